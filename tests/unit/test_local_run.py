"""`qvl run --local`'s own guards, before kfp.local starts any task."""

import subprocess
import sys

import pytest

from components._shared.platform import locks


def test_a_second_run_into_the_same_directory_is_refused_before_it_clears_anything(tmp_path):
    """A second `qvl run --local --out OUT` deleted the first run's logs, stage results and progress, and its
    failed preflight went into the first run's summary."""
    from pipelines.qvl.local_run import run_local

    out, lake = tmp_path / "out", tmp_path / "lake"  # the lake is never read: the lock refuses first
    lake.mkdir()
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "sft.log").write_text("the first run's log")
    first = "from components._shared.platform import locks; import sys, time\n"
    first += "with locks.scope():\n    locks.hold(sys.argv[1], purpose='qvl run --local')\n"
    first += "    print('held', flush=True); time.sleep(120)\n"
    holder = subprocess.Popen([sys.executable, "-c", first, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the first run, still going
        with pytest.raises(locks.LockHeld, match=r"qvl run --local"):
            run_local(lake_uri=str(lake), out_dir=out, until="clean_data")
    finally:
        holder.kill()
        holder.wait()
    assert (out / "logs" / "sft.log").read_text() == "the first run's log"


def test_an_empty_tracking_uri_is_the_runs_own_store(tmp_path, monkeypatch):
    """An empty MLFLOW_TRACKING_URI (an exported empty shell variable) sent every stage to ./mlflow.db."""
    from pipelines.qvl import local_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", " ")
    seen = {}

    def fake_start(experiment, run_name, tags):
        import os

        seen["uri"] = os.environ["MLFLOW_TRACKING_URI"]
        raise RuntimeError("stop here")

    monkeypatch.setattr("components._shared.platform.mlflow_runs.start_pipeline_run", fake_start)
    (tmp_path / "lake").mkdir()  # never read: the run stops before preflight
    with pytest.raises(RuntimeError, match="stop here"):
        local_run.run_local(lake_uri=str(tmp_path / "lake"), out_dir=tmp_path / "out", until="clean_data")
    assert seen["uri"].startswith("sqlite:///") and seen["uri"].endswith(f"{tmp_path}/out/mlflow.db")
