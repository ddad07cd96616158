"""Preflight refuses a run that cannot end before any GPU is spent: a training stage that does not fit its pod's
GPUs (the memory planner on the resolved base model's config), and select_checkpoint weights or gates on metrics
the held-out data does not yield (a held-out set of only real benchmarks has no `cider_d`); `qvl compile` and
`qvl submit` refuse an unfit preset too, unless --force."""

import json
import subprocess
import sys

import pytest

from components._shared.data import datasets
from components.preflight.fit import check_fits, check_selection, yielded_metrics
from components.synth_world import real_photos as P
from pipelines.presets import load_preset
from pipelines.qvl.real_checkpoints import CHECKPOINT_DIR
from tests.codebase import ROOT

QWEN_7B = json.loads((CHECKPOINT_DIR / "qwen2.5-vl-7b.json").read_text())


@pytest.fixture(scope="module")
def benchmarks(tmp_path_factory) -> list[dict]:
    return datasets.load_eval_records(P.write_benchmarks(tmp_path_factory.mktemp("benchmarks")))


def _profiles(preset, **changes) -> dict[str, dict]:
    cluster = load_preset(preset).cluster_profile()
    profiles = cluster.gpu_profiles(["pretrain", "sft", "reward_model", "rl", "distill"])
    for stage, change in changes.items():
        profiles[stage] = {**profiles[stage], **change}
    return profiles


def test_prod_7b_fits_its_pods_and_rl_on_one_gpu_is_refused_with_the_planners_line():
    stages = load_preset("prod-7b").stages
    student = {
        stages["distill"]["student"]["model_uri"]: json.loads((CHECKPOINT_DIR / "qwen2.5-vl-3b.json").read_text())
    }
    assert check_fits(stages, _profiles("prod-7b"), QWEN_7B, student) == 5
    with pytest.raises(ValueError, match=r"does not fit its GPUs .*\nrl: needs \d+\.\d GB per GPU, the profile's GPU"):
        check_fits(stages, _profiles("prod-7b", rl={"gpus": 1}), QWEN_7B, student)


def test_real_benchmarks_yield_their_own_metrics_and_not_the_synthetic_worlds(benchmarks):
    yielded = yielded_metrics(benchmarks, reward_model=True)
    assert {
        "benchmark/vqav2",
        "benchmark/docvqa",
        "benchmark/pope",
        "benchmark/pope/f1",
        "grounding_accuracy",
    } <= yielded
    assert {"anls", "reward_model_score", "parameters", "latency_ms"} <= yielded
    assert not {"vqa_exact_match", "cider_d", "exact_match/count"} & yielded


def test_weights_the_data_cannot_measure_are_refused_naming_what_it_yields(benchmarks):
    check_selection(load_preset("prod-7b").stages["select_checkpoint"], benchmarks, reward_model=True)
    synthetic = {"weights": {"vqa_exact_match": 1.0, "cider_d": 0.05}, "min_gates": {"benchmark/chartqa": 0.5}}
    with pytest.raises(ValueError) as caught:
        check_selection(synthetic, benchmarks, reward_model=True)
    message = str(caught.value)
    assert "select_checkpoint.weights.cider_d, select_checkpoint.weights.vqa_exact_match:" in message
    assert "'benchmark/docvqa'" in message and "benchmark/chartqa" not in message.split(":")[0]  # chartqa is there
    with pytest.raises(ValueError, match="select_checkpoint.weights.reward_model_score"):
        check_selection({"weights": {"reward_model_score": 1.0}}, benchmarks, reward_model=False)


def _qvl(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.qvl.app", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_compile_refuses_a_preset_that_cannot_fit_unless_forced(tmp_path):
    (tmp_path / "prod-7b.yaml").write_text((ROOT / "pipelines/presets/prod-7b.yaml").read_text())
    (tmp_path / "small.yaml").write_text("extends: prod-7b\nkubernetes: {stages: {rl: {gpus: 1}}}\n")
    refused = _qvl("compile", "--preset", str(tmp_path / "small.yaml"), "--out", str(tmp_path / "a.yaml"))
    assert refused.returncode == 2 and "error: does not fit: rl: needs" in refused.stderr
    assert not (tmp_path / "a.yaml").exists()
    forced = _qvl("compile", "--preset", str(tmp_path / "small.yaml"), "--out", str(tmp_path / "b.yaml"), "--force")
    assert forced.returncode == 0 and "warning: does not fit: rl" in forced.stderr and (tmp_path / "b.yaml").exists()


def test_pretrain_needs_held_out_captions_and_sft_a_curriculum_its_data_has(benchmarks, tmp_path):
    from components.preflight.fit import check_curriculum, check_pretrain_captions

    assert check_pretrain_captions(benchmarks) == 2  # COCO Captions' two images
    without = [r for r in benchmarks if r["benchmark"] != "coco_captions"]
    with pytest.raises(
        ValueError, match=r"held-out data has 0 caption records; pretrain needs >= 2.*format: coco_captions"
    ):
        check_pretrain_captions(without)
    sft = load_preset("prod-7b").stages["sft"]  # phases basic, advanced, all
    plain = [{"id": "a", "difficulty": "all"}]
    with pytest.raises(ValueError, match=r"sft.curriculum\[0\] \(phase 'basic'\).difficulties: \['basic'\] match no"):
        check_curriculum(sft, plain)
    check_curriculum(sft, [{"id": "a", "difficulty": "basic"}, {"id": "b", "difficulty": "advanced"}])
    check_curriculum({"curriculum": []}, plain)
