"""Config of the reward_model stage. Imports pydantic only, so pipelines/ compiles without torch."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from components._shared.model.train_config import (
    ModuleGroup,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
    TrainedStageConfig,
)


class RewardModelConfig(TrainedStageConfig):
    """Bradley-Terry reward model on {image, prompt, chosen, rejected} pairs, initialised from the SFT model."""

    score_first_k: Annotated[
        int,
        Field(
            ge=1,
            description=(
                "Reward sparsification: the reward is read at the K-th response token (or the last one when "
                "shorter), so text appended after K tokens cannot raise it."
            ),
        ),
    ] = 150
    likelihood_term: bool = Field(
        False,
        description=(
            "Add the backbone's mean log-probability of the answer (its tokens up to the K-th), times a learned "
            "weight starting at 1, to the head's score: what the SFT model knows about the image (a colour, a count) "
            "counts from the first step, where a head on one hidden state reads it out poorly."
        ),
    )
    margin: Annotated[
        float, Field(ge=0, description="Bradley-Terry margin: -log sigmoid(r_chosen - r_rejected - m).")
    ] = 0.0
    freeze: list[ModuleGroup] = Field(
        default_factory=list, description="Backbone module groups kept frozen (the head always trains)."
    )
    heldout_fraction: Annotated[
        float,
        Field(
            gt=0,
            lt=1,
            description=(
                "Share of the pairs held out for pair accuracy (chosen by a hash of the id, stable across runs)."
            ),
        ),
    ] = 0.2
    min_pixels: Annotated[int, Field(ge=28 * 28)] = 56 * 56
    max_pixels: Annotated[int, Field(ge=28 * 28)] = 1280 * 28 * 28
    max_length: Annotated[int, Field(ge=16)] = 4096
    max_records: Annotated[int | None, Field(ge=1)] = None
    train: TrainConfig = TrainConfig(steps=200, samples_per_step=16, max_tokens_per_micro_batch=2048)
    optim: OptimConfig = OptimConfig(lr=1e-4)
    schedule: ScheduleConfig = ScheduleConfig(warmup_steps=10)
