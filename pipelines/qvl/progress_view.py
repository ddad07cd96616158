"""The console view of `qvl run --local`: the DAG's stages in order, each with status, time, progress and result.

The runner (pipelines/qvl/local_run.py) tells the view when a task starts and ends; a poller reads the stages'
progress files (components/_shared/platform/progress.py) and their result records. On a terminal the view is
one table redrawn in place (rich's Live); elsewhere (CI, a pipe) it prints one line per event: a stage started,
passed a quarter of a phase, finished with its headline metric, or failed with the last lines of its log.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from components._shared.platform.progress import read_all
from pipelines.qvl.runs import labelled_headline

TAIL_LINES = 15
# kfp task function -> the stage row it belongs to (clean_data fans out into shards, then merges)
TASK_STAGE = {"list_shards_op": "clean_data", "clean_shard_op": "clean_data", "merge_shards_op": "clean_data"}
FINAL_TASK = {"clean_data": "merge_shards_op"}


def stage_of(task: str) -> str:
    """The stage row of a kfp task function name (`sft_op` -> `sft`)."""
    return TASK_STAGE.get(task, task.removesuffix("_op"))


@dataclass
class Row:
    stage: str
    status: str = "waiting"  # waiting, running, succeeded, cached, failed
    started: float | None = None
    ended: float | None = None
    logs: list[Path] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    headline: str = ""
    milestones: dict[str, int] = field(default_factory=dict)  # phase -> quarters already printed

    def elapsed(self, now: float) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or now) - self.started


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def bar(done: int, total: int | None, width: int = 20) -> str:
    if not total:
        return ""
    filled = round(width * min(done, total) / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def describe(progress: dict[str, Any] | None) -> str:
    """`train 40/200 steps loss 1.234` from a stage's latest progress record."""
    if not progress:
        return ""
    total = progress.get("total")
    text = f"{progress['phase']} {progress['done']}" + (f"/{total}" if total else "") + f" {progress['unit']}"
    loss = progress.get("loss")
    if isinstance(loss, float) and loss == loss:
        text += f" loss {loss:.3f}"
    return text


def merged_progress(records: list[dict[str, Any]], stage: str) -> dict[str, Any] | None:
    """One progress record for `stage`: its newest phase, done and totals summed over its processes (shards)."""
    own = [r for r in records if r.get("stage") == stage]
    if not own:
        return None
    newest = max(own, key=lambda r: r.get("time", 0))
    same = [r for r in own if r["phase"] == newest["phase"]]
    totals = [r.get("total") for r in same]
    return {
        **newest,
        "done": sum(int(r["done"]) for r in same),
        "total": sum(int(t) for t in totals if t) if all(totals) else None,
    }


class ProgressView:
    """Stage rows fed by task events and polled progress; `live` redraws a table, otherwise one line per event."""

    def __init__(
        self,
        stages: list[str],
        *,
        stream: IO[str],
        live: bool,
        progress_dir: Path,
        results_dir: Path,
    ):
        self.rows = {stage: Row(stage) for stage in stages}
        self.stream, self.is_live = stream, live
        self.progress_dir, self.results_dir = progress_dir, results_dir
        self.started = time.time()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._live: Any = None  # rich's Live while the view is open on a terminal
        self._poller: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> ProgressView:
        if self.is_live:
            from rich.console import Console
            from rich.live import Live

            live = Live(  # sys.stdout stays where the runner sent it (logs/kfp.log), not above the table
                self._table(),
                console=Console(file=self.stream),
                refresh_per_second=4,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            live.__enter__()
            self._live = live
        self._poller = threading.Thread(target=self._poll_forever, name="progress-view", daemon=True)
        self._poller.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        self.poll()
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)
            self._live = None

    def _poll_forever(self) -> None:
        while not self._stop.wait(0.5 if self.is_live else 2.0):
            self.poll()

    # -- events ------------------------------------------------------------------------------------------
    def task_started(self, task: str, log: Path) -> None:
        with self.lock:
            row = self._row(task)
            if row is None:
                return
            row.logs.append(log)
            if row.status == "waiting":
                row.status, row.started = "running", time.time()
                self._event(row, f"started  (log: {log})")

    def task_finished(self, task: str, returncode: int, log: Path) -> None:
        with self.lock:
            row = self._row(task)
            if row is None:
                return
            if returncode != 0:
                row.status, row.ended = "failed", time.time()
                self._event(row, f"FAILED after {clock(row.elapsed(row.ended))} (exit {returncode})")
                error = self._user_error(row.stage)
                if error:  # a bad setting, record or path: its message is the whole story, the traceback is in the log
                    self.print(f"        error: {error}\n        full log: {log}")
                    return
                if self.is_live:
                    self.print(f"{row.stage} failed (exit {returncode}); the last lines of its log:")
                self._print_tail(log)
            elif FINAL_TASK.get(row.stage, f"{row.stage}_op") == task:
                row.ended = time.time()
                self._finish(row, "succeeded")

    def stage_cached(self, stage: str, metrics: dict[str, Any]) -> None:
        with self.lock:
            row = self.rows.get(stage)
            if row is not None and row.status in ("waiting", "running"):  # clean_data lists its shards uncached
                row.ended = time.time()
                row.started = row.started or row.ended
                self._finish(row, "cached", metrics)

    def poll(self) -> None:
        """Read the progress files; print quarter milestones (line mode) or redraw (live)."""
        records = read_all(self.progress_dir) if self.progress_dir.is_dir() else []
        with self.lock:
            for row in self.rows.values():
                if row.status != "running":
                    continue
                row.progress = merged_progress(records, row.stage)
                if not self.is_live and row.progress and row.progress.get("total"):
                    self._milestone(row, row.progress)
            if self._live is not None:
                self._live.update(self._table())

    # -- output ------------------------------------------------------------------------------------------
    def _row(self, task: str) -> Row | None:
        return self.rows.get(stage_of(task))

    def _finish(self, row: Row, status: str, metrics: dict[str, Any] | None = None) -> None:
        row.status = status
        result_file = self.results_dir / f"{row.stage}.json"
        ignored: list[str] = []
        if metrics is None and result_file.is_file():
            try:
                result = json.loads(result_file.read_text())
                metrics, ignored = result.get("metrics", {}), result.get("ignored_settings", [])
            except ValueError:
                metrics = None
        row.headline = labelled_headline(row.stage, metrics)
        self._event(
            row, f"{status} in {clock(row.elapsed(time.time()))}" + (f"  {row.headline}" if row.headline else "")
        )
        for note in ignored:  # settings the run was given that had no effect (StageConfig.ignored_settings)
            self.print(f"        note: {note}")

    def _milestone(self, row: Row, progress: dict[str, Any]) -> None:
        quarter = min(3, 4 * int(progress["done"]) // int(progress["total"]))
        if quarter > row.milestones.get(progress["phase"], 0):
            row.milestones[progress["phase"]] = quarter
            self._event(row, f"{bar(progress['done'], progress['total'], 12)} {describe(progress)}")

    def _event(self, row: Row, text: str) -> None:
        """One line per event when not live (the live table shows the same)."""
        if not self.is_live:
            self.print(f"{clock(time.time() - self.started):>6}  {row.stage:18s} {text}")

    def _user_error(self, stage: str) -> str:
        """The recorded message of a stage that failed on a user error (runner.py's failure record), else ''."""
        try:
            result = json.loads((self.results_dir / f"{stage}.json").read_text())
        except (OSError, ValueError):
            return ""
        if result.get("status") != "failed" or not result.get("user_error"):
            return ""
        return str(result.get("error", "")).partition(": ")[2] or str(result.get("error", ""))

    def _print_tail(self, log: Path) -> None:
        try:
            lines = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        except OSError:
            lines = []
        self.print("\n".join([f"        | {line}" for line in lines] + [f"        full log: {log}"]))

    def print(self, text: str) -> None:
        """A line outside the rows (the run's end, where its files are)."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def _table(self):
        from rich.table import Table
        from rich.text import Text

        now = time.time()
        table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
        for column in ("stage", "status", "time", "progress", "result"):
            table.add_column(column)
        style = {"running": "cyan", "succeeded": "green", "cached": "green", "failed": "bold red"}
        for row in self.rows.values():
            progress = row.progress if row.status == "running" else None
            shown = f"{bar(progress['done'], progress.get('total'))} {describe(progress)}" if progress else ""
            table.add_row(  # Text, not markup: a bar's brackets are not style tags
                Text(row.stage),
                Text(row.status, style=style.get(row.status, "dim")),
                Text(clock(row.elapsed(now)) if row.started else ""),
                Text(shown),
                Text(row.headline),
            )
        return table
