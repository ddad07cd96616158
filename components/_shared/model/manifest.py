"""What a run trains, per module group, and proof afterwards that the frozen groups did not move.

Freeze flags that leave a module trainable (Qwen3-VL's DeepStack mergers, `visual.pos_embed`) or an optimizer
that updates what was meant to stay frozen are silent in other trainers. `TrainLoop` records a manifest before its
first step (trainable / frozen parameters per group) and a fingerprint of every frozen tensor (float64 sum and sum
of squares); after the last step it checks the fingerprints and raises, naming the group and tensor, if one moved.
Under ZeRO-3 the frozen tensors are partitioned over the ranks and only the counts are recorded.
"""

from __future__ import annotations

import torch

from components._shared.model.train_config import MODULE_GROUPS
from components._shared.model.vlm import parameter_groups


def parameter_manifest(model) -> dict[str, dict[str, int]]:
    """{group: {"trainable": n, "frozen": n}} in parameters (elements), every group listed."""
    out = {g: {"trainable": 0, "frozen": 0} for g in MODULE_GROUPS}
    for group, _, param in parameter_groups(model):
        out[group]["trainable" if param.requires_grad else "frozen"] += int(getattr(param, "ds_numel", param.numel()))
    return out


def frozen_fingerprints(model) -> dict[str, tuple[str, float, float]]:
    """{parameter name: (group, sum, sum of squares)} of every frozen tensor ({} when they are partitioned)."""
    out = {}
    with torch.no_grad():
        for group, name, param in parameter_groups(model):
            if param.requires_grad:
                continue
            if hasattr(param, "ds_id"):  # ZeRO-3: this rank holds a shard, not the tensor
                return {}
            data = param.detach().double()
            out[name] = (group, float(data.sum()), float(data.square().sum()))
    return out


def check_frozen(before: dict[str, tuple[str, float, float]], model) -> None:
    """Raise if a tensor frozen at the start changed (or became trainable) during training."""
    if not before:
        return
    after = frozen_fingerprints(model)
    moved = [name for name, value in before.items() if after.get(name) != value]
    if moved:
        group = before[moved[0]][0]
        raise RuntimeError(
            f"{len(moved)} frozen tensor(s) changed during training, first {moved[0]!r} (group {group}); something "
            "updated parameters the freeze settings excluded (an optimizer group or a module the freeze list "
            "does not reach). Check freeze / train_* settings and the module groups (docs/models.md)."
        )
