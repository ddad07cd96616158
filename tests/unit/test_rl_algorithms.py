"""PPO / TER / GRPO arithmetic on small hand-computed cases."""

import math

import numpy as np
import pytest
import torch

from components.rl.algorithms import core as A


def test_gae_matches_a_hand_computed_example():
    # gamma 0.9, lambda 0.8:  d2 = 1 - 0.6 = 0.4;  d1 = 0.9*0.6 - 0.4 = 0.14;  d0 = 0.9*0.4 - 0.5 = -0.14
    # A2 = 0.4;  A1 = 0.14 + 0.72*0.4 = 0.428;  A0 = -0.14 + 0.72*0.428 = 0.16816
    adv, ret = A.gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.4, 0.6]), gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor([0.16816, 0.428, 0.4]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([0.66816, 0.828, 1.0]), atol=1e-6)


def test_gae_with_lambda_and_gamma_one_is_the_monte_carlo_return_minus_value():
    rewards, values = torch.tensor([0.1, -0.2, 0.3, 1.0]), torch.tensor([0.3, 0.1, -0.4, 0.2])
    adv, ret = A.gae(rewards, values, gamma=1.0, lam=1.0)
    mc = torch.flip(torch.cumsum(torch.flip(rewards, [0]), 0), [0])
    assert torch.allclose(ret, mc) and torch.allclose(adv, mc - values)
    with pytest.raises(ValueError, match="1-D"):
        A.gae(torch.zeros(2, 2), torch.zeros(2, 2), gamma=1.0, lam=1.0)


def test_clipped_surrogate_takes_the_pessimistic_side_and_stops_gradients_when_clipped():
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_()
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = A.clipped_surrogate(logp, old, adv, clip=0.2)
    assert torch.allclose(loss, torch.tensor([-1.2, 1.5, -0.5, 0.8]))
    assert clipped.tolist() == [True, False, False, True]
    loss.sum().backward()
    # d/dlogp of -ratio*A = -ratio*A where unclipped; 0 where the clipped branch is taken
    assert torch.allclose(logp.grad, torch.tensor([0.0, 1.5, -0.5, 0.0]))


def test_clip_range_decays_linearly_from_start_to_end():
    assert [round(A.linear_decay(0.2, 0.05, s, 4), 6) for s in range(4)] == [0.2, 0.15, 0.1, 0.05]
    assert A.linear_decay(0.2, 0.05, 10, 4) == pytest.approx(0.05)


def test_adaptive_kl_controller_moves_towards_its_target_with_a_bounded_step():
    ctl = A.AdaptiveKLController(0.05, target=0.02, horizon=10)
    assert ctl.update(0.04, 1) == pytest.approx(0.05 * 1.02)  # error 1.0 clipped to 0.2
    ctl.load({"value": 0.05})
    assert ctl.update(0.01, 1) == pytest.approx(0.05 * 0.98)  # error -0.5 clipped to -0.2
    ctl.load({"value": 0.05})
    assert ctl.update(0.021, 1) == pytest.approx(0.05 * 1.005)
    assert ctl.state() == {"value": pytest.approx(0.05 * 1.005)}


def test_running_moments_equal_the_moments_of_everything_seen_and_normalise_with_clipping():
    rng = np.random.default_rng(0)
    batches = [list(rng.normal(3.0, 2.0, n)) for n in (5, 1, 17)]
    moments = A.RunningMoments()
    for b in batches:
        moments.update(b)
    everything = np.concatenate(batches)
    assert moments.mean == pytest.approx(everything.mean()) and moments.std == pytest.approx(everything.std())
    normalised = moments.normalize([everything.mean(), everything.mean() + 0.5 * everything.std(), 1e9], clip=1.0)
    assert normalised == pytest.approx([0.0, 0.5, 1.0])
    restored = A.RunningMoments()
    restored.load(moments.state())
    assert restored.normalize([4.0], 1.0) == moments.normalize([4.0], 1.0)


def test_ppo_token_rewards_put_the_kl_penalty_on_every_token_and_the_score_on_the_last():
    r = A.ppo_token_rewards(0.7, torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), kl_coef=0.1)
    assert torch.allclose(r, torch.tensor([-0.05, 0.1 + 0.7]))


def test_ema_baseline_is_bias_corrected_per_prompt_and_falls_back_to_the_prompts_group():
    b = A.EmaBaseline(0.99)
    assert b.value("unseen", "color") == 0.0
    b.update("p", 1.0, "color")
    assert b.value("p") == pytest.approx(1.0)  # the first visit gives the reward itself, not 0.01
    b.update("p", 0.0, "color")
    assert b.value("p") == pytest.approx(0.99 * 0.01 / (1 - 0.99**2))  # ~0.497: nearly the plain mean
    b.update("q", 0.2, "ocr")
    assert b.value("new", "ocr") == pytest.approx(0.2)  # an unseen reading prompt: the reading average
    assert b.value("new", "color") == pytest.approx(b.value("p"))
    restored = A.EmaBaseline(0.99)
    restored.load(b.state())
    assert restored.value("p") == b.value("p") and restored.value("new", "ocr") == b.value("new", "ocr")


def test_leave_one_out_baselines_use_the_other_samples_of_the_prompt_and_never_the_own_reward():
    b = A.EmaBaseline(0.99)
    assert b.leave_one_out("p", [1.0], "color") == [0.0]  # one sample, nothing seen: the (empty) type average
    out = b.leave_one_out("p", [1.0, 0.0, 0.0], "color")
    # sample 0 is judged against the two zeros, samples 1 and 2 against (1, 0) in EMA order
    assert out[0] == pytest.approx(0.0)
    assert out[1] == pytest.approx(b._value([0.99 * 0.01 * 1.0, 2]))
    assert out[1] == out[2] and 0.49 < out[1] < 0.5


def test_group_advantages_are_relative_to_each_group():
    adv = A.group_advantages([1.0, 0.0, 0.5, 0.5, 2.0, 0.0], 2)
    assert adv[0] == pytest.approx(1.0, abs=1e-3) and adv[1] == pytest.approx(-1.0, abs=1e-3)
    assert adv[2:4] == [0.0, 0.0]  # a group that scored the same learns nothing
    assert A.group_advantages([2.0, 0.0], 2, scale=False) == [1.0, -1.0]
    with pytest.raises(ValueError, match="groups of 4"):
        A.group_advantages([1.0, 2.0], 4)


def test_leave_one_out_centring_judges_each_sample_against_the_others_of_its_prompt():
    out = A.leave_one_out_centred([1.0, 0.0, 0.0, 0.6, 0.6, 0.6], 3)
    assert out[:3] == pytest.approx([1.0, -0.5, -0.5])  # 1 - mean(0, 0); 0 - mean(1, 0)
    assert out[3:] == pytest.approx([0.0, 0.0, 0.0])  # a prompt whose samples tie carries no signal
    assert sum(out[:3]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="groups of 4"):
        A.leave_one_out_centred([1.0, 2.0, 3.0], 4)


def test_ppo_group_baseline_needs_several_samples_per_prompt():
    from components.rl.config import RlConfig

    with pytest.raises(ValueError, match="ppo.group_baseline needs rollout.samples_per_prompt >= 2"):
        RlConfig(algorithm="ppo", ppo={"group_baseline": True}, rollout={"samples_per_prompt": 1})
    assert RlConfig(algorithm="ppo", ppo={"group_baseline": True}, rollout={"samples_per_prompt": 2}).ppo.group_baseline


def test_the_prompts_file_cannot_be_a_held_out_file():
    from components.rl.config import RlConfig

    with pytest.raises(ValueError, match="eval.files holds the prompts file 'rl.jsonl'"):
        RlConfig(prompts_file="rl.jsonl", eval={"files": ["eval.jsonl", "rl.jsonl"]})
    assert RlConfig(eval={"files": ["eval.jsonl", "rl.jsonl"]}).eval.files == ["eval.jsonl", "rl.jsonl"]


def test_importance_weights_are_capped_and_carry_no_gradient():
    logp = torch.tensor([0.0, math.log(3.0)], requires_grad=True)
    w = A.truncated_importance_weights(logp, torch.zeros(2), cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0]) and not w.requires_grad


def test_k3_kl_is_zero_for_equal_policies_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0, -0.1])
    assert torch.equal(A.kl_k3(a, a), torch.zeros(3))
    assert (A.kl_k3(a, a + torch.tensor([0.3, -0.4, 0.1])) > 0).all()


def test_gradient_ema_smooths_clipped_gradients_across_steps():
    p = torch.nn.Parameter(torch.zeros(2))
    ema = A.GradientEma(0.9)
    p.grad = torch.tensor([1.0, 0.0])
    ema.apply([("p", p)])
    assert torch.allclose(p.grad, torch.tensor([0.1, 0.0]))
    p.grad = torch.tensor([0.0, 1.0])
    ema.apply([("p", p)])
    assert torch.allclose(p.grad, torch.tensor([0.09, 0.1]))
