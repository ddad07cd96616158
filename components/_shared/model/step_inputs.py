"""A training step's inputs built ahead of the step: samples, micro-batch plan and packed rows, in worker processes.

`prepare_step` turns a step's items (samples, or groups kept in one micro-batch) into what `TrainLoop.train_step`
runs: this rank's micro-batches, packed. `StepInputs` does that for the upcoming steps of a fixed plan of sample
indices in a torch DataLoader (`train.data_workers` processes, `train.prefetch_steps` steps queued per worker,
pinned memory on CUDA), so decode, resize, processor, tokenisation and packing of step k+1 run while step k
trains. The plan is the loop's own data order (a pure function of seed, phase and epoch), so the inputs are the
same samples in the same order as without workers, and a resumed run rebuilds the plan from its restored cursor:
outputs are bit-identical with prefetching on or off (tested). Workers are forked (Linux); the sample builders
must not use CUDA or random state (none of the stages' do). Not prefetched: phases whose sampling weights follow
the evaluations, and custom `sample_batch` builders that need the current model (distill's on-policy answers).
`step_inputs` itself takes any plan and pure builder: RL prefetches its steps' prompts with it (rl/trainer.py).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from components._shared.model.encoder import Sample
from components._shared.model.packing import pack, plan_micro_batches


class Pinnable(Protocol):
    def pin_memory(self) -> Any: ...


Item = TypeVar("Item")  # one entry of the plan: a step's sample indices (or what else names a step's inputs)
Built = TypeVar("Built", bound=Pinnable)  # what a step's entry is built into: PreparedStep, or RL's prompts


@dataclass
class PreparedStep:
    """One optimizer step's inputs on this rank: the micro-batches it runs (packed, on the CPU) with their samples,
    each micro-batch's weight (0 for the zero-weighted copy a rank with fewer micro-batches runs) and the step's
    totals."""

    indices: list[int]
    samples: list[Sample]
    micro: list[list[Sample]]
    batches: list[dict]
    weights: list[float]
    plan_size: int
    total_targets: float

    def pin_memory(self) -> PreparedStep:
        """Packed tensors in page-locked memory (the DataLoader's pin thread calls this on CUDA)."""
        self.batches = [
            {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in self.batches
        ]
        return self


def prepare_step(
    indices: list[int],
    items: list,
    *,
    max_tokens: int,
    unit_weight: Callable[[list[Sample]], float],
    rank: int,
    world: int,
) -> PreparedStep:
    """Plan (first-fit-decreasing over units) and pack this rank's micro-batches of a step's items."""
    units = [list(item) if isinstance(item, (list, tuple)) else [item] for item in items]
    samples = [s for unit in units for s in unit]
    plan = plan_micro_batches([sum(s.num_tokens for s in u) for u in units], max_tokens)
    total_targets = sum(unit_weight(u) for u in units)
    if total_targets == 0:
        raise ValueError(
            f"a training step's {len(samples)} samples have no target tokens; check the data "
            f"(first ids: {[s.sample_id for s in samples[:3]]})."
        )
    # Data parallel: rank r runs micro-batches r, r+W, ...; a rank with one fewer runs a zero-weighted copy
    # of the first, so every rank does the same number of backward passes (collectives stay matched).
    mine = plan[rank::world]
    rounds = -(-len(plan) // world)
    weights = [1.0] * len(mine) + [0.0] * (rounds - len(mine))
    mine = mine + [plan[0]] * (rounds - len(mine))
    micro = [[s for i in group for s in units[i]] for group in mine]
    return PreparedStep(
        indices=list(indices),
        samples=samples,
        micro=micro,
        batches=[pack(m) for m in micro],
        weights=weights,
        plan_size=len(plan),
        total_targets=total_targets,
    )


class _Steps(Dataset):
    """Item k = the prepared step of plan[k] (read in the forked workers)."""

    def __init__(self, plan: list, build: Callable) -> None:
        self.plan, self.build = plan, build

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, k: int) -> Any:
        try:
            return self.build(self.plan[k])
        except Exception as error:  # noqa: BLE001 - handed to the training process as it was raised
            return _Failed(error)


@dataclass
class _Failed:
    """A worker's exception, re-raised as itself in the training process (the DataLoader would rewrap it with the
    worker's traceback in its message, and a bad record's one-line error would become a page)."""

    error: Exception

    def pin_memory(self) -> _Failed:
        return self


def _worker_init(_: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the fast tokenizer's own threads, after a fork
    torch.set_num_threads(1)
    _die_with_parent()


def _die_with_parent() -> None:
    """A worker is killed with the training process (prctl PR_SET_PDEATHSIG): a SIGKILLed stage must not leave a
    worker behind, blocked on flushing its queue to a reader that is gone (and holding the stage's output pipes)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not glibc: the DataLoader's own parent watchdog is what is left
        pass


def _keep(step: Any) -> Any:
    return step


def step_inputs(
    plan: list[Item], build: Callable[[Item], Built], *, workers: int, depth: int, pin: bool
) -> Generator[Built, None, None]:
    """The prepared steps of `plan` in order: built `depth` steps ahead per worker by `workers` processes, or one by
    one in this process when workers is 0 (or the platform cannot fork). `build` must be a pure function of its
    entry (no model, no CUDA, no random state), so the order and bytes are the same either way."""
    if workers == 0 or "fork" not in multiprocessing.get_all_start_methods() or not plan:
        for indices in plan:
            yield build(indices).pin_memory() if pin else build(indices)
        return
    # The fast tokenizer warns in every forked child once its thread pool ran; it is not used in parallel here.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loader = DataLoader(
        _Steps(plan, build),
        batch_size=None,
        shuffle=False,
        num_workers=min(workers, len(plan)),
        prefetch_factor=depth,
        collate_fn=_keep,
        worker_init_fn=_worker_init,
        multiprocessing_context="fork",
        pin_memory=pin,
        # The loader's base seed from its own generator, not a draw from the global RNG that the step's sampling
        # uses (RL's rollouts shifted by one draw with workers on).
        generator=torch.Generator().manual_seed(0),
    )
    iterator = iter(loader)
    try:
        for step in iterator:
            if isinstance(step, _Failed):
                raise step.error
            yield step
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
