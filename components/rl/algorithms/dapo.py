"""DAPO (Yu et al. 2025): GRPO's group baseline with clip-higher (a wider upper clip, so unlikely tokens can rise),
dynamic sampling (groups whose samples all scored the same carry no signal and are dropped from the update),
a token-level loss (the step's mean over all its tokens, so long answers weigh by their length) and overlong reward
shaping (a penalty growing over the last `overlong_buffer` of the length limit, -1 x `overlong_penalty` at it);
no KL term by default."""

from __future__ import annotations

import torch

import components.rl.algorithms.core as A
from components.rl.algorithms.base import Algorithm, TokenBatch, clip_fraction, constant_advantages, rewards_of


def overlong_penalty(length: int, limit: int, buffer: int) -> float:
    """0 up to limit - buffer tokens, then falling linearly to -1 at the limit (DAPO's soft overlong punishment)."""
    start = limit - buffer
    if buffer <= 0 or length <= start:
        return 0.0
    return max(-1.0, (start - length) / buffer)


class Dapo(Algorithm):
    name = "dapo"

    def shape_rewards(self, rollouts) -> dict[str, float]:
        dapo, limit = self.cfg.dapo, self.cfg.rollout.max_new_tokens
        buffer = int(round(dapo.overlong_buffer * limit))
        if not buffer or not dapo.overlong_penalty:
            return {}
        penalties = [dapo.overlong_penalty * overlong_penalty(r.length, limit, buffer) for r in rollouts]
        for r, penalty in zip(rollouts, penalties, strict=True):
            r.rewards["overlong"] = penalty
            r.reward += penalty
        return {"reward/overlong": sum(penalties) / len(penalties)}

    def advantages(self, rollouts, step: int) -> dict[str, float]:
        constant_advantages(rollouts, A.group_advantages(rewards_of(rollouts), self.cfg.rollout.samples_per_prompt))
        return {}

    def keep(self, rollouts):
        """Dynamic sampling: only the groups whose rewards differ (a group that all scored alike has zero
        advantages and would only dilute the token-level mean)."""
        if not self.cfg.dapo.dynamic_sampling:
            return rollouts
        n = self.cfg.rollout.samples_per_prompt
        groups = [rollouts[start : start + n] for start in range(0, len(rollouts), n)]
        return [r for group in groups if len({g.reward for g in group}) > 1 for r in group]

    def loss(self, tokens: TokenBatch, step: int, steps: int) -> tuple[torch.Tensor, dict[str, float]]:
        dapo = self.cfg.dapo
        per_token, clipped = A.clipped_surrogate(
            tokens.logprobs, tokens.old_logprobs, tokens.advantages, dapo.clip_low, dapo.clip_high
        )
        per_token = tokens.policy_term(per_token)
        if dapo.kl_coef:
            per_token = per_token + dapo.kl_coef * A.kl_k3(tokens.logprobs, tokens.ref_logprobs)
        return per_token.sum(), {"clip_fraction": clip_fraction(clipped)}
