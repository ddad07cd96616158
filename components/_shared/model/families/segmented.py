"""Modules that run once per packed sample: what families with state across tokens (Qwen3.5's and the Qwen4
preview's linear attention, the preview's per-layer n-gram embeddings) need for exact packing.

Within `packed_sample_lengths(lengths)`, a module made segmented (`make_segmented`) splits a batch-1 row of
sum(lengths) tokens into the samples and runs each from a zero state, the way the varlen kernels do with
`cu_seqlens`; its decoder layer takes the lengths as an argument (`make_layer_carry_lengths`), so gradient
checkpointing, which recomputes a layer during backward after the forward's context has ended, recomputes it per
sample too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch

_SAMPLE_LENGTHS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("packed_lengths", default=None)


@contextlib.contextmanager
def packed_sample_lengths(lengths: list[int] | None):
    """Within the block, segmented modules treat a batch-1 row of sum(lengths) tokens as these samples."""
    token = _SAMPLE_LENGTHS.set(lengths)
    try:
        yield
    finally:
        _SAMPLE_LENGTHS.reset(token)


def _lengths_for(hidden_states: torch.Tensor, cache) -> list[int] | None:
    lengths = _SAMPLE_LENGTHS.get()
    if lengths is None or cache is not None or hidden_states.shape[0] != 1 or sum(lengths) != hidden_states.shape[1]:
        return None
    return lengths


def _state_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A linear-attention forward(hidden_states, cache, attention_mask) run per packed sample, else unchanged."""
    base = super(type(self), self).forward
    lengths = _lengths_for(hidden_states, cache)
    if lengths is None:
        return base(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    parts = hidden_states.split(lengths, dim=1)
    return torch.cat([base(part, cache=None, attention_mask=None, **kwargs) for part in parts], dim=1)


def _token_forward(self, hidden_states, input_ids, cache=None, conv_mask=None):
    """A per-layer embedding forward(hidden_states, input_ids, cache, conv_mask) run per packed sample: its n-grams
    and convolution restart at each sample, not only at the end-of-sequence token."""
    base = super(type(self), self).forward
    lengths = _lengths_for(hidden_states, cache)
    if lengths is None:
        return base(hidden_states, input_ids, cache, conv_mask=conv_mask)
    pairs = zip(hidden_states.split(lengths, dim=1), input_ids.split(lengths, dim=1), strict=True)
    return torch.cat([base(h, ids, None, conv_mask=None) for h, ids in pairs], dim=1)


def _layer_call(self, *args, **kwargs):
    lengths = _SAMPLE_LENGTHS.get()
    if lengths is not None:
        kwargs["packed_lengths"] = lengths
    return super(type(self), self).__call__(*args, **kwargs)


def _layer_forward(self, *args, packed_lengths=None, **kwargs):
    base = super(type(self), self).forward
    if packed_lengths is None:
        return base(*args, **kwargs)
    with packed_sample_lengths(packed_lengths):
        return base(*args, **kwargs)


_KINDS: dict[str, dict[str, Callable]] = {
    "state": {"forward": _state_forward},
    "tokens": {"forward": _token_forward},
    "layer": {"__call__": _layer_call, "forward": _layer_forward},
}
_CLASSES: dict[tuple[type, str], type] = {}


def _swap(module: torch.nn.Module, kind: str) -> None:
    cls = type(module)
    if cls in _CLASSES.values():  # made already
        return
    if (cls, kind) not in _CLASSES:
        _CLASSES[cls, kind] = type(f"Packed{cls.__name__}", (cls,), dict(_KINDS[kind]))
    module.__class__ = _CLASSES[cls, kind]


def make_segmented(module: torch.nn.Module, *, takes_tokens: bool = False) -> None:
    """Run `module` once per packed sample: a linear attention (hidden_states, cache, attention_mask), or with
    `takes_tokens` a per-layer embedding (hidden_states, input_ids, cache, conv_mask). Idempotent."""
    _swap(module, "tokens" if takes_tokens else "state")


def make_layer_carry_lengths(layer: torch.nn.Module) -> None:
    """Hand the packed sample lengths to `layer` as an argument (for gradient checkpointing). Idempotent."""
    _swap(layer, "layer")
