"""Exact multimodal packing for every Qwen VL family: plan micro-batches, pack, forward, per-sample loss (the
samples come from encoder.py).

Written by hand because no library packs *multimodal* Qwen samples exactly: the LM needs per-sample M-RoPE
positions (3 rows from `get_rope_index`) plus a 4th row of text positions that restart per sample, so that
transformers builds a block-causal mask from them (`attention_mask=None`, `use_cache=False`; with the cache
on, samples leak into each other). The ViT already keeps images apart (cu_seqlens per image). Families whose LM
has recurrent layers (Qwen3.5's linear attention) get the sample lengths too (`Family.prepare_packing`).

    encoder = ConversationEncoder(processor, model, min_pixels=..., max_pixels=...)
    samples = [encoder.encode(turns, images=[img]) for ...]           # labels only on assistant turns
    for group in plan_micro_batches([s.num_tokens for s in samples], max_tokens=4096):   # first-fit-decreasing
        batch = pack([samples[i] for i in group])
        logits = forward_logits(model, batch)
        loss_sum, n_targets = token_loss(logits, batch)

`pad()` builds the conventional right-padded batch of the same samples (the baseline of bench/packing.py and
the reference of the exactness test).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from components._shared.model.attention import packed_row, segment_lengths
from components._shared.model.encoder import IGNORE_INDEX, Sample
from components._shared.model.families import VisualTokens, family_for
from components._shared.model.pixel_norm import model_pixels
from components._shared.model.vlm import qwen_model


def plan_micro_batches(costs: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bins of sample indices whose summed cost stays within `max_tokens`.

    Deterministic (ties keep input order); each bin lists indices in ascending order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1.")
    too_long = [(i, c) for i, c in enumerate(costs) if c > max_tokens]
    if too_long:
        i, c = too_long[0]
        raise ValueError(
            f"sample #{i} has {c} tokens, more than the micro-batch budget max_tokens={max_tokens}; raise "
            "max_tokens_per_micro_batch or lower max_pixels / max_length."
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        for b, free in enumerate(room):
            if costs[i] <= free:
                bins[b].append(i)
                room[b] -= costs[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - costs[i])
    return [sorted(b) for b in bins]


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets of one sample: targets[t] = labels[t+1], IGNORE_INDEX at the last position."""
    return torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])


def _vision_inputs(samples: list[Sample]) -> dict:
    out: dict = {"image_grid_thw": torch.cat([s.image_grid_thw for s in samples])}
    if any(s.features is not None for s in samples):
        if not all(s.features is not None or s.image_grid_thw.numel() == 0 for s in samples):
            raise ValueError("a micro-batch mixes cached features and pixels; use one image source per stage.")
        out["features"] = torch.cat([s.features for s in samples if s.features is not None])
    elif any(s.pixel_values is not None for s in samples):
        rows = [s.pixel_values for s in samples if s.pixel_values is not None]
        norms = {s.pixel_norm for s in samples if s.pixel_values is not None}
        if len(norms) > 1 or len({r.dtype for r in rows}) > 1:
            raise ValueError("a micro-batch mixes pixel rows of different image processors; use one encoder per stage.")
        out["pixel_values"] = torch.cat(rows)
        out["pixel_norm"] = norms.pop()
    return out


def pack(samples: list[Sample]) -> dict:
    """One packed row: input_ids/targets/seq_index (1, L), position_ids (4, 1, L), vision inputs concatenated."""
    if not samples:
        raise ValueError("pack() needs at least one sample.")
    text_positions = torch.cat([torch.arange(s.num_tokens) for s in samples])
    mrope = torch.cat([s.position_ids for s in samples], dim=1)
    targets = torch.cat([_targets(s.labels) for s in samples])[None]
    lengths = [s.num_tokens for s in samples]
    return {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "targets": targets,
        "seq_index": torch.cat([torch.full((s.num_tokens,), i) for i, s in enumerate(samples)])[None],
        "position_ids": torch.cat([text_positions[None], mrope])[:, None, :],
        "attention_mask": None,
        "num_samples": len(samples),
        # Found here, on the host, so the forward reads nothing back from the device (attention.packed_row).
        "sample_lengths": lengths,
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "target_positions": torch.nonzero(targets.flatten() != IGNORE_INDEX).flatten(),
        **_vision_inputs(samples),
    }


def pad(samples: list[Sample], pad_token_id: int) -> dict:
    """The conventional right-padded batch (B, L_max) of the same samples, with an attention mask."""
    if not samples:
        raise ValueError("pad() needs at least one sample.")
    width = max(s.num_tokens for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.int64)
    targets = torch.full((batch, width), IGNORE_INDEX, dtype=torch.int64)
    seq_index = torch.full((batch, width), -1, dtype=torch.int64)
    attention = torch.zeros((batch, width), dtype=torch.int64)
    positions = torch.ones((3, batch, width), dtype=torch.int64)
    for b, s in enumerate(samples):
        n = s.num_tokens
        input_ids[b, :n], targets[b, :n], seq_index[b, :n] = s.input_ids, _targets(s.labels), b
        attention[b, :n] = 1
        positions[:, b, :n] = s.position_ids
    return {
        "input_ids": input_ids,
        "targets": targets,
        "seq_index": seq_index,
        "position_ids": positions,
        "attention_mask": attention,
        "num_samples": batch,
        **_vision_inputs(samples),
    }


def to_device(batch: dict, device) -> dict:
    """The batch with its tensors on `device` (counts and None values pass through); pinned tensors (a data
    worker's prepared step) are copied asynchronously, ordered before their use on the device's stream."""
    return {k: v.to(device, non_blocking=v.is_pinned()) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def batch_pixels(batch: dict) -> torch.Tensor:
    """The batch's pixel rows as the vision tower reads them (uint8 rows normalised where they are, on the device)."""
    return model_pixels(batch["pixel_values"], batch.get("pixel_norm"))


def generation_vision_inputs(samples: list[Sample], device) -> dict:
    """pixel_values (copied as stored, normalised on `device`) and image_grid_thw of samples, for generate(); {} when
    none has pixels."""
    vision = _vision_inputs(samples)
    if "pixel_values" not in vision:
        return {}
    vision = to_device(vision, device)
    return {"pixel_values": batch_pixels(vision), "image_grid_thw": vision["image_grid_thw"]}


def batch_tokens(batch: dict) -> tuple[int, int]:
    """(real tokens, slots) of a packed or padded batch; slots = batch x width."""
    real = int((batch["seq_index"] >= 0).sum())
    return real, int(batch["input_ids"].numel())


def image_embeddings(model, batch: dict) -> VisualTokens | None:
    """The batch's visual tokens (merged rows, + DeepStack levels): the mergers on cached features, or the ViT."""
    qwen = qwen_model(model)
    family = family_for(qwen.config)
    if "features" in batch:
        return family.visual_tokens(qwen.visual, batch["features"])
    if "pixel_values" in batch:
        return family.pixel_tokens(qwen, batch_pixels(batch), batch["image_grid_thw"])
    return None


def forward_logits(model, batch: dict, image_embeds: VisualTokens | None = None) -> torch.Tensor:
    """Logits (B, L, V) of a packed or padded batch.

    Pixels go through the model's own forward; cached features (mergers only) or precomputed `image_embeds`
    reach the model as its `mm_encoder_outputs`, so each family places them (and DeepStack's levels) itself.
    """
    return _forward(model, batch, image_embeds).logits


def forward_hidden(
    model, batch: dict, image_embeds: VisualTokens | None = None, router: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Last-layer hidden states (B, L, hidden) of the language model for a packed or padded batch (no lm_head);
    with a `router` list (a model with experts), each MoE layer's router logits are appended to it."""
    flags = {"output_router_logits": True} if router is not None else {}
    out = _forward(qwen_model(model), batch, image_embeds, **flags)
    if router is not None:
        router.extend(getattr(out, "router_logits", None) or ())
    return out.last_hidden_state


def forward_outputs(model, batch: dict, *, lm_head: bool = True, **flags):
    """The model's full output for a packed or padded batch (without `lm_head`: the language model's, with
    last_hidden_state and no logits); `flags` go to the forward (e.g. output_hidden_states, output_attentions: the
    latter needs eager attention)."""
    return _forward(model if lm_head else qwen_model(model), batch, None, **flags)


def _forward(model, batch: dict, image_embeds: VisualTokens | None, **flags):
    qwen = qwen_model(model)
    family = family_for(qwen.config)
    family.prepare_packing(qwen)
    kwargs = {
        "position_ids": batch["position_ids"],
        "attention_mask": batch["attention_mask"],
        "use_cache": False,
        **flags,
    }
    if image_embeds is None and "features" in batch:
        image_embeds = image_embeddings(model, batch)
    if image_embeds is not None:
        n_tokens = int((batch["input_ids"] == qwen.config.image_token_id).sum())
        if n_tokens != image_embeds.embeds.shape[0]:
            raise ValueError(
                f"{n_tokens} image tokens but {image_embeds.embeds.shape[0]} merged visual rows; the cached "
                "features were extracted with other min_pixels/max_pixels than the encoder's."
            )
        kwargs["mm_encoder_outputs"] = {"image": family.encoder_output(image_embeds)}
    else:
        if "image_grid_thw" in batch:
            kwargs["image_grid_thw"] = batch["image_grid_thw"]
        if "pixel_values" in batch:
            kwargs["pixel_values"] = batch_pixels(batch)
    with family.packed_samples(_packed_lengths(batch) if family.needs_sample_lengths else None), packed_row(batch):
        return model(input_ids=batch["input_ids"], **kwargs)


def _packed_lengths(batch: dict) -> list[int] | None:
    """The sample lengths of a packed row (4 position rows, the first restarting per sample), else None."""
    positions = batch["position_ids"]
    if batch["attention_mask"] is not None or positions.shape[0] != 4 or positions.shape[1] != 1:
        return None
    given = batch.get("sample_lengths")
    if given is not None:  # pack() gave them: no read from the device
        return list(given) if len(given) > 1 else None
    return segment_lengths(positions[0])


def token_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, int]:
    """(summed cross-entropy over target tokens, number of target tokens) of one micro-batch."""
    targets = batch["targets"].to(logits.device).flatten()
    valid = targets != IGNORE_INDEX  # select first: only target rows of the (L, V) logits go to fp32
    losses = F.cross_entropy(logits.flatten(0, 1)[valid].float(), targets[valid], reduction="sum")
    return losses, int(valid.sum())


def per_sample_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Mean target-token cross-entropy of each sample, (num_samples,), for packed and padded batches alike."""
    targets = batch["targets"].to(logits.device).flatten()
    seq = batch["seq_index"].to(logits.device).flatten()
    valid = (targets != IGNORE_INDEX) & (seq >= 0)
    token = F.cross_entropy(logits.flatten(0, 1)[valid].float(), targets[valid], reduction="none")
    n = batch["num_samples"]
    sums = torch.zeros(n, device=logits.device).index_add_(0, seq[valid], token)
    counts = torch.zeros(n, device=logits.device).index_add_(0, seq[valid], torch.ones_like(token))
    return sums / counts.clamp_min(1)
