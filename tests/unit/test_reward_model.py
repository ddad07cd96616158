"""The reward_model stage: Bradley-Terry on pairs, sparsified scoring, per-kind accuracy, save/load, bait caught."""

import json

import pytest
import torch

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.packing import pack
from components._shared.model.reward_models import RewardModel, load_reward_model, reward_index
from components._shared.model.vlm import load_vlm
from components._shared.platform.tracking import NullTracker
from components.reward_model.config import RewardModelConfig
from components.reward_model.stage import load_pairs, run, score_pairs
from components.synth_world.splits import write_splits
from tests.prefetch import assert_same_with_and_without_workers

BASE = "builtin:tiny-qwen2_5-vl"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefs")
    write_splits(out, seed=6, eval_per_type=2, sft_records=4, preference_pairs=80)
    return out


def _cfg(**over):
    data = {
        "min_pixels": 3136,
        "max_pixels": 12544,
        "heldout_fraction": 0.25,
        "train": {
            "steps": 12,
            "samples_per_step": 8,
            "max_tokens_per_micro_batch": 1024,
            "eval_every": 6,
            "threads": 1,
        },
        "optim": {"lr": 0.003},
    }
    data.update(over)
    return RewardModelConfig.model_validate(data)


@pytest.mark.parametrize("backend", ["torch", pytest.param("deepspeed-3", marks=pytest.mark.slow)])
def test_training_separates_pairs_and_reports_every_kind(data_dir, tmp_path, backend):
    cfg = _cfg()
    if backend != "torch":
        cfg = _cfg(train={**cfg.train.model_dump(), "backend": "deepspeed", "zero_stage": 3})
    metrics = run(cfg, base_model=BASE, data=str(data_dir), output_dir=tmp_path, tracker=NullTracker())
    assert metrics["train_loss_final"] < metrics["train_loss_first"]
    kinds = {k.split("/")[1] for k in metrics if k.startswith("pair_accuracy/")}
    assert kinds == {"wrong_attribute", "hallucinated_object", "flowery_padding", "hacking_bait"}
    # text-only tells (padding, bait suffix) are learnt first, even by a random-init backbone in 12 steps
    assert metrics["pair_accuracy/flowery_padding"] >= 0.8 and metrics["pair_accuracy/hacking_bait"] >= 0.8
    assert metrics["heldout_pairs"] + metrics["train_pairs"] == 80
    model, processor, meta = load_reward_model(str(tmp_path / "model"))
    assert meta["score_first_k"] == 150 and meta["reward_std"] > 0
    # the saved model scores held-out pairs exactly as at the end of training
    pairs = [p for p in load_pairs(data_dir, None)][:4]
    encoder = ConversationEncoder(processor, model.backbone, min_pixels=3136, max_pixels=12544)
    assert len(score_pairs(model, [_unit(encoder, data_dir, p) for p in pairs])) == 4


def _unit(encoder, data_dir, record, k=150, rejected=None):
    from components._shared.data import datasets

    image = datasets.load_image(data_dir, record["image"])
    out = []
    for text in (record["chosen"], rejected or record["rejected"]):
        s = encoder.encode(
            [{"role": "user", "text": f"<image>\n{record['prompt']}"}, {"role": "assistant", "text": text}],
            images=[image],
        )
        s.meta["reward_index"] = reward_index(s, k)
        out.append(s)
    return out


def test_sparsified_reward_ignores_everything_after_k_tokens(data_dir):
    torch.manual_seed(0)
    backbone, processor, _ = load_vlm(BASE)
    model = RewardModel(backbone).eval()
    encoder = ConversationEncoder(processor, backbone, min_pixels=3136, max_pixels=12544)
    record = {
        "image": json.loads((data_dir / "preferences.jsonl").read_text().splitlines()[0])["image"],
        "prompt": "What shape is it?",
        "chosen": "a red circle",
        "rejected": "x",
    }
    short = _unit(encoder, data_dir, record, k=2, rejected="a red circle according to the image evidence")
    assert short[0].meta["reward_index"] == short[1].meta["reward_index"]
    with torch.no_grad():
        r = model.scores(pack(short), short)
    assert float(r[0]) == pytest.approx(float(r[1]), abs=1e-5)  # same first 2 response tokens, same reward
    full = _unit(encoder, data_dir, record, k=150, rejected="a red circle according to the image evidence")
    with torch.no_grad():
        r = model.scores(pack(full), full)
    assert abs(float(r[0] - r[1])) > 1e-4  # without sparsification the suffix moves the reward


def test_bad_pairs_are_rejected(tmp_path):
    (tmp_path / "preferences.jsonl").write_text(
        json.dumps({"id": "p1", "image": "a.png", "prompt": "q", "chosen": "same", "rejected": "same"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"preferences.jsonl:1 \(id='p1'\): chosen and rejected are the same text"):
        load_pairs(tmp_path, None)


def test_prefetching_data_workers_leave_the_model_bit_identical(data_dir, tmp_path):
    def run_with(workers, out):
        cfg = _cfg()
        cfg = _cfg(train={**cfg.train.model_dump(), "steps": 4, "eval_every": 0, "data_workers": workers})
        run(cfg, base_model=BASE, data=str(data_dir), output_dir=out, tracker=NullTracker())

    assert_same_with_and_without_workers(run_with, tmp_path)


def test_gradient_checkpointing_trains_the_same_reward_model(data_dir, tmp_path):
    """prod presets train the reward model with gradient checkpointing: the backbone's layers are checkpointed
    (recomputed in the backward) and the run follows the plain one."""
    from safetensors.torch import load_file

    def run_with(checkpointing, out):
        cfg = _cfg()
        train = {**cfg.train.model_dump(), "steps": 3, "eval_every": 0, "gradient_checkpointing": checkpointing}
        return run(_cfg(train=train), base_model=BASE, data=str(data_dir), output_dir=out, tracker=NullTracker())

    plain, checkpointed = run_with(False, tmp_path / "plain"), run_with(True, tmp_path / "ckpt")
    assert checkpointed["train_loss_final"] == pytest.approx(plain["train_loss_final"], rel=1e-5)
    heads = [load_file(str(tmp_path / name / "model" / "reward_head.safetensors")) for name in ("plain", "ckpt")]
    assert torch.allclose(heads[0]["weight"], heads[1]["weight"], atol=1e-6)
    model = RewardModel(load_vlm(BASE)[0])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.backbone.is_activation_checkpointing


def test_the_likelihood_term_adds_the_answers_mean_log_probability_up_to_k_and_survives_saving(data_dir, tmp_path):
    """score = head(h_K) + w x mean log p(answer tokens 1..K); text after the K-th token changes neither part, and the
    learned weight is saved with the head."""
    from components._shared.model.packing import forward_logits
    from components._shared.model.reward_models import save_reward_model

    torch.manual_seed(0)
    backbone, processor, _ = load_vlm(BASE)
    plain, with_term = RewardModel(backbone).eval(), RewardModel(backbone, likelihood_term=True).eval()
    with_term.head.load_state_dict(plain.head.state_dict())
    with_term.likelihood_weight.data.fill_(0.7)
    encoder = ConversationEncoder(processor, backbone, min_pixels=3136, max_pixels=12544)
    record = {"image": load_pairs(data_dir, None)[0]["image"], "prompt": "What shape is it?"}
    record |= {"chosen": "a red circle", "rejected": "a blue square"}
    for k in (2, 150):
        samples = _unit(encoder, data_dir, record, k=k)
        with torch.no_grad():
            batch = pack(samples)
            logits = forward_logits(backbone, batch)[0]
            expected = []
            for i, sample in enumerate(samples):  # by hand: sample i's answer tokens up to its K-th
                start = sum(s.num_tokens for s in samples[:i])
                answer = (sample.labels != -100).nonzero().flatten()
                answer = answer[answer <= sample.meta["reward_index"]]
                logp = torch.log_softmax(logits[start + answer - 1].float(), -1)
                expected.append(logp.gather(1, sample.labels[answer][:, None]).mean())
            got = with_term.scores(batch, samples) - plain.scores(batch, samples)
        assert torch.allclose(got, 0.7 * torch.stack(expected), atol=1e-5), (k, got, expected)
    suffix = _unit(encoder, data_dir, record, k=2, rejected="a red circle, as the image shows")
    with torch.no_grad():
        chosen, rejected = with_term.scores(pack(suffix), suffix)
    assert float(chosen) == pytest.approx(float(rejected), abs=1e-5)  # same first 2 answer tokens
    save_reward_model(with_term, processor, tmp_path, score_first_k=2, mean=0.0, std=1.0, base_model=BASE)
    loaded, _, _ = load_reward_model(str(tmp_path))
    assert float(loaded.likelihood_weight.detach()) == pytest.approx(0.7)
    with torch.no_grad():
        assert torch.allclose(loaded.scores(pack(suffix), suffix), with_term.scores(pack(suffix), suffix), atol=1e-5)
    save_reward_model(plain, processor, tmp_path / "plain", score_first_k=2, mean=0.0, std=1.0, base_model=BASE)
    assert load_reward_model(str(tmp_path / "plain"))[0].likelihood_weight is None  # older artifacts load as before
