"""The CPU instruction-set pins behind "the demo's numbers on any machine of a vendor" (platform/cpu_numerics.py):
with them, a host whose MKL runs AVX2 only computes the same weights, bit for bit, as an AVX-512 host; on AMD, MKL
ignores its pin; the rules for when they apply."""

import subprocess
import sys
from pathlib import Path

import pytest

from components._shared.platform.cpu_numerics import MODE_ENV, PINS, cpu_vendor, host_has_avx2, pinned_environment

JOB = Path(__file__).resolve().parents[1] / "jobs" / "cpu_numerics_job.py"


def _weights_digest(**env: str) -> str:
    import os

    clean = {k: v for k, v in os.environ.items() if k not in PINS and k != "MKL_ENABLE_INSTRUCTIONS"}
    proc = subprocess.run(
        [sys.executable, str(JOB)], env={**clean, **env}, capture_output=True, text=True, timeout=300, check=True
    )
    return proc.stdout.strip()


@pytest.mark.skipif(not host_has_avx2(), reason="the pins need an x86-64 host with AVX2 (every CI machine here has it)")
def test_pinned_a_host_whose_mkl_has_only_avx2_trains_the_same_bytes():
    pinned = _weights_digest(**PINS)
    assert _weights_digest(**PINS, MKL_ENABLE_INSTRUCTIONS="AVX2") == pinned  # MKL as on an AVX2-only machine
    assert _weights_digest(**PINS) == pinned  # and run to run
    cpuinfo = Path("/proc/cpuinfo").read_text()
    if "avx512f" in cpuinfo:  # an AVX-512 host: the pins are what make that true
        assert _weights_digest() != pinned
    if "avx512f" in cpuinfo and cpu_vendor(cpuinfo) == "GenuineIntel":
        assert _weights_digest(MKL_ENABLE_INSTRUCTIONS="AVX2") != _weights_digest(), "MKL alone moves the bytes"
    if cpu_vendor(cpuinfo) == "AuthenticAMD":  # MKL ignores its AVX2 pin off Intel: why the demo publishes per vendor
        without_mkl_pin = {k: v for k, v in PINS.items() if k != "MKL_CBWR"}
        assert _weights_digest(**without_mkl_pin) == pinned


def test_the_pins_apply_unless_set_already_or_turned_off():
    assert pinned_environment({}, avx2=True) == PINS
    assert pinned_environment({"MKL_CBWR": "COMPATIBLE"}, avx2=True) == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }  # the user's own setting wins
    assert pinned_environment({MODE_ENV: "native"}, avx2=True) == {}
    assert pinned_environment({}, avx2=False) == {}  # ARM, or an x86 without AVX2: nothing to pin to
    with pytest.raises(ValueError, match="QVL_CPU_NUMERICS='fast'"):
        pinned_environment({MODE_ENV: "fast"}, avx2=True)


def test_avx2_is_read_from_the_cpu_flags(monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert host_has_avx2("processor: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n")
    assert not host_has_avx2("processor: 0\nflags\t\t: fpu sse2 avx\n")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert not host_has_avx2("flags: avx2 fma")
