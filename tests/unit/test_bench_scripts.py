"""The benchmark scripts run end to end on tiny settings and report what they promise (behaviour, never timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_sft_mfu_tiny_prints_the_json_report(tmp_path):
    profile = tmp_path / "profile.txt"
    out = _run("bench/gpu/sft_mfu.py", "--tiny", "--steps", "2", "--check-varlen", "--profile", str(profile))
    report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    for key in (
        "tokens_per_s",
        "step_time_s",
        "mfu",
        "achieved_tflops",
        "peak_tflops",
        "model_flops_per_step",
        "tokens_per_step",
        "memory",
        "flops_split",
        "budget",
    ):
        assert key in report, key
    assert report["timed_steps"] == 2 and len(report["step_time_s_all"]) == 2
    assert report["mfu_meaningful"] is False and "not meaningful" in report["note"]
    agreement = report["varlen_agreement"]  # the CPU runs the SDPA loops with the switch on or off: equal
    assert agreement["loss_rel_diff"] == 0 and agreement["grad_norms_rel_diff"] == 0 and agreement["loss_on"] > 0
    assert "aten::mm" in profile.read_text()  # torch.profiler's table of the untimed warm-up step
    assert report["tokens_per_s"] > 0 and 0 < report["mfu"]
    assert 0 < report["tokens_per_step"] <= report["budget"]
    assert abs(sum(report["flops_split"].values()) - 1.0) < 1e-9
    assert report["memory"]["max_rss_gib"] > 0


def test_packing_throughput_packs_more_efficiently_than_padding():
    out = _run(
        "bench/packing_throughput.py",
        "--model",
        "builtin:tiny-qwen2_5-vl",
        "--samples",
        "24",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--budget",
        "auto,512",
        "--json",
    )
    assert "vs padded" in out and "goals packed@" in out and "vision tower" in out
    report = json.loads(out.split("JSON ", 1)[1].splitlines()[0])
    arms = report["arms"]
    packed = [name for name in arms if name.startswith("packed@")]
    assert len(packed) == 3 and "padded" in arms
    mask_arm = next(name for name in packed if name.endswith(" sdpa-mask"))  # the same batches, sdpa's mask
    assert arms[mask_arm]["steps"] == arms[mask_arm.removesuffix(" sdpa-mask")]["steps"]
    for name in packed:
        assert arms[name]["real_tokens"] == arms["padded"]["real_tokens"] == report["real_tokens"]
        assert arms[name]["efficiency"] > arms["padded"]["efficiency"]
        assert 0 < arms[name]["budget_fill"] <= 1
        assert arms[name]["tokens_per_cpu_s"] > 0 and arms[name]["speedup"] > 0
    assert arms["padded"]["efficiency"] < 1
    assert 4 <= report["visual_tokens"]["min"] <= report["visual_tokens"]["max"] <= 256


def test_vision_like_7b_resizes_only_the_vit_to_the_7b_cost_ratio():
    """`--vision-like 7b`: the LM keeps its shape, the ViT shrinks until an image token costs (in matmul parameters,
    next to a text token) what it costs in Qwen2.5-VL-7B (0.36, counted on a meta-device 7B)."""
    sys.path.insert(0, str(ROOT))
    from bench.packing_throughput import reference_vit_to_lm_cost, vision_like, vit_to_lm_cost
    from components._shared.model.vlm import load_vlm

    model = load_vlm("builtin:tiny-qwen2_5-vl").model
    target = reference_vit_to_lm_cost("7b")
    assert 0.3 < target < 0.45
    resized = vision_like(model, "7b")

    def lm_shape(m):
        text = m.config.text_config
        sizes = [
            getattr(text, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        ]
        return sizes, sum(p.numel() for p in m.model.language_model.parameters())

    assert lm_shape(resized) == lm_shape(model)
    # the tiny LM (width 64) is too small for any ViT to get all the way down (the patch embedding alone is
    # 1,176 x width per patch); the demo model's resized ViT lands on 0.36 (docs/benchmarks.md)
    assert vit_to_lm_cost(resized) < 0.5 * vit_to_lm_cost(model)
    assert 1 < vit_to_lm_cost(resized) / target < 3


def test_rl_step_tiny_reports_the_time_split_and_the_kv_cache_baseline():
    out = _run("bench/gpu/rl_step.py", "--tiny", "--steps", "2")
    report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert report["timed_steps"] == 2 and report["algorithm"] == "ppo"
    assert set(report["split_seconds"]) == {"generation", "scoring", "update"}
    assert abs(sum(report["split_fraction"].values()) - 1.0) < 0.01
    arms = report["generation_arms"]
    assert arms["kv_cache"]["tokens"] > 0 and arms["no_cache"]["tokens"] > 0
    assert report["rollout_tokens_per_s"] > 0 and report["kv_cache_speedup"] > 0


def _run_all_tiny(out: Path, timeout: int, **env: str) -> subprocess.CompletedProcess:
    """bench/gpu/run_all.sh in CPU smoke mode into `out`, with `env` added to this environment."""
    return subprocess.run(
        ["bash", "bench/gpu/run_all.sh", str(out), "--tiny"],
        check=False,
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_gpu_run_all_tiny_writes_one_json_per_arm(tmp_path):
    done = _run_all_tiny(tmp_path, 600, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    assert done.returncode == 0, done.stdout + done.stderr
    arms = ("probe", "sft_varlen_4k", "sft_selckpt_8k", "sft_ckpt_16k", "rl_step", "dali_decode")
    reports = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in arms}
    probe = reports["probe"]
    assert probe["cuda"] is False and probe["fused_adamw"] is True and "scale" in probe["varlen_attn_parameters"]
    assert probe["attention_fp32_autocast"] == "attention: per-sample SDPA loops (the flash varlen kernel needs CUDA)"
    sft = {name: reports[name] for name in arms if name.startswith("sft_")}
    assert all(r["optim"] == "adamw-fused" and r["tokens_per_s"] > 0 for r in sft.values())
    assert (sft["sft_selckpt_8k"]["ckpt_every"], sft["sft_ckpt_16k"]["ckpt_every"]) == (2, 1)
    assert sft["sft_varlen_4k"]["grad_ckpt"] is False and sft["sft_varlen_4k"]["data_workers"] == 1
    # the same rows and the same fused update: checkpointing every block, half of them or none gives the same losses
    losses = [r["loss_first_last"] for r in sft.values()]
    assert all(pair == pytest.approx(losses[0], rel=1e-5) for pair in losses)
    assert set(reports["rl_step"]["split_seconds"]) == {"generation", "scoring", "update"}
    dali = reports["dali_decode"]
    assert dali["meaningful"] is False and dali["dali_images_per_s"] > 0 and dali["images"] == 16
    assert dali["dali_error"] is None and dali["torchvision_nvjpeg_images_per_s"] is None  # nvJPEG arm: GPU only
    assert all("ok in" in line for line in done.stdout.splitlines() if line.startswith("   "))
    expected = json.loads((ROOT / "bench/gpu/expected_mfu.json").read_text())["arms"]
    assert set(expected) == {"sft_varlen_4k", "sft_selckpt_8k", "sft_ckpt_16k", "sft_compiled_4k"}
    assert all(0 < e["mfu_low"] < e["mfu_high"] < 1 for e in expected.values())


def test_gpu_run_all_skips_an_arm_past_its_budget_and_names_an_unknown_one(tmp_path):
    done = _run_all_tiny(tmp_path, 120, RUN_BUDGET_S="30", MIN_ARM_S="60", ARMS="probe sft_varlen_4k bogus")
    assert done.returncode == 1, done.stdout  # the unknown arm counts as failed
    assert "== probe: SKIPPED, 30 s of the 30 s budget left" in done.stdout
    assert "== sft_varlen_4k: SKIPPED" in done.stdout and "== bogus: unknown arm" in done.stdout
    assert not list(tmp_path.glob("*.json"))


def test_logits_memory_bench_reports_the_chunked_head_lower():
    out = _run(
        "bench/logits_memory.py",
        "--tokens",
        "1024",
        "--vocab",
        "151936",
        "--hidden",
        "16",
        "--chunk",
        "128",
        "--repeats",
        "1",
        "--json",
    )
    (row,) = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["rows"]
    assert row["plain_measured"] and row["loss_rel_diff"] < 1e-5
    assert row["peak_ratio"] > 2  # 1024 rows at once against 128: the plain arm holds far more


@pytest.mark.slow
def test_input_pipeline_rl_arm_reports_the_wait_and_equal_weights():
    """The rl stage's loop with its prompts built in the step and by a data worker: same final weights."""
    out = _run(
        "bench/input_pipeline.py",
        *("--stage", "rl", "--steps", "2", "--samples-per-step", "1", "--workers", "0,1", "--rl-new-tokens", "4"),
        "--json",
    )
    report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert report["stage"] == "rl" and [arm["workers"] for arm in report["arms"]] == [0, 1]
    for arm in report["arms"]:
        assert arm["bit_identical_to_baseline"] is True
        assert 0 <= arm["wait_share"] < 1 and arm["step_s_median"] > 0


@pytest.mark.slow
def test_input_pipeline_sft_arms_train_the_same_weights_from_uint8_and_float_rows():
    """In the step vs by a worker carrying the processor's float32 rows: uint8 rows normalised at the model train
    bit-identical weights."""
    out = _run(
        "bench/input_pipeline.py",
        *("--steps", "2", "--samples-per-step", "1", "--workers", "0,1:float32", "--budget", "4096"),
        "--json",
    )
    assert "pixel rows per step:" in out
    report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert [(arm["workers"], arm["pixels"]) for arm in report["arms"]] == [(0, "uint8"), (1, "float32")]
    assert all(arm["bit_identical_to_baseline"] is True for arm in report["arms"])


@pytest.mark.slow
def test_host_ops_counts_one_attention_call_per_layer_with_varlen():
    """At the 7B geometry (28 LM layers, 32 ViT blocks) the varlen arm calls attention once per layer and block each
    way; the loops arm once per sample / window, and dispatches more kernels."""
    out = _run("bench/host_ops.py", "--steps", "1", "--json")
    (row,) = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["rows"]
    assert row["varlen"]["attention_calls"] == 2 * (28 + 32)
    assert row["loops"]["attention_calls"] > 2 * (28 * row["samples"] + 32 * row["images"])
    assert row["kernels_ratio"] > 1.5 and row["loops"]["scalar_reads"] >= row["varlen"]["scalar_reads"]
    # pack()'s host-given bounds and target positions: the nonzero of the bounds and the 3 masked selects gone
    assert row["varlen_found"]["scalar_reads"] - row["varlen"]["scalar_reads"] >= 5


@pytest.mark.slow
def test_sft_mfu_compiled_blocks_train_like_eager_ones():
    """--compile (each LM layer and ViT block through torch.compile) changes the tiny run's losses by rounding only."""
    reports = []
    for flags in ((), ("--compile",)):
        out = _run("bench/gpu/sft_mfu.py", "--tiny", "--steps", "1", "--warmup", "1", *flags, timeout=900)
        reports.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    eager, compiled = reports
    assert (eager["compile"], compiled["compile"]) == (False, True) and len(compiled["warmup_step_s"]) == 1
    # 29 frames on torch 2.14 (each block's pieces around its attention call); 3 when the blocks' compiled code was
    # bypassed (transformers' checkpointed layers, hence --compile refuses --grad-ckpt)
    assert eager["compiled_frames"] == 0 and compiled["compiled_frames"] >= 10
    for a, b in zip(eager["loss_first_last"], compiled["loss_first_last"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_json_arrays_reports_both_arms_for_each_size():
    """Both arms read every record (the bench asserts the count) and a rate and ratio are printed per size."""
    out = _run("bench/json_arrays.py", "--records", "2000", "10000")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [int(r[0]) for r in rows] == [2000, 10000] and all(float(r[3]) > 0 for r in rows)


def test_length_check_reports_the_length_pass_against_reading():
    """Every arm keeps every record (the bench asserts it) and prints a rate and a ratio to the read time."""
    out = _run("bench/length_check.py", "--records", "300")
    rows = {line[:16].strip(): line[16:].split() for line in out.splitlines()[2:]}
    assert set(rows) == {"read (baseline)", "length pass", "exact counts"}
    assert float(rows["read (baseline)"][1]) == 1.0 and all(float(r[1]) > 0 for r in rows.values())


@pytest.mark.slow
def test_train_threads_runs_each_arm_repeatably():
    """Both thread counts train the demo's sft steps; each arm gives the same loss on every repeat (a run is
    deterministic at a given thread count) and the first arm is the baseline of the ratios."""
    out = _run("bench/train_threads.py", "--steps", "2", "--repeats", "2", "--json", timeout=900)
    rows = json.loads(out[out.index("[") :])
    assert [row["threads"] for row in rows] == [2, 1] and rows[0]["x_baseline"] == 1.0
    for row in rows:
        assert row["loss_same_every_repeat"] is True and 0 < row["loss_final"] < 20
        assert len(row["tokens_per_second"]) == 2 and all(speed > 0 for speed in row["tokens_per_second"])


def test_step_profile_splits_the_demo_step_and_counts_its_ops():
    """The parts add up to the step, the probe counted ops forward and backward and the step's FLOPs, and the baseline
    (the same FLOPs as matmuls, timed in the same process) is positive."""
    out = _run("bench/step_profile.py", "--steps", "7", "--json", timeout=600)
    result = json.loads(out[out.index('{\n  "steps_timed"') :])
    assert result["steps_timed"] == 3  # 7 steps and the probe's, less 5 warm-up steps
    shares = result["share_of_step"]
    assert set(shares) == {"inputs", "forward", "backward", "optimizer", "loop"}
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01) and shares["forward"] > 0.05
    assert result["ops_per_step"]["forward"] > 100 and result["ops_per_step"]["backward"] > 100
    assert result["gflops_per_step"] > 0.1 and result["matmul_equivalent_s"] > 0
