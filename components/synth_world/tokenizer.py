"""The world tokenizer and the Qwen-VL processors built on it (offline, no downloads).

A byte-level BPE is trained with `tokenizers` on the shapes world's text, using Qwen2's own
normalizer and pre-tokenizer, so it behaves like Qwen's tokenizer at a few hundred tokens. The
Qwen2-VL special tokens (same strings and order as Qwen2-VL's tokenizer_config, placed after the BPE
vocabulary the way Qwen places them) and the Qwen2-VL chat template are added. The result is a
`Qwen2Tokenizer`, and `build_processor` wraps it in a `Qwen2_5_VLProcessor` (or `Qwen2VLProcessor`) that
`AutoProcessor.from_pretrained(dir)` loads offline.

Visual tokens per image = (pixels / 14^2) / 2^2 after smart_resize; 112x112 with
min_pixels = max_pixels = 112*112 gives an 8x8 patch grid, i.e. 16 tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2-VL's added tokens, in its id order (151643..151656 there; right after the BPE vocab here).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL-Instruct's chat template (chat_template.json), verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenization regex (transformers/models/qwen2/tokenization_qwen2.py).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

# Text the chat template and common instructions add on top of the world's own words.
CHAT_TEXT: tuple[str, ...] = (
    "system\nYou are a helpful assistant.",
    "user\n",
    "assistant\n",
    "Describe the image. Describe this image briefly. What is in the picture?",
    "What color is the shape? What shape is it? How many shapes are there? Which word is written?",
    "Is it on the left or on the right? Answer with one word. Yes No",
    "0 1 2 3 4 5 6 7 8 9 10 ( ) [ ] , . : ; ? ! ' \" - _ / = + * %",
)

PATCH_SIZE = 14
MERGE_SIZE = 2
TINY_IMAGE_PIXELS = 112 * 112  # 8x8 patches of 14 px -> 16 visual tokens after the 2x2 merge


def world_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """The text the tokenizer learns from: every word the shapes world produces plus chat text."""
    from components.synth_world.world import text_corpus

    return list(text_corpus(n, seed)) + list(CHAT_TEXT)


def train_tokenizer(corpus: Iterable[str], *, vocab_size: int = 512):
    """Train a Qwen2-style byte-level BPE on `corpus`; returns a `Qwen2Tokenizer` with Qwen2-VL's specials.

    `vocab_size` counts the BPE vocabulary (256 byte symbols + merges); the 14 special tokens come on top.
    """
    from transformers import Qwen2Tokenizer

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is below the 256 byte symbols + 1; use 300..2000.")
    texts = [t for t in corpus if t]
    if not texts:
        raise ValueError("The tokenizer corpus is empty; pass the world's text_corpus (at least a few sentences).")

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)

    import json

    vocab = bpe.get_vocab()
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)})  # Qwen's order, after BPE
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]
    ]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS),
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
    )
    missing = [t for t in SPECIAL_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise RuntimeError(f"Special tokens did not register in the tokenizer: {missing}")
    return tokenizer


def build_processor(
    tokenizer,
    *,
    family: str = "qwen2_5_vl",
    min_pixels: int = TINY_IMAGE_PIXELS,
    max_pixels: int = TINY_IMAGE_PIXELS,
):
    """A Qwen-VL processor (image + video processor + `tokenizer` + chat template) for `family`.

    `family` is "qwen2_5_vl" or "qwen2_vl". min/max_pixels bound smart_resize; equal values pin every
    image to about that many pixels (112*112 -> 16 visual tokens).
    """
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    unit = (PATCH_SIZE * MERGE_SIZE) ** 2
    if min_pixels < unit or max_pixels < min_pixels:
        raise ValueError(
            f"min_pixels={min_pixels}, max_pixels={max_pixels}: need {unit} <= min_pixels <= max_pixels "
            f"(one merged 28x28 patch at least); the tiny recipe uses {TINY_IMAGE_PIXELS} for both."
        )
    processors = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen2_vl": Qwen2VLProcessor}
    if family not in processors:
        raise ValueError(f"Unknown processor family {family!r}; use one of {sorted(processors)}.")
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    common = {"size": size, "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": 2}
    return processors[family](
        image_processor=Qwen2VLImageProcessor(**common),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**common),
        chat_template=CHAT_TEMPLATE,
    )


def visual_tokens(
    height: int, width: int, *, min_pixels: int = TINY_IMAGE_PIXELS, max_pixels: int = TINY_IMAGE_PIXELS
) -> int:
    """How many <|image_pad|> tokens an image of this size becomes (Qwen2-VL smart_resize, 2x2 merge)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=PATCH_SIZE * MERGE_SIZE, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // PATCH_SIZE) * (w // PATCH_SIZE) // (MERGE_SIZE**2)
