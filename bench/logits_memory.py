"""Peak memory and time of one LM-head loss step at Qwen's real vocabularies: full logits against row chunks.

    python bench/logits_memory.py [--tokens 2048,4096,16384] [--vocab 151936,248320] [--hidden 128]
                                  [--chunk 1024] [--repeats 2] [--threads 0] [--json]

One step = the head (hidden -> vocabulary) over a micro-batch of `--tokens` target rows, summed cross-entropy in
fp32, backward to the hidden states and the head weight (fp32 on the CPU). Baseline (`plain`): the full logits at
once, what the stages did before (`F.cross_entropy(head(h).float(), targets)`). Candidate (`chunked`): the stages'
`fused_head_loss` with `--chunk` rows per chunk (train.loss_chunk_tokens). Both arms run in this process, one after
the other per repeat; memory is the process's peak resident set above its level before the step (sampled every
millisecond; tensors this large are mmapped and returned on free), time is wall seconds of the step (median).

The head's memory does not depend on the hidden size, its time does: `--hidden 128` keeps a CPU step in seconds
(a real 3,584-wide head is a GPU's job; the GPU script measures SFT at the 7B shape). A plain arm whose logits
would not fit this machine's free memory is not run; its peak is then extrapolated from the plain arm's measured
bytes per token at the smaller sizes and marked so. Goal printed beside the numbers: >= 4x lower peak at 16k tokens
with step time within 10%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: make `components` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components._shared.model.head_loss import cross_entropy_rows, fused_head_loss  # noqa: E402

GIB = 2**30


class PeakRss:
    """Peak resident set size (bytes above the level at entry) while the block runs, sampled every millisecond."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0

    def __enter__(self) -> PeakRss:
        self.start = self.process.memory_info().rss
        self.top = self.start
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.top = max(self.top, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.top = max(self.top, self.process.memory_info().rss)
        self.peak = self.top - self.start


def step(arm: str, head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, chunk: int) -> float:
    """One loss step (forward + backward) of `arm`; returns its loss."""
    head.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_()
    if arm == "plain":
        loss = F.cross_entropy(head(h).float(), targets, reduction="sum")
    else:
        loss = fused_head_loss(h, head, cross_entropy_rows(targets), chunk_rows=chunk)
    loss.backward()
    return float(loss.detach())


def measure(tokens: int, vocab: int, args) -> dict:
    torch.manual_seed(0)
    head = nn.Linear(args.hidden, vocab, bias=False)
    hidden = torch.randn(tokens, args.hidden)
    targets = torch.randint(0, vocab, (tokens,))
    logits_gib = tokens * vocab * 4 / GIB
    fits = 3.3 * logits_gib < psutil.virtual_memory().available / GIB * 0.85  # measured: ~3 logits-sized copies
    arms = ["plain", "chunked"] if fits else ["chunked"]
    peaks: dict[str, list[float]] = {a: [] for a in arms}
    times: dict[str, list[float]] = {a: [] for a in arms}
    losses: dict[str, float] = {}
    for _ in range(args.repeats):
        for arm in arms:
            with PeakRss() as rss:
                started = time.perf_counter()
                losses[arm] = step(arm, head, hidden, targets, args.chunk)
                times[arm].append(time.perf_counter() - started)
            peaks[arm].append(rss.peak / GIB)
    row = {
        "tokens": tokens,
        "vocab": vocab,
        "hidden": args.hidden,
        "chunk": args.chunk,
        "logits_fp32_gib": logits_gib,
        **{f"{a}_peak_gib": max(peaks[a]) for a in arms},
        **{f"{a}_step_s": statistics.median(times[a]) for a in arms},
        "plain_measured": fits,
    }
    if fits:
        row["loss_rel_diff"] = abs(losses["chunked"] - losses["plain"]) / abs(losses["plain"])
    return row


def extrapolate(rows: list[dict]) -> None:
    """Fill the plain peak (and the ratios) of rows whose plain arm did not fit, from the measured bytes per token."""
    for vocab in {r["vocab"] for r in rows}:
        measured = [r for r in rows if r["vocab"] == vocab and r["plain_measured"]]
        per_token = max((r["plain_peak_gib"] / r["tokens"] for r in measured), default=None)
        for r in rows:
            if r["vocab"] == vocab and not r["plain_measured"] and per_token is not None:
                r["plain_peak_gib"] = per_token * r["tokens"]
    for r in rows:
        if "plain_peak_gib" in r:
            r["peak_ratio"] = r["plain_peak_gib"] / r["chunked_peak_gib"]
        if "plain_step_s" in r:
            r["time_ratio"] = r["chunked_step_s"] / r["plain_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,4096,16384")
    parser.add_argument("--vocab", default="151936,248320")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(int(t), int(v), args) for v in args.vocab.split(",") for t in args.tokens.split(",")]
    extrapolate(rows)
    print(
        f"{'vocab':>7} {'tokens':>6} {'logits GiB':>10} {'plain GiB':>10} {'chunked GiB':>11} {'peak x':>7} "
        f"{'plain s':>8} {'chunked s':>9} {'time x':>7}"
    )
    for r in rows:
        plain = f"{r['plain_peak_gib']:.2f}" + ("" if r["plain_measured"] else "*") if "plain_peak_gib" in r else "-"
        print(
            f"{r['vocab']:>7} {r['tokens']:>6} {r['logits_fp32_gib']:>10.2f} {plain:>10} "
            f"{r['chunked_peak_gib']:>11.2f} "
            f"{r.get('peak_ratio', float('nan')):>7.1f} {r.get('plain_step_s', float('nan')):>8.2f} "
            f"{r['chunked_step_s']:>9.2f} {r.get('time_ratio', float('nan')):>7.2f}"
        )
    print("* plain arm does not fit this machine: extrapolated from its measured GiB per token at the smaller sizes")
    print("goal: peak x >= 4 at 16384 tokens; time x <= 1.10 (chunked / plain step time)")
    if args.json:
        print(json.dumps({"rows": rows, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
