"""The same numbers from a CPU run on any machine with the same CPU vendor: pin the instruction sets the CPU math
libraries pick.

PyTorch's CPU kernels (ATen), MKL's GEMM and oneDNN's convolutions each choose their code path from the host CPU:
AVX-512 on one machine, AVX2 on another, with different blocking and summation order, so a 1,700-step run lands
on different weights (the demo's SFT accuracy moved 0.02 between two cloud machines of the same size). Pinned to
AVX2, which every x86-64 server of the last decade has, each library runs the same code on every Intel CPU: ATen
through `ATEN_CPU_CAPABILITY`, MKL through its Conditional Numerical Reproducibility mode (`MKL_CBWR`), oneDNN
through `ONEDNN_MAX_CPU_ISA`. MKL honours `MKL_CBWR=AVX2` on Intel CPUs only; on AMD it takes its automatic branch
(measured: the same weights with the pin as without), so AMD hosts agree with each other, not with Intel, and the
demo publishes numbers per vendor (pipelines/qvl/published.py). Measured on a 60-step SFT (`docs/benchmarks.md`): each
library alone changes the weights' bytes, the three pins make an AVX-512 host and the same host with MKL restricted
to AVX2 agree bit for bit, at ~5% of the step time. `qvl run --local` sets them for its tasks; a value the user
already set wins, and QVL_CPU_NUMERICS=native turns the pins off (fastest kernels, numbers that depend on the
machine).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path

PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
MODE_ENV = "QVL_CPU_NUMERICS"  # "pinned" (default) or "native"


def host_has_avx2(cpuinfo: str | None = None) -> bool:
    """x86-64 with AVX2 and FMA (what the pinned paths execute); False elsewhere (ARM, or no /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _field(_cpuinfo() if cpuinfo is None else cpuinfo, "flags").split()
    return "avx2" in flags and "fma" in flags


def pinned_environment(environ: Mapping[str, str] | None = None, *, avx2: bool | None = None) -> dict[str, str]:
    """The variables to add to a task's environment: the pins the environment does not set already; none when
    $QVL_CPU_NUMERICS is "native" or the host cannot run AVX2 (the libraries' own choice is all there is)."""
    environ = os.environ if environ is None else environ
    mode = environ.get(MODE_ENV, "pinned").strip().lower() or "pinned"
    if mode not in ("pinned", "native"):
        raise ValueError(f"${MODE_ENV}={environ[MODE_ENV]!r}: use 'pinned' (the default) or 'native'.")
    if mode == "native" or not (host_has_avx2() if avx2 is None else avx2):
        return {}
    return {name: value for name, value in PINS.items() if name not in environ}


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The CPU's vendor id as Linux reports it (GenuineIntel, AuthenticAMD; "unknown" elsewhere): pinned runs agree
    bit for bit within a vendor, not across vendors (MKL's pin holds on Intel only)."""
    return _field(_cpuinfo() if cpuinfo is None else cpuinfo, "vendor_id") or "unknown"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(cpuinfo: str, name: str) -> str:
    """The first processor's value of `name` in /proc/cpuinfo text ("" when absent)."""
    for line in cpuinfo.splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1].strip()
    return ""
