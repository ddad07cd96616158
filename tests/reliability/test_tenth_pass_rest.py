"""The tenth hostile pass's cases its stop left (all low or unclear): each now refused or said plainly.

Ids from its report (/work/notes/pass10.md) in brackets: a slash look-alike in a path [CL23], a truncated JPEG holding
a thumbnail [t_trunc_thumb], a file named in another case [Y03], a preset or `extends:` that is a device or a pipe
[F_preset_zero, P14, P15], a token echoed by click's own usage errors [K02, K08c], a variation selector in --host
[S04], a committed file edited in place through a hard link [HL1].
"""

from __future__ import annotations

import io
import os
import random
import re
import sys

import pytest
from PIL import Image
from typer.testing import CliRunner

from components._shared.platform import storage
from pipelines.qvl.app import app, main

runner = CliRunner()
TOKEN = "hf_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefgh"


def _main(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of the `qvl` console script run with `argv`."""
    monkeypatch.setattr(sys, "argv", ["qvl", *argv])
    with pytest.raises(SystemExit) as ended:
        main()
    out = capsys.readouterr()
    return int(ended.value.code or 0), out.out + out.err


@pytest.mark.parametrize(
    ("char", "name"),
    [
        ("\uff0f", "FULLWIDTH SOLIDUS (U+FF0F)"),
        ("\u2215", "DIVISION SLASH (U+2215)"),
        ("\u2044", "FRACTION SLASH (U+2044)"),
        ("\u29f8", "BIG SOLIDUS (U+29F8)"),
        ("\u2571", "BOX DRAWINGS LIGHT DIAGONAL UPPER RIGHT TO LOWER LEFT (U+2571)"),
    ],
)
def test_a_slash_look_alike_in_a_path_is_refused_naming_it(char, name):  # [CL23]
    for value in (f"/tmp/runs/a{char}b", f"s3://bucket/lake{char}x"):
        with pytest.raises(ValueError, match=rf"--out=.* holds {re.escape(name)}, drawn as '/' but a letter") as err:
            storage.check_location(value, "--out")
        assert "write '/' itself" in str(err.value)
    assert storage.check_location("/tmp/runs/a/b", "--out") == "/tmp/runs/a/b"


def test_a_slash_look_alike_in_out_stops_the_command(monkeypatch, capsys, tmp_path):  # [CL23]
    code, said = _main(monkeypatch, capsys, "lake", "synth", "--records", "5", "--out", f"{tmp_path}/a\uff0fb")
    assert code == 2 and "--out=" in said and "FULLWIDTH SOLIDUS (U+FF0F)" in said
    assert list(tmp_path.iterdir()) == []


def _jpeg_with_thumbnail(where: str) -> bytes:
    """A 400x400 JPEG of noise holding a whole 16x16 JPEG in a COM or an APP1 (EXIF-like) segment."""
    rnd = random.Random(0)
    image = Image.new("RGB", (400, 400))
    image.putdata([(rnd.randrange(256), rnd.randrange(256), rnd.randrange(256)) for _ in range(400 * 400)])
    thumb = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(thumb, "JPEG")
    out = io.BytesIO()
    extra = {"comment": thumb.getvalue()} if where == "COM" else {"exif": b"Exif\0\0" + thumb.getvalue()}
    image.save(out, "JPEG", **extra)
    assert thumb.getvalue() in out.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("where", ["COM", "APP1"])
def test_a_truncated_jpeg_holding_a_thumbnail_is_a_bad_record(tmp_path, where):  # [t_trunc_thumb]
    from components._shared.data.image_checks import probe_image

    whole = _jpeg_with_thumbnail(where)
    (tmp_path / "cut.jpg").write_bytes(whole[: len(whole) * 6 // 10])
    said = probe_image(tmp_path, "cut.jpg")
    assert said is not None and said.startswith("image 'cut.jpg' is truncated: its JPEG data ends before")
    assert "fetch it again or drop the record" in said
    (tmp_path / "whole.jpg").write_bytes(whole)
    (tmp_path / "motion.jpg").write_bytes(whole + os.urandom(70_000))  # data after the image (a motion photo)
    assert probe_image(tmp_path, "whole.jpg") is None and probe_image(tmp_path, "motion.jpg") is None


def test_a_file_named_in_another_case_is_said(tmp_path):  # [Y03]
    from components._shared.data.containers import iter_file
    from components._shared.data.image_checks import probe_image
    from components._shared.data.manifest import manifest

    (tmp_path / "sft.jsonl").write_text("")
    with pytest.raises(ValueError, match="SFT.jsonl does not exist as spelled; 'sft.jsonl' does: the same letters in"):
        list(iter_file(tmp_path / "SFT.jsonl"))
    with pytest.raises(ValueError, match=r"another case \(retype the name\); name a file inside the data directory"):
        list(iter_file(tmp_path / "SFT.jsonl"))
    with pytest.raises(ValueError, match=r"nothere.jsonl does not exist; name a file inside the data directory"):
        list(iter_file(tmp_path / "nothere.jsonl"))
    (tmp_path / "Images").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "Images" / "Cat.png")
    said = probe_image(tmp_path, "Images/cat.png")
    assert said is not None and "(a file 'Cat.png' looks the same but is written in another case: rename one)" in said
    (tmp_path / "dataset.yaml").write_text("sft: [{path: sft.jsonl, images: images}]\n")
    with pytest.raises(ValueError, match="images: 'images' does not exist as spelled; 'Images' does: the same letters"):
        manifest(tmp_path)


def test_a_preset_that_is_a_device_or_a_pipe_is_named_as_such(tmp_path, monkeypatch, capsys):  # [F_preset_zero]
    from pipelines.presets import load_preset

    os.mkfifo(tmp_path / "fifo.yaml")
    for given in ("/dev/zero", str(tmp_path / "fifo.yaml")):
        with pytest.raises(ValueError, match=rf"{given} is not a regular file \(a pipe or a device\); give the YAML"):
            load_preset(given)
    code, said = _main(monkeypatch, capsys, "plan", "--preset", "/dev/zero")
    assert code == 2 and "/dev/zero is not a regular file (a pipe or a device)" in said
    assert "Unknown preset" not in said


@pytest.mark.parametrize("parent", ["fifo.yaml", "/dev/zero"])
def test_extends_naming_a_device_or_a_pipe_is_named_as_such(tmp_path, parent):  # [P14, P15]
    from components._shared.platform.presets import read_preset_yaml

    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "mine.yaml").write_text(f"extends: {parent}\nsft: {{seed: 1}}\n")
    names = str(tmp_path / parent) if parent == "fifo.yaml" else parent
    said = rf"mine.yaml: extends '{parent}', which names '{names}': not a regular file \(a pipe or a device\)\."
    with pytest.raises(ValueError, match=said):
        read_preset_yaml(tmp_path / "mine.yaml")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["plan", "--preset", "tiny", f"sft.{TOKEN}=1"], "Got unexpected extra argument"),
        (["compile", "--preset", "tiny", "--out", "OUT", f"sft.{TOKEN}=1"], "Got unexpected extra argument"),
        (["lake", TOKEN], "No such command"),
        (["plan", f"--{TOKEN}=1"], "No such option"),
        ([f"--{TOKEN}", "plan"], "No such option"),
    ],
)
def test_a_token_in_an_argument_click_refuses_is_hidden(tmp_path, argv, said):  # [K02, K08c]
    argv = [str(tmp_path / "k.yaml") if a == "OUT" else a for a in argv]
    result = runner.invoke(app, argv, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and said in result.output
    assert TOKEN not in result.output and "<a credential, hidden>" in result.output
    assert not (tmp_path / "k.yaml").exists()


def test_a_character_that_draws_nothing_in_host_is_named(monkeypatch):  # [S04]
    from pipelines.submit import SubmitError, check_host

    with pytest.raises(SubmitError, match=r"holds '\\ufe0f' at character 18 \(U\+FE0F VARIATION SELECTOR-16: a space"):
        check_host("http://127.0.0.1:9\ufe0f")
    with pytest.raises(SubmitError, match=r"U\+17B4 KHMER VOWEL INHERENT AQ.*retype it as scheme://HOST"):
        check_host("http://kfp.exa\u17b4mple.com")
    monkeypatch.setenv("KFP_TOKEN", "abcdef123456")
    args = ["submit", "--preset", "tiny", "--experiment", "vlm", "--host", "http://127.0.0.1:9\ufe0f"]
    result = runner.invoke(app, [*args, "lake_uri=s3://bucket/lake"])
    assert result.exit_code == 2 and "U+FE0F VARIATION SELECTOR-16" in result.output
    assert "the port must be a number" not in result.output


def test_a_committed_file_edited_through_a_hard_link_says_so(tmp_path):  # [HL1]
    given, out = tmp_path / "given", tmp_path / "out"
    given.mkdir()
    out.mkdir()
    (given / "eval.jsonl").write_text('{"answer": "yellow"}\n')
    os.link(given / "eval.jsonl", out / "eval.jsonl")  # as the SFT builder carries the data it was given
    (out / "sft.jsonl").write_text('{"answer": "red"}\n')
    storage.commit_dir(out)
    with open(given / "eval.jsonl", "r+") as handle:  # an editor writing in place (vim keeps hard links)
        handle.write('{"answer": "Yellow"}\n')
    with pytest.raises(storage.IntegrityError) as err:
        storage.verify_dir(out)
    assert str(err.value) == (
        f"{out / 'eval.jsonl'} does not match _COMMITTED.json (missing, truncated or modified); it has 1 other hard "
        f"link: a file linked elsewhere was edited in place; re-run the stage that produced {out}."
    )
    os.link(given / "eval.jsonl", tmp_path / "third.jsonl")
    with pytest.raises(storage.IntegrityError, match="it has 2 other hard links: a file linked elsewhere"):
        storage.verify_dir(out)
    os.unlink(out / "eval.jsonl")
    with pytest.raises(storage.IntegrityError) as err:
        storage.verify_dir(out)
    assert "hard link" not in str(err.value) and "(missing, truncated or modified); re-run the stage" in str(err.value)
