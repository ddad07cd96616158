"""What a server can load: the checks on the champion's files, the structural check of its weights against its own
config (on the meta device, headers only), and the rewrite in the serving dtype, shard by shard.

Pickled weights are never opened; tensors are read only through safetensors, one output shard at a time.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
CASTABLE = {"F64", "F32", "F16", "BF16"}  # safetensors dtype tags of plain floating tensors (fp8 etc. kept as is)
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TAGS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


@dataclass(frozen=True)
class Tensor:
    name: str
    file: str
    dtype: str  # safetensors tag (F32, BF16, I64 ...)
    shape: tuple[int, ...]

    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def weight_files(model_dir: Path) -> list[str]:
    """The champion's weight files (its index's, else model.safetensors), after refusing what a server cannot load:
    a LoRA adapter, pickled weights, stray or missing safetensors. The errors name the file and the fix."""
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: no config.json; pass select_checkpoint's output directory (it holds model/).")
    everything = sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file())
    adapters = [f for f in everything if Path(f).name in ADAPTER_FILES or Path(f).name.startswith("adapter_model.")]
    if adapters:
        raise ValueError(
            f"{model_dir / adapters[0]}: a LoRA adapter ({adapters}); a serving runtime (vLLM) cannot load a vision "
            "LoRA. Merge it first (peft: model.merge_and_unload(), then save_pretrained) and promote the merged model."
        )
    pickled = [f for f in everything if Path(f).suffix.lower() in PICKLE_SUFFIXES]
    if pickled:
        raise ValueError(
            f"{model_dir / pickled[0]}: pickle-format weights {pickled} (loading them can run code; they are never "
            "opened here). Re-save the model with save_pretrained (safetensors) and remove those files."
        )
    present = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if (model_dir / INDEX).is_file():
        files = sorted(set(json.loads((model_dir / INDEX).read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"] if "model.safetensors" in present else []
    if not present or not files:
        raise ValueError(
            f"{model_dir}: no safetensors weights ({'found ' + ', '.join(present) if present else 'none at all'}; "
            f"expected model.safetensors or {INDEX} and its shards); save the model with save_pretrained."
        )
    missing = [f for f in files if f not in present]
    stray = [f for f in present if f not in files]
    if missing or stray:
        raise ValueError(
            f"{model_dir}: {'shards listed in ' + INDEX + ' are missing: ' + str(missing) if missing else ''}"
            f"{'; ' if missing and stray else ''}{'weight files no index lists: ' + str(stray) if stray else ''}; a "
            "server would load the wrong set. Copy the complete checkpoint (every shard and the index), nothing else."
        )
    return files


def read_headers(model_dir: Path, files: list[str]) -> list[Tensor]:
    """Every tensor's name, file, dtype and shape, from the safetensors headers only; refuses LoRA tensors."""
    from safetensors import SafetensorError, safe_open

    tensors = []
    for file in files:
        try:
            with safe_open(str(model_dir / file), framework="pt") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    tensors.append(Tensor(name, file, view.get_dtype(), tuple(view.get_shape())))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{model_dir / file} is not a readable safetensors file ({err}); re-save it.") from None
    lora = [t.name for t in tensors if "lora_" in t.name]
    if lora:
        raise ValueError(
            f"{model_dir / next(t.file for t in tensors if 'lora_' in t.name)}: {len(lora)} LoRA tensor(s) such as "
            f"{lora[:3]}: an unmerged adapter a server cannot load. Merge it (peft merge_and_unload) and save again."
        )
    return tensors


def check_structure(model_dir: Path, tensors: list[Tensor]) -> None:
    """Compare the weights with the model its config.json builds (meta device: no memory, no weights loaded), key
    names mapped the way transformers maps them when loading; the error lists missing, unexpected and mis-shaped
    tensors. Tied weights (lm_head with tie_word_embeddings) may be absent."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=False)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    found, unexpected, misshaped, converted = set(), [], [], set()
    for tensor in tensors:
        name, pattern = rename_source_key(tensor.name, renamings, converters, model.base_model_prefix, expected)
        if name not in expected:
            unexpected.append(tensor.name)
        elif pattern is not None:  # a converter fuses / splits it on load: its shape is the converter's business
            converted.add(name)
        elif expected[name] != tensor.shape:
            misshaped.append(f"{tensor.name} {list(tensor.shape)} (config: {list(expected[name])})")
        found.add(name)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(expected) - found - tied - converted)
    if missing or unexpected or misshaped:
        raise ValueError(
            f"{model_dir}: the weights do not fit the model its config.json describes "
            f"({type(model).__name__}): {len(missing)} missing {missing[:5]}, {len(unexpected)} unexpected "
            f"{unexpected[:5]}, {len(misshaped)} mis-shaped {misshaped[:5]}. A server would refuse it or serve random "
            "weights; promote a complete checkpoint whose config matches it (select_checkpoint's model/)."
        )


def serving_tag(tensors: list[Tensor], dtype: str) -> str:
    """The safetensors tag floating tensors get: the setting's, or for auto the champion's most common one."""
    if dtype != "auto":
        return TAGS[dtype]
    floating = [t.dtype for t in tensors if t.dtype in CASTABLE]
    return max(set(floating), key=floating.count) if floating else "F32"


def plan_shards(tensors: list[Tensor], dtype: str, max_bytes: int) -> list[list[Tensor]]:
    """Tensors in name order, grouped into shards of at most `max_bytes` (a bigger tensor gets a shard alone)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for tensor in sorted(tensors, key=lambda t: t.name):
        nbytes = output_bytes(tensor, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def output_bytes(tensor: Tensor, dtype: str) -> int:
    tag = TAGS[dtype] if dtype != "auto" and tensor.dtype in CASTABLE else tensor.dtype
    return tensor.numel() * SIZES.get(tag, 1)


def write_weights(model_dir: Path, tensors: list[Tensor], out_dir: Path, dtype: str, max_bytes: int) -> list[str]:
    """Write the weights into `out_dir` in `dtype` (floating tensors cast, the others kept), shard by shard, with an
    index when there is more than one; returns the file names. Refuses non-finite values and a cast that overflows."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = plan_shards(tensors, dtype, max_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    handles = {f: safe_open(str(model_dir / f), framework="pt") for f in sorted({t.file for t in tensors})}
    weight_map, total = {}, 0
    for shard, file in zip(shards, names, strict=True):
        data = {tensor.name: _cast(handles[tensor.file].get_tensor(tensor.name), tensor, dtype) for tensor in shard}
        save_file(data, str(out_dir / file), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in data.values())
        weight_map.update({name: file for name in data})
        del data
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names


def _cast(value: torch.Tensor, tensor: Tensor, dtype: str) -> torch.Tensor:
    if tensor.dtype not in CASTABLE:
        return value.contiguous()
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"tensor {tensor.name} ({tensor.file}) holds inf / nan: the training diverged; not promoted.")
    if dtype == "auto":
        return value.contiguous()
    cast = value.to(TORCH_DTYPES[dtype])
    if not bool(torch.isfinite(cast).all()):
        raise ValueError(
            f"tensor {tensor.name} has values beyond {dtype}'s range (float16 ends at 65504); promote with "
            "dtype: bfloat16 (same range as float32) instead."
        )
    return cast.contiguous()


def copy_other_files(model_dir: Path, out_dir: Path, weights: list[str], dtype: str, tag: str) -> list[str]:
    """Copy every top-level non-weight file (config, tokenizer, processor, chat template, model card); config.json
    says the serving dtype. Returns the copied names; sub-folders are not part of an HF model directory and stay."""
    copied = []
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name in weights or path.suffix == ".safetensors" or path.name == INDEX:
            continue
        shutil.copyfile(path, out_dir / path.name)
        copied.append(path.name)
    if dtype != "auto":
        set_config_dtype(out_dir / "config.json", {v: k for k, v in TAGS.items()}[tag])
    return copied


def set_config_dtype(path: Path, name: str) -> None:
    """config.json's dtype (and the legacy torch_dtype, and each sub-config's) = `name`, so dtype="auto" loads it as
    stored and vLLM's --dtype auto agrees."""
    config = json.loads(path.read_text())
    for section in (config, *(v for v in config.values() if isinstance(v, dict))):
        if section is config or "dtype" in section or "torch_dtype" in section:
            section["dtype"] = name
            if "torch_dtype" in section:
                section["torch_dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
