"""The arithmetic RL algorithms share, as small pure functions and state objects (tested on hand-made cases).

Shapes: per-token tensors of one completion are 1-D (T,); a batch is a list of them (completions differ in
length), so nothing here pads. The stateful pieces (KL controller, reward normaliser, EMA baselines) expose
`state()` / `load()` with plain JSON so the RL stage's checkpoints restore them exactly.
"""

from __future__ import annotations

import math

import torch

# ------------------------------------------------------------------------------------------------- PPO ---


def gae(rewards: torch.Tensor, values: torch.Tensor, *, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of one completion by generalised advantage estimation; the value after the last
    token is 0 (the episode ends there)."""
    if rewards.shape != values.shape or rewards.dim() != 1:
        raise ValueError(
            f"gae needs 1-D rewards and values of one completion, got {tuple(rewards.shape)} and {tuple(values.shape)}."
        )
    advantages = torch.zeros_like(rewards)
    running = 0.0
    for t in range(rewards.numel() - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < rewards.numel() else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values


def whiten(values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance (the batch of advantages PPO normalises before its update)."""
    if values.numel() < 2:
        return values - values.mean()
    return (values - values.mean()) / (values.std(unbiased=False) + eps)


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO policy loss -min(r A, clip(r, 1-e, 1+e_high) A) with r = pi/pi_old (e_high = e unless given:
    DAPO's clip-higher), and whether each token was clipped (the objective's gradient is zero there)."""
    ratio = torch.exp(logprobs - old_logprobs)
    return clipped_objective(ratio, advantages, clip, clip if clip_high is None else clip_high)


def clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1-low, 1+high) A) elementwise (tokens, or GSPO's sequences) and where the clip bound."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """Per-token 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def linear_decay(start: float, end: float, step: int, total: int) -> float:
    """`start` at step 0 to `end` at the last step (PPO's clip range 0.2 -> 0.05 by default)."""
    if total <= 1:
        return start
    return start + (end - start) * min(1.0, step / (total - 1))


class AdaptiveKLController:
    """Ziegler et al. (2019): coef <- coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)."""

    def __init__(self, init: float, target: float, horizon: int) -> None:
        if init < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"KL controller needs init >= 0, target > 0, horizon > 0; got {init}, {target}, {horizon}."
            )
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl: float, n_steps: int) -> float:
        error = max(-0.2, min(0.2, kl / self.target - 1.0))
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state(self) -> dict:
        return {"value": self.value}

    def load(self, state: dict) -> None:
        self.value = float(state["value"])


class RunningMoments:
    """Running mean / std of rewards (Chan et al.'s parallel update), used to normalise PPO's scores."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        n = len(values)
        if n == 0:
            return
        batch_mean = sum(values) / n
        batch_m2 = sum((v - batch_mean) ** 2 for v in values)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0

    def normalize(self, values: list[float], clip: float) -> list[float]:
        """(v - mean) / std, clipped to [-clip, clip] (rewards in [-1, 1] with clip 1)."""
        std = max(self.std, 1e-6)
        return [max(-clip, min(clip, (v - self.mean) / std)) for v in values]

    def state(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def ppo_token_rewards(score: float, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards of one completion: -kl_coef * (log pi - log pi_ref) on every token, plus the
    (normalised) sequence score on the last one."""
    rewards = -kl_coef * (logprobs - ref_logprobs)
    rewards[-1] += score
    return rewards


# ------------------------------------------------------------------------------------------ TER / GRPO ---


class EmaBaseline:
    """TER's baseline b(s): an exponential moving average of the efficacy of each prompt (decay 0.99 by default),
    bias-corrected like Adam's moments so that the first visits give the plain mean rather than a value shrunk
    towards 0. A prompt not seen yet falls back to the EMA of its group (the question type): efficacy differs far
    more between types (counting vs reading) than between samples of one prompt, and a single overall baseline
    would turn that difference into advantage noise."""

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"baseline decay must be in [0, 1), got {decay}.")
        self.decay = decay
        self.per_prompt: dict[str, list[float]] = {}  # id -> [biased EMA, number of updates]
        self.per_group: dict[str, list[float]] = {}

    def _value(self, entry: list[float] | None) -> float:
        if not entry or not entry[1]:
            return 0.0
        ema, n = entry
        return ema / (1.0 - self.decay**n)

    def value(self, prompt_id: str, group: str = "") -> float:
        entry = self.per_prompt.get(prompt_id)
        return self._value(entry) if entry else self._value(self.per_group.get(group))

    def update(self, prompt_id: str, reward: float, group: str = "") -> None:
        for entry in (self.per_prompt.setdefault(prompt_id, [0.0, 0]), self.per_group.setdefault(group, [0.0, 0])):
            self._step(entry, reward)

    def _step(self, entry: list[float], reward: float) -> None:
        entry[0] = self.decay * entry[0] + (1.0 - self.decay) * reward
        entry[1] += 1

    def leave_one_out(self, prompt_id: str, rewards: list[float], group: str = "") -> list[float]:
        """Baselines of several samples of one prompt drawn in the same step: for each, the prompt's EMA over its
        earlier samples and this step's *other* samples (its own reward left out, so the baseline stays
        independent of the action it judges). With one sample this is `value`."""
        if len(rewards) == 1:
            return [self.value(prompt_id, group)]
        history = self.per_prompt.get(prompt_id, [0.0, 0])
        out = []
        for i in range(len(rewards)):
            entry = list(history)
            for j, r in enumerate(rewards):
                if j != i:
                    self._step(entry, r)
            out.append(self._value(entry))
        return out

    def state(self) -> dict:
        return {"per_prompt": self.per_prompt, "per_group": self.per_group}

    def load(self, state: dict) -> None:
        self.per_prompt = {k: [float(v[0]), int(v[1])] for k, v in state["per_prompt"].items()}
        self.per_group = {k: [float(v[0]), int(v[1])] for k, v in state["per_group"].items()}


def group_advantages(rewards: list[float], group_size: int, *, scale: bool = True, eps: float = 1e-4) -> list[float]:
    """GRPO: each reward minus the mean of its group of `group_size` samples of the same prompt (consecutive),
    divided by the group's std when `scale` (a group whose samples all scored the same gets 0)."""
    if group_size < 2 or len(rewards) % group_size:
        raise ValueError(
            f"{len(rewards)} rewards cannot form groups of {group_size} (need group_size >= 2 dividing it)."
        )
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / group_size)
        out += [(r - mean) / (std + eps) if scale else r - mean for r in group]
    return out


def leave_one_out_centred(rewards: list[float], group_size: int) -> list[float]:
    """Each reward minus the mean of the *other* samples of its prompt (consecutive groups of `group_size`; RLOO,
    Ahmadian et al. 2024): a per-prompt baseline that does not depend on the sample it judges. PPO's optional
    `ppo.group_baseline` applies it before normalisation, so the critic only has to learn what is left."""
    if group_size < 2 or len(rewards) % group_size:
        raise ValueError(
            f"{len(rewards)} rewards cannot form groups of {group_size} (need group_size >= 2 dividing it)."
        )
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        total = sum(group)
        out += [r - (total - r) / (group_size - 1) for r in group]
    return out


def truncated_importance_weights(logprobs: torch.Tensor, old_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """pi_new / pi_old per token, capped at `cap` and detached (TER: the rollouts come from the previous policy;
    the practitioners' write-up has the inverse ratio pi_old / pi_new (docs/references.md), which would
    down-weight exactly the actions the update made likelier; we use the standard off-policy correction)."""
    return torch.exp(logprobs - old_logprobs).clamp(max=cap).detach()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi: exp(d) - d - 1 with d = ref - logp
    (non-negative, unbiased; Schulman's k3)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


class GradientEma:
    """TER's gradient smoothing: after clipping, grad <- ema = beta * ema + (1 - beta) * grad."""

    def __init__(self, beta: float) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"gradient EMA beta must be in [0, 1), got {beta}.")
        self.beta = beta
        self.buffers: dict[str, torch.Tensor] = {}

    def apply(self, named_parameters) -> None:
        if self.beta == 0.0:
            return
        for name, p in named_parameters:
            if p.grad is None:
                continue
            ema = self.buffers.get(name)
            ema = (
                p.grad.detach().clone() * (1.0 - self.beta)
                if ema is None
                else ema.mul_(self.beta).add_(p.grad.detach(), alpha=1.0 - self.beta)
            )
            self.buffers[name] = ema
            p.grad.copy_(ema)
