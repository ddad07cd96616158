"""Encoded training items kept for reuse: a record drawn again in a later epoch is not decoded, resized,
tokenised and position-indexed again.

A stage's `sample(i)` is a pure function of the record index (the image, the processor, the chat template), and on
a small set trained for many passes (the demo's SFT draws each record ~27 times) building items was 40% of a CPU
step. `SampleCache` keeps built items (a Sample, or a list of them: a preference pair) up to `max_bytes` of their
tensors, least recently used first out; a set larger than that (a real SFT set, one pass) keeps what fits and
builds the rest as before. Items are shared, not copied: packing copies their tensors into the micro-batch and no
step writes into them. With data workers each worker process keeps its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

import torch


def item_bytes(item: Any) -> int:
    """Bytes of the tensors an item holds (a Sample's fields, or a list / tuple of Samples)."""
    if isinstance(item, list | tuple):
        return sum(item_bytes(part) for part in item)
    if is_dataclass(item):
        return sum(item_bytes(getattr(item, f.name)) for f in fields(item))
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    return 0


class SampleCache:
    """`cache(i)` = `build(i)`, built once while the items kept fit `max_bytes` (0: nothing kept)."""

    def __init__(self, build: Callable[[int], Any], max_bytes: int) -> None:
        self.build, self.max_bytes = build, max_bytes
        self._kept: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.hits = self.built = 0

    def __call__(self, index: int) -> Any:
        if index in self._kept:
            self._kept.move_to_end(index)
            self.hits += 1
            return self._kept[index][0]
        item = self.build(index)
        self.built += 1
        size = item_bytes(item)
        if 0 < size <= self.max_bytes:
            self._kept[index] = (item, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._kept.popitem(last=False)
                self.bytes -= dropped
        return item
