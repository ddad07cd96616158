"""Each RL algorithm as a part (components/rl/algorithms/): its advantages and loss on hand-computed batches, so a
wrong sign or a wrong normalisation fails; the registry and the config agree."""

import math
from types import SimpleNamespace

import pytest
import torch

from components.rl.algorithms import ALGORITHMS, build
from components.rl.algorithms.base import TokenBatch
from components.rl.algorithms.dapo import overlong_penalty
from components.rl.config import ALGORITHM_SETTINGS, RlConfig

LOG = math.log


def _cfg(algorithm: str, **over) -> RlConfig:
    data = {"algorithm": algorithm, "rollout": {"samples_per_prompt": 2, "max_new_tokens": 10}, **over}
    return RlConfig.model_validate(data)


def _rollouts(rewards: list[float], lengths: list[int] | None = None, prompt: str = "p") -> list:
    lengths = lengths or [1] * len(rewards)
    return [
        SimpleNamespace(
            reward=r,
            rewards={},
            length=n,
            finished=True,
            record={"id": f"{prompt}{i // 2}", "type": "count"},
            logprobs=torch.zeros(n),
            ref_logprobs=torch.zeros(n),
            values=torch.zeros(n),
            advantages=None,
            returns=None,
        )
        for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
    ]


def _tokens(ratios: list[float], advantages: list[float], lengths: list[int], **extra) -> TokenBatch:
    """Old log-probabilities 0, so each token's ratio is the given one; the current log-probabilities need grad."""
    logp = torch.tensor([LOG(r) for r in ratios], requires_grad=True)
    n = len(ratios)
    base = {"returns": torch.zeros(n), "old_values": torch.zeros(n), "values": None, "ref_logprobs": torch.zeros(n)}
    fields = {**base, **extra}
    return TokenBatch(
        logprobs=logp, old_logprobs=torch.zeros(n), advantages=torch.tensor(advantages), lengths=lengths, **fields
    )


def test_the_registry_and_the_config_name_the_same_algorithms_and_unknown_ones_are_refused():
    assert set(ALGORITHMS) == set(ALGORITHM_SETTINGS) == {"ppo", "ter", "grpo", "dapo", "gspo"}
    with pytest.raises(ValueError, match=r"unknown algorithm 'reinforce\+\+'; choose from \['ppo', 'ter'"):
        RlConfig.model_validate({"algorithm": "reinforce++"})
    for name in ("grpo", "dapo", "gspo"):  # a group baseline needs a group
        with pytest.raises(ValueError, match=f"algorithm {name} needs rollout.samples_per_prompt >= 2"):
            RlConfig.model_validate({"algorithm": name, "rollout": {"samples_per_prompt": 1}})
    notes = _cfg("gspo", dapo={"clip_high": 0.3}).ignored_settings()
    assert "dapo.clip_high: a dapo setting; algorithm is gspo" in notes


def test_grpo_advantages_are_group_relative_and_its_loss_is_the_clipped_surrogate_per_token():
    algo = build(_cfg("grpo", grpo={"kl_coef": 0.0}))
    rollouts = _rollouts([1.0, 0.0, 0.5, 0.5])
    algo.advantages(rollouts, 0)
    assert [float(r.advantages[0]) for r in rollouts] == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0])
    # ratios 1.5 (A=+1, clipped at 1.2), 0.5 (A=+1, unclipped), 1.1 (A=-1, inside): -1.2 - 0.5 + 1.1
    tokens = _tokens([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], [2, 1])
    loss, extras = algo.loss(tokens, 0, 10)
    assert loss.item() == pytest.approx(-0.6) and extras["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()  # d(-r A)/dlogp = -r A where unclipped, 0 where clipped
    assert tokens.logprobs.grad.tolist() == pytest.approx([0.0, -0.5, 1.1])


def test_dapo_clips_higher_drops_groups_without_signal_and_shapes_overlong_answers():
    algo = build(_cfg("dapo"))
    tokens = _tokens([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], [2, 1])
    loss, extras = algo.loss(tokens, 0, 10)
    assert loss.item() == pytest.approx(-1.28 - 0.5 + 1.1)  # the upper clip is 1.28, not 1.2
    rollouts = _rollouts([1.0, 0.0, 0.5, 0.5])
    algo.advantages(rollouts, 0)
    assert algo.keep(rollouts) == rollouts[:2]  # the second prompt's samples scored alike: no signal
    # max_new_tokens 10, buffer 0.2 x 10 = 2 tokens: 0 up to 8 tokens, -0.5 at 9, -1 at 10
    assert [overlong_penalty(n, 10, 2) for n in (7, 8, 9, 10)] == [0.0, 0.0, -0.5, -1.0]
    long = _rollouts([1.0, 1.0], lengths=[8, 10])
    assert algo.shape_rewards(long) == {"reward/overlong": -0.5}
    assert [r.reward for r in long] == [1.0, 0.0] and long[1].rewards == {"overlong": -1.0}


def test_gspo_clips_the_sequences_geometric_mean_ratio_and_averages_over_sequences():
    algo = build(_cfg("gspo"))
    assert algo.sequence_mean
    # sequence 1: token ratios 1.5 and 0.5 -> s = sqrt(0.75) = 0.8660, A = +1, below the band: -0.8660
    # sequence 2: ratio 1.1, A = -1: min(-1.1, -1.0004) = -1.1 -> +1.1
    tokens = _tokens([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], [2, 1])
    loss, extras = algo.loss(tokens, 0, 10)
    assert loss.item() == pytest.approx(-math.sqrt(0.75) + 1.1, abs=1e-6) and extras["clip_fraction"] == 0.0
    loss.backward()  # d(-s A)/dlogp_t = -A s / |y| for each token of the sequence
    assert tokens.logprobs.grad.tolist() == pytest.approx([-math.sqrt(0.75) / 2, -math.sqrt(0.75) / 2, 1.1])
    inside = _tokens([1.0001, 1.0001], [1.0, 1.0], [1, 1])
    assert algo.loss(inside, 0, 10)[1]["clip_fraction"] == 0.0
    above = _tokens([1.01, 1.0], [1.0, 1.0], [1, 1])
    assert algo.loss(above, 0, 10)[0].item() == pytest.approx(-1.0004 - 1.0)  # the first clipped at 1 + 4e-4


def test_ter_is_reinforce_against_a_leave_one_out_baseline_with_capped_importance_weights():
    algo = build(_cfg("ter", ter={"baseline_decay": 0.5, "importance_cap": 2.0}))
    rollouts = _rollouts([1.0, 0.0])
    algo.advantages(rollouts, 0)
    assert [float(r.advantages[0]) for r in rollouts] == [1.0, -1.0]  # each against the other sample's reward
    tokens = _tokens([1.5, 0.5], [1.0, -1.0], [1, 1])
    loss, _ = algo.loss(tokens, 0, 10)
    assert loss.item() == pytest.approx(-(1.5 * LOG(1.5)) + 0.5 * LOG(0.5))
    loss.backward()  # -w A: the better sample's log-probability is pushed up, the worse one's down
    assert tokens.logprobs.grad.tolist() == pytest.approx([-1.5, 0.5])
    assert algo.state()["baseline"]["per_prompt"]["p0"] == [0.25, 2]  # both rewards seen: 0.5 x 0.5 x 1


def test_ppo_normalises_scores_runs_gae_and_adds_the_clipped_value_loss():
    algo = build(_cfg("ppo", ppo={"kl_coef": 0.05}, rollout={"samples_per_prompt": 1}))
    rollouts = _rollouts([1.0, 0.0])
    metrics = algo.advantages(rollouts, 0)
    # scores (r - 0.5) / 0.5 = +-1 on the last token; KL 0; values 0; gamma 1: advantages +-1, whitened +-1
    assert [float(r.advantages[0]) for r in rollouts] == pytest.approx([1.0, -1.0])
    assert [float(r.returns[0]) for r in rollouts] == [1.0, -1.0] and metrics["explained_variance"] == 0.0
    values = torch.zeros(3, requires_grad=True)
    tokens = _tokens([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], [2, 1], returns=torch.tensor([1.0, 0.0, 0.0]), values=values)
    loss, extras = algo.loss(tokens, 0, 4)  # clip 0.2 at the first step; value loss 0.5 x (0 - 1)^2 on token 0
    assert loss.item() == pytest.approx(-0.6 + 0.1 * 0.5) and extras["value_loss"] == pytest.approx(0.5 / 3)
    assert algo.stop(0.2, 3) == "ppo.kl_stop: per-token KL 0.2000 > 0.1 at step 3" and algo.stop(0.05, 3) == ""
    assert algo.after_step(0.04) == {"kl_coef": 0.05} and algo.kl_ctl.value == pytest.approx(0.05 * (1 + 0.2 / 1000))


def test_truncated_importance_sampling_reweights_only_the_policy_term():
    algo = build(_cfg("grpo", grpo={"kl_coef": 0.0}))
    weights = torch.tensor([2.0, 1.0, 0.5])
    plain, _ = algo.loss(_tokens([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], [2, 1]), 0, 10)
    weighted, _ = algo.loss(_tokens([1.5, 0.5, 1.1], [1.0, 1.0, -1.0], [2, 1], sampling_weights=weights), 0, 10)
    assert plain.item() == pytest.approx(-0.6) and weighted.item() == pytest.approx(-2.4 - 0.5 + 0.55)
