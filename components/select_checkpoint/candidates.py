"""The candidates select_checkpoint scores: every stage output's model/ and its kept intermediate checkpoints (the
trainable weights of checkpoints/step-N/ loaded over the stage's model), found in the stage directories."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from components._shared.launch.result import RESULT_FILE
from components._shared.model import checkpoint as ckpt
from components._shared.model.vlm import LoadedVlm, load_vlm
from components._shared.platform import storage

IGNORED_CHECKPOINT_KEYS = ("value_head.", "distill_projections.")  # training-only modules (rl's critic, distill's maps)


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


def _recorded_stage(root: Path) -> str | None:
    """The stage a stage output directory's result file names (None without one)."""
    try:
        return str(json.loads((root / RESULT_FILE).read_text()).get("stage") or "") or None
    except (OSError, ValueError, AttributeError):
        return None


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
        if not (root / storage.COMMIT_MARKER).is_file():
            raise ValueError(
                f"select_checkpoint input {stage}={directory!r} has no {storage.COMMIT_MARKER}: the {stage} stage did "
                "not finish there (it failed, was stopped, or is still running); pass the output of a finished run."
            )
        recorded = _recorded_stage(root)
        if recorded is not None and recorded != stage:
            raise ValueError(
                f"select_checkpoint input --{stage.replace('_', '-')} {directory!r} is the output of the {recorded} "
                f"stage ({RESULT_FILE} says so); pass the {stage} stage's output there."
            )
        same = next(
            (s for s, d in stage_dirs.items() if s != stage and d and Path(d).resolve() == root.resolve()), None
        )
        if same is not None and list(stage_dirs).index(same) < list(stage_dirs).index(stage):
            raise ValueError(
                f"select_checkpoint inputs {same} and {stage} name the same directory {directory!r}; each stage's "
                "output is one candidate: give each its own."
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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    loaded = model, _, _ = load_vlm(candidate.model_dir)
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
    try:
        weights = load_file(str(weights_file))
    except (OSError, SafetensorError) as error:  # truncated or damaged: this checkpoint is skipped, not the stage
        raise ValueError(f"{weights_file} cannot be read ({error}); a damaged checkpoint") from error
    params = dict(model.named_parameters())
    unknown, changed = [], False
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
