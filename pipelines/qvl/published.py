"""The demo's published numbers: README's results table is generated from a run, and a fresh run is checked
against it.

    python -m pipelines.qvl.published runs/demo "machine"  # this vendor's docs/demo_published*.json + README's table

One file per CPU vendor, because the same pinned run gives other bits on Intel and AMD: MKL honours
`MKL_CBWR=AVX2` on Intel CPUs only and falls back to its automatic branch elsewhere (Intel's documentation; on an
AMD EPYC `MKL_CBWR=AVX2` leaves the weights' digest exactly as unset), so 1,700 SFT steps land elsewhere.
`docs/demo_published.json` (Intel) and `docs/demo_published.amd.json` (AMD) keep a run's key metrics
(`run_report.key_metric_rows`: each stage's headline against its baseline, with its notes), where and when it was
measured; README.md's text between the markers below is generated from them (tests/unit/test_published.py fails
when they differ), and the demo test compares a fresh run of README command 1 with its own vendor's file
(`compare`), each metric within its tolerance.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from components._shared.platform.cpu_numerics import PINS, cpu_vendor

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED_BY_VENDOR = {
    "GenuineIntel": ROOT / "docs" / "demo_published.json",  # README's table
    "AuthenticAMD": ROOT / "docs" / "demo_published.amd.json",
}
PUBLISHED = PUBLISHED_BY_VENDOR["GenuineIntel"]
README = ROOT / "README.md"
BEGIN, END = (
    "<!-- demo-results:begin (generated: python -m pipelines.qvl.published RUN) -->",
    "<!-- demo-results:end -->",
)
# How far a fresh run may land from its vendor's published value: pinned runs of one vendor agree bit for bit on the
# machines tried; the tolerances leave room for a CPU generation not tried, far less than a broken stage moves.
# Labels (the champion's stage) are published but not compared: two candidates 0.001 apart may swap places.
TOLERANCE = {"default": 0.03, "records_kept": 10, "images": 10, "records_in": 0, "heldout_caption_loss_final": 0.1}


def published_for(vendor: str) -> Path:
    """The published file a run on this vendor's CPU is compared with."""
    if vendor not in PUBLISHED_BY_VENDOR:
        known = ", ".join(PUBLISHED_BY_VENDOR)
        raise ValueError(
            f"no demo numbers are published for CPU vendor {vendor!r} (only {known}): a run here cannot be checked "
            "bit for bit; publish one with `python -m pipelines.qvl.published RUN_DIR` after adding the vendor to "
            "PUBLISHED_BY_VENDOR in pipelines/qvl/published.py"
        )
    return PUBLISHED_BY_VENDOR[vendor]


def published_from(summary: dict[str, Any], *, machine: str) -> dict[str, Any]:
    """What gets published of a run: its key metric rows (values rounded as printed), seconds per stage."""
    from pipelines.qvl.run_report import key_metric_rows

    rows = []
    for row in key_metric_rows(summary):
        rows.append(
            {
                "stage": row["stage"],
                "metric": row["metric"],
                "value": _round(row["value"]),
                "baseline_name": row["baseline_name"],
                "baseline_label": row["baseline_label"],
                "baseline": _round(row["baseline"]),
                "interval": [_round(v) for v in row["interval"]] if row["interval"] else None,
                "notes": {k: _round(v) for k, v in row["notes"].items()},
            }
        )
    seconds = {s: round(float(e.get("seconds") or 0), 1) for s, e in (summary.get("stages") or {}).items()}
    return {
        "preset": summary.get("preset"),
        "measured": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine,
        "cpu_vendor": summary.get("cpu_vendor") or cpu_vendor(),  # the run's host (older summaries: this host)
        "dag_seconds": round(float(summary.get("seconds") or 0), 1),
        "cpu_numerics": summary.get("cpu_numerics") or {},
        "stage_seconds": seconds,
        "rows": rows,
    }


def check_covers(current: dict[str, Any], summary: dict[str, Any], run: str) -> None:
    """Refuse a run that would publish less than the published file holds: another preset, or stages missing or
    not succeeded (a run stopped with --until, a summary written by hand)."""
    if summary.get("preset") != current.get("preset"):
        raise SystemExit(
            f"{run}: a run of preset {summary.get('preset')!r}; the published numbers are preset "
            f"{current.get('preset')!r}'s: publish a run of README command 1."
        )
    given = summary.get("stages")
    stages: dict[str, Any] = given if isinstance(given, dict) else {}
    wanted = set(current.get("stage_seconds") or {}) | {row.get("stage") for row in current.get("rows") or []}
    missing = sorted(s for s in wanted if not isinstance(stages.get(s), dict) or stages[s].get("status") != "succeeded")
    if missing:
        raise SystemExit(
            f"{run}: the run has no succeeded {', '.join(missing)} (the published numbers do): publish a run of the "
            "whole DAG (README command 1), not one stopped with --until."
        )


def _round(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, int) or float(value).is_integer():
        return int(value)
    return float(f"{value:.4g}")


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.5f}" if 0 < abs(value) < 1e-3 else f"{value:.4g}"  # -0.00006, not -6.419e-05
    return str(value)


def markdown_table(published: dict[str, Any]) -> str:
    """README's results table: one row per key metric, its baseline and the difference, the notes beside."""
    lines = [
        "| stage | metric | value | baseline | difference | notes |",
        "|---|---|---|---|---|---|",
    ]
    for row in published["rows"]:
        value = _value(row)
        base = f"{_fmt(row['baseline'])} ({row['baseline_label']})" if row["baseline_label"] else ""
        numbers = isinstance(row["value"], (int, float)) and isinstance(row["baseline"], (int, float))
        delta = f"{row['value'] - row['baseline']:+.4g}" if numbers and row["baseline_label"] else ""
        notes = ", ".join(f"{k} {_fmt(v)}" for k, v in row["notes"].items())
        lines.append(f"| {row['stage']} | `{row['metric']}` | {value} | {base} | {delta} | {notes} |")
    return "\n".join(lines)


def readme_block(published: dict[str, Any], others: Sequence[dict[str, Any]] = ()) -> str:
    """The README text between the markers: the table, where it was measured, and each other vendor's values (its
    stale stages left out and said)."""
    lines = [BEGIN, markdown_table(published), "", f"{_where(published)} has every stage's seconds)."]
    for other in others:
        stale = set(stale_stages(other))
        values = "; ".join(
            f"{row['stage']} `{row['metric']}` {_value(row)}" for row in other["rows"] if row["stage"] not in stale
        )
        note = ""
        if stale:
            since = other["stale"]
            note = (
                f" Not remeasured there since {since['since']} ({since['because']}): "
                + ", ".join(s for s in DAG_STAGES if s in stale)
                + "."
            )
        lines += ["", f"{_where(other)}): {values}.{note}"]
    return "\n".join([*lines, END])


DAG_STAGES = ("clean_data", "extract_features", "pretrain", "sft", "reward_model", "rl", "distill", "select_checkpoint")


def stale_stages(published: dict[str, Any]) -> list[str]:
    """The stages whose published values no longer hold for this vendor (the code changed since and no machine of
    the vendor has rerun it): left out of README and of `compare`, until a run of that vendor is published."""
    return list((published.get("stale") or {}).get("stages", []))


def mark_stale(published: dict[str, Any], stages: Sequence[str], because: str) -> dict[str, Any]:
    unknown = sorted(set(stages) - set(DAG_STAGES))
    if unknown or not because.strip():
        raise ValueError(f"--stale-others needs DAG stages (got unknown {unknown}) and a reason (--because).")
    merged = sorted({*stale_stages(published), *stages}, key=DAG_STAGES.index)
    return {
        **published,
        "stale": {"stages": merged, "since": time.strftime("%Y-%m-%d", time.gmtime()), "because": because},
    }


def _where(published: dict[str, Any]) -> str:
    minutes, seconds = divmod(int(published["dag_seconds"]), 60)
    path = PUBLISHED_BY_VENDOR.get(published.get("cpu_vendor", "unknown"), PUBLISHED)
    return (
        f"Measured {published['measured']} on {published['machine']}: the DAG in {minutes}:{seconds:02d} "
        f"(`{path.relative_to(ROOT)}`"
    )


def _value(row: dict[str, Any]) -> str:
    value = _fmt(row["value"])
    if row["interval"]:
        value += f" (95% CI {_fmt(row['interval'][0])} to {_fmt(row['interval'][1])})"
    return value


def replace_block(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no results markers ({BEGIN} ... {END}); add them where the table goes.")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def compare(summary: dict[str, Any], published: dict[str, Any]) -> list[str]:
    """Each published key metric (and the baseline beside it: records in, the majority answer's accuracy) against a
    fresh run's: the ones outside their tolerance, described."""
    from pipelines.qvl.run_report import key_metric_rows

    fresh = {(r["stage"], r["metric"]): r for r in key_metric_rows(summary)}
    problems = []
    stale = set(stale_stages(published))
    for row in published["rows"]:
        if row["stage"] in stale:
            continue
        got_row = fresh.get((row["stage"], row["metric"])) or {}
        checks = [(row["metric"], row["value"], got_row.get("value"))]
        if row.get("baseline_name") and row["baseline_name"] != row["baseline_label"]:  # a metric, not a constant
            checks.append((row["baseline_name"], row["baseline"], got_row.get("baseline")))
        for name, want, got in checks:
            if isinstance(want, (int, float)) and not isinstance(want, bool):
                tolerance = TOLERANCE.get(name, TOLERANCE["default"])
                if not isinstance(got, (int, float)) or not math.isfinite(got) or abs(got - want) > tolerance:
                    problems.append(f"{row['stage']} {name}: published {want}, this run {got} (tolerance {tolerance})")
            elif got is None:
                problems.append(f"{row['stage']} {name}: published {want!r}, missing from this run")
    return problems


def readme_text(text: str) -> str:
    """README.md with its block regenerated from the published files: the table from the first vendor whose numbers
    are all current (Intel's when they are), then the others' values."""
    data = {v: json.loads(p.read_text()) for v, p in PUBLISHED_BY_VENDOR.items() if p.is_file()}
    if not data:
        raise FileNotFoundError(f"{PUBLISHED} is missing: README's table is generated from it")
    table = next((v for v, d in data.items() if not stale_stages(d)), next(iter(data)))
    return replace_block(text, readme_block(data.pop(table), list(data.values())))


USAGE = (
    'usage: python -m pipelines.qvl.published RUN_DIR ["machine description"] '
    '[--stale-others STAGE,STAGE --because "what changed"]'
)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    stale, because = _option(args, "--stale-others"), _option(args, "--because")
    if len(args) not in (1, 2) or bool(stale) != bool(because) or args[0].startswith("-") or not args[0].strip():
        raise SystemExit(USAGE)
    summary_file = Path(args[0]) / "run_summary.json"
    if not summary_file.is_file():
        what = "is not a regular file (a pipe or a device?)" if summary_file.exists() else "no such file"
        raise SystemExit(f"{summary_file}: {what}; RUN_DIR is a finished run's --out directory.\n{USAGE}")
    try:
        summary = json.loads(summary_file.read_text())
    except (ValueError, RecursionError) as error:
        raise SystemExit(f"{summary_file}: not a run summary (not JSON: {str(error)[:200]}).") from None
    if not isinstance(summary, dict):
        raise SystemExit(f"{summary_file}: not a run summary (a JSON {type(summary).__name__}, not an object).")
    if summary.get("status") != "succeeded":
        raise SystemExit(f"{args[0]}: the run did not succeed ({summary.get('status')}); nothing to publish.")
    if summary.get("cpu_numerics") != PINS:
        raise SystemExit(
            f"{args[0]}: the run's CPU kernels were not pinned (cpu_numerics {summary.get('cpu_numerics')}, want "
            f"{PINS}): no other machine repeats it; rerun without QVL_CPU_NUMERICS=native and publish that run."
        )
    machine = args[1] if len(args) == 2 else "a 2-core machine with nothing else running"
    published = published_from(summary, machine=machine)
    target = published_for(published["cpu_vendor"])
    if target.is_file():
        check_covers(json.loads(target.read_text()), summary, args[0])
    target.write_text(json.dumps(published, indent=2) + "\n")
    for other in PUBLISHED_BY_VENDOR.values():  # the other vendors' numbers of the stages that changed since
        if stale and other != target and other.is_file():
            marked = mark_stale(json.loads(other.read_text()), stale.split(","), because or "")
            other.write_text(json.dumps(marked, indent=2) + "\n")
    README.write_text(readme_text(README.read_text()))
    print(f"wrote {target.relative_to(ROOT)} and the results in README.md from {args[0]}")


def _option(args: list[str], name: str) -> str | None:
    """Remove `name VALUE` from args and return VALUE (None when absent)."""
    if name not in args:
        return None
    i = args.index(name)
    if i + 1 >= len(args):
        raise SystemExit(USAGE)
    value = args[i + 1]
    del args[i : i + 2]
    return value


if __name__ == "__main__":
    main()
