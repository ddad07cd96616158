"""PPO with a value head on the policy: GAE over per-token rewards (the KL penalty on every token, the normalised
score on the last), whitened advantages, the clipped surrogate with a clip range decaying over the run, a clipped
value loss, an adaptive KL coefficient and a hard stop when the KL to the reference runs away."""

from __future__ import annotations

import numpy as np
import torch

import components.rl.algorithms.core as A
from components.rl.algorithms.base import Algorithm, TokenBatch, clip_fraction, rewards_of


class Ppo(Algorithm):
    name = "ppo"
    critic = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.kl_ctl = A.AdaptiveKLController(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
        self.moments = A.RunningMoments()

    def advantages(self, rollouts, step: int) -> dict[str, float]:
        ppo = self.cfg.ppo
        rewards = rewards_of(rollouts)
        if ppo.group_baseline:
            rewards = A.leave_one_out_centred(rewards, self.cfg.rollout.samples_per_prompt)
        self.moments.update(rewards)
        scores = self.moments.normalize(rewards, ppo.reward_clip)
        for r, score in zip(rollouts, scores, strict=True):
            token_rewards = A.ppo_token_rewards(score, r.logprobs, r.ref_logprobs, self.kl_ctl.value)
            r.advantages, r.returns = A.gae(token_rewards, r.values, gamma=ppo.gamma, lam=ppo.lam)
        flat = A.whiten(torch.cat([r.advantages for r in rollouts]))
        for r, adv in zip(rollouts, flat.split([r.length for r in rollouts]), strict=True):
            r.advantages = adv
        returns, values = torch.cat([r.returns for r in rollouts]), torch.cat([r.values for r in rollouts])
        return {"score_normalised": float(np.mean(scores)), "explained_variance": explained(values, returns)}

    def loss(self, tokens: TokenBatch, step: int, steps: int) -> tuple[torch.Tensor, dict[str, float]]:
        ppo = self.cfg.ppo
        clip = A.linear_decay(ppo.clip_start, ppo.clip_end, step, steps)
        per_token, clipped = A.clipped_surrogate(tokens.logprobs, tokens.old_logprobs, tokens.advantages, clip)
        assert tokens.values is not None  # the policy carries a value head (critic = True)
        vloss = A.clipped_value_loss(tokens.values, tokens.old_values, tokens.returns, ppo.value_clip)
        per_token = tokens.policy_term(per_token) + ppo.value_coef * vloss
        extras = {
            "clip_fraction": clip_fraction(clipped),
            "value_loss": float(vloss.detach().mean()) if vloss.numel() else 0.0,
        }
        return per_token.sum(), extras

    def stop(self, kl: float, step: int) -> str:
        if kl > self.cfg.ppo.kl_stop:
            return f"ppo.kl_stop: per-token KL {kl:.4f} > {self.cfg.ppo.kl_stop} at step {step}"
        return ""

    def after_step(self, kl: float) -> dict[str, float]:
        metrics = {"kl_coef": self.kl_ctl.value}
        if self.cfg.ppo.adaptive_kl:
            self.kl_ctl.update(kl, 1)
        return metrics

    def state(self) -> dict:
        return {"kl_coef": self.kl_ctl.state(), "moments": self.moments.state()}

    def load(self, state: dict) -> None:
        self.kl_ctl.load(state["kl_coef"])
        self.moments.load(state["moments"])


def explained(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): how much of the returns' spread the critic predicted (1 = all, 0 =
    no better than their mean, negative = worse)."""
    spread = float(returns.var(unbiased=False))
    return 1.0 - float((returns - values).var(unbiased=False)) / spread if spread > 0 else 0.0
