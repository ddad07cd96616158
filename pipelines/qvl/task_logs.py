"""Where each kfp.local task's output goes, whichever runner starts it: `logs/<task>[-N].log` in the run directory
(and the console with `--verbose`), its start and end told to the progress view."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import IO

from pipelines.qvl.progress_view import ProgressView, stage_of


def task_name(command: list[str]) -> str:
    """The component function a kfp.local task runs (`--function_to_execute sft_op`), else the program."""
    if "--function_to_execute" in command:
        return command[command.index("--function_to_execute") + 1]
    return Path(command[0]).name if command else "task"


class TaskLogs:
    def __init__(self, logs_dir: Path, view: ProgressView | None, echo: IO[str] | None) -> None:
        self.logs_dir, self.view, self.echo = logs_dir, view, echo
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def started(self, command: list[str]) -> tuple[str, Path]:
        """(task name, its log file: a task run again, by a retry, gets `-2`, `-3`, ...)."""
        task = task_name(command)
        with self._lock:
            self._seen[task] += 1
            n = self._seen[task]
        log = self.logs_dir / (f"{task}.log" if n == 1 else f"{task}-{n}.log")
        if self.view is not None:
            self.view.task_started(task, log)
        return task, log

    def write(self, sink: IO[str], task: str, text: str) -> None:
        sink.write(text)
        sink.flush()
        if self.echo is not None:
            self.echo.write(f"[{stage_of(task)}] {text}")

    def finished(self, task: str, returncode: int, log: Path) -> None:
        if self.view is not None:
            self.view.task_finished(task, returncode, log)
