"""How a stage runs inside a KFP task (or from the CLI): validate, track, run, record the result.

`run_stage` is the one call a component body makes. It re-validates the config (KFP hands dicts back with
floats for ints), opens the stage's nested MLflow run, calls the stage function and records a result file
(launch/result.py). Inputs that are committed directories are verified against their `_COMMITTED.json`
first; the output directory gets its own marker last, on success only. With a launch plan (launch/plan.py)
the stage runs on several processes instead.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components._shared.launch.plan import LaunchPlan, check_config, plan_from_env
from components._shared.launch.result import RESULT_FILE, _record, flatten_metrics
from components._shared.launch.torchrun import run_local_torchrun
from components._shared.platform import bad_records, disk_space, launcher_env, locks, progress, storage
from components._shared.platform.credential_shapes import shown
from components._shared.platform.presets import validate
from components._shared.platform.shards import tar_shards
from components._shared.platform.user_errors import USER_ERRORS


def execute(
    stage: str,
    cfg,
    run: Callable[..., dict[str, Any]],
    *,
    inputs: dict[str, Any],
    output_dir: str | Path,
    experiment: str,
    artifacts: dict[str, str] | None = None,
    record_as: str | None = None,
) -> dict[str, Any]:
    """Run `run(cfg, **inputs, output_dir=..., tracker=...)` inside the stage's tracker and record the result.

    `record_as` names the entry in the run summary and the MLflow stage run; None records and tracks nothing
    (one shard of a fan-out: its merge task reports for it). The output directory is locked for the run
    (platform/locks.py): a second run into it fails at once, naming this one.
    """
    launcher_env.check()  # RANK / WORLD_SIZE read as numbers below and in the stage: named here when they are not
    show_stage_logs()
    if os.environ.get("RANK", "0").strip() not in ("", "0"):
        # torchrun: every rank trains; only rank 0 writes the record and the commit marker (and logs).
        record_as = None
    verify_inputs(inputs)
    output_dir = Path(output_dir)
    with locks.scope(), progress.stage_scope(record_as or stage):
        # first: a second run into this output fails here, before any work, and writes nothing into it
        locks.hold(output_dir, purpose=f"{stage} output")
        return _execute_held(stage, cfg, run, inputs, output_dir, experiment, artifacts, record_as)


class _StageLogFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        kind = "note" if record.levelno < logging.WARNING else record.levelname.lower()
        return f"{kind}: {record.getMessage()}"


def show_stage_logs() -> None:
    """The project's log lines on stderr, notes (INFO) included: `note: ...` / `warning: ...` (once a process).
    Without it Python shows warnings only, and a stage's notes (how often it repeats its data, which attention
    kernel it runs) would go nowhere."""
    project = logging.getLogger("components")
    if not any(isinstance(h.formatter, _StageLogFormat) for h in project.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_StageLogFormat())
        project.addHandler(handler)
        project.setLevel(logging.INFO)


RECORDED_ERROR = 20_000  # characters: a record's value in an error must not make a 30 MB result file


def _execute_held(stage, cfg, run, inputs, output_dir: Path, experiment, artifacts, record_as) -> dict[str, Any]:
    from contextlib import nullcontext

    from components._shared.platform.mlflow_runs import stage_tracker
    from components._shared.platform.tracking import NullTracker

    output_dir.mkdir(parents=True, exist_ok=True)  # (rank 0's lock made it; other ranks may get here first)
    artifacts = {"output": str(output_dir), **(artifacts or {})}
    started = time.time()
    params = cfg.model_dump(mode="json")
    ignored = [f"{stage}.{note}" for note in cfg.ignored_settings()]  # said at the start, kept with the result
    for note in ignored:
        print(f"warning: setting without effect: {note}", file=sys.stderr, flush=True)
    other_rank = os.environ.get("RANK", "0").strip() not in ("", "0")  # logs nothing; its node's system metrics
    try:
        tracking = (
            stage_tracker(record_as or stage, experiment=experiment, params=params)
            if record_as or other_rank
            else nullcontext(NullTracker())
        )
        with tracking as tracker, bad_records.policy(getattr(cfg, "on_bad_record", "fail")) as ledger:
            metrics = run(cfg, **inputs, output_dir=output_dir, tracker=tracker)
            metrics = {**metrics, **ledger.metrics()}  # records skipped under on_bad_record: skip, per reason
            tracker.log_metrics(flatten_metrics(metrics))
            if ignored:
                tracker.set_tags({"qvl.ignored_settings": "; ".join(ignored)[:4900]})
            if (output_dir / "report.md").is_file():  # the page the KFP UI shows, in the stage's MLflow run too
                tracker.log_artifact(output_dir / "report.md")
    except BaseException as err:
        full = disk_space.explain(err, output_dir, stage) if isinstance(err, Exception) else None
        if record_as:
            failure = {
                "status": "failed",
                "error": shown(f"{type(err).__name__}: {err if full is None else full}", RECORDED_ERROR),
                # a bad setting, record or path (user_errors.USER_ERRORS): the run's console shows the message alone
                "user_error": isinstance(full or err, USER_ERRORS),
                "traceback": shown(traceback.format_exc(limit=8), RECORDED_ERROR),
                "metrics": {},
                "artifacts": artifacts,
                "seconds": round(time.time() - started, 3),
            }
            try:
                _record(record_as, failure, output_dir)
            except OSError as unwritten:  # a full disk: the stage's own error is the one to show
                print(f"warning: the failure record was not written: {unwritten}", file=sys.stderr, flush=True)
        if full is not None:
            raise full from err
        raise
    if record_as:
        _record(
            record_as,
            {
                "status": "succeeded",
                "metrics": metrics,
                "artifacts": artifacts,
                "seconds": round(time.time() - started, 3),
                **({"ignored_settings": ignored} if ignored else {}),
            },
            output_dir,
        )
    if os.environ.get("RANK", "0").strip() in ("", "0"):
        storage.commit_dir(output_dir)  # last: readers treat a directory without the marker as unfinished
    return metrics


STAGE_OUTPUT_INPUTS = ("clean_data", "features", "shard_dirs")  # inputs that only a stage makes


def verify_inputs(inputs: dict[str, Any]) -> int:
    """Verify every local directory input (or list of them) that is, or lies inside, a committed stage output
    against its marker (a model at OUT/model is checked against OUT's); a stage's output without its marker, and
    an input only a stage makes that is missing or uncommitted, are refused. Returns the outputs verified."""
    verified = 0
    for name, value in inputs.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(item, (str, Path)) or not str(item) or storage.is_s3(item):
                continue
            path = Path(item).resolve()  # a link to OUT/model is checked against OUT's marker
            flag = f"--{name.replace('_', '-')}"
            if name in STAGE_OUTPUT_INPUTS and not path.is_dir():
                raise ValueError(
                    f"{flag} {item}: {'no such directory' if not path.exists() else 'not a directory'}; give the "
                    f"output directory of the stage that makes {name} (qvl run --local keeps it under pipeline_root/)."
                )
            if not path.is_dir():
                continue
            committed = next((p for p in (path, *path.parents) if (p / storage.COMMIT_MARKER).is_file()), None)
            if committed is not None:
                storage.verify_dir(committed, under=path.relative_to(committed).as_posix())
                verified += 1
            elif _verify_linked_files(path):  # a folder of links into an output (Hugging Face's cache layout)
                verified += 1
            elif any((p / RESULT_FILE).is_file() for p in (path, *path.parents)) or name in STAGE_OUTPUT_INPUTS:
                shards = tar_shards(path)
                if shards and name == "clean_data":  # the lake itself, given where its cleaned output belongs
                    raise ValueError(
                        f"{flag} {item} holds {shards[:3]}, a raw lake's shards, not clean_data's output: run "
                        "clean_data on it first (qvl stage clean_data --lake-uri ...) and give its output directory."
                    )
                raise ValueError(
                    f"{flag} {item} is, or lies in, a stage's output without its commit marker "
                    f"({storage.COMMIT_MARKER}): the stage did not finish, or the directory was copied in part. Re-run "
                    "the stage that produced it."
                )
    return verified


def _verify_linked_files(folder: Path) -> bool:
    """Verify the committed outputs that the links directly in `folder` lead into (each target's folder against
    its marker): per-file links into OUT/model would otherwise read its files unchecked. True when any was."""
    checked: set[tuple[Path, str]] = set()
    for entry in folder.iterdir():
        if not entry.is_symlink() or not entry.is_file():
            continue
        target = entry.resolve()
        committed = next((p for p in target.parents if (p / storage.COMMIT_MARKER).is_file()), None)
        if committed is not None:
            checked.add((committed, target.parent.relative_to(committed).as_posix()))
    for committed, under in sorted(checked):
        storage.verify_dir(committed, under=under)
    return bool(checked)


def run_stage(
    stage: str,
    config: dict[str, Any],
    *,
    experiment: str,
    inputs: dict[str, Any],
    output_dir: str,
    function: str = "run",
    artifacts: dict[str, str] | None = None,
    record_as: str | None = None,
) -> dict[str, Any]:
    """Validate `config` for `stage` and run `components.<stage>.stage.<function>` (the component body's one call);
    a step (components/stages.py STEPS, e.g. sft_data) validates its stage's section and runs its own module.

    With a launch plan in QVL_LAUNCH_PLAN (a cluster profile asking for several GPUs or nodes) the stage runs
    on several processes instead (launch/plan.py) and this returns the metrics they recorded.
    """
    from components.stages import STEPS, load_config_class, load_stage

    section = STEPS[stage][0] if stage in STEPS else stage  # a step reads its stage's section
    cfg = validate(load_config_class(section), section, config)
    plan = plan_from_env() if function == "run" and section == stage else None
    if plan is not None:  # several processes (torchrun here) or nodes (a TrainJob): they run and record the stage
        return run_launched(
            plan, cfg.model_dump(mode="json"), inputs=inputs, output_dir=output_dir, experiment=experiment
        )
    fn = getattr(load_stage(stage), function)
    return execute(
        section,
        cfg,
        fn,
        inputs=inputs,
        output_dir=output_dir,
        experiment=experiment,
        artifacts=artifacts,
        record_as=record_as,
    )


def run_launched(
    plan: LaunchPlan, config: dict[str, Any], *, inputs: dict[str, Any], output_dir: str, experiment: str
) -> dict[str, Any]:
    """Run the stage as the plan says; returns its metrics. The stage's MLflow run is resolved here, once, and handed
    to every process ($MLFLOW_RUN_ID): rank 0 logs into it, each node its system metrics; this launcher ends it."""
    from components._shared.platform.mlflow_runs import GIVEN_RUN_ENV, launched_stage_run

    check_config(plan.stage, config)
    with launched_stage_run(plan.stage, experiment=experiment, params=config) as run_id:
        env = {GIVEN_RUN_ENV: run_id} if run_id else {}
        if plan.nodes > 1:
            from components._shared.launch.trainjob import run_trainjob

            return run_trainjob(plan, config, inputs=inputs, output_dir=output_dir, experiment=experiment, env=env)
        return run_local_torchrun(plan, config, inputs=inputs, output_dir=output_dir, experiment=experiment, env=env)
