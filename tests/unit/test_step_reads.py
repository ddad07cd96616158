"""A training step reads its loss, extras and gradient norms back to the host once, not once per micro-batch and
value: on a GPU each read is a sync that drains the queue while the host waits (issue 43). Counted by a tensor
subclass on what the loss function returns (every tensor computed from it stays of the subclass), and by patched
readers around the per-group clipping. The forward itself reads nothing back in the project's own code: a packed
row's sample bounds and target positions come from `pack()` on the host (the reads left are transformers' own)."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.vlm import load_vlm

READS = {"n": 0}


class Counted(torch.Tensor):
    """A tensor that counts the times it is read to the host (item, float, tolist)."""

    def item(self):
        READS["n"] += 1
        return super().item()

    def __float__(self):
        READS["n"] += 1
        return super().__float__()

    def tolist(self):
        READS["n"] += 1
        return super().tolist()


def _loop(tmp_path, max_tokens: int, loss_fn):
    from components._shared.model.checkpoint import CheckpointStore
    from components._shared.model.train_config import OptimConfig, ScheduleConfig, TrainConfig
    from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop
    from tests.unit.test_families import BUILTINS, PIXELS, _samples

    model, processor, _ = load_vlm(BUILTINS["qwen2_5_vl"])
    samples = _samples(ConversationEncoder(processor, model, **PIXELS))
    train = TrainConfig(steps=1, samples_per_step=len(samples), max_tokens_per_micro_batch=max_tokens, threads=1)
    loop = TrainLoop(
        model,
        LoopSettings(train, OptimConfig(lr=1e-3), ScheduleConfig()),
        LoopData(phases=[Phase("all", 1, list(range(len(samples))))], sample=lambda i: samples[i]),
        CheckpointStore(tmp_path / "ckpt"),
        loss_fn=loss_fn,
    )
    return loop, samples


@pytest.mark.parametrize("max_tokens", [4096, 128])
def test_the_loss_and_extras_are_read_once_a_step_whatever_the_micro_batches(tmp_path, max_tokens):
    from components._shared.model.training import default_loss

    calls = {"n": 0}

    def counted_loss(model, batch, samples):
        calls["n"] += 1
        loss_sum, targets, extra = default_loss(model, batch, samples)
        probe = loss_sum.detach().as_subclass(Counted) * 0 + 0.5
        return loss_sum.as_subclass(Counted), targets, {**extra, "probe": probe, "host": 1.0}

    loop, samples = _loop(tmp_path, max_tokens, counted_loss)
    READS["n"] = 0
    metrics = loop.train_step(samples)
    assert metrics["micro_batches"] == calls["n"] and (calls["n"] == 1 if max_tokens == 4096 else calls["n"] >= 4)
    assert READS["n"] == 1  # before: one float() of the loss and one of each tensor extra per micro-batch
    assert metrics["probe"] == pytest.approx(0.5) and metrics["host"] == pytest.approx(1.0)
    assert metrics["loss"] > 0


def test_the_step_loss_equals_the_host_sum_bit_for_bit():
    from components._shared.model.training import read_once

    values = [torch.tensor(v, dtype=torch.float32) for v in (2.3456789, 1e-3, 7.25, 0.1)]
    weights = [1.0, 0.5, 3.0, 1.0]
    on_host, on_device = 0.0, 0.0
    for weight, value in zip(weights, values, strict=True):
        on_host += weight * float(value)
        on_device = on_device + weight * value.double()
    loss, extras = read_once(on_device, {"x": 1.5})
    assert loss == on_host and extras == {"x": 1.5}  # exactly: the float64 sum the step's log always had
    assert read_once(0.0, {}) == (0.0, {})


def test_every_groups_gradient_norm_is_read_in_one_transfer(monkeypatch):
    from components._shared.model.backends import clip_per_group

    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    groups = [
        {"name": f"g{i}", "params": list(layer.parameters()), "max_grad_norm": 0.1} for i, layer in enumerate(layers)
    ]
    for layer in layers:
        layer(torch.ones(2, 4)).sum().backward()
    expected = {
        g["name"]: float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in g["params"]]))) for g in groups
    }
    reads = {"n": 0}
    for name in ("item", "__float__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            reads["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    norms = clip_per_group(torch.optim.SGD(groups, lr=0.1))
    monkeypatch.undo()
    assert reads["n"] == 1  # before: one float() per group
    assert norms == pytest.approx(expected, rel=1e-6)
    assert all(float(torch.linalg.vector_norm(p.grad)) <= 0.1 + 1e-6 for g in groups for p in g["params"][:1])


SYNCS = (torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default)


class SyncsByOwner(TorchDispatchMode):
    """Counts the ops that read the device back to the host (nonzero, a scalar read, a boolean-mask index), by the
    code that asked for them: the project's own (components/) or a library's (transformers)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        mask = func is torch.ops.aten.index.Tensor and any(t is not None and t.dtype == torch.bool for t in args[1])
        if func in SYNCS or mask:
            frames = [f.filename for f in traceback.extract_stack() if "/torch/" not in f.filename]
            owner = next((f for f in reversed(frames) if "/components/" in f or "/transformers/" in f), "")
            self.counts["ours" if "/components/" in owner else "library"] += 1
        return func(*args, **(kwargs or {}))


HOST_GIVEN = ("sample_lengths", "cu_seqlens", "max_seqlen", "target_positions")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen4_exp"])
def test_the_forward_reads_nothing_back_in_the_projects_own_code(family):
    from components._shared.model.packing import pack
    from components._shared.model.training import default_loss
    from tests.unit.test_families import BUILTINS, PIXELS, _samples

    model, processor, _ = load_vlm(BUILTINS[family])
    batch = pack(_samples(ConversationEncoder(processor, model, **PIXELS)))
    found = {k: v for k, v in batch.items() if k not in HOST_GIVEN}  # a batch without the host's bounds
    losses, grads, syncs = {}, {}, {}
    for name, given in (("given", batch), ("found", found)):
        model.zero_grad()
        with SyncsByOwner() as counter:
            losses[name] = default_loss(model, given, None)[0]
        syncs[name] = counter.counts
        losses[name].backward()
        grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert syncs["given"]["ours"] == 0  # bounds and target rows came with the batch
    assert syncs["found"]["ours"] >= 3  # the counter sees them where the forward finds them itself
    assert torch.equal(losses["given"], losses["found"])  # the same numbers, bit for bit
    assert len(grads["given"]) == len(grads["found"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads["given"], grads["found"], strict=True))


def test_a_checkpointed_layer_recomputed_in_the_backward_reads_nothing_back_either():
    """Non-reentrant checkpointing recomputes each layer in the backward, after the forward's packed_row has ended:
    the bounds are found again by the position tensor the layer saved, not read from the device."""
    from components._shared.model.packing import pack
    from components._shared.model.training import default_loss
    from tests.unit.test_families import BUILTINS, PIXELS, _samples

    model, processor, _ = load_vlm(BUILTINS["qwen2_5_vl"])
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = pack(_samples(ConversationEncoder(processor, model, **PIXELS)))
    with SyncsByOwner() as counter:
        default_loss(model, batch, None)[0].backward()
    assert counter.counts["ours"] == 0
