"""The stage registry: stage name -> its config class and stage module, as import strings.

Strings keep this importable without torch; `load_config_class` and `load_stage` import on demand.
"""

from __future__ import annotations

import importlib
from types import ModuleType

STAGES: dict[str, tuple[str, str]] = {
    "preflight": ("components.preflight.config:PreflightConfig", "components.preflight.stage"),
    "clean_data": ("components.clean_data.config:CleanDataConfig", "components.clean_data.stage"),
    "extract_features": (
        "components.extract_features.config:ExtractFeaturesConfig",
        "components.extract_features.stage",
    ),
    "pretrain": ("components.pretrain.config:PretrainConfig", "components.pretrain.stage"),
    "sft": ("components.sft.config:SftConfig", "components.sft.stage"),
    "reward_model": ("components.reward_model.config:RewardModelConfig", "components.reward_model.stage"),
    "rl": ("components.rl.config:RlConfig", "components.rl.stage"),
    "distill": ("components.distill.config:DistillConfig", "components.distill.stage"),
    "select_checkpoint": (
        "components.select_checkpoint.config:SelectCheckpointConfig",
        "components.select_checkpoint.stage",
    ),
    "promote": ("components.promote.config:PromoteConfig", "components.promote.stage"),
}

# Stages in DAG order (preflight is a check, not a stage of the run summary's training flow).
DAG_ORDER: tuple[str, ...] = (
    "clean_data",
    "extract_features",
    "pretrain",
    "sft_data",
    "sft",
    "reward_model",
    "rl",
    "distill",
    "select_checkpoint",
    "promote",
)
# Steps: DAG tasks that run a stage's own code under their own name (their record, progress, cluster profile) with
# the stage's config section: step -> (stage, the module whose `run` it calls).
STEPS: dict[str, tuple[str, str]] = {"sft_data": ("sft", "components.sft.build_data")}
# In a DAG only when the setting at this path of the stage configs is true.
OPTIONAL: dict[str, tuple[str, ...]] = {
    "sft_data": ("sft", "build_data", "enabled"),
    "promote": ("promote", "enabled"),
}


def is_enabled(stage: str, stage_configs: dict[str, dict]) -> bool:
    """Whether `stage` runs in a DAG of these stage configs: always, or for an optional one when its setting says so."""
    if stage not in OPTIONAL:
        return True
    value: object = stage_configs
    for key in OPTIONAL[stage]:
        value = (value if isinstance(value, dict) else {}).get(key) or {}
    return value is True


def dag_stages(stage_configs: dict[str, dict], until: str | None = None) -> list[str]:
    """The stages a DAG runs, in order: DAG_ORDER up to and including `until` (all when None), without the optional
    stages whose config leaves them off."""
    if until is not None and until not in DAG_ORDER:
        first = (
            " (preflight runs first in every DAG: --until names the last stage after it)"
            if until == "preflight"
            else ""
        )
        raise ValueError(f"--until {until!r} is not a stage to stop at{first}; choose one of: {', '.join(DAG_ORDER)}.")
    if until is not None and not is_enabled(until, stage_configs):
        setting = ".".join(OPTIONAL[until])
        raise ValueError(
            f"--until {until}: {setting} is not true, so this DAG has no {until} task; set it, or stop earlier."
        )
    last = DAG_ORDER.index(until) if until else len(DAG_ORDER) - 1
    return [s for s in DAG_ORDER[: last + 1] if is_enabled(s, stage_configs)]


def _check(stage: str) -> tuple[str, str]:
    if stage not in STAGES:
        raise ValueError(f"Unknown stage '{stage}'. Known stages: {', '.join(STAGES)}.")
    return STAGES[stage]


def load_config_class(stage: str):
    """The pydantic config class of `stage`."""
    module_name, _, class_name = _check(stage)[0].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def load_stage(stage: str) -> ModuleType:
    """The stage module of `stage`, or a step's module (imports torch etc. where the stage needs them)."""
    return importlib.import_module(STEPS[stage][1] if stage in STEPS else _check(stage)[1])
