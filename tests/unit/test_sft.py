"""The sft stage on the tiny model: LoRA (incl. vision qkv and merger), QLoRA and full; merging; outputs load."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from components._shared.platform.tracking import NullTracker
from components.sft.config import SftConfig
from components.sft.stage import load_sft_records, run
from components.synth_world.splits import write_splits
from tests.prefetch import assert_same_with_and_without_workers
from tests.stage_cli import run_stage_cli

BASE = "builtin:tiny-qwen2_5-vl"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("heldout")
    write_splits(out, seed=5, eval_per_type=6, sft_records=48, preference_pairs=2)
    return out


def _cfg(mode, **over):
    base = {
        "mode": mode,
        "min_pixels": 3136,
        "max_pixels": 12544,
        "max_records": 48,
        "train": {"steps": 4, "samples_per_step": 8, "max_tokens_per_micro_batch": 256, "threads": 1},
        "optim": {"lr": 0.01},
        "eval": {"per_type": 2, "batch_size": 16, "max_new_tokens": 8},
    }
    base.update(over)
    return SftConfig.model_validate(base)


def _run(cfg, data_dir, out):
    return run(cfg, base_model=BASE, data=str(data_dir), output_dir=out, tracker=NullTracker())


def test_lora_trains_vision_qkv_and_merger_adapters_and_merges_exactly(data_dir, tmp_path):
    metrics = _run(_cfg("lora"), data_dir, tmp_path)
    adapter = load_file(str(tmp_path / "adapter/adapter_model.safetensors"))
    for fragment in (
        "visual.merger.mlp.0",
        "visual.merger.mlp.2",
        "visual.blocks.0.attn.qkv",
        "language_model.layers.0.self_attn.q_proj",
    ):
        b = [v for k, v in adapter.items() if fragment in k and "lora_B" in k]
        assert b, f"no LoRA adapter on {fragment}"
        assert float(b[0].abs().max()) > 0, f"LoRA B of {fragment} never moved from its zero init"
    assert metrics["merge_max_abs_logit_diff"] < 1e-4
    assert metrics["trainable_parameters"] > 0
    assert metrics["train_loss_final"] < metrics["train_loss_first"]
    # the merged model is a plain HF checkpoint that answers a held-out question
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model")
    processor = AutoProcessor.from_pretrained(tmp_path / "model")
    record = json.loads((data_dir / "eval.jsonl").read_text().splitlines()[0])
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": record["question"]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.open(data_dir / record["image"]).convert("RGB")], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    for key in ("vqa_exact_match", "vqa_majority_baseline", "padding_efficiency", "ece"):
        assert key in metrics
    assert 0 <= metrics["ece"] <= 1 and "temperature" not in metrics  # no temperature fitted unless asked
    assert "confidence_temperature" not in json.loads((tmp_path / "model/qvl_model.json").read_text())
    assert (tmp_path / "report.md").read_text().count("| color |") == 1


def test_full_sft_with_frozen_vision_changes_only_unfrozen_weights(data_dir, tmp_path):
    calibration, evaluation = {"fit_temperature": True}, {"per_type": 6, "batch_size": 48, "max_new_tokens": 8}
    cfg = _cfg("full", freeze=["vision_lower", "vision_upper"], calibration=calibration, eval=evaluation)
    metrics = _run(cfg, data_dir, tmp_path)  # 42 short answers: 21 to fit the temperature, 21 to measure it
    # a fitted temperature is reported with ECE before / after it and travels with the exported model
    assert {"ece", "ece_before", "ece_after"} <= set(metrics) and metrics["temperature"] > 0
    meta = json.loads((tmp_path / "model/qvl_model.json").read_text())
    assert meta["confidence_temperature"] == metrics["temperature"]
    from components._shared.model.sources import resolve_model

    before = load_file(str(resolve_model(BASE) / "model.safetensors"))
    after = load_file(str(tmp_path / "model/model.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert set(before) == set(after) and any("visual.blocks." in k for k in before)
    assert not any("visual.blocks." in k or "patch_embed" in k for k in changed)
    assert any("merger" in k for k in changed) and any(k.startswith("model.layers.") for k in changed)


def test_a_temperature_without_the_ece_pass_is_refused():
    with pytest.raises(ValueError, match="fit_temperature needs calibration.enabled: true"):
        _cfg("lora", calibration={"enabled": False, "fit_temperature": True})
    assert _cfg("lora", calibration={"fit_temperature": True, "fraction": 0.3}).calibration.fraction == 0.3


def test_qlora_quantises_the_lm_but_not_vision_or_lm_head(data_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    from components.sft.stage import build_model

    cfg = _cfg("qlora", calibration={"enabled": False})
    model = build_model(cfg, BASE).model
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert any(
        k.endswith("language_model.layers.0.self_attn.q_proj.base_layer") and v == "Linear4bit"
        for k, v in kinds.items()
    )
    assert not any("visual" in k and v == "Linear4bit" for k, v in kinds.items())
    assert not any(k.endswith("lm_head") and v == "Linear4bit" for k, v in kinds.items())
    metrics = _run(cfg, data_dir, tmp_path)
    assert metrics["train_loss_final"] < metrics["train_loss_first"]
    assert (tmp_path / "model/model.safetensors").is_file()
    print(f"qlora merge max abs logit diff (4-bit vs merged fp32): {metrics['merge_max_abs_logit_diff']:.4f}")


def test_bad_records_and_config_are_rejected_with_the_fix(tmp_path):
    (tmp_path / "sft.jsonl").write_text(json.dumps({"id": "r1", "conversations": [{"from": "bot", "value": "x"}]}))
    with pytest.raises(
        ValueError, match="sft.jsonl:1 \\(id='r1'\\): conversations\\[0\\]: role 'bot'; use from=system\\|human\\|gpt"
    ):
        load_sft_records(tmp_path)
    with pytest.raises(ValueError, match="curriculum steps sum to 3 but train.steps=4"):
        _cfg("lora", curriculum=[{"name": "basic", "steps": 3}])
    with pytest.raises(ValueError, match="gave no adapter on"):
        from components.sft.stage import build_model

        build_model(_cfg("lora", lora={"target_modules": [r"language_model\.layers\.\d+\.self_attn\.q_proj"]}), BASE)


def _stage_cli(config: dict, data_dir, out, **env):
    return run_stage_cli("sft", config, out, {"base_model": BASE, "data": data_dir}, **env)


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("deepspeed-2", marks=pytest.mark.slow), pytest.param("deepspeed-3", marks=pytest.mark.slow)],
)
def test_sft_killed_mid_run_resumes_to_bit_identical_weights(data_dir, tmp_path, backend):
    import signal

    engine, _, zero = backend.partition("-")
    config = _cfg(
        "full",
        calibration={"enabled": False},
        difficulty_scheduler={"enabled": True},
        train={
            "steps": 6,
            "samples_per_step": 8,
            "max_tokens_per_micro_batch": 256,
            "threads": 1,
            "eval_every": 3,
            "checkpoint_every": 2,
            "backend": engine,
            "zero_stage": int(zero or 2),
        },
    ).model_dump(mode="json", exclude_none=True)
    straight = _stage_cli(config, data_dir, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _stage_cli(config, data_dir, tmp_path / "killed", QVL_TEST_KILL_AT_STEP=3)
    assert killed.returncode == -signal.SIGKILL
    in_write = _stage_cli(config, data_dir, tmp_path / "killed", QVL_TEST_KILL_IN_CHECKPOINT=4)
    assert in_write.returncode == -signal.SIGKILL
    resumed = _stage_cli(config, data_dir, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((tmp_path / "killed/_stage_result.json").read_text())["metrics"]
    assert metrics["resumed_from_step"] == 2  # the checkpoint of step 4 never committed
    a = load_file(str(tmp_path / "straight/model/model.safetensors"))
    b = load_file(str(tmp_path / "killed/model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"sft {backend}: {len(a)} tensors bit-identical after SIGKILL at step 3 and during the step-4 checkpoint")


def test_difficulty_scheduler_weights_follow_the_latest_eval():
    from components.sft.stage import type_weights

    cfg = _cfg(
        "lora", difficulty_scheduler={"enabled": True, "floor": 0.1}, train={"steps": 4, "eval_every": 2, "threads": 1}
    )
    records = [{"type": "color"}] * 3 + [{"type": "count"}] + [{"type": "caption"}] * 2
    weights = type_weights(cfg, records, [0, 1, 2, 3, 4, 5])
    assert weights([]) is None
    w = weights([{"step": 2, "exact_match/color": 1.0, "exact_match/count": 0.0}])
    assert sum(w[:3]) == pytest.approx(0.1) and w[3] == pytest.approx(1.1)  # per type: floor + error rate
    assert sum(w[4:]) == pytest.approx(0.6)  # captions are not in the quick eval: the mean weight


def test_quick_eval_set_covers_every_question_type():
    from components.sft.stage import quick_eval_set

    records = [{"type": t, "id": f"{t}{i}"} for t in ("caption", "color", "count", "ocr") for i in range(5)]
    picked = quick_eval_set(records, 7)
    assert [r["type"] for r in picked] == ["color", "count", "ocr"] * 2 + ["color"]
    with pytest.raises(ValueError, match="eval_every > 0"):
        _cfg("lora", difficulty_scheduler={"enabled": True})


def test_a_diverging_run_stops_and_exports_nothing(data_dir, tmp_path):
    from components._shared.model.training import NonFiniteTraining

    cfg = _cfg("full", train={"steps": 6, "samples_per_step": 8, "max_tokens_per_micro_batch": 256, "threads": 1})
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lr": 1e30})})
    with pytest.raises(NonFiniteTraining, match=r"step \d: .* is not finite"):
        _run(cfg, data_dir, tmp_path)
    assert not (tmp_path / "model").exists()


def test_prefetching_data_workers_leave_the_model_bit_identical(data_dir, tmp_path):
    def run_with(workers, out):
        train = {"steps": 4, "samples_per_step": 8, "max_tokens_per_micro_batch": 256, "threads": 1}
        _run(_cfg("full", train={**train, "data_workers": workers}), data_dir, out)

    assert_same_with_and_without_workers(run_with, tmp_path)


@pytest.mark.slow
def test_lora_on_zero3_with_gradient_checkpointing_trains(data_dir, tmp_path):
    """LoRA keeps the LM head frozen; under ZeRO-3 the head loss gathers it for its eager pass (a checkpointed head
    failed: DeepSpeed does not gather a frozen parameter for the backward's recomputation). prod-qwen3-vl-8b's SFT."""
    train = {"steps": 2, "samples_per_step": 8, "max_tokens_per_micro_batch": 256, "threads": 1, "eval_every": 2}
    train.update(backend="deepspeed", zero_stage=3, gradient_checkpointing=True)
    config = _cfg("lora", calibration={"enabled": False}, train=train).model_dump(mode="json", exclude_none=True)
    proc = _stage_cli(config, data_dir, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out/_stage_result.json").read_text())["metrics"]
    assert math.isfinite(metrics["train_loss_final"]) and metrics["merge_max_abs_logit_diff"] < 1e-3
