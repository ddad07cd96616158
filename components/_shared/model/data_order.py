"""The training loop's data order: which sample indices each step takes, as a pure function of saved integers.

A run is a list of `Phase`s (curriculum pools, each with a number of steps). Within a phase the order is a
permutation that depends only on (seed, phase, epoch), and a step takes the next `samples_per_step` indices of
it, so the data position is the `DataCursor`'s four integers saved with every checkpoint. A phase with
eval-driven `weights` draws each step's samples with replacement from a generator seeded by (seed, step) instead.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phase:
    """A stretch of training on one pool of sample indices, with its own learning-rate scale (curriculum)."""

    name: str
    steps: int
    pool: Sequence[int]
    lr_scale: float = 1.0
    # Online scheduling: weights over `pool` from the evaluations so far (None = plain epochs). When it returns
    # weights, each step draws its samples with replacement from a generator seeded by (seed, step), so the
    # data stays a pure function of the restored state and resume stays exact.
    weights: Callable[[list[dict]], Sequence[float] | None] | None = None


@dataclass
class DataCursor:
    phase: int = 0
    step_in_phase: int = 0
    epoch: int = 0
    offset: int = 0


def passes(phase: Phase, samples_per_step: int) -> float:
    """How many times a phase draws each of its records on average (its epochs)."""
    return phase.steps * samples_per_step / max(len(phase.pool), 1)


def say_passes(phase: Phase, samples_per_step: int) -> None:
    """Log how often the phase repeats its records; a warning where one step already holds a record twice (a
    training set smaller than train.samples_per_step: the model sees the same few records every step)."""
    times = passes(phase, samples_per_step)
    line = (
        f"phase '{phase.name}': {phase.steps} steps x {samples_per_step} samples over {len(phase.pool)} records "
        f"= {times:.1f} passes over its data"
    )
    if phase.steps and len(phase.pool) < samples_per_step:
        logger.warning(
            "%s; its %d records are fewer than train.samples_per_step=%d, so every step repeats them: give more "
            "records, or lower train.samples_per_step and train.steps",
            line,
            len(phase.pool),
            samples_per_step,
        )
    elif phase.steps:
        logger.info(line)


class DataOrder:
    """The sample indices of each step over `phases` (`samples_per_step` a step, `steps` in all)."""

    def __init__(self, phases: list[Phase], *, seed: int, samples_per_step: int, steps: int) -> None:
        if sum(p.steps for p in phases) != steps:
            raise ValueError(
                f"phases have {sum(p.steps for p in phases)} steps but train.steps={steps}; make "
                "the phase steps add up to train.steps."
            )
        for p in phases:
            if len(p.pool) == 0 and p.steps:
                raise ValueError(f"phase '{p.name}' has no samples; check its data filter.")
        self.phases, self.seed, self.samples_per_step, self.steps = phases, seed, samples_per_step, steps
        for p in phases:
            say_passes(p, samples_per_step)
        self.cursor = DataCursor()
        self._order_cache: dict[tuple[int, int], np.ndarray] = {}

    def _order(self, phase: int, epoch: int) -> np.ndarray:
        key = (phase, epoch)
        if key not in self._order_cache:
            rng = np.random.default_rng([self.seed, phase, epoch])
            self._order_cache = {key: rng.permutation(np.asarray(self.phases[phase].pool))}
        return self._order_cache[key]

    def next_indices(self, step: int, evals: list[dict]) -> tuple[list[int], Phase]:
        """The indices of the step after `step` (0-based count of steps done) and its phase; moves the cursor."""
        c = self.cursor
        while c.step_in_phase >= self.phases[c.phase].steps:
            c.phase, c.step_in_phase, c.epoch, c.offset = c.phase + 1, 0, 0, 0
        phase = self.phases[c.phase]
        weights = phase.weights(evals) if phase.weights else None
        if weights is not None:
            p = np.asarray(weights, dtype=np.float64)
            rng = np.random.default_rng([self.seed, 1_000_003, step])
            c.step_in_phase += 1
            drawn = rng.choice(np.asarray(phase.pool), size=self.samples_per_step, p=p / p.sum())
            return [int(i) for i in drawn], phase
        picked: list[int] = []
        while len(picked) < self.samples_per_step:
            order = self._order(c.phase, c.epoch)
            take = order[c.offset : c.offset + self.samples_per_step - len(picked)]
            picked += [int(i) for i in take]
            c.offset += len(take)
            if c.offset >= len(order):
                c.epoch, c.offset = c.epoch + 1, 0
        c.step_in_phase += 1
        return picked, phase

    def upcoming_indices(self, step: int) -> list[list[int]]:
        """The indices of the steps after `step` up to the end or the first eval-weighted phase (whose draw depends
        on evaluations not yet run), without moving the cursor."""
        saved = copy.deepcopy(self.cursor)
        plan: list[list[int]] = []
        try:
            for _ in range(self.steps - step):
                c = self.cursor
                while c.phase < len(self.phases) - 1 and c.step_in_phase >= self.phases[c.phase].steps:
                    c.phase, c.step_in_phase, c.epoch, c.offset = c.phase + 1, 0, 0, 0
                if self.phases[c.phase].weights:
                    break
                plan.append(self.next_indices(step, [])[0])
        finally:
            self.cursor = saved
        return plan

    def phase_at(self, step: int) -> Phase:
        """The phase optimizer step `step` (0-based) belongs to."""
        at = 0
        for phase in self.phases:
            at += phase.steps
            if step < at:
                return phase
        return self.phases[-1]
