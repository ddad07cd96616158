"""`qvl rehearse --preset`: the whole DAG of each production preset at its own settings (sizes, widths and what needs
a cluster cut and declared), on the real-format set of `qvl lake synth --real`, the multi-GPU stages under torchrun
with 2 CPU processes. Each preset takes 8-15 minutes on 2 cores: CI runs them while its budget allows (.ci/run)."""

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.rehearsal
STAGES = ["preflight", "clean_data", "extract_features", "pretrain", "sft", "reward_model", "rl", "distill",
          "select_checkpoint", "promote"]  # fmt: skip
TORCHRUN = {"pretrain", "sft", "reward_model", "rl", "distill"}


@pytest.mark.parametrize("preset", ["prod-7b", "prod-qwen3-vl-8b", "prod-qwen3.5-9b"])
def test_the_whole_dag_runs_at_the_presets_settings(preset, tmp_path):
    cmd = [sys.executable, "-m", "pipelines.qvl.app", "rehearse", "--preset", preset, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2400)
    out = tmp_path / preset
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    table = json.loads((out / "rehearsal.json").read_text())["stages"]
    assert [r["stage"] for r in table] == STAGES
    assert all(r["status"] == "succeeded" for r in table), table
    assert {r["stage"] for r in table if r["processes"] == 2} == TORCHRUN
    for row in table:  # every training stage with its measured peak (the largest process) and the planner's estimate
        assert row["peak_rss_gb"] > 0.3, row
        assert (row["planned_gb"] > 0) == (row["stage"] in TORCHRUN), row
    assert f"rehearsal of preset {preset}" in proc.stdout and "rl " in proc.stdout
    summary = json.loads((out / "run_summary.json").read_text())
    assert (out / "report.html").is_file() and summary["status"] == "succeeded"
    metrics = {stage: summary["stages"][stage]["metrics"] for stage in STAGES if stage != "preflight"}
    assert metrics["clean_data"]["records_in"] == 24  # the real set's lake, every record kept or rejected
    assert metrics["sft"]["steps"] == 3  # prod's basic / advanced / all phases, a step each, on the set's difficulties
    assert metrics["sft"]["mode"] == load_preset(preset).stages["sft"]["mode"]
    rl = metrics["rl"]
    assert rl["algorithm"] == "ppo" and rl["steps"] == 1
    assert rl["ratio_max"] > 1.0 > rl["ratio_min"]  # 4 PPO epochs x 4 minibatches move the policy off its rollouts
    select = metrics["select_checkpoint"]
    weights = load_weights(preset)
    assert {f"selected_{k}" for k in weights} <= set(select)  # every weighted benchmark measured on real layouts
    cuts = json.loads((out / "rehearsal_cuts.json").read_text())
    assert all(c["why"] for c in cuts) and any(c["setting"] == "base_model_uri" for c in cuts)
    assert "rl.algorithm" not in {c["setting"] for c in cuts}
    shutil.rmtree(tmp_path)  # ~11 GB of real-width checkpoints: CI's image build after it needs the disk


def load_preset(preset):
    from pipelines.presets import load_preset as load

    return load(preset)


def load_weights(preset):
    return {k: v for k, v in load_preset(preset).stages["select_checkpoint"]["weights"].items() if v}
