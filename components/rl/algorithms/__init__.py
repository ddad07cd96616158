"""RL algorithms as parts: one module each (ppo, ter, grpo, dapo, gspo), picked by `rl.algorithm` from this registry
(base.py says what an algorithm owns; core.py holds the arithmetic they share)."""

from __future__ import annotations

from components.rl.algorithms.base import Algorithm
from components.rl.algorithms.dapo import Dapo
from components.rl.algorithms.grpo import Grpo
from components.rl.algorithms.gspo import Gspo
from components.rl.algorithms.ppo import Ppo
from components.rl.algorithms.ter import Ter

ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (Ppo, Ter, Grpo, Dapo, Gspo)}


def build(cfg) -> Algorithm:
    """The configured algorithm (RlConfig has already refused names that are not registered here)."""
    return ALGORITHMS[cfg.algorithm](cfg)
