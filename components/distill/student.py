"""The distillation student: a pruned teacher, a random init of the pruned sizes, or a given checkpoint of the
teacher's family; and the learned hidden-state projections the hidden-matching loss trains on it."""

from __future__ import annotations

from typing import Any

import torch

from components._shared.model.attention import enable_vision_varlen
from components._shared.model.families import family_for
from components._shared.model.sources import resolve_model
from components._shared.model.vlm import build_student as random_student
from components._shared.model.vlm import checkpoint_dtype, count_parameters, lm_attention, load_vlm, qwen_model
from components.distill.config import STUDENT_SIZES, DistillConfig, StudentConfig
from components.distill.prune import PrunePlan, measure_importance, plan_pruning, prune


def student_sizes(cfg: StudentConfig) -> dict[str, int]:
    return {k: getattr(cfg, k) for k in STUDENT_SIZES}


def student_stored_dtype(cfg: DistillConfig, teacher_stored: torch.dtype) -> torch.dtype:
    """What `export_dtype: checkpoint` writes the student in: a loaded student's own checkpoint dtype, a new
    (pruned or random) one the teacher checkpoint's."""
    if cfg.student.init != "model":
        return teacher_stored
    return checkpoint_dtype(resolve_model(str(cfg.student.model_uri)))


def build_student(cfg: DistillConfig, teacher, processor, calibration) -> tuple[Any, PrunePlan | None]:
    """(student model, prune plan or None) as config `student` says; `calibration()` yields packed batches. A student
    with as many parameters as the teacher is refused: it would be the teacher distilled into itself."""
    student, plan = _build(cfg, teacher, processor, calibration)
    counts = count_parameters(student), count_parameters(teacher)
    if cfg.student.init != "model" and counts[0] >= counts[1]:
        sizes = {k: v for k, v in student_sizes(cfg.student).items() if v}
        raise ValueError(
            f"distill.student sizes {sizes or '(none given)'} build a student of {counts[0]:,} parameters, not fewer "
            f"than the teacher's {counts[1]:,}: these are the teacher's own sizes (a size of 0 keeps the teacher's), "
            "so it would be distilled into itself. Give smaller student.layers / hidden / intermediate / vision_*."
        )
    return student, plan


def _build(cfg: DistillConfig, teacher, processor, calibration) -> tuple[Any, PrunePlan | None]:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(cfg.seed)
    s = cfg.student
    if s.init == "model":
        student, student_processor, _ = load_vlm(s.model_uri)
        _check_compatible(student, student_processor, teacher, processor, s.model_uri)
        counts = count_parameters(student), count_parameters(teacher)
        if counts[0] >= counts[1]:
            raise ValueError(
                f"distill.student.model_uri={s.model_uri!r} has {counts[0]:,} parameters, not fewer than the teacher's "
                f"{counts[1]:,} (the teacher itself?): distillation makes a smaller model; give a smaller checkpoint, "
                "or init: prune / random with the student sizes."
            )
        return student, None
    family = family_for(teacher)
    if not family.prunable:
        if s.init == "prune":
            raise ValueError(
                f"distill.student.init=prune: structured pruning knows the Qwen2-VL / Qwen2.5-VL layouts, not this "
                f"{family.name} teacher's; set distill.student.init: random (same sizes) or model."
            )
        sizes = {k: v or None for k, v in student_sizes(s).items()}
        sizes["layers"] = sizes["layers"] or qwen_model(teacher).config.text_config.num_hidden_layers
        student = random_student(qwen_model(teacher).config, **sizes)
        student.generation_config = teacher.generation_config
        return student, None
    importance = measure_importance(teacher, calibration())
    try:
        plan = plan_pruning(teacher, importance, **student_sizes(s))
    except ValueError as err:
        if s.init != "random":
            raise
        raise ValueError(
            f"{err} (init: random builds the student in the teacher's layout cut to these sizes, as pruning would, "
            "so the same rules hold; or give a student checkpoint with init: model)"
        ) from None
    if s.init == "prune":
        return prune(teacher, plan), plan
    student = AutoModelForImageTextToText.from_config(plan.config, attn_implementation=lm_attention(plan.config))
    enable_vision_varlen(student)
    student.generation_config = teacher.generation_config
    return student, None


def _check_compatible(student, student_processor, teacher, processor, uri: str) -> None:
    """A student checkpoint must share the teacher's vocabulary and image tokenisation (logits are compared
    token by token, and both models read the same packed rows)."""
    s, t = qwen_model(student).config, qwen_model(teacher).config
    if student_processor.tokenizer.get_vocab() != processor.tokenizer.get_vocab():
        raise ValueError(
            f"distill.student.model_uri={uri!r} has another tokenizer / vocabulary than the teacher; "
            "logit distillation needs the same one (use a checkpoint of the teacher's family)."
        )
    tokens = len(processor.tokenizer)  # embedding widths may differ (padding rows): logits compare over the tokens
    for name, config in (("student", s), ("teacher", t)):
        if config.text_config.vocab_size < tokens:
            raise ValueError(
                f"the {name}'s vocab_size {config.text_config.vocab_size} is smaller than its tokenizer ({tokens} "
                "tokens); the checkpoint is inconsistent."
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
    family = family_for(student)
    ts, tt = qwen_model(student).config.text_config, qwen_model(teacher).config.text_config
    widths = [(family.hidden_state_width(ts, s), family.hidden_state_width(tt, t)) for s, t in pairs]
    layers = torch.nn.ModuleList(torch.nn.Linear(ws, wt, bias=False) for ws, wt in widths)
    if plan is not None:
        hs = ts.hidden_size
        with torch.no_grad():
            for layer in layers:
                layer.weight.zero_()
                layer.weight[plan.lm_channels, torch.arange(hs)] = 1.0
    student.distill_projections = layers.to(next(student.parameters()).dtype)
