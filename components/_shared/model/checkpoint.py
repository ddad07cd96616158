"""Atomic, verifiable training checkpoints with the whole state needed for an exact resume.

A checkpoint is a directory `step-NNNNNNN/` under the stage's checkpoint location (local or s3://):
    trainable.safetensors   every parameter with requires_grad (frozen ones come back from the base model)
    optimizer.pt            {"optimizer": ..., "scheduler": ...} (torch.save; read back with weights_only=True)
    rng.safetensors         torch CPU (and CUDA) generator states
    state.json              step, data position, python / numpy RNG, metric history, anything the stage adds
    deepspeed/              with the DeepSpeed backend, the engine's own checkpoint instead of the two .pt/.safetensors
    key.json                the key of the run that wrote it (`fingerprint`: config, inputs by content, version)
    _COMMITTED.json         written last (sizes + sha256 of everything above)

Readers only see committed directories and verify every file before loading, so a process killed while
writing a checkpoint leaves a directory that is never loaded (and is removed on the next save). A store opened
with a key resumes only checkpoints of that key: a local root holding another key's checkpoints (a finished run
with other settings or data in the same output directory) is moved aside to ROOT.stale-<key>, kept, and noted
in the store's `set_aside` (the loop's result carries it to the stage's report).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components._shared.platform import locks, s3_client, storage

STEP_PREFIX = "step-"
KEY_FILE = "key.json"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, json-able) RNG state of torch, CUDA, python and numpy."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's own device only
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    version, keys, pos, has_gauss, gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return tensors, {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [version, [int(k) for k in keys], pos, has_gauss, gauss],
    }


def set_rng_state(tensors: dict[str, torch.Tensor], states: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    py_version, py_state, py_gauss = states["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    version, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((version, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


class CheckpointStore:
    """Saves and finds committed checkpoints under `root` (a local directory or an s3:// prefix)."""

    def __init__(
        self, root: str | Path, *, keep: int = 2, scratch: str | Path | None = None, key: str | None = None
    ) -> None:
        """`key` (a stage's `fingerprint`): checkpoints are stamped with it and only its own are resumed; the
        root is held for this run (platform/locks.py). None: unkeyed, unlocked (library use, tests)."""
        self.root = str(root)
        self.keep = keep
        self.key = key
        self.remote = storage.is_s3(self.root)
        self.scratch = Path(scratch or tempfile.gettempdir()) if self.remote else Path(self.root)
        self.set_aside: list[dict[str, str]] = []  # other runs' checkpoints moved out of the root (for the report)
        self.damaged: set[str] = set()  # checkpoints found damaged at resume: never resumed or counted again
        if key is not None:
            locks.hold(self.root, purpose="checkpoints")
        if not self.remote:
            Path(self.root).mkdir(parents=True, exist_ok=True)
            if key is not None and _rank() == 0:
                self._set_aside_foreign()

    def staging_dir(self, step: int, *, shared: bool = False) -> Path:
        """A fresh, empty directory to write checkpoint `step` into (removes leftovers of killed writes).

        `shared=True` (several processes write one checkpoint) gives every rank the same path; the caller lets
        rank 0 create it and the others wait at a barrier.
        """
        self.scratch.mkdir(parents=True, exist_ok=True)
        for stale in self.scratch.glob(f".{STEP_PREFIX}*.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if shared:
            path = self.scratch / f".{step_name(step)}.partial-shared"
            path.mkdir()
            return path
        return Path(tempfile.mkdtemp(prefix=f".{step_name(step)}.partial-", dir=self.scratch))

    def commit(self, staging: Path, step: int) -> str:
        """Publish a fully written staging dir as checkpoint `step` (marker last) and prune old ones."""
        locks.check_not_lost()  # another run took the root's lease: never write over its checkpoints
        if self.key is not None:
            (staging / KEY_FILE).write_text(json.dumps({"key": self.key}) + "\n")
        if self.remote:
            uri = storage.join(self.root, step_name(step))
            storage.publish_dir(staging, uri)
            shutil.rmtree(staging, ignore_errors=True)
            self.damaged.discard(uri.rstrip("/"))  # written anew over a damaged one
        else:
            storage.commit_dir(staging)
            target = Path(self.root) / step_name(step)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
            uri = str(target)
        self._prune()
        return uri

    def committed(self) -> list[str]:
        """This store's committed checkpoints, oldest first (with a key: only those stamped with it)."""
        found = [u for u in storage.list_committed(self.root) if Path(u.rstrip("/")).name.startswith(STEP_PREFIX)]
        found = [u for u in found if u.rstrip("/") not in self.damaged]
        return found if self.key is None else [u for u in found if checkpoint_key(u) == self.key]

    def _set_aside_foreign(self) -> None:
        """Move the checkpoints of other keys out of a local root into ROOT.stale-<key>/, kept whole (the root
        itself stays: it may hold this run's lock)."""
        root = Path(self.root)
        found = [u for u in storage.list_committed(root) if Path(u).name.startswith(STEP_PREFIX)]
        foreign = sorted({checkpoint_key(u) or "unkeyed" for u in found} - {self.key})
        if not foreign:
            return
        target = _free_sibling(root, f"stale-{foreign[0]}")
        target.mkdir(parents=True)
        moved = []
        for child in sorted(root.iterdir()):
            if child.name.startswith((STEP_PREFIX, f".{STEP_PREFIX}")) and checkpoint_key(str(child)) != self.key:
                os.replace(child, target / child.name)
                moved.append(child.name)
        note = {"root": str(root), "kept_at": str(target), "old_key": ", ".join(foreign), "new_key": str(self.key)}
        self.set_aside.append(note)
        own = [u for u in storage.list_committed(root) if Path(u).name.startswith(STEP_PREFIX)]
        after = f"this run resumes from its own {Path(own[-1]).name}" if own else "this run trains from its own start"
        print(
            f"NOTE: {root} held {len(moved)} checkpoint(s) of another run ({', '.join(moved[:3])}; key "
            f"{note['old_key']}: other settings (any but train.log_every, checkpoint_every, keep_checkpoints), data "
            f"or input models than this run's {self.key}); they were set "
            f"aside, kept at {target}, and {after}.",
            flush=True,
        )

    def latest(self) -> str | None:
        found = self.committed()
        return found[-1] if found else None

    def newest_intact(self, rank: int = 0) -> Path | None:
        """A verified local copy of the newest committed checkpoint that is whole. A damaged one (a file changed or
        cut after its commit) is set aside with a warning naming it (a local one moved to ROOT.stale-damaged-STEP,
        kept; an s3:// one left in place and no longer counted), so pruning never keeps it in place of the new
        checkpoints; training resumes from the one before (the damaged step is written anew when training reaches
        it). None: no checkpoint, or none intact."""
        found = self.committed()
        for uri in reversed(found):
            try:
                return self.local_copy(uri, rank)
            except (storage.IntegrityError, OSError) as err:  # OSError: rank 0 set it aside while this rank read it
                kept = self._set_aside_damaged(uri, rank)
                why = str(err).split("; re-run the stage")[0]
                print(
                    f"WARNING: checkpoint {uri} is damaged ({why}); it is not resumed"
                    + (f" (kept at {kept})" if kept else "")
                    + (
                        "; trying the one before it."
                        if found.index(uri)
                        else "; no earlier checkpoint: training from step 0."
                    ),
                    flush=True,
                )
        return None

    def _set_aside_damaged(self, uri: str, rank: int) -> str | None:
        """Leave a damaged checkpoint out of `committed()` from now on; rank 0 moves a local one out of the root."""
        self.damaged.add(uri.rstrip("/"))
        if self.remote or rank != 0:
            return None
        target = _free_sibling(Path(self.root), f"stale-damaged-{Path(uri).name}")
        os.replace(uri, target)
        return str(target)

    def local_copy(self, uri: str, rank: int = 0) -> Path:
        """A verified local directory of committed checkpoint `uri` (downloaded when remote, one copy per rank)."""
        if not self.remote:
            storage.verify_dir(uri)
            return Path(uri)
        target = self.scratch / f"resume-rank{rank}-{Path(uri).name}"
        shutil.rmtree(target, ignore_errors=True)
        return storage.fetch_dir(uri, target)

    def _prune(self) -> None:
        found = self.committed()
        for uri in found[: max(0, len(found) - self.keep)]:
            if self.remote:
                bucket, key = storage.split_s3(uri)
                client = s3_client.client()
                for file_uri in storage.list_files(uri):
                    client.delete_object(Bucket=bucket, Key=storage.split_s3(file_uri)[1])
                del key
            else:
                shutil.rmtree(uri, ignore_errors=True)


def _free_sibling(root: Path, suffix: str) -> Path:
    """ROOT.SUFFIX beside `root`, or ROOT.SUFFIX-2, -3 ... when taken: where set-aside checkpoints are kept (a
    `.stale-` part keeps them out of the stage's committed files)."""
    target = root.with_name(f"{root.name}.{suffix}")
    for n in range(2, 1000):
        if not target.exists():
            break
        target = root.with_name(f"{root.name}.{suffix}-{n}")
    return target


def fingerprint(config: dict[str, Any], inputs: dict[str, Any]) -> str:
    """A short hash of a stage's config, its inputs by content (`content_identity`) and the package version: the
    same run, retried (or its data moved), gets the same key; any change of settings, data or models a new one."""
    import hashlib

    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(f"\nversion={_package_version()}".encode())
    for name, value in sorted(inputs.items()):
        digest.update(f"\n{name}={content_identity(value)}".encode())
    return digest.hexdigest()[:16]


def content_identity(value: Any) -> str:
    """What an input is, independent of where it is: a committed directory by its marker's sha256s, any other
    local directory or file by the sha256 of every file, an s3:// prefix by its objects' sizes and ETags; other
    values (builtin:..., empty) as themselves."""
    text = str(value or "")
    if not text or not (storage.is_s3(text) or Path(text).exists()):
        return text
    if storage.is_committed(text):  # local or s3://: the marker already holds every file's sha256
        return json.dumps(storage.read_marker(text)["files"], sort_keys=True)
    if storage.is_s3(text):
        return json.dumps(storage.list_etags(text), sort_keys=True)
    path = Path(text)
    if path.is_file():
        return storage.sha256_file(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name not in storage.LOCK_FILES)
    return json.dumps({p.relative_to(path).as_posix(): storage.sha256_file(p) for p in files}, sort_keys=True)


def checkpoint_key(uri: str) -> str | None:
    """The key a committed checkpoint was stamped with (None: written before keys, or by an unkeyed store)."""
    try:
        return str(json.loads(storage.read_bytes(storage.join(uri, KEY_FILE)))["key"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qwen-vl-pipeline")
    except PackageNotFoundError:
        return "unknown"


def _rank() -> int:
    return int(os.environ.get("RANK", "0").strip() or 0)


def location(checkpoint_uri: str | None, stage: str, key: str, output_dir: Path) -> str:
    """Where a stage's checkpoints live: CHECKPOINT_URI/<stage>-<key> when a root is configured (S3 survives a
    failed KFP task, whose outputs are never uploaded), else OUTPUT/checkpoints."""
    if checkpoint_uri:
        return storage.join(checkpoint_uri, f"{stage}-{key}")
    return str(Path(output_dir) / "checkpoints")


POINTER_FILE = "checkpoints.json"


def write_pointer(output_dir: str | Path, roots: list[str]) -> None:
    """Name in OUTPUT/checkpoints.json the checkpoint roots that live outside OUTPUT/checkpoints (a
    `train.checkpoint_uri` such as s3://...), so that select_checkpoint finds a stage's intermediate checkpoints
    from its output alone; writes nothing when they are all inside."""
    inside = str(Path(output_dir) / "checkpoints")
    outside = [str(r) for r in roots if not str(r).startswith(inside)]
    if outside:
        (Path(output_dir) / POINTER_FILE).write_text(json.dumps({"roots": outside}, indent=1) + "\n")


def read_pointer(output_dir: str | Path) -> list[str]:
    """The roots `write_pointer` recorded in a stage output ([] when its checkpoints are inside it)."""
    path = Path(output_dir) / POINTER_FILE
    return [str(r) for r in json.loads(path.read_text())["roots"]] if path.is_file() else []


def write_state(directory: Path, state: dict[str, Any]) -> None:
    (directory / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))


def read_state(directory: Path) -> dict[str, Any]:
    return json.loads((Path(directory) / "state.json").read_text())


def save_torch_state(directory: Path, model, optimizer, scheduler) -> None:
    """Trainable weights (safetensors), optimizer + scheduler (weights-only torch file), RNG tensors."""
    from safetensors.torch import save_file

    trainable = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}
    save_file(trainable, str(directory / "trainable.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, directory / "optimizer.pt")


def load_torch_state(directory: Path, model, optimizer, scheduler) -> None:
    from safetensors.torch import load_file

    trainable = load_file(str(directory / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = sorted({n for n, p in params.items() if p.requires_grad} - set(trainable))
    if missing:
        raise ValueError(
            f"checkpoint {directory} lacks trainable parameters {missing[:3]}...; it was written by a run with other "
            "trainable modules (LoRA targets / frozen groups). Resume with the same config or start a new output."
        )
    with torch.no_grad():
        for name, tensor in trainable.items():
            params[name].copy_(tensor)
    blob = torch.load(directory / "optimizer.pt", weights_only=True, map_location="cpu")
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])


def save_rng(directory: Path, rank: int = 0) -> dict[str, Any]:
    """Write this rank's torch RNG tensors; returns its python/numpy state (json-able)."""
    from safetensors.torch import save_file

    tensors, states = rng_state()
    save_file(tensors, str(directory / _rng_file(rank)))
    return states


def load_rng(directory: Path, states: dict[str, Any], rank: int = 0) -> None:
    from safetensors.torch import load_file

    set_rng_state(load_file(str(directory / _rng_file(rank))), states)


def _rng_file(rank: int) -> str:
    return "rng.safetensors" if rank == 0 else f"rng-rank{rank}.safetensors"
