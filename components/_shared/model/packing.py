"""Exact multimodal packing for Qwen2-VL / Qwen2.5-VL: encode, plan micro-batches, pack, forward, per-sample loss.

Written by hand because no library packs *multimodal* Qwen samples exactly: the LM needs per-sample M-RoPE
positions (3 rows from `get_rope_index`) plus a 4th row of text positions that restart per sample, so that
transformers builds a block-causal mask from them (`attention_mask=None`, `use_cache=False`; with the cache
on, samples leak into each other). The ViT already keeps images apart (cu_seqlens per image).

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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from components._shared.model.vlm import qwen_model

IGNORE_INDEX = -100
IMAGE_PLACEHOLDER = "<image>"
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass
class Sample:
    """One tokenised conversation. `labels[t]` is token t itself on assistant turns, IGNORE_INDEX elsewhere."""

    input_ids: torch.Tensor  # (L,) int64
    labels: torch.Tensor  # (L,) int64
    position_ids: torch.Tensor  # (3, L) M-RoPE rows (temporal, height, width)
    image_grid_thw: torch.Tensor  # (n_images, 3) int64
    pixel_values: torch.Tensor | None = None  # (patches, C*T*P*P), processor layout
    features: torch.Tensor | None = None  # (patches, vision hidden): cached pre-merger rows instead of pixels
    sample_id: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


class ConversationEncoder:
    """Turns (role, text) conversations with images into Samples, byte-identical to the Qwen chat template.

    A user turn holds `<image>` placeholders (LLaVA / ShareGPT style), one per image, in order; without any,
    the images go in front of the first user turn (Qwen's own order). Only assistant text and its <|im_end|>
    are labelled.
    """

    def __init__(
        self,
        processor,
        model,
        *,
        min_pixels: int,
        max_pixels: int,
        max_length: int = 4096,
        system_prompt: str = DEFAULT_SYSTEM,
    ) -> None:
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.qwen = qwen_model(model)
        config = self.qwen.config
        self.image_token_id = int(config.image_token_id)
        self.merge_unit = int(config.vision_config.spatial_merge_size) ** 2
        self.min_pixels, self.max_pixels, self.max_length = min_pixels, max_pixels, max_length
        self.system_prompt = system_prompt
        self._vision_start = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self._vision_end = self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        self._specials = sorted(
            set(self.tokenizer.all_special_tokens) | {"<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>"}
        )

    def prepare_image(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, grid_thw (3,)) of a PIL image, resized exactly as the Qwen image processor does."""
        out = self.image_processor(
            images=[image],
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            return_tensors="pt",
        )
        return out["pixel_values"], out["image_grid_thw"][0]

    def encode(
        self,
        turns: list[dict],
        *,
        images=(),
        grids=None,
        features=None,
        sample_id: str = "",
        add_generation_prompt: bool = False,
        meta: dict | None = None,
    ) -> Sample:
        """Encode `turns` ([{"role": "user"|"assistant", "text": ...}]) with PIL `images`, or with `grids` and
        cached `features` (pre-merger rows per image) instead of pixels; `grids` alone leaves the visual rows to
        be passed to forward_logits as `image_embeds`."""
        pixel_values, grid_list = self._visual_inputs(images, grids)
        ids: list[int] = []
        labels: list[int] = []

        def add(text: str, *, train: bool) -> None:
            piece = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids.extend(piece)
            labels.extend(piece if train else [IGNORE_INDEX] * len(piece))

        self._check_control_tokens(turns, sample_id)
        add(f"<|im_start|>system\n{self.system_prompt}<|im_end|>\n", train=False)
        placed = 0
        for i, turn in enumerate(turns):
            role, text = turn.get("role"), turn.get("text")
            if role not in ("user", "assistant") or not isinstance(text, str):
                raise ValueError(
                    f"sample {sample_id!r} turn {i}: expected role 'user' or 'assistant' with a text string, got "
                    f"role={role!r} text={type(text).__name__}."
                )
            if role == "assistant":
                add("<|im_start|>assistant\n", train=False)
                add(f"{text}<|im_end|>", train=True)
                add("\n", train=False)
                continue
            add("<|im_start|>user\n", train=False)
            parts = text.split(IMAGE_PLACEHOLDER)
            if len(parts) == 1 and placed == 0 and grid_list:
                parts = [""] * (len(grid_list) + 1)
                parts[-1] = text
            for j, part in enumerate(parts):
                if j:
                    if placed >= len(grid_list):
                        raise ValueError(
                            f"sample {sample_id!r}: more {IMAGE_PLACEHOLDER} placeholders than images "
                            f"({len(grid_list)}); give one image per placeholder."
                        )
                    n = int(grid_list[placed].prod()) // self.merge_unit
                    ids.extend([self._vision_start, *[self.image_token_id] * n, self._vision_end])
                    labels.extend([IGNORE_INDEX] * (n + 2))
                    placed += 1
                    part = part.removeprefix("\n")
                add(part, train=False)
            add("<|im_end|>\n", train=False)
        if placed != len(grid_list):
            raise ValueError(
                f"sample {sample_id!r}: {len(grid_list)} image(s) but {placed} {IMAGE_PLACEHOLDER} placeholder(s); "
                "put one placeholder per image in the user turns."
            )
        if add_generation_prompt:
            add("<|im_start|>assistant\n", train=False)
        if len(ids) > self.max_length:
            raise ValueError(
                f"sample {sample_id!r} has {len(ids)} tokens (text + visual), more than max_length="
                f"{self.max_length}; lower max_pixels or raise max_length."
            )
        grid = torch.stack(grid_list) if grid_list else torch.zeros((0, 3), dtype=torch.int64)
        return self._sample(ids, labels, grid, pixel_values, features, sample_id, meta)

    def _sample(self, ids, labels, grid, pixel_values, features, sample_id: str, meta: dict | None) -> Sample:
        input_ids = torch.tensor(ids, dtype=torch.int64)
        return Sample(
            input_ids=input_ids,
            labels=torch.tensor(labels, dtype=torch.int64),
            position_ids=self.rope_positions(input_ids, grid),
            image_grid_thw=grid,
            pixel_values=pixel_values,
            features=None if features is None else torch.cat(list(features)),
            sample_id=sample_id,
            meta=dict(meta or {}),
        )

    def _visual_inputs(self, images, grids) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """(pixel rows or None, one (t, h, w) grid per image): from PIL images, or from given grids (cached
        features, or image tokens only with the visual rows supplied at forward time)."""
        if grids is not None:
            return None, [torch.as_tensor(g, dtype=torch.int64) for g in grids]
        prepared = [self.prepare_image(img) for img in images]
        return (torch.cat([p for p, _ in prepared]) if prepared else None), [g for _, g in prepared]

    def _check_control_tokens(self, turns: list[dict], sample_id: str) -> None:
        for i, turn in enumerate(turns):
            text = turn.get("text")
            found = [t for t in self._specials if isinstance(text, str) and t in text]
            if found:
                raise ValueError(
                    f"sample {sample_id!r} turn {i}: the text contains the control token(s) {found}; they would be "
                    "read as chat-template / image markers. Remove them from the data (use <image> for images)."
                )

    def rope_positions(self, input_ids: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The model's own M-RoPE positions (3, L) for one unpadded sample."""
        if grid.numel() == 0:
            return torch.arange(input_ids.numel()).expand(3, -1).clone()
        token_types = (input_ids == self.image_token_id).to(torch.int32)
        positions, _ = self.qwen.get_rope_index(input_ids[None], token_types[None], image_grid_thw=grid)
        return positions[:, 0]


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
        out["pixel_values"] = torch.cat([s.pixel_values for s in samples if s.pixel_values is not None])
    return out


def pack(samples: list[Sample]) -> dict:
    """One packed row: input_ids/targets/seq_index (1, L), position_ids (4, 1, L), vision inputs concatenated."""
    if not samples:
        raise ValueError("pack() needs at least one sample.")
    text_positions = torch.cat([torch.arange(s.num_tokens) for s in samples])
    mrope = torch.cat([s.position_ids for s in samples], dim=1)
    return {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "targets": torch.cat([_targets(s.labels) for s in samples])[None],
        "seq_index": torch.cat([torch.full((s.num_tokens,), i) for i, s in enumerate(samples)])[None],
        "position_ids": torch.cat([text_positions[None], mrope])[:, None, :],
        "attention_mask": None,
        "num_samples": len(samples),
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
    """The batch with its tensors on `device` (counts and None values pass through)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def batch_tokens(batch: dict) -> tuple[int, int]:
    """(real tokens, slots) of a packed or padded batch; slots = batch x width."""
    real = int((batch["seq_index"] >= 0).sum())
    return real, int(batch["input_ids"].numel())


def image_embeddings(model, batch: dict) -> torch.Tensor | None:
    """Merged visual tokens (n_image_tokens, hidden) of a batch: merger(cached features) or the full ViT."""
    qwen = qwen_model(model)
    if "features" in batch:
        return qwen.visual.merger(batch["features"].to(qwen.visual.merger.mlp[0].weight.dtype))
    if "pixel_values" in batch:
        return torch.cat(list(qwen.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output))
    return None


def forward_logits(model, batch: dict, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, L, V) of a packed or padded batch.

    Pixels go through the model's own forward; cached features (merger only) or precomputed `image_embeds`
    are spliced into the input embeddings at the image tokens.
    """
    return _forward(model, batch, image_embeds).logits


def forward_hidden(model, batch: dict, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Last-layer hidden states (B, L, hidden) of the language model for a packed or padded batch (no lm_head)."""
    return _forward(qwen_model(model), batch, image_embeds).last_hidden_state


def forward_outputs(model, batch: dict, **flags):
    """The model's full output for a packed or padded batch; `flags` go to the forward (e.g. output_hidden_states,
    output_attentions: the latter needs eager attention)."""
    return _forward(model, batch, None, **flags)


def _forward(model, batch: dict, image_embeds: torch.Tensor | None, **flags):
    kwargs = {
        "position_ids": batch["position_ids"],
        "attention_mask": batch["attention_mask"],
        "use_cache": False,
        **flags,
    }
    if image_embeds is None and "features" in batch:
        image_embeds = image_embeddings(model, batch)
    if image_embeds is not None:
        qwen = qwen_model(model)
        embeds = model.get_input_embeddings()(batch["input_ids"])
        mask = batch["input_ids"] == qwen.config.image_token_id
        if int(mask.sum()) != image_embeds.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} image tokens but {image_embeds.shape[0]} merged visual rows; the cached features "
                "were extracted with other min_pixels/max_pixels than the encoder's."
            )
        embeds = embeds.masked_scatter(mask[..., None], image_embeds.to(embeds.dtype))
        return model(inputs_embeds=embeds, **kwargs)
    vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
    return model(input_ids=batch["input_ids"], **vision, **kwargs)


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
