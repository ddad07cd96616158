"""Exact multimodal packing for every Qwen VL family: encode, plan micro-batches, pack, forward, per-sample loss.

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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from components._shared.model.attention import segment_lengths
from components._shared.model.chat import ChatTemplate
from components._shared.model.families import VisualTokens, family_for
from components._shared.model.families.qwen3_5 import packed_sample_lengths
from components._shared.model.pixels import PixelNorm, model_pixels
from components._shared.model.vlm import qwen_model

IGNORE_INDEX = -100
IMAGE_PLACEHOLDER = "<image>"


@dataclass
class Sample:
    """One tokenised conversation. `labels[t]` is token t itself on assistant turns, IGNORE_INDEX elsewhere."""

    input_ids: torch.Tensor  # (L,) int64
    labels: torch.Tensor  # (L,) int64
    position_ids: torch.Tensor  # (3, L) M-RoPE rows (temporal, height, width)
    image_grid_thw: torch.Tensor  # (n_images, 3) int64
    pixel_values: torch.Tensor | None = None  # (patches, C*T*P*P), processor layout: uint8 until the model
    pixel_norm: PixelNorm | None = None  # how model_pixels normalises uint8 rows (None: float rows, used as given)
    features: torch.Tensor | None = None  # (patches, vision hidden): cached pre-merger rows instead of pixels
    sample_id: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


class RopeIndex:
    """The model's own `get_rope_index` without a reference to the model: its class's method bound to an object
    that holds only the config (the method reads the config and calls sibling methods, never weights)."""

    def __init__(self, qwen) -> None:
        self.config, self._cls = qwen.config, type(qwen)

    def __getattr__(self, name: str):
        return getattr(self._cls, name).__get__(self)

    def __call__(self, *args, **kwargs):
        return self._cls.get_rope_index(self, *args, **kwargs)


class ConversationEncoder:
    """Turns (role, text) conversations with images into Samples, byte-identical to the checkpoint's chat template.

    A user turn holds `<image>` placeholders (LLaVA / ShareGPT style), one per image, in order; without any,
    the images go in front of the first user turn (Qwen's own order). The template is the processor's own
    (model/chat.py finds the assistant text in it); only assistant text and its end-of-turn token are labelled.
    A conversation's own first `system` turn is rendered as the template renders system messages (never trained);
    without one, `system_prompt=None` leaves the system turn to the template (Qwen2/2.5-VL add one, Qwen3 families
    do not).
    """

    def __init__(
        self,
        processor,
        model,
        *,
        min_pixels: int,
        max_pixels: int,
        max_length: int = 4096,
        system_prompt: str | None = None,
    ) -> None:
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.pixel_norm = PixelNorm.of(self.image_processor)  # None: the processor's float rows, as they come
        qwen = qwen_model(model)
        self.config = config = qwen.config
        self.rope_index = RopeIndex(qwen)  # not the model: an encoder must not keep a dropped model alive
        self.image_token_id = int(config.image_token_id)
        self.merge_unit = int(config.vision_config.spatial_merge_size) ** 2
        self.min_pixels, self.max_pixels, self.max_length = min_pixels, max_pixels, max_length
        self.system_prompt = system_prompt
        self.template = ChatTemplate(
            self.tokenizer,
            getattr(processor, "chat_template", None) or self.tokenizer.chat_template,
            end_of_turn="<|im_end|>",
            extra=family_for(config).template_kwargs,
        )
        self._specials = sorted(
            set(self.tokenizer.all_special_tokens) | {"<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>"}
        )

    def model_image_size(self, image) -> tuple[int, int]:
        """(width, height) of `image` as the model sees it, resized by the Qwen image processor's rule."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        factor = int(self.image_processor.patch_size) * int(self.image_processor.merge_size)
        height, width = smart_resize(
            image.height, image.width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        return width, height

    def box_frame(self, record: dict) -> dict:
        """The grounding scorer's frame of a question record with a pixel "box": the family's box convention, the
        image's size and the size the model sees it at ({} for records without a box)."""
        if record.get("box") is None:
            return {}
        return {
            "box_convention": family_for(self.config).grounding,
            "image_size": record["pil"].size,
            "model_size": self.model_image_size(record["pil"]),
        }

    def prepare_image(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel rows, grid_thw (3,)) of a PIL image, resized and patchified exactly as the Qwen image processor
        does; uint8 rows when `pixel_norm` is set (model_pixels normalises them where they reach the model)."""
        unnormalised = {"do_rescale": False, "do_normalize": False} if self.pixel_norm is not None else {}
        out = self.image_processor(
            images=[image],
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            return_tensors="pt",
            **unnormalised,
        )
        rows = out["pixel_values"]
        if self.pixel_norm is not None and rows.dtype != torch.uint8:
            raise TypeError(
                f"{type(self.image_processor).__name__} gave {rows.dtype} rows without rescale/normalise (uint8 "
                "expected); give it uint8 RGB images (PIL mode 'RGB')."
            )
        return rows, out["image_grid_thw"][0]

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
        self._check_control_tokens(turns, sample_id)
        messages = self._messages(turns, len(grid_list), sample_id)
        ids: list[int] = []
        labels: list[int] = []
        for text, trained in self.template.segments(messages, add_generation_prompt=add_generation_prompt):
            piece = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids.extend(piece)
            labels.extend(piece if trained else [IGNORE_INDEX] * len(piece))
        ids, labels = self._expand_images(ids, labels, grid_list, sample_id)
        if len(ids) > self.max_length:
            raise ValueError(
                f"sample {sample_id!r} has {len(ids)} tokens (text + visual), more than max_length="
                f"{self.max_length}; lower max_pixels or raise max_length."
            )
        grid = torch.stack(grid_list) if grid_list else torch.zeros((0, 3), dtype=torch.int64)
        return self._sample(ids, labels, grid, pixel_values, features, sample_id, meta)

    def _messages(self, turns: list[dict], n_images: int, sample_id: str) -> list[dict]:
        """Chat-template messages: user content as [image | text] parts at the placeholders, assistant as text."""
        messages: list[dict] = []
        if self.system_prompt is not None and not (turns and turns[0].get("role") == "system"):
            messages.append({"role": "system", "content": self.system_prompt})
        placed = 0
        for i, turn in enumerate(turns):
            role, text = turn.get("role"), turn.get("text")
            if role not in ("system", "user", "assistant") or not isinstance(text, str) or (role == "system" and i):
                raise ValueError(
                    f"sample {sample_id!r} turn {i}: expected role 'user' or 'assistant' (or 'system' first) with a "
                    f"text string, got role={role!r} text={type(text).__name__}."
                )
            if role in ("system", "assistant"):
                messages.append({"role": role, "content": text})
                continue
            parts = text.split(IMAGE_PLACEHOLDER)
            if len(parts) == 1 and placed == 0 and n_images:
                parts = [""] * n_images + [text]
            content: list[dict] = []
            for j, part in enumerate(parts):
                if j:
                    if placed >= n_images:
                        raise ValueError(
                            f"sample {sample_id!r}: more {IMAGE_PLACEHOLDER} placeholders than images ({n_images}); "
                            "give one image per placeholder."
                        )
                    content.append({"type": "image"})
                    placed += 1
                    part = part.removeprefix("\n")
                if part:
                    content.append({"type": "text", "text": part})
            messages.append({"role": "user", "content": content})
        if placed != n_images:
            raise ValueError(
                f"sample {sample_id!r}: {n_images} image(s) but {placed} {IMAGE_PLACEHOLDER} placeholder(s); "
                "put one placeholder per image in the user turns."
            )
        return messages

    def _expand_images(self, ids: list[int], labels: list[int], grids: list[torch.Tensor], sample_id: str):
        """Each image's single <|image_pad|> becomes its grid's number of visual tokens (as the processor does)."""
        slots = [k for k, token in enumerate(ids) if token == self.image_token_id]
        if len(slots) != len(grids):
            raise ValueError(
                f"sample {sample_id!r}: the chat template wrote {len(slots)} image slot(s) for {len(grids)} image(s)."
            )
        out_ids, out_labels, start = [], [], 0
        for slot, grid in zip(slots, grids, strict=True):
            n = int(grid.prod()) // self.merge_unit
            out_ids += [*ids[start:slot], *[self.image_token_id] * n]
            out_labels += [*labels[start:slot], *[IGNORE_INDEX] * n]
            start = slot + 1
        return out_ids + ids[start:], out_labels + labels[start:]

    def _sample(self, ids, labels, grid, pixel_values, features, sample_id: str, meta: dict | None) -> Sample:
        input_ids = torch.tensor(ids, dtype=torch.int64)
        return Sample(
            input_ids=input_ids,
            labels=torch.tensor(labels, dtype=torch.int64),
            position_ids=self.rope_positions(input_ids, grid),
            image_grid_thw=grid,
            pixel_values=pixel_values,
            pixel_norm=self.pixel_norm if pixel_values is not None else None,
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
        positions, _ = self.rope_index(input_ids[None], token_types[None], image_grid_thw=grid)
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


def forward_hidden(model, batch: dict, image_embeds: VisualTokens | None = None) -> torch.Tensor:
    """Last-layer hidden states (B, L, hidden) of the language model for a packed or padded batch (no lm_head)."""
    return _forward(qwen_model(model), batch, image_embeds).last_hidden_state


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
    with packed_sample_lengths(_packed_lengths(batch)):
        return model(input_ids=batch["input_ids"], **kwargs)


def _packed_lengths(batch: dict) -> list[int] | None:
    """The sample lengths of a packed row (4 position rows, the first restarting per sample), else None."""
    positions = batch["position_ids"]
    if batch["attention_mask"] is not None or positions.shape[0] != 4 or positions.shape[1] != 1:
        return None
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
