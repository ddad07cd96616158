"""Reward-hacking gates of the RL stage: step monitors (KL, length, entropy) and the held-out divergence check."""

from __future__ import annotations

from collections import defaultdict

from components.rl.config import GateConfig


class GateTripped(ValueError):
    """A reward-hacking monitor crossed its bound; the message names the gate. A ValueError: the run's settings or
    rewards are what to change, so the command ends with the message alone (exit 2), not a traceback."""


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
