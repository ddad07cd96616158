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

from components._shared.model.encoder import IGNORE_INDEX
from components._shared.model.head_loss import fused_head_loss


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


def head_kl_ce(
    student_rows: torch.Tensor,
    teacher_rows: torch.Tensor,
    heads: tuple[torch.nn.Module, torch.nn.Module],
    targets: torch.Tensor,
    data_answer: torch.Tensor,
    *,
    weights,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights.kl * sum KL + weights.ce * sum CE on data answers, per-row KL, per-row CE) over the response rows'
    last hidden states, the heads run `chunk_rows` rows at a time (the teacher's logits of a chunk under no_grad)."""
    student_head, teacher_head = heads
    kls: list[torch.Tensor] = []
    ces: list[torch.Tensor] = []
    answer = data_answer.float()

    def row_loss(logits: torch.Tensor, rows: slice) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = teacher_head(teacher_rows[rows])
        kl = logit_kl(logits, teacher_logits, weights.temperature)
        kls.append(kl.detach())
        loss = weights.kl * kl.sum() if weights.kl else kl.sum() * 0.0
        if weights.ce:
            ce = F.cross_entropy(logits, targets[rows], reduction="none") * answer[rows]
            ces.append(ce.detach())
            loss = loss + weights.ce * ce.sum()
        return loss

    total = fused_head_loss(student_rows, student_head, row_loss, chunk_rows=chunk_rows)
    empty = student_rows.new_zeros(0, dtype=torch.float32)
    return total, torch.cat(kls) if kls else empty, torch.cat(ces) if ces else empty


def distillation_loss(
    student_out,
    teacher_out,
    batch: dict,
    *,
    weights,
    pairs: list[tuple[int, int]],
    projections: torch.nn.ModuleList | None,
    data_answer: torch.Tensor,
    heads: tuple[torch.nn.Module, torch.nn.Module],
    chunk_rows: int,
) -> tuple[torch.Tensor, int, dict[str, float]]:
    """(summed weighted loss over response tokens, their count, per-token means of each part).

    `student_out` / `teacher_out` are the language models' outputs (last_hidden_state, + hidden_states / attentions
    when their weights are non-zero); `heads` = (student lm_head, teacher lm_head), run `chunk_rows` rows at a time.
    `weights` is the LossConfig; `data_answer` (L,) bool marks tokens whose target is the data's answer (CE applies
    there only).
    """
    targets = batch["targets"][0].to(student_out.last_hidden_state.device)
    valid = targets != IGNORE_INDEX
    n = int(valid.sum())
    total, kl, ce = head_kl_ce(
        student_out.last_hidden_state[0][valid],
        teacher_out.last_hidden_state[0][valid],
        heads,
        targets[valid],
        data_answer.to(targets.device)[valid],
        weights=weights,
        chunk_rows=chunk_rows,
    )
    parts = {"kl": float(kl.mean()) if n else 0.0}
    if weights.ce:
        parts["ce"] = float(ce.mean()) if n else 0.0
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
