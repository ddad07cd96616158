"""The steps every model stage takes around its training loop, in one place.

    store = checkpoint_store("sft", cfg.train, run_key(cfg, {"base_model": ..., "data": ...}), output_dir)
    ...train with a TrainLoop on `store`...
    model = trained_module(loop, rebuild)          # None on ranks > 0 (they stop here)
    metrics = {**loop_metrics(result), ...}
    finish_report(output_dir, tracker, report(metrics), [Figure("train_loss", "training loss", series)],
                  set_aside=result.set_aside)

- `run_key`: the checkpoint key, a hash of the stage config and its inputs by content (a run with other settings,
  data or models never resumes this one's checkpoints; checkpoint.py sets another key's aside).
- `trained_module`: with DeepSpeed, a plain module rebuilt from the fp32 masters (ZeRO-3 partitions the engine's
  module between forwards, which evaluation, merging and saving cannot use); else the loop's own module.
- `finish_report`: report.md with its figures (rank 0), the scratch directory removed, the text logged to MLflow.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components._shared.model import checkpoint as ckpt
from components._shared.model.train_config import TrainConfig
from components._shared.model.training import TrainLoop, TrainResult, is_main_process
from components._shared.platform import bad_records
from components._shared.platform.reports import Series, figure
from components._shared.platform.tracking import Tracker

SCRATCH = ".scratch"  # downloads and checkpoint staging inside the output directory; not part of the output


# Settings that change when or how often a run reports or saves, never what it trains: a rerun that changes only
# these resumes its checkpoints (fourteenth pass, RS4: train.log_every=1 set every checkpoint aside).
RESULT_NEUTRAL_TRAIN = ("log_every", "checkpoint_every", "keep_checkpoints")


def run_key(cfg, inputs: dict[str, str]) -> str:
    """The key of this run's checkpoints: the stage config (less RESULT_NEUTRAL_TRAIN in every training block), its
    inputs by content and the package version."""
    return ckpt.fingerprint(_without_neutral(cfg.model_dump(mode="json")), inputs)


def _without_neutral(config: dict) -> dict:
    out = {}
    for name, value in config.items():
        if name == "train" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in RESULT_NEUTRAL_TRAIN}
        elif isinstance(value, dict):
            value = _without_neutral(value)  # pretrain's stage1 / stage2 blocks
        out[name] = value
    return out


def checkpoint_store(stage: str, train: TrainConfig, key: str, output_dir: Path) -> ckpt.CheckpointStore:
    """The stage's checkpoints: under train.checkpoint_uri (keyed) when set, else output_dir/checkpoints."""
    return ckpt.CheckpointStore(
        ckpt.location(train.checkpoint_uri, stage, key, output_dir),
        keep=train.keep_checkpoints,
        scratch=output_dir / SCRATCH,
        key=key,
    )


def trained_module(loop: TrainLoop, rebuild: Callable[[], Any]) -> Any | None:
    """The trained model to evaluate and export: the loop's module, or with DeepSpeed `rebuild()` loaded with the
    full fp32 weights (a collective: every rank must call this; ranks > 0 get None)."""
    if loop.train.backend != "deepspeed":
        return loop.backend.module
    weights = loop.backend.full_state_dict()
    if not is_main_process():
        return None
    model = rebuild()
    model.load_state_dict(weights)
    return model


def loop_metrics(result: TrainResult) -> dict[str, Any]:
    """The metrics every TrainLoop stage reports: steps, resume point, first/last loss and packing figures."""
    return {
        "steps": result.steps,
        "resumed_from_step": result.resumed_from if result.resumed_from is not None else -1,
        "train_loss_first": result.history[0]["loss"] if result.history else float("nan"),
        "train_loss_final": result.history[-1]["loss"] if result.history else float("nan"),
        "padding_efficiency": round(result.padding_efficiency, 4),
        "budget_fill": round(result.budget_fill, 4),
        "tokens_per_second": round(result.tokens / result.seconds, 1) if result.seconds else 0.0,
        "parameters": result.parameters,  # per module group: trainable / frozen (the run's manifest)
    }


@dataclass(frozen=True)
class Figure:
    """One figure of a report: platform/reports.py's `figure` arguments."""

    name: str
    title: str
    series: Series
    log_y: bool = False


def finish_report(
    output_dir: Path, tracker: Tracker, text: str, figures: list[Figure], set_aside: Sequence[dict[str, str]] = ()
) -> str:
    """Write report.md (the text, notes on checkpoints `set_aside` (TrainResult.set_aside) and records skipped,
    the figures) on rank 0, remove the scratch directory, log the report."""
    for note in set_aside:
        text += (
            f"\n**Checkpoints set aside**: `{note['root']}` held checkpoints of another run (key {note['old_key']}; "
            f"this run's key is {note['new_key']}: other settings, data or input models). They were not resumed (this "
            "run's own checkpoints are); "
            f"they are kept at `{note['kept_at']}`.\n"
        )
    ledger = bad_records.current()
    text += ledger.report() if ledger is not None else ""
    if is_main_process():
        lines: list[str] = []
        for f in figures:
            lines += figure(f.name, f.title, f.series, output_dir=output_dir, tracker=tracker, log_y=f.log_y)
        text += "\n".join(lines) + "\n"
        (output_dir / "report.md").write_text(text)
    shutil.rmtree(output_dir / SCRATCH, ignore_errors=True)
    tracker.log_text(text, "report.md")
    return text
