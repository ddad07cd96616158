"""The local DAG on a small real-photo dataset: SFT data as one LLaVA JSON array, a custom task (photo_qa, scored by
exact match) that RL takes its efficacy reward from, and select_checkpoint scoring and gating per benchmark. The
lake stages run on the synthetic world's lake (a lake is its own input)."""

import json
import subprocess
import sys

import pytest

from components._shared.data import scorers
from components.synth_world import real_photos as P

pytestmark = pytest.mark.e2e

PRESET = """\
extends: tiny               # a preset of the project's, from a preset file kept anywhere
sft:
  curriculum: []            # the photos carry no difficulty levels
select_checkpoint:
  weights: {benchmark/photo_qa: 1.0, benchmark/photo_mc: 0.5, benchmark/photo_captions/cider_d: 0.05}
  min_gates: {benchmark/photo_qa: 0.0, benchmark/photo_refs: 0.0}
"""
BENCHMARKS = {"photo_qa", "photo_vqa", "photo_pope", "photo_refs", "photo_captions", "photo_mc"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from components.synth_world.lake import write_world

    root = tmp_path_factory.mktemp("photo-dag")
    write_world(root / "world", records=300, seed=4)
    data = P.write_dag_dataset(root / "photos")
    (root / "photos.yaml").write_text(PRESET)
    cmd = [sys.executable, "-m", "pipelines.qvl.app", "run", "--local", "--preset", str(root / "photos.yaml")]
    cmd += ["--lake", str(root / "world" / "lake"), "--data", str(data), "--out", str(root / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return root / "out", json.loads((root / "out" / "run_summary.json").read_text())


def test_every_stage_succeeds_and_sft_reports_each_benchmark(run):
    _, summary = run
    assert summary["status"] == "succeeded"
    sft = summary["stages"]["sft"]["metrics"]
    assert sft["train_loss_final"] < sft["train_loss_first"]
    assert {k.split("/")[1] for k in sft if k.startswith("benchmark/")} == BENCHMARKS
    assert "task/photo_qa" in sft
    # the boxes' task is named "grounding", a builtin name: its rows are the only builtin ones
    assert sft["vqa_exact_match"] == sft["grounding_accuracy"] == sft["benchmark/photo_refs"]


def test_rl_rewards_the_custom_tasks_answers_with_its_scorer(run):
    out, summary = run
    rl_dir = summary["stages"]["rl"]["artifacts"]["model"].rsplit("/model", 1)[0]
    rows = [json.loads(line) for line in open(f"{rl_dir}/rollouts.jsonl")]
    assert rows and {row["type"] for row in rows} == {"photo_qa"} and {row["scorer"] for row in rows} == {"exact_match"}
    for row in rows:
        assert row["rewards"]["efficacy"] == scorers.exact_match(row["completion"], {"answer": row["reference"]})
    rl = summary["stages"]["rl"]["metrics"]
    assert {"benchmark/photo_qa", "benchmark/photo_qa_before"} <= set(rl)
    assert "| photo_qa |" in open(f"{rl_dir}/report.md").read()


def test_select_scores_and_gates_per_benchmark(run):
    _, summary = run
    select = summary["stages"]["select_checkpoint"]["metrics"]
    assert select["candidates_evaluated"] >= 4 and select["candidates_failing_gates"] == 0
    winner = {k.removeprefix("selected_"): v for k, v in select.items() if k.startswith("selected_benchmark/")}
    assert {k.split("/")[1] for k in winner} == BENCHMARKS
    expected = winner["benchmark/photo_qa"] + 0.5 * winner["benchmark/photo_mc"]
    expected += 0.05 * winner["benchmark/photo_captions/cider_d"]
    assert select["selected_score"] == pytest.approx(expected)
