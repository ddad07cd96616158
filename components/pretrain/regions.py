"""Region-phrase alignment in pretrain (`pretrain.region`): the kept records' boxes, checked and counted, and the
loss term that ties the merged visual tokens under a phrase's box to that phrase.

Boxes come as GRIT's `noun_chunks` in each lake record's JSON (clean_data keeps the JSON in its `metadata`
column): `[start, end, x1, y1, x2, y2, score]`, a character span of the caption and its box relative to the image.
A box is placed on the merged token grid (one cell per `spatial_merge_size`^2 patches, the cells in raster order
as the processors lay them out), i.e. in units of the vision encoder's stride, whatever the image's size (seed
000 3.1). Written here because no library aligns region-pooled Qwen-VL merger outputs with phrases.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from components._shared.data.regions import Region, record_regions
from components.pretrain.config import RegionConfig

logger = logging.getLogger(__name__)


def collect_regions(records: list[dict], cfg: RegionConfig) -> tuple[list[list[Region]], dict[str, int]]:
    """Every kept record's regions and their accounting (used + dropped by reason = chunks given); warns about
    the dropped ones with an example record, refuses a run where region supervision has nothing to learn from."""
    per_record: list[list[Region]] = []
    reasons: Counter[str] = Counter()
    example: dict[str, str] = {}
    for r in records:
        regions, dropped = record_regions(r, cfg.min_score)
        per_record.append(regions)
        for reason in dropped:
            reasons[reason] += 1
            where = f"lake key {r['key']!r} of shard {r['shard']}" if r.get("key") and r.get("shard") else None
            example.setdefault(reason, where or f"image_hash {r['image_hash']}")
    used = sum(len(regions) for regions in per_record)
    if not used:
        raise ValueError(
            f"pretrain.region.enabled, but none of the {len(records)} kept records has a usable box: give the lake "
            "records GRIT-style noun_chunks ([start, end, x1, y1, x2, y2, score] per caption phrase, boxes relative "
            f"to the image) in their JSON, or set region.enabled: false{_said(reasons)}."
        )
    named = Counter(phrase_key(region.phrase) for regions in per_record for region in regions)
    phrase, most = named.most_common(1)[0]
    if len(named) < 2 or most > MAX_ONE_PHRASE_SHARE * used:
        raise ValueError(
            f"pretrain.region.enabled, but {most} of the {used} usable boxes of the {len(records)} kept records name "
            f"one phrase ({phrase!r}, case and end punctuation aside): the region term matches each box to its phrase "
            "against the other phrases of a micro-batch, and nearly every micro-batch has no other. Give chunks for "
            "the phrases that name objects, or set region.enabled: false."
        )
    for reason, count in sorted(reasons.items()):
        logger.warning("pretrain: %d region chunk(s) not used: %s (e.g. %s)", count, reason, example[reason])
    metrics = {
        "region_records": sum(1 for regions in per_record if regions),
        "region_boxes": used,
        "region_phrases": len(named),
        "region_dropped": sum(reasons.values()),
    }
    return per_record, metrics


MAX_ONE_PHRASE_SHARE = 0.9  # more boxes than this naming one phrase: most micro-batches contrast nothing


def phrase_key(phrase: str) -> str:
    """A phrase as a reader tells phrases apart: case, surrounding punctuation and repeated spaces aside."""
    return " ".join(phrase.lower().strip(" .,;:!?\"'()[]").split())


def _said(reasons: Counter) -> str:
    return "; chunks given but not used: " + ", ".join(f"{n} {why}" for why, n in reasons.items()) if reasons else ""


def box_cells(box: tuple[float, float, float, float], rows: int, cols: int) -> tuple[slice, slice]:
    """The merged-grid cells (rows, cols) a relative box covers: every cell it touches, at least one."""
    x1, y1, x2, y2 = box
    c1, r1 = min(cols - 1, math.floor(x1 * cols)), min(rows - 1, math.floor(y1 * rows))
    c2, r2 = max(c1 + 1, min(cols, math.ceil(x2 * cols))), max(r1 + 1, min(rows, math.ceil(y2 * rows)))
    return slice(r1, r2), slice(c1, c2)


class RegionTerm:
    """The region loss of a micro-batch and its scheduled weight. `loop` is set once the phase's TrainLoop exists:
    its step (plus the steps of the phases before, `offset`) places the schedule over all `total` steps."""

    def __init__(self, cfg: RegionConfig, tokenizer, merge: int, *, offset: int, total: int) -> None:
        self.cfg, self.tokenizer, self.merge = cfg, tokenizer, merge
        self.offset, self.total = offset, total
        self.loop: Any = None
        self._ids: dict[str, list[int]] = {}

    def weight(self) -> float:
        return self.weight_at(self.offset + (self.loop.step if self.loop is not None else 0))

    def weight_at(self, step: int) -> float:
        """The scheduled weight at pretraining step `step` (of `total`)."""
        at = step / max(1, self.total)
        edge = 0.0
        for segment in self.cfg.schedule:
            edge += segment.fraction
            if at < edge:
                return segment.weight
        return self.cfg.schedule[-1].weight

    def _phrase_ids(self, phrase: str) -> list[int]:
        """The phrase's tokens as they read inside a sentence (after a space)."""
        if phrase not in self._ids:
            self._ids[phrase] = self.tokenizer(" " + phrase, add_special_tokens=False)["input_ids"] or [0]
        return self._ids[phrase]

    def pooled(self, embeds: torch.Tensor, samples) -> tuple[list[torch.Tensor], list[str]]:
        """(mean merged token under each box, its phrase) over the micro-batch's single-image samples."""
        rows, phrases, start = [], [], 0
        for s in samples:
            sizes = [int(g.prod()) // self.merge**2 for g in s.image_grid_thw]
            regions = s.meta.get("regions", ())
            if regions and len(sizes) == 1:
                t, h, w = (int(v) for v in s.image_grid_thw[0])
                grid = embeds[start : start + sizes[0]].reshape(t, h // self.merge, w // self.merge, -1)[0]
                for region in regions:
                    r, c = box_cells(region.box, grid.shape[0], grid.shape[1])
                    rows.append(grid[r, c].reshape(-1, grid.shape[-1]).mean(0))
                    phrases.append(region.phrase)
            start += sum(sizes)
        return rows, phrases

    def __call__(self, model, embeds: torch.Tensor, samples) -> torch.Tensor:
        """InfoNCE of each box's pooled tokens against the micro-batch's distinct phrases (mean token embedding);
        zero, with a graph, under two distinct phrases. The embedding table is called on every micro-batch (ZeRO-3
        gathers in lockstep)."""
        rows, phrases = self.pooled(embeds, samples)
        distinct = sorted(set(phrases))
        ids = [self._phrase_ids(p) for p in distinct] or [[0]]
        table = model.get_input_embeddings()
        flat = torch.tensor([i for group in ids for i in group], device=embeds.device)
        token_embeds = table(flat)
        if len(distinct) < 2:
            return 0.0 * (token_embeds.sum() + embeds.sum())
        text = torch.stack([part.mean(0) for part in token_embeds.split([len(g) for g in ids])])
        sim = F.normalize(torch.stack(rows).float(), dim=-1) @ F.normalize(text.float(), dim=-1).T
        labels = torch.tensor([distinct.index(p) for p in phrases], device=embeds.device)
        return F.cross_entropy(sim / self.cfg.temperature, labels)
