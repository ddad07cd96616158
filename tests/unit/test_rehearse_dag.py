"""`qvl rehearse --preset`: what the rehearsal changes of a production preset is sizes, models and what needs a
cluster, every change declared with its reason; the settings that make the preset what it is stay as they are."""

import json
import re

import pytest

from pipelines.presets import load_preset
from pipelines.qvl import rehearse_dag as R
from pipelines.qvl.real_checkpoints import reduced_config

PROD = ["prod-7b", "prod-qwen3-vl-8b", "prod-qwen3.5-9b"]
# What a rehearsal must never cut: the choices the preset is about (regexes over the flattened settings).
KEPT = [
    r"^sft\.(mode|lora\.|qlora\.)",
    r"\.curriculum\.\d+\.(name|difficulties|lr_scale)",
    r"^rl\.(algorithm|rewards|update|ppo|ter|frozen_sharding)",
    r"\.(backend|zero_stage|precision|offload_optimizer|gradient_checkpointing)$",
    r"^select_checkpoint\.(weights|checkpoints_per_stage)",
    r"^promote\.(enabled|dtype|serving)",
    r"^distill\.(loss|student\.init)",
    r"^pretrain\.(infonce|keep_best_of_last|stage2\.enabled)",
    r"\.optim\.",
    r"^reward_model\.(score_first_k|margin|freeze)",
    r"^clean_data\.(nsfw|ocr|outlier|judge)",
]  # fmt: skip


@pytest.mark.parametrize("name", PROD)
def test_cuts_are_declared_and_leave_the_presets_choices(name, tmp_path):
    models = {"base_model_uri": "/models/base", "distill": {"student": {"model_uri": "/models/student"}}}
    cut, cuts = R.cut_preset(name, tmp_path, models, {"base_model_uri": "the base model at reduced depth"})
    preset = load_preset(name)
    before, after = R._flat(preset.stages), R._flat(cut.stages)
    changed = {c.setting for c in cuts}
    assert all(c.why for c in cuts)
    assert {s for s in before if before[s] != after.get(s)} <= changed  # every change declared
    touched = [s for s in changed for pattern in KEPT if re.search(pattern, s)]
    assert not touched, f"the rehearsal cut the preset's own choices: {touched}"
    for stage, section in cut.stages.items():  # every checkpoint on this machine, every train block cut to steps
        for key, value in R._flat(section).items():
            if key.endswith("checkpoint_uri"):
                assert value.startswith(str(tmp_path)), (stage, key)
    assert cut.stages["select_checkpoint"]["min_gates"] == dict.fromkeys(
        preset.stages["select_checkpoint"]["min_gates"], 0.0
    )
    assert cut.base_model_uri == "/models/base" and cut.stages["promote"]["model_registry"]["server_address"] == ""
    assert R.processes(cut) == {"pretrain": 2, "sft": 2, "reward_model": 2, "rl": 2, "distill": 2}
    rl = cut.stages["rl"]
    rollouts_per_process = rl["train"]["samples_per_step"] * rl["rollout"]["samples_per_prompt"] // 2
    assert rl["update"]["minibatches"] <= rollouts_per_process  # PPO's minibatches each get rollouts on every rank
    assert {k: v for k, v in cut.cluster_profile().stages.items() if v.retries} == {}


@pytest.mark.parametrize("checkpoint", ["qwen2.5-vl-7b", "qwen3-vl-8b", "qwen3.5-9b"])
def test_narrowed_checkpoints_keep_heads_vocabulary_and_rotary_sections(checkpoint):
    full = reduced_config(checkpoint, layers=2, vision_depth=4)
    cut = reduced_config(checkpoint, layers=2, vision_depth=4, **R.NARROW)
    t, f = cut.text_config, full.text_config
    head_dim = getattr(f, "head_dim", None) or f.hidden_size // f.num_attention_heads
    assert t.head_dim == head_dim and t.hidden_size == t.num_attention_heads * head_dim <= R.NARROW["text_hidden"]
    assert t.num_attention_heads % t.num_key_value_heads == 0 and t.vocab_size == f.vocab_size
    v, fv = cut.vision_config, full.vision_config
    assert v.num_heads == 2 and v.hidden_size // v.num_heads == fv.hidden_size // fv.num_heads
    assert v.out_hidden_size == t.hidden_size and v.patch_size == fv.patch_size


def test_local_launch_plans_reach_only_the_named_tasks(tmp_path):
    import yaml
    from kfp import compiler

    from pipelines.vlm_training import build_pipeline

    compiler.Compiler().compile(
        build_pipeline("tiny", "sft", for_cluster=False, local_processes={"sft": 2}), str(tmp_path / "p.yaml")
    )
    executors = yaml.safe_load((tmp_path / "p.yaml").read_text())["deploymentSpec"]["executors"]
    plans = {
        name: json.loads(env["value"])
        for name, executor in executors.items()
        for env in executor["container"].get("env", [])
        if env["name"] == "QVL_LAUNCH_PLAN"
    }
    assert list(plans) == ["exec-sft-op"] and plans["exec-sft-op"]["gpus_per_node"] == 2
    assert plans["exec-sft-op"]["stage"] == "sft" and plans["exec-sft-op"]["nodes"] == 1
