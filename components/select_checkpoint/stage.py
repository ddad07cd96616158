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
import logging
import math
import re
import shutil
import time
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
from components._shared.model.vlm import count_parameters, save_vlm, set_pixel_bounds
from components._shared.platform import progress
from components._shared.platform.tracking import Tracker
from components.select_checkpoint.candidates import Candidate, find_candidates, load_candidate
from components.select_checkpoint.card import model_card
from components.select_checkpoint.config import SUITE_METRICS, SelectCheckpointConfig

logger = logging.getLogger(__name__)


class NoCandidatePasses(ValueError):
    """Every candidate failed a gate (or none could be evaluated); the message lists each one's failure."""


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
    if not math.isfinite(candidate.score):  # a NaN score ranks anywhere: the winner would be chance
        terms = {k: f"{w:g} x {m.get(k, 0.0):.4g}" for k, w in cfg.weights.items()}
        raise ValueError(
            f"candidate {candidate.name} scores {candidate.score} (weights x metrics: {terms}): a weight too large "
            "for the sum or a metric that is not a number; give select_checkpoint.weights of ordinary size."
        )
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
    absent = [stage for stage in cfg.stages if not given[stage]]
    if absent and len(absent) < len(cfg.stages):  # none at all is the error below
        logger.warning(
            "select_checkpoint.stages lists %s, but no output of %s was given: not candidates (the pipeline gives only "
            "the stages it ran; by hand, pass --%s DIR).",
            cfg.stages,
            absent,
            absent[0],
        )
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
    model, processor, stored_dtype = load_candidate(winner, output_dir / SCRATCH)  # saved as its stage exported it
    save_vlm(
        model,
        processor,
        output_dir / "model",
        dtype=stored_dtype,
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


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(
        SelectCheckpointConfig,
        run,
        section="select_checkpoint",
        inputs=("data", "pretrain", "sft", "rl", "distill", "reward_model", "clean_data"),
        # the candidates are the stages of select_checkpoint.stages that are given (run() names a missing one)
        optional_inputs=("pretrain", "sft", "rl", "distill", "reward_model", "clean_data"),
        argv=argv,
    )
