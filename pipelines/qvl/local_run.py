"""Run the DAG on this machine with kfp.local and write run_summary.json.

Every task runs as a subprocess of this Python (no containers); the stages record their results through
`components._shared.launch.result` into a per-run directory named by QVL_RUN_SUMMARY_DIR, their progress into
QVL_PROGRESS_DIR, and the MLflow parent run id travels in QVL_MLFLOW_PARENT_RUN_ID (environment only, never a
cached task input). Each task's output (its executor input, library warnings, the stage's own lines) goes to
`logs/<task>.log` in the run directory and kfp.local's own lines to `logs/kfp.log`; the console gets the
progress view (pipelines/qvl/progress_view.py), or everything as well with `verbose`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from components._shared.launch.result import RESULT_FILE, SUMMARY_DIR_ENV, SUMMARY_FILE
from components._shared.platform.cpu_numerics import PINS, cpu_vendor, pinned_environment
from components._shared.platform.progress import PROGRESS_DIR_ENV
from components._shared.platform.storage import COMMIT_MARKER
from components.stages import dag_stages
from pipelines.presets import Preset, as_preset
from pipelines.qvl.progress_view import ProgressView
from pipelines.qvl.run_report import write_run_report
from pipelines.qvl.task_logs import TaskLogs


@contextmanager
def _recording_cache_hits(view: ProgressView | None = None) -> Iterator[list[dict[str, Any]]]:
    """Yield a list that collects the outputs of every kfp.local cache hit during the block (and tell `view`).

    kfp.local logs its hits at INFO on a logger it leaves at WARNING, so the lookup itself is wrapped.
    """
    from kfp.local import cache as kfp_cache

    hits: list[dict[str, Any]] = []
    original = kfp_cache.LocalCache.get

    def get(self, key):
        outputs = original(self, key)
        if outputs is not None:
            hits.append(outputs)
            if view is not None:
                for stage, result in _cached_results([outputs]).items():
                    view.stage_cached(stage, result.get("metrics") or {})
        return outputs

    kfp_cache.LocalCache.get = get
    try:
        yield hits
    finally:
        kfp_cache.LocalCache.get = original


def _cached_results(hits: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Stage results of cached tasks: the `_stage_result.json` inside the artifacts they reused."""
    results: dict[str, dict[str, Any]] = {}
    for outputs in hits:
        for value in outputs.values():
            uri = getattr(value, "uri", None)
            result_file = Path(uri or "") / RESULT_FILE
            if uri and result_file.is_file():
                result = json.loads(result_file.read_text())
                if result.get("stage"):
                    results[result["stage"]] = {**result, "status": "cached"}
    return results


@contextmanager
def _task_logs(
    logs_dir: Path, view: ProgressView | None, echo: IO[str] | None, peaks: dict[str, float] | None = None
) -> Iterator[None]:
    """Each kfp.local task's output into logs_dir/<task>[-N].log (and `echo`), its start and end told to `view`;
    into `peaks`, the peak resident memory (GB) of the task's largest process (itself or any it waited for: torchrun's
    ranks), from the kernel's rusage.

    kfp.local streams every task's output to the console through `run_local_subprocess`; this replaces it
    for the block (the same Popen, its lines going to the task's file instead).
    """
    from kfp.local import subprocess_task_handler

    original = subprocess_task_handler.run_local_subprocess
    logs = TaskLogs(logs_dir, view, echo)

    def run_local_subprocess(full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
        task, log = logs.started(full_command)
        env = {**os.environ, **(env_vars or {})}
        with (
            log.open("w") as sink,
            subprocess.Popen(
                full_command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
            ) as process,
        ):
            assert process.stdout is not None
            for line in process.stdout:
                logs.write(sink, task, line)
            _, status, usage = os.wait4(process.pid, 0)
            returncode = process.returncode = os.waitstatus_to_exitcode(status)
        if peaks is not None:
            peaks[log.stem] = round(usage.ru_maxrss / 2**20, 3)  # KiB on Linux
        logs.finished(task, returncode, log)
        return returncode

    subprocess_task_handler.run_local_subprocess = run_local_subprocess
    try:
        yield
    finally:
        subprocess_task_handler.run_local_subprocess = original


def _collect(results_dir: Path, expected: list[str], cached: dict[str, dict[str, Any]]) -> dict[str, Any]:
    stages: dict[str, Any] = {}
    for stage in expected:
        path = results_dir / f"{stage}.json"
        if path.exists():
            result = json.loads(path.read_text())
        elif stage in cached:
            result = cached[stage]
        else:
            continue
        stages[stage] = {key: result.get(key) for key in ("status", "metrics", "artifacts", "seconds", "error")}
        if not stages[stage]["error"]:
            stages[stage].pop("error")
    return stages


@contextmanager
def _environment_restored(*names: str) -> Iterator[None]:
    """The run sets these for its tasks (kfp.local hands them the process environment); put back as they were after
    it, so a caller that runs several DAGs in one process (the tests) never leaks one run's parent into the next."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


RUN_FILES = {
    "logs",
    "stage_results",
    "progress",
    "pipeline_root",
    "mlflow.db",
    "mlartifacts",
    "report.html",
    SUMMARY_FILE,
}  # what a run writes into its directory (with its lock files)


def check_run_dir(out_dir: Path, ours: frozenset[str] = frozenset()) -> None:
    """The run directory is new, empty, or a run's own: a run clears its logs/, stage_results/ and progress/ and
    overwrites report.html, so a directory of other files (a project folder given as --out) is refused, naming
    them, before anything in it is touched. `ours`: names the caller writes there itself (qvl rehearse --preset)."""
    from components._shared.platform.placement import check_outside_inputs

    check_outside_inputs(out_dir, "--out")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory; give a new or empty directory.")
    if (out_dir / COMMIT_MARKER).exists():
        raise ValueError(
            f"--out {out_dir} is a stage's committed output (it holds {COMMIT_MARKER}); a run would write its logs, "
            "MLflow store and pipeline_root into it. Give a new or empty directory (e.g. runs/NAME)."
        )
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries or (out_dir / SUMMARY_FILE).exists() or any(n.startswith(".qvl-lock") for n in entries):
        return  # new, or an earlier run's (finished, or stopped before its summary: its lock file stays)
    if ours and all(n in RUN_FILES or n in ours for n in entries):
        return  # the caller's own earlier files (a rehearsal stopped before its run started)
    foreign = [n for n in entries if n not in RUN_FILES and n not in ours]
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise ValueError(
        f"--out {out_dir} holds files no qvl run wrote ({shown or ', '.join(entries[:5])}); a run clears its logs/ "
        "and overwrites report.html there. Give a new or empty directory (e.g. runs/NAME)."
    )


def check_run_args(out_dir: Path, lake_uri: str, data_uri: str, runner: str, *, prepared_dir: bool = False) -> None:
    """What `qvl run --local` checks before anything is written or said: the runner, the run directory outside the
    lake and the data, and new, empty or a run's own (unless `prepared_dir`: qvl rehearse --preset made it); then
    the local lake and data exist."""
    if runner not in ("subprocess", "docker"):
        raise ValueError(f"--runner {runner!r}: choose subprocess or docker.")
    from components._shared.platform.storage import check_location

    for option, location in (("--out", str(out_dir)), ("--lake", lake_uri), ("--data", data_uri)):
        if location:
            check_location(location, option)  # before anything resolves them (a symlink loop, hidden characters)
    out_dir = Path(out_dir).resolve()
    for option, uri in (("--lake", lake_uri), ("--data", data_uri)):
        if uri and "://" not in uri and out_dir.is_relative_to(Path(uri).resolve()):
            raise ValueError(
                f"--out {out_dir} is inside {option} {uri}: the run's own files (clean_data's Parquet parts, "
                f"checkpoints) would become part of the {option[2:]} the next run reads; put the run directory "
                "elsewhere (e.g. runs/NAME)."
            )
    if not prepared_dir:  # a caller that made out_dir and put the run's inputs there itself (qvl rehearse --preset)
        check_run_dir(out_dir)
    for option, uri in (("--lake", lake_uri), ("--data", data_uri)):
        if uri and "://" not in uri and not Path(uri).exists():
            raise ValueError(f"{option} {uri} does not exist; give the directory `qvl lake synth` wrote (or yours).")


def run_local(
    *,
    lake_uri: str,
    out_dir: Path,
    data_uri: str = "",
    preset: Preset | str = "tiny",
    until: str | None = None,
    enable_caching: bool = False,
    console: IO[str] | None = None,
    live: bool | None = None,
    verbose: bool = False,
    processes: dict[str, int] | None = None,
    runner: str = "subprocess",
    prepared_dir: bool = False,
) -> dict[str, Any]:
    """Run the DAG (up to `until`) on `lake_uri` with held-out / SFT data at `data_uri`; returns the run summary,
    also written to out_dir/run_summary.json. `processes`: stages run under torchrun with that many processes.

    With `console`, the progress view goes there (redrawn in place when `live`, by default when it is a terminal;
    otherwise one line per event); `verbose` streams every task's output to stdout as well as to its log file.
    `runner`: "subprocess" (every task a process of this Python) or "docker" (every task in its component's image,
    pipelines/qvl/docker_tasks.py). A run directory holding files no run wrote is refused (a run clears its logs/)
    unless `prepared_dir`: the caller made it and wrote the run's inputs there.
    """
    from pipelines.vlm_training import build_pipeline

    out_dir = Path(out_dir).resolve()
    check_run_args(out_dir, lake_uri, data_uri, runner, prepared_dir=prepared_dir)
    p = as_preset(preset)  # read once: the caller's loaded preset, or its name read here
    # built first: it validates `until` before anything starts
    pipeline = build_pipeline(p, until, for_cluster=False, local_processes=processes)
    out_dir.mkdir(parents=True, exist_ok=True)  # after the checks: a refused run leaves no empty run directory
    if runner == "docker":
        from components._shared.platform.container_images import image_for
        from pipelines.qvl.docker_tasks import check_images

        check_images(image_for(kind) for kind in ("data", "train"))
        remote = [u for u in (lake_uri, data_uri, os.environ.get("MLFLOW_TRACKING_URI", "")) if "://" in u]
        if [u for u in remote if not u.startswith("sqlite:///")]:
            raise ValueError(
                f"--runner docker runs each task without network: {remote} cannot be reached from it; give local "
                "directories and leave MLFLOW_TRACKING_URI unset (the run's own sqlite store)."
            )
    if lake_uri and "://" not in lake_uri:
        lake_uri = str(Path(lake_uri).resolve())
    if data_uri and "://" not in data_uri:
        data_uri = str(Path(data_uri).resolve())
    from components._shared.platform import locks

    with locks.scope():  # one run per run directory: a second would clear this one's logs and stage results
        locks.hold(out_dir, purpose="qvl run --local")
        dirs = {name: out_dir / name for name in ("stage_results", "progress", "logs")}
        for directory in dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
        expected = ["preflight", *dag_stages(p.stages, until)]
        view = None
        if console is not None:
            is_live = console.isatty() if live is None else live
            view = ProgressView(
                expected, stream=console, live=is_live, progress_dir=dirs["progress"], results_dir=dirs["stage_results"]
            )
        from components._shared.platform.mlflow_runs import PARENT_RUN_ENV

        names = ("MLFLOW_TRACKING_URI", PARENT_RUN_ENV, SUMMARY_DIR_ENV, PROGRESS_DIR_ENV, *PINS)
        with _environment_restored(*names):
            os.environ.update(pinned_environment())  # the same numbers on any host of a CPU vendor (cpu_numerics.py)
            launch = _task_logs if runner == "subprocess" else _containers(out_dir, lake_uri, data_uri, names)
            return _run(pipeline, p, out_dir, dirs, expected, view, verbose, lake_uri, data_uri, enable_caching, launch)


def _containers(out_dir: Path, lake_uri: str, data_uri: str, env: tuple[str, ...]):
    """The `_task_logs` of the docker runner: the run directory writable, the lake and data read-only, the run's
    variables and a model cache in the run directory (the images' own cache is not shared between tasks)."""
    from pipelines.qvl.docker_tasks import in_containers, open_to_containers

    mounts = {str(out_dir): "rw", **{uri: "ro" for uri in (lake_uri, data_uri) if uri and "://" not in uri}}
    cache = out_dir / "qvl-cache"

    def launch(logs_dir: Path, view, echo, peaks) -> contextlib.AbstractContextManager:
        cache.mkdir(exist_ok=True)
        open_to_containers(cache)
        return in_containers(TaskLogs(logs_dir, view, echo), mounts, env, {"QVL_CACHE_DIR": str(cache)})

    return launch


def _run(
    pipeline, p, out_dir, dirs, expected, view, verbose, lake_uri, data_uri, enable_caching, launch=None
) -> dict[str, Any]:
    started = time.time()
    with (dirs["logs"] / "kfp.log").open("w") as kfp_log, contextlib.ExitStack() as stack:  # the log closes last
        if not verbose:  # kfp.local's lines, library warnings and MLflow's notices: into logs/kfp.log
            stack.enter_context(contextlib.redirect_stdout(kfp_log))
            stack.enter_context(contextlib.redirect_stderr(kfp_log))
        if view is not None:
            stack.enter_context(view)
        peaks: dict[str, float] = {}
        stack.enter_context((launch or _task_logs)(dirs["logs"], view, sys.stdout if verbose else None, peaks))
        hits = stack.enter_context(_recording_cache_hits(view))
        docker = launch is not None and launch is not _task_logs
        parent_run_id = _run_pipeline(pipeline, p, out_dir, dirs, lake_uri, data_uri, enable_caching, docker)
    stages = _collect(dirs["stage_results"], expected, _cached_results(hits))
    ok = all(stages.get(s, {}).get("status") in ("succeeded", "cached") for s in expected)

    from components._shared.platform.mlflow_runs import finish_pipeline_run, log_pipeline_artifact

    finish_pipeline_run(parent_run_id, "FINISHED" if ok else "FAILED")
    summary = {
        "mlflow_run_id": parent_run_id,
        "mlflow_tracking_uri": os.environ["MLFLOW_TRACKING_URI"],
        "preset": p.name,
        "lake_uri": lake_uri,
        "data_uri": data_uri,
        "status": "succeeded" if ok else "failed",
        "seconds": round(time.time() - started, 1),
        "logs": str(dirs["logs"]),
        "cpu_numerics": {name: os.environ.get(name, "") for name in PINS},  # what the tasks' math libraries ran
        "cpu_vendor": cpu_vendor(),  # pinned runs agree within a vendor (docs/operations.md)
        "stages": stages,
        "task_peak_rss_gb": peaks,  # per task log name: its largest process's peak resident memory
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    try:  # the page reads the summary just written; a failure to draw it never hides the run's own result
        report = write_run_report(out_dir)
        summary["report"] = str(report)
        log_pipeline_artifact(parent_run_id, report)
    except Exception as error:  # noqa: BLE001 - recorded in the summary and shown by the CLI
        summary["report_error"] = f"{type(error).__name__}: {error}"
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return summary


def _run_pipeline(
    pipeline, p, out_dir: Path, dirs: dict[str, Path], lake_uri, data_uri, enable_caching, docker: bool = False
) -> str:
    """Open the MLflow parent run and run the pipeline under kfp.local (each task in its image with `docker`);
    returns the parent run id."""
    from kfp import local

    from components._shared.platform.mlflow_runs import PARENT_RUN_ENV, start_pipeline_run
    from components._shared.platform.mlflow_tracking import default_tracking_uri

    os.environ["MLFLOW_TRACKING_URI"] = default_tracking_uri(out_dir)  # the run's own store unless one is set
    parent_run_id = start_pipeline_run(p.experiment, run_name=f"local-{p.name}", tags={"preset": p.name})
    os.environ[PARENT_RUN_ENV] = parent_run_id
    os.environ[SUMMARY_DIR_ENV] = str(dirs["stage_results"])
    os.environ[PROGRESS_DIR_ENV] = str(dirs["progress"])
    cache_root = out_dir / "kfp_cache"
    if docker:  # what the host made before the containers' user writes to it
        from pipelines.qvl.docker_tasks import open_to_containers

        uri = os.environ["MLFLOW_TRACKING_URI"]
        database = [Path(uri[len("sqlite:///") :])] if uri.startswith("sqlite:///") else []
        made = [out_dir / "pipeline_root", out_dir / "mlartifacts"]  # else docker makes a missing mount root's
        for directory in made:
            directory.mkdir(exist_ok=True)
        open_to_containers(out_dir, *dirs.values(), *made, *database)
    local.init(
        runner=local.DockerRunner() if docker else local.SubprocessRunner(use_venv=False),
        pipeline_root=str(out_dir / "pipeline_root"),
        raise_on_error=False,
        enable_caching=enable_caching,
        cache_root=str(cache_root) if enable_caching else None,
    )
    pipeline(
        lake_uri=lake_uri,
        eval_data_uri=data_uri,
        sft_data_uri=data_uri,
        preference_data_uri=data_uri,
        rl_data_uri=data_uri,
        **p.pipeline_args(),
    )
    return parent_run_id
