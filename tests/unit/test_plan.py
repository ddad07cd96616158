"""`qvl plan`: parameters counted from the real config on the meta device, memory per GPU by the stage's settings
and cluster profile, refusals that name the setting to change. The estimate against measured memory is checked
by the rehearsal (tests/e2e/test_rehearsal.py, within 25%)."""

from __future__ import annotations

import pytest

from pipelines.presets import PRESET_DIR, preset_path
from pipelines.qvl.memory_plan import gpu_memory_gb, plan, refusals, table


def _extending_prod_7b(tmp_path, text: str) -> str:
    (tmp_path / "prod-7b.yaml").write_text(preset_path("prod-7b").read_text())
    (tmp_path / "p.yaml").write_text("extends: prod-7b\n" + text)
    return str(tmp_path / "p.yaml")


def test_prod_7b_is_planned_per_stage_and_the_stages_that_cannot_fit_are_refused_with_the_fix(tmp_path):
    name, plans = plan("prod-7b")
    assert name == "qwen2.5-vl-7b"
    by_stage = {p.stage: p for p in plans}
    assert set(by_stage) == {"pretrain", "sft", "reward_model", "rl", "distill"}
    pretrain, sft = by_stage["pretrain"], by_stage["sft"]
    assert 8.2e9 < pretrain.params_total < 8.4e9  # Qwen2.5-VL-7B: 8.29B with its 152,064-row untied embeddings
    assert pretrain.gpus == 16 and pretrain.zero == "ZeRO-3" and pretrain.fits
    # DeepSpeed with bf16: the module in bf16 (2 bytes, partitioned by ZeRO-3), fp32 masters + moments in the optimizer
    assert pretrain.weights_gb == pytest.approx(2 * pretrain.params_total / 16 / 2**30)
    assert pretrain.optimizer_gb == pytest.approx(16 * pretrain.params_trainable / 16 / 2**30)
    assert sft.params_trainable < 0.03 * sft.params_total  # LoRA r=64
    assert by_stage["distill"].params_trainable < 0.5 * pretrain.params_total  # the 3B student
    assert all(p.activations_checkpointed_gb < p.activations_gb for p in plans)
    lines = refusals(plans)
    assert not any(line.startswith("sft: ") for line in lines)  # the chunked LM-head loss: 2.3 GB of logits
    assert sft.logits_gb == pytest.approx(1024 * 152_064 * 16 / 2**30)
    unchunked = "sft: {train: {loss_chunk_tokens: 0, max_tokens_per_micro_batch: 32768}}\n"  # 55.7 GB of logits
    _, full_logits = plan(_extending_prod_7b(tmp_path, unchunked))
    fix = "set sft.train.max_tokens_per_micro_batch: 16384, sft.train.gradient_checkpointing: true"
    assert any(line.startswith("sft: ") and fix in line for line in refusals(full_logits))
    assert lines == []  # every stage fits its profile, rl included: 8 GPUs, the reference partitioned over them
    rl = by_stage["rl"]
    assert rl.gpus == 8 and rl.fits and "reference ZeRO-3 over 8" in rl.notes
    policy_and_rm = 2 * rl.params_total  # the reward model stays whole on every GPU (bf16); the reference is 1/8
    assert rl.frozen_models_gb == pytest.approx((policy_and_rm + 2 * rl.params_total / 8) / 2**30)
    assert "qwen2.5-vl-7b" in table(name, "prod-7b", plans)


def test_rl_on_a_gpu_too_small_for_a_whole_reference_is_told_to_partition_it(tmp_path):
    preset = _extending_prod_7b(
        tmp_path, "rl: {frozen_sharding: replicated}\nkubernetes: {stages: {rl: {accelerator_type: GPU-70GB}}}\n"
    )
    _, plans = plan(preset)
    (line,) = [line for line in refusals(plans) if line.startswith("rl: ")]
    assert "set rl.frozen_sharding: zero3" in line


def test_the_fix_the_planner_names_makes_the_stage_fit(tmp_path):
    preset = _extending_prod_7b(tmp_path, "sft: {train: {zero_stage: 3}}\nreward_model: {train: {zero_stage: 3}}\n")
    _, plans = plan(preset)
    fits = {p.stage: p.fits for p in plans}
    assert fits["sft"] and fits["reward_model"] and not refusals([p for p in plans if p.stage == "sft"])


def test_gpu_memory_is_read_from_the_accelerator_label():
    assert gpu_memory_gb("NVIDIA-H100-80GB-HBM3") == 80 and gpu_memory_gb("NVIDIA-H200") == 141
    assert gpu_memory_gb(None) is None


def test_a_base_model_on_s3_that_is_no_known_checkpoint_needs_its_name(tmp_path):
    preset = _extending_prod_7b(tmp_path, "base_model_uri: s3://models/my-own-vlm\n")
    with pytest.raises(ValueError, match="give --config NAME"):
        plan(preset)
    assert plan(preset, "qwen3-vl-8b")[0] == "qwen3-vl-8b"


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESET_DIR.glob("prod-*.yaml")))
def test_every_committed_prod_preset_fits_its_cluster_profile(preset):
    """`qvl plan` exits 0 for each: no committed preset ships a training stage that cannot fit its GPUs."""
    _, plans = plan(preset)
    assert refusals(plans) == [] and all(p.fits for p in plans)


def test_a_training_stage_without_gpus_is_not_planned_and_a_student_larger_than_its_teacher_is_refused(tmp_path):
    """sft on gpus: 0 was said to fit an 80 GB GPU it never gets (accelerator_type alone is a node selector); one
    model stage at 0 beside others on GPUs is refused (the twelfth pass's PR27), a CPU-only profile is planned."""
    with pytest.raises(ValueError, match="kubernetes.stages.sft.gpus: 0 while distill, extract_features"):
        plan(_extending_prod_7b(tmp_path, "kubernetes: {stages: {sft: {gpus: 0}}}\n"))
    cpu = ["extract_features", "sft", "sft_data", "reward_model", "rl", "distill", "select_checkpoint"]
    stages = ", ".join(f"{s}: {{gpus: 0}}" for s in cpu) + ", pretrain: {gpus: 0, nodes: 1}"
    name, plans = plan(_extending_prod_7b(tmp_path, f"kubernetes: {{stages: {{{stages}}}}}\n"))
    sft = next(p for p in plans if p.stage == "sft")
    assert sft.gpus == 0 and sft.fits is None and not refusals([sft])
    (line,) = [row for row in table(name, "p", plans).splitlines() if row.startswith("sft ")]
    assert "not planned on a GPU: kubernetes.stages.sft.gpus is 0" in line and "fits" not in line
    larger = "distill: {student: {model_uri: s3://qvl-models/Qwen3-VL-8B-Instruct}}\n"  # 8.8B under a 8.3B teacher
    with pytest.raises(ValueError, match=r"distill.student: the student has 8.\d\dB parameters, more than its teacher"):
        plan(_extending_prod_7b(tmp_path, larger))


def test_checkpointing_every_second_block_is_planned_between_all_and_none(tmp_path):
    """train.checkpoint_every_n_layers: 2 keeps half the blocks' activations: the planned activation memory lies half
    way between full checkpointing and none, and the plan says so."""
    _, plans = plan(_extending_prod_7b(tmp_path, "sft: {train: {checkpoint_every_n_layers: 2}}\n"))
    (sft,) = [p for p in plans if p.stage == "sft"]
    (full,) = [p for p in plan("prod-7b")[1] if p.stage == "sft"]
    half_way = (sft.activations_gb + sft.activations_checkpointed_gb) / 2
    assert sft.total_gb - full.total_gb == pytest.approx(half_way - full.activations_checkpointed_gb)
    assert "gradient checkpointing (every 2 blocks)" in sft.notes and full.total_gb < sft.total_gb
