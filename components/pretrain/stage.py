"""pretrain: image-caption alignment. Stage 1 (ViT frozen) trains the merger, optionally the LM, on the cached
pre-merger features of extract_features; stage 2 trains jointly from pixels with per-module learning rates.

1 process (CPU/tiny):  python -m components.pretrain --config pipelines/presets/tiny.yaml \
                           --clean-data OUT/clean_data --features OUT/features --base-model builtin:tiny-qwen2_5-vl \
                           --data runs/world/heldout --output-dir OUT/pretrain
N GPUs (DeepSpeed):    torchrun --nproc-per-node 8 -m components.pretrain --config pipelines/presets/prod-7b.yaml ...
In the pipeline:       components/pretrain/component.py calls run_stage("pretrain", ...).

Convergence is tracked on held-out captions (`--data`: eval.jsonl, type "caption"): the mean caption loss and
image->text retrieval R@1 (each image ranks every candidate caption by its caption loss given the image minus
that caption's mean loss over all candidate images, so generic, likely captions do not win everywhere). The exported
model/ is the best of the last N evaluated checkpoints. Writes model/, checkpoints/, report.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from components._shared.data import datasets
from components._shared.data.kept_records import load_kept
from components._shared.eval import evaluation as E
from components._shared.model import checkpoint as ckpt
from components._shared.model import moe
from components._shared.model.checkpoint import CheckpointStore
from components._shared.model.encoder import IGNORE_INDEX, ConversationEncoder
from components._shared.model.families import VisualTokens
from components._shared.model.head_loss import per_sample_sequence_loss, sequence_loss
from components._shared.model.packing import image_embeddings, pack, plan_micro_batches, to_device
from components._shared.model.sources import check_not_reward_model
from components._shared.model.stage_steps import SCRATCH, Figure, finish_report, run_key
from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop, TrainResult, is_main_process
from components._shared.model.vlm import export_dtype, freeze, load_vlm, qwen_model, save_vlm, set_pixel_bounds
from components._shared.platform import storage
from components._shared.platform.image_decode import decode_image
from components._shared.platform.reports import history_series
from components._shared.platform.tracking import Tracker
from components.pretrain.config import InfoNceConfig, PretrainConfig, Stage1Config, Stage2Config
from components.pretrain.feature_store import FeatureStore
from components.pretrain.regions import Region, RegionTerm, collect_regions

MAX_IMAGE_PIXELS = 89_478_485


def infonce_loss(cfg: InfoNceConfig, embeds: torch.Tensor, batch: dict, text_embeds: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE between each sample's mean merged image token and mean caption-token embedding."""
    seq = batch["seq_index"][0]
    n = batch["num_samples"]
    image_mask = batch["image_mask"][0]
    caption_mask = torch.roll(batch["targets"][0] != IGNORE_INDEX, 1)  # token t is a label iff targets[t-1] is
    image_seq = seq[image_mask]
    img = torch.zeros(n, embeds.shape[-1], dtype=embeds.dtype, device=embeds.device).index_add_(0, image_seq, embeds)
    img = img / torch.bincount(image_seq, minlength=n).clamp_min(1)[:, None]
    txt_rows = text_embeds[0][caption_mask]
    txt_seq = seq[caption_mask]
    txt = torch.zeros(n, txt_rows.shape[-1], dtype=txt_rows.dtype, device=txt_rows.device).index_add_(
        0, txt_seq, txt_rows
    )
    txt = txt / torch.bincount(txt_seq, minlength=n).clamp_min(1)[:, None]
    sim = F.normalize(img.float(), dim=-1) @ F.normalize(txt.float(), dim=-1).T / cfg.temperature
    row, col = sim, sim.T
    if cfg.hard_negatives and cfg.hard_negatives < n - 1:
        row, col = _hardest(row, cfg.hard_negatives), _hardest(col, cfg.hard_negatives)
    labels = torch.arange(n, device=sim.device)
    return 0.5 * (F.cross_entropy(row, labels) + F.cross_entropy(col, labels))


def _hardest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row keeps its positive (the diagonal) and its k most similar negatives; the rest is masked out."""
    eye = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    keep = eye.clone()
    keep.scatter_(1, scores.masked_fill(eye, float("-inf")).topk(k, dim=1).indices, True)
    return scores.masked_fill(~keep, float("-inf"))


def make_loss(cfg: PretrainConfig, chunk_rows: int, region: RegionTerm | None = None):
    """Caption cross-entropy (+ the region term and weighted InfoNCE when enabled) for the TrainLoop; the LM head in
    `chunk_rows` rows."""

    def loss(model, batch: dict, samples) -> tuple[torch.Tensor, int, dict[str, float]]:
        embeds = image_embeddings(model, batch)
        router = moe.router_list(model)
        loss_sum, targets = sequence_loss(model, batch, chunk_rows=chunk_rows, image_embeds=embeds, router=router)
        loss_sum, extra = moe.add_balance(model, loss_sum, targets, router)  # {} without experts
        if region is not None:
            if embeds is None:
                raise ValueError("pretrain's region term needs an image in every caption sample; the batch has none.")
            term = region(model, embeds.embeds, samples)
            loss_sum, extra["region"] = loss_sum + region.weight() * term * targets, term.detach()
        if cfg.infonce.weight <= 0:
            return loss_sum, targets, extra
        # Same calls and the same metric keys on every micro-batch and rank (ZeRO-3 gathers, all-reduces).
        text_embeds = model.get_input_embeddings()(batch["input_ids"])
        if batch["num_samples"] < 2:  # no negatives in this micro-batch
            return loss_sum + 0.0 * text_embeds.sum(), targets, {**extra, "infonce": 0.0}
        if embeds is None:
            raise ValueError("pretrain's InfoNCE needs an image in every caption sample; the batch has none.")
        image_token = qwen_model(model).config.image_token_id
        batch = {**batch, "image_mask": batch["input_ids"] == image_token}
        nce = infonce_loss(cfg.infonce, embeds.embeds, batch, text_embeds)
        return loss_sum + cfg.infonce.weight * nce * targets, targets, {**extra, "infonce": nce.detach()}

    return loss


class HeldoutCaptions:
    """Held-out caption loss and image->text retrieval R@1 on the held-out caption records (the first reference)."""

    def __init__(self, cfg: PretrainConfig, encoder: ConversationEncoder, data_dir: Path) -> None:
        records = [
            r for r in datasets.load_eval_records(data_dir) if r["type"] == "caption" or r.get("scorer") == "cider_d"
        ]
        if len(records) < 2:
            raise ValueError(
                f"the held-out data in {data_dir} has {len(records)} caption records (task caption, or a task scored "
                "by cider_d); pretrain needs >= 2 to measure held-out caption loss and retrieval."
            )
        self.encoder = encoder

        def turns(caption: str) -> list[dict]:
            return [{"role": "user", "text": f"<image>\n{cfg.prompt}"}, {"role": "assistant", "text": caption}]

        self.loss_samples = [
            encoder.encode(turns(r["answer"]), images=[r["pil"]], sample_id=r["id"])
            for r in records[: cfg.eval.heldout_captions]
        ]
        pool = records[: cfg.eval.retrieval_candidates]
        self.image_samples = (
            self.loss_samples[: len(pool)]
            if len(pool) <= len(self.loss_samples)
            else [encoder.encode(turns(r["answer"]), images=[r["pil"]], sample_id=r["id"]) for r in pool]
        )
        grids = [s.image_grid_thw[0] for s in self.image_samples]
        self.pairs = [
            encoder.encode(turns(pool[j]["answer"]), grids=[grids[i]], sample_id=f"{i}:{j}")
            for i in range(len(pool))
            for j in range(len(pool))
        ]
        self.pool = len(pool)

    @torch.no_grad()
    def __call__(self, model, chunk_rows: int) -> dict[str, float]:
        """`chunk_rows`: the training phase's train.loss_chunk_tokens (its memory budget for LM-head logits)."""
        losses = E.heldout_loss(model, self.loss_samples, chunk_rows=chunk_rows)
        device = next(model.parameters()).device
        batch = to_device(pack(self.image_samples), device)
        embeds = image_embeddings(model, batch)
        if embeds is None:
            raise ValueError("pretrain's retrieval samples carry no image inputs; every eval caption needs its image.")
        per_image = embeds.split([int(s.image_grid_thw.prod()) // self.encoder.merge_unit for s in self.image_samples])
        scores = torch.empty(self.pool, self.pool)
        budget = max(4096, max(s.num_tokens for s in self.pairs))
        for group in plan_micro_batches([s.num_tokens for s in self.pairs], budget):
            micro = [self.pairs[k] for k in group]
            mb = to_device(pack(micro), device)
            embeds = VisualTokens.cat([per_image[k // self.pool] for k in group])
            pair_losses = per_sample_sequence_loss(model, mb, chunk_rows=chunk_rows, image_embeds=embeds)
            for k, value in zip(group, pair_losses.tolist(), strict=True):
                scores[k // self.pool, k % self.pool] = value
        # Caption-prior normalisation (PMI): a caption that is likely under every image must not win for all.
        normalised = scores - scores.mean(dim=0, keepdim=True)
        r1 = float((normalised.argmin(dim=1) == torch.arange(self.pool)).float().mean())
        return {"heldout_caption_loss": sum(losses) / len(losses), "retrieval_r1": r1}


def checkpoint_root(name: str, block, key: str, output_dir: Path) -> str:
    """Where phase `name` ("stage1" / "stage2") keeps its checkpoints."""
    return storage.join(ckpt.location(block.train.checkpoint_uri, "pretrain", key, output_dir), name)


def train_phase(
    name: str,
    model,
    block,
    sample,
    evaluate,
    cfg: PretrainConfig,
    n: int,
    output_dir: Path,
    tracker: Tracker,
    key: str,
    region: RegionTerm | None,
) -> tuple[TrainLoop, TrainResult]:
    """Train one phase (stage1 / stage2) on its own keyed checkpoints; returns the loop and its result."""
    store = CheckpointStore(
        checkpoint_root(name, block, key, output_dir),
        keep=block.train.keep_checkpoints,
        scratch=output_dir / SCRATCH,
        key=key,
    )
    loop = TrainLoop(
        model,
        LoopSettings.of(block, seed=cfg.seed),
        LoopData(phases=[Phase(name, block.train.steps, list(range(n)))], sample=sample),
        store,
        tracker=_Prefixed(tracker, name),
        loss_fn=make_loss(cfg, block.train.loss_chunk_tokens, region),
    )
    if region is not None:
        region.loop, region.offset = loop, 0 if name == "stage1" else cfg.stage1.train.steps
    return loop, loop.run(evaluate=evaluate)


def select_best(loop: TrainLoop, cfg: PretrainConfig) -> tuple[dict[str, float], int]:
    """Load the best of the last N evaluated, still committed checkpoints into the model; returns its eval and
    how many candidates there were."""
    committed = {int(Path(u.rstrip("/")).name.split("-")[1]): u for u in loop.store.committed()}
    candidates = [e for e in loop.evals if e["step"] in committed][-cfg.keep_best_of_last :]
    if not candidates:
        return loop.evals[-1], 1
    sign = 1.0 if cfg.selection_metric == "heldout_caption_loss" else -1.0
    best = min(candidates, key=lambda e: (sign * e[cfg.selection_metric], -e["step"]))
    if best["step"] != loop.step:
        loop.backend.load(loop.store.local_copy(committed[int(best["step"])], loop.backend.rank))
    return best, len(candidates)


def kept_records(cfg: PretrainConfig, clean_data: Path) -> tuple[list[dict], list[list[Region]], dict[str, int]]:
    """clean_data's kept records, with their regions and the regions' accounting when region supervision is on."""
    records = load_kept(clean_data, cfg.max_records, with_images=cfg.stage2.enabled, with_metadata=cfg.region.enabled)
    regions, metrics = collect_regions(records, cfg.region) if cfg.region.enabled else ([], {})
    return records, regions, metrics


def _feature_store(cfg: PretrainConfig, features: Path, records: list[dict], model) -> FeatureStore:
    """The feature cache, checked against the model and to hold every kept image."""
    store = FeatureStore(features)
    store.check(model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    missing = [r["image_hash"] for r in records if r["image_hash"] not in store]
    if missing:
        raise ValueError(
            f"{len(missing)} kept images have no cached features (first: {missing[0]}); run "
            "extract_features on this clean_data output."
        )
    return store


def run(
    cfg: PretrainConfig,
    *,
    clean_data: str,
    features: str,
    base_model: str,
    data: str,
    output_dir: str | Path,
    tracker: Tracker,
) -> dict[str, Any]:
    """Stage 1 (+ optional stage 2); returns held-out caption loss before/after, retrieval R@1 and throughput."""
    check_not_reward_model(base_model, "--base-model", expected="the base checkpoint")
    output_dir = Path(output_dir)
    records, regions, region_metrics = kept_records(cfg, Path(clean_data))
    key = run_key(cfg, {"clean_data": clean_data, "features": features, "base_model": base_model, "data": data})
    torch.manual_seed(cfg.seed)
    model, processor, stored_dtype = load_vlm(base_model)
    store = _feature_store(cfg, Path(features), records, model)
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    encoder = ConversationEncoder(
        processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    heldout = HeldoutCaptions(cfg, encoder, datasets.resolve_data_dir(data, scratch=output_dir / SCRATCH))
    from_features, from_pixels = caption_samples(cfg, encoder, records, store, regions)
    freeze(model, ("vision_lower", "vision_upper") + (() if cfg.stage1.train_lm else ("lm_lower", "lm_upper")))
    region = region_term(cfg, encoder, model) if cfg.region.enabled else None
    phase_args = (cfg, len(records), output_dir, tracker, key, region)

    def phase(name: str, block, samples):  # its held-out evals chunk the LM head by the phase's loss_chunk_tokens
        chunk = block.train.loss_chunk_tokens
        return train_phase(name, model, block, samples, lambda step, trained: heldout(trained, chunk), *phase_args)

    last: Stage1Config | Stage2Config = cfg.stage1
    loop, first = phase("stage1", cfg.stage1, from_features)
    results = {"stage1": first}
    if cfg.stage2.enabled:
        # A fresh module for stage 2: a DeepSpeed engine keeps hooks and flat buffers on the module it wrapped,
        # so stage 2 starts from stage 1's full fp32 weights in a new model instead of re-wrapping the old one.
        weights = loop.backend.full_state_dict()
        del loop
        model = load_vlm(base_model).model
        model.load_state_dict(weights)
        freeze(model, tuple(cfg.stage2.freeze))
        last = cfg.stage2
        loop, results["stage2"] = phase("stage2", cfg.stage2, from_pixels)
    best, candidates = select_best(loop, cfg)
    final = heldout(model, last.train.loss_chunk_tokens) if best["step"] != loop.step else best
    initial = first.evals[0]
    metrics: dict[str, Any] = {name: value for n, r in results.items() for name, value in _phase_metrics(n, r).items()}
    metrics.update(
        {
            "records": len(records),
            "heldout_caption_loss_initial": initial["heldout_caption_loss"],
            "heldout_caption_loss_final": final["heldout_caption_loss"],
            "heldout_caption_loss_reduction": 1.0 - final["heldout_caption_loss"] / initial["heldout_caption_loss"],
            "retrieval_r1_initial": initial["retrieval_r1"],
            "retrieval_r1": final["retrieval_r1"],
            "retrieval_chance": 1.0 / heldout.pool,
            "selected_step": best["step"],
            "selected_from": candidates,
            **region_metrics,
        }
    )
    for param in model.parameters():
        param.requires_grad_(False)
    with loop.backend.gathered():
        if is_main_process():
            save_vlm(
                loop.backend.module,
                processor,
                output_dir / "model",
                metadata={"stage": "pretrain", "base_model": str(base_model), "selected_step": best["step"]},
                dtype=export_dtype(last.train.export_dtype, stored_dtype),
            )
            phases = [("stage1", cfg.stage1)] + ([("stage2", cfg.stage2)] if cfg.stage2.enabled else [])
            ckpt.write_pointer(output_dir, [checkpoint_root(name, block, key, output_dir) for name, block in phases])
    curve = [{"stage": name, **e} for name, result in results.items() for e in result.evals]
    set_aside = [note for result in results.values() for note in result.set_aside]
    finish_report(output_dir, tracker, report(metrics, curve), _figures(results, curve), set_aside=set_aside)
    return metrics


def region_term(cfg: PretrainConfig, encoder: ConversationEncoder, model) -> RegionTerm:
    """The region loss over all pretraining steps (stage 1, then stage 2 when it runs)."""
    total = cfg.stage1.train.steps + (cfg.stage2.train.steps if cfg.stage2.enabled else 0)
    merge = int(qwen_model(model).config.vision_config.spatial_merge_size)
    term = RegionTerm(cfg.region, encoder.tokenizer, merge, offset=0, total=total)
    if not any(term.weight_at(step) for step in range(total)):
        raise ValueError(
            f"pretrain.region.schedule gives weight 0 at every one of the {total} pretraining steps (its weighted "
            "segments fall between steps): the region term would train nothing. Widen the weighted segments, give "
            "more steps, or set region.enabled: false."
        )
    return term


def caption_samples(
    cfg: PretrainConfig, encoder: ConversationEncoder, records: list[dict], store, regions: list[list[Region]]
):
    """(index -> sample from cached features, index -> sample from pixels): a kept record as a caption turn (its
    regions in the sample's meta when region supervision is on)."""

    def turns(caption: str) -> list[dict]:
        return [{"role": "user", "text": f"<image>\n{cfg.prompt}"}, {"role": "assistant", "text": caption}]

    def with_regions(i: int, sample):
        if regions and regions[i]:
            sample.meta["regions"] = regions[i]
        return sample

    def from_features(i: int):
        rows, grid = store.get(records[i]["image_hash"])
        sample = encoder.encode(
            turns(records[i]["caption"]), grids=[grid], features=[rows], sample_id=records[i]["image_hash"]
        )
        return with_regions(i, sample)

    def from_pixels(i: int):
        image = decode_image(records[i]["image"], max_image_pixels=MAX_IMAGE_PIXELS).image
        sample = encoder.encode(turns(records[i]["caption"]), images=[image], sample_id=records[i]["image_hash"])
        return with_regions(i, sample)

    return from_features, from_pixels


def _figures(results: dict[str, TrainResult], curve: list[dict]) -> list[Figure]:
    losses = {name: history_series(result.history, ["loss"]).get("loss", []) for name, result in results.items()}
    return [
        Figure(
            "train_loss",
            "training loss (step within each phase)",
            {k: v for k, v in losses.items() if v},
            log_y=True,
        ),
        Figure(
            "heldout",
            "held-out caption loss and retrieval R@1 (evals in order)",
            history_series(
                [{**e, "eval": i} for i, e in enumerate(curve)],
                ["heldout_caption_loss", "retrieval_r1"],
                step="eval",
            ),
        ),
    ]


def _phase_metrics(name: str, result: TrainResult) -> dict[str, float]:
    return {
        f"{name}_steps": result.steps,
        f"{name}_steps_per_second": round(len(result.history) / result.seconds, 3) if result.seconds else 0.0,
        f"{name}_train_loss_first": result.history[0]["loss"] if result.history else float("nan"),
        f"{name}_train_loss_final": result.history[-1]["loss"] if result.history else float("nan"),
        f"{name}_padding_efficiency": round(result.padding_efficiency, 4),
        f"{name}_budget_fill": round(result.budget_fill, 4),
    }


def report(metrics: dict[str, Any], evals: list[dict]) -> str:
    lines = [
        "# Pretrain",
        "",
        f"Held-out caption loss {metrics['heldout_caption_loss_initial']:.3f} -> "
        f"{metrics['heldout_caption_loss_final']:.3f} ({100 * metrics['heldout_caption_loss_reduction']:.1f}% "
        f"lower); retrieval R@1 {metrics['retrieval_r1_initial']:.3f} -> {metrics['retrieval_r1']:.3f} "
        f"(chance {metrics['retrieval_chance']:.3f}); exported step {metrics['selected_step']}.",
        "",
        "| stage | step | held-out caption loss | retrieval R@1 |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {e['stage']} | {e['step']} | {e['heldout_caption_loss']:.4f} | {e['retrieval_r1']:.3f} |" for e in evals
    ]
    return "\n".join(lines) + "\n"


class _Prefixed(Tracker):
    """A tracker view that prefixes metric names with the phase (stage1/..., stage2/...)."""

    def __init__(self, tracker: Tracker, prefix: str) -> None:
        self.tracker, self.prefix = tracker, prefix

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.tracker.log_metrics({f"{self.prefix}/{k}": v for k, v in metrics.items()}, step=step)

    def __getattr__(self, name: str):
        return getattr(self.tracker, name)


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(
        PretrainConfig, run, section="pretrain", inputs=("clean_data", "features", "base_model", "data"), argv=argv
    )
