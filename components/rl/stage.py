"""rl: optimise the SFT policy on verifiable prompts with PPO, TER or GRPO, guarded by reward-hacking gates.

1 process (CPU/tiny):  python -m components.rl --config pipelines/presets/tiny.yaml --base-model OUT/sft/model \
                           --reward-model OUT/reward_model/model --data runs/world/heldout --output-dir OUT/rl
In the pipeline:       components/rl/component.py calls run_stage("rl", ...).

Each step: sample completions of `train.samples_per_step` prompts from the current policy (rollout engine),
score them with the configured reward callables (weighted sum), compute log-probabilities under the policy and
the frozen reference (the SFT model) and, for PPO, values; turn rewards into per-token advantages
(PPO: normalised + clipped score with a per-token KL penalty, GAE; TER: efficacy minus an EMA baseline;
GRPO: group-relative), then run `update.epochs` x `update.minibatches` optimizer steps through the shared
TrainLoop machinery (packed micro-batches, per-group AdamW, checkpoints). The monitors (KL to the reference,
mean length vs the first step, entropy, training reward vs held-out efficacy) are logged every step and
fail the stage through the gates; PPO also stops early (keeping its policy) past `ppo.kl_stop`.

Data (`--data`): the prompts file (default sft.jsonl; first human turn = prompt with one image, first gpt turn
= reference answer, `type` = question type) and eval.jsonl (held-out efficacy). Writes model/ (the policy, HF
format), value_head.safetensors (PPO), eval_predictions.jsonl, rollouts.jsonl (the last step's samples with
their rewards, for inspection), report.md.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components._shared.eval import evaluation as E
from components._shared.eval import metrics as M
from components._shared.eval import readers
from components._shared.model import checkpoint as ckpt
from components._shared.model.checkpoint import CheckpointStore
from components._shared.model.packing import ConversationEncoder
from components._shared.model.train_config import OptimConfig
from components._shared.model.training import (
    Phase,
    TorchBackend,
    TrainLoop,
    _crash_point,
    lr_factor,
    resolve_device,
)
from components._shared.model.vlm import freeze, load_vlm, save_vlm, set_pixel_bounds
from components._shared.platform.reports import figure, history_series
from components._shared.platform.tracking import Tracker
from components.rl import algorithms as A
from components.rl.config import GateConfig, RlConfig
from components.rl.rewards import EfficacyCache, build_rewards, task_efficacy
from components.rl.rollout import Policy, Rollout, RolloutEngine, packed_micro_batches, split_by_sample, token_outputs


class GateTripped(RuntimeError):
    """A reward-hacking monitor crossed its bound; the message names the gate."""


class Gates:
    """Step gates trip after `patience` consecutive violations; the divergence gate is checked at each eval."""

    def __init__(self, cfg: GateConfig) -> None:
        self.cfg = cfg
        self.strikes: dict[str, int] = defaultdict(int)

    def check_step(self, step: int, *, kl: float, length_ratio: float, entropy: float) -> None:
        c = self.cfg
        checks = {
            "kl_max": (0 < c.kl_max < kl, f"per-token KL to the reference {kl:.4f} > {c.kl_max}"),
            "length_ratio_max": (
                0 < c.length_ratio_max < length_ratio,
                f"mean completion length {length_ratio:.2f}x the first step's > {c.length_ratio_max}",
            ),
            "length_ratio_min": (
                length_ratio < c.length_ratio_min,
                f"mean completion length {length_ratio:.2f}x the first step's < {c.length_ratio_min}",
            ),
            "entropy_min": (entropy < c.entropy_min, f"mean token entropy {entropy:.4f} < {c.entropy_min}"),
        }
        for name, (bad, detail) in checks.items():
            self.strikes[name] = self.strikes[name] + 1 if bad else 0
            if self.strikes[name] >= c.patience:
                raise GateTripped(
                    f"rl gate gates.{name} tripped at step {step}: {detail} for {c.patience} consecutive steps. The "
                    "policy is drifting from the SFT model or gaming its reward; lower optim.lr, raise the KL "
                    f"penalty, check the rewards, or relax gates.{name} if the change is intended."
                )

    def check_eval(self, step: int, *, reward_rise: float, heldout_drop: float) -> None:
        bound = self.cfg.heldout_drop_max
        if bound and reward_rise > 0 and heldout_drop > bound:
            raise GateTripped(
                f"rl gate gates.heldout_drop_max tripped at step {step}: the training reward rose by {reward_rise:.4f} "
                f"while held-out efficacy fell by {heldout_drop:.4f} (> {bound}); the policy is learning to please the "
                "reward, not to answer. Check the reward functions / reward model (rollouts.jsonl shows samples)."
            )

    def state(self) -> dict:
        return dict(self.strikes)

    def load(self, state: dict) -> None:
        self.strikes = defaultdict(int, {k: int(v) for k, v in state.items()})


def load_prompts(
    data_dir: Path, cfg: RlConfig, *, need_types: bool, types: list[str] | None = None, setting: str = "prompt_types"
) -> list[dict]:
    """Prompt records {"id", "image", "question", "answer", "type"} from the prompts file (LLaVA format), of
    `types` (default `prompt_types`; empty = every type); a type no record has is an error naming `setting`."""
    types = cfg.prompt_types if types is None else types
    prompts, seen_types = [], set()
    for r in readers.conversation_questions(data_dir, cfg.prompts_file, label="rl prompt"):
        seen_types.add(r["type"])
        if need_types and r["type"] not in M.QUESTION_TYPES:
            raise ValueError(
                f"rl prompt {r['id']!r} has type {r['type']!r}; the efficacy reward needs one of "
                f"{M.QUESTION_TYPES}. Fix the record or drop the efficacy reward."
            )
        if types and r["type"] not in types:
            continue
        prompts.append(r)
        if cfg.max_records and len(prompts) >= cfg.max_records:
            break
    absent = sorted(set(types) - seen_types)
    if absent:
        raise ValueError(
            f"rl {setting} names question type(s) {absent} that no record of {cfg.prompts_file} has "
            f"(it has {sorted(seen_types)}{' within max_records' if cfg.max_records else ''}); fix or "
            "drop them."
        )
    if not prompts:
        raise ValueError(f"no rl prompts in {data_dir / cfg.prompts_file} (question types {types or 'all'}).")
    return prompts


class RlLoop(TrainLoop):
    """TrainLoop's backend, checkpoints and packed update steps, driven by rollouts instead of a dataset."""

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
        self.updates_per_step = cfg.update.epochs * cfg.update.minibatches  # read by _lr_lambda during __init__
        optim = cfg.optim
        if cfg.algorithm == "ter":  # TER's own gradient clip for every group
            optim = OptimConfig(
                **{**cfg.optim.model_dump(), "max_grad_norm": cfg.ter.max_grad_norm, "group_max_grad_norm": {}}
            )
        super().__init__(
            policy,
            train=cfg.train,
            optim=optim,
            schedule=cfg.schedule,
            sample=lambda i: i,
            phases=[Phase("rl", cfg.train.steps, list(range(len(prompts))))],
            checkpoints=checkpoints,
            tracker=tracker,
            loss_fn=self._loss,
            seed=cfg.seed,
            extra_state=self._state,
            load_extra_state=self._load_state,
            unit_weight=self._rollout_tokens,
        )
        if cfg.algorithm == "ter" and cfg.ter.grad_ema:
            assert isinstance(self.backend, TorchBackend)  # RlConfig refuses ter.grad_ema with DeepSpeed
            self.backend.grad_ema = A.GradientEma(cfg.ter.grad_ema)
        self.reference = reference.to(self.device).eval()
        self.prompts, self.image, self.engine, self.rewards = prompts, image, engine, rewards
        self.ptx_pool = ptx_pool or []
        self.ptx_token_weight = 0.0  # set with each step's ptx samples (see _ptx_samples)
        self.kl_ctl = A.AdaptiveKLController(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
        self.moments = A.RunningMoments()
        self.baseline = A.EmaBaseline(cfg.ter.baseline_decay)
        self.gates = Gates(cfg.gates)
        self.length_reference: float | None = None
        self.stop_reason = ""
        self.last_rollouts: list[Rollout] = []
        self.timing: defaultdict[str, float] = defaultdict(float)
        self.generated_tokens = 0
        self.heldout_before: list[float] = []  # per-question efficacy of the SFT model (step 0), for the paired test

    # -- state saved with every checkpoint ----------------------------------------------------------------
    def _state(self) -> dict:
        return {
            "kl_coef": self.kl_ctl.state(),
            "moments": self.moments.state(),
            "baseline": self.baseline.state(),
            "gates": self.gates.state(),
            "length_reference": self.length_reference,
            "stop_reason": self.stop_reason,
            "timing": dict(self.timing),
            "generated_tokens": self.generated_tokens,
            "heldout_before": self.heldout_before,
        }

    def _load_state(self, state: dict) -> None:
        self.kl_ctl.load(state["kl_coef"])
        self.moments.load(state["moments"])
        self.baseline.load(state["baseline"])
        self.gates.load(state["gates"])
        self.length_reference, self.stop_reason = state["length_reference"], state["stop_reason"]
        self.timing = defaultdict(float, state["timing"])
        self.generated_tokens = int(state["generated_tokens"])
        self.heldout_before = [float(x) for x in state.get("heldout_before", [])]

    def _lr_lambda(self, step: int) -> float:  # optimizer step -> RL step
        return lr_factor(step // self.updates_per_step, self.train.steps, self.schedule)

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self, evaluate) -> dict:
        resumed = self.try_resume()
        if resumed is None:
            self._evaluate(evaluate)
        while self.step < self.train.steps and not self.stop_reason:
            indices, _ = self._next_indices()
            metrics = self._rl_step([{**self.prompts[i], "pil": self.image(self.prompts[i]["image"])} for i in indices])
            self.step += 1
            metrics["step"] = self.step
            self.history.append(metrics)
            if self.step % self.train.log_every == 0 or self.step == self.train.steps:
                self.tracker.log_metrics({f"rl/{k}": v for k, v in metrics.items() if k != "step"}, step=self.step)
            _crash_point("QVL_TEST_KILL_AT_STEP", self.step)
            if self.train.eval_every and self.step % self.train.eval_every == 0 and self.step < self.train.steps:
                self._evaluate(evaluate)
                self._check_divergence()
            if (
                self.train.checkpoint_every
                and self.step % self.train.checkpoint_every == 0
                and self.step < self.train.steps
            ):
                self.save_checkpoint()
        if self.evals[-1]["step"] != self.step:
            self._evaluate(evaluate)
            self._check_divergence()
        if resumed != self.step:
            self.save_checkpoint()
        return {"resumed_from": resumed}

    def _check_divergence(self) -> None:
        window = max(1, self.train.eval_every or len(self.history))
        rewards = [h["reward"] for h in self.history]
        if len(rewards) < 2:
            return
        rise = float(np.mean(rewards[-window:]) - np.mean(rewards[:window]))
        drop = self.evals[0]["efficacy"] - self.evals[-1]["efficacy"]
        self.gates.check_eval(self.step, reward_rise=rise, heldout_drop=drop)

    def _rl_step(self, records: list[dict]) -> dict[str, float]:
        cfg = self.cfg
        policy = self.backend.module
        started = time.perf_counter()
        policy.eval()
        with torch.no_grad(), self._autocast():
            rollouts = self.engine.sample(policy.model, records, cfg.rollout.samples_per_prompt)
        generated = time.perf_counter()
        completions = [r.text for r in rollouts]
        batch = {"records": [r.record for r in rollouts], "finished": [r.finished for r in rollouts]}
        prompts = [r.record["question"] for r in rollouts]
        per_reward = {name: fn(prompts, completions, **batch) for name, fn in self.rewards.items()}
        for i, r in enumerate(rollouts):
            r.rewards = {name: values[i] for name, values in per_reward.items()}
            r.reward = sum(cfg.rewards[name] * values[i] for name, values in per_reward.items())
        with torch.no_grad(), self._autocast():
            self.engine.score(policy, self.reference, rollouts)
        scored = time.perf_counter()

        kl = float(np.mean([float(A.kl_k3(r.logprobs, r.ref_logprobs).mean()) for r in rollouts]))
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
        }
        self.gates.check_step(self.step + 1, kl=kl, length_ratio=metrics["length_ratio"], entropy=entropy)
        self.last_rollouts = rollouts
        if cfg.algorithm == "ppo" and kl > cfg.ppo.kl_stop:
            self.stop_reason = f"ppo.kl_stop: per-token KL {kl:.4f} > {cfg.ppo.kl_stop} at step {self.step + 1}"
            metrics.update(self._timing(started, generated, scored, scored, rollouts))
            return metrics

        metrics.update(self._advantages(rollouts))
        ptx = self._ptx_samples(rollouts) if cfg.ptx.coef else []
        updates = []
        order_rng = np.random.default_rng([cfg.seed, 7_000_003, self.step])
        for _ in range(cfg.update.epochs):
            order = order_rng.permutation(len(rollouts))
            ptx_parts = np.array_split(np.arange(len(ptx)), cfg.update.minibatches)
            for part, ptx_part in zip(np.array_split(order, cfg.update.minibatches), ptx_parts, strict=True):
                updates.append(self._train_step([[rollouts[i].sample] for i in part] + [[ptx[i]] for i in ptx_part]))
        updated = time.perf_counter()
        for key in ("loss", "clip_fraction", "value_loss", "ratio_max"):
            values = [u[key] for u in updates if key in u]
            if values:
                metrics[f"update/{key}"] = float(np.mean(values))
        if ptx:  # per reference token, whichever micro-batches the reference samples were packed into
            tokens = sum(u["ptx_tokens"] for u in updates)
            metrics["update/ptx_nll"] = sum(u["ptx_nll_sum"] for u in updates) / tokens
            if cfg.ptx.loss == "kl":
                metrics["update/ptx_kl"] = sum(u["ptx_kl_sum"] for u in updates) / tokens
        metrics.update({k: v for k, v in updates[-1].items() if k.startswith("grad_norm/") or k == "lr"})
        if cfg.algorithm == "ppo":
            metrics["kl_coef"] = self.kl_ctl.value
            if cfg.ppo.adaptive_kl:
                self.kl_ctl.update(kl, 1)
        metrics.update(self._timing(started, generated, scored, updated, rollouts))
        return metrics

    @staticmethod
    def _rollout_tokens(unit: list) -> float:
        """The update's normaliser: completion tokens only, so ptx samples leave the RL term's scale unchanged."""
        return float(sum(s.num_targets for s in unit if not s.meta.get("ptx")))

    def _ptx_samples(self, rollouts: list[Rollout]) -> list:
        """`ptx.samples_per_step` records of the prompts file (of `ptx.types`, drawn afresh each step as a pure
        function of the seed and step) with their reference answers, encoded as SFT encodes them; each target token
        weighs ptx.coef x (completion tokens / reference tokens of the step), so the term adds ptx.coef x the mean
        NLL."""
        count = min(self.cfg.ptx.samples_per_step or self.train.samples_per_step, len(self.ptx_pool))
        rng = np.random.default_rng([self.cfg.seed, 9_000_011, self.step])
        records = [self.ptx_pool[i] for i in rng.choice(len(self.ptx_pool), count, replace=False)]
        samples = [
            self.engine.encoder.encode(
                readers.prompt_turns(r["question"]) + [{"role": "assistant", "text": r["answer"]}],
                images=[self.image(r["image"])],
                sample_id=f"ptx:{r['id']}",
            )
            for r in records
        ]
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
        for _, micro, batch in packed_micro_batches(samples, self.engine.max_tokens, device):
            every_row = torch.ones(sum(s.num_targets for s in micro), dtype=torch.bool, device=device)
            with self._autocast():
                out = token_outputs(self.reference, batch, 1.0, self.engine.suppressed, plain_rows=every_row)
            for s, rows in zip(micro, split_by_sample(out["plain_full"].float().cpu(), micro), strict=True):
                s.meta["ref_full_logprobs"] = rows

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
        """Per-token advantages (and PPO returns) into each rollout's sample.meta for the loss."""
        cfg = self.cfg
        rewards = [r.reward for r in rollouts]
        out: dict[str, float] = {}
        if cfg.algorithm == "ppo":
            if cfg.ppo.group_baseline:
                rewards = A.leave_one_out_centred(rewards, cfg.rollout.samples_per_prompt)
            self.moments.update(rewards)
            scores = self.moments.normalize(rewards, cfg.ppo.reward_clip)
            for r, score in zip(rollouts, scores, strict=True):
                token_rewards = A.ppo_token_rewards(score, r.logprobs, r.ref_logprobs, self.kl_ctl.value)
                r.advantages, r.returns = A.gae(token_rewards, r.values, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam)
            flat = A.whiten(torch.cat([r.advantages for r in rollouts]))
            for r, adv in zip(rollouts, flat.split([r.length for r in rollouts]), strict=True):
                r.advantages = adv
            out["score_normalised"] = float(np.mean(scores))
        elif cfg.algorithm == "ter":
            n = cfg.rollout.samples_per_prompt  # the samples of one prompt are consecutive
            baselines = []
            for start in range(0, len(rollouts), n):
                group = rollouts[start : start + n]
                baselines += self.baseline.leave_one_out(
                    group[0].record["id"], [r.reward for r in group], group[0].record["type"]
                )
            for r, b in zip(rollouts, baselines, strict=True):
                r.advantages = torch.full((r.length,), r.reward - b)
            for r in rollouts:
                self.baseline.update(r.record["id"], r.reward, r.record["type"])
            out["baseline"] = float(np.mean(baselines))
        else:
            for r, adv in zip(
                rollouts,
                A.group_advantages(rewards, cfg.rollout.samples_per_prompt, scale=cfg.grpo.scale_rewards),
                strict=True,
            ):
                r.advantages = torch.full((r.length,), adv)
        for r in rollouts:
            r.sample.meta.update(
                old_logprobs=r.logprobs,
                ref_logprobs=r.ref_logprobs,
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
            batch, cfg.rollout.temperature, self.engine.suppressed, plain_rows=~rl if ptx_on else None
        )
        logp = out["logprobs"]

        def meta(key: str) -> torch.Tensor:
            return torch.cat([s.meta[key] for s in micro]).to(logp.device)

        old, advantages = meta("old_logprobs"), meta("advantages")
        extras = {"ratio_max": float(torch.exp(logp.detach() - old)[rl].max()) if rl.any() else 1.0}
        if cfg.algorithm == "ter":
            weights = A.truncated_importance_weights(logp, old, cfg.ter.importance_cap)
            per_token = -(weights * advantages * logp)
        else:
            clip = (
                A.linear_decay(cfg.ppo.clip_start, cfg.ppo.clip_end, self.step, self.train.steps)
                if cfg.algorithm == "ppo"
                else cfg.grpo.clip
            )
            per_token, clipped = A.clipped_surrogate(logp, old, advantages, clip)
            extras["clip_fraction"] = float(clipped[rl].float().mean()) if rl.any() else 0.0
            if cfg.algorithm == "ppo":
                vloss = A.clipped_value_loss(out["values"], meta("old_values"), meta("returns"), cfg.ppo.value_clip)
                per_token = per_token + cfg.ppo.value_coef * vloss
                extras["value_loss"] = float(vloss.detach()[rl].mean()) if rl.any() else 0.0
            elif cfg.grpo.kl_coef:
                per_token = per_token + cfg.grpo.kl_coef * A.kl_k3(logp, meta("ref_logprobs"))
        loss = per_token[rl].sum()
        if ptx_on:
            nll = -out["plain_logprobs"]
            ptx_loss = nll
            if cfg.ptx.loss == "kl":  # KL(reference || policy) per position, over the vocabulary
                ptx_samples = [s for s in micro if s.meta.get("ptx")]
                ref = (
                    torch.cat([s.meta["ref_full_logprobs"] for s in ptx_samples]).to(logp.device)
                    if ptx_samples
                    else out["plain_full"]
                )
                ptx_loss = (ref.exp() * (ref - out["plain_full"])).sum(-1)
                extras["ptx_kl_sum"] = float(ptx_loss.detach().sum())
            loss = loss + self.ptx_token_weight * ptx_loss.sum()
            extras.update(ptx_nll_sum=float(nll.detach().sum()), ptx_tokens=float(nll.numel()))
        return loss, int(rl.sum()), extras


def heldout_eval(model, encoder: ConversationEncoder, records: list[dict], cfg: RlConfig) -> tuple[dict, list[dict]]:
    """Greedy answers on the held-out set: mean efficacy (overall, per type), the VQA suite, mean answer tokens."""
    answers = E.generate_answers(
        model, encoder, records, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens
    )
    rows = []
    for r, a in zip(records, answers, strict=True):
        rows.append(
            {
                "id": r["id"],
                "type": r["type"],
                "question": r["question"],
                "answer": r["answer"],
                "prediction": a,
                "score": M.score_answer(r["type"], a, r["answer"]),
                "efficacy": task_efficacy(r["type"], a, r["answer"], r["question"]),
                "tokens": len(encoder.tokenizer(a, add_special_tokens=False)["input_ids"]),
            }
        )
    by_type: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_type[row["type"]].append(row["efficacy"])
    summary = M.summarize(rows)
    return {
        "efficacy": float(np.mean([row["efficacy"] for row in rows])),
        **{f"efficacy/{t}": float(np.mean(v)) for t, v in by_type.items()},
        "vqa_exact_match": summary.get("vqa_exact_match", 0.0),
        "answer_tokens": float(np.mean([row["tokens"] for row in rows])),
    }, rows


def run(
    cfg: RlConfig, *, base_model: str, reward_model: str, data: str, output_dir: str | Path, tracker: Tracker
) -> dict[str, Any]:
    """Run RL from the SFT model; returns efficacy before/after, length ratio, final KL and the timing split."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "the rl stage runs in one process (rollouts are not sharded over ranks yet); launch it "
            "without torchrun (train.backend: deepspeed still works on one GPU)."
        )
    output_dir = Path(output_dir)
    data_dir = readers.resolve_data_dir(data, scratch=output_dir / ".scratch")
    prompts = load_prompts(data_dir, cfg, need_types=bool(cfg.rewards.get("efficacy")))
    eval_records = readers.load_eval_records(data_dir, per_type=cfg.eval.per_type, files=cfg.eval.files)
    key = ckpt.fingerprint(
        cfg.model_dump(mode="json"), {"base_model": base_model, "reward_model": reward_model, "data": data}
    )
    torch.manual_seed(cfg.seed)
    model, processor = load_vlm(base_model)
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    freeze(model, tuple(cfg.freeze))
    policy = Policy(model, value_head=cfg.algorithm == "ppo")
    device = resolve_device(cfg.train.device)
    reference, _ = load_vlm(base_model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    reference.requires_grad_(False)
    encoder = ConversationEncoder(
        processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    rewards = build_rewards(
        dict(cfg.rewards),
        reward_model_uri=reward_model or None,
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        device=device,
    )
    image = functools.lru_cache(maxsize=4096)(functools.partial(readers.load_image, data_dir))
    engine = RolloutEngine(
        encoder,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        batch_size=cfg.rollout.batch_size,
        max_tokens=cfg.train.max_tokens_per_micro_batch,
    )
    loop = RlLoop(
        policy,
        reference,
        cfg=cfg,
        prompts=prompts,
        image=image,
        engine=engine,
        rewards=rewards,
        checkpoints=CheckpointStore(
            ckpt.location(cfg.train.checkpoint_uri, "rl", key, output_dir),
            keep=cfg.train.keep_checkpoints,
            scratch=output_dir / ".scratch",
        ),
        tracker=tracker,
        ptx_pool=load_prompts(data_dir, cfg, need_types=False, types=cfg.ptx.types, setting="ptx.types")
        if cfg.ptx.coef
        else None,
    )
    final_rows: list[dict] = []

    def evaluate(step: int) -> dict[str, float]:
        summary, rows = heldout_eval(loop.backend.module.model, encoder, eval_records, cfg)
        final_rows[:] = rows
        if loop.step == 0:  # the SFT model's per-question scores: the paired test's "before"
            loop.heldout_before = [row["efficacy"] for row in rows]
        return summary

    outcome = loop.run(evaluate)
    if not final_rows:  # resumed after the last evaluation: score the final policy again for its predictions
        evaluate(loop.step)
    before, after = loop.evals[0], loop.evals[-1]
    history = loop.history
    cache = rewards.get("efficacy")
    if len(loop.heldout_before) != len(final_rows):
        raise RuntimeError(
            f"rl: the checkpoint holds {len(loop.heldout_before)} held-out scores of the SFT model "
            f"but {len(final_rows)} questions were scored now (a checkpoint from before the paired test, or another "
            f"eval set); rerun into a fresh output directory or train.checkpoint_uri."
        )
    change = M.paired_bootstrap(loop.heldout_before, [row["efficacy"] for row in final_rows], seed=cfg.seed)
    per_type: dict[str, dict[str, float]] = {}  # the same paired test within each question type
    for t in sorted({row["type"] for row in final_rows}):
        pairs = [
            (b, row["efficacy"]) for b, row in zip(loop.heldout_before, final_rows, strict=True) if row["type"] == t
        ]
        per_type[t] = M.paired_bootstrap([b for b, _ in pairs], [a for _, a in pairs], seed=cfg.seed)
    metrics: dict[str, Any] = {
        "algorithm": cfg.algorithm,
        "steps": loop.step,
        "resumed_from_step": outcome["resumed_from"] if outcome["resumed_from"] is not None else -1,
        "stopped_early": loop.stop_reason or "",
        "efficacy_before": before["efficacy"],
        "efficacy_after": after["efficacy"],
        "vqa_exact_match_before": before["vqa_exact_match"],
        "vqa_exact_match_after": after["vqa_exact_match"],
        **{f"{k}_before": v for k, v in before.items() if k.startswith("efficacy/")},
        **{f"{k}_after": v for k, v in after.items() if k.startswith("efficacy/")},
        "efficacy_gain": change["gain"],
        "efficacy_gain_ci_low": change["ci_low"],  # 95% paired bootstrap over the held-out questions
        "efficacy_gain_ci_high": change["ci_high"],
        "heldout_improved": change["improved"],
        "heldout_worsened": change["worsened"],
        **{
            f"efficacy_gain/{t}{suffix}": c[key]
            for t, c in per_type.items()
            for suffix, key in (("", "gain"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high"))
        },
        "mean_length_ratio": after["answer_tokens"] / max(before["answer_tokens"], 1e-9),
        "kl_final": history[-1]["kl"] if history else 0.0,
        "kl_max_seen": max((h["kl"] for h in history), default=0.0),
        "reward_first": history[0]["reward"] if history else float("nan"),
        "reward_final": history[-1]["reward"] if history else float("nan"),
        **{
            f"ptx_{k}_{when}": history[i][f"update/ptx_{k}"]
            for k in ("nll", "kl")
            for when, i in (("first", 0), ("final", -1))
            if history and f"update/ptx_{k}" in history[i]
        },
        "efficacy_cache_hit_rate": cache.hit_rate if isinstance(cache, EfficacyCache) else 0.0,
        **{f"seconds_{k}": round(v, 3) for k, v in loop.timing.items()},
        "rollout_tokens_per_second": round(loop.generated_tokens / max(loop.timing["generation"], 1e-9), 1),
    }
    policy = loop.backend.module
    if cfg.train.backend == "deepspeed":  # export a plain copy of the fp32 masters (ZeRO-3 partitions the module)
        weights = loop.backend.full_state_dict()
        policy = Policy(load_vlm(base_model)[0], value_head=cfg.algorithm == "ppo")
        policy.load_state_dict(weights)
    save_vlm(
        policy.model,
        processor,
        output_dir / "model",
        metadata={"stage": "rl", "algorithm": cfg.algorithm, "base_model": str(base_model)},
    )
    ckpt.write_pointer(output_dir, [loop.store.root])
    if policy.value_head is not None:
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()},
            str(output_dir / "value_head.safetensors"),
        )
    with (output_dir / "eval_predictions.jsonl").open("w") as f:
        for row in final_rows:
            f.write(json.dumps(row) + "\n")
    with (output_dir / "rollouts.jsonl").open("w") as f:
        for r in loop.last_rollouts:
            f.write(
                json.dumps(
                    {
                        "id": r.record["id"],
                        "type": r.record["type"],
                        "question": r.record["question"],
                        "reference": r.record["answer"],
                        "completion": r.text,
                        "finished": r.finished,
                        "reward": r.reward,
                        "rewards": r.rewards,
                    }
                )
                + "\n"
            )
    text = (
        report(metrics)
        + "\n".join(
            [
                *figure(
                    "reward",
                    "training reward",
                    history_series(history, ["reward"]),
                    output_dir=output_dir,
                    tracker=tracker,
                ),
                *figure(
                    "kl",
                    "per-token KL to the reference",
                    history_series(history, ["kl"]),
                    output_dir=output_dir,
                    tracker=tracker,
                ),
                *figure(
                    "length_entropy",
                    "length ratio and entropy",
                    history_series(history, ["length_ratio", "entropy"]),
                    output_dir=output_dir,
                    tracker=tracker,
                ),
                *figure(
                    "heldout_efficacy",
                    "held-out efficacy",
                    history_series(loop.evals, ["efficacy", "vqa_exact_match"]),
                    output_dir=output_dir,
                    tracker=tracker,
                ),
            ]
        )
        + "\n"
    )
    (output_dir / "report.md").write_text(text)
    shutil.rmtree(output_dir / ".scratch", ignore_errors=True)
    tracker.log_text(text, "report.md")
    return metrics


def report(metrics: dict[str, Any]) -> str:
    lines = [
        f"# RL ({metrics['algorithm']})",
        "",
        f"{metrics['steps']} steps"
        + (f"; stopped early: {metrics['stopped_early']}." if metrics["stopped_early"] else "."),
        f"Held-out efficacy {metrics['efficacy_before']:.3f} -> {metrics['efficacy_after']:.3f}; VQA exact match "
        f"{metrics['vqa_exact_match_before']:.3f} -> {metrics['vqa_exact_match_after']:.3f}; efficacy change "
        f"{metrics['efficacy_gain']:+.3f} (95% paired bootstrap {metrics['efficacy_gain_ci_low']:+.3f} to "
        f"{metrics['efficacy_gain_ci_high']:+.3f}; {metrics['heldout_improved']:.0f} questions better, "
        f"{metrics['heldout_worsened']:.0f} worse); mean answer length "
        f"{metrics['mean_length_ratio']:.2f}x the SFT model's; final per-token KL {metrics['kl_final']:.4f}.",
        "",
        "| type | efficacy before | after | change [95% paired CI] |",
        "|---|---|---|---|",
    ]
    for t in M.QUESTION_TYPES:
        if f"efficacy/{t}_before" in metrics:
            gain = (
                f"{metrics[f'efficacy_gain/{t}']:+.3f} [{metrics[f'efficacy_gain/{t}_ci_low']:+.3f}, "
                f"{metrics[f'efficacy_gain/{t}_ci_high']:+.3f}]"
                if f"efficacy_gain/{t}" in metrics
                else ""
            )
            lines.append(
                f"| {t} | {metrics[f'efficacy/{t}_before']:.3f} | {metrics[f'efficacy/{t}_after']:.3f} | {gain} |"
            )
    lines += [
        "",
        "Seconds per phase: "
        + ", ".join(f"{k.removeprefix('seconds_')} {v:.1f}" for k, v in metrics.items() if k.startswith("seconds_"))
        + f"; rollout {metrics['rollout_tokens_per_second']:.0f} tokens/s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(RlConfig, run, section="rl", inputs=("base_model", "reward_model", "data"), argv=argv)
