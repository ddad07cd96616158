"""The varlen attention path (components/_shared/model/attention.py): one attention call per layer for packed LM
rows and for the ViT over all its images / windows.

The flash varlen kernel itself needs CUDA; here a CPU reference of its contract (tokens x heads x dim, segments
by cu_seqlens, `window_size` or `is_causal`, GQA) stands in for it, so what is tested is everything around the
kernel: which calls reach it, with which shapes and bounds, and that the model's loss and gradients equal the
per-sample / per-window SDPA loops. On the CPU the real path must not change a number.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from components._shared.model import attention
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.head_loss import sequence_loss
from components._shared.model.packing import pack
from components._shared.model.vlm import load_vlm, qwen_model

FAMILIES = ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen2_5-vl", "builtin:tiny-qwen3-vl", "builtin:tiny-qwen3_5"]


class ReferenceVarlen:
    """torch.nn.attention.varlen.varlen_attn's contract on the CPU (per-segment SDPA), counting its calls."""

    def __init__(self, api: str = "window_size"):
        self.api = api
        self.calls: list[dict] = []

    def _run(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, gqa):
        assert q.dim() == k.dim() == v.dim() == 3 and q.is_contiguous() and k.is_contiguous()
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert int(cu_q[-1]) == q.shape[0] and max(lengths) == max_q
        if k.shape[1] != q.shape[1]:
            assert gqa, "fewer KV heads without enable_gqa"
        self.calls.append({"causal": causal, "segments": len(lengths), "tokens": q.shape[0]})
        out = [
            F.scaled_dot_product_attention(
                qs.transpose(0, 1),
                ks.transpose(0, 1),
                vs.transpose(0, 1),
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            ).transpose(0, 1)
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
        return torch.cat(out)

    def modern(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size in ((-1, -1), (-1, 0))
        return self._run(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size == (-1, 0), enable_gqa)

    def torch_2_10(self, q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):
        return self._run(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, False)

    def __call__(self):
        return self.modern if self.api == "window_size" else self.torch_2_10


@pytest.fixture
def reference_kernel(monkeypatch):
    """Route the varlen path to the CPU reference: `attention._torch_varlen` returns it, the CUDA guard passes."""
    kernel = ReferenceVarlen()
    monkeypatch.setattr(attention, "_torch_varlen", kernel)
    attention._varlen_parameters.cache_clear()
    monkeypatch.setattr(
        attention, "varlen_applies", lambda query, dropout: attention._VARLEN["enabled"] and not dropout
    )
    yield kernel
    attention.use_varlen(True)
    attention._varlen_parameters.cache_clear()


def _packed_batch(model, processor):
    encoder = ConversationEncoder(processor, model, min_pixels=3136, max_pixels=4 * 3136)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(3):
        image = Image.fromarray(rng.integers(0, 255, (56 + 28 * i, 84, 3), dtype=np.uint8))
        turns = [
            {"role": "user", "text": "<image>\nWhat is here?"},
            {"role": "assistant", "text": "shapes " * (i + 2)},
        ]
        samples.append(encoder.encode(turns, images=[image], sample_id=str(i)))
    return pack(samples)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss_sum, targets = sequence_loss(model, batch, chunk_rows=0)
    (loss_sum / targets).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return float(loss_sum.detach() / targets), grads


@pytest.mark.parametrize("uri", ["builtin:tiny-qwen2_5-vl", "builtin:tiny-qwen3_5"])
def test_varlen_path_equals_the_sdpa_loops_one_call_per_layer(uri, reference_kernel):
    model, processor, _ = load_vlm(uri)
    assert qwen_model(model).visual.config._attn_implementation == attention.VISION_VARLEN  # load_vlm sets it
    assert model.config.vision_config._attn_implementation == attention.PACKED_SDPA  # what saves and copies see
    batch = _packed_batch(model, processor)
    attention.use_varlen(False)
    loss_loops, grads_loops = _loss_and_grads(model, batch)
    assert reference_kernel.calls == []
    attention.use_varlen(True)
    loss_varlen, grads_varlen = _loss_and_grads(model, batch)
    assert loss_varlen == pytest.approx(loss_loops, rel=1e-6)
    assert float((grads_varlen - grads_loops).norm() / grads_loops.norm()) < 1e-6

    qwen = qwen_model(model)
    text = qwen.config.text_config
    attention_layers = sum(
        1 for t in getattr(text, "layer_types", None) or ["full"] * text.num_hidden_layers if t != "linear_attention"
    )
    causal = [c for c in reference_kernel.calls if c["causal"]]
    vision = [c for c in reference_kernel.calls if not c["causal"]]
    assert len(causal) == attention_layers  # one call per attention layer, all 3 samples in it
    assert all(c["segments"] == 3 and c["tokens"] == batch["input_ids"].shape[-1] for c in causal)
    assert len(vision) == qwen.config.vision_config.depth  # one call per ViT block, all images / windows in it
    assert all(c["segments"] >= 3 for c in vision)


@pytest.mark.parametrize("uri", FAMILIES)
def test_vision_varlen_keeps_every_family_s_cpu_numbers(uri):
    """On the CPU the one-call ViT branch runs transformers' own per-segment loop: bit-identical output."""
    model = load_vlm(uri).model
    visual = qwen_model(model).visual
    config = visual.config
    grid = torch.tensor([[1, 8, 12], [1, 16, 8], [1, 4, 4]])
    torch.manual_seed(0)
    pixels = torch.randn(
        int(grid.prod(-1).sum()), config.in_channels * config.temporal_patch_size * config.patch_size**2
    )
    assert config._attn_implementation == attention.VISION_VARLEN
    with torch.no_grad():
        varlen = visual(pixels, grid_thw=grid).pooler_output
        model.set_attn_implementation(attention.PACKED_SDPA)  # back to transformers' per-image / per-window loop
        assert visual.config._attn_implementation == attention.PACKED_SDPA
        loops = visual(pixels, grid_thw=grid).pooler_output
    assert torch.equal(varlen, loops)
    assert attention.enable_vision_varlen(model) and visual.config._attn_implementation == attention.VISION_VARLEN
    assert model.config.vision_config._attn_implementation == attention.PACKED_SDPA
    type(model)(model.config)  # a model built from the config never meets the flash-named implementation


def test_varlen_attention_speaks_both_kernel_apis_and_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 4, 9])
    expected = torch.cat(
        [
            F.scaled_dot_product_attention(
                a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
            for a, b, c in zip(q.split([4, 5]), k.split([4, 5]), v.split([4, 5]), strict=True)
        ]
    )
    for api in ("window_size", "is_causal"):
        kernel = ReferenceVarlen(api)
        original = attention._torch_varlen
        attention._torch_varlen = kernel
        attention._varlen_parameters.cache_clear()
        try:
            out = attention.varlen_attention(q, k, v, cu, 5, causal=True, scale=None)
        finally:
            attention._torch_varlen = original
            attention._varlen_parameters.cache_clear()
        assert kernel.calls == [{"causal": True, "segments": 2, "tokens": 9}]
        assert torch.allclose(out, expected, atol=1e-6), api  # torch 2.10's API has no GQA: KV heads repeated


def test_varlen_stays_off_where_the_kernel_cannot_run():
    query = torch.randn(1, 4, 16, 8)
    assert not attention.varlen_applies(query, 0.0)  # CPU
    assert not attention.varlen_applies(query.to(torch.bfloat16), 0.0)  # CPU, even in bf16
    env = {**os.environ, "QVL_ATTN_VARLEN": "0"}
    code = "from components._shared.model import attention; print(attention._VARLEN['enabled'])"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
