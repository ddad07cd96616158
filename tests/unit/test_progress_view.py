"""The progress of `qvl run --local`: stages' progress files, the console view (line and live modes), task logs."""

import io
import json
import os
import sys
from pathlib import Path

import pytest

from components._shared.platform import progress
from pipelines.qvl.local_run import _task_logs
from pipelines.qvl.progress_view import ProgressView, merged_progress, stage_of


@pytest.fixture
def run_dirs(tmp_path, monkeypatch):
    dirs = {name: tmp_path / name for name in ("progress", "stage_results", "logs")}
    for directory in dirs.values():
        directory.mkdir()
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(dirs["progress"]))
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 0.0)
    return dirs


def _view(dirs, stream, live=False):
    return ProgressView(
        ["preflight", "clean_data", "sft"],
        stream=stream,
        live=live,
        progress_dir=dirs["progress"],
        results_dir=dirs["stage_results"],
    )


def test_updates_are_written_only_inside_a_stage_and_only_by_rank_zero(run_dirs, monkeypatch):
    progress.update("train", 1, 10, "steps")  # no stage named: nothing
    assert progress.read_all(run_dirs["progress"]) == []
    with progress.stage_scope("sft"):
        progress.update("train", 3, 10, "steps", loss=1.5)
        monkeypatch.setenv("RANK", "1")
        progress.update("train", 9, 10, "steps")  # another rank: ignored
    (record,) = progress.read_all(run_dirs["progress"])
    assert (record["stage"], record["phase"], record["done"], record["total"], record["loss"]) == (
        "sft",
        "train",
        3,
        10,
        1.5,
    )
    assert (run_dirs["progress"] / f"sft-{os.getpid()}.json").is_file()


def test_updates_are_throttled_but_a_finished_phase_always_lands(run_dirs, monkeypatch):
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 3600.0)
    with progress.stage_scope("pretrain"):
        progress.update("train", 1, 4, "steps")
        progress.update("train", 2, 4, "steps")  # within the interval: dropped
        assert progress.read_all(run_dirs["progress"])[0]["done"] == 1
        progress.update("train", 4, 4, "steps")
    assert progress.read_all(run_dirs["progress"])[0]["done"] == 4


def test_shards_of_a_stage_are_summed_over_their_newest_phase():
    records = [
        {"stage": "clean_data", "phase": "score", "done": 10, "total": 40, "unit": "records", "time": 2.0},
        {"stage": "clean_data", "phase": "score", "done": 5, "total": 60, "unit": "records", "time": 3.0},
        {"stage": "clean_data", "phase": "read", "done": 99, "total": None, "unit": "records", "time": 1.0},
        {"stage": "sft", "phase": "train", "done": 1, "total": 2, "unit": "steps", "time": 9.0},
    ]
    merged = merged_progress(records, "clean_data")
    assert (merged["phase"], merged["done"], merged["total"]) == ("score", 15, 100)
    assert merged_progress(records, "rl") is None
    assert [stage_of(t) for t in ("clean_shard_op", "merge_shards_op", "sft_op", "preflight_op")] == [
        "clean_data",
        "clean_data",
        "sft",
        "preflight",
    ]


def test_line_mode_prints_events_milestones_and_the_headline(run_dirs):
    out = io.StringIO()
    view = _view(run_dirs, out)
    view.task_started("sft_op", run_dirs["logs"] / "sft_op.log")
    with progress.stage_scope("sft"):
        for step in range(1, 9):
            progress.update("train", step, 8, "steps", loss=2.0 / step)
            view.poll()
    (run_dirs["stage_results"] / "sft.json").write_text(json.dumps({"metrics": {"vqa_exact_match": 0.459}}))
    view.task_finished("sft_op", 0, run_dirs["logs"] / "sft_op.log")
    lines = out.getvalue().splitlines()
    assert "sft" in lines[0] and "started" in lines[0] and "sft_op.log" in lines[0]
    milestones = [line for line in lines if "train" in line and "steps" in line]
    assert [m.split("train ")[1].split(" ")[0] for m in milestones] == ["2/8", "4/8", "6/8"]  # then the end
    assert "succeeded in" in lines[-1] and lines[-1].endswith("VQA 0.459")
    assert len(lines) == 5


def test_a_failed_task_shows_its_exit_the_last_lines_of_its_log_and_its_path(run_dirs):
    log = run_dirs["logs"] / "sft_op.log"
    log.write_text("\n".join(f"line {i}" for i in range(40)) + "\nValueError: sft.jsonl:3 (id=q3): empty answer\n")
    out = io.StringIO()
    view = _view(run_dirs, out)
    view.task_started("sft_op", log)
    view.task_finished("sft_op", 1, log)
    text = out.getvalue()
    assert "FAILED" in text and "exit 1" in text
    assert "ValueError: sft.jsonl:3 (id=q3): empty answer" in text and "line 39" in text
    assert "line 20" not in text  # only the tail
    assert f"full log: {log}" in text
    assert view.rows["sft"].status == "failed"


def test_a_task_that_failed_on_a_user_error_shows_the_message_not_the_traceback(run_dirs):
    """A bad setting, record or path (recorded by the runner as a user error) is one `error:` line; the traceback
    stays in the log, which the view names."""
    log = run_dirs["logs"] / "sft_op.log"
    log.write_text('Traceback (most recent call last):\n  File "x.py", line 1\nValueError: sft.jsonl:3: empty answer\n')
    record = {"status": "failed", "error": "ValueError: sft.jsonl:3 (id=q3): empty answer", "user_error": True}
    (run_dirs["stage_results"] / "sft.json").write_text(json.dumps(record))
    out = io.StringIO()
    view = _view(run_dirs, out)
    view.task_started("sft_op", log)
    view.task_finished("sft_op", 1, log)
    text = out.getvalue()
    assert "error: sft.jsonl:3 (id=q3): empty answer" in text and f"full log: {log}" in text
    assert "Traceback" not in text and "ValueError" not in text
    (run_dirs["stage_results"] / "sft.json").write_text(json.dumps({**record, "user_error": False}))  # a defect
    view.task_finished("sft_op", 1, log)
    assert "Traceback (most recent call last)" in out.getvalue()


def test_live_mode_draws_one_table_with_every_stage(run_dirs):
    out = io.StringIO()
    with _view(run_dirs, out, live=True) as view:
        view.task_started("clean_shard_op", run_dirs["logs"] / "clean_shard_op.log")
        with progress.stage_scope("clean_data"):
            progress.update("score", 30, 120, "records")
        view.poll()
        view.stage_cached("preflight", {})
        view.task_started("sft_op", run_dirs["logs"] / "sft_op.log")  # a task that runs, then is a cache hit
        view.stage_cached("sft", {"vqa_exact_match": 0.5})
    assert view.rows["sft"].status == "cached" and view.rows["sft"].headline == "VQA 0.5"
    text = out.getvalue()
    for expected in ("preflight", "clean_data", "sft", "cached", "running", "[#####...............] score 30/120"):
        assert expected in text, expected
    assert "started" not in text  # no event lines: the table says it


def test_task_logs_take_a_tasks_output_and_tell_the_view(run_dirs):
    from kfp.local import subprocess_task_handler

    out = io.StringIO()
    view = _view(run_dirs, out)
    script = "import sys; print('executor input ...'); print('boom', file=sys.stderr); sys.exit(3)"
    command = [sys.executable, "-c", script, "--function_to_execute", "sft_op"]
    with _task_logs(run_dirs["logs"], view, echo=None):
        assert subprocess_task_handler.run_local_subprocess(full_command=command, env_vars={"X": "1"}) == 3
        assert subprocess_task_handler.run_local_subprocess(full_command=command) == 3
    assert subprocess_task_handler.run_local_subprocess.__module__ == "kfp.local.subprocess_task_handler"
    log = Path(run_dirs["logs"] / "sft_op.log")
    assert log.read_text().splitlines() == ["executor input ...", "boom"]
    assert (run_dirs["logs"] / "sft_op-2.log").is_file()
    assert "FAILED" in out.getvalue() and "| boom" in out.getvalue()


def test_settings_without_effect_are_shown_under_the_stage_that_had_them(run_dirs):
    out = io.StringIO()
    view = _view(run_dirs, out)
    view.task_started("sft_op", run_dirs["logs"] / "sft_op.log")
    result = {"metrics": {"vqa_exact_match": 0.5}, "ignored_settings": ["sft.train.zero_stage: a DeepSpeed setting"]}
    (run_dirs["stage_results"] / "sft.json").write_text(json.dumps(result))
    view.task_finished("sft_op", 0, run_dirs["logs"] / "sft_op.log")
    lines = out.getvalue().splitlines()
    assert "succeeded in" in lines[-2] and lines[-1] == "        note: sft.train.zero_stage: a DeepSpeed setting"
