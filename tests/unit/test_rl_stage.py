"""The rl stage on the tiny model: PPO / TER / GRPO run and move the policy, the hard stop and the gates end the
run as documented, the bait suffix is caught by the reward model, and a SIGKILLed run resumes exactly."""

import json
import signal

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from components._shared.data import datasets
from components._shared.platform.tracking import NullTracker
from components.reward_model.config import RewardModelConfig
from components.reward_model.stage import run as train_reward_model
from components.rl.config import RlConfig
from components.rl.gates import Gates, GateTripped
from components.rl.rewards import RewardModelReward
from components.rl.stage import load_prompts, run
from components.synth_world.splits import write_splits
from tests.prefetch import assert_same_with_and_without_workers
from tests.stage_cli import run_stage_cli
from tests.tiny_sft import train_tiny_sft

BASE = "builtin:tiny-qwen2_5-vl"
BAIT = ", according to the image evidence."


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rlworld")
    write_splits(out, seed=7, eval_per_type=3, sft_records=64, preference_pairs=96)
    return out


@pytest.fixture(scope="module")
def sft_model(data_dir, tmp_path_factory):
    """A briefly fine-tuned tiny model: it answers in the data's short format and ends its turns, so sampled
    completions earn varied rewards (a random-init model's samples all score 0 and give no learning signal)."""
    return str(train_tiny_sft(data_dir, tmp_path_factory.mktemp("sft"), steps=40))


@pytest.fixture(scope="module")
def reward_model(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    cfg = RewardModelConfig.model_validate(
        {
            "min_pixels": 3136,
            "max_pixels": 3136,
            "heldout_fraction": 0.25,
            "train": {"steps": 16, "samples_per_step": 8, "max_tokens_per_micro_batch": 1024, "threads": 1},
            "optim": {"lr": 0.003},
        }
    )
    train_reward_model(cfg, base_model=BASE, data=str(data_dir), output_dir=out, tracker=NullTracker())
    return str(out / "model")


GROUPED = ("grpo", "dapo", "gspo")  # algorithms whose baseline is the group of a prompt's samples


def _cfg(algorithm, **over):
    data = {
        "algorithm": algorithm,
        "min_pixels": 3136,
        "max_pixels": 3136,
        "rewards": {"efficacy": 1.0, "format": 0.2},
        "rollout": {"samples_per_prompt": 2 if algorithm in GROUPED else 1, "max_new_tokens": 6},
        "train": {"steps": 3, "samples_per_step": 4, "max_tokens_per_micro_batch": 512, "threads": 1, "eval_every": 0},
        "update": {"epochs": 2, "minibatches": 2},
        "optim": {"lr": 0.01},
        "ppo": {"kl_stop": 10.0},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 6},
        "gates": {"kl_max": 0, "length_ratio_min": 0, "length_ratio_max": 0, "heldout_drop_max": 0},
    }
    for key, value in over.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    return RlConfig.model_validate(data)


def _run(cfg, data_dir, out, base, reward_model=""):
    return run(
        cfg, base_model=base, reward_model=reward_model, data=str(data_dir), output_dir=out, tracker=NullTracker()
    )


@pytest.mark.parametrize("algorithm", ["ppo", "ter", "grpo", "dapo", "gspo"])
def test_each_algorithm_updates_the_policy_and_reports_the_rl_metrics(algorithm, data_dir, sft_model, tmp_path):
    over = {"dapo": {"dynamic_sampling": False}} if algorithm == "dapo" else {}  # 3 steps: keep every group
    metrics = _run(_cfg(algorithm, **over), data_dir, tmp_path, sft_model)
    assert metrics["algorithm"] == algorithm and metrics["steps"] == 3 and not metrics["stopped_early"]
    for key in (
        "efficacy_before",
        "efficacy_after",
        "mean_length_ratio",
        "kl_final",
        "seconds_generation",
        "seconds_scoring",
        "seconds_update",
        "rollout_tokens_per_second",
    ):
        assert metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["kl_final"] > 0  # the policy moved away from the reference
    after = [json.loads(line)["efficacy"] for line in (tmp_path / "eval_predictions.jsonl").read_text().splitlines()]
    assert metrics["efficacy_gain"] == pytest.approx(metrics["efficacy_after"] - metrics["efficacy_before"])
    assert metrics["efficacy_gain_ci_low"] <= metrics["efficacy_gain"] <= metrics["efficacy_gain_ci_high"]
    assert metrics["heldout_improved"] + metrics["heldout_worsened"] <= len(after)
    rows = [json.loads(line) for line in (tmp_path / "eval_predictions.jsonl").read_text().splitlines()]
    for t in {row["type"] for row in rows}:  # per-type paired changes, each the change of that type's mean
        assert metrics[f"efficacy_gain/{t}"] == pytest.approx(
            metrics[f"efficacy/{t}_after"] - metrics[f"efficacy/{t}_before"], abs=1e-9
        )
        assert (
            metrics[f"efficacy_gain/{t}_ci_low"]
            <= metrics[f"efficacy_gain/{t}"]
            <= metrics[f"efficacy_gain/{t}_ci_high"]
        )
    assert f"| {rows[0]['type']} |" in (tmp_path / "report.md").read_text()
    trained = load_file(str(tmp_path / "model/model.safetensors"))
    assert (tmp_path / "value_head.safetensors").exists() == (algorithm == "ppo")
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 * (2 if algorithm in GROUPED else 1)
    # the update's diagnostics and the sampler/trainer parity, in the metrics and the report (fp32: ~1e-7)
    assert metrics["ratio_max"] >= 1.0 >= metrics["ratio_min"] > 0 and metrics["approx_kl_mean"] >= 0
    assert metrics["parity_mean_abs"] < 1e-5 and metrics["parity_corr_min"] > 0.999
    assert ("clip_fraction_mean" in metrics) == (algorithm != "ter")
    assert ("explained_variance_final" in metrics) == (algorithm == "ppo")
    assert "| parity_mean_abs |" in (tmp_path / "report.md").read_text()
    assert {"efficacy", "format", *(["overlong"] if algorithm == "dapo" else [])} == set(rollouts[0]["rewards"])
    # the saved policy differs from the SFT model it started from
    base = load_file(f"{sft_model}/model.safetensors")
    assert base.keys() == trained.keys() and any(not torch.equal(base[k], trained[k]) for k in base)


@pytest.mark.parametrize("algorithm", ["ppo", "ter"])
def test_ptx_pulls_the_policy_towards_the_reference_answers(algorithm, data_dir, sft_model, tmp_path):
    """ptx adds coef x the mean NLL of the step's reference answers to the RL loss. On 4 fixed prompts the
    reference NLL falls over the run with coef 5, and ends far below a run whose ptx term is negligible (1e-6:
    the RL term alone at this learning rate drives it up); without ptx the stage reports no such term."""
    assert "ptx_nll_first" not in _run(_cfg(algorithm), data_dir, tmp_path / "plain", sft_model)
    over = {"train": {"steps": 4}, "max_records": 4}
    weak = _run(_cfg(algorithm, ptx={"coef": 1e-6}, **over), data_dir, tmp_path / "weak", sft_model)
    mixed = _run(_cfg(algorithm, ptx={"coef": 5.0}, **over), data_dir, tmp_path / "ptx", sft_model)
    assert mixed["ptx_nll_final"] < 0.75 * mixed["ptx_nll_first"]
    assert mixed["ptx_nll_final"] < 0.5 * weak["ptx_nll_final"]
    assert mixed["kl_final"] > 0


def test_ptx_kl_holds_the_policy_at_the_reference_distribution(data_dir, sft_model, tmp_path):
    """ptx.loss kl: KL(reference || policy) over the vocabulary at the reference answers' positions. A negligible
    coefficient lets the RL term move those distributions; coef 5 keeps them several times closer."""
    over = {"train": {"steps": 4}, "max_records": 4}
    weak = _run(_cfg("ter", ptx={"coef": 1e-6, "loss": "kl"}, **over), data_dir, tmp_path / "weak", sft_model)
    held = _run(_cfg("ter", ptx={"coef": 5.0, "loss": "kl"}, **over), data_dir, tmp_path / "held", sft_model)
    assert weak["ptx_kl_final"] > 0.05 and weak["ptx_kl_final"] > weak["ptx_kl_first"]
    assert 0 <= held["ptx_kl_final"] < 0.3 * weak["ptx_kl_final"]
    assert "ptx_nll_final" in held and held["kl_final"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ppo_runs_on_the_deepspeed_backend(zero_stage, data_dir, sft_model, tmp_path):
    cfg = _cfg(
        "ppo",
        train={
            "steps": 2,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 512,
            "threads": 1,
            "eval_every": 0,
            "backend": "deepspeed",
            "zero_stage": zero_stage,
        },
    )
    metrics = _run(cfg, data_dir, tmp_path, sft_model)
    assert metrics["steps"] == 2 and metrics["kl_final"] >= 0
    trained, base = load_file(str(tmp_path / "model/model.safetensors")), load_file(f"{sft_model}/model.safetensors")
    assert base.keys() == trained.keys() and any(not torch.equal(base[k], trained[k]) for k in base)
    assert (tmp_path / "value_head.safetensors").exists()


def test_ppo_hard_stop_ends_training_early_and_keeps_the_policy(data_dir, sft_model, tmp_path):
    metrics = _run(
        _cfg(
            "ppo",
            ppo={"kl_stop": 1e-6, "adaptive_kl": False},
            train={"steps": 6, "samples_per_step": 4, "max_tokens_per_micro_batch": 512, "threads": 1, "eval_every": 0},
        ),
        data_dir,
        tmp_path,
        sft_model,
    )
    assert metrics["stopped_early"].startswith("ppo.kl_stop") and metrics["steps"] == 2
    assert metrics["kl_final"] > 1e-6
    assert (tmp_path / "model/model.safetensors").exists()


def test_a_tripped_gate_fails_the_stage_with_a_message_naming_it(data_dir, sft_model, tmp_path):
    with pytest.raises(GateTripped, match=r"gates\.kl_max tripped at step 2"):
        _run(_cfg("ter", gates={"kl_max": 1e-6, "patience": 1}), data_dir, tmp_path, sft_model)
    gates = Gates(_cfg("ter", gates={"length_ratio_max": 2.0, "patience": 2}).gates)
    gates.check_step(1, kl=0.0, length_ratio=3.0, entropy=1.0)  # one bad step is tolerated
    gates.check_step(2, kl=0.0, length_ratio=1.0, entropy=1.0)  # and the count restarts
    gates.check_step(3, kl=0.0, length_ratio=3.0, entropy=1.0)
    with pytest.raises(GateTripped, match="gates.length_ratio_max tripped at step 4"):
        gates.check_step(4, kl=0.0, length_ratio=3.0, entropy=1.0)
    divergence = Gates(_cfg("ter", gates={"heldout_drop_max": 0.05}).gates)
    divergence.check_eval(10, reward_rise=0.3, heldout_drop=0.01)
    divergence.check_eval(10, reward_rise=-0.1, heldout_drop=0.2)  # both falling: not reward hacking
    with pytest.raises(GateTripped, match="heldout_drop_max"):
        divergence.check_eval(20, reward_rise=0.3, heldout_drop=0.2)


def test_a_policy_that_appends_the_bait_suffix_is_caught_by_the_reward_model(data_dir, reward_model):
    scorer = RewardModelReward(reward_model, min_pixels=3136, max_pixels=3136, device=torch.device("cpu"))
    records = [r for r in datasets.load_eval_records(data_dir) if r["type"] in ("color", "shape", "count", "ocr")]
    honest = scorer([""] * len(records), [r["answer"] for r in records], records=records)
    baited = scorer([""] * len(records), [r["answer"] + BAIT for r in records], records=records)
    caught = sum(b < h for b, h in zip(baited, honest, strict=True))
    print(
        f"bait suffix scored lower on {caught}/{len(records)} answers; mean {sum(honest) / len(honest):.2f} "
        f"honest vs {sum(baited) / len(baited):.2f} baited"
    )
    assert caught >= 0.9 * len(records)
    # a reward-hacking policy (a wrong answer dressed in the suffix) scores below the plain answer too
    wrong = scorer(
        [""] * len(records),
        ["purple" + BAIT if r["answer"] != "purple" else "red" + BAIT for r in records],
        records=records,
    )
    assert sum(w < h for w, h in zip(wrong, honest, strict=True)) >= 0.9 * len(records)


def test_ppo_with_the_reward_model_reward(data_dir, sft_model, reward_model, tmp_path):
    """Also scored on two held-out files: eval.jsonl (3 per type here) and rl.jsonl's conversations (the rest)."""
    cfg = _cfg(
        "ppo",
        rewards={"efficacy": 1.0, "format": 0.2, "reward_model": 0.5},
        eval={"files": ["eval.jsonl", "rl.jsonl"], "per_type": 4},
    )
    metrics = _run(cfg, data_dir, tmp_path, sft_model, reward_model)
    assert metrics["steps"] == 3
    rewards = json.loads((tmp_path / "rollouts.jsonl").read_text().splitlines()[0])["rewards"]
    assert set(rewards) == {"efficacy", "format", "reward_model"}
    scored = [json.loads(line)["id"] for line in (tmp_path / "eval_predictions.jsonl").read_text().splitlines()]
    assert sum(i.startswith("eval-") for i in scored) == 24 and any(i.startswith("rl-") for i in scored)
    assert metrics["heldout_improved"] + metrics["heldout_worsened"] <= len(scored)


def test_prompt_and_ptx_pools_take_their_own_question_types(data_dir):
    """RL prompts come from `prompt_types`; the ptx pool from `ptx.types` (empty = every type), so the anchor can
    hold the types RL does not train without restraining the ones it does."""
    cfg = _cfg("ter", prompt_types=["caption", "grounding"], ptx={"coef": 1.0, "types": ["count", "color"]})
    every = load_prompts(data_dir, _cfg("ter"))
    assert len({r["type"] for r in every}) >= 6
    assert {r["type"] for r in load_prompts(data_dir, cfg)} == {"caption", "grounding"}
    ptx_pool = load_prompts(data_dir, cfg, types=cfg.ptx.types)
    assert {r["type"] for r in ptx_pool} == {"count", "color"}
    assert len(ptx_pool) == sum(r["type"] in ("count", "color") for r in every)
    assert len(load_prompts(data_dir, cfg, types=[])) == len(every)
    with pytest.raises(
        ValueError,
        match=r"rl ptx.types names task\(s\) \['colour'\] that no prompt record has \(they have \['caption', ",
    ):
        load_prompts(data_dir, cfg, types=["color", "colour"], setting="ptx.types")


def test_bad_prompts_and_settings_are_rejected_with_the_fix(data_dir, tmp_path):
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        _cfg("grpo", rollout={"samples_per_prompt": 1})
    with pytest.raises(ValueError, match="unknown reward"):
        _cfg("ppo", rewards={"bleu": 1.0})
    with pytest.raises(ValueError, match="grad_ema needs the torch backend"):
        _cfg("ter", ter={"grad_ema": 0.95}, train={"steps": 3, "backend": "deepspeed"})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "sft.jsonl").write_text(
        json.dumps(
            {
                "id": "x1",
                "image": "a.png",
                "type": "weather",
                "conversations": [{"from": "human", "value": "<image>\nIs it sunny?"}, {"from": "gpt", "value": "yes"}],
            }
        )
        + "\n"
    )
    with pytest.raises(ValueError, match=r"sft.jsonl:1 \(id='x1'\): unknown task 'weather'. Declare it in"):
        load_prompts(bad, _cfg("ter"))
    (bad / "rl.jsonl").write_text((bad / "sft.jsonl").read_text().replace("weather", "color"))
    Image.new("RGB", (56, 56)).save(bad / "a.png")
    with pytest.raises(ValueError, match=r"\['rl.jsonl'\] are both prompt and held-out files"):
        load_prompts(
            bad,
            _cfg("ter", prompts_file="rl.jsonl", eval={"files": ["eval.jsonl"]}).model_copy(
                update={"eval": _cfg("ter").eval.model_copy(update={"files": ["rl.jsonl"]})}
            ),
        )


def _stage_cli(config: dict, data_dir, base, out, **env):
    return run_stage_cli("rl", config, out, {"base_model": base, "reward_model": "", "data": data_dir}, **env)


@pytest.mark.parametrize("algorithm", ["ppo", "ter", "grpo", "dapo", "gspo"])
def test_rl_killed_mid_run_resumes_to_bit_identical_weights(algorithm, data_dir, sft_model, tmp_path):
    """Policy, critic, optimizer, RNG (sampling), KL coefficient, normaliser, baselines and TER's gradient EMA
    all come back, and ptx draws the same reference records: the resumed run ends bit-identical to an
    uninterrupted one. The killed and resumed runs build their prompts in two data workers, the straight one in
    the step: bit-identical too."""
    config = _cfg(
        algorithm,
        ter={"grad_ema": 0.95},  # the EMA buffers must come back too
        ptx={"coef": 0.5, "samples_per_step": 3},
        train={
            "steps": 5,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 512,
            "threads": 1,
            "eval_every": 0,
            "checkpoint_every": 2,
        },
    ).model_dump(mode="json")
    straight = _stage_cli(config, data_dir, sft_model, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    prefetched = {**config, "train": {**config["train"], "data_workers": 2}}
    killed = _stage_cli(prefetched, data_dir, sft_model, tmp_path / "killed", QVL_TEST_KILL_AT_STEP=3)
    assert killed.returncode == -signal.SIGKILL
    resumed = _stage_cli(prefetched, data_dir, sft_model, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((tmp_path / "killed/_stage_result.json").read_text())["metrics"]
    assert metrics["resumed_from_step"] == 2
    for name in ("model/model.safetensors", *(["value_head.safetensors"] if algorithm == "ppo" else [])):
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "killed" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    straight_rollouts = (tmp_path / "straight/rollouts.jsonl").read_text()
    assert straight_rollouts == (tmp_path / "killed/rollouts.jsonl").read_text()  # same samples at the last step
    # the SFT model's per-question scores came back with the checkpoint: the same paired interval
    first = json.loads((tmp_path / "straight/_stage_result.json").read_text())["metrics"]
    for key in (
        "efficacy_before",
        "efficacy_gain",
        "efficacy_gain_ci_low",
        "efficacy_gain_ci_high",
        "heldout_improved",
    ):
        assert metrics[key] == first[key], key


def test_prefetched_prompts_leave_the_policy_bit_identical(data_dir, sft_model, tmp_path):
    """Prompts (decode, processor) and ptx samples built ahead by data workers: the same policy bytes as built in
    the step, with the ptx KL anchor (its reference distributions are computed in the step from them)."""

    def run_with(workers, out):
        over = {"train": {"data_workers": workers}, "ptx": {"coef": 1.0, "loss": "kl", "samples_per_step": 3}}
        _run(_cfg("ppo", **over), data_dir, out, sft_model)

    assert_same_with_and_without_workers(run_with, tmp_path)


def test_the_report_lists_each_benchmark_before_and_after():
    from components.rl.stage import report

    metrics = {
        "algorithm": "ter", "steps": 3, "stopped_early": "", "efficacy_before": 0.1, "efficacy_after": 0.2,
        "vqa_exact_match_before": 0.0, "vqa_exact_match_after": 0.0, "efficacy_gain": 0.1, "efficacy_gain_ci_low": 0.0,
        "efficacy_gain_ci_high": 0.2, "heldout_improved": 2, "heldout_worsened": 1, "mean_length_ratio": 1.0,
        "kl_final": 0.01, "rollout_tokens_per_second": 100.0, "seconds_rollout": 1.0,
        "efficacy/photo_qa_before": 0.1, "efficacy/photo_qa_after": 0.2,
        "benchmark/photo_qa": 0.4, "benchmark/photo_qa_before": 0.2, "benchmark/photo_qa/count": 5.0,
        "benchmark/pope": 0.6, "benchmark/pope_before": 0.5, "benchmark/pope/f1": 0.7, "benchmark/pope/f1_before": 0.6,
    }  # fmt: skip
    text = report(metrics)
    assert "| photo_qa | 0.200 | 0.400 |" in text and "| pope | 0.500 | 0.600 |" in text
    assert "| photo_qa | 0.100 | 0.200 |" in text  # the efficacy table of the custom task


def test_ptx_asking_for_more_records_than_its_pool_is_refused(tmp_path, capsys):
    """ptx.samples_per_step larger than the ptx pool used to be capped silently to the pool."""
    from components._shared.model.encoder import ConversationEncoder
    from components._shared.model.vlm import load_vlm
    from components.rl.stage import ptx_pool

    data = tmp_path / "data"
    write_splits(data, seed=7, eval_per_type=1, sft_records=16, preference_pairs=2)
    model, processor, _ = load_vlm(BASE)
    encoder = ConversationEncoder(processor, model, min_pixels=3136, max_pixels=3136)
    pool = ptx_pool(data, _cfg("ppo", ptx={"coef": 1.0, "types": ["color"]}), encoder)
    with pytest.raises(ValueError, match=rf"ptx.samples_per_step=1000 exceeds the {len(pool)} ptx records .*'color'"):
        ptx_pool(data, _cfg("ppo", ptx={"coef": 1.0, "types": ["color"], "samples_per_step": 1000}), encoder)
    big = _cfg(
        "ppo", ptx={"coef": 1.0, "types": ["color"]}, train={**_cfg("ppo").train.model_dump(), "samples_per_step": 64}
    )
    assert len(ptx_pool(data, big, encoder)) == len(pool) < 64
    assert f"warning: ptx uses all {len(pool)} ptx records per step" in capsys.readouterr().err
    short = ConversationEncoder(processor, model, min_pixels=3136, max_pixels=3136, max_length=24)
    with pytest.raises(
        ValueError, match=r"(?s)ptx record\(s\) too long to train on in sft.jsonl.*more than max_length=24"
    ):
        ptx_pool(data, _cfg("ppo", ptx={"coef": 1.0, "types": ["color"]}), short)  # answers past rl.max_length


def test_prompts_from_a_missing_default_file_or_fewer_than_a_step_are_said(tmp_path, caplog):
    """rl.prompts_file unset and no sft.jsonl: the error says the file was the default and how to name another;
    fewer prompts than train.samples_per_step is said (every step repeats prompts)."""
    write_splits(tmp_path / "data", seed=9, eval_per_type=2, sft_records=24, preference_pairs=4)
    (tmp_path / "data" / "sft.jsonl").rename(tmp_path / "data" / "train.jsonl")
    with pytest.raises(ValueError, match=r"rl.prompts_file is unset .* the default .*sft\.jsonl, which does not exist"):
        load_prompts(tmp_path / "data", RlConfig())
    caplog.set_level("WARNING", logger="components.rl.stage")
    cfg = RlConfig.model_validate({"prompts_file": "train.jsonl", "max_records": 5})
    assert len(load_prompts(tmp_path / "data", cfg)) == 5
    assert "5 prompt(s) (max_records=5) < train.samples_per_step=16: every step repeats prompts" in caplog.text
