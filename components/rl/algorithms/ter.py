"""TER, task-efficacy reinforcement: REINFORCE on the task's efficacy reward against an exponential-moving-average
baseline per prompt (leave-one-out within a step), truncated importance weights for the epochs after the first,
and its own gradient clip (optionally smoothed by an EMA of the gradients); docs/references.md."""

from __future__ import annotations

import numpy as np
import torch

import components.rl.algorithms.core as A
from components._shared.model.train_config import OptimConfig
from components.rl.algorithms.base import Algorithm, TokenBatch


class Ter(Algorithm):
    name = "ter"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.baseline = A.EmaBaseline(cfg.ter.baseline_decay)

    def optim(self, optim: OptimConfig) -> OptimConfig:
        """TER's own gradient clip for every group."""
        clips = {"max_grad_norm": self.cfg.ter.max_grad_norm, "group_max_grad_norm": {}}
        return OptimConfig(**{**optim.model_dump(), **clips})

    def attach(self, backend) -> None:
        if self.cfg.ter.grad_ema:  # RlConfig refuses ter.grad_ema with DeepSpeed
            backend.grad_ema = A.GradientEma(self.cfg.ter.grad_ema)

    def advantages(self, rollouts, step: int) -> dict[str, float]:
        n = self.cfg.rollout.samples_per_prompt  # the samples of one prompt are consecutive
        baselines: list[float] = []
        for start in range(0, len(rollouts), n):
            group = rollouts[start : start + n]
            baselines += self.baseline.leave_one_out(
                group[0].record["id"], [r.reward for r in group], group[0].record["type"]
            )
        for r, b in zip(rollouts, baselines, strict=True):
            r.advantages = torch.full((r.length,), r.reward - b)
        for r in rollouts:
            self.baseline.update(r.record["id"], r.reward, r.record["type"])
        return {"baseline": float(np.mean(baselines))}

    def loss(self, tokens: TokenBatch, step: int, steps: int) -> tuple[torch.Tensor, dict[str, float]]:
        weights = A.truncated_importance_weights(tokens.logprobs, tokens.old_logprobs, self.cfg.ter.importance_cap)
        per_token = -(weights * tokens.advantages * tokens.logprobs)
        return tokens.policy_term(per_token).sum(), {}

    def state(self) -> dict:
        return {"baseline": self.baseline.state()}

    def load(self, state: dict) -> None:
        self.baseline.load(state["baseline"])
