"""select_checkpoint: evaluate every candidate model on the held-out suite, pick the best one that passes the gates,
export it, register it in MLflow (alias champion; the runner-up challenger) and write its model card.

1 process:        python -m components.select_checkpoint --config pipelines/presets/tiny.yaml --data DIR \
                      --pretrain OUT/pretrain --sft OUT/sft --rl OUT/rl --distill OUT/distill \
                      --reward-model OUT/reward_model/model --clean-data OUT/clean_data --output-dir OUT/select
In the pipeline:  components/select_checkpoint/component.py calls run_stage("select_checkpoint", ...).

Candidates: each named stage's output model/ and its newest `checkpoints_per_stage` intermediate checkpoints (one
holding LoRA or ZeRO shards, or identical to the output, is listed as skipped with the reason). Each is scored on the
held-out data per task and benchmark (docs/data.md; the synthetic world's VQA, grounding, ANLS, CIDEr-D), by the
reward model, parameters and latency (ms per answer). score = sum(weights x metrics); the winner is the best that
passes every gate (ties: fewer parameters). Writes model/, candidates.json, model_card.md, eval_predictions.jsonl.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from components._shared.data import datasets
from components._shared.data import tasks as T
from components._shared.eval import evaluation as E
from components._shared.launch.result import RESULT_FILE
from components._shared.model import checkpoint as ckpt
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.stage_steps import SCRATCH
from components._shared.model.vlm import LoadedVlm, count_parameters, load_vlm, save_vlm, set_pixel_bounds
from components._shared.platform import progress, storage
from components._shared.platform.tracking import Tracker
from components.select_checkpoint.config import SUITE_METRICS, SelectCheckpointConfig

IGNORED_CHECKPOINT_KEYS = ("value_head.", "distill_projections.")  # training-only modules (rl's critic, distill's maps)


class NoCandidatePasses(ValueError):
    """Every candidate failed a gate (or none could be evaluated); the message lists each one's failure."""


@dataclass
class Candidate:
    name: str
    stage: str
    model_dir: Path  # the stage's output model/ (architecture, processor, frozen weights)
    checkpoint: Path | str | None = None  # an intermediate checkpoint (dir or s3:// URI) whose trainable weights
    #                                       replace the model's
    metrics: dict[str, float] = field(default_factory=dict)
    score: float = float("nan")
    failed_gates: list[str] = field(default_factory=list)
    skipped: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stage": self.stage,
            "model_dir": str(self.model_dir),
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "metrics": self.metrics,
            "score": self.score,
            "failed_gates": self.failed_gates,
            "skipped": self.skipped,
        }


def _step(path: Path) -> int:
    match = re.search(r"step-(\d+)$", path.name)
    return int(match.group(1)) if match else -1


def find_candidates(stage_dirs: dict[str, str], per_stage: int) -> list[Candidate]:
    """The stage outputs and their newest `per_stage` committed intermediate checkpoints, in stage order."""
    found = []
    for stage, directory in stage_dirs.items():
        if not directory:
            continue
        root = Path(directory)
        if not (root / "model" / "config.json").is_file():
            raise ValueError(
                f"select_checkpoint input {stage}={directory!r} has no model/config.json; pass the "
                f"{stage} stage's output directory."
            )
        found.append(Candidate(stage, stage, root / "model"))
        # (group, label, location): local ones under checkpoints/, or at the roots checkpoints.json names
        # (train.checkpoint_uri, e.g. s3://)
        committed: list[tuple[str, str, str | Path]] = (
            [
                (str(p.parent), str(p.relative_to(root / "checkpoints")), p)
                for p in (root / "checkpoints").rglob("step-*")
                # not another run's, set aside by checkpoint.py as <root>.stale-<key>
                if (p / storage.COMMIT_MARKER).is_file() and ".stale-" not in p.relative_to(root).as_posix()
            ]
            if (root / "checkpoints").is_dir()
            else []
        )
        elsewhere = ckpt.read_pointer(root)
        for location in elsewhere:
            for uri in storage.list_committed(location):
                step = Path(uri.rstrip("/")).name
                if step.startswith("step-"):
                    label = f"{Path(location.rstrip('/')).name}/{step}" if len(elsewhere) > 1 else step
                    committed.append((location, label, uri if storage.is_s3(uri) else Path(uri)))
        committed.sort(key=lambda c: (c[0], _step(Path(c[1]))), reverse=True)  # newest first within each group
        # one spare: the newest checkpoint is often the output itself (skipped as identical, not counted)
        for _, label, checkpoint in committed[: per_stage + 1] if per_stage else []:
            found.append(Candidate(f"{stage}@{label}", stage, root / "model", checkpoint))
    return found


def load_candidate(candidate: Candidate, scratch: Path) -> LoadedVlm:
    """(model, processor, stored dtype) of a candidate; raises ValueError with the reason a checkpoint cannot be used. A
    checkpoint on S3 is downloaded into `scratch` (every file checked against its sha256)."""
    from safetensors.torch import load_file

    loaded = load_vlm(candidate.model_dir)
    model = loaded.model
    if candidate.checkpoint is None:
        return loaded
    directory = Path(candidate.checkpoint)
    if storage.is_s3(str(candidate.checkpoint)):
        target = scratch / "checkpoints" / re.sub(r"[^\w.-]", "_", candidate.name)
        shutil.rmtree(target, ignore_errors=True)
        directory = storage.fetch_dir(str(candidate.checkpoint), target)
    weights_file = directory / "trainable.safetensors"
    if not weights_file.is_file():
        raise ValueError(
            f"no trainable.safetensors (a ZeRO-sharded checkpoint?): {sorted(p.name for p in directory.iterdir())[:4]}"
        )
    params = dict(model.named_parameters())
    weights, unknown, changed = load_file(str(weights_file)), [], False
    for key, value in weights.items():
        if key.startswith(IGNORED_CHECKPOINT_KEYS):
            continue
        name = key if key in params else key.removeprefix("model.") if key.removeprefix("model.") in params else None
        if name is None or params[name].shape != value.shape:
            unknown.append(key)
            continue
        changed = changed or not torch.equal(params[name].data, value)
        params[name].data.copy_(value)
    if unknown:
        raise ValueError(
            f"{len(unknown)} checkpoint tensor(s) do not fit the stage's model (a LoRA adapter "
            f"checkpoint?), e.g. {unknown[:2]}"
        )
    if not changed:
        raise ValueError("identical to the stage's output model")
    return loaded


def evaluate(model, processor, records: list[dict], cfg: SelectCheckpointConfig, scorer) -> tuple[dict, list[dict]]:
    """The candidate's suite metrics and per-record predictions."""
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    encoder = ConversationEncoder(processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    started = time.perf_counter()
    with torch.no_grad():
        summary, rows = E.evaluate_vqa(
            model, encoder, records, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens
        )
    seconds = time.perf_counter() - started
    metrics = {k: v for k, v in summary.items() if not k.startswith("count/")}
    metrics["parameters"] = float(count_parameters(model))
    metrics["latency_ms"] = 1000.0 * seconds / max(len(records), 1)
    if scorer is not None:
        scores = scorer.standardised(records, [row["prediction"] for row in rows])
        metrics["reward_model_score"] = sum(scores) / len(scores)
    return metrics, rows


def judge(candidate: Candidate, cfg: SelectCheckpointConfig) -> None:
    """Fill in the weighted score and the gates this candidate fails (a metric the suite lacks fails its gate)."""
    m = candidate.metrics
    candidate.score = sum(w * m.get(k, 0.0) for k, w in cfg.weights.items())
    for k, bound in cfg.min_gates.items():
        if k not in m or m[k] < bound:
            candidate.failed_gates.append(f"{k} {m.get(k, float('nan')):.4g} < {bound:g}")
    for k, bound in cfg.max_gates.items():
        if k not in m or m[k] > bound:
            candidate.failed_gates.append(f"{k} {m.get(k, float('nan')):.4g} > {bound:g}")


def check_weighted_metrics(candidates: list[Candidate], cfg: SelectCheckpointConfig) -> None:
    """A weight on a metric no candidate has would score them all 0 on it silently: name what the data yields."""
    have = {k for c in candidates if not c.skipped for k in c.metrics}
    missing = sorted(k for k, w in cfg.weights.items() if w and k not in have)
    if have and missing:
        offered = sorted(k for k in have if k.startswith(T.PER_DATA) or k in SUITE_METRICS)
        raise ValueError(f"select_checkpoint.weights name {missing}; the held-out data does not yield them: {offered}.")


def choose(candidates: list[Candidate]) -> tuple[Candidate, Candidate | None]:
    """(winner, runner-up) among evaluated candidates passing every gate; NoCandidatePasses otherwise."""
    passing = [c for c in candidates if not c.skipped and not c.failed_gates]
    if not passing:
        lines = [f"  {c.name}: {c.skipped or '; '.join(c.failed_gates)}" for c in candidates]
        raise NoCandidatePasses(
            "no candidate passes the gates (select_checkpoint.min_gates / max_gates):\n"
            + "\n".join(lines)
            + "\nRelax the gates in the preset or train the stages further."
        )
    ranked = sorted(passing, key=lambda c: (-c.score, c.metrics.get("parameters", 0.0), c.name))
    return ranked[0], ranked[1] if len(ranked) > 1 else None


def run(
    cfg: SelectCheckpointConfig,
    *,
    data: str,
    pretrain: str = "",
    sft: str = "",
    rl: str = "",
    distill: str = "",
    reward_model: str = "",
    clean_data: str = "",
    output_dir: str | Path,
    tracker: Tracker,
    stage_configs: dict[str, dict] | None = None,
) -> dict[str, Any]:
    """Evaluate, select, export, register; returns the selection and the winner's metrics."""
    output_dir = Path(output_dir)
    given = {"pretrain": pretrain, "sft": sft, "rl": rl, "distill": distill}
    candidates = find_candidates({s: given[s] for s in cfg.stages}, cfg.checkpoints_per_stage)
    if not candidates:
        raise ValueError(
            f"no candidates: pass the output directories of the stages in select_checkpoint.stages ({cfg.stages})."
        )
    data_dir = datasets.resolve_data_dir(data, scratch=output_dir / SCRATCH)
    records = datasets.load_eval_records(data_dir, per_type=cfg.eval.per_type)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("select_checkpoint.device=cuda but no CUDA GPU is visible; use device: auto or cpu.")
    use_cuda = cfg.device == "cuda" or cfg.device == "auto" and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    scorer = None
    if reward_model:
        from components._shared.model.reward_models import RewardModelScorer

        scorer = RewardModelScorer(reward_model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, device=device)
    predictions = evaluate_candidates(candidates, records, cfg, scorer, device, output_dir / SCRATCH, tracker)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "candidates.json").write_text(json.dumps([c.describe() for c in candidates], indent=2) + "\n")
    check_weighted_metrics(candidates, cfg)
    winner, runner_up = choose(candidates)  # raises with every candidate's failure when none passes

    export_winner(winner, predictions[winner.name], output_dir)
    lineage = _stage_results(
        {"clean_data": clean_data, **given, "reward_model": str(Path(reward_model).parent) if reward_model else ""}
    )
    version, challenger_version = "", ""
    if cfg.register_winner:
        # the same selection (config and inputs), retried after it registered, reuses its versions
        key = ckpt.fingerprint(cfg.model_dump(mode="json"), {"data": data, "reward_model": reward_model, **given})
        version, challenger_version = register(cfg, tracker, winner, runner_up, output_dir, key)
    metrics: dict[str, Any] = {
        "selected_candidate": winner.name,
        "selected_stage": winner.stage,
        "selected_score": winner.score,
        "runner_up": runner_up.name if runner_up else "",
        "candidates_evaluated": sum(1 for c in candidates if not c.skipped),
        "candidates_skipped": sum(1 for c in candidates if c.skipped),
        "candidates_failing_gates": sum(1 for c in candidates if c.failed_gates),
        "registered_model": cfg.registry_name if version else "",
        "registered_version": version,
        "challenger_version": challenger_version,
        **{f"selected_{k}": v for k, v in winner.metrics.items()},
    }
    card = model_card(cfg, candidates, winner, runner_up, metrics, lineage, stage_configs or {})
    (output_dir / "model_card.md").write_text(card)
    shutil.copyfile(output_dir / "model_card.md", output_dir / "model" / "README.md")  # travels with the model
    if version:  # the registered version's directory gets the card too (it names the version, so it comes last)
        tracker.log_artifact(output_dir / "model" / "README.md", "champion")
    (output_dir / "report.md").write_text(card)
    tracker.log_text(card, "model_card.md")
    shutil.rmtree(output_dir / SCRATCH, ignore_errors=True)
    return metrics


def export_winner(winner: Candidate, predictions: list[dict], output_dir: Path) -> None:
    """model/ (the winner, HF format, with where it came from) and its eval_predictions.jsonl."""
    model, processor, stored_dtype = load_candidate(winner, output_dir / SCRATCH)
    save_vlm(
        model,
        processor,
        output_dir / "model",
        dtype=stored_dtype,  # as the candidate's stage exported it
        metadata={
            "stage": "select_checkpoint",
            "selected_candidate": winner.name,
            "score": winner.score,
            "source": str(winner.checkpoint or winner.model_dir),
        },
    )
    with (output_dir / "eval_predictions.jsonl").open("w") as f:
        for row in predictions:
            f.write(json.dumps(row) + "\n")


def evaluate_candidates(
    candidates: list[Candidate],
    records: list[dict],
    cfg: SelectCheckpointConfig,
    scorer,
    device,
    scratch: Path,
    tracker: Tracker,
) -> dict[str, list[dict]]:
    """Score every candidate on the held-out suite and judge it against the gates; returns the predictions by
    name. A candidate that cannot be loaded, or beyond checkpoints_per_stage, keeps the reason it was skipped."""
    predictions: dict[str, list[dict]] = {}
    checkpoints_taken: dict[str, int] = {}
    for number, candidate in enumerate(candidates):
        progress.update("candidates", number, len(candidates), "candidates")
        if candidate.checkpoint is not None and checkpoints_taken.get(candidate.stage, 0) >= cfg.checkpoints_per_stage:
            candidate.skipped = f"beyond checkpoints_per_stage={cfg.checkpoints_per_stage}"
            continue
        try:
            model, processor, _ = load_candidate(candidate, scratch)
        except ValueError as error:
            candidate.skipped = str(error)
            continue
        if candidate.checkpoint is not None:
            checkpoints_taken[candidate.stage] = checkpoints_taken.get(candidate.stage, 0) + 1
        model.to(device).eval()
        candidate.metrics, predictions[candidate.name] = evaluate(model, processor, records, cfg, scorer)
        judge(candidate, cfg)
        key = re.sub(r"[^\w\-. :/]", ":", candidate.name)  # MLflow metric names: no '@'
        tracker.log_metrics(
            {f"candidate/{key}/{k}": v for k, v in {**candidate.metrics, "score": candidate.score}.items()}
        )
        del model
    return predictions


def register(
    cfg: SelectCheckpointConfig,
    tracker: Tracker,
    winner: Candidate,
    runner_up: Candidate | None,
    output_dir: Path,
    key: str,
) -> tuple[str, str]:
    """Register the exported winner as `champion` and the runner-up as `challenger`; returns their versions.
    `key` identifies the selection, so a retried task reuses the versions it registered."""
    tags = {"candidate": winner.name, "stage": winner.stage, "score": f"{winner.score:.6g}"}
    version = tracker.register_model(
        output_dir / "model",
        name=cfg.registry_name,
        artifact_path="champion",
        aliases=("champion",),
        tags=tags,
        description=f"champion: {winner.name}",
        key=f"{key}.champion",
    )
    if runner_up is None:
        return version, ""
    runner_dir = output_dir / SCRATCH / "challenger"
    runner_model, runner_processor, stored_dtype = load_candidate(runner_up, output_dir / SCRATCH)
    save_vlm(
        runner_model,
        runner_processor,
        runner_dir,
        dtype=stored_dtype,
        metadata={"stage": "select_checkpoint", "selected_candidate": runner_up.name},
    )
    challenger_version = tracker.register_model(
        runner_dir,
        name=cfg.registry_name,
        artifact_path="challenger",
        aliases=("challenger",),
        tags={"candidate": runner_up.name, "stage": runner_up.stage, "score": f"{runner_up.score:.6g}"},
        description=f"challenger: {runner_up.name}",
        key=f"{key}.challenger",
    )
    return version, challenger_version


def _stage_results(dirs: dict[str, str]) -> dict[str, dict]:
    """Each given stage output's recorded result (metrics, seconds), read from its _stage_result.json."""
    results = {}
    for stage, directory in dirs.items():
        path = Path(directory) / RESULT_FILE if directory else None
        if path is not None and path.is_file():
            results[stage] = json.loads(path.read_text())
    return results


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


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(
        SelectCheckpointConfig,
        run,
        section="select_checkpoint",
        inputs=("data", "pretrain", "sft", "rl", "distill", "reward_model", "clean_data"),
        argv=argv,
    )
