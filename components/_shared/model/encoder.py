"""Samples and the conversation encoder: (role, text) turns with images -> a tokenised `Sample` with per-sample
M-RoPE positions, byte-identical to the checkpoint's chat template, labels only on assistant turns.

    encoder = ConversationEncoder(processor, model, min_pixels=..., max_pixels=...)
    sample = encoder.encode(turns, images=[img])

packing.py packs Samples into micro-batches and runs the model on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from components._shared.model.chat import ChatTemplate
from components._shared.model.families import family_for
from components._shared.model.pixel_norm import PixelNorm
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


@dataclass(frozen=True)
class _Size:
    """An image's size where only its header was read (model_image_size reads .width and .height)."""

    width: int
    height: int


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
        self._skeletons: dict[tuple, int] = {}  # token_bound's counts of conversations with empty texts, by shape
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
        ids, labels = self._tokens(turns, grid_list, sample_id, add_generation_prompt)
        grid = torch.stack(grid_list) if grid_list else torch.zeros((0, 3), dtype=torch.int64)
        return self._sample(ids, labels, grid, pixel_values, features, sample_id, meta)

    def count_tokens(
        self, turns: list[dict], image_sizes=(), *, sample_id: str = "", add_generation_prompt: bool = False
    ) -> int:
        """The tokens `encode` would give `turns` with images of these (width, height) sizes (None: not known,
        counted at min_pixels), without decoding an image; raises what `encode` raises (over max_length, ...)."""
        grids = [self.grid_for_size(size) for size in image_sizes]
        return len(self._tokens(turns, grids, sample_id, add_generation_prompt)[0])

    def token_bound(self, turns: list[dict], image_sizes=()) -> int:
        """An upper bound of `count_tokens(turns, image_sizes)` that neither renders nor tokenizes the texts: the
        tokens of the same conversation with empty texts (counted once per shape of turns, then cached), each
        text's UTF-8 bytes (a byte-level BPE token covers at least one byte) plus 8 for merges at its edges, and
        the images' visual tokens. model/length_check.py counts exactly only records this does not clear."""
        self._check_control_tokens(turns, "")
        marked = any(t.get("role") == "user" and IMAGE_PLACEHOLDER in str(t.get("text")) for t in turns)
        first_user = next((i for i, t in enumerate(turns) if t.get("role") == "user"), -1)  # unmarked images go there
        shape = tuple(
            (
                t.get("role"),
                str(t.get("text")).count(IMAGE_PLACEHOLDER) if marked else len(image_sizes) * (i == first_user),
            )
            for i, t in enumerate(turns)
        )
        if shape not in self._skeletons:
            empty = [{"role": role, "text": IMAGE_PLACEHOLDER * n} for role, n in shape]
            one_patch = [torch.tensor([1, 1, self.merge_unit])] * sum(n for _, n in shape)  # one visual token each
            self._skeletons[shape] = len(self._tokens(empty, one_patch, "", False)[0]) - len(one_patch)
        visual = sum(int(self.grid_for_size(size).prod()) // self.merge_unit for size in image_sizes)
        texts = sum(len(str(t.get("text")).encode()) + 8 for t in turns)
        return self._skeletons[shape] + visual + texts

    def grid_for_size(self, size: tuple[int, int] | None) -> torch.Tensor:
        """The (t, h, w) patch grid the image processor gives an image of `size` (width, height): one frame."""
        factor = int(self.image_processor.patch_size) * int(self.image_processor.merge_size)
        width, height = size or (factor, factor)
        model_width, model_height = self.model_image_size(_Size(width, height))
        patch = int(self.image_processor.patch_size)
        return torch.tensor([1, model_height // patch, model_width // patch], dtype=torch.int64)

    def _tokens(
        self, turns: list[dict], grid_list: list[torch.Tensor], sample_id: str, add_generation_prompt: bool
    ) -> tuple[list[int], list[int]]:
        """(input ids, labels) of `turns` with one image of each grid; over max_length is a ValueError."""
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
        return ids, labels

    def _messages(self, turns: list[dict], n_images: int, sample_id: str) -> list[dict]:
        """Chat-template messages: user content as [image | text] parts at the placeholders, assistant as text."""
        messages: list[dict] = []
        if self.system_prompt is not None and not (turns and turns[0].get("role") == "system"):
            messages.append({"role": "system", "content": self.system_prompt})
        placed = 0
        # a record without any marker gets its images at the first user turn; with markers, where they are
        marked = any(t.get("role") == "user" and IMAGE_PLACEHOLDER in str(t.get("text")) for t in turns)
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
            if len(parts) == 1 and placed == 0 and n_images and not marked:
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
