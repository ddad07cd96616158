"""`qvl plan`: the memory of every training stage per GPU, before GPUs are spent.

    qvl plan --preset prod-7b [--config qwen2.5-vl-7b]

Per training stage and for the preset's cluster profile: parameters, weights + gradients + optimizer states per
GPU, activations, logits and the frozen models it keeps, and whether it fits; a preset that cannot fit is refused,
naming the setting to change. The arithmetic and its rules are components/_shared/model/memory_plan.py (preflight
runs the same); this module resolves the preset's models and writes the table.
"""

from __future__ import annotations

import json

from components._shared.model.memory_plan import (  # noqa: F401 - the planner's API, as `qvl plan` shows it
    GB,
    TRAINING_STAGES,
    StagePlan,
    gpu_memory_gb,
    meta_model,
    plan_stage,
    refusals,
)


def base_config(preset, checkpoint: str | None):
    """The base model's config: a named real checkpoint, or the preset's base model when it is local/builtin."""
    from transformers import AutoConfig

    from pipelines.qvl.real_checkpoints import checkpoint_names, model_config

    name = checkpoint or _checkpoint_named_by(preset.base_model_uri, checkpoint_names())
    if name:
        return model_config(name), name
    if preset.base_model_uri.startswith("s3://"):
        raise ValueError(
            f"the base model {preset.base_model_uri} is on S3 and not a known checkpoint name; give "
            "--config NAME (qvl rehearse's checkpoints) or a local copy of its config.json."
        )
    from components._shared.model.sources import resolve_model

    return AutoConfig.from_pretrained(resolve_model(preset.base_model_uri)), preset.base_model_uri


def _checkpoint_named_by(uri: str, names: list[str]) -> str | None:
    tail = uri.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    return tail if tail in names else None


def known_config(uri: str):
    """The config of a real checkpoint named by `uri`'s last part (s3://.../Qwen2.5-VL-3B-Instruct), else None."""
    from pipelines.qvl.real_checkpoints import checkpoint_names, model_config

    name = _checkpoint_named_by(uri, checkpoint_names())
    return model_config(name) if name else None


def plan(preset, checkpoint: str | None = None, *, device: str = "gpu") -> tuple[str, list[StagePlan]]:
    """(the base model's name, one StagePlan per training stage of the preset: a name, a path or a loaded Preset)."""
    from pipelines.presets import as_preset

    preset = as_preset(preset)
    config, name = base_config(preset, checkpoint)
    model = meta_model(config)
    cluster = preset.cluster_profile()
    plans = [
        plan_stage(s, preset.stages[s], cluster.stages[s], model, config, device=device, resolve=known_config)
        for s in TRAINING_STAGES
    ]
    return name, plans


def table(name: str, preset: str, plans: list[StagePlan]) -> str:
    head = (
        f"memory plan of preset {preset} on {name} (GB per GPU)\n"
        f"{'stage':<13}{'GPUs':>5} {'sharding':<17}{'params':>8}{'trained':>9}{'weights':>8}{'grads':>7}{'adam':>7}"
        f"{'act':>7}{'act(ckpt)':>10}{'logits':>7}{'frozen':>7}{'total':>7}{'GPU':>6}  fits"
    )
    rows = [head]
    for p in plans:
        if p.gpus == 0:  # a training stage whose pod has no GPU: nothing to fit
            rows.append(f"{p.stage:<13}{0:>5} {p.notes[0]}")
            continue
        rows.append(
            f"{p.stage:<13}{p.gpus:>5} {p.zero:<17}{p.params_total / 1e9:>7.2f}B{p.params_trainable / 1e9:>8.3f}B"
            f"{p.weights_gb:>8.1f}{p.grads_gb:>7.1f}{p.optimizer_gb:>7.1f}{p.activations_gb:>7.1f}"
            f"{p.activations_checkpointed_gb:>10.1f}{p.logits_gb:>7.1f}{p.frozen_models_gb:>7.1f}{p.total_gb:>7.1f}"
            f"{(p.gpu_gb or 0):>6.0f}  {'-' if p.fits is None else ('yes' if p.fits else 'NO')}  {', '.join(p.notes)}"
        )
    return "\n".join(rows)


def to_json(plans: list[StagePlan]) -> str:
    from dataclasses import asdict

    return json.dumps([{**asdict(p), "fits": p.fits} for p in plans], indent=2)


def preset_refusals(preset) -> list[str]:
    """The planner's refusals for a preset (`qvl compile` / `qvl submit` stop on them unless --force); none, with a
    note, where torch or transformers is not installed (compiling needs neither; preflight plans again)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("note: torch / transformers are not installed here: the memory plan is left to preflight", flush=True)
        return []
    return refusals(plan(preset)[1])
