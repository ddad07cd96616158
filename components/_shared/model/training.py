"""The training loop the model stages share: packed micro-batches, per-group AdamW, schedules, exact resume.

    loop = TrainLoop(model, LoopSettings.of(cfg), LoopData(phases=[Phase("all", cfg.train.steps, range(n))],
                     sample=dataset.__getitem__), CheckpointStore(output_dir / "checkpoints"), tracker=tracker)
    result = loop.run(evaluate=lambda step, model: {...})   # resumes from the newest committed checkpoint

Data order is a pure function of (seed, phase, epoch) (data_order.py), and a step takes the next
`samples_per_step` indices of its phase, so the data position is a few integers saved with the checkpoint. Each
step packs its samples first-fit-decreasing into micro-batches of at most `max_tokens_per_micro_batch` tokens and
normalises the loss by the step's number of target tokens, so a step's gradient does not depend on how it was
packed. The callbacks get the model being trained as an argument (`evaluate(step, model)`,
`sample_batch(indices, model)`); a stage's own state rides in every checkpoint through `extra` (a `LoopState`).

Written by hand rather than with the HF Trainer: that trainer's resume does not restore this model's
weights, restores RNG one batch late and writes non-atomic checkpoints (docs/references.md). The DeepSpeed
backend (components/_shared/model/ds_backend.py) plugs into the same loop.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from components._shared.model import checkpoint as ckpt
from components._shared.model import moe
from components._shared.model.attention import attention_path
from components._shared.model.backends import Backend, TorchBackend
from components._shared.model.data_order import DataCursor, DataOrder, Phase
from components._shared.model.device import resolve_device
from components._shared.model.encoder import Sample
from components._shared.model.head_loss import sequence_loss
from components._shared.model.manifest import check_frozen, frozen_fingerprints, parameter_manifest
from components._shared.model.packing import batch_tokens, to_device
from components._shared.model.step_inputs import PreparedStep, prepare_step, step_inputs
from components._shared.model.train_config import OptimConfig, ScheduleConfig, TrainConfig, lr_factor
from components._shared.platform import disk_space, progress
from components._shared.platform.tracking import NullTracker, Tracker

logger = logging.getLogger(__name__)

__all__ = ["DataCursor", "LoopData", "LoopSettings", "LoopState", "Phase", "TrainLoop", "TrainResult"]
Model = Any  # the module being trained (the backend's: a DeepSpeed engine's module under DeepSpeed)
# A loss function's extras are floats or 0-dim device tensors (read once a step with the loss: read_once).
LossFn = Callable[[Model, dict, list[Sample]], tuple[torch.Tensor, int, dict[str, Any]]]
Evaluate = Callable[[int, Model], dict[str, float]]  # (step, the model being trained) -> metrics


def target_tokens(unit: list[Sample]) -> float:
    """The default unit weight: an item's target tokens (the step's loss is a mean over them)."""
    return float(sum(s.num_targets for s in unit))


@dataclass(frozen=True)
class LoopSettings:
    """The settings blocks a loop runs by; `updates_per_step` optimizer steps make one loop step (RL's epochs x
    minibatches), so the schedule advances once per loop step."""

    train: TrainConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    seed: int = 0
    updates_per_step: int = 1

    @classmethod
    def of(cls, cfg: Any, **changes: Any) -> LoopSettings:
        """The blocks of a stage config (or pretrain's phase block, with `seed=` given)."""
        values = {"train": cfg.train, "optim": cfg.optim, "schedule": cfg.schedule, "seed": getattr(cfg, "seed", 0)}
        return cls(**{**values, **changes})


@dataclass(frozen=True)
class LoopData:
    """What a loop trains on: its phases and how a step's items are made. `sample(i)` builds one item (a Sample,
    or a group kept in one micro-batch such as a preference pair) and lets data workers build steps ahead;
    `sample_batch(indices, model)` builds a step's items with the current model (distill's on-policy answers),
    in the step. `unit_weight(item)` is an item's share of the step's loss normaliser (default: target tokens)."""

    phases: list[Phase]
    sample: Callable[[int], Sample | list[Sample]] | None = None
    sample_batch: Callable[[list[int], Model], list] | None = None
    unit_weight: Callable[[list[Sample]], float] | None = None


class LoopState(Protocol):
    """A stage's own state saved with every checkpoint and restored on resume (before RNG)."""

    def state(self) -> dict: ...

    def load(self, state: dict) -> None: ...


@dataclass
class TrainResult:
    steps: int
    resumed_from: int | None
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    padding_efficiency: float = 0.0  # real tokens / positions the model computed (this rank's micro-batches)
    budget_fill: float = 0.0  # real tokens / (micro-batches x max_tokens_per_micro_batch)
    tokens: int = 0
    seconds: float = 0.0
    parameters: dict[str, dict[str, int]] = field(default_factory=dict)  # per group: trainable / frozen (manifest.py)
    set_aside: list[dict[str, str]] = field(default_factory=list)  # other runs' checkpoints moved aside (report)


def default_loss(
    model, batch: dict, samples: list[Sample], *, chunk_rows: int = TrainConfig().loss_chunk_tokens
) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """Summed next-token cross-entropy over assistant tokens, and their count (the LM head run in chunks). A model
    with experts also reports its router's load-balancing loss, added as its checkpoint's forward adds it (moe.py)."""
    router = moe.router_list(model)
    loss_sum, targets = sequence_loss(model, batch, chunk_rows=chunk_rows, router=router)
    loss_sum, extra = moe.add_balance(model, loss_sum, targets, router)
    return loss_sum, targets, extra


class TrainLoop:
    """One training run over `phases`; see the module docstring."""

    def __init__(
        self,
        model,
        settings: LoopSettings,
        data: LoopData,
        checkpoints: ckpt.CheckpointStore,
        *,
        tracker: Tracker | None = None,
        loss_fn: LossFn | None = None,
        extra: LoopState | None = None,
    ) -> None:
        train = settings.train
        self.order = DataOrder(
            data.phases, seed=settings.seed, samples_per_step=train.samples_per_step, steps=train.steps
        )
        if int(os.environ.get("WORLD_SIZE", "").strip() or 1) > 1 and train.backend != "deepspeed":
            raise ValueError(
                "this run has several processes (WORLD_SIZE > 1) but train.backend is 'torch', which "
                "trains one process; set train.backend: deepspeed for data-parallel training."
            )
        if train.threads:
            torch.set_num_threads(train.threads)
        self.model, self.settings, self.train, self.schedule = model, settings, train, settings.schedule
        self.data, self.store, self.extra = data, checkpoints, extra
        self.tracker = tracker or NullTracker()
        self.loss_fn = loss_fn or functools.partial(default_loss, chunk_rows=train.loss_chunk_tokens)
        self.device = resolve_device(train.device)
        self.autocast = train.precision == "bf16" or (train.precision == "auto" and self.device.type == "cuda")
        if train.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=train.checkpoint_every_n_layers
            )
            model.enable_input_require_grads()
        model.to(self.device)
        if train.backend == "deepspeed":
            from components._shared.model.ds_backend import DeepSpeedBackend

            self.backend: Backend = DeepSpeedBackend(
                model, train=train, optim=settings.optim, lr_lambda=self._lr_lambda
            )
        else:
            self.backend = TorchBackend(model, optim=settings.optim, lr_lambda=self._lr_lambda)
        weights = next(self.backend.module.parameters()).dtype
        path = attention_path(self.device, weights, torch.bfloat16 if self.autocast else None)
        text = getattr(getattr(self.backend.module, "config", None), "text_config", None)
        if getattr(text, "_attn_implementation", None) == "sdpa":  # Family.splits_packed_rows off (the Qwen4 preview)
            path += "; the LM instead: sdpa over each packed row's block-causal mask (its family reads the mask)"
        logger.info(path)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.parameters: dict[str, dict[str, int]] = {}

    # -- data position -------------------------------------------------------------------------------------
    @property
    def phases(self) -> list[Phase]:
        return self.order.phases

    @property
    def cursor(self) -> DataCursor:
        return self.order.cursor

    def next_indices(self) -> tuple[list[int], Phase]:
        """The next step's sample indices and phase (moves the data cursor)."""
        return self.order.next_indices(self.step, self.evals)

    def upcoming_indices(self) -> list[list[int]]:
        """The sample indices of the next steps up to the end or the first eval-weighted phase."""
        return self.order.upcoming_indices(self.step)

    def _inputs_ahead(self) -> Generator[PreparedStep, None, None]:
        """The prepared inputs of the upcoming steps, built by train.data_workers processes (step_inputs.py); empty
        when the step's items come from `sample_batch` (it needs the current model)."""
        plan = self.upcoming_indices() if self.data.sample_batch is None else []
        return step_inputs(
            plan,
            lambda indices: self.prepare(indices, self._items(indices)),
            workers=data_workers(self.train, self.device),
            depth=self.train.prefetch_steps,
            pin=self.device.type == "cuda",
        )

    def _items(self, indices: list[int]) -> list:
        """A step's items: built together with the current model (`sample_batch`), else one by one (`sample`)."""
        if self.data.sample_batch is not None:
            return self.data.sample_batch(indices, self.backend.module)
        if self.data.sample is None:
            raise TypeError("this TrainLoop was built without `sample`; pass it, or drive the loop with drive().")
        return [self.data.sample(i) for i in indices]

    def _lr_lambda(self, update: int) -> float:
        """Optimizer update -> learning-rate factor: the schedule at its loop step times the phase's scale."""
        step = update // self.settings.updates_per_step
        return lr_factor(step, self.train.steps, self.schedule) * self.order.phase_at(step).lr_scale

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """Write and commit checkpoint `self.step`; with several processes every rank writes its part into one
        shared staging directory and rank 0 commits it after a barrier."""
        rank, world = self.backend.rank, self.backend.world_size
        if world == 1:
            staging = self.store.staging_dir(self.step)
        else:
            if rank == 0:
                self.store.staging_dir(self.step, shared=True)
            _barrier()
            staging = self.store.scratch / f".{ckpt.step_name(self.step)}.partial-shared"
        with disk_space.writing(staging, f"checkpoint of step {self.step}"):
            self.backend.save(staging)
            states = ckpt.save_rng(staging, rank)
        _crash_point("QVL_TEST_KILL_IN_CHECKPOINT", self.step)
        if world > 1:
            (staging / f"state-rank{rank}.json").write_text(json.dumps(states))
        _barrier()
        uri = ""
        if rank == 0:
            state = {
                "step": self.step,
                "cursor": vars(self.cursor),
                "rng": states,
                "history": self.history,
                "evals": self.evals,
                "extra": self.extra.state() if self.extra is not None else {},
            }
            ckpt.write_state(staging, state)
            uri = self.store.commit(staging, self.step)
        _barrier()
        return uri

    def try_resume(self) -> int | None:
        local = self.store.newest_intact(self.backend.rank)
        if local is None:
            return None
        state = ckpt.read_state(local)
        self.backend.load(local)
        self.step = int(state["step"])
        self.order.cursor = DataCursor(**state["cursor"])
        self.history, self.evals = state["history"], state["evals"]
        if self.extra is not None:
            self.extra.load(state.get("extra", {}))
        rank = self.backend.rank
        rng = state["rng"] if rank == 0 else json.loads((local / f"state-rank{rank}.json").read_text())
        ckpt.load_rng(local, rng, rank)  # last: nothing after this may consume randomness before training
        return self.step

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self, evaluate: Evaluate | None = None) -> TrainResult:
        """Train over the phases from `sample` (resuming from the newest checkpoint); evaluate at eval_every."""
        started = time.perf_counter()
        counts = {"_tokens": 0, "_slots": 0, "_real": 0, "_positions": 0}

        ahead: list[Generator[PreparedStep, None, None]] = []  # started at the first step, after any resume

        def one_step() -> dict[str, float]:
            if not ahead:
                ahead.append(self._inputs_ahead())
            indices, phase = self.next_indices()
            waiting = time.perf_counter()
            step = next(ahead[0], None)
            if step is None or step.indices != indices:  # past the prefetch plan (an eval-weighted phase)
                if step is not None:
                    raise RuntimeError(f"prefetched step inputs {step.indices[:4]} are not step {self.step + 1}'s")
                step = self.prepare(indices, self._items(indices))
            waited = time.perf_counter() - waiting
            metrics = self.train_step(step)
            metrics["time/data_wait_s"] = waited  # the step's wait for its inputs (~0 when prefetched in time)
            metrics["time/step_s"] = time.perf_counter() - waiting
            for key in counts:
                counts[key] += int(metrics.pop(key))
            metrics["phase"] = self.phases.index(phase)
            return metrics

        try:
            resumed, saved = self.drive(one_step, evaluate)
        finally:
            for iterator in ahead:
                iterator.close()
        return TrainResult(
            steps=self.step,
            resumed_from=resumed,
            history=self.history,
            evals=self.evals,
            checkpoints=saved,
            padding_efficiency=counts["_real"] / counts["_positions"] if counts["_positions"] else 0.0,
            budget_fill=counts["_tokens"] / counts["_slots"] if counts["_slots"] else 0.0,
            tokens=counts["_tokens"],
            seconds=time.perf_counter() - started,
            parameters=self.parameters,
            set_aside=list(self.store.set_aside),
        )

    def drive(
        self,
        step_fn: Callable[[], dict[str, float]],
        evaluate: Evaluate | None = None,
        *,
        log_prefix: str = "train",
        after_eval: Callable[[], None] | None = None,
        stopped: Callable[[], bool] = lambda: False,
    ) -> tuple[int | None, list[str]]:
        """The loop skeleton: resume, then `step_fn()` per step until train.steps (or `stopped()`), with logging,
        evaluation every eval_every (then `after_eval()`), checkpoints every checkpoint_every and a final
        checkpoint. Returns (the step resumed from or None, the checkpoints written)."""
        self.parameters = parameter_manifest(self.model)
        frozen = frozen_fingerprints(self.model)
        resumed = self.try_resume()
        if resumed is None and evaluate is not None:
            self._evaluate(evaluate)
        saved: list[str] = []
        while self.step < self.train.steps and not stopped():
            metrics = step_fn()
            self.step += 1
            check_finite(metrics, self.step)
            metrics["step"] = self.step
            self.history.append(metrics)
            progress.update(log_prefix, self.step, self.train.steps, "steps", loss=metrics.get("loss", math.nan))
            if self.step % self.train.log_every == 0 or self.step == self.train.steps:
                logged = {f"{log_prefix}/{k}": v for k, v in metrics.items() if k != "step"}
                self.tracker.log_metrics(logged, step=self.step)
            _crash_point("QVL_TEST_KILL_AT_STEP", self.step)
            if evaluate is not None and self._due(self.train.eval_every):
                self._evaluate(evaluate)
                if after_eval is not None:
                    after_eval()
            if self._due(self.train.checkpoint_every):
                saved.append(self.save_checkpoint())
        if evaluate is not None and (not self.evals or self.evals[-1]["step"] != self.step):
            self._evaluate(evaluate)
            if after_eval is not None:
                after_eval()
        if resumed != self.step:  # a run resumed from its final checkpoint has nothing new to save
            saved.append(self.save_checkpoint())
        check_frozen(frozen, self.model)
        return resumed, saved

    def _due(self, every: int) -> bool:
        """A periodic action at this step (never at the last step: the end of the run does it)."""
        return bool(every) and self.step % every == 0 and self.step < self.train.steps

    def _evaluate(self, evaluate: Evaluate) -> None:
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.autocast_context():
            result = {"step": self.step, **evaluate(self.step, self.backend.module)}
        self.model.train(was_training)
        self.evals.append(result)
        self.tracker.log_metrics({f"eval/{k}": v for k, v in result.items() if k != "step"}, step=self.step)

    def autocast_context(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def prepare(self, indices: list[int], items: list) -> PreparedStep:
        """A step's items planned and packed into this rank's micro-batches (step_inputs.prepare_step)."""
        return prepare_step(
            indices,
            items,
            max_tokens=self.train.max_tokens_per_micro_batch,
            unit_weight=self.data.unit_weight or target_tokens,
            rank=self.backend.rank,
            world=self.backend.world_size,
        )

    def train_step(self, items: list | PreparedStep) -> dict[str, float]:
        """One optimizer step over `items` (samples, or groups kept in one micro-batch, or a prepared step);
        returns its metrics."""
        self.model.train()
        step = items if isinstance(items, PreparedStep) else self.prepare([], items)
        samples, plan_size, total_targets = step.samples, step.plan_size, step.total_targets
        world = self.backend.world_size
        loss_on_device: torch.Tensor | float = 0.0  # summed on the device and read once after the micro-batches
        real, positions = 0, 0
        summed: dict[str, torch.Tensor | float] = {}
        self.backend.begin_step(len(step.batches))
        for micro, batch, weight in zip(step.micro, step.batches, step.weights, strict=True):
            if weight:
                used, computed = batch_tokens(batch)
                real, positions = real + used, positions + computed
            batch = to_device(batch, self.device)
            self.backend.before_forward()
            with self.autocast_context():
                loss_sum, _, extra = self.loss_fn(self.backend.module, batch, micro)
            self.backend.backward(loss_sum * (weight / total_targets))
            loss_on_device = loss_on_device + weight * loss_sum.detach().double()  # float64 as the host's sum was
            for k, v in extra.items():
                value = v.detach().double() if isinstance(v, torch.Tensor) else v
                summed[k] = summed.get(k, 0.0) + weight * value / plan_size
        loss_total, extras = read_once(loss_on_device, summed)
        if world > 1:  # one collective; loss_fn returns the same keys on every micro-batch and rank
            keys = sorted(extras)
            totals = self.backend.all_reduce_sum([loss_total, *(extras[k] for k in keys)])
            loss_total, extras = totals[0], dict(zip(keys, totals[1:], strict=True))
        norms, lrs = self.backend.step()
        tokens = sum(s.num_tokens for s in samples)
        slots = plan_size * self.train.max_tokens_per_micro_batch
        # Packed rows carry no padding (every computed position is a real token); budget_fill says how full the
        # micro-batches are against max_tokens_per_micro_batch (what a fixed-shape GPU buffer would pad to).
        return {
            "loss": loss_total / total_targets,
            "micro_batches": float(plan_size),
            "budget_fill": tokens / slots,
            "lr": lrs[0] if lrs else 0.0,
            **{f"grad_norm/{k}": v for k, v in norms.items()},
            **extras,
            "_tokens": tokens,
            "_slots": slots,
            "_real": real,
            "_positions": positions,
        }


def read_once(loss: torch.Tensor | float, extras: dict[str, torch.Tensor | float]) -> tuple[float, dict[str, float]]:
    """A step's summed loss and extras as floats, the device values read in one transfer (one host sync a step,
    not one per micro-batch and value: a sync drains the GPU's queue while the host waits)."""
    values = {"": loss, **extras}
    on_device = {k: v for k, v in values.items() if torch.is_tensor(v)}
    read = dict(zip(on_device, torch.stack(list(on_device.values())).tolist(), strict=True)) if on_device else {}
    floats = {k: float(read.get(k, v)) for k, v in values.items()}
    return floats.pop(""), floats


class NonFiniteTraining(ValueError):
    """A step's loss or gradient norm is inf / nan: the stage stops before anything of it is saved."""


def check_finite(metrics: dict[str, float], step: int) -> None:
    """Stop at the first step whose loss (any "...loss..." metric) or gradient norm is not finite; the weights it
    produced are never checkpointed or exported."""
    bad = {
        k: v
        for k, v in metrics.items()
        if ("loss" in k or k.startswith("grad_norm")) and isinstance(v, float) and not math.isfinite(v)
    }
    if bad:
        raise NonFiniteTraining(
            f"step {step}: {bad} is not finite; nothing of this step is saved. Lower optim.lr, check lora.alpha / "
            "optim.eps / the loss weights, or train in float32 (train.precision)."
        )


def data_workers(train: TrainConfig, device: torch.device) -> int:
    """train.data_workers, or for null 1 on CUDA and 0 on the CPU (on the demo's 2 cores a prefetched step still
    waited about a third of its time: the worker competes with the step's threads, docs/benchmarks.md)."""
    if train.data_workers is not None:
        return train.data_workers
    return 1 if device.type == "cuda" else 0


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def is_main_process() -> bool:
    """True outside torch.distributed and on rank 0: only it writes outputs and logs."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _crash_point(variable: str, step: int) -> None:
    """Fault injection for the resume tests: SIGKILL this process when env `variable` equals `step` (only the first
    time when QVL_TEST_KILL_ONCE names a marker file: the retry of a killed KFP task then runs through)."""
    if os.environ.get(variable) != str(step):
        return
    once = os.environ.get("QVL_TEST_KILL_ONCE")
    if once:
        if os.path.exists(once):
            return
        Path(once).write_text(f"{variable}={step}\n")
    os.kill(os.getpid(), signal.SIGKILL)
