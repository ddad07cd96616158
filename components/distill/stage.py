"""distill: compress the RL policy (teacher) into a smaller student of the same family by knowledge distillation.

1 process (CPU/tiny):  python -m components.distill --config pipelines/presets/tiny.yaml \
                           --teacher-model OUT/rl/model --data runs/world/heldout --output-dir OUT/distill
N GPUs (DeepSpeed):    torchrun --nproc-per-node 8 -m components.distill --config pipelines/presets/prod-7b.yaml ...
In the pipeline:       components/distill/component.py calls run_stage("distill", ...).

The student starts as a structurally pruned teacher (components/distill/prune.py), a random init of the same
sizes, or a given smaller checkpoint (config `student`). Each step packs `train.samples_per_step` conversations
into micro-batches; the frozen teacher (bf16 on a GPU) scores the same packed rows and the student learns its
temperature-scaled distribution over the response tokens, optionally with the data's cross-entropy, hidden-state
matching through learned projections and attention-map matching (components/distill/losses.py). With
`on_policy.fraction` > 0, that share of each step's answers is sampled from the current student first.
Packing, backends (torch / DeepSpeed), checkpoints and exact resume are the shared TrainLoop's.

Data (`--data`): sft.jsonl (the conversations; answers are targets for CE and prompts for on-policy samples)
and eval.jsonl (the held-out suite both models are scored on). Writes model/ (the student, HF format),
student.json (sizes, init, what pruning kept), eval_predictions.jsonl (student), report.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components._shared.data import datasets
from components._shared.data import tasks as T
from components._shared.data.image_cache import DecodedImages
from components._shared.data.overlap import held_out_overlap
from components._shared.data.record_images import say_small_images
from components._shared.eval import evaluation as E
from components._shared.model import checkpoint as ckpt
from components._shared.model.attention import enable_vision_varlen
from components._shared.model.device import resolve_device
from components._shared.model.encoder import IGNORE_INDEX, ConversationEncoder
from components._shared.model.head_loss import output_head
from components._shared.model.length_check import conversation_tokens, keep_trainable
from components._shared.model.packing import forward_outputs, pack, plan_micro_batches, to_device
from components._shared.model.sources import check_not_reward_model
from components._shared.model.stage_steps import (
    SCRATCH,
    Figure,
    checkpoint_store,
    finish_report,
    loop_metrics,
    run_key,
    trained_module,
)
from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop
from components._shared.model.vlm import (
    count_parameters,
    export_dtype,
    lm_attention,
    load_vlm,
    qwen_model,
    save_vlm,
    set_pixel_bounds,
)
from components._shared.platform.reports import history_series
from components._shared.platform.tracking import Tracker
from components.distill.config import DistillConfig, LossConfig
from components.distill.losses import distillation_loss, head_kl_ce, layer_map
from components.distill.student import attach_projections, build_student, student_sizes, student_stored_dtype

SUITE_KEYS = ("vqa_exact_match", "grounding_accuracy", "anls", "cider_d")


def heldout_eval(model, encoder, records: list[dict], cfg: DistillConfig) -> tuple[dict[str, float], list[dict], float]:
    """(suite metrics, per-record rows, seconds spent generating)."""
    started = time.perf_counter()
    summary, rows = E.evaluate_vqa(
        model, encoder, records, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens
    )
    return summary, rows, time.perf_counter() - started


@torch.no_grad()
def heldout_kl(student, teacher, samples: list, *, temperature: float, max_tokens: int, chunk_rows: int) -> float:
    """Mean per-token T^2 * KL(teacher_T || student_T) over the held-out answers, teacher-forced (what the
    training loss measures, on data the student never trained on)."""
    device = next(student.parameters()).device
    total, count = 0.0, 0
    for group in plan_micro_batches(
        [s.num_tokens for s in samples], max(max_tokens, max(s.num_tokens for s in samples))
    ):
        batch = to_device(pack([samples[i] for i in group]), device)
        valid = batch["targets"][0] != IGNORE_INDEX
        _, kl, _ = head_kl_ce(
            forward_outputs(student, batch, lm_head=False).last_hidden_state[0][valid],
            forward_outputs(teacher, batch, lm_head=False).last_hidden_state[0][valid],
            (output_head(student), output_head(teacher)),
            batch["targets"][0][valid],
            valid[valid],
            weights=LossConfig(kl=1.0, ce=0.0, temperature=temperature),
            chunk_rows=chunk_rows,
        )
        total, count = total + float(kl.sum()), count + int(valid.sum())
    return total / max(count, 1)


def run(
    cfg: DistillConfig, *, teacher_model: str, data: str, output_dir: str | Path, tracker: Tracker
) -> dict[str, Any]:
    """Distill the teacher into the configured student; returns teacher vs student scores, sizes and speed."""
    check_not_reward_model(teacher_model, "--teacher-model", expected="the RL stage's model/, the teacher")
    output_dir = Path(output_dir)
    data_dir = datasets.resolve_data_dir(data, scratch=output_dir / SCRATCH)
    records = datasets.load_conversations(data_dir, cfg.max_records)
    eval_records = datasets.load_eval_records(data_dir, per_type=cfg.eval.per_type)
    overlap = held_out_overlap(records, eval_records, what="distill")
    say_small_images(records, cfg.min_pixels, "distill")
    key = run_key(cfg, {"teacher_model": teacher_model, "data": data, "student_model": cfg.student.model_uri})
    store = checkpoint_store("distill", cfg.train, key, output_dir)
    teacher, processor, teacher_stored = load_vlm(teacher_model)
    teacher.requires_grad_(False).eval()
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    encoder = ConversationEncoder(
        processor, teacher, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    budget = cfg.train.max_tokens_per_micro_batch
    records = keep_trainable(records, conversation_tokens(encoder, budget), budget=budget, what="conversation")
    encode = record_encoder(encoder, records, data_dir)
    student, plan, pairs = prepare_student(cfg, teacher, processor, encode, len(records))
    final_rows: list[dict] = []
    eval_seconds: list[float] = []
    kl_samples = E.answer_samples(encoder, eval_records, [r["answer"] for r in eval_records])

    def evaluate(step: int, model) -> dict[str, float]:
        summary, rows, seconds = heldout_eval(model, encoder, eval_records, cfg)
        final_rows[:] = rows
        eval_seconds.append(seconds)
        kl = heldout_kl(
            model,
            teacher,
            kl_samples,
            temperature=cfg.loss.temperature,
            max_tokens=cfg.train.max_tokens_per_micro_batch,
            chunk_rows=cfg.train.loss_chunk_tokens,
        )
        return {
            "heldout_kl": kl,
            **{k: v for k, v in summary.items() if k in SUITE_KEYS or k.startswith("exact_match/")},
        }

    items = LoopData(
        phases=[Phase("all", cfg.train.steps, list(range(len(records))))],
        sample=encode,
        # on-policy answers come from the current student: built in the step; otherwise the data workers prefetch
        sample_batch=on_policy_batches(cfg, records, encode, encoder)
        if round(cfg.on_policy.fraction * cfg.train.samples_per_step)
        else None,
    )
    loop = TrainLoop(
        student, LoopSettings.of(cfg), items, store, tracker=tracker, loss_fn=make_loss(cfg, teacher, pairs)
    )
    result = loop.run(evaluate=evaluate)
    trained = trained_module(loop, lambda: _plain_student(cfg, student.config, teacher, pairs))
    if trained is None:  # DeepSpeed ranks > 0: rank 0 evaluates and exports
        return {"rank": loop.backend.rank, "steps": result.steps}
    student = _for_export(cfg, trained, teacher)
    with torch.no_grad():
        teacher_summary, _, teacher_seconds = heldout_eval(teacher, encoder, eval_records, cfg)
        if not final_rows:  # resumed from the final checkpoint: its evals were restored, the predictions were not
            _, final_rows, seconds = heldout_eval(student, encoder, eval_records, cfg)
            eval_seconds.append(seconds)
    metrics: dict[str, Any] = {
        "student_init": cfg.student.init,
        **loop_metrics(result),
        **comparison(teacher, student, teacher_summary, loop.evals),
        "student_speedup": round(teacher_seconds / max(eval_seconds[-1], 1e-9), 3),
        **({"data/held_out_overlap": overlap} if overlap else {}),
    }
    export = export_dtype(cfg.train.export_dtype, student_stored_dtype(cfg, teacher_stored))
    write_outputs(cfg, student, processor, plan, pairs, metrics, final_rows, output_dir, teacher_model, export)
    ckpt.write_pointer(output_dir, [store.root])
    finish_report(output_dir, tracker, report(metrics), _figures(result), set_aside=result.set_aside)
    return metrics


def _figures(result) -> list[Figure]:
    return [
        Figure(
            "train_loss",
            "training loss and its parts",
            history_series(result.history, ["loss", "kl", "ce", "hidden_mse", "attention_kl"]),
            log_y=True,
        ),
        Figure(
            "heldout",
            "held-out KL to the teacher and student VQA",
            history_series(result.evals, ["heldout_kl", "vqa_exact_match"]),
        ),
    ]


def write_outputs(
    cfg: DistillConfig,
    student,
    processor,
    plan,
    pairs: list[tuple[int, int]],
    metrics: dict[str, Any],
    rows: list[dict],
    output_dir: Path,
    teacher_model: str,
    export: torch.dtype,
) -> None:
    """model/ (the student, HF format, weights in `export`), student.json (init, sizes, matched layers, what
    pruning kept) and the student's eval_predictions.jsonl."""
    save_vlm(
        student,
        processor,
        output_dir / "model",
        metadata={
            "stage": "distill",
            "teacher_model": str(teacher_model),
            "student_init": cfg.student.init,
            "student_param_ratio": metrics["student_param_ratio"],
        },
        dtype=export,
    )
    description = {
        "init": cfg.student.init,
        "sizes": student_sizes(cfg.student),
        "parameters": metrics["student_parameters"],
        "layer_pairs": pairs,
        **(plan.summary() if plan is not None else {}),
    }
    (output_dir / "student.json").write_text(json.dumps(description, indent=2) + "\n")
    with (output_dir / "eval_predictions.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def record_encoder(encoder: ConversationEncoder, records: list[dict], data_dir: Path):
    """(index, turns=None, **kw) -> the encoded record (its own turns unless others are given); images cached."""
    image = DecodedImages(data_dir)

    def encode(i: int, turns: list[dict] | None = None, **kw):
        r = records[i]
        return encoder.encode(turns or r["turns"], images=[image(p) for p in r["images"]], sample_id=r["id"], **kw)

    return encode


def prepare_student(cfg: DistillConfig, teacher, processor, encode, n_records: int):
    """(student in fp32, prune plan or None, matched (student, teacher) layer pairs); the teacher ends in its
    training dtype, with eager attention on both when attention maps are matched."""
    device = resolve_device(cfg.train.device)
    teacher_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        cfg.teacher_dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )

    def calibration():
        order = np.random.default_rng(cfg.seed).permutation(n_records)[: cfg.student.calibration_samples]
        samples = [encode(int(i)) for i in order]
        for group in plan_micro_batches([s.num_tokens for s in samples], cfg.train.max_tokens_per_micro_batch):
            yield pack([samples[i] for i in group])

    teacher.to(device)  # calibrate on the accelerator, in fp32: the importance ranks decide what the student keeps
    student, plan = build_student(cfg, teacher, processor, calibration)
    student.to(torch.float32)  # fp32 master weights whatever the teacher's dtype
    teacher.to(dtype=teacher_dtype)
    pairs = layer_map(
        qwen_model(student).config.text_config.num_hidden_layers,
        qwen_model(teacher).config.text_config.num_hidden_layers,
        plan.lm_layers if plan is not None else None,
    )
    if cfg.loss.hidden:
        attach_projections(student, teacher, pairs, plan)
    if cfg.loss.attention:  # attention maps are only returned by the eager kernels
        teacher.set_attn_implementation("eager")
        student.set_attn_implementation("eager")
    return student, plan, pairs


def make_loss(cfg: DistillConfig, teacher, pairs: list[tuple[int, int]]):
    """The TrainLoop loss: the frozen teacher scores the packed rows, the student matches it (losses.py)."""
    flags = {"output_hidden_states": bool(cfg.loss.hidden), "output_attentions": bool(cfg.loss.attention)}

    def loss_fn(model, batch: dict, micro: list) -> tuple[torch.Tensor, int, dict[str, float]]:
        with torch.no_grad():
            teacher_out = forward_outputs(teacher, batch, lm_head=False, **flags)
        student_out = forward_outputs(model, batch, lm_head=False, **flags)
        data_answer = torch.cat([torch.full((s.num_tokens,), not s.meta.get("on_policy", False)) for s in micro])
        return distillation_loss(
            student_out,
            teacher_out,
            batch,
            weights=cfg.loss,
            pairs=pairs,
            projections=getattr(model, "distill_projections", None),
            data_answer=data_answer,
            heads=(output_head(model), output_head(teacher)),
            chunk_rows=cfg.train.loss_chunk_tokens,
        )

    return loss_fn


def on_policy_batches(cfg: DistillConfig, records: list[dict], encode, encoder):
    """The step's samples; the first `on_policy.fraction` of them answered by the current student (`model`)."""

    def sample_batch(indices: list[int], model) -> list:
        on = round(cfg.on_policy.fraction * len(indices))
        samples = [encode(i) for i in indices[on:]]
        if not on:
            return samples
        prompts, contexts = [], []
        for i in indices[:on]:
            turns = records[i]["turns"]
            last = max(k for k, t in enumerate(turns) if t["role"] == "assistant")
            contexts.append(turns[:last])
            prompts.append(encode(i, turns[:last], add_generation_prompt=True))
        was_training = model.training
        model.eval()
        answers = E.generate_completions(
            model,
            encoder,
            prompts,
            batch_size=cfg.eval.batch_size,
            max_new_tokens=cfg.on_policy.max_new_tokens,
            temperature=cfg.on_policy.temperature,
        )
        model.train(was_training)
        generated = [
            encode(i, [*context, {"role": "assistant", "text": answer}], meta={"on_policy": True})
            for i, context, answer in zip(indices[:on], contexts, answers, strict=True)
        ]
        return generated + samples

    return sample_batch


def _plain_student(cfg: DistillConfig, config, teacher, pairs: list[tuple[int, int]]):
    """A fresh student module of `config` (for DeepSpeed's fp32 weights), with projections if training used them."""
    from transformers import AutoModelForImageTextToText

    student = AutoModelForImageTextToText.from_config(config, attn_implementation=lm_attention(config))
    enable_vision_varlen(student)
    if cfg.loss.hidden:
        attach_projections(student, teacher, pairs, None)
    return student


def _for_export(cfg: DistillConfig, student, teacher):
    """The student as it is exported and scored: a plain Qwen model (no training-only projections), its family's
    packed attention."""
    if hasattr(student, "distill_projections"):
        del student.distill_projections
    if cfg.loss.attention:
        for model in (student, teacher):
            model.set_attn_implementation(lm_attention(model))
            enable_vision_varlen(model)
    student.eval()
    return student


PER_TASK = ("exact_match/", *T.PER_DATA)  # the per-task and per-benchmark scores of the suite


def comparison(teacher, student, teacher_summary: dict[str, float], evals: list[dict]) -> dict[str, Any]:
    """Sizes and held-out scores of teacher and student (the student's from its first and last eval)."""
    before, after = evals[0], evals[-1]
    teacher_params, student_params = count_parameters(teacher), count_parameters(student)
    teacher_score, student_score = teacher_summary.get("vqa_exact_match", 0.0), after.get("vqa_exact_match", 0.0)
    return {
        "teacher_parameters": teacher_params,
        "student_parameters": student_params,
        "student_param_ratio": round(student_params / teacher_params, 4),
        "student_score_ratio": round(student_score / teacher_score, 4) if teacher_score else 0.0,
        "student_vqa_exact_match_init": before.get("vqa_exact_match", 0.0),
        "heldout_kl_init": before.get("heldout_kl", float("nan")),
        "heldout_kl_final": after.get("heldout_kl", float("nan")),
        **{f"teacher_{k}": teacher_summary[k] for k in SUITE_KEYS if k in teacher_summary},
        **{f"student_{k}": after[k] for k in SUITE_KEYS if k in after},
        **{f"teacher_{k}": v for k, v in teacher_summary.items() if k.startswith(PER_TASK)},
        **{f"student_{k}": v for k, v in after.items() if k.startswith(PER_TASK)},
    }


def report(metrics: dict[str, Any]) -> str:
    lines = [
        "# Distillation",
        "",
        f"Student ({metrics['student_init']} init): {metrics['student_parameters']:,} parameters = "
        f"{metrics['student_param_ratio']:.2f} x the teacher's {metrics['teacher_parameters']:,}; "
        f"{metrics['steps']} steps, loss {metrics['train_loss_first']:.3f} -> {metrics['train_loss_final']:.3f}.",
        f"Held-out VQA exact match: teacher {metrics.get('teacher_vqa_exact_match', 0):.3f}, student "
        f"{metrics.get('student_vqa_exact_match', 0):.3f} (at init {metrics['student_vqa_exact_match_init']:.3f})"
        f" = {metrics['student_score_ratio']:.2f} x the teacher; generation {metrics['student_speedup']:.2f}x "
        "faster.",
        "",
        "| metric | teacher | student |",
        "|---|---|---|",
    ]
    extra = sorted(
        {k.removeprefix("teacher_") for k in metrics if k.startswith(("teacher_task/", "teacher_benchmark/"))}
    )
    keys = [*SUITE_KEYS[1:], *(f"exact_match/{t}" for t in T.SYNTHETIC_TASKS), *extra]
    for k in keys:
        if f"teacher_{k}" in metrics and f"student_{k}" in metrics:
            lines.append(f"| {k} | {metrics[f'teacher_{k}']:.3f} | {metrics[f'student_{k}']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(DistillConfig, run, section="distill", inputs=("teacher_model", "data"), argv=argv)
