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

import functools
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components._shared.eval import evaluation as E
from components._shared.eval import metrics as M
from components._shared.eval import readers
from components._shared.model import checkpoint as ckpt
from components._shared.model.attention import PACKED_SDPA
from components._shared.model.checkpoint import CheckpointStore
from components._shared.model.packing import (
    IGNORE_INDEX,
    ConversationEncoder,
    forward_outputs,
    pack,
    plan_micro_batches,
    to_device,
)
from components._shared.model.training import Phase, TrainLoop, is_main_process, resolve_device
from components._shared.model.vlm import count_parameters, load_vlm, qwen_model, save_vlm, set_pixel_bounds
from components._shared.platform.reports import figure, history_series
from components._shared.platform.tracking import Tracker
from components.distill.config import DistillConfig, StudentConfig
from components.distill.losses import distillation_loss, layer_map, logit_kl
from components.distill.prune import PrunePlan, measure_importance, plan_pruning, prune

SUITE_KEYS = ("vqa_exact_match", "grounding_accuracy", "anls", "cider_d")


def _sizes(cfg: StudentConfig) -> dict[str, int]:
    return {
        k: getattr(cfg, k)
        for k in (
            "layers",
            "hidden",
            "intermediate",
            "kv_heads",
            "vision_depth",
            "vision_hidden",
            "vision_intermediate",
        )
    }


def build_student(cfg: DistillConfig, teacher, processor, calibration) -> tuple[Any, PrunePlan | None]:
    """(student model, prune plan or None) as config `student` says; `calibration()` yields packed batches."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(cfg.seed)
    s = cfg.student
    if s.init == "model":
        student, student_processor = load_vlm(s.model_uri)
        _check_compatible(student, student_processor, teacher, processor, s.model_uri)
        return student, None
    importance = measure_importance(teacher, calibration())
    plan = plan_pruning(teacher, importance, **_sizes(s))
    if s.init == "prune":
        return prune(teacher, plan), plan
    student = AutoModelForImageTextToText.from_config(plan.config, attn_implementation=PACKED_SDPA)  # random weights
    student.generation_config = teacher.generation_config
    return student, None


def _check_compatible(student, student_processor, teacher, processor, uri: str) -> None:
    """A student checkpoint must share the teacher's vocabulary and image tokenisation (logits are compared
    token by token, and both models read the same packed rows)."""
    s, t = qwen_model(student).config, qwen_model(teacher).config
    if (
        student_processor.tokenizer.get_vocab() != processor.tokenizer.get_vocab()
        or s.text_config.vocab_size != t.text_config.vocab_size
    ):
        raise ValueError(
            f"distill.student.model_uri={uri!r} has another tokenizer / vocabulary than the teacher; "
            "logit distillation needs the same one (use a checkpoint of the teacher's family)."
        )
    for key in ("patch_size", "spatial_merge_size", "temporal_patch_size"):
        if getattr(s.vision_config, key) != getattr(t.vision_config, key):
            raise ValueError(
                f"distill.student.model_uri={uri!r}: vision {key} {getattr(s.vision_config, key)} != the "
                f"teacher's {getattr(t.vision_config, key)}; both must tokenise images the same way."
            )
    for key in ("image_token_id", "vision_start_token_id"):
        if getattr(s, key) != getattr(t, key):
            raise ValueError(f"distill.student.model_uri={uri!r}: {key} differs from the teacher's.")


def attach_projections(student, teacher, pairs: list[tuple[int, int]], plan: PrunePlan | None) -> None:
    """Learned maps student hidden -> teacher hidden, one per matched layer, on the student (so the optimizer and
    checkpoints include them); a pruned student's start at the channel selection it was cut with."""
    hs = qwen_model(student).config.text_config.hidden_size
    ht = qwen_model(teacher).config.text_config.hidden_size
    layers = torch.nn.ModuleList(torch.nn.Linear(hs, ht, bias=False) for _ in pairs)
    if plan is not None:
        with torch.no_grad():
            for layer in layers:
                layer.weight.zero_()
                layer.weight[plan.lm_channels, torch.arange(hs)] = 1.0
    student.distill_projections = layers.to(next(student.parameters()).dtype)


def heldout_eval(model, encoder, records: list[dict], cfg: DistillConfig) -> tuple[dict[str, float], list[dict], float]:
    """(suite metrics, per-record rows, seconds spent generating)."""
    started = time.perf_counter()
    summary, rows = E.evaluate_vqa(
        model, encoder, records, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens
    )
    return summary, rows, time.perf_counter() - started


@torch.no_grad()
def heldout_kl(student, teacher, samples: list, *, temperature: float, max_tokens: int) -> float:
    """Mean per-token T^2 * KL(teacher_T || student_T) over the held-out answers, teacher-forced (what the
    training loss measures, on data the student never trained on)."""
    device = next(student.parameters()).device
    total, count = 0.0, 0
    for group in plan_micro_batches(
        [s.num_tokens for s in samples], max(max_tokens, max(s.num_tokens for s in samples))
    ):
        batch = to_device(pack([samples[i] for i in group]), device)
        valid = batch["targets"][0] != IGNORE_INDEX
        kl = logit_kl(
            forward_outputs(student, batch).logits[0][valid],
            forward_outputs(teacher, batch).logits[0][valid],
            temperature,
        )
        total, count = total + float(kl.sum()), count + int(valid.sum())
    return total / max(count, 1)


def run(
    cfg: DistillConfig, *, teacher_model: str, data: str, output_dir: str | Path, tracker: Tracker
) -> dict[str, Any]:
    """Distill the teacher into the configured student; returns teacher vs student scores, sizes and speed."""
    output_dir = Path(output_dir)
    data_dir = readers.resolve_data_dir(data, scratch=output_dir / ".scratch")
    records = readers.load_conversations(data_dir, cfg.max_records)
    eval_records = readers.load_eval_records(data_dir, per_type=cfg.eval.per_type)
    key = ckpt.fingerprint(cfg.model_dump(mode="json"), {"teacher_model": teacher_model, "data": data})
    device = resolve_device(cfg.train.device)
    teacher_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        cfg.teacher_dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    teacher, processor = load_vlm(teacher_model)
    teacher.requires_grad_(False).eval()
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    encoder = ConversationEncoder(
        processor, teacher, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    image = functools.lru_cache(maxsize=4096)(functools.partial(readers.load_image, data_dir))

    def encode(i: int, turns: list[dict] | None = None, **kw):
        r = records[i]
        return encoder.encode(turns or r["turns"], images=[image(p) for p in r["images"]], sample_id=r["id"], **kw)

    def calibration():
        order = np.random.default_rng(cfg.seed).permutation(len(records))[: cfg.student.calibration_samples]
        samples = [encode(int(i)) for i in order]
        for group in plan_micro_batches([s.num_tokens for s in samples], cfg.train.max_tokens_per_micro_batch):
            yield pack([samples[i] for i in group])

    teacher.to(device)  # calibrate on the accelerator, in fp32: the importance ranks decide what the student keeps
    student, plan = build_student(cfg, teacher, processor, calibration)
    student.to(torch.float32)  # fp32 master weights whatever the teacher's dtype
    teacher.to(dtype=teacher_dtype)
    student_layers = qwen_model(student).config.text_config.num_hidden_layers
    pairs = layer_map(
        student_layers,
        qwen_model(teacher).config.text_config.num_hidden_layers,
        plan.lm_layers if plan is not None else None,
    )
    if cfg.loss.hidden:
        attach_projections(student, teacher, pairs, plan)
    if cfg.loss.attention:  # attention maps are only returned by the eager kernels
        teacher.set_attn_implementation("eager")
        student.set_attn_implementation("eager")
    flags = {"output_hidden_states": bool(cfg.loss.hidden), "output_attentions": bool(cfg.loss.attention)}

    def loss_fn(model, batch: dict, micro: list) -> tuple[torch.Tensor, int, dict[str, float]]:
        with torch.no_grad():
            teacher_out = forward_outputs(teacher, batch, **flags)
        student_out = forward_outputs(model, batch, **flags)
        data_answer = torch.cat([torch.full((s.num_tokens,), not s.meta.get("on_policy", False)) for s in micro])
        return distillation_loss(
            student_out,
            teacher_out,
            batch,
            weights=cfg.loss,
            pairs=pairs,
            projections=getattr(model, "distill_projections", None),
            data_answer=data_answer,
        )

    def sample_batch(indices: list[int]) -> list:
        """The step's samples; the first `on_policy.fraction` of them answered by the current student."""
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
        model = loop.backend.module
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

    kl_samples = E.answer_samples(encoder, eval_records, [r["answer"] for r in eval_records])
    final_rows: list[dict] = []
    eval_seconds: list[float] = []

    def evaluate(step: int) -> dict[str, float]:
        summary, rows, seconds = heldout_eval(loop.backend.module, encoder, eval_records, cfg)
        final_rows[:] = rows
        eval_seconds.append(seconds)
        kl = heldout_kl(
            loop.backend.module,
            teacher,
            kl_samples,
            temperature=cfg.loss.temperature,
            max_tokens=cfg.train.max_tokens_per_micro_batch,
        )
        return {
            "heldout_kl": kl,
            **{k: v for k, v in summary.items() if k in SUITE_KEYS or k.startswith("exact_match/")},
        }

    loop = TrainLoop(
        student,
        train=cfg.train,
        optim=cfg.optim,
        schedule=cfg.schedule,
        sample=encode,
        phases=[Phase("all", cfg.train.steps, list(range(len(records))))],
        tracker=tracker,
        seed=cfg.seed,
        loss_fn=loss_fn,
        sample_batch=sample_batch,
        checkpoints=CheckpointStore(
            ckpt.location(cfg.train.checkpoint_uri, "distill", key, output_dir),
            keep=cfg.train.keep_checkpoints,
            scratch=output_dir / ".scratch",
        ),
    )
    result = loop.run(evaluate=evaluate)
    student = loop.backend.module
    if cfg.train.backend == "deepspeed":  # export a plain copy of the fp32 masters (ZeRO-3 partitions the module)
        from transformers import AutoModelForImageTextToText

        weights = loop.backend.full_state_dict()  # a collective: every rank takes part
        if not is_main_process():
            return {"rank": loop.backend.rank, "steps": result.steps}
        config = student.config
        student = AutoModelForImageTextToText.from_config(config, attn_implementation=PACKED_SDPA)
        if cfg.loss.hidden:
            attach_projections(student, teacher, pairs, None)
        student.load_state_dict(weights)
    if hasattr(student, "distill_projections"):  # training-only; the exported student is a plain Qwen model
        del student.distill_projections
    if cfg.loss.attention:
        student.set_attn_implementation(PACKED_SDPA)
        teacher.set_attn_implementation(PACKED_SDPA)
    student.eval()

    with torch.no_grad():
        teacher_summary, _, teacher_seconds = heldout_eval(teacher, encoder, eval_records, cfg)
        if not final_rows:  # resumed from the final checkpoint: its evals were restored, the predictions were not
            _, final_rows, seconds = heldout_eval(student, encoder, eval_records, cfg)
            eval_seconds.append(seconds)
    student_seconds = eval_seconds[-1]
    before, after = loop.evals[0], loop.evals[-1]
    teacher_params, student_params = count_parameters(teacher), count_parameters(student)
    teacher_score, student_score = teacher_summary.get("vqa_exact_match", 0.0), after.get("vqa_exact_match", 0.0)
    metrics: dict[str, Any] = {
        "student_init": cfg.student.init,
        "steps": result.steps,
        "resumed_from_step": result.resumed_from if result.resumed_from is not None else -1,
        "train_loss_first": result.history[0]["loss"] if result.history else float("nan"),
        "train_loss_final": result.history[-1]["loss"] if result.history else float("nan"),
        "teacher_parameters": teacher_params,
        "student_parameters": student_params,
        "student_param_ratio": round(student_params / teacher_params, 4),
        "student_score_ratio": round(student_score / teacher_score, 4) if teacher_score else 0.0,
        "student_vqa_exact_match_init": before.get("vqa_exact_match", 0.0),
        "heldout_kl_init": before.get("heldout_kl", float("nan")),
        "heldout_kl_final": after.get("heldout_kl", float("nan")),
        **{f"teacher_{k}": teacher_summary[k] for k in SUITE_KEYS if k in teacher_summary},
        **{f"student_{k}": after[k] for k in SUITE_KEYS if k in after},
        **{f"teacher_{k}": v for k, v in teacher_summary.items() if k.startswith("exact_match/")},
        **{f"student_{k}": v for k, v in after.items() if k.startswith("exact_match/")},
        "student_speedup": round(teacher_seconds / max(student_seconds, 1e-9), 3),
        "tokens_per_second": round(result.tokens / result.seconds, 1) if result.seconds else 0.0,
    }
    if is_main_process():
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
        )
        ckpt.write_pointer(output_dir, [loop.store.root])
        description = {
            "init": cfg.student.init,
            "sizes": _sizes(cfg.student),
            "parameters": student_params,
            "layer_pairs": pairs,
            **(plan.summary() if plan is not None else {}),
        }
        (output_dir / "student.json").write_text(json.dumps(description, indent=2) + "\n")
        with (output_dir / "eval_predictions.jsonl").open("w") as f:
            for row in final_rows:
                f.write(json.dumps(row) + "\n")
    text = report(metrics)
    if is_main_process():
        text += (
            "\n".join(
                [
                    *figure(
                        "train_loss",
                        "training loss and its parts",
                        history_series(result.history, ["loss", "kl", "ce", "hidden_mse", "attention_kl"]),
                        output_dir=output_dir,
                        tracker=tracker,
                        log_y=True,
                    ),
                    *figure(
                        "heldout",
                        "held-out KL to the teacher and student VQA",
                        history_series(result.evals, ["heldout_kl", "vqa_exact_match"]),
                        output_dir=output_dir,
                        tracker=tracker,
                    ),
                ]
            )
            + "\n"
        )
        (output_dir / "report.md").write_text(text)
    shutil.rmtree(output_dir / ".scratch", ignore_errors=True)
    tracker.log_text(text, "report.md")
    return metrics


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
    keys = [*SUITE_KEYS[1:], *(f"exact_match/{t}" for t in M.QUESTION_TYPES)]
    for k in keys:
        if f"teacher_{k}" in metrics and f"student_{k}" in metrics:
            lines.append(f"| {k} | {metrics[f'teacher_{k}']:.3f} | {metrics[f'student_{k}']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(DistillConfig, run, section="distill", inputs=("teacher_model", "data"), argv=argv)
