"""Report figures: curves become PNG files, embedded in the Markdown as data URIs and logged to the run."""

import base64
import math

from components._shared.platform.reports import figure, history_series
from components._shared.platform.tracking import NullTracker


class Recording(NullTracker):
    def __init__(self):
        super().__init__()
        self.artifacts = []

    def log_artifact(self, local_path, artifact_path=None):
        self.artifacts.append((str(local_path), artifact_path))


def test_history_series_keeps_finite_values_of_present_keys():
    rows = [{"step": 1, "loss": 2.0, "kl": 0.1}, {"step": 2, "loss": math.nan}, {"step": 3, "loss": 1.0}]
    assert history_series(rows, ["loss", "kl", "absent"]) == {"loss": [(1.0, 2.0), (3.0, 1.0)], "kl": [(1.0, 0.1)]}


def test_figure_writes_a_png_embeds_it_and_logs_it(tmp_path):
    tracker = Recording()
    lines = figure(
        "loss", "training loss", {"loss": [(1, 2.0), (2, 1.0)]}, output_dir=tmp_path, tracker=tracker, log_y=True
    )
    png = (tmp_path / "figures/loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert lines[-1] == f"![training loss](data:image/png;base64,{base64.b64encode(png).decode()})"
    assert tracker.artifacts == [(str(tmp_path / "figures/loss.png"), "figures")]
    assert figure("empty", "nothing", {}, output_dir=tmp_path, tracker=tracker) == []
    assert not (tmp_path / "figures/empty.png").exists()
