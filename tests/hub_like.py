"""A checkpoint directory laid out like the hub's Qwen2.5-VL-*-Instruct: a legacy-format config.json (text settings
at the top level, `rope_scaling: {type: mrope}`, `torch_dtype`), weights in bf16 sharded over two safetensors
files under the hub's (pre-transformers-5) key names, the hub's generation_config.json. Built from a builtin's
random weights, so tests see what users' downloads look like without a download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from components._shared.model.sources import resolve_model

GENERATION_CONFIG = {  # Qwen/Qwen2.5-VL-*-Instruct generation_config.json, token ids of the world tokenizer
    "do_sample": True,
    "eos_token_id": [2, 0],
    "pad_token_id": 0,
    "repetition_penalty": 1.05,
    "temperature": 0.1,
    "top_p": 0.001,
    "top_k": 1,
    "transformers_version": "4.49.0",
}


def _hub_key(key: str) -> str:
    """transformers 5 names -> the hub's names (model.language_model.X -> model.X, model.visual.X -> visual.X)."""
    if key.startswith("model.visual."):
        return key.removeprefix("model.")
    return key.replace("model.language_model.", "model.", 1)


def write_hub_like(dest: Path, builtin: str = "builtin:tiny-qwen2_5-vl") -> Path:
    source = resolve_model(builtin)
    dest.mkdir(parents=True)
    for name in source.iterdir():
        if name.suffix not in (".safetensors",) and name.name not in ("config.json", "generation_config.json"):
            shutil.copy(name, dest / name.name) if name.is_file() else None
    state = {_hub_key(k): v.to(torch.bfloat16) for k, v in load_file(str(source / "model.safetensors")).items()}
    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    for file, part in halves.items():
        save_file({k: state[k].contiguous() for k in part}, str(dest / file), metadata={"format": "pt"})
    weight_map = {k: file for file, part in halves.items() for k in part}
    size = sum(v.numel() * v.element_size() for v in state.values())
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2)
    )
    (dest / "config.json").write_text(
        json.dumps(_legacy_config(json.loads((source / "config.json").read_text())), indent=2)
    )
    (dest / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    return dest


def _legacy_config(config: dict) -> dict:
    text = config["text_config"]
    rope = text["rope_parameters"]
    legacy = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2",
        **{
            k: text[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "max_position_embeddings",
                "rms_norm_eps",
                "hidden_act",
                "eos_token_id",
                "pad_token_id",
            )
        },
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "vision_config": {
            k: v for k, v in config["vision_config"].items() if k not in ("dtype", "model_type", "transformers_version")
        },
    }
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        legacy[key] = config[key]
    return legacy
