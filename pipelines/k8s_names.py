"""What Kubernetes and KFP accept in a cluster profile's values, checked when the preset is read: resource
quantities (and limits not below requests), retry durations, label and annotation keys, label values and object
names. Each check returns the value or raises a ValueError that says what is wrong and what the rule is, so a
profile that would compile and then be refused by the API server (or by kfp with a message naming no setting) fails
at `qvl compile` / `qvl submit`, naming the setting (pydantic adds its path)."""

from __future__ import annotations

import re

# kfp's own rules (kfp.dsl.pipeline_task): a CPU is a number or millicores, a memory an integer with a unit.
CPU = re.compile(r"([0-9]*[.])?[0-9]+m?")
MEMORY = re.compile(r"[0-9]+(E|Ei|P|Pi|T|Ti|G|Gi|M|Mi|K|Ki)?")
MEMORY_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
MEMORY_UNITS |= {f"{unit}i": 1024 ** (i + 1) for i, unit in enumerate("KMGTPE")}
DURATION = re.compile(r"[0-9]+ *(s|m|h|d|w)")  # kfp's convert_duration_to_seconds: seconds to weeks
# Kubernetes' validation (apimachinery): a DNS-1123 subdomain (object names), a label name and value, a key prefix.
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def cpu(value: str) -> str:
    if not CPU.fullmatch(value) or cpu_cores(value) <= 0:
        raise ValueError(f"{value!r} is not a CPU quantity: write cores ('4', '0.5') or millicores ('500m'), above 0")
    return value


def cpu_cores(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def memory(value: str) -> str:
    if not MEMORY.fullmatch(value) or memory_bytes(value) <= 0:
        raise ValueError(
            f"{value!r} is not a memory quantity: write a whole number with an optional unit, e.g. '64Gi', "
            "'16G', '512Mi' (units E, P, T, G, M, K and Ei ... Ki)"
        )
    return value


def memory_bytes(value: str) -> int:
    digits = re.match(r"[0-9]+", value)
    assert digits is not None  # checked by memory()
    return int(digits.group()) * MEMORY_UNITS[value[digits.end() :]]


def duration(value: str) -> str:
    if not DURATION.fullmatch(value.strip()):
        raise ValueError(f"{value!r} is not a duration: write a whole number and a unit s, m, h, d or w ('60s', '1h')")
    return value


def object_name(value: str) -> str:
    """A Secret, PVC or TrainingRuntime name: a DNS-1123 subdomain."""
    if len(value) > 253 or not DNS_SUBDOMAIN.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a Kubernetes object name: lowercase letters, digits, '-' and '.', starting and ending "
            "with a letter or digit, at most 253 characters (e.g. qvl-s3-credentials)"
        )
    return value


def label_key(value: str) -> str:
    """A label or annotation key: [prefix/]name, the prefix a DNS subdomain, the name 1-63 characters."""
    prefix, slash, name = value.rpartition("/")
    if (slash and (len(prefix) > 253 or not DNS_SUBDOMAIN.fullmatch(prefix))) or not _label_name(name):
        raise ValueError(
            f"{value!r} is not a label or annotation key: [prefix/]name, the name 1-63 letters, digits, '-', '_' "
            "or '.' starting and ending with a letter or digit, the prefix a lowercase DNS name (e.g. "
            "team.example.com/owner)"
        )
    return value


def label_value(value: str) -> str:
    if value and not _label_name(value):
        raise ValueError(
            f"{value!r} is not a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit (or empty)"
        )
    return value


def _label_name(text: str) -> bool:
    return 0 < len(text) <= 63 and bool(LABEL_NAME.fullmatch(text))
