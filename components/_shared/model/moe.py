"""The mixture-of-experts router's load-balancing loss (Switch Transformer, eqs. 4-6), for the families with
experts (Qwen3-VL-MoE, Qwen3.5-MoE, the Qwen4 preview).

The loss is the model's own: each MoE modeling module of transformers ships `load_balancing_loss_func`, which its
forward adds to the loss (times `router_aux_loss_coef`) when the checkpoint's `output_router_logits` is on. The
stages compute their loss from hidden states, so the training loop asks for the router logits, logs the balance
loss every step and adds it as the checkpoint's forward would.
"""

from __future__ import annotations

import importlib

import torch

from components._shared.model.vlm import qwen_model


def has_experts(model) -> bool:
    """Whether the model's language model routes tokens to experts."""
    return bool(getattr(qwen_model(model).config.text_config, "num_experts", 0))


def balance_loss(model, router_logits: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """(the load-balancing loss of these router logits, one tensor per MoE layer, the weight the checkpoint's forward
    adds it with: `router_aux_loss_coef` where `output_router_logits` is on, else 0)."""
    inner = qwen_model(model)
    text = inner.config.text_config
    balance = importlib.import_module(type(inner).__module__).load_balancing_loss_func
    loss = balance(tuple(router_logits), text.num_experts, text.num_experts_per_tok, None)
    weight = float(text.router_aux_loss_coef) if getattr(text, "output_router_logits", False) else 0.0
    return loss, weight


def router_list(model) -> list[torch.Tensor] | None:
    """An empty list for the router logits of a model with experts (packing.forward_hidden fills it), else None."""
    return [] if has_experts(model) else None


def add_balance(model, loss_sum: torch.Tensor, targets: int, router: list[torch.Tensor] | None):
    """(`loss_sum` with the balance loss added where the checkpoint adds it, weighted like the micro-batch's summed
    cross-entropy, the metrics to log: {"router_balance_loss"} for a model with experts, else {})."""
    if not router:
        return loss_sum, {}
    balance, weight = balance_loss(model, router)
    if weight:
        loss_sum = loss_sum + weight * balance.to(loss_sum.device) * targets
    return loss_sum, {"router_balance_loss": balance.detach()}  # read with the step's loss (training.read_once)
