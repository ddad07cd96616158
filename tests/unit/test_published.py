"""The demo's published numbers: README's results table is the one generated from docs/demo_published.json, and
`compare` tells a fresh run that lands on them from one that does not."""

import copy
import json

import pytest

from components._shared.platform.cpu_numerics import PINS, cpu_vendor
from pipelines.qvl import published
from pipelines.qvl.run_report import key_metric_rows


def _summary() -> dict:
    """A run summary shaped like the demo's (the metric keys run_report reads)."""
    stages = {
        "clean_data": {"records_in": 2000, "records_kept": 1540, "kept_fraction": 0.77},
        "extract_features": {"images": 1540, "visual_tokens_total": 24640},
        "pretrain": {"retrieval_r1": 0.5, "retrieval_chance": 0.03125, "heldout_caption_loss_final": 0.38}
        | {"heldout_caption_loss_initial": 6.28, "retrieval_r1_initial": 0.03},
        "sft": {"vqa_exact_match": 0.459, "vqa_majority_baseline": 0.23},
        "reward_model": {"pair_accuracy": 0.89, "pair_accuracy_initial": 0.45},
        "rl": {"efficacy_gain": 0.0017, "efficacy_gain_ci_low": -0.002, "efficacy_gain_ci_high": 0.005},
        "distill": {"student_score_ratio": 0.95, "student_param_ratio": 0.46},
        "select_checkpoint": {"selected_stage": "rl", "selected_score": 0.78},
    }
    return {
        "status": "succeeded",
        "preset": "demo",
        "seconds": 1061.4,
        "stages": {s: {"status": "succeeded", "seconds": 60.0, "metrics": m} for s, m in stages.items()},
    }


def test_readme_shows_the_results_generated_from_the_published_json():
    text = published.README.read_text()
    assert published.BEGIN in text and published.END in text, "README.md lost its demo-results markers"
    assert published.readme_text(text) == text, (
        "README's results differ from docs/demo_published*.json: regenerate them with "
        "`python -m pipelines.qvl.published RUN_DIR` from the run you mean to publish"
    )
    for vendor, path in published.PUBLISHED_BY_VENDOR.items():
        data = json.loads(path.read_text())
        assert data["cpu_vendor"] == vendor, f"{path.name} holds a run on {data['cpu_vendor']}"
        stages = {row["stage"] for row in data["rows"]} - set(published.stale_stages(data))
        current = {"clean_data", "pretrain", "sft", "reward_model", "rl", "distill", "select_checkpoint"}
        assert current - set(published.stale_stages(data)) <= stages
        assert data["preset"] == "demo" and data["dag_seconds"] > 0
        assert data["cpu_numerics"] == PINS, (
            f"{path.name}: publish a run made with the CPU pins (cpu_numerics.py), or no machine repeats it"
        )


def test_a_run_is_compared_with_its_own_cpu_vendors_numbers():
    assert cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t: avx2\n") == "AuthenticAMD"
    assert cpu_vendor("processor : 0\nvendor_id : GenuineIntel\n") == "GenuineIntel"
    assert cpu_vendor("CPU implementer : 0x41\n") == "unknown"  # ARM
    assert published.published_for("GenuineIntel") == published.PUBLISHED
    assert published.published_for("AuthenticAMD").name == "demo_published.amd.json"
    with pytest.raises(ValueError, match="no demo numbers are published for CPU vendor 'unknown'"):
        published.published_for("unknown")


def test_a_published_run_compares_equal_to_itself_and_rounding_stays_inside_the_tolerance():
    summary = _summary()
    data = published.published_from(summary, machine="test")
    assert published.compare(summary, data) == []
    nudged = copy.deepcopy(summary)
    nudged["stages"]["sft"]["metrics"]["vqa_exact_match"] += 0.01  # another CPU's float rounding
    nudged["stages"]["clean_data"]["metrics"]["records_kept"] += 3
    assert published.compare(nudged, data) == []


def test_compare_names_each_metric_a_fresh_run_misses():
    data = published.published_from(_summary(), machine="test")
    broken = copy.deepcopy(_summary())
    broken["stages"]["sft"]["metrics"]["vqa_exact_match"] = 0.24  # an SFT that learned nothing
    broken["stages"]["clean_data"]["metrics"]["records_in"] = 1999  # a record lost
    del broken["stages"]["reward_model"]["metrics"]["pair_accuracy"]
    problems = published.compare(broken, data)
    assert any(p.startswith("sft vqa_exact_match: published 0.459, this run 0.24") for p in problems), problems
    assert any(p.startswith("clean_data records_in: published 2000, this run 1999") for p in problems), problems
    assert any(p.startswith("reward_model pair_accuracy") for p in problems), problems
    assert len(problems) == 3


def test_the_table_prints_each_key_metric_with_its_baseline_difference_and_interval():
    summary = _summary()
    table = published.markdown_table(published.published_from(summary, machine="test"))
    lines = table.splitlines()
    assert len(lines) == 2 + len(key_metric_rows(summary))
    sft = next(line for line in lines if "`vqa_exact_match`" in line)
    assert "| 0.459 |" in sft and "0.23" in sft and "+0.229" in sft
    rl = next(line for line in lines if "`efficacy_gain`" in line)
    assert "0.0017 (95% CI -0.002 to 0.005)" in rl
    summary["stages"]["rl"]["metrics"]["efficacy_gain_ci_low"] = -6.42e-05  # printed as a decimal, not 1e-05 style
    table = published.markdown_table(published.published_from(summary, machine="test"))
    assert "0.0017 (95% CI -0.00006 to 0.005)" in table


def test_publishing_needs_the_markers_and_a_succeeded_run(tmp_path):
    with pytest.raises(ValueError, match="no results markers"):
        published.replace_block("# a README without the markers\n", "table")
    (tmp_path / "run_summary.json").write_text(json.dumps({**_summary(), "status": "failed"}))
    with pytest.raises(SystemExit, match="did not succeed"):
        published.main([str(tmp_path)])
    (tmp_path / "run_summary.json").write_text(
        json.dumps({**_summary(), "cpu_numerics": {}})
    )  # QVL_CPU_NUMERICS=native
    with pytest.raises(SystemExit, match="CPU kernels were not pinned"):
        published.main([str(tmp_path)])


def test_a_vendors_stale_stages_leave_its_comparison_and_readme_line_and_are_said():
    """Publishing one vendor's run after a change marks the changed stages of the others stale: their values leave
    `compare` and README (no machine of that vendor has rerun them) and README says since when and why."""
    summary = _summary()
    data = published.published_from(summary, machine="test")
    stale = published.mark_stale(data, ["rl", "distill"], "RL's rollouts are seeded per chunk")
    moved = copy.deepcopy(summary)
    moved["stages"]["rl"]["metrics"]["efficacy_gain"] = 0.5  # the changed stage lands elsewhere now
    assert published.compare(moved, data) and published.compare(moved, stale) == []
    block = published.readme_block(data, [{**stale, "cpu_vendor": "AuthenticAMD"}])
    line = block.splitlines()[-2]
    assert "rl `efficacy_gain`" not in line and "sft `vqa_exact_match` 0.459" in line
    assert line.endswith("(RL's rollouts are seeded per chunk): rl, distill.")
    with pytest.raises(ValueError, match="unknown"):
        published.mark_stale(data, ["rlhf"], "x")
