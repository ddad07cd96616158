"""reward_model: Bradley-Terry training of a scalar head on a Qwen-VL backbone initialised from the SFT model.

1 process (CPU/tiny):  python -m components.reward_model --config pipelines/presets/tiny.yaml \
                           --base-model OUT/sft/model --data runs/world/heldout --output-dir OUT/reward_model
N GPUs (DeepSpeed):    torchrun --nproc-per-node 8 -m components.reward_model \
                           --config pipelines/presets/prod-7b.yaml ...
In the pipeline:       components/reward_model/component.py calls run_stage("reward_model", ...).

Data (`--data`): `preferences.jsonl` records {"id", "image", "prompt", "chosen", "rejected", optional "kind"}
(image: a path inside the data directory or an s3:// URI). Each pair is one unit of the shared loop (both
answers in the same packed micro-batch). The reward of an answer is the head's score of the last-layer hidden
state at its K-th response token (`score_first_k`, or the last one when shorter). Writes model/ (the backbone,
HF format), reward_head.safetensors and reward_model.json (K, normalisation mean/std), report.md.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from components._shared.data import datasets
from components._shared.data.record_images import say_small_images
from components._shared.model.encoder import ConversationEncoder, Sample
from components._shared.model.length_check import keep_trainable
from components._shared.model.packing import pack, plan_micro_batches, to_device
from components._shared.model.reward_models import RewardModel, reward_index, save_reward_model
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
from components._shared.model.vlm import export_dtype, freeze, load_vlm, set_pixel_bounds
from components._shared.platform.reports import history_series
from components._shared.platform.tracking import Tracker
from components.reward_model.config import RewardModelConfig


def load_pairs(data_dir: Path, max_records: int | None) -> list[dict]:
    """Preference pairs of the data directory (datasets.load_preferences: preferences.jsonl or dataset.yaml's files,
    TRL's prompt / chosen / rejected layout)."""
    return datasets.load_preferences(data_dir, max_records)


def is_heldout(record_id: str, fraction: float) -> bool:
    return int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) / 16**8 < fraction


def bt_loss(margin: float):
    """Summed Bradley-Terry loss of the pairs in a micro-batch (samples come as chosen, rejected, chosen, ...)."""

    def loss(model: RewardModel, batch: dict, samples: list[Sample]) -> tuple[torch.Tensor, int, dict[str, float]]:
        r = model.scores(batch, samples)
        chosen, rejected = r[0::2], r[1::2]
        losses = -F.logsigmoid(chosen - rejected - margin)
        accuracy = float((chosen > rejected).float().mean())
        return losses.sum(), len(losses), {"pair_accuracy": accuracy}

    return loss


@torch.no_grad()
def score_pairs(model: RewardModel, units: list[list[Sample]], max_tokens: int = 4096) -> list[tuple[float, float]]:
    """(reward chosen, reward rejected) of every pair, packed."""
    device = next(model.parameters()).device
    out: list = [None] * len(units)
    budget = max(max_tokens, max(sum(s.num_tokens for s in u) for u in units))
    for group in plan_micro_batches([sum(s.num_tokens for s in u) for u in units], budget):
        micro = [s for i in group for s in units[i]]
        batch = to_device(pack(micro), device)
        r = model.scores(batch, micro).tolist()
        for j, i in enumerate(group):
            out[i] = (r[2 * j], r[2 * j + 1])
    return out


def run(
    cfg: RewardModelConfig, *, base_model: str, data: str, output_dir: str | Path, tracker: Tracker
) -> dict[str, Any]:
    """Train the reward model; returns held-out pair accuracy (overall and per rejection kind) and reward stats."""
    check_not_reward_model(base_model, "--base-model")
    output_dir = Path(output_dir)
    data_dir = datasets.resolve_data_dir(data, scratch=output_dir / SCRATCH)
    loaded = load_pairs(data_dir, cfg.max_records)
    say_small_images(loaded, cfg.min_pixels, "reward_model")
    store = checkpoint_store(
        "reward_model", cfg.train, run_key(cfg, {"base_model": base_model, "data": data}), output_dir
    )
    torch.manual_seed(cfg.seed)
    backbone, processor, stored_dtype = load_vlm(base_model)
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    freeze(backbone, tuple(cfg.freeze))
    model = RewardModel(backbone, likelihood_term=cfg.likelihood_term)  # head init right after the seed
    encoder = ConversationEncoder(
        processor, backbone, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    loaded = keep_trainable(
        loaded, pair_tokens(encoder), budget=cfg.train.max_tokens_per_micro_batch, what="preference"
    )
    train, heldout = split_pairs(loaded, cfg.heldout_fraction)
    unit = pair_encoder(encoder, data_dir, cfg.score_first_k)
    heldout_units = [unit(r) for r in heldout]

    def evaluate(step: int, model) -> dict[str, float]:
        scored = score_pairs(model, heldout_units)
        return {"pair_accuracy": sum(c > r for c, r in scored) / len(scored)}

    pairs = LoopData(
        phases=[Phase("pairs", cfg.train.steps, list(range(len(train))))],
        sample=lambda i: unit(train[i]),
        unit_weight=lambda u: 1.0,  # the loss is a mean over pairs
    )
    loop = TrainLoop(model, LoopSettings.of(cfg), pairs, store, tracker=tracker, loss_fn=bt_loss(cfg.margin))
    result = loop.run(evaluate=evaluate)
    trained = trained_module(loop, lambda: RewardModel(load_vlm(base_model)[0], likelihood_term=cfg.likelihood_term))
    if trained is None:  # DeepSpeed ranks > 0: rank 0 scores and saves
        return {"rank": loop.backend.rank, "steps": result.steps}
    model = trained
    model.eval()
    scored = score_pairs(model, heldout_units)
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for record, (c, r) in zip(heldout, scored, strict=True):
        by_kind[record.get("kind", "unknown")].append(c > r)
    train_scores = [s for pair in score_pairs(model, [unit(r) for r in train[:256]]) for s in pair]
    mean = sum(train_scores) / len(train_scores)
    std = (sum((s - mean) ** 2 for s in train_scores) / len(train_scores)) ** 0.5
    metrics: dict[str, Any] = {
        "pair_accuracy": sum(c > r for c, r in scored) / len(scored),
        **{f"pair_accuracy/{k}": sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "pair_accuracy_initial": result.evals[0]["pair_accuracy"] if result.evals else float("nan"),
        "heldout_pairs": len(heldout),
        "train_pairs": len(train),
        "reward_mean": mean,
        "reward_std": std,
        "margin_mean": sum(c - r for c, r in scored) / len(scored),
        **loop_metrics(result),
    }
    save_reward_model(
        model,
        processor,
        output_dir / "model",
        score_first_k=cfg.score_first_k,
        mean=mean,
        std=std,
        base_model=base_model,
        dtype=export_dtype(cfg.train.export_dtype, stored_dtype),
    )
    figures = [
        Figure("train_loss", "training loss (Bradley-Terry)", history_series(result.history, ["loss"])),
        Figure("pair_accuracy", "held-out pair accuracy", history_series(result.evals, ["pair_accuracy"])),
    ]
    finish_report(output_dir, tracker, report(metrics), figures, set_aside=result.set_aside)
    return metrics


def split_pairs(pairs: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, held-out) by a hash of each pair's id, so a pair stays on its side whatever else the file holds."""
    train = [p for p in pairs if not is_heldout(p["id"], fraction)]
    heldout = [p for p in pairs if is_heldout(p["id"], fraction)]
    if not train or not heldout:
        raise ValueError(
            f"{len(pairs)} preference pairs split into {len(train)} train / {len(heldout)} held out; "
            "give more pairs or change heldout_fraction."
        )
    return train, heldout


def pair_turns(record: dict, side: str) -> list[dict]:
    """The conversation one side of a preference pair is scored on."""
    return [{"role": "user", "text": f"<image>\n{record['prompt']}"}, {"role": "assistant", "text": record[side]}]


def pair_tokens(encoder: ConversationEncoder):
    """record -> the tokens of its pair (both sides: a pair is one unit of a micro-batch)."""

    def count(r: dict) -> int:
        return sum(
            encoder.count_tokens(pair_turns(r, side), r["image_sizes"], sample_id=f"{r['id']}:{side}")
            for side in ("chosen", "rejected")
        )

    return count


def pair_encoder(encoder: ConversationEncoder, data_dir: Path, score_first_k: int):
    """record -> [chosen sample, rejected sample], each marked with the token the reward is read at."""

    def unit(record: dict) -> list[Sample]:
        image = datasets.load_image(data_dir, record["image"])
        out = []
        for side in ("chosen", "rejected"):
            sample = encoder.encode(pair_turns(record, side), images=[image], sample_id=f"{record['id']}:{side}")
            sample.meta["reward_index"] = reward_index(sample, score_first_k)
            out.append(sample)
        return out

    return unit


def report(metrics: dict[str, Any]) -> str:
    lines = [
        "# Reward model",
        "",
        f"Held-out pair accuracy {metrics['pair_accuracy']:.3f} "
        f"(before training {metrics['pair_accuracy_initial']:.3f}) on {metrics['heldout_pairs']} pairs.",
        "",
        "| rejection kind | pair accuracy |",
        "|---|---|",
    ]
    lines += [f"| {k.split('/', 1)[1]} | {v:.3f} |" for k, v in metrics.items() if k.startswith("pair_accuracy/")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(RewardModelConfig, run, section="reward_model", inputs=("base_model", "data"), argv=argv)
