"""The distill stage: structured pruning (exact at the teacher's sizes, closer to the teacher than a random init
when smaller, clear errors for sizes it cannot cut), the losses, the stage end to end on the tiny model
(every loss and on-policy samples on), exact resume after SIGKILL, and config errors."""

import json
import signal

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.packing import forward_logits, pack
from components._shared.model.vlm import build_student, count_parameters, load_vlm, set_pixel_bounds
from components._shared.platform.tracking import NullTracker
from components.distill.config import DistillConfig, LossConfig
from components.distill.losses import attention_kl, distillation_loss, layer_map, logit_kl
from components.distill.prune import measure_importance, plan_pruning, prune
from components.distill.stage import run
from components.synth_world.splits import write_splits
from tests.prefetch import assert_same_with_and_without_workers
from tests.stage_cli import run_stage_cli
from tests.tiny_sft import train_tiny_sft

BASE = "builtin:tiny-qwen2_5-vl"
SMALL = {"layers": 1, "hidden": 32, "intermediate": 64, "vision_depth": 1, "vision_hidden": 32}


def _batch(model, processor, n: int = 6):
    set_pixel_bounds(processor, 3136, 12544)
    encoder = ConversationEncoder(processor, model, min_pixels=3136, max_pixels=12544)
    rng = np.random.default_rng(0)
    samples = [
        encoder.encode(
            [
                {"role": "user", "text": "<image>\nWhat colour is the shape?"},
                {"role": "assistant", "text": ["red", "blue square", "two"][i % 3]},
            ],
            images=[Image.fromarray((rng.random((84, 112, 3)) * 255).astype("uint8"))],
        )
        for i in range(n)
    ]
    return pack(samples)


def _kl(teacher, student, batch) -> float:
    with torch.no_grad():
        t = torch.log_softmax(forward_logits(teacher.eval(), batch), -1)
        s = torch.log_softmax(forward_logits(student.eval(), batch), -1)
    return float((t.exp() * (t - s)).sum(-1).mean())


@pytest.mark.parametrize("family", ["tiny-qwen2_5-vl", "tiny-qwen2-vl"])
def test_pruning_keeps_the_teacher_exactly_at_its_sizes_and_beats_random_init_when_smaller(family):
    teacher, processor, _ = load_vlm(f"builtin:{family}")
    batch = _batch(teacher, processor)
    importance = measure_importance(teacher, [batch])
    same = prune(teacher, plan_pruning(teacher, importance)).eval()
    with torch.no_grad():
        assert torch.equal(forward_logits(same, batch), forward_logits(teacher.eval(), batch))

    sizes = {**SMALL, "vision_intermediate": 64 if family == "tiny-qwen2_5-vl" else 128}
    plan = plan_pruning(teacher, importance, **sizes)
    pruned = prune(teacher, plan)
    text, vision = pruned.config.text_config, pruned.config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, vision.depth) == (1, 32, 2, 1)
    assert count_parameters(pruned) / count_parameters(teacher) < 0.35
    assert plan.lm_layers == [int(np.argmax(importance.lm_layers))]  # the layer that changes the stream most
    random = AutoModelForImageTextToText.from_config(plan.config)
    assert _kl(teacher, pruned, batch) < 0.7 * _kl(teacher, random, batch)


def test_pruning_rejects_sizes_it_cannot_cut():
    teacher, processor, _ = load_vlm(BASE)
    importance = measure_importance(teacher, [_batch(teacher, processor, 2)])
    with pytest.raises(ValueError, match=r"student\.hidden=40 is not a multiple of the teacher's head_dim 16"):
        plan_pruning(teacher, importance, hidden=40)
    with pytest.raises(ValueError, match=r"student\.layers=3 exceeds the teacher's 2"):
        plan_pruning(teacher, importance, layers=3)
    with pytest.raises(ValueError, match=r"student\.kv_heads=3"):
        plan_pruning(teacher, importance, hidden=32, kv_heads=3)
    with pytest.raises(ValueError, match=r"vision_hidden=24 is not a multiple"):
        plan_pruning(teacher, importance, vision_hidden=24)


def test_losses():
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    assert float(logit_kl(logits, logits, 2.0).abs().max()) < 1e-6
    other = torch.randn(5, 11)
    kl1, kl2 = logit_kl(other, logits, 1.0), logit_kl(other, logits, 4.0)
    assert (kl1 > 0).all() and (kl2 > 0).all() and not torch.allclose(kl1, kl2)
    att = torch.softmax(torch.randn(1, 2, 6, 6), -1)
    assert float(attention_kl(att, att, torch.arange(6)).abs().max()) < 1e-5
    assert float(attention_kl(torch.softmax(torch.randn(1, 4, 6, 6), -1), att, torch.arange(6)).min()) > 0
    assert layer_map(2, 4) == [(0, 1), (1, 3)] and layer_map(1, 2, kept=[1]) == [(0, 1)]

    class Out:  # what the language model returns, for the parts the loss reads
        def __init__(self, hidden):
            self.last_hidden_state = hidden[None]

    batch = {"targets": torch.tensor([[-100, 3, 4, -100, 5]])}
    student, teacher = Out(torch.randn(5, 7)), Out(torch.randn(5, 7))
    heads = (torch.nn.Linear(7, 11), torch.nn.Linear(7, 11))
    weights = LossConfig(kl=0.0, ce=1.0)

    def loss(data_answer, chunk_rows=2, weights=weights):
        return distillation_loss(
            student,
            teacher,
            batch,
            weights=weights,
            pairs=[],
            projections=None,
            data_answer=data_answer,
            heads=heads,
            chunk_rows=chunk_rows,
        )

    everything, n, _ = loss(torch.ones(5, dtype=torch.bool))
    on_policy_last, _, _ = loss(torch.tensor([True, True, True, False, False]))
    both = LossConfig(kl=0.7, ce=0.3)
    chunked, _, parts = loss(torch.ones(5, dtype=torch.bool), 2, both)
    plain, _, plain_parts = loss(torch.ones(5, dtype=torch.bool), 0, both)
    assert abs(float(chunked.detach()) - float(plain.detach())) < 1e-6 and parts == pytest.approx(plain_parts, rel=1e-6)
    (chunked_grad,) = torch.autograd.grad(chunked, heads[0].weight)
    (plain_grad,) = torch.autograd.grad(plain, heads[0].weight)
    assert torch.allclose(chunked_grad, plain_grad, atol=1e-6) and plain_grad.abs().sum() > 0
    # no CE on the student's own tokens
    assert n == 3 and 0 < float(on_policy_last.detach()) < float(everything.detach())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("distillworld")
    write_splits(out, seed=3, eval_per_type=2, sft_records=48, preference_pairs=8)
    return out


@pytest.fixture(scope="module")
def teacher(data_dir, tmp_path_factory):
    """A briefly fine-tuned tiny model: a teacher with a distribution worth copying (a random init is near
    uniform, which any student already matches)."""
    return str(train_tiny_sft(data_dir, tmp_path_factory.mktemp("teacher"), steps=30))


def _cfg(**over) -> DistillConfig:
    data = {
        "student": {**SMALL, "vision_intermediate": 64, "calibration_samples": 16},
        "min_pixels": 3136,
        "max_pixels": 3136,
        "loss": {"temperature": 2.0, "kl": 1.0, "ce": 0.2, "hidden": 0.5, "attention": 0.5},
        "on_policy": {"fraction": 0.25, "max_new_tokens": 6},
        "train": {"steps": 12, "samples_per_step": 8, "max_tokens_per_micro_batch": 512, "threads": 1, "eval_every": 0},
        "optim": {"lr": 0.003},
        "schedule": {"warmup_steps": 1},
        "eval": {"per_type": 2, "batch_size": 16, "max_new_tokens": 6},
    }
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) else v
    return DistillConfig.model_validate(data)


def test_distill_stage_pulls_the_student_toward_the_teacher(data_dir, teacher, tmp_path):
    metrics = run(_cfg(), teacher_model=teacher, data=str(data_dir), output_dir=tmp_path, tracker=NullTracker())
    assert metrics["student_param_ratio"] < 0.35 and metrics["steps"] == 12
    assert metrics["heldout_kl_final"] < 0.8 * metrics["heldout_kl_init"]  # on held-out answers it never saw
    assert 0 <= metrics["student_vqa_exact_match"] <= 1 and metrics["student_speedup"] > 0
    student = AutoModelForImageTextToText.from_pretrained(tmp_path / "model")
    assert count_parameters(student) == metrics["student_parameters"]
    assert not [k for k in load_file(str(tmp_path / "model/model.safetensors")) if "distill" in k]
    described = json.loads((tmp_path / "student.json").read_text())
    assert described["init"] == "prune" and described["lm_layers_kept"] in ([0], [1])
    rows = [json.loads(line) for line in (tmp_path / "eval_predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"prediction", "score"} <= set(rows[0])
    report = (tmp_path / "report.md").read_text()
    assert "| grounding_accuracy |" in report and report.count("](data:image/png;base64,") == 2  # curves embedded


def test_distill_killed_mid_run_resumes_to_bit_identical_weights(data_dir, tmp_path):
    """Student, projections, optimizer and the RNG that samples on-policy answers all come back."""
    config = _cfg(loss={"attention": 0.0}, train={"steps": 5, "checkpoint_every": 2}).model_dump(mode="json")
    inputs = {"teacher_model": BASE, "data": data_dir}
    straight = run_stage_cli("distill", config, tmp_path / "straight", inputs)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run_stage_cli("distill", config, tmp_path / "killed", inputs, QVL_TEST_KILL_AT_STEP=3)
    assert killed.returncode == -signal.SIGKILL
    resumed = run_stage_cli("distill", config, tmp_path / "killed", inputs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "killed/_stage_result.json").read_text())["metrics"]["resumed_from_step"] == 2
    a, b = (load_file(str(tmp_path / run / "model/model.safetensors")) for run in ("straight", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_logit_kl_compares_the_vocabulary_both_checkpoints_share():
    torch.manual_seed(0)
    student, teacher = torch.randn(5, 8), torch.randn(5, 11)  # the teacher's embedding has 3 more padding rows
    torch.testing.assert_close(logit_kl(student, teacher, 2.0), logit_kl(student, teacher[:, :8], 2.0))
    torch.testing.assert_close(logit_kl(teacher, student, 2.0), logit_kl(teacher[:, :8], student, 2.0))


def test_student_checkpoint_init_and_config_errors(data_dir, tmp_path):
    """The student checkpoint has the teacher's tokenizer but more embedding rows (as Qwen2.5-VL-7B's 152,064 vs
    3B's 151,936): accepted, distilled over the shared vocabulary."""
    teacher = load_vlm(BASE).model
    small = build_student(teacher.config, layers=1)
    small.resize_token_embeddings(teacher.config.text_config.vocab_size + 64)
    assert small.config.text_config.vocab_size == teacher.config.text_config.vocab_size + 64
    processor = load_vlm(BASE).processor
    small.save_pretrained(tmp_path / "small")
    processor.save_pretrained(tmp_path / "small")
    cfg = _cfg(
        student={"init": "model", "model_uri": str(tmp_path / "small")},
        train={"steps": 2},
        loss={"hidden": 0.0, "attention": 0.0},
        on_policy={"fraction": 0.0},
    )
    metrics = run(cfg, teacher_model=BASE, data=str(data_dir), output_dir=tmp_path / "out", tracker=NullTracker())
    assert metrics["student_init"] == "model" and metrics["student_parameters"] == count_parameters(small)
    itself = cfg.model_copy(update={"student": cfg.student.model_copy(update={"model_uri": BASE})})
    with pytest.raises(ValueError, match=r"not fewer than the teacher's .* \(the teacher itself\?\)"):
        run(itself, teacher_model=BASE, data=str(data_dir), output_dir=tmp_path / "self", tracker=NullTracker())

    with pytest.raises(ValueError, match="student.init=model needs student.model_uri"):
        DistillConfig.model_validate({"student": {"init": "model"}})
    with pytest.raises(ValueError, match="on_policy.fraction > 0 needs loss.kl > 0"):
        DistillConfig.model_validate({"loss": {"kl": 0.0, "ce": 1.0}, "on_policy": {"fraction": 0.5}})
    with pytest.raises(ValueError, match="student.model_uri is set but student.init='prune'"):
        DistillConfig.model_validate({"student": {"model_uri": "builtin:tiny-qwen2-vl"}})


def test_an_on_policy_fraction_that_rounds_to_no_sample_is_rejected_with_the_smallest_that_gives_one():
    with pytest.raises(ValueError) as err:
        DistillConfig.model_validate({"on_policy": {"fraction": 0.01}, "train": {"samples_per_step": 32}})
    assert (
        "distill.on_policy.fraction=0.01 x train.samples_per_step=32 rounds to 0 on-policy samples per step; set "
        "on_policy.fraction >= 0.03125 (one sample per step), raise train.samples_per_step, or set "
        "on_policy.fraction: 0 for off-policy distillation only."
    ) in str(err.value)
    with pytest.raises(ValueError, match=r"fraction=0\.1 x train\.samples_per_step=5 rounds to 0 .* >= 0\.2 "):
        DistillConfig.model_validate({"on_policy": {"fraction": 0.1}, "train": {"samples_per_step": 5}})
    for per_step in (1, 3, 7, 32, 100):  # the suggested fraction is accepted and gives one sample
        smallest = float(f"{1 / per_step:.4g}")
        cfg = DistillConfig.model_validate(
            {"on_policy": {"fraction": smallest}, "train": {"samples_per_step": per_step}}
        )
        assert round(cfg.on_policy.fraction * cfg.train.samples_per_step) == 1
    DistillConfig.model_validate({"on_policy": {"fraction": 0.0}, "train": {"samples_per_step": 32}})  # off-policy


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_distill_runs_on_the_deepspeed_backend(zero_stage, data_dir, teacher, tmp_path):
    """Hidden-state projections ride in the engine; the exported student is a plain Qwen model."""
    cfg = _cfg(
        loss={"attention": 0.0},
        on_policy={"fraction": 0.0},
        train={"steps": 3, "backend": "deepspeed", "zero_stage": zero_stage},
    )
    metrics = run(cfg, teacher_model=teacher, data=str(data_dir), output_dir=tmp_path, tracker=NullTracker())
    assert metrics["steps"] == 3 and metrics["heldout_kl_final"] < metrics["heldout_kl_init"]
    weights = load_file(str(tmp_path / "model/model.safetensors"))
    assert not [k for k in weights if "distill" in k]
    assert (
        count_parameters(AutoModelForImageTextToText.from_pretrained(tmp_path / "model"))
        == metrics["student_parameters"]
    )


def test_prefetching_data_workers_leave_the_student_bit_identical(data_dir, teacher, tmp_path):
    """Off-policy distillation prefetches (on-policy answers need the current student: built in the step)."""

    def run_with(workers, out):
        cfg = _cfg(
            on_policy={"fraction": 0.0},
            loss={"hidden": 0.0, "attention": 0.0},
            train={"steps": 3, "data_workers": workers},
        )
        run(cfg, teacher_model=teacher, data=str(data_dir), output_dir=out, tracker=NullTracker())

    assert_same_with_and_without_workers(run_with, tmp_path)
