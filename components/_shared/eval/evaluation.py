"""The held-out eval suite every model stage reports: scores per task and benchmark (data/tasks.py), held-out loss, ECE.

Records come from data/datasets.py (`load_eval_records`). Generation is greedy, batched with left padding and
the KV cache.
"""

from __future__ import annotations

import math

import torch

from components._shared.data import tasks as T
from components._shared.data.datasets import prompt_turns
from components._shared.model.encoder import IGNORE_INDEX, ConversationEncoder, Sample
from components._shared.model.generation import own_generation_config
from components._shared.model.head_loss import per_sample_sequence_loss
from components._shared.model.packing import (
    forward_logits,
    generation_vision_inputs,
    pack,
    plan_micro_batches,
    to_device,
)
from components._shared.model.train_config import TrainConfig
from components._shared.platform import progress


@torch.no_grad()
def generate_answers(
    model,
    encoder: ConversationEncoder,
    records: list[dict],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 48,
    first_logits: list | None = None,
) -> list[str]:
    """Greedy answers, batched with left padding (the KV cache on); `first_logits`, when a list, receives each
    record's logits of the first generated token (for tests and diagnostics)."""
    prompts = [
        encoder.encode(prompt_turns(r["question"]), images=[r["pil"]], add_generation_prompt=True, sample_id=r["id"])
        for r in records
    ]
    return generate_completions(
        model,
        encoder,
        prompts,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        first_logits=first_logits,
        progress_phase="eval",
    )


@torch.no_grad()
def _zero3_partitioned(model) -> bool:
    """True for a module whose parameters DeepSpeed ZeRO-3 partitions over the ranks (they carry a ds_id)."""
    return torch.distributed.is_initialized() and any(hasattr(p, "ds_id") for p in model.parameters())


def generate_completions(
    model,
    encoder: ConversationEncoder,
    prompts: list[Sample],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    first_logits: list | None = None,
    progress_phase: str | None = None,
) -> list[str]:
    """Completions of encoded prompts (encoded with add_generation_prompt=True), batched with left padding and
    the KV cache; greedy when `temperature` is 0, sampled otherwise (torch's RNG, so a resumed run repeats it).
    With `progress_phase`, each batch is reported to the progress view as that many questions answered."""
    tokenizer = encoder.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    device = next(model.parameters()).device
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature
        else {"do_sample": False}
    )
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        samples = prompts[start : start + batch_size]
        width = max(s.num_tokens for s in samples)
        ids = torch.full((len(samples), width), pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(samples):
            ids[b, width - s.num_tokens :] = s.input_ids
            mask[b, width - s.num_tokens :] = 1
        # mm_token_type_ids: without it, generate gives the image tokens plain text positions (no 2-D M-RoPE)
        image_token = encoder.image_token_id
        vision = generation_vision_inputs(samples, device)
        with own_generation_config(model):  # only these settings: a checkpoint's repetition_penalty etc. stay out
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                mm_token_type_ids=(ids == image_token).to(torch.int32).to(device),
                **vision,
                max_new_tokens=max_new_tokens,
                use_cache=True,
                eos_token_id=end_id,
                pad_token_id=pad_id,
                return_dict_in_generate=True,
                output_logits=first_logits is not None,
                **sampling,
                # ZeRO-3 gathers weights in every forward, so every rank keeps stepping until all are done; a plain
                # copy evaluated on rank 0 alone (sft, reward_model, pretrain after DeepSpeed) must not wait for peers
                synced_gpus=_zero3_partitioned(model) and torch.distributed.get_world_size() > 1,
            )
        if first_logits is not None:
            first_logits.extend(out.logits[0].float().cpu())
        for row in out.sequences[:, width:]:
            row = row.tolist()
            row = row[: row.index(end_id)] if end_id in row else row
            answers.append(tokenizer.decode(row, skip_special_tokens=True).strip())
        if progress_phase:
            progress.update(progress_phase, len(answers), len(prompts), "questions")
    return answers


def answer_samples(encoder: ConversationEncoder, records: list[dict], answers: list[str]) -> list[Sample]:
    """Teacher-forced samples (prompt + given answer) for loss and confidence."""
    return [
        encoder.encode(
            [*prompt_turns(r["question"]), {"role": "assistant", "text": a}], images=[r["pil"]], sample_id=r["id"]
        )
        for r, a in zip(records, answers, strict=True)
    ]


@torch.no_grad()
def heldout_loss(
    model, samples: list[Sample], *, max_tokens: int = 4096, chunk_rows: int = TrainConfig().loss_chunk_tokens
) -> list[float]:
    """Per-sample mean target-token loss, packed (exact), the LM head run `chunk_rows` target rows at a time."""
    device = next(model.parameters()).device
    losses = [0.0] * len(samples)
    for group in plan_micro_batches(
        [s.num_tokens for s in samples], max(max_tokens, max(s.num_tokens for s in samples))
    ):
        batch = pack([samples[i] for i in group])
        batch = to_device(batch, device)
        per_sample = per_sample_sequence_loss(model, batch, chunk_rows=chunk_rows)
        for i, value in zip(group, per_sample.tolist(), strict=True):
            losses[i] = value
    return losses


@torch.no_grad()
def answer_logits(model, samples: list[Sample], *, max_tokens: int = 4096) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each sample, (logits at its target positions (n, V), target ids (n,)), float32 on the CPU."""
    device = next(model.parameters()).device
    out: list = [None] * len(samples)
    for group in plan_micro_batches(
        [s.num_tokens for s in samples], max(max_tokens, max(s.num_tokens for s in samples))
    ):
        batch = pack([samples[i] for i in group])
        batch = to_device(batch, device)
        logits = forward_logits(model, batch)[0].float().cpu()
        targets, seq = batch["targets"][0].cpu(), batch["seq_index"][0].cpu()
        for local, i in enumerate(group):
            where = (seq == local) & (targets != IGNORE_INDEX)
            out[i] = (logits[where], targets[where])
    return out


def confidences(pairs: list[tuple[torch.Tensor, torch.Tensor]], temperature: float) -> list[float]:
    """Sequence probability of each answer under temperature-scaled logits."""
    return [math.exp(float(torch.log_softmax(lg / temperature, -1).gather(1, t[:, None]).sum())) for lg, t in pairs]


def expected_calibration_error(conf: list[float], correct: list[float], bins: int = 10) -> float:
    """ECE with equal-width confidence bins."""
    if len(conf) != len(correct) or not conf:
        raise ValueError("ECE needs the same, non-zero number of confidences and correctness values.")
    total, error = len(conf), 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        idx = [i for i, c in enumerate(conf) if lo < c <= hi or (b == 0 and c == 0.0)]
        if idx:
            error += (
                len(idx) / total * abs(sum(conf[i] for i in idx) / len(idx) - sum(correct[i] for i in idx) / len(idx))
            )
    return error


TEMPERATURE_GRID = tuple(round(0.25 * k, 2) for k in range(2, 41))  # 0.5 .. 10


def fit_temperature(pairs, correct: list[float], grid: tuple[float, ...] | None = None) -> tuple[float, float]:
    """(temperature, ECE) minimising ECE over a grid (temperature scaling after SFT)."""
    grid = grid or TEMPERATURE_GRID
    best = min(grid, key=lambda t: (expected_calibration_error(confidences(pairs, t), correct), abs(t - 1.0)))
    return best, expected_calibration_error(confidences(pairs, best), correct)


def score_rows(encoder: ConversationEncoder, records: list[dict], answers: list[str]) -> list[dict]:
    """Per-record rows {"id", "type", "question", "answer", "prediction", "score"} (+ "answers" for several
    references, "benchmark", "scorer", "choices", a pixel "box" with its frame), each scored by its record's task
    (data/tasks.py)."""
    rows = []
    for r, a in zip(records, answers, strict=True):
        scored = {**r, **encoder.box_frame(r)}
        row = {"id": r["id"], "type": r["type"], "question": r["question"], "answer": r["answer"], "prediction": a}
        row["score"] = T.score(a, scored)
        for key in ("benchmark", "scorer", "choices", "box", "box_convention", "image_size", "model_size"):
            if scored.get(key):
                row[key] = scored[key]
        if len(r.get("answers", ())) > 1:
            row["answers"] = r["answers"]
        rows.append(row)
    return rows


def evaluate_vqa(
    model, encoder: ConversationEncoder, records: list[dict], *, batch_size: int = 16, max_new_tokens: int = 48
) -> tuple[dict[str, float], list[dict]]:
    """Suite metrics (tasks.summarize: per task and per benchmark) and the per-record predictions."""
    answers = generate_answers(model, encoder, records, batch_size=batch_size, max_new_tokens=max_new_tokens)
    rows = score_rows(encoder, records, answers)
    return T.summarize(rows), rows
