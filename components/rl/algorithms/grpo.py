"""GRPO: the group of a prompt's samples is the baseline (each reward minus the group mean, over its std), the
clipped surrogate, and a k3 KL penalty to the reference in the loss; token-level mean over the step."""

from __future__ import annotations

import torch

import components.rl.algorithms.core as A
from components.rl.algorithms.base import Algorithm, TokenBatch, clip_fraction, constant_advantages, rewards_of


class Grpo(Algorithm):
    name = "grpo"

    def advantages(self, rollouts, step: int) -> dict[str, float]:
        group, scale = self.cfg.rollout.samples_per_prompt, self.cfg.grpo.scale_rewards
        constant_advantages(rollouts, A.group_advantages(rewards_of(rollouts), group, scale=scale))
        return {}

    def loss(self, tokens: TokenBatch, step: int, steps: int) -> tuple[torch.Tensor, dict[str, float]]:
        grpo = self.cfg.grpo
        per_token, clipped = A.clipped_surrogate(tokens.logprobs, tokens.old_logprobs, tokens.advantages, grpo.clip)
        per_token = tokens.policy_term(per_token)
        if grpo.kl_coef:
            per_token = per_token + grpo.kl_coef * A.kl_k3(tokens.logprobs, tokens.ref_logprobs)
        return per_token.sum(), {"clip_fraction": clip_fraction(clipped)}
