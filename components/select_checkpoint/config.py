"""Config of the select_checkpoint stage. Imports pydantic only, so pipelines/ compiles without torch."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from components._shared.platform.config import StageConfig, SubConfig

QUESTION_TYPES = ("caption", "color", "count", "shape", "position", "relation", "grounding", "ocr")  # = tasks.py
SUITE_METRICS = (
    "vqa_exact_match",
    "grounding_accuracy",
    "anls",
    "cider_d",
    "reward_model_score",
    "parameters",
    "latency_ms",
)
CANDIDATE_STAGES = ("pretrain", "sft", "rl", "distill")


PER_DATA_METRIC = r"^(benchmark/[A-Za-z0-9][A-Za-z0-9_.-]*(/[a-z_0-9]+)?|task/[^/\s]+(/[a-z_0-9]+)?)$"


def check_metric_names(names, field: str) -> None:
    """Every name is a suite metric, exact_match/<synthetic task>, benchmark/<name>[/<metric>] or
    task/<name>[/<metric>] (those of the data's benchmarks and tasks); the error lists what is allowed."""
    allowed = (*SUITE_METRICS, *(f"exact_match/{t}" for t in QUESTION_TYPES))
    unknown = sorted(n for n in set(names) - set(allowed) if not re.match(PER_DATA_METRIC, n))
    if unknown:
        raise ValueError(
            f"{field}: unknown metric(s) {unknown}; choose from {list(allowed)}, benchmark/<name> (e.g. "
            "benchmark/docvqa, benchmark/pope/f1) or task/<name>."
        )


class SelectEvalConfig(SubConfig):
    per_type: Annotated[int | None, Field(ge=1)] = 50
    batch_size: Annotated[int, Field(ge=1)] = 64
    max_new_tokens: Annotated[int, Field(ge=1)] = 48


class SelectCheckpointConfig(StageConfig):
    """Evaluate every candidate on the held-out suite, pick the best by a weighted score among those passing the
    gates, export it, register it in the MLflow model registry (alias champion, runner-up challenger) and write
    its model card."""

    stages: list[Literal["pretrain", "sft", "rl", "distill"]] = Field(
        default_factory=lambda: list(CANDIDATE_STAGES),  # type: ignore[arg-type]  # the same four names
        description="Stages whose outputs compete.",
    )
    checkpoints_per_stage: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "Also the newest N intermediate checkpoints each stage kept (full-weight ones; a LoRA or ZeRO "
                "checkpoint is listed as skipped with its reason)."
            ),
        ),
    ] = 1
    weights: dict[str, float] = Field(
        default_factory=lambda: {"vqa_exact_match": 1.0, "grounding_accuracy": 0.5, "anls": 0.5, "cider_d": 0.05},
        description="score = sum(weight x metric); a negative weight penalises (e.g. latency_ms).",
    )
    min_gates: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Hard gates metric >= bound, per benchmark too (benchmark/refcoco: 0.68, benchmark/docvqa: 0.45 are the "
            "seeds' bars for a real 7B; docs/references.md)."
        ),
    )
    max_gates: dict[str, float] = Field(default_factory=dict, description="Hard gates metric <= bound.")
    registry_name: str = Field(
        "qvl-vlm",
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="MLflow registered model name.",
    )
    register_winner: bool = Field(True, description="Register the winner (needs a reachable MLflow tracking server).")
    min_pixels: Annotated[int, Field(ge=28 * 28)] = 56 * 56
    max_pixels: Annotated[int, Field(ge=28 * 28)] = 1280 * 28 * 28
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval: SelectEvalConfig = SelectEvalConfig()

    @field_validator("stages")
    @classmethod
    def _stages(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError(
                f"no stage competes; name at least one of {list(CANDIDATE_STAGES)} (the default is all four)."
            )
        return value

    @field_validator("weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        check_metric_names(value, "weights")
        if not any(value.values()):
            raise ValueError("weights are all 0; give at least one metric a weight (e.g. vqa_exact_match: 1.0).")
        return value

    @field_validator("min_gates", "max_gates")
    @classmethod
    def _gates(cls, value: dict[str, float], info) -> dict[str, float]:
        check_metric_names(value, info.field_name)
        return value

    @model_validator(mode="after")
    def _gates_can_pass(self):
        crossed = {k: (low, self.max_gates[k]) for k, low in self.min_gates.items() if self.max_gates.get(k, low) < low}
        if crossed:
            shown = ", ".join(f"{k} >= {low:g} and <= {high:g}" for k, (low, high) in crossed.items())
            raise ValueError(f"min_gates and max_gates ask {shown}: no candidate can pass; fix one bound.")
        return self
