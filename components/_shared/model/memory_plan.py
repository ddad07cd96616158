"""The memory of a training stage per GPU, before GPUs are spent (`qvl plan`, preflight and the rehearsal use it).

    plan_stage(stage, stage_config, profile, meta_model(config), config)   # profile: gpus, nodes, accelerator_type

Per stage and for the preset's cluster profile: parameters (total / trainable, counted on the meta device from
the base model's config, trainability by the stage's settings), weights + gradients + AdamW states per GPU under
its ZeRO stage or offload, activations at its token budget with and without gradient checkpointing, the logits at
the vocabulary, the frozen models it keeps (RL's reference and reward model, distill's teacher), and whether it
fits the profile's GPU (a stage whose profile gives it no GPU is reported as not planned on one). The planner refuses
a preset that cannot fit and names the setting to change, and a distill student larger than its teacher.

An estimate, written by hand (no library plans multimodal packed training), from these rules: fp32 master weights,
gradients and two AdamW moments per trainable parameter (the stages train in fp32 with bf16 autocast on GPUs);
ZeRO-2 shards gradients and optimizer states over the data-parallel GPUs, ZeRO-3 the weights too; activations per
LM layer and token 2 bytes x (18 hidden + 6 intermediate), per ViT block and patch the same over the vision widths,
one layer's worth plus the layer inputs with checkpointing; the loss's logits for one chunk of
`train.loss_chunk_tokens` rows (`logits_bytes`). On the CPU
(`device="cpu"`, what `qvl rehearse` runs) activations are fp32, the process adds BASELINE_GB, and its peak may be
the export instead of training (the weights, a cast copy and its serialization buffer: LoRA's peak).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GB = 2**30
ConfigOf = Callable[[str], object | None]  # a model URI -> its transformers config (None: unknown)
# A stage process before any model: python, torch, transformers, deepspeed, the tokenizer and the data. Fitted:
# the rehearsal's non-training processes (clean_data, extract_features) peak at 2.0-2.5 GB holding data and a ViT.
BASELINE_GB = 1.5
TRAINING_STAGES = ("pretrain", "sft", "reward_model", "rl", "distill")


@dataclass
class StagePlan:
    stage: str
    gpus: int
    zero: str
    params_total: int
    params_trainable: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    activations_checkpointed_gb: float
    logits_gb: float
    frozen_models_gb: float
    total_gb: float
    gpu_gb: float | None
    notes: list[str] = field(default_factory=list)
    fix: str = ""  # for a stage that does not fit: the change that makes it fit (`suggest`)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_gb is None else self.total_gb <= 0.9 * self.gpu_gb


def gpu_memory_gb(accelerator_type: str | None) -> float | None:
    """GPU memory from the accelerator label value (NVIDIA-H100-80GB-HBM3 -> 80; H200 -> 141)."""
    if not accelerator_type:
        return None
    if match := re.search(r"(\d+)\s*GB", accelerator_type, re.IGNORECASE):
        return float(match.group(1))
    known = {"H200": 141.0, "H100": 80.0, "A100": 80.0, "L40S": 48.0, "L4": 24.0, "A10G": 24.0}
    return next((v for k, v in known.items() if k in accelerator_type.upper()), None)


def meta_model(config):
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def _group_sizes(model) -> dict[str, int]:
    from components._shared.model.vlm import parameter_groups

    sizes: dict[str, int] = {}
    for group, _, param in parameter_groups(model):
        sizes[group] = sizes.get(group, 0) + param.numel()
    return sizes


def _lora_parameters(model, targets: list[str], r: int) -> int:
    import torch

    pattern = re.compile(r".*(?:" + "|".join(f"(?:{t})" for t in targets) + r")")
    return sum(
        r * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and pattern.fullmatch(name)
    )


def trainable(stage: str, cfg: dict, model, config, resolve: ConfigOf | None = None) -> tuple[int, int, int, list[str]]:
    """(trainable parameters, parameters of the frozen models the stage keeps, their bytes per parameter, notes)."""
    from components._shared.model.families import family_for

    sizes = _group_sizes(model)
    total = sum(sizes.values())
    hidden = config.text_config.hidden_size

    def minus(frozen) -> int:
        return total - sum(sizes.get(g, 0) for g in frozen)

    if stage == "pretrain":
        if cfg["stage2"]["enabled"]:
            return minus(cfg["stage2"]["freeze"]), 0, 0, ["stage 2 (joint, from pixels)"]
        groups = ["merger"] + (["lm_lower", "lm_upper"] if cfg["stage1"]["train_lm"] else [])
        return sum(sizes.get(g, 0) for g in groups), 0, 0, ["stage 1 (" + " + ".join(groups) + ")"]
    if stage == "sft":
        if cfg["mode"] == "full":
            return minus(cfg["freeze"]), 0, 0, ["full"]
        targets = cfg["lora"]["target_modules"] or family_for(config).lora_targets
        notes = [f"{cfg['mode']} r={cfg['lora']['r']}"]
        if cfg["mode"] == "qlora":
            notes.append("4-bit LM counted at fp32: a bound")
        return _lora_parameters(model, targets, cfg["lora"]["r"]), 0, 0, notes
    if stage == "reward_model":
        return minus(cfg["freeze"]) + hidden + 1, 0, 0, ["backbone + scalar head"]
    if stage == "rl":
        head = hidden + 1 if cfg["algorithm"] == "ppo" else 0
        keeps_rm = float(cfg["rewards"].get("reward_model", 0)) > 0
        notes = [cfg["algorithm"], "frozen reference" + (" + reward model" if keeps_rm else "")]
        return minus(cfg["freeze"]) + head, total * (2 if keeps_rm else 1), 2, notes
    if stage == "distill":
        student = _student_parameters(cfg, config, resolve)
        teacher_bytes = 4 if cfg.get("teacher_dtype") == "float32" else 2
        if student < 0:  # counted as large as the teacher: a bound
            return total, total, teacher_bytes, ["student sizes known only after pruning: counted as the teacher"]
        if student > total:
            raise ValueError(
                f"distill.student: the student has {student / 1e9:.2f}B parameters, more than its teacher's "
                f"{total / 1e9:.2f}B; distillation makes a smaller model: lower distill.student's sizes (layers, "
                "hidden, ...) or name a smaller checkpoint as distill.student.model_uri."
            )
        return student, total, teacher_bytes, [f"student {student / total:.2f}x, frozen teacher"]
    raise ValueError(f"{stage} does not train")


def _student_parameters(cfg: dict, config, resolve: ConfigOf | None) -> int:
    from components._shared.model.vlm import student_config

    s = cfg["student"]
    if s["init"] == "model":  # a given checkpoint: its config (a known name's, or a local directory's config.json)
        student = resolve(s["model_uri"]) if resolve else None
        if student is None and Path(s["model_uri"], "config.json").is_file():
            from transformers import AutoConfig

            student = AutoConfig.from_pretrained(s["model_uri"])
        if student is None:
            raise ValueError(
                f"distill.student.model_uri={s['model_uri']!r} is neither a known checkpoint name nor a local "
                "directory; the planner needs the student's config."
            )
        return sum(p.numel() for p in meta_model(student).parameters())
    sizes = {
        "layers": s["layers"] or config.text_config.num_hidden_layers,
        "hidden": s["hidden"] or None,
        "intermediate": s["intermediate"] or None,
        "kv_heads": s["kv_heads"] or None,
        "vision_depth": s["vision_depth"] or None,
        "vision_hidden": s["vision_hidden"] or None,
        "vision_intermediate": s["vision_intermediate"] or None,
    }
    try:
        return sum(p.numel() for p in meta_model(student_config(config, **sizes)).parameters())
    except ValueError:  # sizes a pruned student reaches (whole heads removed) but a fresh config cannot describe
        return -1


def _train_block(stage: str, cfg: dict) -> dict:
    if stage == "pretrain":
        return cfg["stage2"]["train"] if cfg["stage2"]["enabled"] else cfg["stage1"]["train"]
    return cfg["train"]


def activation_bytes(config, tokens: int, *, checkpointed: bool, bytes_per_value: int) -> float:
    """Activations kept for backward of one micro-batch of `tokens` (text + visual tokens; the ViT sees 4 patches
    per visual token, counted as if every token were visual: the bound)."""
    text, vision = config.text_config, config.vision_config
    from components._shared.model.families import family_for

    family = family_for(config)
    v_hidden, v_inter = family.vision_width(vision), family.vision_intermediate(vision)
    per_layer = tokens * (18 * text.hidden_size + 6 * family.lm_mlp_width(text)) * bytes_per_value
    patches = tokens * vision.spatial_merge_size**2
    per_block = patches * (18 * v_hidden + 6 * v_inter) * bytes_per_value
    layers, blocks = text.num_hidden_layers, vision.depth
    if not checkpointed:
        return layers * per_layer + blocks * per_block
    inputs = (layers * tokens * text.hidden_size + blocks * patches * v_hidden) * bytes_per_value
    return inputs + per_layer + per_block


def logits_bytes(tokens: int, vocab: int, chunk: int, width: int) -> float:
    """The LM-head loss's logits memory of one micro-batch: chunked (train.loss_chunk_tokens > 0), one chunk's fp32
    logits with the loss's copies of them (~4, bench/logits_memory.py); else the whole micro-batch's logits in the
    compute dtype and their gradient plus the fp32 rows of the loss (all tokens: a bound)."""
    if chunk > 0:
        return min(chunk, tokens) * vocab * 16
    return tokens * vocab * (2 * width + 8)


def plan_stage(
    stage: str,
    cfg: dict,
    profile,
    model,
    config,
    *,
    device: str = "gpu",
    suggest_fix: bool = True,
    resolve: ConfigOf | None = None,
) -> StagePlan:
    """The plan of one stage (`cfg`: its validated section) on `profile` (gpus, nodes, accelerator_type) for the
    base `model` (on the meta device) and its `config`; `resolve(uri)` gives another model's config (distill's
    student) or None."""
    train = _train_block(stage, cfg)
    n = max(1, profile.gpus * profile.nodes) if device == "gpu" else 1
    deepspeed = train["backend"] == "deepspeed" and device == "gpu"
    zero = int(train["zero_stage"]) if deepspeed else 0
    offload = deepspeed and train["offload_optimizer"]
    params = sum(p.numel() for p in model.parameters())
    trained, frozen_params, frozen_bytes, notes = trainable(stage, cfg, model, config, resolve)
    if stage == "distill":  # the student is what trains; the teacher is a frozen model beside it
        params = trained
    # DeepSpeed with bf16 casts the module to bf16 and keeps the fp32 master weights (with fp32 gradient partitions
    # and Adam's moments: 16 bytes per trained parameter) in its optimizer; otherwise fp32 weights and gradients
    # (bf16 autocast) and 8 bytes of moments.
    ds_bf16 = deepspeed and train["precision"] in ("bf16", "auto")
    weights = (2 if ds_bf16 else 4) * params / (n if zero == 3 else 1)
    grads = (2 if ds_bf16 else 4) * trained / (n if zero >= 2 else 1)
    optimizer = 0.0 if offload else (16 if ds_bf16 else 8) * trained / (n if zero >= 1 else 1)
    width = 2 if device == "gpu" else 4  # bf16 autocast on GPUs, fp32 on the CPU
    frozen = frozen_params * (frozen_bytes if device == "gpu" else 4)
    if stage == "rl" and deepspeed and cfg.get("frozen_sharding") == "zero3":  # the reference partitioned over n
        reference = sum(p.numel() for p in model.parameters()) * (frozen_bytes if device == "gpu" else 4)
        frozen -= reference * (1 - 1 / n)
        notes = [*notes, f"reference ZeRO-3 over {n}"]
    tokens = int(train["max_tokens_per_micro_batch"])
    plain = activation_bytes(config, tokens, checkpointed=False, bytes_per_value=width)
    saved = activation_bytes(config, tokens, checkpointed=True, bytes_per_value=width)
    vocab = config.text_config.vocab_size
    logits = logits_bytes(tokens, vocab, int(train.get("loss_chunk_tokens", 1024)), width)
    every = int(train.get("checkpoint_every_n_layers", 1))  # every n-th block recomputed, the rest keep theirs
    activations = saved + (plain - saved) * (1 - 1 / every) if train["gradient_checkpointing"] else plain
    total = weights + grads + optimizer + frozen + activations + logits
    if device == "cpu":  # the process also exports: a cast copy of the weights and its serialization buffer
        total = max(total, weights + frozen + 4 * params) + BASELINE_GB * GB
    unplanned = device == "gpu" and profile.gpus == 0  # a training stage whose pod holds no GPU
    gpu = gpu_memory_gb(profile.accelerator_type) if device == "gpu" and not unplanned else None
    if unplanned:
        notes = [
            f"not planned on a GPU: kubernetes.stages.{stage}.gpus is 0, so its pod gets none and it would train on "
            "the CPU; give it gpus: 1 or more to plan it"
        ]
    fix = ""
    if suggest_fix and gpu is not None and total / GB > 0.9 * gpu:
        fix = suggest(stage, cfg, profile, model, config, resolve)
    return StagePlan(
        stage=stage,
        gpus=0 if unplanned else n,
        zero=("offload " if offload else "") + (f"ZeRO-{zero}" if deepspeed else "torch (no ZeRO)"),
        params_total=params,
        params_trainable=trained,
        weights_gb=weights / GB,
        grads_gb=grads / GB,
        optimizer_gb=optimizer / GB,
        activations_gb=plain / GB,
        activations_checkpointed_gb=saved / GB,
        logits_gb=logits / GB,
        frozen_models_gb=frozen / GB,
        total_gb=total / GB,
        gpu_gb=gpu,
        notes=notes + ([_checkpointing_note(every)] if train["gradient_checkpointing"] else []),
        fix=fix,
    )


def _checkpointing_note(every: int) -> str:
    return "gradient checkpointing" + (f" (every {every} blocks)" if every > 1 else "")


def suggest(stage: str, cfg: dict, profile, model, config, resolve: ConfigOf | None = None) -> str:
    """The first single change of the stage's train block that makes it fit, with the total it gives."""
    from components._shared.platform.presets import deep_merge

    key = (
        "stage2.train"
        if stage == "pretrain" and cfg["stage2"]["enabled"]
        else ("stage1.train" if stage == "pretrain" else "train")
    )
    train = _train_block(stage, cfg)
    changes: list[dict] = [{"gradient_checkpointing": True}]
    if train["backend"] == "deepspeed":
        changes += [{"zero_stage": 3}, {"zero_stage": 3, "gradient_checkpointing": True}, {"offload_optimizer": True}]
        if stage == "rl" and cfg.get("frozen_sharding") != "zero3" and profile.gpus * profile.nodes > 1:
            zero3 = {**cfg, "frozen_sharding": "zero3"}
            trial = plan_stage(stage, zero3, profile, model, config, suggest_fix=False, resolve=resolve)
            if trial.fits:
                return f"set rl.frozen_sharding: zero3 ({trial.total_gb:.1f} GB)"
    tokens = int(train["max_tokens_per_micro_batch"])
    changes += [{"max_tokens_per_micro_batch": tokens // f, "gradient_checkpointing": True} for f in (2, 4, 8)]
    if train["backend"] == "deepspeed":
        changes += [
            {"zero_stage": 3, "gradient_checkpointing": True, "max_tokens_per_micro_batch": tokens // f} for f in (2, 4)
        ]
    for change in changes:
        nested: dict = change
        for part in reversed(key.split(".")):
            nested = {part: nested}
        trial = plan_stage(stage, deep_merge(cfg, nested), profile, model, config, suggest_fix=False, resolve=resolve)
        if trial.fits:
            settings = ", ".join(f"{stage}.{key}.{k}: {str(v).lower()}" for k, v in change.items())
            return f"set {settings} ({trial.total_gb:.1f} GB)"
    more = f"more GPUs (kubernetes.stages.{stage}.gpus / nodes), "  # every planned stage runs on several
    return (
        f"no single train setting fits; give it {more}a larger GPU (kubernetes.stages.{stage}.accelerator_type) "
        f"or freeze more ({stage}.freeze)"
    )


def refusals(plans: list[StagePlan]) -> list[str]:
    """One line per stage that does not fit its GPU, with the setting to change."""
    return [
        f"{p.stage}: needs {p.total_gb:.1f} GB per GPU, the profile's GPU has {p.gpu_gb:.0f} GB (90% usable); {p.fix}."
        for p in plans
        if p.fits is False
    ]
