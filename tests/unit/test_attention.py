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
from tests.varlen_signatures import SIGNATURES

FAMILIES = ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen2_5-vl", "builtin:tiny-qwen3-vl", "builtin:tiny-qwen3_5"]


class ReferenceVarlen:
    """torch.nn.attention.varlen.varlen_attn's contract on the CPU (per-segment SDPA), counting its calls; called
    with the parameter list of torch release `version` (varlen_signatures.py), nothing more."""

    def __init__(self, version: str = max(SIGNATURES)):
        self.version = version
        self.calls: list[dict] = []
        namespace = {"torch": torch, "AuxRequest": object, "kernel": self}
        exec(f"def varlen_attn({SIGNATURES[version]}):\n    return kernel._call(locals())", namespace)  # noqa: S102
        self.function = namespace["varlen_attn"]

    def _call(self, a: dict) -> torch.Tensor:
        assert a["return_aux"] is None
        causal = a["is_causal"] if "is_causal" in a else a["window_size"] == (-1, 0)
        assert "window_size" not in a or a["window_size"] in ((-1, -1), (-1, 0))
        q, k, v, cu_q, cu_k = a["query"], a["key"], a["value"], a["cu_seq_q"], a["cu_seq_k"]
        assert q.dim() == k.dim() == v.dim() == 3 and q.is_contiguous() and k.is_contiguous()
        assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and a["max_q"] == a["max_k"]
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert int(cu_q[-1]) == q.shape[0] and max(lengths) == a["max_q"]
        gqa = a.get("enable_gqa", False)
        if k.shape[1] != q.shape[1]:
            assert gqa, "fewer KV heads without enable_gqa"
        self.calls.append({"causal": causal, "segments": len(lengths), "tokens": q.shape[0], "dtype": q.dtype})
        out = [
            F.scaled_dot_product_attention(
                qs.transpose(0, 1),
                ks.transpose(0, 1),
                vs.transpose(0, 1),
                is_causal=causal,
                scale=a.get("scale"),
                enable_gqa=gqa,
            ).transpose(0, 1)
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
        return torch.cat(out)

    def __call__(self):
        return self.function


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


def _segments_sdpa(q, k, v, lengths, scale):
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1), is_causal=True, enable_gqa=True, scale=scale
            ).transpose(0, 1)
            for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
    )


def _with_kernel(kernel, fn):
    original = attention._torch_varlen
    attention._torch_varlen = kernel
    attention._varlen_parameters.cache_clear()
    try:
        return fn()
    finally:
        attention._torch_varlen = original
        attention._varlen_parameters.cache_clear()


@pytest.mark.parametrize("version", sorted(SIGNATURES))
@pytest.mark.parametrize("scale", [None, 0.125, 0.3])
def test_varlen_attention_speaks_each_torch_releases_signature(version, scale):
    """torch 2.10 takes no `scale` and no `enable_gqa` (the query is scaled and KV heads repeated instead), 2.11 no
    `enable_gqa`; the kernel is called with its release's exact parameters, so an extra keyword is a TypeError."""
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    kernel = ReferenceVarlen(version)
    out = _with_kernel(
        kernel, lambda: attention.varlen_attention(q, k, v, torch.tensor([0, 4, 9]), 5, causal=True, scale=scale)
    )
    assert [(c["causal"], c["segments"], c["tokens"]) for c in kernel.calls] == [(True, 2, 9)]
    assert torch.allclose(out, _segments_sdpa(q, k, v, [4, 5], scale), atol=1e-5), (version, scale)


def test_fp32_queries_under_autocast_run_in_the_autocast_dtype():
    """fp32 weights under bf16 autocast leave the queries fp32 after the rotary embedding: the kernel gets them in
    bf16 (it was skipped for the SDPA loops without a word) and answers in bf16, as SDPA does under autocast."""
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 4, 8), torch.randn(9, 4, 8)
    kernel = ReferenceVarlen()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.kernel_dtype(q) == torch.bfloat16
        out = _with_kernel(
            kernel, lambda: attention.varlen_attention(q, k, v, torch.tensor([0, 4, 9]), 5, causal=True, scale=None)
        )
    assert kernel.calls[0]["dtype"] == torch.bfloat16 and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), _segments_sdpa(q, k, v, [4, 5], None), atol=3e-2)
    assert attention.kernel_dtype(q) is None  # outside autocast: fp32 is not the kernel's


@pytest.mark.parametrize(
    ("cuda", "flash_gpu", "weights", "autocast", "path"),
    [
        (True, True, torch.bfloat16, None, "flash varlen kernel, one call per layer, in bfloat16"),  # DeepSpeed bf16
        (True, True, torch.float32, torch.bfloat16, "flash varlen kernel, one call per layer, in bfloat16"),  # torch
        (True, True, torch.float16, None, "flash varlen kernel, one call per layer, in float16"),
        (True, True, torch.float32, None, "SDPA loops (fp32 without autocast: the kernel takes bf16 or fp16"),
        (True, False, torch.bfloat16, None, "SDPA loops (the GPU is older than Ampere"),
        (False, False, torch.float32, torch.bfloat16, "SDPA loops (the flash varlen kernel needs CUDA)"),
        (False, False, torch.float32, None, "SDPA loops (the flash varlen kernel needs CUDA)"),
    ],
)
def test_the_attention_path_per_device_and_precision(monkeypatch, cuda, flash_gpu, weights, autocast, path):
    monkeypatch.setattr(attention, "_flash_capable", lambda index: flash_gpu)
    monkeypatch.setattr(attention, "_torch_varlen", ReferenceVarlen())
    device = torch.device("cuda:0" if cuda else "cpu")
    assert path in attention.attention_path(device, weights, autocast)
    attention.use_varlen(False)
    try:
        assert "switched off (QVL_ATTN_VARLEN=0)" in attention.attention_path(device, weights, autocast)
    finally:
        attention.use_varlen(True)


def test_varlen_stays_off_where_the_kernel_cannot_run():
    query = torch.randn(1, 4, 16, 8)
    assert not attention.varlen_applies(query, 0.0)  # CPU
    assert not attention.varlen_applies(query.to(torch.bfloat16), 0.0)  # CPU, even in bf16
    env = {**os.environ, "QVL_ATTN_VARLEN": "0"}
    code = "from components._shared.model import attention; print(attention._VARLEN['enabled'])"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
