"""Preflight's checks that the run can end, before any GPU is asked for: every training stage fits its pod's GPUs
(the memory planner, model/memory_plan.py, on the resolved base model's config), and every metric that
select_checkpoint weighs or gates is one the held-out data yields (a weight on `cider_d` with no caption task would
fail the last stage, after every GPU hour was spent)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from components._shared.data import tasks as T
from components._shared.model.memory_plan import TRAINING_STAGES, meta_model, plan_stage, refusals

# What select_checkpoint measures of every candidate, whatever the data (reward_model_score: with a reward model).
ALWAYS_MEASURED = ("parameters", "latency_ms")


class Profile:
    """A stage's pod as the planner reads it (pipelines/k8s.py StageProfile, passed to preflight as a dict)."""

    def __init__(self, gpus: int = 1, nodes: int = 1, accelerator_type: str | None = None, **_: Any) -> None:
        self.gpus, self.nodes, self.accelerator_type = int(gpus), int(nodes), accelerator_type


def check_fits(
    stage_configs: dict[str, dict[str, Any]],
    gpu_profiles: dict[str, dict[str, Any]],
    base: dict[str, Any],
    models: dict[str, dict[str, Any]],
) -> int:
    """Plan every training stage of the DAG on its pod (`gpu_profiles`: stage -> gpus, nodes, accelerator_type) for
    the base model's config.json `base` (`models`: every resolved model URI's, for distill's student); raise with
    the planner's line for each stage that cannot fit. Returns how many stages were planned."""
    config = transformers_config(base)
    model = meta_model(config)

    def resolve(uri: str):
        return transformers_config(models[uri]) if uri in models else None

    plans = [
        plan_stage(stage, stage_configs[stage], Profile(**gpu_profiles[stage]), model, config, resolve=resolve)
        for stage in TRAINING_STAGES
        if stage in stage_configs and stage in gpu_profiles
    ]
    problems = refusals(plans)
    if problems:
        raise ValueError(
            "the run cannot end: a training stage does not fit its GPUs (qvl plan says the same before submitting):\n"
            + "\n".join(problems)
        )
    return len(plans)


def transformers_config(config_json: dict[str, Any]):
    """A transformers config from a checkpoint's config.json contents (read in place, e.g. on S3, by preflight)."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_json))
        return AutoConfig.from_pretrained(tmp)


def yielded_metrics(records: list[dict], *, reward_model: bool) -> set[str]:
    """The metric names select_checkpoint's held-out suite yields on these records (their tasks and benchmarks),
    found by summarising them as if answered (the keys do not depend on the answers)."""
    rows = [{**r, "prediction": r.get("answer") or (r.get("answers") or [""])[0]} for r in records]
    found = set(T.summarize(rows)) | set(ALWAYS_MEASURED)
    return found | {"reward_model_score"} if reward_model else found


def check_selection(select_config: dict[str, Any], records: list[dict], *, reward_model: bool) -> None:
    """Refuse weights and gates that name a metric the held-out data does not yield, naming the ones it does."""
    yielded = yielded_metrics(records, reward_model=reward_model)
    named = {
        f"select_checkpoint.{field}.{metric}"
        for field in ("weights", "min_gates", "max_gates")
        for metric, value in (select_config.get(field) or {}).items()
        if metric not in yielded and (value or field != "weights")  # a zero weight counts for nothing
    }
    if named:
        shown = sorted(m for m in yielded if not m.startswith("count/"))
        raise ValueError(
            f"{', '.join(sorted(named))}: the held-out data yields no such metric (its tasks and benchmarks give "
            f"{shown}); weigh and gate what the data measures (docs/stages/select_checkpoint.md)."
        )


def check_pretrain_captions(records: list[dict]) -> int:
    """pretrain measures held-out caption loss and retrieval on the held-out captions (task caption, or a task scored
    by cider_d, e.g. COCO Captions); refuse held-out data with fewer than two before any GPU. Returns the count."""
    captions = sum(1 for r in records if r.get("type") == "caption" or r.get("scorer") == "cider_d")
    if captions < 2:
        raise ValueError(
            f"the held-out data has {captions} caption records; pretrain needs >= 2 to measure held-out caption loss "
            "and retrieval: add captions (a `format: coco_captions` file, or records of task caption) to its eval "
            "files (docs/data.md)."
        )
    return captions


def check_curriculum(sft_config: dict[str, Any], records: list[dict]) -> None:
    """SFT's curriculum phases name difficulties its training data has (sft would stop at its start, on GPUs)."""
    from collections import Counter

    from components._shared.data.curriculum import curriculum_problem

    problem = curriculum_problem(
        sft_config.get("curriculum") or [], Counter(r.get("difficulty", "all") for r in records)
    )
    if problem:
        raise ValueError(problem)
