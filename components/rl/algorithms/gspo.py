"""GSPO (Zheng et al. 2025): the importance ratio of a whole sequence, s = exp(mean over its tokens of log pi/pi_old)
(the geometric mean of the token ratios), clipped in a narrow band and weighting the sequence's group-relative
advantage; the step's loss is a mean over sequences. Token ratios' noise no longer accumulates along long answers,
which is what destabilises token-level clipping on long or MoE rollouts."""

from __future__ import annotations

import torch

import components.rl.algorithms.core as A
from components.rl.algorithms.base import Algorithm, TokenBatch, clip_fraction, constant_advantages, rewards_of


class Gspo(Algorithm):
    name = "gspo"
    sequence_mean = True

    def advantages(self, rollouts, step: int) -> dict[str, float]:
        constant_advantages(rollouts, A.group_advantages(rewards_of(rollouts), self.cfg.rollout.samples_per_prompt))
        return {}

    def loss(self, tokens: TokenBatch, step: int, steps: int) -> tuple[torch.Tensor, dict[str, float]]:
        gspo = self.cfg.gspo
        if not tokens.lengths:  # a micro-batch of ptx samples only
            return tokens.logprobs.sum() * 0.0, {"clip_fraction": 0.0}
        ratio = torch.exp(tokens.per_rollout(tokens.logprobs - tokens.old_logprobs))
        advantages = tokens.per_rollout(tokens.advantages)
        per_sequence, clipped = A.clipped_objective(ratio, advantages, gspo.clip_low, gspo.clip_high)
        if tokens.sampling_weights is not None:
            per_sequence = per_sequence * tokens.per_rollout(tokens.sampling_weights)
        if gspo.kl_coef:
            per_sequence = per_sequence + gspo.kl_coef * tokens.per_rollout(
                A.kl_k3(tokens.logprobs, tokens.ref_logprobs)
            )
        return per_sequence.sum(), {"clip_fraction": clip_fraction(clipped)}
