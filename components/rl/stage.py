"""rl: optimise the SFT policy on verifiable prompts with PPO, TER or GRPO, guarded by reward-hacking gates.

1 process (CPU/tiny):  python -m components.rl --config pipelines/presets/tiny.yaml --base-model OUT/sft/model \
                           --reward-model OUT/reward_model/model --data runs/world/heldout --output-dir OUT/rl
                       (--reward-model only when rl.rewards weights reward_model)
In the pipeline:       components/rl/component.py calls run_stage("rl", ...).

Each step: sample completions of `train.samples_per_step` prompts from the current policy (rollout engine),
score them with the configured reward callables (weighted sum), compute log-probabilities under the policy and
the frozen reference (the SFT model) and, for PPO, values; turn rewards into per-token advantages
(PPO: normalised + clipped score with a per-token KL penalty, GAE; TER: efficacy minus an EMA baseline;
GRPO: group-relative), then run `update.epochs` x `update.minibatches` optimizer steps through the shared
TrainLoop machinery (packed micro-batches, per-group AdamW, checkpoints). The monitors (KL to the reference,
mean length vs the first step, entropy, training reward vs held-out efficacy) are logged every step and
fail the stage through the gates; PPO also stops early (keeping its policy) past `ppo.kl_stop`.

Data (`--data`): the prompts file (default sft.jsonl; first human turn = prompt with one image, first gpt turn
= reference answer, `type` = question type) and eval.jsonl (held-out efficacy). Writes model/ (the policy, HF
format), value_head.safetensors (PPO), eval_predictions.jsonl, rollouts.jsonl (the last step's samples with
their rewards, for inspection), report.md.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components._shared.data import datasets
from components._shared.data import metrics as M
from components._shared.data import tasks as T
from components._shared.data.file_checks import check_distinct_contents, same_file
from components._shared.data.image_cache import DecodedImages
from components._shared.data.overlap import held_out_overlap
from components._shared.data.record_images import say_small_images
from components._shared.eval import evaluation as E
from components._shared.model import checkpoint as ckpt
from components._shared.model.device import resolve_device
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.length_check import keep_trainable
from components._shared.model.sources import check_not_reward_model, resolve_model
from components._shared.model.stage_steps import (
    SCRATCH,
    Figure,
    checkpoint_store,
    finish_report,
    run_key,
    trained_module,
)
from components._shared.model.vlm import checkpoint_dtype, export_dtype, freeze, load_vlm, save_vlm, set_pixel_bounds
from components._shared.platform.reports import history_series
from components._shared.platform.tracking import Tracker
from components.rl import algorithms
from components.rl.config import RlConfig
from components.rl.rewards import EfficacyCache, build_rewards, efficacy, say_other_family
from components.rl.rollout import Policy, RolloutEngine
from components.rl.trainer import RlTrainer

logger = logging.getLogger(__name__)


def load_prompts(
    data_dir: Path, cfg: RlConfig, *, types: list[str] | None = None, setting: str = "prompt_types"
) -> list[dict]:
    """Prompt records (datasets.load_questions: "id", "image", "question", "answer", "type" = the task, ...) from the
    prompts file(s), of `types` (default `prompt_types`; empty = every task); a task no record has is an error
    naming `setting`. Held-out files are never prompt files."""
    types = cfg.prompt_types if types is None else types
    prompts, seen_types = [], set()
    records = datasets.conversation_questions(data_dir, cfg.prompts_file, label="rl prompt")
    held_out = {same_file(f.path) for f in datasets.manifest(data_dir).files("eval", cfg.eval.files)}
    prompt_files = {same_file(r["file"]) for r in records}
    overlap = sorted(held_out & prompt_files)
    if overlap:
        raise ValueError(
            f"rl: {overlap} are both prompt and held-out files; the policy would train on its held-out questions. "
            "Name other files in dataset.yaml (rl / eval) or in rl.prompts_file / rl.eval.files."
        )
    check_distinct_contents(data_dir, "rl", sorted(prompt_files), sorted(held_out))  # a link or copy of one
    for r in records:
        seen_types.add(r["type"])
        if types and r["type"] not in types:
            continue
        prompts.append(r)
        if cfg.max_records and len(prompts) >= cfg.max_records:
            break
    absent = sorted(set(types) - seen_types)
    if absent:
        raise ValueError(
            f"rl {setting} names task(s) {absent} that no prompt record has (they have {sorted(seen_types)}"
            f"{' within max_records' if cfg.max_records else ''}); fix or drop them."
        )
    if not prompts:
        raise ValueError(f"no rl prompts in {data_dir} (tasks {types or 'all'}).")
    if len(prompts) < cfg.train.samples_per_step:
        logger.warning(
            "rl: %d prompt(s)%s < train.samples_per_step=%d: every step repeats prompts; give more prompt records or "
            "lower train.samples_per_step.",
            len(prompts),
            f" (max_records={cfg.max_records})" if cfg.max_records else "",
            cfg.train.samples_per_step,
        )
    if setting == "prompt_types":  # the training prompts (ptx's pool is read by this too)
        say_small_images(prompts, cfg.min_pixels, "rl")
    return prompts


def heldout_eval(model, encoder: ConversationEncoder, records: list[dict], cfg: RlConfig) -> tuple[dict, list[dict]]:
    """Greedy answers on the held-out set: mean efficacy (overall, per type), the VQA suite, mean answer tokens."""
    answers = E.generate_answers(
        model, encoder, records, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens
    )
    rows = E.score_rows(encoder, records, answers)
    for r, row, a in zip(records, rows, answers, strict=True):
        row["efficacy"] = efficacy({**r, **row}, a)  # the row carries a pixel box's frame
        row["tokens"] = len(encoder.tokenizer(a, add_special_tokens=False)["input_ids"])
    by_type: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_type[row["type"]].append(row["efficacy"])
    summary = T.summarize(rows)
    return {
        "efficacy": float(np.mean([row["efficacy"] for row in rows])),
        **{f"efficacy/{t}": float(np.mean(v)) for t, v in by_type.items()},
        "vqa_exact_match": summary.get("vqa_exact_match", 0.0),
        **{k: v for k, v in summary.items() if k.startswith(T.PER_DATA)},
        "answer_tokens": float(np.mean([row["tokens"] for row in rows])),
    }, rows


def run(
    cfg: RlConfig, *, base_model: str, reward_model: str, data: str, output_dir: str | Path, tracker: Tracker
) -> dict[str, Any]:
    """Run RL from the SFT model; returns efficacy before/after, length ratio, final KL and the timing split. Under
    torchrun every rank generates and scores its share of each step (shard.py); rank 0 reports and exports."""
    if cfg.rewards.get("reward_model", 0.0) and not reward_model:  # before any data is read or model loaded
        raise ValueError(
            f"rl.rewards uses reward_model (weight {cfg.rewards['reward_model']}) but the stage got no reward model; "
            "give --reward-model (the reward_model stage's output) or set rl.rewards.reward_model to 0."
        )
    if reward_model and not cfg.rewards.get("reward_model", 0.0):
        logger.warning(
            "rl: the reward model given (%s) is not used: rl.rewards gives reward_model no weight (%s); set "
            "rl.rewards.reward_model > 0 to use it.",
            reward_model,
            cfg.rewards,
        )
    check_not_reward_model(base_model, "--base-model")
    output_dir = Path(output_dir)
    data_dir = datasets.resolve_data_dir(data, scratch=output_dir / SCRATCH)
    prompts = load_prompts(data_dir, cfg)
    eval_records = datasets.load_eval_records(data_dir, per_type=cfg.eval.per_type, files=cfg.eval.files)
    overlap = held_out_overlap(prompts, eval_records, what="rl prompt")
    key = run_key(cfg, {"base_model": base_model, "reward_model": reward_model, "data": data})
    trainer, encoder, processor, rewards = build_trainer(
        cfg, base_model, reward_model, data_dir, prompts, key, output_dir, tracker
    )
    loop = trainer.loop
    final_rows: list[dict] = []

    def evaluate(step: int, policy) -> dict[str, float]:
        summary, rows = heldout_eval(policy.model, encoder, eval_records, cfg)
        final_rows[:] = rows
        if loop.step == 0:  # the SFT model's per-question scores: the paired test's "before"
            trainer.heldout_before = [row["efficacy"] for row in rows]
        return summary

    resumed = trainer.run(evaluate)
    if not final_rows:  # resumed after the last evaluation: score the final policy again for its predictions
        evaluate(loop.step, loop.backend.module)
    critic = trainer.algorithm.critic
    exported = trained_module(loop, lambda: Policy(load_vlm(base_model)[0], value_head=critic))
    if exported is None:  # DeepSpeed ranks > 0: rank 0 reports and exports
        return {"rank": loop.backend.rank, "steps": loop.step}
    cache = rewards.get("efficacy")
    metrics: dict[str, Any] = {
        "algorithm": cfg.algorithm,
        "steps": loop.step,
        "resumed_from_step": resumed if resumed is not None else -1,
        "stopped_early": trainer.stop_reason or "",
        **heldout_change(trainer.heldout_before, final_rows, loop.evals, seed=cfg.seed),
        **training_summary(loop.history),
        "efficacy_cache_hit_rate": cache.hit_rate if isinstance(cache, EfficacyCache) else 0.0,
        **{f"seconds_{k}": round(v, 3) for k, v in trainer.timing.items()},
        "rollout_tokens_per_second": round(trainer.generated_tokens / max(trainer.timing["generation"], 1e-9), 1),
        **({"data/held_out_overlap": overlap} if overlap else {}),
    }
    export_policy(exported, processor, output_dir, cfg, base_model, checkpoint_dtype(resolve_model(base_model)))
    ckpt.write_pointer(output_dir, [loop.store.root])
    write_jsonl(output_dir / "eval_predictions.jsonl", final_rows)
    write_jsonl(output_dir / "rollouts.jsonl", [rollout_row(r) for r in trainer.last_rollouts])
    figures = [
        Figure(
            "reward",
            "training reward and each reward it sums (unweighted)",
            history_series(
                loop.history, ["reward", *sorted({k for h in loop.history for k in h if k.startswith("reward/")})]
            ),
        ),
        Figure("kl", "per-token KL to the reference", history_series(loop.history, ["kl"])),
        Figure("length_entropy", "length ratio and entropy", history_series(loop.history, ["length_ratio", "entropy"])),
        Figure("heldout_efficacy", "held-out efficacy", history_series(loop.evals, ["efficacy", "vqa_exact_match"])),
        Figure(
            "update",
            "update: clip fraction, approximate KL to the sampler, sampler/trainer |delta log p|",
            history_series(loop.history, ["update/clip_fraction", "update/approx_kl", "parity/mean_abs"]),
        ),
    ]
    finish_report(output_dir, tracker, report(metrics), figures, set_aside=loop.store.set_aside)
    return metrics


def build_trainer(
    cfg: RlConfig,
    base_model: str,
    reward_model: str,
    data_dir: Path,
    prompts: list[dict],
    key: str,
    output_dir: Path,
    tracker: Tracker,
):
    """(trainer, encoder, processor, rewards): the policy (with a value head for PPO) and the frozen reference
    from the SFT model, the reward callables, the rollout engine and the trainer over them."""
    torch.manual_seed(cfg.seed)
    model, processor, _ = load_vlm(base_model)
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    freeze(model, tuple(cfg.freeze))
    policy = Policy(model, value_head=algorithms.ALGORITHMS[cfg.algorithm].critic)
    device = resolve_device(cfg.train.device)
    reference = load_vlm(base_model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).model
    reference.requires_grad_(False)
    encoder = ConversationEncoder(
        processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    prompts = keep_trainable(prompts, prompt_tokens(encoder), budget=None, what="rl prompt", setting="max_length")
    rewards = build_rewards(
        dict(cfg.rewards),
        reward_model_uri=reward_model or None,
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        device=device,
    )
    say_other_family(rewards, model)
    engine = RolloutEngine(
        encoder,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        batch_size=cfg.rollout.batch_size,
        max_tokens=cfg.train.max_tokens_per_micro_batch,
        chunk_rows=cfg.train.loss_chunk_tokens,
    )
    trainer = RlTrainer(
        policy,
        reference,
        cfg=cfg,
        prompts=prompts,
        image=DecodedImages(data_dir),
        engine=engine,
        rewards=rewards,
        checkpoints=checkpoint_store("rl", cfg.train, key, output_dir),
        tracker=tracker,
        ptx_pool=ptx_pool(data_dir, cfg, encoder) if cfg.ptx.coef else None,
    )
    return trainer, encoder, processor, rewards


def prompt_tokens(encoder: ConversationEncoder, *, answered: bool = False) -> Callable[[dict], int]:
    """record -> the tokens of its rollout prompt (`answered`: of the prompt and its reference answer, as ptx
    encodes it); over max_length is a ValueError (model/length_check.py)."""

    def count(r: dict) -> int:
        turns = datasets.prompt_turns(r["question"])
        if answered:
            turns = turns + [{"role": "assistant", "text": r["answer"]}]
        return encoder.count_tokens(turns, r["image_sizes"], sample_id=r["id"], add_generation_prompt=not answered)

    return count


def ptx_pool(data_dir: Path, cfg: RlConfig, encoder: ConversationEncoder) -> list[dict]:
    """The records ptx draws its reference answers from (those whose answer fits max_length); ptx.samples_per_step
    larger than the pool is an error (each step would use the whole pool, fewer than asked), the default
    (train.samples_per_step) is capped, said."""
    pool = load_prompts(data_dir, cfg, types=cfg.ptx.types, setting="ptx.types")
    pool = keep_trainable(pool, prompt_tokens(encoder, answered=True), budget=None, what="ptx", setting="max_length")
    if cfg.ptx.samples_per_step > len(pool):
        raise ValueError(
            f"ptx.samples_per_step={cfg.ptx.samples_per_step} exceeds the {len(pool)} ptx records (the prompts file"
            f"{f', ptx.types {list(cfg.ptx.types)}' if cfg.ptx.types else ''}); set ptx.samples_per_step <= "
            f"{len(pool)}, or widen ptx.types."
        )
    if not cfg.ptx.samples_per_step and cfg.train.samples_per_step > len(pool):
        print(
            f"warning: ptx uses all {len(pool)} ptx records per step (fewer than train.samples_per_step="
            f"{cfg.train.samples_per_step}, its default per-step count)",
            file=sys.stderr,
            flush=True,
        )
    return pool


def heldout_change(before_scores: list[float], final_rows: list[dict], evals: list[dict], *, seed: int) -> dict:
    """Held-out efficacy and VQA before/after, and the paired bootstrap of the change, overall and per type."""
    if len(before_scores) != len(final_rows):
        raise RuntimeError(
            f"rl: the checkpoint holds {len(before_scores)} held-out scores of the SFT model "
            f"but {len(final_rows)} questions were scored now (a checkpoint from before the paired test, or another "
            f"eval set); rerun into a fresh output directory or train.checkpoint_uri."
        )
    change = M.paired_bootstrap(before_scores, [row["efficacy"] for row in final_rows], seed=seed)
    per_type: dict[str, dict[str, float]] = {}  # the same paired test within each question type
    for t in sorted({row["type"] for row in final_rows}):
        pairs = [(b, row["efficacy"]) for b, row in zip(before_scores, final_rows, strict=True) if row["type"] == t]
        per_type[t] = M.paired_bootstrap([b for b, _ in pairs], [a for _, a in pairs], seed=seed)
    before, after = evals[0], evals[-1]
    return {
        "efficacy_before": before["efficacy"],
        "efficacy_after": after["efficacy"],
        "vqa_exact_match_before": before["vqa_exact_match"],
        "vqa_exact_match_after": after["vqa_exact_match"],
        **{f"{k}_before": v for k, v in before.items() if k.startswith("efficacy/")},
        **{f"{k}_after": v for k, v in after.items() if k.startswith("efficacy/")},
        "efficacy_gain": change["gain"],
        "efficacy_gain_ci_low": change["ci_low"],  # 95% paired bootstrap over the held-out questions
        "efficacy_gain_ci_high": change["ci_high"],
        "heldout_improved": change["improved"],
        "heldout_worsened": change["worsened"],
        **{
            f"efficacy_gain/{t}{suffix}": c[key]
            for t, c in per_type.items()
            for suffix, key in (("", "gain"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high"))
        },
        "mean_length_ratio": after["answer_tokens"] / max(before["answer_tokens"], 1e-9),
        **{k: v for k, v in after.items() if k.startswith(T.PER_DATA)},  # the final policy's
        **{f"{k}_before": v for k, v in before.items() if k.startswith(T.PER_DATA)},
    }


# Update and parity diagnostics over the run: (metric, the step metric it reads, how the steps are combined)
DIAGNOSTICS = (
    ("clip_fraction_mean", "update/clip_fraction", "mean"),
    ("clip_fraction_max", "update/clip_fraction", "max"),
    ("ratio_max", "update/ratio_max", "max"),
    ("ratio_min", "update/ratio_min", "min"),
    ("approx_kl_mean", "update/approx_kl", "mean"),
    ("value_loss_final", "update/value_loss", "last"),
    ("explained_variance_final", "explained_variance", "last"),
    ("rollouts_kept_mean", "update/rollouts_kept", "mean"),
    ("parity_mean_abs", "parity/mean_abs", "mean"),
    ("parity_max_abs", "parity/max_abs", "max"),
    ("parity_corr_min", "parity/corr", "min"),
)
_COMBINE: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda v: float(np.mean(v)),
    "max": max,
    "min": min,
    "last": lambda v: v[-1],
}


def training_summary(history: list[dict]) -> dict[str, float]:
    """KL, reward and (with ptx) the anchor's loss at the first and last RL step, and the update's diagnostics
    (clip fraction, ratio range, approximate KL, value loss, explained variance, sampler/trainer parity)."""
    summary = {
        "kl_final": history[-1]["kl"] if history else 0.0,
        "kl_max_seen": max((h["kl"] for h in history), default=0.0),
        "reward_first": history[0]["reward"] if history else float("nan"),
        "reward_final": history[-1]["reward"] if history else float("nan"),
        **{
            f"ptx_{k}_{when}": history[i][f"update/ptx_{k}"]
            for k in ("nll", "kl")
            for when, i in (("first", 0), ("final", -1))
            if history and f"update/ptx_{k}" in history[i]
        },
    }
    for name, key, how in DIAGNOSTICS:
        values = [h[key] for h in history if key in h]
        if values:
            summary[name] = float(_COMBINE[how](values))
    return summary


def export_policy(
    policy: Policy, processor, output_dir: Path, cfg: RlConfig, base_model: str, stored_dtype: torch.dtype
) -> None:
    """model/ (the policy's language model, HF format; `export_dtype: checkpoint` = the SFT model's
    `stored_dtype`) and, for PPO, value_head.safetensors."""
    save_vlm(
        policy.model,
        processor,
        output_dir / "model",
        metadata={"stage": "rl", "algorithm": cfg.algorithm, "base_model": str(base_model)},
        dtype=export_dtype(cfg.train.export_dtype, stored_dtype),
    )
    if policy.value_head is not None:
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()},
            str(output_dir / "value_head.safetensors"),
        )


def rollout_row(r) -> dict[str, Any]:
    """One line of rollouts.jsonl: a sample of the last step with its rewards."""
    return {
        "id": r.record["id"],
        "type": r.record["type"],
        "question": r.record["question"],
        "reference": r.record["answer"],
        "completion": r.text,
        "finished": r.finished,
        "reward": r.reward,
        "rewards": r.rewards,
        **({"scorer": r.record["scorer"]} if r.record.get("scorer") else {}),
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def report(metrics: dict[str, Any]) -> str:
    lines = [
        f"# RL ({metrics['algorithm']})",
        "",
        f"{metrics['steps']} steps"
        + (f"; stopped early: {metrics['stopped_early']}." if metrics["stopped_early"] else "."),
        f"Held-out efficacy {metrics['efficacy_before']:.3f} -> {metrics['efficacy_after']:.3f}; VQA exact match "
        f"{metrics['vqa_exact_match_before']:.3f} -> {metrics['vqa_exact_match_after']:.3f}; efficacy change "
        f"{metrics['efficacy_gain']:+.3f} (95% paired bootstrap {metrics['efficacy_gain_ci_low']:+.3f} to "
        f"{metrics['efficacy_gain_ci_high']:+.3f}; {metrics['heldout_improved']:.0f} questions better, "
        f"{metrics['heldout_worsened']:.0f} worse); mean answer length "
        f"{metrics['mean_length_ratio']:.2f}x the SFT model's; final per-token KL {metrics['kl_final']:.4f}.",
        "",
        "| type | efficacy before | after | change [95% paired CI] |",
        "|---|---|---|---|",
    ]
    found = {k.removeprefix("efficacy/").removesuffix("_before") for k in metrics if k.startswith("efficacy/")}
    for t in [*(t for t in T.SYNTHETIC_TASKS if t in found), *sorted(found - set(T.SYNTHETIC_TASKS))]:
        if f"efficacy/{t}_before" in metrics:
            gain = (
                f"{metrics[f'efficacy_gain/{t}']:+.3f} [{metrics[f'efficacy_gain/{t}_ci_low']:+.3f}, "
                f"{metrics[f'efficacy_gain/{t}_ci_high']:+.3f}]"
                if f"efficacy_gain/{t}" in metrics
                else ""
            )
            lines.append(
                f"| {t} | {metrics[f'efficacy/{t}_before']:.3f} | {metrics[f'efficacy/{t}_after']:.3f} | {gain} |"
            )
    benchmarks = sorted(k for k in metrics if k.startswith("benchmark/") and f"{k}_before" in metrics)
    if benchmarks:
        lines += ["", "| benchmark | before | after |", "|---|---|---|"]
        lines += [f"| {k[10:]} | {metrics[f'{k}_before']:.3f} | {metrics[k]:.3f} |" for k in benchmarks]
    shown = [(name, metrics[name]) for name, _, _ in DIAGNOSTICS if name in metrics]
    if shown:
        lines += ["", "Update and sampler/trainer parity over the run:", "", "| diagnostic | value |", "|---|---|"]
        lines += [f"| {name} | {value:.4g} |" for name, value in shown]
    lines += [
        "",
        "Seconds per phase: "
        + ", ".join(f"{k.removeprefix('seconds_')} {v:.1f}" for k, v in metrics.items() if k.startswith("seconds_"))
        + f"; rollout {metrics['rollout_tokens_per_second']:.0f} tokens/s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(
        RlConfig,
        run,
        section="rl",
        inputs=("base_model", "reward_model", "data"),
        optional_inputs=("reward_model",),
        argv=argv,
    )
