"""The ninth hostile pass's cases the last stop left (all low): each now refused or said plainly.

Ids from its report in brackets: lake synth --real options [L07, M07], invisible characters in paths and URI
parameters [M06, SP4], run directories inside an uncommitted stage output [R02], invisible answers [e_answer_zwsp], a
model's confidence temperature [K10v], interrupted runs [M02], region boxes checked at preflight [RG01], a damaged
newest checkpoint [CK01], and the unclear messages [K08, C07, E06, R09, R14 (tests/unit/test_cli.py), S16,
Y_images_nfd, PB_fifo]. The faint image [t_alpha3] is in tests/reliability/test_seventh_pass.py.

The tenth pass (230 cases) checked those and found more, fixed here too (ids marked "tenth"): checkpoints pruned after
a damaged resume [CK1, CK4], JSON nested past the parser [DJ10, MN07, DJ3, DJ6, DJ9], self-holding YAML aliases [P07,
P12, P13], a token in a submit override key [K07, K11, K13], the region sample across shards [PF01, PF02, PF04], a
step writing into its stage's output [BG11], characters that draw nothing [e_answer_*, r_answer_tag, r_id_rlo, CL01,
CL03, S07, BD_nc_zwsp], dot parts in s3 keys [CL12, CL20, S02, S03], links into a committed model [T04], comparing an
unfinished run [RN02]; the builder's own cases are in tests/unit/test_sft_data_builder.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from components._shared.platform import storage
from pipelines.qvl.app import app

runner = CliRunner()


def test_lake_synth_real_refuses_the_synthetic_worlds_options(tmp_path):  # [L07, M07]
    result = runner.invoke(
        app, ["lake", "synth", "--real", "--records", "5", "--seed", "3", "--out", str(tmp_path / "w")]
    )
    assert result.exit_code == 2
    assert "--records, --seed shape the synthetic world; --real writes the fixed real-format set" in result.output
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("/tmp/world\n", "holds a control character"),
        ("s3://bucket/lake\u200b", "holds an invisible formatting character (ZERO WIDTH SPACE)"),
        (" /tmp/world", "begins or ends with white space"),
    ],
)
def test_paths_and_uris_holding_what_a_listing_hides_are_refused(value, said):  # [M06, SP4]
    with pytest.raises(ValueError, match=rf"--out=.* {re.escape(said)}"):
        storage.check_location(value, "--out")
    storage.check_location("/tmp/my data/world", "--out")  # a space inside a name is a name


def test_a_run_directory_inside_an_uncommitted_stage_output_is_refused(tmp_path):  # [R02]
    from pipelines.qvl.local_run import check_run_dir

    failed = tmp_path / "sft"
    failed.mkdir()
    (failed / "_stage_result.json").write_text('{"status": "failed"}')
    with pytest.raises(ValueError, match=r"--out .*sft/sub lies inside .*sft, a stage's output, not committed"):
        check_run_dir(failed / "sub")


@pytest.mark.parametrize("answer", ["\u200b", "\u2060\ufeff", " \u200d "])
def test_an_answer_of_invisible_characters_is_empty(answer):  # [e_answer_zwsp]
    from components._shared.data import formats as F
    from components._shared.data.formats import RecordError

    with pytest.raises(RecordError, match=r"the answer is empty \(nothing visible\)"):
        F.question({"image": "a.png", "question": "<image>What colour?", "answer": answer})
    assert F.question({"image": "a.png", "question": "<image>What colour?", "answer": "red\u200b"})["answers"]


@pytest.mark.parametrize("value", [float("nan"), 0, -1.0, 11.0, "2", True])
def test_a_model_whose_confidence_temperature_is_not_a_temperature_is_refused(tmp_path, value):  # [K10v]
    from components._shared.model.vlm import check_model_notes

    (tmp_path / "qvl_model.json").write_text(json.dumps({"confidence_temperature": value}))
    with pytest.raises(ValueError, match=r"confidence_temperature is .*; sft writes a number from 0.5 to 10"):
        check_model_notes(tmp_path, "mymodel")
    (tmp_path / "qvl_model.json").write_text(json.dumps({"confidence_temperature": 1.25, "other": "kept"}))
    check_model_notes(tmp_path, "mymodel")


def test_an_interrupted_run_is_listed(tmp_path):  # [M02]
    from pipelines.qvl.runs import find_runs

    done = tmp_path / "done"
    done.mkdir()
    (done / "run_summary.json").write_text(json.dumps({"status": "succeeded", "stages": {}}))
    killed = tmp_path / "killed"
    for sub in ("logs", "progress", "pipeline_root"):
        (killed / sub).mkdir(parents=True)
    statuses = {run.path.name: run.summary["status"] for run in find_runs(tmp_path)}
    assert statuses == {"done": "succeeded", "killed": "no summary (running, or stopped before it finished)"}
    from pipelines.qvl.runs import read_run

    with pytest.raises(ValueError, match=r"a run without a run_summary.json \(still running"):  # [tenth: RN02]
        read_run(killed)


def _shard(path: Path, chunks: list | None) -> None:
    from PIL import Image

    with tarfile.open(path, "w") as tar:
        for i in range(3):
            image = io.BytesIO()
            Image.new("RGB", (32, 32), (200, 20 * i, 0)).save(image, format="JPEG")
            meta = {"caption": "a red circle"} | ({"noun_chunks": chunks} if chunks is not None else {})
            for suffix, data in ((".jpg", image.getvalue()), (".txt", b"a red circle"), (".json", json.dumps(meta))):
                raw = data.encode() if isinstance(data, str) else data
                info = tarfile.TarInfo(f"{i:09d}{suffix}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))


def test_preflight_refuses_a_lake_without_region_boxes_when_the_region_term_is_on(tmp_path):  # [RG01]
    from components.preflight.lake_regions import check_lake_regions

    bare, boxed, broken = tmp_path / "bare", tmp_path / "boxed", tmp_path / "broken"
    for lake, chunks in ((bare, None), (boxed, [[2, 12, 0.1, 0.1, 0.6, 0.6, 0.9]]), (broken, [[2, 12, 0.6, 0.1]])):
        lake.mkdir()
        _shard(lake / "00000.tar", chunks)
    with pytest.raises(ValueError, match=r"none of the first 3 records of the lake \(00000.tar\) has a usable box "):
        check_lake_regions(str(bare), 0.0)
    with pytest.raises(ValueError, match=r"3 chunk\(s\) malformed"):
        check_lake_regions(str(broken), 0.0)
    assert check_lake_regions(str(boxed), 0.0) == 1  # stops at the first usable box
    with pytest.raises(ValueError, match=r"3 chunk\(s\) score under region.min_score"):
        check_lake_regions(str(boxed), 0.95)
    (bare / "00001.tar").write_bytes((boxed / "00000.tar").read_bytes())  # boxes in the second shard [tenth: PF01]
    assert check_lake_regions(str(bare), 0.0) == 1
    (boxed / "00000.tar").rename(boxed / "00001.tar")
    (boxed / "00000.tar").write_bytes(b"")  # an empty first shard is passed over [tenth: PF02, PF04]
    assert check_lake_regions(str(boxed), 0.0) == 1


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(tmp_path, capsys):  # [CK01]
    from components._shared.model.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path / "checkpoints", keep=3)
    for step in (500, 550):
        staging = store.staging_dir(step)
        (staging / "state.json").write_text(json.dumps({"step": step}))
        store.commit(staging, step)
    newest = Path(store.committed()[-1])
    (newest / "state.json").write_text(json.dumps({"step": 999}))
    resumed = store.newest_intact()
    assert resumed is not None and json.loads((resumed / "state.json").read_text()) == {"step": 500}
    said = capsys.readouterr().out
    assert f"checkpoint {newest} is damaged (" in said and "re-run the stage" not in said
    assert (tmp_path / "checkpoints.stale-damaged-step-0000550" / "state.json").is_file()  # kept, out of the root
    (resumed / "state.json").write_text("{}")
    assert store.newest_intact() is None  # none intact: training starts over, said
    assert "no earlier checkpoint: training from step 0" in capsys.readouterr().out
    for step in (50, 100, 150):  # the new checkpoints are kept: nothing damaged is counted by the pruning [tenth: CK1]
        staging = store.staging_dir(step)
        (staging / "state.json").write_text(json.dumps({"step": step}))
        store.commit(staging, step)
    assert [Path(u).name for u in store.committed()] == ["step-0000050", "step-0000100", "step-0000150"]


def test_the_stage_cli_names_a_config_that_is_a_presets_name(tmp_path):  # [C07]
    from components._shared.launch.cli import _check_options

    args = type("Args", (), {"config": "tiny", "config_json": None, "experiment": None})()
    with pytest.raises(ValueError, match=r"--config tiny does not exist; .*--config pipelines/presets/tiny.yaml"):
        _check_options(args)


def test_a_stage_output_given_as_data_is_named(tmp_path):  # [E06]
    from components._shared.data.containers import iter_file

    (tmp_path / "_COMMITTED.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is a stage's output \(it holds _COMMITTED.json\), not a data directory"):
        list(iter_file(tmp_path / "sft.jsonl"))


def test_an_images_folder_in_another_unicode_form_is_named_once(tmp_path):  # [Y_images_nfd]
    from components._shared.data.manifest import manifest

    (tmp_path / "imagin\u00e9s").mkdir()
    (tmp_path / "sft.jsonl").write_text("")
    (tmp_path / "dataset.yaml").write_text('sft: [{path: sft.jsonl, images: "imagine\u0301s"}]\n', encoding="utf-8")
    said = re.escape("images: 'imagine\\u0301s' does not exist as spelled; 'imagin\\xe9s' does")
    with pytest.raises(ValueError, match=said):
        manifest(tmp_path)
    (tmp_path / "dataset.yaml").write_text("sft: [{path: sft.jsonl, images: pictures}]\n")
    with pytest.raises(ValueError, match=r"images: 'pictures' does not exist in"):
        manifest(tmp_path)


def test_submit_refuses_a_poll_interval_that_is_not_a_number(tmp_path):  # [S16]
    args = ["submit", "--wait", "--poll-interval", "nan", "--host", "http://localhost:1", "--experiment", "e"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "--poll-interval nan: give a number of seconds (at least 0.01)" in result.output


def test_published_names_a_summary_that_is_a_pipe(tmp_path):  # [PB_fifo]
    from pipelines.qvl import published

    os.mkfifo(tmp_path / "run_summary.json")
    with pytest.raises(SystemExit, match="is not a regular file"):
        published.main([str(tmp_path), "machine"])


@pytest.mark.parametrize("reader", ["lake", "config.json", "qvl_model.json", "stage result", "world.json"])
def test_json_nested_past_the_parser_is_refused_not_a_traceback(tmp_path, reader):  # [tenth: DJ10, MN07, DJ3, DJ6, DJ9]
    deep = "[" * 100_000 + "]" * 100_000
    if reader == "lake":
        from components._shared.data.lake import _parse_metadata

        assert _parse_metadata(deep.encode()) == {"metadata_error": "invalid JSON: nested too deeply to read"}
    elif reader == "config.json":
        from components._shared.model.sources import _check_readable

        (tmp_path / "config.json").write_text(deep)
        with pytest.raises(ValueError, match="nested too deeply to be a model config"):
            _check_readable(tmp_path)
    elif reader == "qvl_model.json":
        from components._shared.model.vlm import check_model_notes

        (tmp_path / "qvl_model.json").write_text(deep)
        with pytest.raises(ValueError, match="nested too deeply"):
            check_model_notes(tmp_path, "mymodel")
    elif reader == "stage result":
        from components._shared.launch.cli import _check_owner

        (tmp_path / "_stage_result.json").write_text(deep)
        _check_owner(str(tmp_path), "sft")  # not a result qvl writes: no owner to refuse for
    else:
        from pipelines.qvl.out_targets import check_world_dir

        (tmp_path / "world.json").write_text(deep)
        with pytest.raises(ValueError, match="holds files that are not a synthetic world's"):
            check_world_dir(tmp_path)


def test_a_step_does_not_write_into_its_stages_committed_output(tmp_path):  # [tenth: BG11]
    from components._shared.launch.cli import _check_owner

    (tmp_path / "_stage_result.json").write_text(json.dumps({"stage": "sft"}))
    with pytest.raises(ValueError, match="holds a sft output"):
        _check_owner(str(tmp_path), "sft_data")
    _check_owner(str(tmp_path), "sft")  # the stage's own earlier output: resumed


@pytest.mark.parametrize("text", ["a: &x {b: *x}", "sft: {curriculum: &c [{name: all, steps: 8, difficulties: *c}]}"])
def test_a_yaml_alias_that_holds_itself_is_refused(text):  # [tenth: P07, P12, P13]
    from components._shared.platform import strict_yaml
    from components._shared.platform.presets import parse_overrides

    with pytest.raises(ValueError, match="an alias refers to the mapping or list that holds it"):
        strict_yaml.load(text, "preset.yaml")
    with pytest.raises(ValueError, match="an alias refers to the mapping or list that holds it"):
        parse_overrides(["sft.lora=&a {r: 8, x: *a}"])
    assert strict_yaml.load("a: &x [1]\nb: *x", "ok.yaml") == {"a": [1], "b": [1]}  # an alias used twice is fine


def test_submit_hides_a_token_in_an_override_key(tmp_path, monkeypatch):  # [tenth: K07, K11, K13]
    monkeypatch.setenv("KFP_TOKEN", "abcdef123456")
    token = "ghp_16C7e42F292c6912E7710c838347Ae178B4a"
    args = ["submit", "--preset", "tiny", "lake_uri=s3://bucket/lake", "--experiment", "vlm"]
    result = runner.invoke(app, [*args, "--host", "http://127.0.0.1:9", f"sft.optim.{token}=1"])
    assert result.exit_code == 2 and "unknown setting" in result.output
    assert token not in result.output and "<a credential, hidden>" in result.output


@pytest.mark.parametrize("text", ["\ufe0f", "\u17b4\u17b5", "\u2800", "\u3164"])
def test_answers_of_characters_that_draw_nothing_are_empty(text):  # [tenth: e_answer_vs16, _khmer, _braille, _hangul]
    from components._shared.data import formats as F
    from components._shared.data.formats import RecordError

    with pytest.raises(RecordError, match=r"the answer is empty \(nothing visible\)"):
        F.question({"image": "a.png", "question": "<image>What colour?", "answer": text})


def test_tag_characters_in_text_and_direction_overrides_in_ids_are_refused():  # [tenth: r_answer_tag, r_id_rlo]
    from components._shared.data.formats import RecordError
    from components._shared.data.record_ids import check_ids
    from components._shared.data.text_checks import check_text

    with pytest.raises(RecordError, match="a Unicode tag character U\\+E0069"):
        check_text("green cross\U000e0069\U000e0067", "answer")
    with pytest.raises(RecordError, match="holds an invisible formatting character \\(RIGHT-TO-LEFT OVERRIDE\\)"):
        check_ids({"id": "sft-\u202e00000"})
    check_ids({"id": "sft-00000"})


def test_a_phrase_of_invisible_characters_names_no_region():  # [tenth: BD_nc_zwsp]
    from components._shared.data.regions import EMPTY, record_regions

    caption = "An image of a \u200b\u200b\u200b thing."
    record = {"caption": caption, "metadata": json.dumps({"noun_chunks": [[14, 17, 0.1, 0.1, 0.5, 0.5, 0.9]]})}
    assert record_regions(record, 0.0) == ([], [EMPTY])


@pytest.mark.parametrize("value", ["s3://bucket/a/../lake", "s3://bucket/./lake"])
def test_s3_keys_with_dot_parts_are_refused(value):  # [tenth: CL12, CL20, S02, S03]
    with pytest.raises(ValueError, match=r"the key holds a '\.{1,2}' part, which S3 keeps as written"):
        storage.check_location(value, "--lake")


@pytest.mark.parametrize("char", ["\ufe0f", "\u17b4"])
def test_marks_that_draw_nothing_are_refused_in_paths(char):  # [tenth: CL01, CL03, S07]
    with pytest.raises(ValueError, match="a character that draws nothing"):
        storage.check_location(f"/tmp/run{char}s", "--out")


def test_a_folder_of_links_into_a_committed_model_is_verified(tmp_path):  # [tenth: T04]
    from components._shared.launch.runner import verify_inputs

    out = tmp_path / "sft"
    (out / "model").mkdir(parents=True)
    (out / "model" / "model.safetensors").write_bytes(b"weights" * 100)
    (out / "model" / "config.json").write_text("{}")
    (out / "_stage_result.json").write_text("{}")
    storage.commit_dir(out)
    snapshot = tmp_path / "hf-cache" / "snapshot"
    snapshot.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (snapshot / name).symlink_to(out / "model" / name)
    assert verify_inputs({"base_model": str(snapshot)}) == 1
    (out / "model" / "model.safetensors").write_bytes(b"flipped" * 100)
    with pytest.raises(storage.IntegrityError, match="model.safetensors does not match"):
        verify_inputs({"base_model": str(snapshot)})
