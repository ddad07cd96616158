"""The eleventh hostile pass's low leftovers, ids from its report in brackets: a look-alike host [S2_idn_homoglyph]
or a full-width colon in --host; a `checkpoints` link in an output directory [LK04]; `build_data.enabled` given to
the sft stage run alone [P41b]; messages naming a setting the stage lacks [U09] or a command that does not take the
form [P41]; a 0-byte image told to convert [I04]; `extends:` a URL [P_p27_url]; a gzipped sft.jsonl beside a
missing one [D26]; a raw lake given as --clean-data [B24]; `qvl stage sft_data` unknown."""

from __future__ import annotations

import re
import tarfile

import pytest
from typer.testing import CliRunner


@pytest.mark.parametrize(
    ("host", "named"),
    [
        ("https://kubefl\u043ew.example.com", "U+043E CYRILLIC SMALL LETTER O"),  # reads as kubeflow.example.com
        ("https\uff1a//kubeflow.example.com", "U+FF1A FULLWIDTH COLON"),
    ],
)
def test_a_host_with_a_character_outside_ascii_is_refused_before_the_token_is_sent(host, named):
    from pipelines.submit import SubmitError, check_host

    with pytest.raises(SubmitError, match=rf"\({re.escape(named)}\), not an ASCII character: it can read as another"):
        check_host(host)
    check_host("https://xn--kubefl-7wf.example.com")  # the punycode form of an IDN host is given as such


def test_a_checkpoints_link_in_the_output_directory_is_refused(tmp_path):
    from components._shared.launch.cli import _check_owner

    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=r"holds 'checkpoints' as a symbolic link \(to '.*precious'\)"):
        _check_owner(str(out), "sft")
    (out / "checkpoints").unlink()
    (out / "checkpoints").mkdir()  # a killed run's own checkpoints: resumed
    _check_owner(str(out), "sft")


def test_build_data_enabled_on_the_sft_stage_alone_is_said(tmp_path, capsys):
    from components.sft.build_data import DROPPED
    from components.sft.config import SftConfig
    from components.sft.stage import say_unbuilt

    say_unbuilt(SftConfig.model_validate({"build_data": {"enabled": True}}), "given", tmp_path)
    assert "warning: build_data.enabled is true but --data given is not the sft_data step's output" in (
        capsys.readouterr().out
    )
    (tmp_path / DROPPED).write_text("")  # the step's output: trained on as built
    say_unbuilt(SftConfig.model_validate({"build_data": {"enabled": True}}), "built", tmp_path)
    say_unbuilt(SftConfig(), "given", tmp_path.parent)
    assert capsys.readouterr().out == ""


def test_an_unwritable_output_names_the_setting_of_what_was_written(tmp_path):
    from components._shared.platform.locks import LocalLock, OutputUnusable, holder

    (tmp_path / "file").write_text("")
    with pytest.raises(OutputUnusable, match=r"choose a writable --output-dir, or fix"):  # clean_data has no train
        LocalLock(tmp_path / "file" / "out", holder=holder("output"))
    with pytest.raises(OutputUnusable, match=r"choose a writable train.checkpoint_uri, or fix"):
        LocalLock(tmp_path / "file" / "ckpt", holder=holder("checkpoints"))


def test_a_prefixed_override_on_a_stage_names_the_command_that_takes_it(tmp_path, capsys):
    from components.clean_data.stage import main

    (tmp_path / "lake").mkdir()
    with pytest.raises(SystemExit):
        main(["--lake", str(tmp_path / "lake"), "--output-dir", str(tmp_path / "out"), "clean_data.min_side=8"])
    assert "leave out the 'clean_data.' prefix (that form is qvl submit's)." in capsys.readouterr().err


def test_an_empty_image_is_told_to_be_fetched_again_not_converted(tmp_path):
    from components._shared.data.image_checks import probe_image

    (tmp_path / "e.jpg").write_bytes(b"")
    (tmp_path / "p.jpg").write_text("<html><body>404</body></html>")
    for name in ("e.jpg", "p.jpg"):
        message = probe_image(tmp_path, name)
        assert message.endswith("; fetch the image again or drop the record") and "convert" not in message


def test_extends_a_url_is_refused_as_such(tmp_path):
    from pipelines.presets import load_preset

    (tmp_path / "p.yaml").write_text("extends: https://example.com/presets/tiny.yaml\n")
    with pytest.raises(ValueError, match=r"extends: 'https://example.com/presets/tiny.yaml' is a URL; .*nothing is"):
        load_preset(tmp_path / "p.yaml")


def test_a_raw_lake_given_as_clean_data_is_named(tmp_path):
    from components._shared.data.kept_records import load_kept

    with tarfile.open(tmp_path / "shard-000000.tar", "w"):
        pass
    with pytest.raises(ValueError, match=r"\['shard-000000.tar'\], a raw lake's shards: run clean_data on it first"):
        load_kept(tmp_path, None)


def test_qvl_stage_runs_the_sft_data_step_and_lists_it():
    from pipelines.qvl.app import app

    runner = CliRunner()
    helped = runner.invoke(app, ["stage", "sft_data", "--help"])
    assert helped.exit_code == 0 and "--clean-data" in helped.output
    unknown = runner.invoke(app, ["stage", "sft_dat"])
    assert unknown.exit_code == 2 and "steps: sft_data." in unknown.output


def test_a_compressed_copy_beside_a_missing_data_file_is_named(tmp_path):
    from components._shared.data.containers import iter_file

    (tmp_path / "sft.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(ValueError, match=r"sft.jsonl does not exist; 'sft.jsonl.gz' does, compressed \(gunzip it"):
        list(iter_file(tmp_path / "sft.jsonl"))
