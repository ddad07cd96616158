"""What the GPU machine runs, before any timed arm: versions, the device, and the paths the stages would take.

    python bench/gpu/probe.py [--json-out PATH]

Prints one JSON line: torch / CUDA / transformers versions, the device and its memory, the parameters of torch's
`varlen_attn` as this torch defines them (the call `attention.varlen_attention` makes differs by release), the
attention path a packed row takes with bf16 weights and with fp32 weights under bf16 autocast
(`attention.attention_path`, what each stage says at its start), and whether torch's fused AdamW takes a parameter
on this device. On a machine without CUDA it reports what it can (`cuda: false`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `components` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def probe() -> dict:
    import transformers

    from components._shared.model import attention

    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    kernel = attention._torch_varlen()
    report: dict = {
        "torch": torch.__version__,
        "cuda": cuda,
        "cuda_version": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "varlen_attn_parameters": list(inspect.signature(kernel).parameters) if kernel is not None else None,
        "attention_bf16": attention.attention_path(device, torch.bfloat16, None),
        "attention_fp32_autocast": attention.attention_path(device, torch.float32, torch.bfloat16),
    }
    try:
        parameter = torch.nn.Parameter(torch.zeros(4, device=device))
        parameter.grad = torch.ones(4, device=device)
        torch.optim.AdamW([parameter], lr=0.1, fused=True).step()
        report["fused_adamw"] = True
    except (RuntimeError, ValueError) as error:
        report["fused_adamw"] = f"no: {error}"
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    report = probe()
    print(json.dumps(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
