"""The reward model artifact: a Qwen2(.5)-VL with a scalar head, read at the K-th response token.

The reward_model stage trains and saves it; the rl stage scores rollouts and select_checkpoint scores each
candidate's held-out answers with `RewardModelScorer`. Format of a saved
`model/`: the backbone in HF format (safetensors), `reward_head.safetensors` (the head) and `reward_model.json`
(`score_first_k`, `reward_mean` / `reward_std` over training answers, for normalisation).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from components._shared.model.encoder import IGNORE_INDEX, Sample
from components._shared.model.packing import forward_hidden
from components._shared.model.sources import REWARD_HEAD_FILE
from components._shared.model.vlm import load_vlm, qwen_model, save_vlm

HEAD_FILE = REWARD_HEAD_FILE
META_FILE = "reward_model.json"
LIKELIHOOD_KEY = "likelihood_weight"  # in HEAD_FILE when the score has the likelihood term


class RewardModel(torch.nn.Module):
    """A Qwen2(.5)-VL (the full conditional-generation model, so it saves and loads as one) plus a scalar head."""

    def __init__(self, backbone, *, likelihood_term: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = qwen_model(backbone).config.text_config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.normal_(self.head.weight, std=1.0 / hidden**0.5)
        torch.nn.init.zeros_(self.head.bias)
        # the backbone's own mean log-probability of the answer (up to the K-th token), weighted: what the SFT model
        # knows about the image (a colour, a count) that a head on one hidden state does not read out
        self.likelihood_weight = torch.nn.Parameter(torch.ones(())) if likelihood_term else None

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def gradient_checkpointing_enable(self, **kwargs):
        """Checkpoint the backbone's layers (the head is one Linear): what TrainLoop asks of a model when
        `train.gradient_checkpointing` is on."""
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def enable_input_require_grads(self):
        self.backbone.enable_input_require_grads()

    def scores(self, batch: dict, samples: list[Sample]) -> torch.Tensor:
        """One reward per sample of a packed batch, read at each sample's `reward_index`."""
        hidden = forward_hidden(self.backbone, batch)[0]
        starts = torch.tensor([0, *[s.num_tokens for s in samples]]).cumsum(0)[:-1]
        read_at = torch.tensor([s.meta["reward_index"] for s in samples])
        index = (starts + read_at).to(hidden.device)
        score = self.head(hidden[index].to(self.head.weight.dtype)).float().squeeze(-1)
        if self.likelihood_weight is None:
            return score
        return score + self.likelihood_weight.float() * self._answer_logprob(hidden, batch, starts, read_at)

    def _answer_logprob(self, hidden, batch: dict, starts: torch.Tensor, read_at: torch.Tensor) -> torch.Tensor:
        """Mean log-probability of each sample's answer tokens up to the one the reward is read at."""
        device = hidden.device
        targets = batch["targets"].to(device).flatten()
        seq = batch["seq_index"].to(device).flatten()
        known = seq.clamp_min(0)
        local = torch.arange(targets.numel(), device=device) - starts.to(device)[known]
        valid = (targets != IGNORE_INDEX) & (seq >= 0) & (local < read_at.to(device)[known])
        logits = self.backbone.get_output_embeddings()(hidden[valid]).float()
        token = torch.log_softmax(logits, dim=-1).gather(1, targets[valid][:, None]).squeeze(1)
        n = len(starts)
        sums = torch.zeros(n, device=device).index_add_(0, seq[valid], token)
        counts = torch.zeros(n, device=device).index_add_(0, seq[valid], torch.ones_like(token))
        return sums / counts.clamp_min(1)


def reward_index(sample: Sample, k: int) -> int:
    """Position of the K-th response token of a sample (the last one when the response is shorter)."""
    positions = (sample.labels != IGNORE_INDEX).nonzero().flatten()
    if positions.numel() == 0:
        raise ValueError(f"sample {sample.sample_id!r} has no response tokens to score.")
    return int(positions[min(k, positions.numel()) - 1])


def save_reward_model(
    model: RewardModel,
    processor,
    out_dir: Path,
    *,
    score_first_k: int,
    mean: float,
    std: float,
    base_model: str,
    dtype: torch.dtype | None = None,
) -> None:
    from safetensors.torch import save_file

    meta = {"stage": "reward_model", "base_model": str(base_model)}
    save_vlm(model.backbone, processor, out_dir, metadata=meta, dtype=dtype)
    head = dict(model.head.state_dict())
    if model.likelihood_weight is not None:
        head[LIKELIHOOD_KEY] = model.likelihood_weight
    save_file({k: v.detach().cpu().contiguous() for k, v in head.items()}, str(out_dir / HEAD_FILE))
    (out_dir / META_FILE).write_text(
        json.dumps({"score_first_k": score_first_k, "reward_mean": mean, "reward_std": std}, indent=2) + "\n"
    )


def load_reward_model(uri: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[RewardModel, Any, dict]:
    """(reward model, processor, meta) from a directory written by this stage (safetensors only)."""
    from safetensors.torch import load_file

    from components._shared.model.sources import resolve_model

    path = resolve_model(str(uri))
    if not (path / HEAD_FILE).is_file() or not (path / META_FILE).is_file():
        raise ValueError(f"{uri} has no {HEAD_FILE} / {META_FILE}; point at the reward_model stage's model/ directory.")
    backbone, processor, _ = load_vlm(path, dtype=dtype)
    head = load_file(str(path / HEAD_FILE))
    weight = head.pop(LIKELIHOOD_KEY, None)
    model = RewardModel(backbone, likelihood_term=weight is not None).to(dtype)
    model.head.load_state_dict(head)
    if weight is not None:
        model.likelihood_weight.data.copy_(weight)
    return model.eval(), processor, json.loads((path / META_FILE).read_text())


class RewardModelScorer:
    """Scores (image, question, answer) with a saved reward model, read at the K-th response token. Images are
    resized within the pixel bounds saved with the reward model (`min_pixels` / `max_pixels` only when it has
    none); bf16 on a GPU (the model only scores: a 7B one would take 28 GB in fp32)."""

    def __init__(
        self, uri: str, *, min_pixels: int, max_pixels: int, device: torch.device, max_tokens: int = 4096
    ) -> None:
        from components._shared.model.encoder import ConversationEncoder

        self.model, processor, self.meta = load_reward_model(
            uri, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        )
        self.model.to(device)
        size = getattr(processor.image_processor, "size", None) or {}
        self.encoder = ConversationEncoder(
            processor,
            self.model.backbone,
            min_pixels=int(size.get("shortest_edge", min_pixels)),
            max_pixels=int(size.get("longest_edge", max_pixels)),
        )
        self.max_tokens = max_tokens

    @torch.no_grad()
    def raw_scores(self, records: list[dict], answers: list[str], map_groups: MapGroups | None = None) -> list[float]:
        """One score per (record {"id", "question", "pil"}, answer); `map_groups(groups, fn)` runs the packed
        micro-batches (default: here, one after the other; the rl stage deals them to its processes)."""
        from components._shared.model.packing import pack, plan_micro_batches, to_device

        samples = []
        for i, (record, answer) in enumerate(zip(records, answers, strict=True)):
            answer = self.encoder.template.shown_answer(answer)  # a generated answer, as a conversation shows it
            turns = [{"role": "user", "text": f"<image>\n{record['question']}"}, {"role": "assistant", "text": answer}]
            sample = self.encoder.encode(turns, images=[record["pil"]], sample_id=f"{record['id']}#{i}")
            sample.meta["reward_index"] = reward_index(sample, int(self.meta["score_first_k"]))
            samples.append(sample)
        device = next(self.model.parameters()).device
        out = [0.0] * len(samples)
        budget = max(self.max_tokens, max(s.num_tokens for s in samples))
        groups = plan_micro_batches([s.num_tokens for s in samples], budget)

        def scores(group: list[int]) -> list[float]:
            micro = [samples[i] for i in group]
            return self.model.scores(to_device(pack(micro), device), micro).tolist()

        for group, values in zip(groups, (map_groups or _in_turn)(groups, scores), strict=True):
            for i, score in zip(group, values, strict=True):
                out[i] = score
        return out

    def standardised(self, records: list[dict], answers: list[str], map_groups: MapGroups | None = None) -> list[float]:
        """Scores minus the training answers' mean, over their std (0 = an average SFT-quality answer)."""
        std = max(float(self.meta["reward_std"]), 1e-6)
        raw = self.raw_scores(records, answers, map_groups)
        return [(s - float(self.meta["reward_mean"])) / std for s in raw]


MapGroups = Callable[[list[list[int]], Callable[[list[int]], list[float]]], list[list[float]]]


def _in_turn(groups: list[list[int]], fn: Callable[[list[int]], list[float]]) -> list[list[float]]:
    return [fn(group) for group in groups]
