"""The ninth hostile pass's cases the last stop left (all low): each now refused or said plainly.

Ids from its report in brackets: lake synth --real options [L07, M07], invisible characters in paths and URI
parameters [M06, SP4], run directories inside an uncommitted stage output [R02], invisible answers [e_answer_zwsp], a
model's confidence temperature [K10v], interrupted runs [M02], region boxes checked at preflight [RG01], a damaged
newest checkpoint [CK01], and the unclear messages [K08, C07, E06, R09, R14 (tests/unit/test_cli.py), S16,
Y_images_nfd, PB_fifo]. The faint image [t_alpha3] is in tests/reliability/test_seventh_pass.py.
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
    with pytest.raises(ValueError, match=r"none of the first 3 records of .*00000.tar has a usable box \(none carries"):
        check_lake_regions(str(bare), 0.0)
    with pytest.raises(ValueError, match=r"3 chunk\(s\) malformed"):
        check_lake_regions(str(broken), 0.0)
    assert check_lake_regions(str(boxed), 0.0) == 3
    with pytest.raises(ValueError, match=r"3 chunk\(s\) score under region.min_score"):
        check_lake_regions(str(boxed), 0.95)


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
    assert f"checkpoint {newest} is damaged and is not resumed" in capsys.readouterr().out
    (resumed / "state.json").write_text("{}")
    assert store.newest_intact() is None  # none intact: training starts over, said
    assert "no earlier checkpoint: training from step 0" in capsys.readouterr().out


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
