"""`sdpa_packed`: SDPA that attends within each packed sample instead of over the whole packed row.

Why by hand: transformers runs packed rows (text positions restarting per sample, `attention_mask=None`) through
flash-attention's varlen kernel, which needs a CUDA build of `flash-attn`. With plain `sdpa` it builds a
block-causal (L x L) mask instead and attends over the whole row, so a packed row of budget L costs L^2 in
attention and mask building, not the sum of its samples' length^2 (docs/benchmarks.md, Packing). This kernel
splits the row at the position restarts, as the varlen kernel does, and runs causal SDPA per sample; every other
call (padded batches, generation with the KV cache, the ViT's per-image calls) goes to transformers' own `sdpa`
unchanged. Registered under its own name in transformers' `AttentionInterface` and `AttentionMaskInterface`, so
nothing global is overridden; checkpoints still save and load as ordinary `sdpa` models.

On CUDA in bf16/fp16, or with fp32 weights under bf16/fp16 autocast (queries cast down, as SDPA would), both loops
become one kernel per layer: torch's own flash-attention varlen kernel (`torch.nn.attention.varlen.varlen_attn`, no
`flash-attn` build needed), called with the parameters each torch release takes (2.10: no `scale`, no GQA). The
training loop says at its start which path its packed rows take and why (`attention_path`). A packed LM row's
sample bounds come from `pack()` on the host (`packed_row`: no read from the device); a row without them has them
found once per forward (cached on the position tensor every layer receives), not once per layer.
The ViT's per-image / per-window loop is transformers' own, taken whenever the vision config's implementation is not
a "flash" one; `enable_vision_varlen(model)` gives the ViT's modules a config named `VISION_VARLEN`, which makes
transformers pass the ViT's `cu_seqlens` in one call, which runs the varlen kernel on CUDA and transformers'
per-segment SDPA loop elsewhere (the same numbers as before on the CPU). Why: on an H200 the loops left SFT at 5-9%
MFU (docs/benchmarks.md, GPU checks); the varlen path has not run on a GPU yet (its plumbing is tested against a
CPU reference of the kernel, tests/unit/test_attention.py). `QVL_ATTN_VARLEN=0` switches it off.

    register()                                   # idempotent; load_vlm does it
    model.set_attn_implementation(PACKED_SDPA)
    enable_vision_varlen(model)                  # the ViT in one varlen call per block
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import os

import torch
import torch.nn.functional as F

PACKED_SDPA = "sdpa_packed"
VISION_VARLEN = "sdpa_packed_vision_flash_varlen"  # "flash" in the name: transformers' one-call varlen ViT branch
_VARLEN = {"enabled": os.environ.get("QVL_ATTN_VARLEN", "1") != "0"}  # QVL_ATTN_VARLEN=0: the SDPA loops
# The last packed row's bounds, by its position tensor (every layer gets the same one, and a checkpointed layer's
# recomputation in the backward too, after packed_row has ended): (positions, version, lengths, cu_seqlens, longest)
_LAST_BOUNDS: list[tuple[torch.Tensor, int, list[int] | None, torch.Tensor, int]] = []
_GIVEN: list[tuple[list[int], torch.Tensor, int]] = []  # the packed row's (lengths, cu_seqlens, longest) from pack()


def use_varlen(enabled: bool) -> None:
    """Turn the CUDA varlen kernel on or off (on by default); off = the per-sample SDPA loops everywhere. For
    benchmarks that compare the two in one process."""
    _VARLEN["enabled"] = enabled


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen()).parameters)


@functools.cache
def _flash_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)  # flash attention: Ampere and later


HALF = (torch.float16, torch.bfloat16)


def kernel_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half precision the flash kernel would run `query` in: its own, or under autocast on its device the
    autocast dtype (fp32 weights under bf16 autocast: rotary embeddings leave queries in fp32, and SDPA would cast
    them down too); None where neither is half."""
    if query.dtype in HALF:
        return query.dtype
    kind = query.device.type
    if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) in HALF:
        return torch.get_autocast_dtype(kind)
    return None


def why_not_varlen(*, cuda: bool, flash_gpu: bool, dtype: torch.dtype | None) -> str | None:
    """Why packed rows cannot take the flash varlen kernel on this device and precision (None: they take it)."""
    if not _VARLEN["enabled"]:
        return "switched off (QVL_ATTN_VARLEN=0)"
    if _torch_varlen() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 or later has)"
    if not cuda:
        return "the flash varlen kernel needs CUDA"
    if not flash_gpu:
        return "the GPU is older than Ampere (compute capability 8.0)"
    if dtype is None:
        return "fp32 without autocast: the kernel takes bf16 or fp16 (train.precision: bf16)"
    return None


def attention_path(device: torch.device, weights: torch.dtype, autocast: torch.dtype | None) -> str:
    """Which kernel packed LM rows and the ViT's images run through on `device` with weights of `weights` and
    `autocast` (None: off), and why; the training loop says it once at its start."""
    cuda = device.type == "cuda"
    dtype = weights if weights in HALF else (autocast if autocast in HALF else None)
    reason = why_not_varlen(cuda=cuda, flash_gpu=cuda and _flash_capable(device.index or 0), dtype=dtype)
    if reason is None:
        return f"attention: torch's flash varlen kernel, one call per layer, in {str(dtype).removeprefix('torch.')}"
    return f"attention: per-sample SDPA loops ({reason})"


def varlen_applies(query: torch.Tensor, dropout: float) -> bool:
    """True where the flash varlen kernel runs (`why_not_varlen` says why not), the head dim is at most 256 and
    there is no dropout."""
    cuda = query.is_cuda
    flash_gpu = cuda and _flash_capable(query.device.index or 0)
    reason = why_not_varlen(cuda=cuda, flash_gpu=flash_gpu, dtype=kernel_dtype(query))
    return reason is None and query.shape[-1] <= 256 and not dropout


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    *,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """Attention within each segment of (tokens, heads, head_dim) tensors, segments given by `cu_seqlens`, by torch's
    flash varlen kernel, in `kernel_dtype` (the output too, as SDPA's under autocast). Speaks each release's
    signature: torch 2.10 (`is_causal`, no `scale`, no GQA), 2.11 (`window_size`, `scale`), 2.12+ (`enable_gqa`)."""
    fn = _torch_varlen()
    params = _varlen_parameters()
    extra: dict[str, object] = {}
    dtype = kernel_dtype(query) or query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None and scale != query.shape[-1] ** -0.5:
        query = query * (scale * query.shape[-1] ** 0.5)  # the kernel scales by 1/sqrt(dim)
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        extra["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        extra["is_causal"] = causal
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    return fn(query, key, value, cu, cu, max_len, max_len, **extra)


def _varlen_row(query, key, value, cu_seqlens, max_len: int, *, causal: bool, scale: float | None) -> torch.Tensor:
    """`varlen_attention` on one row in transformers' layout: (1, heads, L, dim) in, (1, L, heads, dim) out."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return varlen_attention(q, k, v, cu_seqlens, max_len, causal=causal, scale=scale).unsqueeze(0)


@contextlib.contextmanager
def packed_row(batch: dict):
    """The packed row's sample bounds as the input pipeline computed them on the host (`packing.pack`: lengths,
    `cu_seqlens` moved with the batch, the longest), for the attention calls of one forward: they need no read
    from the device (a host sync each). A batch without them (a padded one) leaves the attention to find them."""
    given = batch.get("sample_lengths")
    if given is None:
        yield
        return
    _GIVEN[:] = [(given, batch["cu_seqlens"], batch["max_seqlen"])]
    try:
        yield
    finally:
        _GIVEN.clear()


def _given_bounds(position_ids: torch.Tensor) -> tuple[list[int], torch.Tensor, int] | None:
    """The host-given bounds of the packed row `position_ids` belongs to (its length theirs), or those the same
    position tensor had earlier in this step (a checkpointed layer recomputed in the backward), else None."""
    if torch.compiler.is_compiling():  # traced, host ints become symbols the split cannot prove sum to the row
        return None
    for positions, version, lengths, cu, longest in _LAST_BOUNDS:
        if positions is position_ids and version == position_ids._version and lengths is not None:
            return lengths, cu, longest
    if _GIVEN and sum(_GIVEN[0][0]) == position_ids.shape[-1]:
        lengths, cu, longest = _GIVEN[0]
        cu = cu.to(position_ids.device)
        _LAST_BOUNDS[:] = [(position_ids, position_ids._version, lengths, cu, longest)]
        return lengths, cu, longest
    return None


def _packed_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest sample) of a packed row: given by the input pipeline (`packed_row`), else computed once
    per forward: every layer gets the same position tensor, so the one host sync (the sample count and the longest
    sample) is paid once, not per layer."""
    given = _given_bounds(position_ids)
    if given is not None:
        return given[1], given[2]
    for positions, version, _, cu, longest in _LAST_BOUNDS:
        if positions is position_ids and version == position_ids._version:
            return cu, longest
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).reshape(-1) + 1
    edge = torch.tensor([0], device=positions.device)
    end = torch.tensor([positions.numel()], device=positions.device)
    cu = torch.cat([edge, starts, end]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    _LAST_BOUNDS[:] = [(position_ids, position_ids._version, None, cu, longest)]
    return cu, longest


def segment_lengths(position_ids: torch.Tensor) -> list[int] | None:
    """Lengths of the samples in one packed row of text positions (1, L), split where a position does not follow
    its predecessor; None when the row is one plain sequence starting at 0. Given by the input pipeline where it
    gave them (`packed_row`: no read from the device), else found from the positions."""
    given = _given_bounds(position_ids)
    if given is not None:
        return list(given[0]) if len(given[0]) > 1 else None
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
    if packed and varlen_applies(query, dropout):
        cu, longest = _packed_bounds(position_ids)
        return _varlen_row(query, key, value, cu, longest, causal=True, scale=scaling), None
    lengths = segment_lengths(position_ids) if packed else None
    if lengths is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # The module's own group count is a plain int: under torch.compile with dynamic shapes a comparison of the
    # head dims would be a symbolic bool that SDPA cannot take without a graph break.
    gqa = getattr(module, "num_key_value_groups", query.shape[1] // key.shape[1]) > 1
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
        for q, k, v in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
        )
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def vision_varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
):
    """The ViT's attention over all images / windows of a forward in one call (`VISION_VARLEN`): the varlen kernel
    on CUDA, else transformers' own loop (sdpa per segment), so CPU numbers do not change. (B, L, heads, dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for name in ("cu_seq_lens_k", "max_length_k"):
        kwargs.pop(name, None)
    if cu_seq_lens_q is None or attention_mask is not None or query.shape[0] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if varlen_applies(query, dropout):
        longest = int(max_length_q) if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
        return _varlen_row(query, key, value, cu_seq_lens_q, longest, causal=False, scale=scaling), None
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    outputs = [
        sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=False, **kwargs)[0]
        for q, k, v in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
        )
    ]
    return torch.cat(outputs, dim=1), None


def enable_vision_varlen(model: torch.nn.Module) -> bool:
    """Run the model's ViT under `VISION_VARLEN` when it runs `PACKED_SDPA`; True when it does (now or before).

    The ViT's modules get their own copy of the vision config carrying the name; `model.config` keeps
    `PACKED_SDPA`, so a model built from it, a saved checkpoint or `set_attn_implementation` never meets the "flash"
    name (transformers would look for a flash-attn build behind it)."""
    register()
    visual = next((m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "visual"), None)
    shared = getattr(visual, "config", None)
    if visual is None or shared is None:
        return False
    current = getattr(shared, "_attn_implementation", None)
    if current == VISION_VARLEN:
        return True
    if current != PACKED_SDPA:
        return False
    own = copy.deepcopy(shared)
    own._attn_implementation = VISION_VARLEN
    for module in visual.modules():
        if getattr(module, "config", None) is shared:
            module.config = own
    return True


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
    AttentionInterface.register(VISION_VARLEN, vision_varlen_forward)
    AttentionMaskInterface.register(VISION_VARLEN, packed_sdpa_mask)
    return PACKED_SDPA
