"""What every record's text must be before a tokenizer sees it, and the error a bad record raises."""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")
_BIDI_OVERRIDE = re.compile("[\u202a-\u202e]")  # embeddings, overrides and their POP DIRECTIONAL FORMATTING
_TAG = re.compile("[\U000e0000-\U000e007f]")  # Unicode tag characters: ASCII text that draws nothing
# C0 controls, DEL and C1 controls (U+0085 NEL among them); tab, line feed and carriage return are text
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# The Qwen VL tokenizers' special tokens (Qwen2-VL's added tokens, shared by Qwen2.5-VL, Qwen3-VL and Qwen3.5; the
# synthetic world's tokenizer has the same). model/encoder.py's ConversationEncoder refuses text holding any of them
# (with the checkpoint's own special tokens) when it encodes; the readers refuse such records here, before training.
CONTROL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip


class RecordError(ValueError):
    """A record that cannot be used; the message says why and how to fix it."""


def check_text(text: str, where: str) -> str:
    """`text` unchanged, or a RecordError naming `where` when the tokenizer would stop on it mid-run: a chat control
    token (read as template structure) or a lone surrogate (not text; a broken \\u escape in the JSON)."""
    found = [token for token in CONTROL_TOKENS if token in text]
    if found:
        raise RecordError(
            f"{where}: the text holds the chat control token(s) {found}, which the chat template would read as "
            "structure; remove them from the data"
        )
    surrogate = _SURROGATE.search(text)
    if surrogate:
        raise RecordError(
            f"{where}: a lone surrogate {surrogate.group()!r} at character {surrogate.start()} (a broken \\u escape), "
            "which no tokenizer can encode; fix the escape or re-export the file"
        )
    control = _CONTROL.search(text)
    if control:
        raise RecordError(
            f"{where}: a control character U+{ord(control.group()):04X} at character {control.start()} (binary data or "
            "a broken export; a tokenizer would train on it as text); remove it or re-export the file"
        )
    override = _BIDI_OVERRIDE.search(text)
    if override:
        raise RecordError(
            f"{where}: a bidirectional embedding or override U+{ord(override.group()):04X} at character "
            f"{override.start()}, which shows the text in an order other than the one trained on (natural "
            "right-to-left text needs none: marks and isolates are kept); remove it"
        )
    tag = _TAG.search(text)
    if tag:
        raise RecordError(
            f"{where}: a Unicode tag character U+{ord(tag.group()):04X} at character {tag.start()}: tags carry ASCII "
            "text that no reader sees (a hidden instruction, or a flag emoji's letters); remove them"
        )
    return text
