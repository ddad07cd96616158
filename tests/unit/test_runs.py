"""`qvl runs`: the runs under a directory with status, time and headline metrics; two runs compared."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from pipelines.qvl.app import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _run_dir(path: Path, *, preset: str, status: str, vqa: float, seconds: float, champion: str, mtime: float):
    stages = {
        "preflight": {"status": "succeeded", "metrics": {}, "seconds": 2.0},
        "clean_data": {"status": "succeeded", "metrics": {"records_kept": 1540, "records_in": 2000}, "seconds": 90.0},
        "sft": {"status": "succeeded", "metrics": {"vqa_exact_match": vqa, "vqa_majority": 0.226}, "seconds": 300.0},
        "select_checkpoint": {"status": status, "metrics": {"selected_stage": champion}, "seconds": 20.0},
    }  # fmt: skip
    path.mkdir(parents=True)
    summary = {"preset": preset, "status": status, "seconds": seconds, "stages": stages}
    (path / "run_summary.json").write_text(json.dumps(summary))
    os.utime(path / "run_summary.json", (mtime, mtime))
    return path


def test_runs_lists_every_run_newest_first_with_headlines_and_an_unreadable_one(tmp_path):
    _run_dir(
        tmp_path / "demo", preset="demo", status="succeeded", vqa=0.451, seconds=842, champion="distill", mtime=2e9
    )
    _run_dir(tmp_path / "old/tiny", preset="tiny", status="failed", vqa=0.1, seconds=120, champion="sft", mtime=1.9e9)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken/run_summary.json").write_text("{not json")
    result = runner.invoke(app, ["runs", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["run", "status", "preset", "min", "finished", "kept", "VQA", "champion"]
    assert lines[1].split()[:4] == ["demo", "succeeded", "demo", "14.0"] and lines[1].split()[-3:] == [
        "1,540",
        "0.451",
        "distill",
    ]
    assert lines[2].split()[:4] == ["old/tiny", "failed", "tiny", "2.0"] and lines[2].split()[-1] == "sft"
    assert lines[3].split()[:2] == ["broken", "unreadable"]  # listed, not skipped


def test_compare_puts_each_metric_side_by_side_with_the_difference(tmp_path):
    a = _run_dir(tmp_path / "a", preset="demo", status="succeeded", vqa=0.431, seconds=900, champion="sft", mtime=1e9)
    b = _run_dir(
        tmp_path / "b", preset="demo", status="succeeded", vqa=0.451, seconds=842, champion="distill", mtime=1e9
    )
    result = runner.invoke(app, ["runs", "--compare", str(a), str(b)])
    assert result.exit_code == 0, result.output
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in result.output.splitlines()[1:]}
    assert rows[("sft", "vqa_exact_match")] == ["0.431", "0.451", "+0.02"]
    assert rows[("sft", "seconds")] == ["300", "300", "+0"]
    assert rows[("select_checkpoint", "selected_stage")] == ["sft", "distill", "changed"]
    assert rows[("clean_data", "records_kept")] == ["1,540", "1,540", "+0"]


def test_runs_without_any_run_or_a_wrong_compare_path_say_what_to_pass(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["runs", str(tmp_path)], ["runs", "--compare", str(tmp_path), str(tmp_path)]):
        done = subprocess.run(
            [sys.executable, "-m", "pipelines.qvl.app", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "run_summary.json" in done.stderr and ("qvl run --local --out" in done.stderr or "--out" in done.stderr)
