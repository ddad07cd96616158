"""The reward model artifact: a Qwen2(.5)-VL with a scalar head, read at the K-th response token.

The reward_model stage trains and saves it; the rl stage loads it to score rollouts. Format of a saved
`model/`: the backbone in HF format (safetensors), `reward_head.safetensors` (the head) and `reward_model.json`
(`score_first_k`, `reward_mean` / `reward_std` over training answers, for normalisation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from components._shared.packing import IGNORE_INDEX, Sample, forward_hidden
from components._shared.vlm import load_vlm, qwen_model, save_vlm

HEAD_FILE = "reward_head.safetensors"
META_FILE = "reward_model.json"


class RewardModel(torch.nn.Module):
    """A Qwen2(.5)-VL (the full conditional-generation model, so it saves and loads as one) plus a scalar head."""

    def __init__(self, backbone) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = qwen_model(backbone).config.text_config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.normal_(self.head.weight, std=1.0 / hidden**0.5)
        torch.nn.init.zeros_(self.head.bias)

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def scores(self, batch: dict, samples: list[Sample]) -> torch.Tensor:
        """One reward per sample of a packed batch, read at each sample's `reward_index`."""
        hidden = forward_hidden(self.backbone, batch)[0]
        starts = torch.tensor([0, *[s.num_tokens for s in samples]]).cumsum(0)[:-1]
        index = starts + torch.tensor([s.meta["reward_index"] for s in samples])
        return self.head(hidden[index.to(hidden.device)].to(self.head.weight.dtype)).float().squeeze(-1)


def reward_index(sample: Sample, k: int) -> int:
    """Position of the K-th response token of a sample (the last one when the response is shorter)."""
    positions = (sample.labels != IGNORE_INDEX).nonzero().flatten()
    if positions.numel() == 0:
        raise ValueError(f"sample {sample.sample_id!r} has no response tokens to score.")
    return int(positions[min(k, positions.numel()) - 1])


def save_reward_model(model: RewardModel, processor, out_dir: Path, *, score_first_k: int, mean: float, std: float,
                      base_model: str) -> None:
    from safetensors.torch import save_file

    save_vlm(model.backbone, processor, out_dir, metadata={"stage": "reward_model", "base_model": str(base_model)})
    save_file({k: v.detach().cpu().contiguous() for k, v in model.head.state_dict().items()}, str(out_dir / HEAD_FILE))
    (out_dir / META_FILE).write_text(json.dumps({"score_first_k": score_first_k, "reward_mean": mean,
                                                 "reward_std": std}, indent=2) + "\n")


def load_reward_model(uri: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[RewardModel, Any, dict]:
    """(reward model, processor, meta) from a directory written by this stage (safetensors only)."""
    from safetensors.torch import load_file

    from components._shared.models import resolve_model

    path = resolve_model(str(uri))
    if not (path / HEAD_FILE).is_file() or not (path / META_FILE).is_file():
        raise ValueError(f"{uri} has no {HEAD_FILE} / {META_FILE}; point at the reward_model stage's model/ directory.")
    backbone, processor = load_vlm(path, dtype=dtype)
    model = RewardModel(backbone).to(dtype)
    model.head.load_state_dict(load_file(str(path / HEAD_FILE)))
    return model.eval(), processor, json.loads((path / META_FILE).read_text())
