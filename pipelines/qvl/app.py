"""`qvl`: the pipeline's command line (synthesise a lake, run the DAG locally, run one stage, compile).

qvl lake synth --out runs/world --records 2000
qvl run --local --preset demo --lake runs/world/lake --out runs/demo
qvl stage clean_data --config pipelines/presets/tiny.yaml --lake-uri runs/world/lake --output-dir runs/clean
qvl rehearse --config qwen3.5-0.8b
qvl plan --preset prod-7b
qvl compile
KFP_TOKEN=... qvl submit --host https://kfp.example.com/pipeline --experiment vlm-prod lake_uri=s3://lake/x --wait
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import typer

from pipelines.api_errors import api_errors, describe_api_error
from pipelines.qvl.arguments import RedactingGroup, refuse_repeated_options
from pipelines.qvl.rehearse import RUN_NAMES

REHEARSAL_RUNS = ", ".join(RUN_NAMES)
app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, cls=RedactingGroup)
lake_app = typer.Typer(help="Data lakes: the synthetic shapes world.", no_args_is_help=True)
models_app = typer.Typer(help="Builtin helper models of the presets (tokenizer, tiny Qwen-VL, tiny CLIP).")
app.add_typer(lake_app, name="lake")
app.add_typer(models_app, name="models")


@lake_app.command("synth")
def lake_synth(
    ctx: typer.Context,
    out: str = typer.Option(..., help="Output directory: DIR/lake, DIR/heldout, DIR/ground_truth.jsonl."),
    records: int = typer.Option(2000, min=1, max=1_000_000, help="Lake records (defects included)."),
    seed: int = typer.Option(0, min=0, max=2**32 - 1, help="Seed: the same seed writes the same bytes."),
    sft_records: int = typer.Option(
        8000,
        min=1,
        max=1_000_000,
        help="Instruction conversations in DIR/heldout/sft.jsonl (the demo SFT trains ~8 epochs on them).",
    ),
    real: bool = typer.Option(
        False,
        "--real",
        help="Instead: the real-format set of photographs (DIR/lake as img2dataset tars, DIR/data in the layouts "
        "users download); what `qvl rehearse --preset` runs on.",
    ),
):
    """Write the synthetic shapes world: a lake with labelled defects plus held-out splits (or, with --real, the
    real-format set of photographs)."""
    from rich.console import Console

    from components.synth_world.lake import write_world
    from pipelines.qvl.out_targets import check_world_dir

    directory = _local_dir(out, "--out")
    check_world_dir(directory)
    if real:
        from components.synth_world.real_set import write_real_set

        given = [
            f"--{n.replace('_', '-')}"
            for n in ("records", "sft_records", "seed")
            if getattr(ctx.get_parameter_source(n), "name", "") == "COMMANDLINE"  # typer bundles its own click
        ]
        if given:
            typer.echo(
                f"error: {', '.join(given)} shape the synthetic world; --real writes the fixed real-format set, which "
                "they do not change. Drop them, or drop --real.",
                err=True,
            )
            raise typer.Exit(2)

        typer.echo(json.dumps(write_real_set(directory), indent=2))
        return

    with Console(stderr=True).status(f"Writing {records} records to {directory} ..."):
        counts = write_world(directory, records=records, seed=seed, sft_records=sft_records)
    typer.echo(json.dumps(counts, indent=2, default=str))


@models_app.command("build")
def models_build(
    names: list[str] = typer.Argument(
        None, help="Builtin names (default: every builtin of the tiny and demo presets)."
    ),
):
    """Build builtin models into the cache now (otherwise they are built on first use)."""
    from components._shared.model.sources import resolve_model
    from components.synth_world.builtin_models import BUILTIN_NAMES

    wanted = [name.removeprefix("builtin:") for name in names or ["tiny-qwen2_5-vl", "demo-qwen2_5-vl", "tiny-clip"]]
    unknown = [name for name in wanted if name not in BUILTIN_NAMES]
    if unknown:
        raise ValueError(f"unknown builtin model(s) {unknown}; this command builds: {', '.join(BUILTIN_NAMES)}.")
    for name in wanted:
        uri = f"builtin:{name}"
        typer.echo(f"{uri} -> {resolve_model(uri)}")


@models_app.command("ship")
def models_ship(name: str = typer.Argument("tiny-clip", help="A builtin that ships with the package.")):
    """Rebuild a shipped builtin by its recipe (tiny-clip: ~20 min on 2 cores) and commit-ready copy it into
    components/synth_world/shipped_models/NAME (after a change of its recipe or of the world's code)."""
    import tempfile

    from components.synth_world import builtin_models, shipped

    if name not in shipped.SHIPPED_NAMES:
        typer.echo(f"{name} is not shipped; shipped builtins: {', '.join(shipped.SHIPPED_NAMES)}.", err=True)
        raise typer.Exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        built = builtin_models.build(name, Path(tmp) / name)
        target = shipped.ship(name, built, builtin_models.recipe_version(name))
    typer.echo(f"{name} -> {target} (recipe key {builtin_models.recipe_version(name)}); commit it.")


def _local_dir(value: str, flag: str, kind: str = "dir") -> Path:
    """A local path option: not empty (an unset shell variable would mean the working directory), no unexpanded
    '~', no URI scheme (these commands write local files), a `kind` ("dir" or "file") that can be made and written
    there; a ValueError naming the flag otherwise."""
    from components._shared.platform.storage import check_location
    from pipelines.qvl.out_targets import check_writable

    check_location(value, flag)
    if "://" in value:
        raise ValueError(f"{flag}={value!r}: this command writes a local directory; give a local path.")
    check_writable(Path(value), flag, kind)
    return Path(value)


@app.command("run")
def run(
    local: bool = typer.Option(False, "--local", help="Run with kfp.local on this machine (the only mode here)."),
    preset: str = typer.Option("tiny", help="Preset name (pipelines/presets/NAME.yaml) or a YAML path."),
    lake: str | None = typer.Option(None, help="Lake dir or s3:// prefix (default: the preset's lake_uri)."),
    data: str | None = typer.Option(
        None,
        help="Training data dir or s3:// prefix (eval.jsonl, sft.jsonl, preferences.jsonl; default: LAKE/../heldout).",
    ),
    out: str = typer.Option("runs/local", help="Run directory (run_summary.json, mlflow.db, artifacts)."),
    until: str | None = typer.Option(None, help="Last stage to run (default: all)."),
    cache: bool = typer.Option(False, help="Reuse outputs of tasks whose inputs did not change (kfp.local cache)."),
    verbose: bool = typer.Option(False, "--verbose", help="Stream every task's output too (it is in OUT/logs/)."),
    runner: str = typer.Option(
        "subprocess",
        help="subprocess: every task a process of this Python; docker: every task in its component's image, as uid "
        "1000 without network (build the images first: make local-base images-cpu; docs/images.md).",
    ),
):
    """Run the DAG and write OUT/run_summary.json; the console shows each stage's progress and result."""
    if not local:
        typer.echo(
            "error: `qvl run` runs locally (--local); submit to a cluster with `qvl submit` or `kfp run create` "
            "(docs/submitting.md).",
            err=True,
        )
        raise typer.Exit(2)
    from pipelines.presets import load_preset
    from pipelines.qvl.local_run import SUMMARY_FILE, check_run_args, run_local

    run_dir = _local_dir(out, "--out")
    loaded = load_preset(preset)  # read and validated once; the runner and the DAG get this object
    lake_uri = lake or loaded.lake_uri
    if not lake_uri:
        typer.echo("No lake given: pass --lake DIR (e.g. the DIR/lake written by `qvl lake synth`).", err=True)
        raise typer.Exit(2)
    if data is None and "://" not in lake_uri:
        data = str(Path(lake_uri).resolve().parent / "heldout")  # where `qvl lake synth` puts it
        if not Path(data).is_dir():
            typer.echo(
                f"error: no --data given, and its default beside the lake ({data}, where `qvl lake synth` writes the "
                "held-out and SFT data) does not exist; pass --data DIR (eval.jsonl, sft.jsonl, preferences.jsonl or "
                "a dataset.yaml; docs/data.md).",
                err=True,
            )
            raise typer.Exit(2)
    from components.stages import dag_stages

    dag_stages(loaded.stages, until)  # a wrong --until refused before the line below, which says the run starts
    check_run_args(run_dir, lake_uri, data or "", runner)
    typer.echo(f"Running preset {preset} on {lake_uri} into {run_dir}/ (task logs: {run_dir}/logs/)")
    summary = run_local(
        lake_uri=lake_uri,
        data_uri=data or "",
        out_dir=run_dir,
        preset=loaded,
        until=until,
        enable_caching=cache,
        console=sys.stdout,
        verbose=verbose,
        runner=runner,
    )
    minutes, seconds = divmod(int(summary["seconds"]), 60)
    typer.echo(f"Run {summary['status']} in {minutes}:{seconds:02d}.")
    typer.echo(f"  report:  {summary.get('report') or 'not written: ' + summary.get('report_error', '?')}")
    typer.echo(f"  summary: {run_dir / SUMMARY_FILE}")
    typer.echo(f"  logs:    {run_dir}/logs/")
    typer.echo(f"  MLflow:  {summary['mlflow_tracking_uri']} (run {summary['mlflow_run_id']})")
    raise typer.Exit(0 if summary["status"] == "succeeded" else 1)


@app.command(
    "stage", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
)
def stage(ctx: typer.Context, name: str = typer.Argument(..., help="Stage package name, e.g. clean_data.")):
    """Run one stage on its own (no KFP): the remaining arguments go to `python -m components.NAME`."""
    from components.stages import STAGES, STEPS, load_stage

    if name not in STAGES and name not in STEPS:
        shown = "" if name in ("-h", "--help") else f"Unknown stage '{name}'. "
        typer.echo(
            f"{shown}Usage: qvl stage NAME [--config FILE] ... (qvl stage NAME --help lists a stage's "
            f"options). Stages: {', '.join(STAGES)}; steps: {', '.join(STEPS)}.",
            err=True,
        )
        raise typer.Exit(0 if not shown else 2)
    load_stage(name).main(list(ctx.args))


@app.command("rehearse")
def rehearse(
    config: str = typer.Option("", "--config", help="A real checkpoint: qvl rehearse --list shows them."),
    preset: str = typer.Option(
        "", "--preset", help="Instead: the whole DAG at this preset's settings, sizes and widths cut (prod-7b, ...)."
    ),
    stages: str | None = typer.Option(
        None, help="Comma-separated runs (default: all, and what they need): " + REHEARSAL_RUNS
    ),
    layers: int = typer.Option(2, min=1, help="LM layers kept (Qwen3.5 keeps its linear/full pattern)."),
    vision_depth: int = typer.Option(4, min=1, help="ViT blocks kept (full-attention / DeepStack indexes mapped)."),
    data: str | None = typer.Option(None, help="--preset: your data directory (default: `qvl lake synth --real`)."),
    lake: str | None = typer.Option(None, help="--preset: your lake (with --data)."),
    real_widths: bool = typer.Option(False, "--real-widths", help="--preset: keep the checkpoint's widths."),
    out: str = typer.Option("runs/rehearsal", help="Working directory (checkpoint, world, stage outputs)."),
):
    """Every model stage for a step or two on a real checkpoint's config (real widths, vocabulary, tokenizer,
    processor and template; depth cut; random init), or with --preset the whole DAG at a preset's settings:
    pass/fail, seconds and peak memory per stage."""
    if bool(config) == bool(preset):
        both = "--config and --preset exclude each other: " if config else ""
        typer.echo(
            f"error: {both}give --config CHECKPOINT (every model stage) or --preset PRESET (the whole DAG).", err=True
        )
        raise typer.Exit(2)
    root = _local_dir(out, "--out")
    if stages is not None and not [s for s in stages.split(",") if s.strip()]:
        raise ValueError(
            f"--stages={stages!r} names no run (an unset shell variable?); give some of {REHEARSAL_RUNS}, or leave "
            "--stages out for all of them."
        )
    given = [flag for flag, value in (("--data", data), ("--lake", lake), ("--real-widths", real_widths)) if value]
    ignored = given if config else (["--stages"] if stages is not None else [])
    if ignored:
        typer.echo(
            f"error: {', '.join(ignored)} belong to {'--preset' if config else '--config'}; "
            f"with {'--config' if config else '--preset'} they would be ignored.",
            err=True,
        )
        raise typer.Exit(2)
    if preset:
        import sys

        from pipelines.qvl import rehearse_dag

        where = rehearse_dag.rehearsal_dir(root, preset)  # checked before the real set is written there
        summary, rows, cuts = rehearse_dag.rehearse_preset(
            preset, where, data=data, lake=lake, real_widths=real_widths, console=sys.stderr
        )
        typer.echo(rehearse_dag.table(preset, rows, cuts))
        if summary["status"] != "succeeded":
            raise typer.Exit(1)
        return
    from pipelines.qvl.rehearse import rehearse as run_rehearsal
    from pipelines.qvl.rehearse import table

    chosen = [s.strip() for s in (stages or "").split(",") if s.strip()]
    results = run_rehearsal(config, root / config, runs=chosen or None, layers=layers, vision_depth=vision_depth)
    typer.echo(table(config, results))
    if any(r.status != "passed" for r in results):
        raise typer.Exit(1)


@app.command("plan")
def plan_(
    preset: str = typer.Option("prod-7b", help="Preset name or YAML path."),
    config: str = typer.Option("", "--config", help="The base model's checkpoint name (default: from the preset)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
):
    """Memory per GPU of every training stage of a preset on its cluster profile; exit 1 if a stage cannot fit."""
    from pipelines.qvl.memory_plan import plan, refusals, table, to_json

    name, plans = plan(preset, config or None)
    typer.echo(to_json(plans) if as_json else table(name, preset, plans))
    problems = refusals(plans)
    for line in problems:
        typer.echo(f"does not fit: {line}", err=True)
    if problems:
        raise typer.Exit(1)


@app.command("runs")
def runs(
    root: str = typer.Argument("runs", help="Directory holding run directories (searched recursively)."),
    compare: tuple[Path, Path] | None = typer.Option(
        None, "--compare", help="Two run directories: every stage's metrics side by side, with B - A."
    ),
):
    """The local runs under ROOT with status, time and each stage's headline metric; or two runs compared."""
    from pipelines.qvl.runs import compare as compare_runs
    from pipelines.qvl.runs import find_runs, read_run, runs_table

    if compare:
        typer.echo(compare_runs(read_run(compare[0]), read_run(compare[1])))
        return
    from components._shared.platform.storage import check_location

    check_location(root, "ROOT")  # an empty argument (an unset shell variable) would list the working directory
    found = find_runs(Path(root))
    if not found:
        raise ValueError(f"no run_summary.json under {root}; runs are written by `qvl run --local --out DIR`.")
    typer.echo(runs_table(found, Path(root)))


@app.command("compile")
def compile_(
    preset: str = typer.Option("prod-7b", help="Preset whose configs become the parameter defaults."),
    out: str | None = typer.Option(
        None,
        help="Output YAML (default pipelines/compiled/vlm_training.yaml for prod-7b, vlm_training-PRESET.yaml beside "
        "it for another preset).",
    ),
    force: bool = typer.Option(False, "--force", help="Compile a preset whose training stage does not fit its GPUs."),
):
    """Compile the pipeline YAML (the committed one is checked by a test); refuses a preset with a training stage
    that cannot fit its cluster profile (`qvl plan`) unless --force."""
    import re

    from pipelines.compile import COMPILED, compile_pipeline
    from pipelines.presets import load_preset, preset_path
    from pipelines.qvl.out_targets import check_compile_target

    target = None if out is None else _local_dir(out, "--out", "file")
    if target is not None and target.suffix not in (".yaml", ".yml"):
        typer.echo(
            f"error: --out {out}: a pipeline with Kubernetes settings compiles to YAML; end it in .yaml.", err=True
        )
        raise typer.Exit(2)
    if target is not None:
        check_compile_target(target, preset_path(preset))
    loaded = load_preset(preset)
    _refuse_unfit(loaded, force)
    if target is None:  # another preset never overwrites the committed prod-7b pipeline
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", loaded.name)
        target = COMPILED if loaded.name == "prod-7b" else COMPILED.with_name(f"vlm_training-{name}.yaml")
    typer.echo(compile_pipeline(loaded, target))


def _refuse_unfit(preset, force: bool) -> None:
    """Stop (exit 2) on the planner's refusals, or with --force say them and go on."""
    from pipelines.qvl.memory_plan import preset_refusals

    problems = preset_refusals(preset)
    for line in problems:
        typer.echo(f"{'warning' if force else 'error'}: does not fit: {line}", err=True)
    if problems and not force:
        typer.echo("the run would fail at that stage; change the setting named, or pass --force.", err=True)
        raise typer.Exit(2)


@app.command("submit")
def submit(
    host: str = typer.Option(
        ...,
        envvar="KFP_HOST",
        help="KFP API endpoint, e.g. https://kfp.example.com/pipeline "
        "(env KFP_HOST). The token is read from env KFP_TOKEN.",
    ),
    experiment: str = typer.Option(..., help="KFP experiment name (created when missing)."),
    preset: str = typer.Option("prod-7b", help="Preset name or YAML path whose configs become the defaults."),
    run_name: str | None = typer.Option(None, help="Run name (default: 'vlm-training PRESET UTC-TIME')."),
    namespace: str | None = typer.Option(None, help="Kubernetes namespace (multi-user KFP)."),
    wait: bool = typer.Option(False, "--wait/--no-wait", help="Wait for the run to end; exit 1 unless it SUCCEEDED."),
    timeout: float | None = typer.Option(None, min=0, help="With --wait: give up after this many seconds (exit 3)."),
    poll_interval: float = typer.Option(30.0, help="With --wait: seconds between status checks (at least 0.01)."),
    params_file: Path | None = typer.Option(
        None, help="JSON/YAML mapping of pipeline parameters (e.g. a data manifest with lake_uri); KEY=VALUE wins."
    ),
    force: bool = typer.Option(False, "--force", help="Submit a preset whose training stage does not fit its GPUs."),
    pairs: list[str] | None = typer.Argument(
        None,
        metavar="[KEY=VALUE]...",
        help="Pipeline parameters (lake_uri=s3://..., eval_data_uri=...) or dotted preset settings "
        "(sft.optim.lr=1e-5).",
    ),
):
    """Compile the preset (with the settings given) and start a run on a KFP cluster; prints the run URL.

    Exit codes: 0 submitted (or, with --wait, SUCCEEDED); 1 the run failed/was canceled, or the API refused;
    2 bad arguments (nothing was sent); 3 --timeout ran out (the run keeps going).
    """
    from pipelines import submit as sub

    def echo_err(line: str) -> None:
        typer.echo(line, err=True)

    for flag, seconds, least in (("--timeout", timeout, 0.0), ("--poll-interval", poll_interval, 0.01)):
        if seconds is not None and not (math.isfinite(seconds) and seconds >= least):
            typer.echo(f"Error: {flag} {seconds}: give a number of seconds (at least {least:g}).", err=True)
            raise typer.Exit(2)
    if timeout is not None and not wait:
        typer.echo("Error: --timeout applies only with --wait (it bounds the wait); add --wait or drop it.", err=True)
        raise typer.Exit(2)
    try:
        client, run_id = sub.compile_and_submit(
            host=host,
            experiment=experiment,
            preset=preset,
            pairs=pairs or [],
            run_name=run_name,
            namespace=namespace,
            echo=typer.echo,
            params_file=params_file,
            force=force,
        )
    except sub.SubmitError as err:  # it may quote a setting's key or value: credential shapes hidden
        typer.echo(f"Error: {sub.redact(str(err))}", err=True)
        raise typer.Exit(2) from None
    except api_errors() as err:  # API refusals, unreachable host: one line, not a traceback
        typer.echo(f"Error: submitting to {sub.shown(host, 200)} failed: {describe_api_error(err)}", err=True)
        raise typer.Exit(1) from None
    if not wait:
        return
    try:
        state = sub.wait(
            client,
            run_id,
            timeout=timeout,
            poll_interval=poll_interval,
            on_state=lambda s: echo_err(f"run {run_id}: {s}"),
        )
    except sub.RunFailed as err:
        typer.echo(f"Error: {err} See {sub.run_url(host, run_id)}", err=True)
        raise typer.Exit(1) from None
    except sub.RunTimeout as err:
        typer.echo(f"Error: {err}", err=True)
        raise typer.Exit(3) from None
    except api_errors() as err:
        typer.echo(f"Error: waiting for run {run_id} failed: {describe_api_error(err)}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"Run {run_id} {state}.")


@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of any error (also QVL_DEBUG=1)."),
) -> None:
    if debug:
        os.environ["QVL_DEBUG"] = "1"


def main() -> None:
    """The `qvl` console script: a user mistake prints one `error: ...` line and exits 2 (user_errors.py)."""
    from components._shared.platform.user_errors import reported

    with reported():
        refuse_repeated_options(sys.argv[1:])
        app(sys.argv[1:])


if __name__ == "__main__":
    main()
