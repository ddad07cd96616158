"""Losses over the LM head computed in row chunks: logits memory that does not grow with the vocabulary.

The plain path materialises (tokens x vocabulary) logits and their fp32 copies: at Qwen's 151,936 / 248,320
vocabularies a 16k-token micro-batch holds 10-16 GB per copy. Here the head runs on `chunk_rows` rows at a time:

- `fused_head_loss` (training losses that are a weighted sum over rows: cross-entropy, distillation KL + CE) computes
  each chunk's gradients during the forward, the way fused linear cross-entropy kernels do, and keeps only
  d(hidden) and d(head weight) (fp32, vocabulary x hidden: 2.2 GB for a 7B's head, until the backward multiplies
  them by the incoming scalar). Same FLOPs as the plain path.
- `head_rows_map` (per-row outputs whose loss comes later: RL log-probabilities and entropies) keeps the rows and
  recomputes each chunk's logits in the backward (one extra head forward).

Under DeepSpeed ZeRO-3 the head's weight is a partition outside its module's own calls, and a gradient handed to it
from outside the module's backward does not reach ZeRO's reduction (TRL hit the same with Liger's kernel), so there
each chunk calls the head module under activation checkpointing instead (one extra head forward; ZeRO gathers the
weight for each call, which its parameter reuse settings may keep resident between the chunks). A head that is
not a plain `nn.Linear` (a LoRA on lm_head) and `chunk_rows <= 0` take the plain path (all target rows at once).

Written by hand: Liger-kernel's fused linear cross-entropy is Triton (GPU only) and cross-entropy only; these serve
every head loss of the stages on CPU and GPU alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from components._shared.model.encoder import IGNORE_INDEX
from components._shared.model.families import VisualTokens
from components._shared.model.packing import forward_hidden

RowLoss = Callable[[torch.Tensor, slice], torch.Tensor]
RowMap = Callable[[torch.Tensor, slice], tuple[torch.Tensor, ...]]


def output_head(model) -> nn.Module:
    """The LM head of a model under any wrapper (PEFT, the DeepSpeed engine's module)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head).")
    return head


def chunkable(head: nn.Module, chunk_rows: int) -> bool:
    """True when the chunked path applies: a plain Linear head and a positive chunk size."""
    return chunk_rows > 0 and type(head) is nn.Linear


def _partitioned(head: nn.Module) -> bool:
    """A DeepSpeed ZeRO-3 parameter (gathered only inside the module's own forward / backward)."""
    return any(hasattr(p, "ds_id") for p in head.parameters(recurse=False))


def _chunks(hidden: torch.Tensor, chunk_rows: int) -> list[slice]:
    return [slice(start, start + chunk_rows) for start in range(0, hidden.shape[0], chunk_rows)]


def _compute_dtype(tensor: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the plain head would run in: autocast's when it is on for the device, else the weight's."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()


def _checkpointed(hidden: torch.Tensor, head: nn.Module, fn: Callable, chunk_rows: int) -> list:
    """fn(head(chunk) in fp32, slice) per chunk through the head module, recomputed in the backward."""
    return [
        checkpoint(lambda h, r=rows: fn(head(h).float(), r), hidden[rows], use_reentrant=False)
        for rows in _chunks(hidden, chunk_rows)
    ]


class _EagerHeadLoss(torch.autograd.Function):
    """sum over chunks of row_loss(head(hidden[chunk])), with the gradients taken chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, row_loss: RowLoss, chunk_rows: int, dtype: torch.dtype):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        for rows in _chunks(hidden, chunk_rows):
            h = hidden[rows].to(dtype)
            with torch.enable_grad():
                logits = _chunk_logits(h, w, bias, dtype).requires_grad_()
                loss = row_loss(logits, rows)
                (grad_logits,) = torch.autograd.grad(loss, logits)
            total += loss.detach()
            g = grad_logits.to(dtype)
            if grad_h is not None:
                grad_h[rows] = (g @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (g.t() @ h).float()
            if grad_b is not None:
                grad_b += g.sum(0).float()
            del logits, loss, grad_logits, g  # before the next chunk's logits exist
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (grad_h, grad_w, grad_b)))
        ctx.has = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        has_h, has_w, has_b = ctx.has
        return (
            grad_total * grad_h if has_h else None,
            (grad_total * grad_w).to(ctx.dtypes[0]) if has_w else None,
            (grad_total * grad_b).to(ctx.dtypes[1]) if has_b else None,
            None,
            None,
            None,
        )


def _frozen_partitioned(hidden: torch.Tensor, head: nn.Module, row_loss: RowLoss, chunk_rows: int) -> torch.Tensor:
    """A frozen ZeRO-3 head (LoRA's): gathered for the eager loss, which takes the hidden states' gradient chunk by
    chunk in the forward and keeps nothing of the weight. (Checkpointing it instead fails: DeepSpeed does not gather
    a frozen parameter for the backward's recomputation, which then sees an empty weight.)"""
    import deepspeed

    params = list(head.parameters(recurse=False))
    with deepspeed.zero.GatheredParameters(params):
        dtype = _compute_dtype(hidden, head.weight)
        return _EagerHeadLoss.apply(hidden, head.weight, head.bias, row_loss, chunk_rows, dtype)


def fused_head_loss(hidden: torch.Tensor, head: nn.Module, row_loss: RowLoss, *, chunk_rows: int) -> torch.Tensor:
    """sum_chunks row_loss(fp32 logits of hidden[chunk], chunk's row slice), a differentiable scalar.

    `hidden` is (rows, hidden size); `row_loss` must be a sum over its rows (anything it needs per row it takes from
    its own tensors at the slice). It may record detached per-row values for the caller, read right after this
    returns (under ZeRO-3 the backward runs it once more).
    """
    if not chunkable(head, chunk_rows):
        return row_loss(head(hidden).float(), slice(0, hidden.shape[0]))
    zero = torch.zeros((), device=hidden.device)
    if _partitioned(head):
        if not torch.is_grad_enabled():
            return sum((row_loss(head(hidden[r]).float(), r) for r in _chunks(hidden, chunk_rows)), zero)
        if not any(p.requires_grad for p in head.parameters(recurse=False)):
            return _frozen_partitioned(hidden, head, row_loss, chunk_rows)
        return sum(_checkpointed(hidden, head, row_loss, chunk_rows), zero)
    weight, bias = head.weight, head.bias
    dtype = _compute_dtype(hidden, weight)
    if not torch.is_grad_enabled():
        return sum(
            (row_loss(_chunk_logits(hidden[r], weight, bias, dtype), r) for r in _chunks(hidden, chunk_rows)), zero
        )
    return _EagerHeadLoss.apply(hidden, weight, bias, row_loss, chunk_rows, dtype)


class _RecomputedHeadMap(torch.autograd.Function):
    """Per-row outputs of fn(head(hidden[chunk])) concatenated; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, fn: RowMap, chunk_rows: int, dtype: torch.dtype):
        pieces = [fn(_chunk_logits(hidden[rows], weight, bias, dtype), rows) for rows in _chunks(hidden, chunk_rows)]
        ctx.save_for_backward(hidden, weight, *([] if bias is None else [bias]))
        ctx.fn, ctx.chunk_rows, ctx.dtype = fn, chunk_rows, dtype
        return tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))

    @staticmethod
    def backward(ctx, *grad_outputs):
        hidden, weight, *maybe_bias = ctx.saved_tensors
        inputs = {
            "h": hidden.detach().requires_grad_(ctx.needs_input_grad[0]),
            "w": weight.detach().requires_grad_(ctx.needs_input_grad[1]),
        }
        if maybe_bias:
            inputs["b"] = maybe_bias[0].detach().requires_grad_(ctx.needs_input_grad[2])
        wrt = {k: t for k, t in inputs.items() if t.requires_grad}
        grads: dict[str, torch.Tensor] = {}
        with torch.enable_grad():
            for rows in _chunks(hidden, ctx.chunk_rows):
                h = inputs["h"][rows]
                outs = ctx.fn(_chunk_logits(h, inputs["w"], inputs.get("b"), ctx.dtype), rows)
                pairs = [(o, g[rows]) for o, g in zip(outs, grad_outputs, strict=True) if g is not None]
                got = torch.autograd.grad(
                    [o for o, _ in pairs], list(wrt.values()), [g for _, g in pairs], allow_unused=True
                )
                for name, grad in zip(wrt, got, strict=True):
                    if grad is not None:
                        grads[name] = grad if name not in grads else grads[name] + grad
                del outs, pairs, got
        return grads.get("h"), grads.get("w"), grads.get("b"), None, None, None


def head_rows_map(hidden: torch.Tensor, head: nn.Module, fn: RowMap, *, chunk_rows: int) -> tuple[torch.Tensor, ...]:
    """fn(fp32 logits of each chunk of `hidden`'s rows, the chunk's slice) -> per-row tensors, concatenated over the
    chunks and differentiable (logits recomputed per chunk in the backward; never all rows x vocabulary at once)."""
    if not chunkable(head, chunk_rows):
        return fn(head(hidden).float(), slice(0, hidden.shape[0]))
    if _partitioned(head):
        if torch.is_grad_enabled():
            pieces = _checkpointed(hidden, head, fn, chunk_rows)
        else:
            pieces = [fn(head(hidden[r]).float(), r) for r in _chunks(hidden, chunk_rows)]
    else:
        dtype = _compute_dtype(hidden, head.weight)
        if torch.is_grad_enabled():
            return _RecomputedHeadMap.apply(hidden, head.weight, head.bias, fn, chunk_rows, dtype)
        pieces = [fn(_chunk_logits(hidden[r], head.weight, head.bias, dtype), r) for r in _chunks(hidden, chunk_rows)]
    return tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))


def target_rows(hidden: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden rows, target ids, sample index) at the target positions of a packed or padded batch: the positions
    `pack()` found on the host where it did (an index: no read from the device), else a mask of them."""
    targets = batch["targets"].to(hidden.device).flatten()
    seq = batch["seq_index"].to(hidden.device).flatten()
    given = batch.get("target_positions")
    if given is not None:
        index = given.to(hidden.device)
        return hidden.flatten(0, 1).index_select(0, index), targets[index], seq[index]
    valid = (targets != IGNORE_INDEX) & (seq >= 0)
    return hidden.flatten(0, 1)[valid], targets[valid], seq[valid]


def cross_entropy_rows(targets: torch.Tensor, per_row: list[torch.Tensor] | None = None) -> RowLoss:
    """A RowLoss: summed cross-entropy against `targets`; each chunk's per-row values go to `per_row` if given."""

    def loss(logits: torch.Tensor, rows: slice) -> torch.Tensor:
        values = F.cross_entropy(logits, targets[rows], reduction="none")
        if per_row is not None:
            per_row.append(values.detach())
        return values.sum()

    return loss


def sequence_loss(
    model,
    batch: dict,
    *,
    chunk_rows: int,
    image_embeds: VisualTokens | None = None,
    router: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over the batch's target tokens, their count), the head run in chunks; a
    `router` list gets the MoE layers' router logits (packing.forward_hidden)."""
    rows, targets, _ = target_rows(forward_hidden(model, batch, image_embeds, router), batch)
    return fused_head_loss(rows, output_head(model), cross_entropy_rows(targets), chunk_rows=chunk_rows), len(targets)


def per_sample_sequence_loss(
    model, batch: dict, *, chunk_rows: int, image_embeds: VisualTokens | None = None
) -> torch.Tensor:
    """Mean target-token cross-entropy of each sample, (num_samples,), for packed and padded batches alike."""
    rows, targets, seq = target_rows(forward_hidden(model, batch, image_embeds), batch)
    per_row: list[torch.Tensor] = []
    fused_head_loss(rows, output_head(model), cross_entropy_rows(targets, per_row), chunk_rows=chunk_rows)
    token = torch.cat(per_row) if per_row else rows.new_zeros(0, dtype=torch.float32)
    n = batch["num_samples"]
    sums = torch.zeros(n, device=rows.device).index_add_(0, seq, token)
    counts = torch.zeros(n, device=rows.device).index_add_(0, seq, torch.ones_like(token))
    return sums / counts.clamp_min(1)
