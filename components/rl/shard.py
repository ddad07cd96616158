"""The rl stage over several processes: each rank does its share of a step's work and every rank gets all of it.

A step's rollouts are generated in chunks (`rollout.batch_size` samples each, the same chunks whatever the number of
processes, each sampled from its own seed), scored in packed micro-batches, and the chunks and micro-batches are
dealt to the ranks round-robin; the results are gathered so every rank holds the step's complete rollouts. Rewards,
advantages and the algorithm's state are then computed identically on every rank, and the update shards its
micro-batches over the ranks as every TrainLoop stage does. One process and several therefore see the same
rollouts and the same advantages, and differ only by the data-parallel update's float rounding.

A model sharded with ZeRO-3 (the policy under `train.zero_stage: 3`, the frozen reference under
`frozen_sharding: zero3`) gathers each layer's weights from every rank in every forward, so all ranks must run the
same number of forwards: `lockstep` pads a rank's share with repeats of the first item, whose results are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

Item = TypeVar("Item")


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1

    @staticmethod
    def current() -> Shard:
        """This process's place among the stage's processes (one process outside torch.distributed)."""
        if torch.distributed.is_initialized():
            return Shard(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return Shard()

    def map(self, items: Sequence[Item], fn: Callable[[Item], Any], *, lockstep: bool = False) -> list[Any]:
        """[fn(item) for item in items], each computed on one rank (item i on rank i % world) and gathered on all."""
        if self.world == 1:
            return [fn(item) for item in items]
        mine = list(range(self.rank, len(items), self.world))
        rounds = math.ceil(len(items) / self.world) if lockstep else len(mine)
        results: dict[int, Any] = {}
        for k in range(rounds):
            if k < len(mine):
                results[mine[k]] = fn(items[mine[k]])
            else:  # a collective-using model: this rank forwards too, on a repeat whose result is dropped
                fn(items[0])
        gathered: list[dict[int, Any]] = [{} for _ in range(self.world)]
        torch.distributed.all_gather_object(gathered, results)  # pickled between this stage's own processes
        merged = {i: r for part in gathered for i, r in part.items()}
        return [merged[i] for i in range(len(items))]


ONE_PROCESS = Shard()
