"""The LM-head losses in row chunks equal the plain full-logits path, and never hold rows x vocabulary at once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from components._shared.model.head_loss import cross_entropy_rows, fused_head_loss, head_rows_map

ROOT = Path(__file__).resolve().parents[2]
VOCABULARIES = [151_936, 248_320]  # Qwen2 / 2.5 / 3-VL and Qwen3.5


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (elements) any op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _case(vocab: int, rows: int = 300, hidden: int = 16, bias: bool = True):
    torch.manual_seed(vocab % 1000)
    head = nn.Linear(hidden, vocab, bias=bias)
    h = torch.randn(rows, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    return head, h, targets


def _grads(value: torch.Tensor, head: nn.Linear, h: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(value, [h, head.weight, head.bias]))


def _assert_close(chunked, plain, tolerance=1e-5):
    for a, b in zip(chunked, plain, strict=True):
        a, b = a.detach(), b.detach()
        assert float((a - b).abs().max()) <= tolerance * max(float(b.abs().max()), 1e-12)


@pytest.mark.parametrize("vocab", VOCABULARIES)
def test_chunked_cross_entropy_equals_the_plain_loss_and_gradients(vocab):
    head, h, targets = _case(vocab)
    plain = F.cross_entropy(head(h).float(), targets, reduction="sum")
    per_row: list[torch.Tensor] = []
    chunked = fused_head_loss(h, head, cross_entropy_rows(targets, per_row), chunk_rows=64)  # 5 chunks, last short
    assert abs(float(chunked.detach()) - float(plain.detach())) <= 1e-5 * float(plain.detach())
    _assert_close(_grads(chunked * 0.37, head, h), _grads(plain * 0.37, head, h))
    expected_rows = F.cross_entropy(head(h).float(), targets, reduction="none").detach()
    assert torch.allclose(torch.cat(per_row), expected_rows, rtol=1e-5)


@pytest.mark.parametrize("vocab", VOCABULARIES)
def test_chunked_per_row_outputs_equal_the_plain_ones_and_their_gradients(vocab):
    head, h, targets = _case(vocab)
    weights = torch.linspace(-1, 1, h.shape[0])

    def logprob_entropy(z, rows):  # what RL's scoring and update read
        logp = torch.log_softmax(z / 0.7, -1)
        return logp.gather(1, targets[rows][:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)

    def objective(outputs):  # a loss known only after the outputs, as PPO's
        logp, entropy = outputs
        return (weights * torch.exp(logp - logp.detach())).sum() + (entropy**2).sum()

    plain = logprob_entropy(head(h).float(), slice(0, h.shape[0]))
    chunked = head_rows_map(h, head, logprob_entropy, chunk_rows=64)
    _assert_close(chunked, plain)
    _assert_close(_grads(objective(chunked), head, h), _grads(objective(plain), head, h))


def test_the_chunked_head_never_holds_rows_times_vocabulary():
    vocab, rows, chunk = 151_936, 256, 32
    head, h, targets = _case(vocab, rows=rows)
    for chunked in (True, False):
        with LargestTensor() as seen:
            if chunked:
                loss = fused_head_loss(h, head, cross_entropy_rows(targets), chunk_rows=chunk)
            else:
                loss = F.cross_entropy(head(h).float(), targets, reduction="sum")
            loss.backward()
        if chunked:  # the head's weight gradient (vocab x hidden) is the largest tensor left
            assert seen.largest <= max(chunk * vocab, head.weight.numel())
        else:
            assert seen.largest >= rows * vocab


def test_no_grad_and_autocast_take_the_plain_paths_numbers():
    head, h, targets = _case(4096, rows=90)
    with torch.no_grad():
        plain = F.cross_entropy(head(h).float(), targets, reduction="sum")
        assert torch.allclose(fused_head_loss(h, head, cross_entropy_rows(targets), chunk_rows=16), plain, rtol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the head runs in bf16 as it would unchunked
        plain = F.cross_entropy(head(h).float(), targets, reduction="sum")
        chunked = fused_head_loss(h, head, cross_entropy_rows(targets), chunk_rows=16)
    assert abs(float(chunked.detach()) - float(plain.detach())) <= 1e-3 * float(plain.detach())
    _assert_close(_grads(chunked, head, h), _grads(plain, head, h), tolerance=2e-2)


def test_a_head_that_is_not_a_plain_linear_and_chunk_zero_use_the_plain_path():
    head, h, targets = _case(512, rows=40)

    class Wrapped(nn.Module):  # what a LoRA on lm_head looks like to the loss
        def __init__(self) -> None:
            super().__init__()
            self.base = head

        def forward(self, x):
            return self.base(x) * 2.0

    plain = F.cross_entropy((head(h) * 2.0).float(), targets, reduction="sum")
    assert torch.allclose(fused_head_loss(h, Wrapped(), cross_entropy_rows(targets), chunk_rows=8), plain)
    plain = F.cross_entropy(head(h).float(), targets, reduction="sum")
    assert torch.allclose(fused_head_loss(h, head, cross_entropy_rows(targets), chunk_rows=0), plain)


def _train(out: Path, backend: str, chunk: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QVL_TEST_LOSS_CHUNK": str(chunk)}
    cmd = [sys.executable, "-m", "tests.jobs.train_loop_job", str(out), backend]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("losses="))
    return [float(v) for v in line.removeprefix("losses=").split(",")], load_file(str(out / "final.safetensors"))


@pytest.mark.parametrize("backend", ["torch", "deepspeed-3"])
def test_training_with_the_chunked_head_follows_the_plain_one(tmp_path, backend):
    """8 steps of the tiny model: per-step losses and final weights as with full logits. ZeRO-3
    takes the checkpointed-module path (its partitioned head), torch the eager one."""
    plain_losses, plain = _train(tmp_path / "plain", backend, 0)
    chunked_losses, chunked = _train(tmp_path / "chunked", backend, 7)  # several chunks per micro-batch
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-6)
    assert plain_losses[-1] < 0.9 * plain_losses[0]
    assert max(float((chunked[k] - plain[k]).abs().max()) for k in plain) < 1e-4


def test_tied_embeddings_get_both_gradients():
    torch.manual_seed(1)
    vocab, hidden = 1000, 8
    embed, head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
    head.weight = embed.weight  # Qwen2.5-VL-3B / Qwen3-VL-2B tie them
    ids, targets = torch.randint(0, vocab, (50,)), torch.randint(0, vocab, (50,))
    plain = F.cross_entropy(head(torch.tanh(embed(ids))).float(), targets, reduction="sum")
    (expected,) = torch.autograd.grad(plain, embed.weight)
    chunked = fused_head_loss(torch.tanh(embed(ids)), head, cross_entropy_rows(targets), chunk_rows=8)
    (got,) = torch.autograd.grad(chunked, embed.weight)
    assert torch.allclose(got, expected, atol=1e-6) and expected.abs().sum() > 0
