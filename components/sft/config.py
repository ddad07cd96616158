"""Config of the sft stage. Imports pydantic only, so pipelines/ compiles without torch."""

from __future__ import annotations

import math
import re
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


class LoraConfig(SubConfig):
    r: Annotated[int, Field(ge=1, le=1024)] = 16
    alpha: Annotated[float, Field(gt=0)] = 32.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: list[str] = Field(
        default_factory=list,
        description=(
            "Regexes (full match on module names, after any prefix) of the Linear layers that get adapters; each must "
            "match at least one Linear layer. Empty: the model family's defaults (LM attention + MLP, Qwen3.5's "
            "linear attention, the ViT qkv and every merger)."
        ),
    )
    require_targets: Annotated[
        list[str],
        Field(
            description=(
                "Module-name fragments that must have received adapters; the stage fails instead of silently skipping "
                "them (e.g. a renamed merger). Empty: the family's (its mergers, the ViT qkv, Qwen3.5's linear_attn)."
            )
        ),
    ] = Field(default_factory=list)

    @field_validator("target_modules")
    @classmethod
    def _regexes_compile(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"lora.target_modules: {pattern!r} is not a valid regex ({err}).") from None
        return value


class QLoraConfig(SubConfig):
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class CurriculumPhase(SubConfig):
    """Train `steps` steps on the records whose difficulty is in `difficulties` (empty = all), lr scaled; every name
    in `difficulties` must occur in the data (records without one are "all")."""

    name: str
    steps: Annotated[int, Field(ge=1)]
    difficulties: list[str] = Field(default_factory=list)
    lr_scale: Annotated[float, Field(gt=0, le=10)] = 1.0


class DifficultySchedulerConfig(SubConfig):
    """Online difficulty scheduling (docs/references.md): after each quick held-out eval, question types the model
    gets wrong more often are sampled more: weight(type) = floor + (1 - exact match(type)) ** sharpness."""

    enabled: bool = False
    floor: Annotated[
        float, Field(ge=0, le=1, description="Minimum weight of a type, so solved types are replayed.")
    ] = 0.1
    sharpness: Annotated[float, Field(gt=0, le=10)] = 1.0


class EvalConfig(SubConfig):
    per_type: Annotated[int, Field(ge=1, description="Held-out questions per question type.")] = 50
    batch_size: Annotated[int, Field(ge=1)] = 32
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 48


class CalibrationConfig(SubConfig):
    enabled: Annotated[
        bool, Field(description="Report `ece`: how well answer confidences match correctness on held-out answers.")
    ] = True
    fit_temperature: Annotated[
        bool,
        Field(
            description=(
                "Also fit a temperature on `fraction` of the answers and report ECE before/after on the rest (seed "
                "001's temperature scaling). Off by default: on the demo's three worlds it lowered held-out ECE by "
                "less than its spread over splits (docs/stages/sft.md, Calibration)."
            )
        ),
    ] = False
    fraction: Annotated[
        float,
        Field(
            gt=0,
            lt=1,
            description=("Share of the held-out answers used to fit the temperature; ECE is reported on the rest."),
        ),
    ] = 0.5

    @model_validator(mode="after")
    def _effective(self):
        if self.fit_temperature and not self.enabled:
            raise ValueError("calibration.fit_temperature needs calibration.enabled: true (it fits on the ECE pass).")
        return self


TEMPLATE_TYPES = ("caption", "color", "shape", "count", "position", "relation", "grounding", "ocr", "counterfactual")
BASIC_TYPES = frozenset({"caption", "color", "count", "shape"})  # the first curriculum phase's (the world's split)


class BuildDataConfig(SubConfig):
    """SFT conversations built from a cleaned lake (`python -m components.sft.build_data`, docs/stages/sft.md):
    templates over each image's GRIT-style regions, scored by the base model, near duplicates dropped, type quotas
    kept; every candidate kept or dropped with its reason (seed 000 3.2, seed 001 3.2 / 4.2)."""

    enabled: bool = Field(
        False,
        description=(
            "In a DAG: run the `sft_data` step between pretrain and sft, which builds SFT data with these settings "
            "from clean_data's output and the pretrained model; sft and distill then train on what it built "
            "(with the held-out questions of sft_data_uri). Off: they train on sft_data_uri as given."
        ),
    )
    templates: list[Literal[TEMPLATE_TYPES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(TEMPLATE_TYPES),
        description=(
            "Question types to generate. `count` counts the caption's annotated objects: leave it out for captions "
            "that do not name every object."
        ),
    )
    min_score: Annotated[float, Field(ge=0, le=1, description="Region chunks under this GRIT score are not used.")] = (
        0.5
    )
    keep_fraction: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description=(
                "Keep this top share of each type's candidates by the base model's likelihood of the answer "
                "(seed 000 keeps the reward model's top 30%); 1 keeps all."
            ),
        ),
    ] = 1.0
    dedup_similarity: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="Candidates of one image whose texts are more alike than this are near duplicates: the "
            "harder (less likely) one is kept.",
        ),
    ] = 0.85
    min_counterfactual: Annotated[
        float, Field(ge=0, le=0.5, description="Least share of counterfactual questions among the kept ones.")
    ] = 0.08
    max_type_share: Annotated[
        float, Field(gt=0, le=1, description="Most share of any one question type among the kept ones.")
    ] = 0.25
    max_answer_tokens: Annotated[
        int, Field(ge=1, le=4096, description="Answers (reasoning chains included) over this many tokens are dropped.")
    ] = 120
    max_records: Annotated[int | None, Field(ge=1, description="Keep at most this many conversations.")] = None
    include_given: Annotated[
        bool, Field(description="Train on the data directory's own SFT conversations beside the built ones.")
    ] = False
    seed: Annotated[int, Field(ge=0, lt=2**32, description="Picks each question's wording.")] = 0

    def difficulties(self) -> set[str]:
        """The `difficulty` values the built conversations take (what sft's curriculum phases can name)."""
        return {"basic" if t in BASIC_TYPES else "advanced" for t in self.templates}

    @model_validator(mode="after")
    def _quotas_possible(self):
        if self.min_counterfactual > 0 and "counterfactual" not in self.templates:
            raise ValueError(
                f"build_data.min_counterfactual={self.min_counterfactual} but 'counterfactual' is not in "
                "build_data.templates; add it, or set min_counterfactual: 0."
            )
        if self.min_counterfactual > self.max_type_share:  # counterfactual is one type: capped like the others
            raise ValueError(
                f"build_data.min_counterfactual={self.min_counterfactual} > max_type_share={self.max_type_share}: "
                "counterfactuals are one type, held under max_type_share, so the share asked cannot be reached; "
                "lower min_counterfactual or raise max_type_share."
            )
        if len(set(self.templates)) != len(self.templates):
            raise ValueError(f"build_data.templates lists a type twice: {self.templates}.")
        if not self.templates:
            raise ValueError("build_data.templates is empty: no conversation type would be built; name at least one.")
        if self.max_records is not None and self.max_records * self.max_type_share < 1:
            raise ValueError(
                f"build_data.max_records={self.max_records} x max_type_share={self.max_type_share} < 1: so few "
                "conversations cannot hold every type under its share (one alone is all of them); give max_records "
                f">= {math.ceil(1 / self.max_type_share)} or raise max_type_share."
            )
        if self.max_type_share * len(self.templates) < 1:
            raise ValueError(
                f"build_data.max_type_share={self.max_type_share} x {len(self.templates)} template types < 1: the "
                "quotas cannot add up to all the kept conversations; raise max_type_share or add templates."
            )
        return self


class SftConfig(TrainedStageConfig):
    """Supervised fine-tuning of a Qwen2(.5)-VL on image conversations (ShareGPT / LLaVA style)."""

    mode: Literal["lora", "qlora", "full"] = "lora"
    lora: LoraConfig = LoraConfig()
    qlora: QLoraConfig = QLoraConfig()
    freeze: list[ModuleGroup] = Field(default_factory=list, description="Module groups kept frozen in full mode.")
    min_pixels: Annotated[int, Field(ge=28 * 28)] = 56 * 56
    max_pixels: Annotated[int, Field(ge=28 * 28)] = 1280 * 28 * 28
    max_length: Annotated[int, Field(ge=16)] = 4096
    max_records: Annotated[int | None, Field(ge=1, description="Use at most this many training records.")] = None
    curriculum: list[CurriculumPhase] = Field(
        default_factory=list,
        description=(
            "Phases in order; their steps must sum to train.steps. Empty = one phase on everything. "
            "basic -> advanced -> all with falling learning rates."
        ),
    )
    train: TrainConfig = TrainConfig(steps=200, samples_per_step=32, max_tokens_per_micro_batch=2048)
    optim: OptimConfig = OptimConfig(lr=2e-4)
    schedule: ScheduleConfig = ScheduleConfig(warmup_steps=10)
    difficulty_scheduler: DifficultySchedulerConfig = DifficultySchedulerConfig()
    eval: EvalConfig = EvalConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    build_data: BuildDataConfig = BuildDataConfig()

    @model_validator(mode="after")
    def _consistent(self):
        if self.curriculum and sum(p.steps for p in self.curriculum) != self.train.steps:
            raise ValueError(
                f"curriculum steps sum to {sum(p.steps for p in self.curriculum)} but train.steps="
                f"{self.train.steps}; make them equal."
            )
        if self.difficulty_scheduler.enabled and not self.train.eval_every:
            raise ValueError("difficulty_scheduler needs train.eval_every > 0 (it reweights after each eval).")
        if self.mode == "qlora" and self.train.backend == "deepspeed":
            raise ValueError("mode=qlora runs with train.backend=torch (4-bit weights are not ZeRO-partitioned).")
        if self.freeze and self.mode != "full":
            raise ValueError(
                f"freeze={list(self.freeze)} applies to mode: full; with mode: {self.mode} the base weights are frozen "
                "already and only adapters train. To keep a module group unadapted, leave it out of "
                "lora.target_modules; to freeze groups of the full model, set mode: full."
            )
        return self

    def ignored_settings(self) -> list[str]:
        """LoRA settings in full mode, QLoRA's quantisation outside qlora mode."""
        notes = super().ignored_settings()
        if self.mode == "full":
            notes += [f"lora.{name}: a LoRA setting; mode is full" for name in changed_fields(self.lora, LoraConfig())]
        if self.mode != "qlora":
            notes += [
                f"qlora.{name}: a QLoRA setting; mode is {self.mode}"
                for name in changed_fields(self.qlora, QLoraConfig())
            ]
        if not self.calibration.fit_temperature and "fraction" in changed_fields(self.calibration, CalibrationConfig()):
            notes.append("calibration.fraction: the temperature's share; calibration.fit_temperature is false")
        if not self.build_data.enabled:  # enabled: a DAG's sft_data step reads them
            notes += [
                f"build_data.{name}: read by the sft_data step (build_data.enabled in a DAG) or `python -m "
                "components.sft.build_data`; the sft stage trains on --data"
                for name in changed_fields(self.build_data, BuildDataConfig())
            ]
        return notes
