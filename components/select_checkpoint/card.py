"""The champion's model card: what was selected and registered, by which rule, on which held-out results, with
the data lineage and every stage's metrics and settings."""

from __future__ import annotations

from typing import Any

from components._shared.data import tasks as T
from components.select_checkpoint.candidates import Candidate
from components.select_checkpoint.config import SelectCheckpointConfig


def _table(candidates: list[Candidate], keys: list[str]) -> list[str]:
    lines = ["| candidate | score | " + " | ".join(keys) + " | gates |", "|---" * (len(keys) + 3) + "|"]
    for c in candidates:
        if c.skipped:
            lines.append(f"| {c.name} | skipped | " + " | ".join("" for _ in keys) + f" | {c.skipped} |")
            continue
        values = " | ".join(f"{c.metrics[k]:.4g}" if k in c.metrics else "-" for k in keys)
        lines.append(f"| {c.name} | {c.score:.4f} | {values} | {'; '.join(c.failed_gates) or 'pass'} |")
    return lines


def model_card(
    cfg: SelectCheckpointConfig,
    candidates: list[Candidate],
    winner: Candidate,
    runner_up: Candidate | None,
    metrics: dict[str, Any],
    lineage: dict[str, dict],
    stage_configs: dict[str, dict],
) -> str:
    """Markdown: what was selected and registered, how, on what data, by which stages with which settings."""

    registered = (
        f"`{metrics['registered_model']}` version {metrics['registered_version']} (alias `champion`)"
        if metrics["registered_version"]
        else "not registered (no MLflow run)"
    )
    lines = [
        f"# Model card: {winner.name}",
        "",
        f"Selected **{winner.name}** (stage `{winner.stage}`) with score {winner.score:.4f}; registered as "
        f"{registered}." + (f" Runner-up: {runner_up.name} (alias `challenger`)." if runner_up else ""),
        "Loads with `AutoModelForImageTextToText.from_pretrained(dir)` and `AutoProcessor.from_pretrained(dir)`; "
        'from the registry: `mlflow.artifacts.download_artifacts("models:/NAME@champion")`.',
        "",
        "## Selection rule",
        "",
        "score = "
        + " + ".join(f"{w:g} x {k}" for k, w in cfg.weights.items())
        + "; gates: "
        + (
            ", ".join(
                [
                    *(f"{k} >= {v:g}" for k, v in cfg.min_gates.items()),
                    *(f"{k} <= {v:g}" for k, v in cfg.max_gates.items()),
                ]
            )
            or "none"
        )
        + ".",
        "",
        "## Held-out evaluation",
        "",
    ]
    keys = [
        "vqa_exact_match",
        "grounding_accuracy",
        "anls",
        "cider_d",
        "reward_model_score",
        "parameters",
        "latency_ms",
        *(f"exact_match/{t}" for t in T.SYNTHETIC_TASKS if t != "caption"),
        *sorted({k for c in candidates for k in c.metrics if k.startswith(T.PER_DATA)}),
    ]
    lines += _table(candidates, [k for k in keys if any(k in c.metrics for c in candidates)])
    lines += _lineage(lineage, stage_configs)
    return "\n".join(lines) + "\n"


def _lineage(lineage: dict[str, dict], stage_configs: dict[str, dict]) -> list[str]:
    """The card's data lineage (clean_data's accounting) and each stage's metrics and settings."""
    import yaml

    lines = ["", "## Data lineage", ""]
    clean = lineage.get("clean_data", {}).get("metrics", {})
    if clean:
        lines.append(
            f"Lake records in: {clean.get('records_in')}, kept: {clean.get('records_kept')}, rejected: "
            f"{clean.get('records_rejected')}."
        )
        for reason, count in sorted((clean.get("rejected_by_reason") or {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"- rejected `{reason}`: {count}")
    else:
        lines.append("clean_data's result was not given.")
    lines += ["", "## Stages", ""]
    for stage in ("clean_data", "pretrain", "sft", "reward_model", "rl", "distill"):
        if stage not in lineage and stage not in stage_configs:
            continue
        result = lineage.get(stage, {})
        lines.append(f"### {stage}" + (f" ({result['seconds']:.0f} s)" if "seconds" in result else ""))
        scalars = {k: v for k, v in result.get("metrics", {}).items() if isinstance(v, (int, float, str))}
        if scalars:
            lines.append(
                "Metrics: "
                + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(scalars.items()))
            )
        if stage in stage_configs:
            lines += ["", "```yaml", yaml.safe_dump(stage_configs[stage], sort_keys=True).strip(), "```"]
        lines.append("")
    return lines
