"""The RL trainer: rollouts from the current policy, rewards, advantages (PPO / TER / GRPO), the update epochs.

It drives a TrainLoop (model/training.py) by composition: the loop owns the backend, the packed update steps,
checkpoints and exact resume; the trainer owns the RL state (KL controller, reward moments, TER baseline, gates,
length reference, timing), saved with every checkpoint as the loop's `extra` (state() / load()).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from components._shared.data import datasets
from components._shared.model.checkpoint import CheckpointStore
from components._shared.model.encoder import Sample
from components._shared.model.families import family_for
from components._shared.model.packing import pack, plan_micro_batches, to_device
from components._shared.model.step_inputs import step_inputs
from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop, data_workers
from components._shared.platform.tracking import Tracker
from components.rl import algorithms
from components.rl.algorithms.base import TokenBatch
from components.rl.algorithms.core import kl_k3
from components.rl.config import RlConfig
from components.rl.gates import Gates
from components.rl.rollout import Policy, Rollout, RolloutEngine, split_by_sample, token_outputs
from components.rl.shard import Shard


@dataclass
class StepPrompts:
    """What an RL step needs that no model computes: its prompt records (image decoded, grounding frame), their
    encoded rollout prompts and the step's ptx samples (pure functions of the step and its indices), so
    `train.data_workers` build them while the previous step generates, scores and updates."""

    step: int
    indices: list[int]
    records: list[dict]
    prompts: list[Sample]
    ptx: list[Sample]

    def pin_memory(self) -> StepPrompts:
        return self  # the rollout concatenates prompts per generation batch: a pinned prompt would not reach the copy


def check_kept(kept: int, rollouts: int, minibatches: int, step: int) -> None:
    """Refuse a step whose kept rollouts cannot fill `minibatches` (DAPO's dynamic sampling drops the groups that
    all scored alike; a minibatch would be empty: thirteenth pass, R32)."""
    if 0 < kept < minibatches:
        raise ValueError(
            f"rl step {step}: dynamic sampling kept {kept} of {rollouts} rollouts (the others' groups all scored "
            f"alike), fewer than update.minibatches={minibatches}: lower update.minibatches, raise "
            "rollout.samples_per_prompt or train.samples_per_step, or set dapo.dynamic_sampling: false."
        )


class RlTrainer:
    """RL steps (rollouts, rewards, advantages, update epochs) driven through a TrainLoop's skeleton: its backend,
    packed update steps, checkpoints and resume, with the RL state saved beside them."""

    def __init__(
        self,
        policy: Policy,
        reference,
        *,
        cfg: RlConfig,
        prompts: list[dict],
        image,
        engine: RolloutEngine,
        rewards: dict,
        checkpoints: CheckpointStore,
        tracker: Tracker,
        ptx_pool: list[dict] | None = None,
    ) -> None:
        self.cfg = cfg
        self.updates_per_step = cfg.update.epochs * cfg.update.minibatches
        self.algorithm = algorithms.build(cfg)
        optim = self.algorithm.optim(cfg.optim)
        # Prompts are drawn by index (no `sample`): the items of an update are built from its rollouts. Each step
        # takes epochs x minibatches optimizer updates; the schedule advances once per step.
        settings = LoopSettings.of(cfg, optim=optim, updates_per_step=self.updates_per_step)
        data = LoopData(phases=[Phase("rl", cfg.train.steps, list(range(len(prompts))))], unit_weight=self._unit_weight)
        self.loop = TrainLoop(policy, settings, data, checkpoints, tracker=tracker, loss_fn=self._loss, extra=self)
        self.algorithm.attach(self.loop.backend)
        self.shard = Shard.current()  # the loop's backend has started torch.distributed when there are several ranks
        train = cfg.train
        self.synced = self.shard.world > 1 and train.backend == "deepspeed" and train.zero_stage == 3
        self.reference = frozen_for_inference(reference, cfg, self.loop.device)
        self.prompts, self.image, self.engine, self.rewards = prompts, image, engine, rewards
        self.ptx_pool = ptx_pool or []
        self.ptx_token_weight = 0.0  # set with each step's ptx samples (see _ptx_samples)
        self.gates = Gates(cfg.gates)
        self.length_reference: float | None = None
        self.stop_reason = ""
        self.last_rollouts: list[Rollout] = []
        self.timing: defaultdict[str, float] = defaultdict(float)
        self.generated_tokens = 0
        self.heldout_before: list[float] = []  # per-question efficacy of the SFT model (step 0), for the paired test

    # -- state saved with every checkpoint (the loop's `extra`) -------------------------------------------
    def state(self) -> dict:
        return {
            "algorithm": self.algorithm.state(),
            "gates": self.gates.state(),
            "length_reference": self.length_reference,
            "stop_reason": self.stop_reason,
            "timing": dict(self.timing),
            "generated_tokens": self.generated_tokens,
            "heldout_before": self.heldout_before,
        }

    def load(self, state: dict) -> None:
        self.algorithm.load(state["algorithm"])
        self.gates.load(state["gates"])
        self.length_reference, self.stop_reason = state["length_reference"], state["stop_reason"]
        self.timing = defaultdict(float, state["timing"])
        self.generated_tokens = int(state["generated_tokens"])
        self.heldout_before = [float(x) for x in state.get("heldout_before", [])]

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self, evaluate: Callable[[int, Any], dict[str, float]]) -> int | None:
        """Train until train.steps or an early stop; returns the step resumed from (None for a fresh run)."""
        ahead: list[Generator[StepPrompts, None, None]] = []  # started at the first step, after any resume

        def next_step() -> dict[str, float]:
            if not ahead:
                plan = [(self.loop.step + k, indices) for k, indices in enumerate(self.loop.upcoming_indices())]
                workers = data_workers(self.cfg.train, self.loop.device)
                ahead.append(
                    step_inputs(
                        plan, self._step_prompts, workers=workers, depth=self.cfg.train.prefetch_steps, pin=False
                    )
                )
            indices, _ = self.loop.next_indices()
            waiting = time.perf_counter()
            prepared = next(ahead[0], None)  # RL's plan covers every remaining step (no eval-weighted phases)
            if prepared is None or (prepared.step, prepared.indices) != (self.loop.step, indices):
                got = prepared.step if prepared else "none"
                raise RuntimeError(f"prefetched RL prompts of step {got} are not step {self.loop.step}'s")
            waited = time.perf_counter() - waiting
            return self.rl_step(prepared.records, prepared) | {"time/data_wait_s": waited}

        try:
            resumed, _ = self.loop.drive(
                next_step,
                evaluate,
                log_prefix="rl",
                after_eval=self._check_divergence,
                stopped=lambda: bool(self.stop_reason),
            )
        finally:
            for iterator in ahead:
                iterator.close()
        return resumed

    def _step_prompts(self, entry: tuple[int, list[int]]) -> StepPrompts:
        """The model-free inputs of RL step `step` (0-based) drawing prompts `indices` (run in a data worker)."""
        step, indices = entry
        records = [{**self.prompts[i], "pil": self.image(self.prompts[i]["image"])} for i in indices]
        records = [{**r, **self.engine.encoder.box_frame(r)} for r in records]
        ptx = self._ptx_encoded(step) if self.cfg.ptx.coef else []
        return StepPrompts(step, list(indices), records, self.engine.encode_prompts(records), ptx)

    def _check_divergence(self) -> None:
        window = max(1, self.loop.train.eval_every or len(self.loop.history))
        rewards = [h["reward"] for h in self.loop.history]
        if len(rewards) < 2:
            return
        rise = float(np.mean(rewards[-window:]) - np.mean(rewards[:window]))
        drop = self.loop.evals[0]["efficacy"] - self.loop.evals[-1]["efficacy"]
        self.gates.check_eval(self.loop.step, reward_rise=rise, heldout_drop=drop)

    def rl_step(self, records: list[dict], prepared: StepPrompts | None = None) -> dict[str, float]:
        """Sample, score and reward rollouts of `records`, then run the update epochs; returns the step's metrics.
        `prepared`: the step's prompts and ptx samples built ahead (`_step_prompts`); built here without it."""
        cfg = self.cfg
        policy = self.loop.backend.module
        started = time.perf_counter()
        policy.eval()
        with torch.no_grad(), self.loop.autocast_context():
            prompts = prepared.prompts if prepared else None
            rollouts = self.engine.sample(
                policy.model,
                records,
                cfg.rollout.samples_per_prompt,
                prompts,
                seed=(cfg.seed, 5_000_011, self.loop.step),
                shard=self.shard,
                synced=self.synced,
            )
        generated = time.perf_counter()
        completions = [r.text for r in rollouts]
        batch = {
            "records": [r.record for r in rollouts],
            "finished": [r.finished for r in rollouts],
            "shard": self.shard,
        }
        prompts = [r.record["question"] for r in rollouts]
        per_reward = {name: fn(prompts, completions, **batch) for name, fn in self.rewards.items()}
        for i, r in enumerate(rollouts):
            r.rewards = {name: values[i] for name, values in per_reward.items()}
            r.reward = sum(cfg.rewards[name] * values[i] for name, values in per_reward.items())
        with torch.no_grad(), self.loop.autocast_context():
            self.engine.score(policy, self.reference, rollouts, self.shard)
        scored = time.perf_counter()

        kl = float(np.mean([float(kl_k3(r.logprobs, r.ref_logprobs).mean()) for r in rollouts]))
        entropy = float(torch.cat([r.entropy for r in rollouts]).mean())
        length = float(np.mean([r.length for r in rollouts]))
        if self.length_reference is None:
            self.length_reference = length
        metrics = {
            "reward": float(np.mean([r.reward for r in rollouts])),
            "kl": kl,
            "entropy": entropy,
            "length": length,
            "length_ratio": length / self.length_reference,
            **{f"reward/{k}": float(np.mean(v)) for k, v in per_reward.items()},
            **self._parity(rollouts),
        }
        self.gates.check_step(self.loop.step + 1, kl=kl, length_ratio=metrics["length_ratio"], entropy=entropy)
        self.last_rollouts = rollouts
        self.stop_reason = self.algorithm.stop(kl, self.loop.step + 1)
        if self.stop_reason:
            metrics.update(self._timing(started, generated, scored, scored, rollouts))
            return metrics

        metrics.update(self.algorithm.shape_rewards(rollouts))
        metrics.update(self._advantages(rollouts))
        trained = self.algorithm.keep(rollouts)
        metrics["update/rollouts_kept"] = len(trained) / len(rollouts)
        check_kept(len(trained), len(rollouts), self.cfg.update.minibatches, self.loop.step)
        updates = self._update(trained, prepared.ptx if prepared else None) if trained else []
        updated = time.perf_counter()
        metrics.update(update_metrics(updates))
        metrics.update(self.algorithm.after_step(kl))
        metrics.update(self._timing(started, generated, scored, updated, rollouts))
        return metrics

    def _update(self, rollouts: list[Rollout], ptx_built: list[Sample] | None) -> list[dict[str, float]]:
        """The step's update epochs, each over `update.minibatches` optimizer steps (rollouts and ptx samples split
        evenly, the rollouts in a fresh order each epoch); returns each optimizer step's metrics."""
        cfg = self.cfg
        ptx = self._ptx_samples(rollouts, ptx_built) if cfg.ptx.coef else []
        updates = []
        order_rng = np.random.default_rng([cfg.seed, 7_000_003, self.loop.step])
        for _ in range(cfg.update.epochs):
            order = order_rng.permutation(len(rollouts))
            ptx_parts = np.array_split(np.arange(len(ptx)), cfg.update.minibatches)
            for part, ptx_part in zip(np.array_split(order, cfg.update.minibatches), ptx_parts, strict=True):
                updates.append(
                    self.loop.train_step([[rollouts[i].sample] for i in part] + [[ptx[i]] for i in ptx_part])
                )
        return updates

    def _parity(self, rollouts: list[Rollout]) -> dict[str, float]:
        """The sampled tokens' log-probabilities as generate() drew them against the trainer's scores of the same
        tokens (mean and max |delta|, their correlation); at the run's first step the mean must be within the
        tolerance (rl.parity.tolerance, else the family's for this precision), or the update would chase a mismatch."""
        sampler = torch.cat([r.sampler_logprobs for r in rollouts]).double()
        trainer = torch.cat([r.logprobs for r in rollouts]).double()
        delta = (sampler - trainer).abs()
        corr = torch.corrcoef(torch.stack([sampler, trainer]))[0, 1] if sampler.numel() > 1 else torch.tensor(1.0)
        metrics = {
            "parity/mean_abs": float(delta.mean()),
            "parity/max_abs": float(delta.max()),
            "parity/corr": float(corr) if torch.isfinite(corr) else 1.0,
        }
        if self.loop.step == 0:
            check_parity(self.cfg, self.loop.model, self.loop.autocast, metrics["parity/mean_abs"])
        return metrics

    def _unit_weight(self, unit: list) -> float:
        """The update's normaliser: completion tokens (or rollouts, for a sequence-level loss) only, so ptx samples
        leave the RL term's scale unchanged."""
        rl = [s for s in unit if not s.meta.get("ptx")]
        return float(len(rl)) if self.algorithm.sequence_mean else float(sum(s.num_targets for s in rl))

    def _ptx_encoded(self, step: int) -> list[Sample]:
        """`ptx.samples_per_step` records of the prompts file (of `ptx.types`, drawn afresh each step as a pure
        function of the seed and step) with their reference answers, encoded as SFT encodes them."""
        count = min(self.cfg.ptx.samples_per_step or self.loop.train.samples_per_step, len(self.ptx_pool))
        rng = np.random.default_rng([self.cfg.seed, 9_000_011, step])
        records = [self.ptx_pool[i] for i in rng.choice(len(self.ptx_pool), count, replace=False)]
        return [
            self.engine.encoder.encode(
                datasets.prompt_turns(r["question"]) + [{"role": "assistant", "text": r["answer"]}],
                images=[self.image(r["image"])],
                sample_id=f"ptx:{r['id']}",
            )
            for r in records
        ]

    def _ptx_samples(self, rollouts: list[Rollout], encoded: list[Sample] | None = None) -> list:
        """This step's ptx samples (`_ptx_encoded`, or `encoded` when built ahead), each target token weighing
        ptx.coef x (completion tokens / reference tokens of the step), so the term adds ptx.coef x the mean NLL."""
        samples = self._ptx_encoded(self.loop.step) if encoded is None else encoded
        completion_tokens = sum(r.length for r in rollouts)
        self.ptx_token_weight = self.cfg.ptx.coef * completion_tokens / sum(s.num_targets for s in samples)
        for s in samples:
            n = s.num_targets
            s.meta.update(
                ptx=True,
                old_logprobs=torch.zeros(n),
                ref_logprobs=torch.zeros(n),
                advantages=torch.zeros(n),
                returns=torch.zeros(n),
                old_values=torch.zeros(n),
            )
        if self.cfg.ptx.loss == "kl":
            self._reference_distributions(samples)
        return samples

    @torch.no_grad()
    def _reference_distributions(self, samples: list) -> None:
        """meta["ref_full_logprobs"] (targets x vocabulary, T=1) of each ptx sample under the frozen reference."""
        device = next(self.reference.parameters()).device
        sizes = [s.num_tokens for s in samples]
        groups = plan_micro_batches(sizes, max(self.engine.max_tokens, max(sizes)))

        def distributions(group: list[int]) -> list[torch.Tensor]:
            micro = [samples[i] for i in group]
            every_row = torch.ones(sum(s.num_targets for s in micro), dtype=torch.bool, device=device)
            with self.loop.autocast_context():
                out = token_outputs(
                    self.reference,
                    to_device(pack(micro), device),
                    1.0,
                    self.engine.suppressed,
                    plain_rows=every_row,
                    full_distribution=True,
                    chunk_rows=self.engine.chunk_rows,
                )
            return split_by_sample(out["plain_full"].float().cpu(), micro)

        for group, pieces in zip(groups, self.shard.map(groups, distributions, lockstep=True), strict=True):
            for i, rows in zip(group, pieces, strict=True):
                samples[i].meta["ref_full_logprobs"] = rows

    def _timing(self, started, generated, scored, updated, rollouts) -> dict[str, float]:
        split = {"generation": generated - started, "scoring": scored - generated, "update": updated - scored}
        for k, v in split.items():
            self.timing[k] += v
        tokens = sum(r.length for r in rollouts)
        self.generated_tokens += tokens
        return {
            **{f"time/{k}": v for k, v in split.items()},
            "rollout_tokens_per_second": tokens / max(split["generation"], 1e-9),
        }

    def _advantages(self, rollouts: list[Rollout]) -> dict[str, float]:
        """The algorithm's per-token advantages (and returns), into each rollout's sample.meta for the loss."""
        out = self.algorithm.advantages(rollouts, self.loop.step)
        for r in rollouts:
            r.sample.meta.update(
                old_logprobs=r.logprobs,
                ref_logprobs=r.ref_logprobs,
                sampler_logprobs=r.sampler_logprobs,
                advantages=r.advantages,
                returns=r.returns,
                old_values=r.values,
            )
        return out

    def _loss(self, policy: Policy, batch: dict, micro: list) -> tuple[torch.Tensor, int, dict[str, float]]:
        cfg = self.cfg
        ptx_on = bool(cfg.ptx.coef)
        rl = torch.cat([torch.full((s.num_targets,), not s.meta.get("ptx")) for s in micro])
        rl = rl.to(batch["targets"].device)
        out = policy.token_outputs(
            batch,
            cfg.rollout.temperature,
            self.engine.suppressed,
            plain_rows=~rl if ptx_on else None,
            full_distribution=ptx_on and cfg.ptx.loss == "kl",
            chunk_rows=self.engine.chunk_rows,
        )
        tokens = self._token_batch(micro, rl, out)
        loss, extras = self.algorithm.loss(tokens, self.loop.step, self.loop.train.steps)
        extras.update(ratio_statistics(tokens))
        if ptx_on:
            nll = -out["plain_logprobs"]
            ptx_loss = nll
            if cfg.ptx.loss == "kl":  # KL(reference || policy) per position, over the vocabulary
                ptx_samples = [s for s in micro if s.meta.get("ptx")]
                ref = (
                    torch.cat([s.meta["ref_full_logprobs"] for s in ptx_samples]).to(out["logprobs"].device)
                    if ptx_samples
                    else out["plain_full"]
                )
                ptx_loss = (ref.exp() * (ref - out["plain_full"])).sum(-1)
                extras["ptx_kl_sum"] = float(ptx_loss.detach().sum())
            loss = loss + self.ptx_token_weight * ptx_loss.sum()
            extras.update(ptx_nll_sum=float(nll.detach().sum()), ptx_tokens=float(nll.numel()))
        return loss, int(rl.sum()), extras

    def _token_batch(self, micro: list, rl: torch.Tensor, out: dict[str, torch.Tensor]) -> TokenBatch:
        """The micro-batch's rollout tokens (ptx left out) with what the algorithm's loss reads."""
        logp = out["logprobs"]

        def meta(key: str) -> torch.Tensor:
            return torch.cat([s.meta[key] for s in micro]).to(logp.device)[rl]

        critic = self.algorithm.critic
        old = meta("old_logprobs")
        weights = None
        if self.cfg.parity.tis_cap:  # trainer / sampler probability of each sampled token, capped (detached)
            weights = torch.exp(old - meta("sampler_logprobs")).clamp(max=self.cfg.parity.tis_cap)
        return TokenBatch(
            logprobs=logp[rl],
            old_logprobs=old,
            ref_logprobs=meta("ref_logprobs"),
            advantages=meta("advantages"),
            returns=meta("returns") if critic else None,
            old_values=meta("old_values") if critic else None,
            values=out["values"][rl] if critic else None,
            lengths=[s.num_targets for s in micro if not s.meta.get("ptx")],
            sampling_weights=weights,
        )


def update_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """A step's update diagnostics over its optimizer steps: means of the loss, clip fraction, approximate KL to the
    sampling policy and value loss, the ratio's extremes, ptx per reference token, the last step's norms and lr."""
    if not updates:
        return {"update/skipped": 1.0}
    metrics: dict[str, float] = {}
    for key, reduce in (("loss", np.mean), ("clip_fraction", np.mean), ("approx_kl", np.mean), ("value_loss", np.mean),
                        ("ratio_max", np.max), ("ratio_min", np.min)):  # fmt: skip
        values = [u[key] for u in updates if key in u]
        if values:
            metrics[f"update/{key}"] = float(reduce(values))
    if "ptx_tokens" in updates[0]:  # per reference token, whichever micro-batches the reference samples were packed in
        tokens = sum(u["ptx_tokens"] for u in updates)
        metrics["update/ptx_nll"] = sum(u["ptx_nll_sum"] for u in updates) / tokens
        if "ptx_kl_sum" in updates[0]:
            metrics["update/ptx_kl"] = sum(u["ptx_kl_sum"] for u in updates) / tokens
    metrics.update({k: v for k, v in updates[-1].items() if k.startswith("grad_norm/") or k == "lr"})
    return metrics


def ratio_statistics(tokens: TokenBatch) -> dict[str, float]:
    """The update's probability ratio to the sampling policy over the micro-batch's rollout tokens: its extremes and
    the approximate KL mean((r - 1) - log r) (every micro-batch reports the same keys)."""
    if not tokens.lengths:
        return {"ratio_max": 1.0, "ratio_min": 1.0, "approx_kl": 0.0}
    log_ratio = tokens.logprobs.detach() - tokens.old_logprobs
    ratio = torch.exp(log_ratio)
    return {
        "ratio_max": float(ratio.max()),
        "ratio_min": float(ratio.min()),
        "approx_kl": float((ratio - 1.0 - log_ratio).mean()),
    }


def check_parity(cfg: RlConfig, policy, autocast: bool, mean_abs: float) -> None:
    """Refuse a run whose sampler and trainer disagree on the first step's tokens beyond the tolerance."""
    family = family_for(policy)
    precision = "bf16" if autocast else "fp32"
    tolerance = cfg.parity.tolerance if cfg.parity.tolerance is not None else family.parity_tolerance[precision]
    if mean_abs > tolerance:
        raise ValueError(
            f"rl: the rollouts' sampling log-probabilities differ from the trainer's by {mean_abs:.3g} per token on "
            f"average at the first step, above the {family.name} tolerance {tolerance:g} in {precision}: generate() "
            "and the packed forward do not compute the same policy (check the model's generation and attention "
            "settings). Raise rl.parity.tolerance if the mismatch is expected, or set rl.parity.tis_cap to correct it."
        )


def frozen_for_inference(model, cfg: RlConfig, device):
    """The frozen reference for scoring: on this rank's device, or with `frozen_sharding: zero3` partitioned over
    the ranks by a ZeRO-3 engine without an optimizer (every rank then holds 1/world of it; its passes run in
    lockstep, shard.py)."""
    if cfg.frozen_sharding != "zero3":
        return model.to(device).eval()
    import deepspeed

    from components._shared.model.ds_backend import register_outside_reads

    bf16 = next(model.parameters()).dtype == torch.bfloat16
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model.eval(), config=config)
    register_outside_reads(engine.module)
    return engine.module.eval()
