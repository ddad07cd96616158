"""Training-loop settings shared by the model stages (pretrain, sft, and later reward_model, rl, distill).

Pydantic only, so pipelines/ compiles without torch. A stage config nests these as `optim`, `schedule`
and `train` blocks; the loop itself is components/_shared/model/training.py.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from components._shared.platform import storage
from components._shared.platform.config import StageConfig, SubConfig

# The parameter groups of a Qwen VLM (model/vlm.py assigns every trainable parameter to exactly one): the one
# spelling of their names, for configs (freeze lists, per-group LRs) and the model code alike.
ModuleGroup = Literal["vision_lower", "vision_upper", "merger", "lm_lower", "lm_upper"]
MODULE_GROUPS: tuple[str, ...] = get_args(ModuleGroup)


def _check_groups(values: dict, what: str) -> dict:
    unknown = sorted(set(values) - set(MODULE_GROUPS))
    if unknown:
        raise ValueError(f"{what}: unknown module group(s) {unknown}; choose from {list(MODULE_GROUPS)}.")
    return values


class OptimConfig(SubConfig):
    """AdamW with one parameter group per module group (its own learning rate and gradient clip)."""

    lr: Annotated[float, Field(gt=0, le=1.0, description="Peak learning rate of every group without an override.")] = (
        1e-4
    )
    group_lr: dict[str, Annotated[float, Field(ge=0, le=1.0)]] = Field(
        default_factory=dict,
        description="Peak learning rate per module group, e.g. {vision_lower: 1e-6, merger: 1e-4}.",
    )
    weight_decay: Annotated[float, Field(ge=0, le=1.0)] = 0.0
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0)] = 1e-8
    max_grad_norm: Annotated[float, Field(gt=0, description="Gradient clip of every group without an override.")] = 1.0
    group_max_grad_norm: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="Gradient clip per module group (clipped on that group's own norm)."
    )
    fused: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch's fused AdamW kernel (one kernel launch for the whole update): auto = where the trained "
        "parameters are on a GPU and the optimizer is not offloaded, on = everywhere (the CPU too), off = the "
        "multi-tensor (foreach) AdamW everywhere.",
    )

    @field_validator("group_lr", "group_max_grad_norm")
    @classmethod
    def _known_groups(cls, value: dict, info) -> dict:
        return _check_groups(value, info.field_name)


class WarmupSegment(SubConfig):
    """One piece of a piecewise-linear warmup: over `fraction` of all steps, go to `lr_fraction` of the peak."""

    fraction: Annotated[float, Field(ge=0, le=1.0)]
    lr_fraction: Annotated[float, Field(ge=0, le=1.0)]


class ScheduleConfig(SubConfig):
    """Warmup then decay. `warmup_segments` replaces `warmup_steps` when set: a segmented warmup is
    [{fraction: 0.05, lr_fraction: 0.7}, {fraction: 0.05, lr_fraction: 0.7}, {fraction: 0.10, lr_fraction: 1.0}]."""

    decay: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    warmup_segments: list[WarmupSegment] = Field(default_factory=list)
    min_lr_ratio: Annotated[
        float, Field(ge=0, le=1.0, description="Final learning rate as a fraction of the peak.")
    ] = 0.0

    @model_validator(mode="after")
    def _segments_fit(self):
        total = sum(s.fraction for s in self.warmup_segments)
        if total > 1.0 + 1e-9:
            raise ValueError(f"warmup_segments cover {total:.2f} of the run; their fractions must sum to <= 1.")
        if self.warmup_segments and self.warmup_steps:
            raise ValueError("set warmup_steps or warmup_segments, not both.")
        return self


class TrainConfig(SubConfig):
    """Steps, batching, precision, DeepSpeed and checkpoints of one training run."""

    steps: Annotated[int, Field(ge=1, description="Optimizer steps.")] = 100
    samples_per_step: Annotated[
        int, Field(ge=1, le=1_000_000, description="Samples per optimizer step (all processes together; <= 1,000,000).")
    ] = 32
    max_tokens_per_micro_batch: Annotated[
        int, Field(ge=16, description="Token budget (text + visual) of one packed micro-batch.")
    ] = 4096
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 autocast on GPU, fp32 on CPU.")
    export_dtype: Literal["checkpoint", "float32", "bfloat16", "float16"] = Field(
        "checkpoint", description="dtype of the exported model/: checkpoint = the base checkpoint's (bf16 for Qwen's)."
    )
    gradient_checkpointing: bool = False
    checkpoint_every_n_layers: Annotated[
        int,
        Field(
            ge=1,
            description=(
                "With gradient_checkpointing: recompute only every n-th repeated block (ViT blocks and LM layers, "
                "in model order; transformers' every_n_layers); the others keep their activations. 1 = every block "
                "(one extra forward per step); 2 = half of them (about half the recompute for more memory)."
            ),
        ),
    ] = 1
    data_workers: Annotated[
        int | None,
        Field(
            ge=0,
            description=(
                "Processes that build the upcoming steps' inputs (decode, processor, tokenise, pack) while a step "
                "trains; 0 = each step's inputs built in the training process before it; null = 1 on a GPU, 0 on "
                "the CPU (where a worker competes with the step for the same cores). Same samples, same order."
            ),
        ),
    ] = None
    prefetch_steps: Annotated[int, Field(ge=1, description="Steps queued ahead per data worker.")] = 2
    loss_chunk_tokens: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "Target tokens per LM-head chunk in the losses (logits memory = chunk x vocabulary, not tokens x "
                "vocabulary); 0 = the whole micro-batch's logits at once."
            ),
        ),
    ] = 1024
    backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="torch = plain AdamW loop (per-group clipping); deepspeed = ZeRO engine (global clip)."
    )
    zero_stage: Literal[2, 3] = 2
    offload_optimizer: bool = Field(False, description="DeepSpeed: optimizer states on the CPU.")
    overlap_comm: bool | None = Field(
        None,
        description=(
            "DeepSpeed: reduce (ZeRO-3: also gather) gradients on a side stream while the backward runs, for buffers "
            "of about 4.5 x reduce_bucket_size; null = on with CUDA and more than one rank (one rank or the CPU: "
            "nothing to overlap)."
        ),
    )
    checkpoint_every: Annotated[int, Field(ge=0, description="Steps between checkpoints; 0 = only at the end.")] = 0
    keep_checkpoints: Annotated[int, Field(ge=1, description="Committed checkpoints kept (older ones deleted).")] = 2
    checkpoint_uri: str | None = Field(
        None,
        description=(
            "Checkpoint root (local dir or s3://); checkpoints go to ROOT/<stage>-<hash of config and inputs>, so a "
            "retried task resumes and a changed run starts fresh. null = the stage output's checkpoints/ (lost "
            "with a failed KFP task: set a root on a cluster)."
        ),
    )
    eval_every: Annotated[
        int, Field(ge=0, description="Steps between held-out evaluations; 0 = start and end only.")
    ] = 0
    log_every: Annotated[int, Field(ge=1)] = 10
    threads: Annotated[
        int,
        Field(
            ge=0,
            le=1024,
            description="torch intra-op threads (<= 1024); 0 leaves the default. Exact resume needs the same count.",
        ),
    ] = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @field_validator("checkpoint_uri")
    @classmethod
    def _local_or_s3(cls, value: str | None) -> str | None:
        return storage.check_location(value, "train.checkpoint_uri") if value else value


def lr_factor(step: int, total: int, schedule: ScheduleConfig) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based) of `total`."""
    points: list[tuple[float, float]] = [(0.0, 0.0)]
    if schedule.warmup_segments:
        at = 0.0
        for seg in schedule.warmup_segments:
            at += seg.fraction * total
            points.append((at, seg.lr_fraction))
    elif schedule.warmup_steps:
        points.append((schedule.warmup_steps, 1.0))
    warm_end, warm_value = points[-1]
    if len(points) > 1 and step < warm_end:
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if step < x1:
                # step+1 so that the first step already trains (a zero learning rate would waste it)
                return y0 + (y1 - y0) * min(1.0, (step + 1 - x0) / max(x1 - x0, 1e-9))
    peak = warm_value if len(points) > 1 else 1.0
    if schedule.decay == "constant":
        return peak
    progress = (step - warm_end) / max(1.0, total - warm_end)
    floor = schedule.min_lr_ratio * peak
    if schedule.decay == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def changed_fields(block: SubConfig, default: SubConfig) -> list[str]:
    """Names of the fields of `block` whose values differ from `default`'s (the settings a user gave a value)."""
    return [name for name in type(block).model_fields if getattr(block, name) != getattr(default, name)]


class TrainedStageConfig(StageConfig):
    """A stage that trains: one or more training runs, each a block with `train`, `optim` and `schedule` (the config
    itself, or sub-blocks such as pretrain's stage1 / stage2). Settings of a run that contradict each other are
    validation errors; settings that do nothing in this configuration are listed by `ignored_settings`."""

    def training_blocks(self) -> list[tuple[str, Any]]:
        """(setting prefix, block) of every training run that takes place (a block with `enabled: false` does not)."""
        candidates = [("", self)] + [(f"{name}.", getattr(self, name)) for name in type(self).model_fields]
        return [
            (prefix, block)
            for prefix, block in candidates
            if isinstance(getattr(block, "train", None), TrainConfig) and getattr(block, "enabled", True) is not False
        ]

    @model_validator(mode="after")
    def _training_settings_agree(self):
        for prefix, block in self.training_blocks():
            clips = block.optim.group_max_grad_norm
            if block.train.backend == "deepspeed" and clips:
                raise ValueError(
                    f"{prefix}optim.group_max_grad_norm={dict(clips)} with {prefix}train.backend: deepspeed: DeepSpeed "
                    f"clips the whole model's gradient norm once, so per-group clips cannot apply (the smallest would "
                    f"clip every group); set {prefix}optim.max_grad_norm, or {prefix}train.backend: torch."
                )
        return self

    def ignored_settings(self) -> list[str]:
        notes = super().ignored_settings()
        for prefix, block in self.training_blocks():
            train, schedule = block.train, block.schedule
            deepspeed_only = [
                name
                for name in ("offload_optimizer", "zero_stage", "overlap_comm")
                if getattr(train, name) != TrainConfig.model_fields[name].default
            ]
            if train.backend == "torch":
                notes += [
                    f"{prefix}train.{name}: a DeepSpeed setting; train.backend is torch" for name in deepspeed_only
                ]
            notes += [
                f"{prefix}train.{name}={getattr(train, name)} > {prefix}train.steps={train.steps}: never reached "
                f"(as {name}: 0, {what} at the end only)"
                for name, what in (
                    ("eval_every", "held-out evaluation at the start and"),
                    ("checkpoint_every", "a checkpoint"),
                )
                if getattr(train, name) > train.steps
            ]
            if train.checkpoint_every_n_layers != 1 and not train.gradient_checkpointing:
                notes.append(
                    f"{prefix}train.checkpoint_every_n_layers={train.checkpoint_every_n_layers}: "
                    f"{prefix}train.gradient_checkpointing is off"
                )
            if schedule.warmup_steps >= train.steps:
                reached = lr_factor(train.steps - 1, train.steps, schedule)
                notes.append(
                    f"{prefix}schedule.warmup_steps={schedule.warmup_steps} >= {prefix}train.steps={train.steps}: the "
                    f"learning rate rises to {reached:.2f} of optim.lr and its {schedule.decay} decay never starts"
                )
        return notes
