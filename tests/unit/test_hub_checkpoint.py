"""A hub-like checkpoint (legacy config.json, bf16 weights sharded under the hub's key names) loads, and every
stage export keeps its dtype: a bf16 checkpoint is exported in bf16 (half the bytes of the fp32 training weights)
unless another dtype is configured; the export loads with the Auto classes and generates."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoProcessor

from components._shared.model.vlm import export_dtype, load_vlm, save_vlm
from tests.hub_like import write_hub_like


def _dtypes(model_dir) -> set[torch.dtype]:
    found = set()
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            found |= {handle.get_slice(k).get_dtype() for k in handle.keys()}  # noqa: SIM118
    return found


def _bytes(model_dir) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def test_exports_keep_the_checkpoints_dtype_unless_configured(tmp_path):
    model, processor, stored = load_vlm(write_hub_like(tmp_path / "hub"))
    assert next(model.parameters()).dtype == torch.float32  # trained in fp32
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # "trained"
    own = save_vlm(model, processor, tmp_path / "own", dtype=export_dtype("checkpoint", stored))
    wide = save_vlm(model, processor, tmp_path / "wide", dtype=export_dtype("float32", stored))
    assert _dtypes(own) == {"BF16"} and _dtypes(wide) == {"F32"}
    assert json.loads((own / "config.json").read_text())["dtype"] == "bfloat16"
    assert 0.45 < _bytes(own) / _bytes(wide) < 0.55
    assert next(model.parameters()).dtype == torch.float32  # the model itself kept training precision
    reloaded = AutoModelForImageTextToText.from_pretrained(own)
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    expected = next(model.parameters()).detach().to(torch.bfloat16)
    assert torch.equal(next(reloaded.parameters()).detach(), expected)
    auto_processor = AutoProcessor.from_pretrained(own)
    inputs = auto_processor.tokenizer("a red circle", return_tensors="pt")
    out = reloaded.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3 or int(out[0, -1]) in (2, 0)
