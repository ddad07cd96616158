"""Config of the pretrain stage. Imports pydantic only, so pipelines/ compiles without torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from components._shared.model.train_config import (
    ModuleGroup,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
    TrainedStageConfig,
    changed_fields,
)
from components._shared.platform.config import SubConfig


class Stage1Config(SubConfig):
    """ViT frozen; the merger (and optionally the LM) learns from cached pre-merger features."""

    train_lm: bool = Field(False, description="Also train the language model (otherwise only the merger).")
    train: TrainConfig = TrainConfig(steps=200, samples_per_step=32, max_tokens_per_micro_batch=2048)
    optim: OptimConfig = OptimConfig(lr=1e-3)
    schedule: ScheduleConfig = ScheduleConfig(warmup_steps=10)


class Stage2Config(SubConfig):
    """Joint training from pixels, after stage 1; runs only with `enabled: true` (the default skips it, and its other
    settings are then unused). Per-module learning rates via optim.group_lr."""

    enabled: bool = False
    freeze: list[ModuleGroup] = Field(default_factory=list, description="Module groups kept frozen in stage 2.")
    train: TrainConfig = TrainConfig(steps=100, samples_per_step=32, max_tokens_per_micro_batch=2048)
    optim: OptimConfig = OptimConfig(lr=1e-4, group_lr={"vision_lower": 1e-5, "vision_upper": 3e-5})
    schedule: ScheduleConfig = ScheduleConfig(warmup_steps=10)


class InfoNceConfig(SubConfig):
    """Auxiliary contrastive loss between pooled merged image tokens and pooled caption token embeddings
    (docs/references.md), in-batch negatives; `hard_negatives` keeps only the k most similar negatives."""

    weight: Annotated[float, Field(ge=0, description="0 disables the auxiliary loss.")] = 0.0
    temperature: Annotated[float, Field(ge=0.01, le=10)] = 0.07  # 1e-9 trained at loss 1e8 (eighth hostile pass)
    hard_negatives: Annotated[int, Field(ge=0, description="0 = all in-batch negatives.")] = 0


MIN_REGION_WEIGHT = 1e-4


class RegionStep(SubConfig):
    fraction: Annotated[float, Field(gt=0, le=1, description="Share of all pretraining steps (stage 1 + stage 2).")]
    weight: Annotated[float, Field(ge=0, le=10, description="The region loss's weight against the caption loss.")]

    @field_validator("weight")
    @classmethod
    def _zero_or_felt(cls, value: float) -> float:
        if 0 < value < MIN_REGION_WEIGHT:
            raise ValueError(
                f"a region weight of {value:g} moves nothing (under {MIN_REGION_WEIGHT:g} of the caption loss); give 0 "
                "for a segment without the region term, or a weight of at least that."
            )
        return value


class RegionConfig(SubConfig):
    """Region-phrase alignment (seed 000 2.2 / 3.1, seed 001 2.1; docs/stages/pretrain.md): the merged visual
    tokens under a caption phrase's box, averaged, are matched to that phrase's token embeddings against the other
    phrases of the micro-batch (InfoNCE). Boxes come from the kept records' GRIT-style `noun_chunks`
    ([start, end, x1, y1, x2, y2, score], the box relative to the image)."""

    enabled: bool = False
    schedule: list[RegionStep] = Field(
        default_factory=lambda: [
            RegionStep(fraction=0.3, weight=0.1),
            RegionStep(fraction=0.4, weight=0.3),
            RegionStep(fraction=0.3, weight=0.05),
        ],
        min_length=1,
        description="The weight over pretraining, piecewise constant (seed 000: 0.1 -> 0.3 -> 0.05 over 30/40/30%).",
    )
    temperature: Annotated[float, Field(ge=0.01, le=10)] = 0.07
    min_score: Annotated[float, Field(ge=0, le=1, description="Chunks scored lower are not used (counted).")] = 0.0

    @model_validator(mode="after")
    def _whole(self):
        total = sum(step.fraction for step in self.schedule)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"region.schedule fractions sum to {total:g}; they must cover all steps (sum to 1).")
        if self.enabled and not any(step.weight for step in self.schedule):
            raise ValueError(
                "region.schedule weights are all 0: the region term would train nothing; give a weight, "
                "or set region.enabled: false."
            )
        return self


class PretrainEvalConfig(SubConfig):
    heldout_captions: Annotated[int, Field(ge=2, description="Held-out caption records for the caption loss.")] = 64
    retrieval_candidates: Annotated[
        int,
        Field(
            ge=2,
            le=256,
            description=(
                "Images (and their captions) in the image->text retrieval pool; costs candidates^2 scored pairs."
            ),
        ),
    ] = 32


class PretrainConfig(TrainedStageConfig):
    """Image-caption alignment of a Qwen2(.5)-VL: stage 1 on cached features, optional stage 2 from pixels."""

    prompt: str = Field("Describe the image.", min_length=1, description="User turn that precedes each caption.")
    min_pixels: Annotated[int, Field(ge=28 * 28, description="Must equal extract_features' min_pixels.")] = 56 * 56
    max_pixels: Annotated[int, Field(ge=28 * 28, description="Must equal extract_features' max_pixels.")] = (
        1280 * 28 * 28
    )
    max_length: Annotated[int, Field(ge=16)] = 4096
    max_records: Annotated[int | None, Field(ge=1)] = None
    stage1: Stage1Config = Stage1Config()
    stage2: Stage2Config = Stage2Config()
    infonce: InfoNceConfig = InfoNceConfig()
    region: RegionConfig = RegionConfig()
    eval: PretrainEvalConfig = PretrainEvalConfig()
    keep_best_of_last: Annotated[
        int,
        Field(
            ge=1,
            description=(
                "Export the best of the last N evaluated checkpoints by held-out caption loss; set the "
                "last stage's train.keep_checkpoints >= N and eval_every = checkpoint_every."
            ),
        ),
    ] = 1
    selection_metric: Literal["heldout_caption_loss", "retrieval_r1"] = "heldout_caption_loss"

    @model_validator(mode="after")
    def _consistent(self):
        last = self.stage2.train if self.stage2.enabled else self.stage1.train
        if self.keep_best_of_last > last.keep_checkpoints:
            raise ValueError(
                f"keep_best_of_last={self.keep_best_of_last} needs the last stage's "
                f"train.keep_checkpoints >= {self.keep_best_of_last} (it is {last.keep_checkpoints})."
            )
        if self.keep_best_of_last > 1 and last.eval_every != last.checkpoint_every:
            raise ValueError(
                "keep_best_of_last > 1 needs the last stage's train.eval_every == checkpoint_every, so "
                "every kept checkpoint has a held-out score."
            )
        return self

    def ignored_settings(self) -> list[str]:
        """Region and InfoNCE settings while their term is off."""
        notes = super().ignored_settings()
        if not self.region.enabled:
            notes += [
                f"region.{name}: a region setting; region.enabled is false"
                for name in changed_fields(self.region, RegionConfig())
            ]
        if not self.infonce.weight:
            notes += [
                f"infonce.{name}: an InfoNCE setting; infonce.weight is 0"
                for name in changed_fields(self.infonce, InfoNceConfig())
                if name != "weight"
            ]
        return notes
