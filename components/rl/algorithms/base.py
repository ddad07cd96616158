"""What an RL algorithm is to the trainer: advantages from scored rollouts, the update's loss, its own heads, state
and statistics. The trainer (rl/trainer.py) keeps what every algorithm shares: rollouts, rewards, the update loop
over epochs and minibatches, the KL anchor (ptx) and the rollout/trainer parity check.

A new algorithm is one module here with a subclass of `Algorithm` registered in `__init__.py`, its settings block in
rl/config.py (`ALGORITHM_SETTINGS`), and a test with hand-computed advantages and losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from components.rl.config import RlConfig
    from components.rl.rollout import Rollout


@dataclass
class TokenBatch:
    """The rollout tokens of one micro-batch (ptx tokens left out), rollout after rollout, with what a loss reads."""

    logprobs: torch.Tensor  # the policy being updated (carries the gradient)
    old_logprobs: torch.Tensor  # the policy that sampled, as the trainer scored it before this step's updates
    ref_logprobs: torch.Tensor  # the frozen reference
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    values: torch.Tensor | None  # the value head's (carries the gradient), algorithms with a critic
    lengths: list[int]  # tokens of each rollout, in order (they sum to the tensors' length)
    sampling_weights: torch.Tensor | None = None  # truncated importance weights trainer/sampler (rl.parity.tis_cap)

    def policy_term(self, per_token: torch.Tensor) -> torch.Tensor:
        """A per-token policy-gradient term, reweighted for the sampler/trainer mismatch when the correction is on."""
        return per_token if self.sampling_weights is None else per_token * self.sampling_weights

    def per_rollout(self, per_token: torch.Tensor) -> torch.Tensor:
        """The mean of a per-token tensor over each rollout's tokens, (rollouts,)."""
        return torch.stack([part.mean() for part in per_token.split(self.lengths)])


class Algorithm:
    """The base: token-level aggregation (the step's loss is a mean over its rollout tokens), no critic, no state."""

    name: ClassVar[str]
    critic: ClassVar[bool] = False  # the policy carries a value head trained with it
    sequence_mean: ClassVar[bool] = False  # the step's loss is a mean over rollouts instead of over tokens

    def __init__(self, cfg: RlConfig) -> None:
        self.cfg = cfg

    # -- set-up -----------------------------------------------------------------------------------------------
    def optim(self, optim):
        """The optimizer settings this algorithm trains with (TER replaces the gradient clips)."""
        return optim

    def attach(self, backend) -> None:
        """Hook the training backend (TER's gradient EMA); nothing by default."""

    # -- one step -----------------------------------------------------------------------------------------------
    def shape_rewards(self, rollouts: list[Rollout]) -> dict[str, float]:
        """Change the rollouts' rewards before the advantages (DAPO's overlong shaping); returns metrics."""
        return {}

    def advantages(self, rollouts: list[Rollout], step: int) -> dict[str, float]:
        """Set every rollout's per-token `advantages` (and `returns` with a critic); returns metrics."""
        raise NotImplementedError

    def keep(self, rollouts: list[Rollout]) -> list[Rollout]:
        """The rollouts the update trains on (DAPO drops groups that carry no signal); all by default."""
        return rollouts

    def loss(self, tokens: TokenBatch, step: int, steps: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's summed loss (over tokens, or over rollouts with `sequence_mean`; the trainer divides by
        the step's total) and metrics that every micro-batch reports under the same keys."""
        raise NotImplementedError

    def stop(self, kl: float, step: int) -> str:
        """Why training must end now (PPO's hard KL stop), or ""."""
        return ""

    def after_step(self, kl: float) -> dict[str, float]:
        """Update per-step controllers (PPO's adaptive KL) after the step's updates; returns metrics."""
        return {}

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {}

    def load(self, state: dict) -> None:
        pass


def rewards_of(rollouts: list[Rollout]) -> list[float]:
    return [r.reward for r in rollouts]


def constant_advantages(rollouts: list[Rollout], values: list[float]) -> None:
    """Each rollout's advantage, the same on every one of its tokens (sequence-level rewards)."""
    for r, value in zip(rollouts, values, strict=True):
        r.advantages = torch.full((r.length,), value)


def clip_fraction(clipped: torch.Tensor) -> float:
    return float(clipped.float().mean()) if clipped.numel() else 0.0
