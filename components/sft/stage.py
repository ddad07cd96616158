"""sft: instruction-tune a Qwen2(.5)-VL on image conversations (LoRA, QLoRA or full), evaluate, calibrate.

1 process (CPU/tiny):  python -m components.sft --config pipelines/presets/tiny.yaml \
                           --base-model builtin:tiny-qwen2_5-vl --data runs/world/heldout --output-dir OUT/sft
N GPUs (DeepSpeed):    torchrun --nproc-per-node 8 -m components.sft --config pipelines/presets/prod-7b.yaml \
                           --base-model s3://bucket/pretrain/model --data s3://bucket/sft-data --output-dir s3://...
In the pipeline:       components/sft/component.py calls run_stage("sft", ...).

Data (`--data`): `sft.jsonl` ({"id", "image" | "images", "conversations": [{"from": "human"|"gpt", "value"}],
optional "difficulty"/"type"}, LLaVA / ShareGPT style, `<image>` placeholders) and `eval.jsonl` (held-out VQA).
Writes model/ (merged HF checkpoint: AutoModelForImageTextToText + AutoProcessor load it), adapter/ (LoRA/QLoRA),
checkpoints/ (resume), eval_predictions.jsonl, calibration.json and report.md.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from components._shared.data import datasets
from components._shared.data import tasks as T
from components._shared.data.curriculum import curriculum_problem
from components._shared.data.datasets import load_conversations as load_sft_records  # sft.jsonl reader (shared with rl)
from components._shared.data.image_cache import DecodedImages
from components._shared.data.overlap import held_out_overlap
from components._shared.data.record_images import say_small_images
from components._shared.eval import evaluation as E
from components._shared.model import checkpoint as ckpt
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.families import family_for
from components._shared.model.length_check import conversation_tokens, keep_trainable
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
from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop, is_main_process
from components._shared.model.vlm import (
    LoadedVlm,
    check_complete,
    checkpoint_dtype,
    count_parameters,
    export_dtype,
    freeze,
    load_vlm,
    save_vlm,
    set_pixel_bounds,
)
from components._shared.platform.reports import history_series
from components._shared.platform.tracking import Tracker
from components.sft.config import SftConfig

logger = logging.getLogger(__name__)


def build_model(cfg: SftConfig, base_model: str) -> LoadedVlm:
    """(model to train, processor, the base's stored dtype) for the configured mode."""
    torch.manual_seed(cfg.seed)  # LoRA init is part of the run's determinism (exact resume)
    model, processor, stored = _load_4bit(cfg, base_model) if cfg.mode == "qlora" else load_vlm(base_model)
    if cfg.mode == "full":
        freeze(model, tuple(cfg.freeze))
        return LoadedVlm(model, processor, stored)
    from peft import LoraConfig, get_peft_model

    # QLoRA: peft's prepare_model_for_kbit_training is not used; it only upcasts half-precision weights (the
    # trainable ones are fp32 here already) and its input-grad hook breaks bitsandbytes' CPU 4-bit path.
    family = family_for(model)
    targets = cfg.lora.target_modules or family.lora_targets
    required = cfg.lora.require_targets or family.lora_required
    if cfg.lora.target_modules:  # the defaults may list modules a variant lacks (MoE); lora_required guards them
        check_lora_targets(model, cfg.lora.target_modules, family.name)
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=lora_pattern(targets),
        bias="none",
    )
    model = get_peft_model(model, lora)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    missing = [frag for frag in required if not any(frag in n for n in adapted)]
    if missing:
        raise ValueError(
            f"LoRA targets {targets} gave no adapter on {missing}; fix lora.target_modules (this {family.name} "
            f"model's defaults: {family.lora_targets}) or lora.require_targets."
        )
    return LoadedVlm(model, processor, stored)


def lora_pattern(targets: list[str]) -> str:
    """One PEFT `target_modules` regex for `targets`: PEFT full-matches it on each module name, so a target matches
    a module name that ends with it (after any prefix such as "model.")."""
    return r".*(?:" + "|".join(f"(?:{t})" for t in targets) + r")"


def check_lora_targets(model, targets: list[str], family: str) -> None:
    """Fail on each `sft.lora.target_modules` pattern that matches no layer LoRA can adapt (Linear, Embedding, Conv;
    PEFT would skip it silently);
    each pattern is matched the way PEFT matches the combined one (peft's own check_target_module_exists)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    adaptable = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)  # PEFT's
    linear = [n for n, m in model.named_modules() if isinstance(m, adaptable)]
    unmatched = [
        t
        for t in targets
        if not any(check_target_module_exists(LoraConfig(target_modules=lora_pattern([t])), n) for n in linear)
    ]
    if unmatched:
        kinds = list(dict.fromkeys(re.sub(r"\.\d+\.", ".N.", n) for n in linear))  # one name per layer kind
        raise ValueError(
            f"sft.lora.target_modules: {unmatched} match no Linear, Embedding or Conv layer of this {family} model "
            "(each is a regex matched against the end of the module name); fix or remove them. Such layers here "
            f"(N = layer index): {kinds[:20]}{' ...' if len(kinds) > 20 else ''}."
        )


def _load_4bit(cfg: SftConfig, base_model: str):
    """The base in 4-bit (nf4, double quant) with the vision tower and lm_head kept in full precision.

    transformers 5 matches skip patterns from the start of the module name, so the tower is "model.visual".
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor, BitsAndBytesConfig

    from components._shared.model.attention import enable_vision_varlen
    from components._shared.model.attention import register as packed_attention
    from components._shared.model.sources import resolve_model

    path = resolve_model(base_model)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.qlora.quant_type,
        bnb_4bit_use_double_quant=cfg.qlora.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, cfg.qlora.compute_dtype),
        llm_int8_skip_modules=["model.visual", "lm_head"],
    )
    model, loading = AutoModelForImageTextToText.from_pretrained(
        path,
        quantization_config=quant,
        use_safetensors=True,
        trust_remote_code=False,
        dtype=torch.float32,
        attn_implementation=packed_attention(),
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported in `loading` for check_complete's message, not raised mid-load
    )
    check_complete(base_model, loading)
    enable_vision_varlen(model)
    for module in model.modules():
        # bitsandbytes repacks 4-bit weights in place for CPU inference (eval mode, no grad) and training on a
        # repacked weight then fails; held-out evals run between training steps, so keep the trainable layout.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return LoadedVlm(model, AutoProcessor.from_pretrained(path, trust_remote_code=False), checkpoint_dtype(path))


def quick_eval_set(eval_records: list[dict], size: int) -> list[dict]:
    """Up to `size` non-caption held-out questions, taken round-robin over question types (eval.jsonl is grouped
    by type, so a plain prefix would hold one type only)."""
    by_type: dict[str, list[dict]] = defaultdict(list)
    for r in eval_records:
        if r["type"] != "caption":
            by_type[r["type"]].append(r)
    picked: list[dict] = []
    for round_ in range(max((len(v) for v in by_type.values()), default=0)):
        picked += [rows[round_] for rows in by_type.values() if round_ < len(rows)]
    return picked[:size]


def quick_key(key: str) -> bool:
    """A per-task score of the quick eval (exact_match/<builtin task>, task/<task>)."""
    return key.startswith(("exact_match/", "task/")) and key.count("/") == 1


def type_weights(cfg: SftConfig, records: list[dict], pool: list[int]):
    """The difficulty scheduler's weights over `pool`, from the latest quick eval's per-type exact match."""
    counts: dict[str, int] = defaultdict(int)
    for i in pool:
        counts[records[i]["type"]] += 1

    def weights(evals: list[dict]):
        if not cfg.difficulty_scheduler.enabled or not evals:
            return None
        latest, sched = evals[-1], cfg.difficulty_scheduler
        scores = {k.split("/")[1]: v for k, v in latest.items() if quick_key(k)}
        measured = {t: sched.floor + (1.0 - scores[t]) ** sched.sharpness for t in counts if t in scores}
        if not measured:
            return None
        neutral = sum(measured.values()) / len(measured)  # types the quick eval does not measure (e.g. captions)
        per_type = {t: measured.get(t, neutral) for t in counts}
        return [per_type[records[i]["type"]] / counts[records[i]["type"]] for i in pool]

    return weights


def phases_for(cfg: SftConfig, records: list[dict]) -> list[Phase]:
    if not cfg.curriculum:
        pool = list(range(len(records)))
        return [Phase("all", cfg.train.steps, pool, weights=type_weights(cfg, records, pool))]
    problem = curriculum_problem([p.model_dump() for p in cfg.curriculum], Counter(r["difficulty"] for r in records))
    if problem:
        raise ValueError(problem)
    phases = []
    for k, p in enumerate(cfg.curriculum):
        pool = [i for i, r in enumerate(records) if not p.difficulties or r["difficulty"] in p.difficulties]
        if not pool:
            raise ValueError(f"sft.curriculum[{k}] (phase '{p.name}') has no training records: the data is empty.")
        phases.append(Phase(p.name, p.steps, pool, p.lr_scale, weights=type_weights(cfg, records, pool)))
    return phases


def say_unbuilt(cfg: SftConfig, data: str, data_dir: Path) -> None:
    """build_data.enabled adds the DAG's sft_data step; a stage run on its own builds nothing (said, not silent)."""
    from components.sft.build_data import DROPPED

    if cfg.build_data.enabled and not (data_dir / DROPPED).is_file():
        print(
            f"warning: build_data.enabled is true but --data {data} is not the sft_data step's output (it has no "
            f"{DROPPED}): this run trains on --data as given. The builder runs as the DAG's sft_data step, or alone: "
            "qvl stage sft_data --clean-data ... --base-model ... --data ... --output-dir BUILT; then --data BUILT.",
            flush=True,
        )


def run(cfg: SftConfig, *, base_model: str, data: str, output_dir: str | Path, tracker: Tracker) -> dict[str, Any]:
    """Fine-tune, evaluate against the majority baseline, calibrate, save; returns the stage metrics."""
    check_not_reward_model(base_model, "--base-model", expected="the pretrain stage's model/")
    output_dir = Path(output_dir)
    data_dir = datasets.resolve_data_dir(data, scratch=output_dir / SCRATCH)
    say_unbuilt(cfg, data, data_dir)
    records = load_sft_records(data_dir, cfg.max_records)
    eval_records = datasets.load_eval_records(data_dir, per_type=cfg.eval.per_type)
    overlap = held_out_overlap(records, eval_records, what="sft")
    say_small_images(records, cfg.min_pixels, "sft")
    store = checkpoint_store("sft", cfg.train, run_key(cfg, {"base_model": base_model, "data": data}), output_dir)
    model, processor, stored_dtype = build_model(cfg, base_model)
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    encoder = ConversationEncoder(
        processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    budget = cfg.train.max_tokens_per_micro_batch
    records = keep_trainable(records, conversation_tokens(encoder, budget), budget=budget, what="conversation")
    loop, quick_eval = build_loop(cfg, model, encoder, records, eval_records, data_dir, store, tracker)
    trainable = count_parameters(model, trainable_only=True)
    tracker.log_params({"trainable_parameters": trainable, "records": len(records)})
    result = loop.run(evaluate=quick_eval)
    trained = trained_module(loop, lambda: build_model(cfg, base_model)[0])
    if trained is None:  # DeepSpeed ranks > 0: rank 0 evaluates and exports
        return {"rank": loop.backend.rank, "steps": result.steps}
    trained.eval()
    with torch.no_grad():
        summary, rows = E.evaluate_vqa(
            trained, encoder, eval_records, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens
        )
        calibration = calibrate(cfg, trained, encoder, eval_records, rows) if cfg.calibration.enabled else {}
        export = export_dtype(cfg.train.export_dtype, stored_dtype)
        fitted = {"confidence_temperature": calibration["temperature"]} if "temperature" in calibration else {}
        saved = save_outputs(
            cfg, trained, processor, base_model, output_dir, encoder, eval_records[:4], export, meta_extra=fitted
        )
    ckpt.write_pointer(output_dir, [store.root])
    with (output_dir / "eval_predictions.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    (output_dir / "calibration.json").write_text(json.dumps(calibration, indent=2))
    metrics = {
        "mode": cfg.mode,
        **loop_metrics(result),
        "trainable_parameters": trainable,
        **{  # the quick set's first score: none where the held-out data has no builtin VQA task (real benchmarks)
            f"{k}_initial": v for k, v in (result.evals or [{}])[0].items() if k == "vqa_exact_match"
        },
        **summary,
        **T.majority_baseline(train_answers(records), rows),
        **calibration,
        **saved,
        **({"data/held_out_overlap": overlap} if overlap else {}),
    }
    figures = [
        Figure("train_loss", "training loss", history_series(result.history, ["loss"]), log_y=True),
        Figure("quick_eval", "held-out VQA exact match (quick set)", history_series(result.evals, ["vqa_exact_match"])),
    ]
    finish_report(output_dir, tracker, report(metrics), figures, set_aside=result.set_aside)
    return metrics


def build_loop(
    cfg: SftConfig, model, encoder, records: list[dict], eval_records: list[dict], data_dir: Path, store, tracker
) -> tuple[TrainLoop, Callable[[int, Any], dict[str, float]]]:
    """The TrainLoop over the SFT records (images decoded on demand, a bounded cache) and its quick evaluation."""

    image = DecodedImages(data_dir)  # bounded by bytes: a real SFT set does not fit in memory decoded

    def sample(i: int):
        r = records[i]
        return encoder.encode(r["turns"], images=[image(p) for p in r["images"]], sample_id=r["id"])

    quick = quick_eval_set(eval_records, 8 * cfg.eval.batch_size)

    def evaluate(step: int, model) -> dict[str, float]:
        summary, _ = E.evaluate_vqa(
            model, encoder, quick, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens
        )
        return {k: v for k, v in summary.items() if k == "vqa_exact_match" or quick_key(k)}

    data = LoopData(phases=phases_for(cfg, records), sample=sample)
    return TrainLoop(model, LoopSettings.of(cfg), data, store, tracker=tracker), evaluate


def train_answers(records: list[dict]) -> dict[str, list[str]]:
    """The last assistant answer of each training record, by task (the majority baseline's input)."""
    answers: dict[str, list[str]] = defaultdict(list)
    for r in records:
        if r["type"] != "unknown":
            answers[r["type"]].append(next(t["text"] for t in reversed(r["turns"]) if t["role"] == "assistant"))
    return answers


MIN_CALIBRATION_SIDE = 20  # answers to fit a temperature on, and to measure it on


def calibrate(cfg: SftConfig, model, encoder, eval_records: list[dict], rows: list[dict]) -> dict[str, float]:
    """ECE of the short answers' confidences (sequence probabilities) on the held-out questions; with
    `calibration.fit_temperature`, a temperature fitted on one part of them and ECE before/after on the rest."""
    picked = [(r, row) for r, row in zip(eval_records, rows, strict=True) if r["type"] != "caption"]
    if not picked:
        logger.warning(
            "sft: calibration skipped: the held-out questions have no short answer to measure; calibration.json is "
            "empty. Give held-out questions other than captions, or calibration.enabled: false."
        )
        return {}
    shown = [encoder.template.shown_answer(w["prediction"]) for _, w in picked]  # a stray </think> (Qwen3.5 on)
    pairs = E.answer_logits(model, E.answer_samples(encoder, [r for r, _ in picked], shown))
    correct = [w["score"] for _, w in picked]
    measured = {"ece": round(E.expected_calibration_error(E.confidences(pairs, 1.0), correct), 4)}
    if not cfg.calibration.fit_temperature:
        return {**measured, "calibration_answers": len(picked)}
    cut = max(1, int(len(picked) * cfg.calibration.fraction))
    fit_idx = [i for i in range(len(picked)) if (i * 7919) % len(picked) < cut]  # spread over question types
    test_idx = [i for i in range(len(picked)) if i not in set(fit_idx)]
    if min(len(fit_idx), len(test_idx)) < MIN_CALIBRATION_SIDE:
        enough = len(picked) >= 2 * MIN_CALIBRATION_SIDE  # then another fraction would split it
        logger.warning(
            "sft: no temperature fitted: calibration.fraction=%g splits %d short answers into %d to fit and %d to "
            "measure; each side needs %d. %s",
            cfg.calibration.fraction,
            len(picked),
            len(fit_idx),
            len(test_idx),
            MIN_CALIBRATION_SIDE,
            "Give a fraction nearer 0.5, or more held-out questions (eval.per_type)."
            if enough
            else f"Give at least {2 * MIN_CALIBRATION_SIDE} short held-out answers (eval.per_type).",
        )
        return {**measured, "calibration_answers": len(picked)}
    fitted, _ = E.fit_temperature([pairs[i] for i in fit_idx], [correct[i] for i in fit_idx])
    test_pairs, test_correct = [pairs[i] for i in test_idx], [correct[i] for i in test_idx]
    before = round(E.expected_calibration_error(E.confidences(test_pairs, 1.0), test_correct), 4)
    after = round(E.expected_calibration_error(E.confidences(test_pairs, fitted), test_correct), 4)
    if after >= before:  # shipped only where it lowers ECE on the answers it was not fitted on
        logger.warning(
            "sft: the fitted temperature %g did not lower ECE on the %d answers it was not fitted on (%.4f -> %.4f): "
            "not applied; the model keeps temperature 1.",
            fitted,
            len(test_idx),
            before,
            after,
        )
    elif fitted in (E.TEMPERATURE_GRID[0], E.TEMPERATURE_GRID[-1]):
        logger.warning("sft: the fitted temperature %g is at the grid's edge; the best may lie beyond it.", fitted)
    return {
        **measured,
        "temperature": fitted if after < before else 1.0,
        "temperature_fitted": fitted,
        "ece_before": before,
        "ece_after": min(after, before),
        "calibration_fit_answers": len(fit_idx),
        "calibration_test_answers": len(test_idx),
    }


def save_outputs(
    cfg: SftConfig,
    model,
    processor,
    base_model: str,
    output_dir: Path,
    encoder,
    probe: list[dict],
    export,
    meta_extra: dict[str, Any],
) -> dict[str, float]:
    """adapter/ (LoRA modes) and model/ (merged, HF format, weights in `export`, `meta_extra` in its
    qvl_model.json: a fitted confidence temperature travels with the model); checks that merging kept the logits."""
    meta = {"stage": "sft", "mode": cfg.mode, "base_model": str(base_model), **meta_extra}
    if cfg.mode == "full":
        if is_main_process():
            save_vlm(model, processor, output_dir / "model", metadata=meta, dtype=export)
        return {}
    if is_main_process():
        model.save_pretrained(output_dir / "adapter", safe_serialization=True)
    samples = E.answer_samples(encoder, probe, [r["answer"] for r in probe])
    before = E.answer_logits(model, samples)
    if cfg.mode == "qlora":  # merge into the full-precision base, the way QLoRA adapters are deployed
        from peft import PeftModel

        base = load_vlm(base_model).model
        merged = PeftModel.from_pretrained(base, output_dir / "adapter").merge_and_unload()
    else:
        merged = model.merge_and_unload()
    after = E.answer_logits(merged, samples)
    diff = max(float((a[0] - b[0]).abs().max()) for a, b in zip(before, after, strict=True))
    if is_main_process():
        save_vlm(
            merged,
            processor,
            output_dir / "model",
            metadata={**meta, "merged_adapter": True},
            dtype=export,
        )
    return {"merge_max_abs_logit_diff": diff}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def task_keys(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """(task, its score's metric key) in report order: the synthetic world's, then the others by name."""
    builtin = [(t, f"exact_match/{t}") for t in T.SYNTHETIC_TASKS if f"exact_match/{t}" in metrics]
    others = sorted((k.split("/")[1], k) for k in metrics if k.startswith("task/") and k.count("/") == 1)
    return builtin + others


def report(metrics: dict[str, Any]) -> str:
    lines = [
        "# SFT",
        "",
        f"mode: {metrics['mode']}, steps: {metrics['steps']}, train loss "
        f"{metrics['train_loss_first']:.3f} -> {metrics['train_loss_final']:.3f}",
        "",
        "| task | score | majority baseline | n |",
        "|---|---|---|---|",
    ]
    for t, key in task_keys(metrics):
        lines.append(
            f"| {t} | {metrics[key]:.3f} | {_cell(metrics.get(f'majority/{t}'))} | "
            f"{int(metrics.get(f'count/{t}', 0))} |"
        )
    benchmarks = sorted(k.split("/")[1] for k in metrics if k.startswith("benchmark/") and k.count("/") == 1)
    if benchmarks:
        lines += ["", "| benchmark | score | n |", "|---|---|---|"]
        lines += [
            f"| {b} | {metrics[f'benchmark/{b}']:.3f} | {int(metrics[f'benchmark/{b}/count'])} |" for b in benchmarks
        ]
    lines += [
        "",
        f"VQA exact match {metrics.get('vqa_exact_match', 0):.3f} vs majority baseline "
        f"{metrics.get('vqa_majority_baseline', 0):.3f}; grounding {metrics.get('grounding_accuracy', 0):.3f}, "
        f"ANLS {metrics.get('anls', 0):.3f}, CIDEr-D {metrics.get('cider_d', 0):.3f}.",
    ]
    if "ece_before" in metrics:
        lines.append(f"Calibration: T={metrics['temperature']}, ECE {metrics['ece_before']} -> {metrics['ece_after']}.")
    elif "ece" in metrics:
        lines.append(f"Calibration: ECE {metrics['ece']} on {metrics['calibration_answers']} short answers.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(SftConfig, run, section="sft", inputs=("base_model", "data"), argv=argv)
