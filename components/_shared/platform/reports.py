"""Figures for the stage reports: training and eval curves as PNGs, embedded in report.md and logged to MLflow.

    lines += figure("loss", "training loss", history_series(result.history, ["loss"]), output_dir=out, tracker=t)

The PNG is embedded as a data URI: the KFP UI shows the Markdown artifact on its own (a relative image link
would not travel with it); the same file goes to the stage's MLflow run under figures/.
"""

from __future__ import annotations

import base64
import math
from pathlib import Path

from components._shared.platform.tracking import Tracker

Series = dict[str, list[tuple[float, float]]]


def history_series(rows: list[dict], keys: list[str], *, step: str = "step") -> Series:
    """label -> [(step, value)] for each key present in the rows (non-finite values dropped)."""
    out: Series = {}
    for key in keys:
        points = [
            (float(r[step]), float(r[key]))
            for r in rows
            if key in r and isinstance(r[key], (int, float)) and math.isfinite(float(r[key]))
        ]
        if points:
            out[key] = points
    return out


def figure(
    name: str, title: str, series: Series, *, output_dir: Path, tracker: Tracker, log_y: bool = False
) -> list[str]:
    """Plot `series` to output_dir/figures/NAME.png, log it to MLflow and return the Markdown lines embedding it;
    no lines (and no file) when there is nothing to plot."""
    if not series:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for label, points in series.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o" if len(points) <= 12 else None, markersize=3, label=label)
    if log_y and all(y > 0 for points in series.values() for _, y in points):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("step")
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(output_dir) / "figures" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    tracker.log_artifact(path, "figures")
    encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return ["", f"![{title}](data:image/png;base64,{encoded})"]
