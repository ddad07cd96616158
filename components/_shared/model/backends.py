"""The optimizer backends a TrainLoop drives: the `Backend` protocol and `TorchBackend` (plain AdamW in one process,
per-group clipping, a LambdaLR schedule); `DeepSpeedBackend` (ds_backend.py) is the other."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from components._shared.model import checkpoint as ckpt
from components._shared.model.train_config import OptimConfig
from components._shared.model.vlm import named_groups


def build_optimizer(model, optim: OptimConfig) -> tuple[torch.optim.Optimizer, list[str]]:
    """AdamW over the trainable parameters, one group per module group with its lr and clip."""
    groups, names = [], []
    for group, params in named_groups(model).items():
        groups.append(
            {
                "params": [p for _, p in params],
                "lr": optim.group_lr.get(group, optim.lr),
                "max_grad_norm": optim.group_max_grad_norm.get(group, optim.max_grad_norm),
                "name": group,
            }
        )
        names.append(group)
    if not groups:
        raise ValueError("no trainable parameters: check the freeze / LoRA settings of this stage.")
    for g in groups:
        g["initial_lr"] = g["lr"]
    return adamw(groups, optim), names


def adamw(groups: list[dict], optim: OptimConfig, *, offloaded: bool = False) -> torch.optim.AdamW:
    """torch's AdamW over `groups`, fused where `optim.fused` asks for it (auto: every parameter on a GPU and the
    optimizer not `offloaded` to the CPU), else multi-tensor (foreach)."""
    on_gpu = all(p.is_cuda for g in groups for p in g["params"])
    fused = optim.fused == "on" or (optim.fused == "auto" and on_gpu and not offloaded)
    return torch.optim.AdamW(
        groups, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay, fused=True if fused else None
    )


def clip_per_group(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Clip each parameter group on its own gradient norm; returns the norms before clipping (read in one sync)."""
    norms = {}
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            norms[group["name"]] = torch.nn.utils.clip_grad_norm_(params, group["max_grad_norm"]).float()
    if not norms:
        return {}
    device = next(iter(norms.values())).device
    read = torch.stack([n.to(device) for n in norms.values()]).tolist()  # one host sync for every group's norm
    return dict(zip(norms, read, strict=True))


class Backend(Protocol):
    """What TrainLoop drives: `TorchBackend` (one process) or `DeepSpeedBackend` (model/ds_backend.py)."""

    module: Any
    groups: list[str]
    rank: int
    world_size: int

    def begin_step(self, micro_batches: int) -> None: ...
    def before_forward(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> tuple[dict[str, float], list[float]]: ...
    def all_reduce_sum(self, values: list[float]) -> list[float]: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def gathered(self) -> AbstractContextManager: ...


class TorchBackend:
    """Plain AdamW with per-group clipping and a LambdaLR schedule. `grad_ema` (rl's TER), when set, smooths the
    clipped gradients before the optimizer step and is saved with the checkpoint."""

    rank, world_size = 0, 1
    grad_ema: Any = None

    def __init__(self, model, *, optim: OptimConfig, lr_lambda: Callable[[int], float]) -> None:
        self.module = model
        self.optimizer, self.groups = build_optimizer(model, optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    def begin_step(self, micro_batches: int) -> None:
        pass

    def before_forward(self) -> None:
        pass

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> tuple[dict[str, float], list[float]]:
        norms = clip_per_group(self.optimizer)
        if self.grad_ema is not None:
            self.grad_ema.apply(self.module.named_parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.scheduler.step()
        return norms, lrs

    def save(self, directory: Path) -> None:
        ckpt.save_torch_state(directory, self.module, self.optimizer, self.scheduler)
        if self.grad_ema is not None:
            from safetensors.torch import save_file

            save_file(
                {k: v.contiguous().cpu() for k, v in self.grad_ema.buffers.items()},
                str(directory / "grad_ema.safetensors"),
            )

    def load(self, directory: Path) -> None:
        ckpt.load_torch_state(directory, self.module, self.optimizer, self.scheduler)
        if self.grad_ema is not None:
            from safetensors.torch import load_file

            device = next(self.module.parameters()).device
            self.grad_ema.buffers = {
                k: v.to(device) for k, v in load_file(str(directory / "grad_ema.safetensors")).items()
            }

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)  # one process: the sum over ranks is the values themselves

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    @contextmanager
    def gathered(self):
        yield
