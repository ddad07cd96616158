"""Distillation losses on one packed micro-batch, summed over response tokens (TrainLoop divides by the step's
target-token count, so packing does not change the gradient).

- logits: T^2 * KL(softmax(teacher / T) || softmax(student / T)) per response token (Hinton et al. 2015; T^2
  keeps gradient size independent of T). Forward KL: the student covers the teacher's whole distribution.
- ce: cross-entropy on the data's answer tokens, for samples whose answer came from the data (not the student).
- hidden: MSE between a learned projection of a student layer's output and the mapped teacher layer's output.
- attention: KL(teacher attention row || student attention row) at each response token, heads averaged (student
  and teacher may have different head counts), over mapped layers ("state distillation"; docs/references.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from components._shared.model.packing import IGNORE_INDEX


def layer_map(student_layers: int, teacher_layers: int, kept: list[int] | None = None) -> list[tuple[int, int]]:
    """(student layer, teacher layer) pairs whose outputs are matched: the pruned-from layer when known, else the
    teacher layer at the same relative depth (the last student layer always meets the last teacher layer)."""
    if kept is not None:
        return list(enumerate(kept))
    return [(i, round((i + 1) * teacher_layers / student_layers) - 1) for i in range(student_layers)]


def logit_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token T^2 * KL(teacher_T || student_T), (n,) in fp32, over the vocabulary both share.

    Checkpoints of one tokenizer may pad their embedding rows differently (Qwen2.5-VL-7B: 152,064, 3B: 151,936, both
    for the same 151,665 tokens); the rows past the narrower width belong to no token and are left out.
    """
    width = min(student_logits.shape[-1], teacher_logits.shape[-1])
    t = F.log_softmax(teacher_logits[..., :width].float() / temperature, dim=-1)
    s = F.log_softmax(student_logits[..., :width].float() / temperature, dim=-1)
    return temperature**2 * (t.exp() * (t - s)).sum(-1)


def attention_kl(student_attention: torch.Tensor, teacher_attention: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per-row KL of head-averaged attention maps (1, H, L, L) at the positions `rows`, (n,) in fp32."""
    s = student_attention[0].float().mean(0)[rows]
    t = teacher_attention[0].float().mean(0)[rows]
    eps = 1e-8
    return (t * ((t + eps).log() - (s + eps).log())).sum(-1)


def distillation_loss(
    student_out,
    teacher_out,
    batch: dict,
    *,
    weights,
    pairs: list[tuple[int, int]],
    projections: torch.nn.ModuleList | None,
    data_answer: torch.Tensor,
) -> tuple[torch.Tensor, int, dict[str, float]]:
    """(summed weighted loss over response tokens, their count, per-token means of each part).

    `weights` is the LossConfig; `data_answer` (L,) bool marks tokens whose target is the data's answer (CE applies
    there only). Hidden states / attentions are read from the outputs when their weights are non-zero.
    """
    targets = batch["targets"][0].to(student_out.logits.device)
    valid = targets != IGNORE_INDEX
    n = int(valid.sum())
    kl = logit_kl(student_out.logits[0][valid], teacher_out.logits[0][valid], weights.temperature)
    total = weights.kl * kl.sum() if weights.kl else kl.sum() * 0.0
    parts = {"kl": float(kl.detach().mean()) if n else 0.0}
    if weights.ce:
        ce = F.cross_entropy(student_out.logits[0][valid].float(), targets[valid], reduction="none")
        ce = ce * data_answer.to(ce.device)[valid].float()
        total = total + weights.ce * ce.sum()
        parts["ce"] = float(ce.detach().mean()) if n else 0.0
    if weights.hidden:
        if projections is None:
            raise ValueError("loss.hidden > 0 needs the student-to-teacher projections; build them with the student.")
        mse = sum(
            (
                F.mse_loss(
                    projections[k](student_out.hidden_states[s + 1][0][valid].float()),
                    teacher_out.hidden_states[t + 1][0][valid].float(),
                    reduction="none",
                ).mean(-1)
                for k, (s, t) in enumerate(pairs)
            ),
            torch.zeros(()),  # a tensor start (0 + x == x exactly), so the sum is a tensor
        ) / len(pairs)
        total = total + weights.hidden * mse.sum()
        parts["hidden_mse"] = float(mse.detach().mean()) if n else 0.0
    if weights.attention:
        rows = valid.nonzero().flatten()
        att = sum(attention_kl(student_out.attentions[s], teacher_out.attentions[t], rows) for s, t in pairs) / len(
            pairs
        )
        total = total + weights.attention * att.sum()
        parts["attention_kl"] = float(att.detach().mean()) if n else 0.0
    return total, n, parts
