"""`sdpa_packed`: SDPA that attends within each packed sample instead of over the whole packed row.

Why by hand: transformers runs packed rows (text positions restarting per sample, `attention_mask=None`) through
flash-attention's varlen kernel, which needs a CUDA build of `flash-attn`. With plain `sdpa` it builds a
block-causal (L x L) mask instead and attends over the whole row, so a packed row of budget L costs L^2 in
attention and mask building, not the sum of its samples' length^2 (docs/benchmarks.md, Packing). This kernel
splits the row at the position restarts, as the varlen kernel does, and runs causal SDPA per sample; every other
call (padded batches, generation with the KV cache, the ViT's per-image calls) goes to transformers' own `sdpa`
unchanged. Registered under its own name in transformers' `AttentionInterface` and `AttentionMaskInterface`, so
nothing global is overridden; checkpoints still save and load as ordinary `sdpa` models.

    register()                                   # idempotent; load_vlm does it
    model.set_attn_implementation(PACKED_SDPA)
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

PACKED_SDPA = "sdpa_packed"


def segment_lengths(position_ids: torch.Tensor) -> list[int] | None:
    """Lengths of the samples in one packed row of text positions (1, L), split where a position does not follow
    its predecessor; None when the row is one plain sequence starting at 0."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).reshape(-1) + 1
    if starts.numel() == 0:
        return None
    bounds = [0, *starts.tolist(), positions.numel()]
    return [b - a for a, b in itertools.pairwise(bounds)]


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """Causal SDPA per packed sample when the call is a packed row (batch 1, no mask, no cache offset, text
    positions given); otherwise transformers' sdpa. Returns (B, L, heads, head_dim) like every attention kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    packed = (
        attention_mask is None
        and position_ids is not None
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2] == position_ids.shape[-1]
        and is_causal is not False
        and getattr(module, "is_causal", True)
    )
    lengths = segment_lengths(position_ids) if packed else None
    if lengths is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=groups > 1)
        for q, k, v in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
        )
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def packed_sdpa_mask(
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """No mask for a fresh sequence without padding (the kernel splits packed rows itself); sdpa's mask for
    padded batches and cached decoding."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def register() -> str:
    """Make `sdpa_packed` a valid `attn_implementation` (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
    return PACKED_SDPA
