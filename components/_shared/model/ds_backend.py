"""DeepSpeed ZeRO-2/3 behind the TrainLoop backend interface (backward / step / save / load / full_state_dict).

Runs on the CPU with gloo (one process, or several under torchrun) and on GPUs with NCCL. The loop decides
where an optimizer step ends (a variable number of packed micro-batches), so gradient_accumulation_steps is
1 and the boundary is set by hand on every backward. Differences from the torch backend, by DeepSpeed's
design: gradient clipping is global (the smallest configured clip), not per module group.

DeepSpeed writes its own checkpoint files and reads them with pickle (torch.load(weights_only=False)); they are
only ever loaded from a committed checkpoint of this run, after every file's sha256 was verified against the
marker written with it, so point checkpoint locations at storage only the pipeline can write.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from components._shared.model.backends import adamw
from components._shared.model.train_config import OptimConfig, TrainConfig
from components._shared.model.vlm import named_groups, qwen_model

TAG = "state"


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed (gloo on CPU, NCCL on GPU) once; single-process defaults when not under
    torchrun. Returns (rank, world_size)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", "").strip() or 0)
            )  # one GPU per rank, before any CUDA work
        if "RANK" not in os.environ:
            # One process outside torchrun: a private group on a free port. Only LOCAL_RANK (which DeepSpeed's
            # engine insists on) is set, so child processes never inherit a RANK / MASTER_PORT that is not theirs.
            os.environ.setdefault("LOCAL_RANK", "0")
            torch.distributed.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def ds_config(train: TrainConfig, optim: OptimConfig, world_size: int = 1) -> dict:
    """The DeepSpeed config for `train` over `world_size` ranks (no train_batch_size: the loop owns batching)."""
    overlap = train.overlap_comm
    if overlap is None:  # a side stream only pays where there is a transfer to hide behind the backward
        overlap = torch.cuda.is_available() and world_size > 1
    zero: dict = {"stage": train.zero_stage, "overlap_comm": overlap, "contiguous_gradients": True}
    extra = {}
    if train.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        # The loop's torch AdamW (per-group lrs) steps on the CPU copy; DeepSpeed would otherwise insist on
        # its compiled CPUAdam op.
        extra["zero_force_ds_cpu_optimizer"] = False
    if train.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    bf16 = train.precision == "bf16" or (train.precision == "auto" and torch.cuda.is_available())
    clips = [optim.max_grad_norm, *optim.group_max_grad_norm.values()]
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": min(clips),
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **extra,
    }


class DeepSpeedBackend:
    def __init__(self, model, *, train: TrainConfig, optim: OptimConfig, lr_lambda: Callable[[int], float]) -> None:
        import deepspeed

        self.rank, self.world_size = init_distributed()
        groups = [
            {
                "params": [p for _, p in params],
                "lr": optim.group_lr.get(name, optim.lr),
                "name": name,
                "initial_lr": optim.group_lr.get(name, optim.lr),
            }
            for name, params in named_groups(model).items()
        ]
        if not groups:
            raise ValueError("no trainable parameters: check the freeze / LoRA settings of this stage.")
        self.groups: list[str] = [str(g["name"]) for g in groups]
        optimizer = adamw(groups, optim, offloaded=train.offload_optimizer)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=ds_config(train, optim, self.world_size),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
        )
        self.module = self.engine.module
        if train.zero_stage == 3:
            register_outside_reads(self.module)
        self._pending = 0

    def begin_step(self, micro_batches: int) -> None:
        """Tell the backend how many backward calls this optimizer step has (the last one reduces)."""
        self._pending = micro_batches

    def before_forward(self) -> None:
        """What `engine(...)` does before a forward, which the loop calls on the module itself: the ZeRO optimizer
        closes the previous backward (ZeRO-3 counts the micro-step, so the next backward adds its gradients to the
        step's instead of overwriting them; ZeRO-2 clears its accumulators and hook counts)."""
        self.engine.optimizer.clear_backward_seen_flag()

    def backward(self, loss: torch.Tensor) -> None:
        self._pending -= 1
        self.engine.set_gradient_accumulation_boundary(self._pending <= 0)
        # ZeRO averages gradients over ranks; the loss is already normalised by the step's global target count
        self.engine.backward(loss * self.world_size)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        torch.distributed.all_reduce(tensor)
        return tensor.tolist()

    def step(self) -> tuple[dict[str, float], list[float]]:
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return ({"global": float(norm)} if norm is not None else {}), lrs

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(Path(directory) / "deepspeed"), tag=TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(Path(directory) / "deepspeed"), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise ValueError(
                f"{directory}/deepspeed holds no DeepSpeed checkpoint tagged {TAG!r}; was it written "
                "with train.backend=torch? Resume with the backend that wrote it."
            )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight on the CPU, trainable ones from DeepSpeed's fp32 master copy (not the bf16 module)."""
        from deepspeed.utils import safe_get_full_fp32_param

        with self.gathered():
            state = {k: v.detach().float().cpu().clone() for k, v in self.module.state_dict().items()}
            for name, param in self.module.named_parameters():
                if param.requires_grad:
                    state[name] = safe_get_full_fp32_param(param).detach().float().cpu().clone()
        return state

    @contextmanager
    def gathered(self):
        """Full parameters inside the block (ZeRO-3 partitions them between steps)."""
        if self.engine.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                yield
        else:
            yield


def register_outside_reads(model) -> None:
    """ZeRO-3 gathers a parameter around its owner's forward; a family whose layers read a child's weight without
    calling the child names those pairs, and each is registered with the module that reads it."""
    from deepspeed.runtime.zero import register_external_parameter

    from components._shared.model.families import family_for

    qwen = qwen_model(model)
    for reader, param in family_for(qwen.config).zero3_external_parameters(qwen):
        register_external_parameter(reader, param)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
