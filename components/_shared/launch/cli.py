"""Command-line entry shared by every stage: `python -m components.<stage> --config FILE [key=value ...]`.

The config file is either a preset (one section per stage; the stage's section is used) or a bare stage
section (platform/presets.py reads both). `key=value` overrides use dotted paths (`optim.lr=2e-5`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components._shared.platform.presets import deep_merge, merged_map_notes, parse_overrides, read_section, validate
from components._shared.platform.strict_yaml import KeyGivenTwice, json_object


def stage_main(
    config_cls,
    run: Callable[..., dict[str, Any]],
    *,
    section: str,
    inputs: tuple[str, ...],
    optional_inputs: tuple[str, ...] = (),
    argv: list[str] | None = None,
    record_as: str | None = None,
) -> dict[str, Any]:
    """Parse the command line, validate the config, run the stage under a tracker, print its metrics as JSON.
    `record_as` names the MLflow run and summary entry when it is not the section (a step that reads a stage's
    settings)."""
    parser = argparse.ArgumentParser(prog=f"python -m components.{section}", description=run.__doc__)
    parser.add_argument("--config", action=_Once, help=f"Preset YAML (uses its '{section}' section) or a bare section.")
    parser.add_argument(
        "--config-json",
        action=_Once,
        help="The section as JSON (what launchers pass); --config and overrides apply underneath and on top.",
    )
    parser.add_argument(
        "--output-dir", action=_Once, required=True, help="Output directory or s3:// prefix (published atomically)."
    )
    parser.add_argument(
        "--experiment", action=_Once, default=None, help="MLflow experiment name (default: the preset's, else vlm)."
    )
    for name in inputs:
        optional = name in optional_inputs
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            action=_Once,
            dest=name,
            required=not optional,
            default="",
            help=f"Input '{name}'"
            + (" (leave it out, or give '', when the config does not use it)." if optional else "."),
        )
    parser.add_argument("overrides", nargs="*", help="Dotted key=value overrides of the config.")
    parser.add_argument("--debug", action="store_true", help="Show the traceback of any error (also QVL_DEBUG=1).")
    args = parser.parse_intermixed_args(argv)  # overrides may come before, between or after the options
    from components._shared.launch.result import RESULT_FILE
    from components._shared.platform.user_errors import reported

    log_file = None if args.output_dir.startswith("s3://") else Path(args.output_dir) / RESULT_FILE
    with reported(debug=args.debug, log_file=log_file):
        return _run_section(parser, args, config_cls, run, section, inputs, optional_inputs, record_as or section)


def _run_section(
    parser,
    args,
    config_cls,
    run,
    section: str,
    inputs: tuple[str, ...],
    optional_inputs: tuple[str, ...],
    record_as: str,
) -> dict[str, Any]:
    from components._shared.platform.storage import check_location

    check_location(args.output_dir, "--output-dir")
    _check_directory(args.output_dir)
    _check_owner(args.output_dir, record_as)  # a step records as itself (sft.build_data: sft_data), not its stage
    for name in inputs:
        if name in optional_inputs and not getattr(args, name).strip():
            continue  # absent: the stage says so if its config needs it
        check_location(getattr(args, name), f"--{name.replace('_', '-')}", builtin=True)
        _check_apart(args.output_dir, getattr(args, name), f"--{name.replace('_', '-')}")
    _check_options(args)
    from components.stages import STAGES

    data = read_section(Path(args.config) if args.config is not None else None, section, sections=tuple(STAGES))
    if args.config_json:
        data = deep_merge(data, _config_json(parser, args.config_json, section, config_cls))
    overrides = parse_overrides(args.overrides)
    if section in overrides and section not in config_cls.model_fields:
        raise ValueError(
            f"override {section}.{next(iter(_dotted(overrides[section])), '...')}: a stage's overrides are relative to "
            f"its section ({section}); leave out the '{section}.' prefix (that form is qvl submit's)."
        )
    for note in merged_map_notes(data, args.overrides):
        print(f"note: {note}", file=sys.stderr, flush=True)
    data = deep_merge(data, overrides)
    cfg = validate(config_cls, section, data)
    if args.experiment is None:
        args.experiment = _preset_experiment(args.config)

    import tempfile

    from components._shared.launch.runner import execute
    from components._shared.platform import locks, storage

    with locks.scope(), tempfile.TemporaryDirectory(prefix=f"qvl-{section}-") as scratch:
        if storage.is_s3(args.output_dir):
            locks.hold(args.output_dir, purpose=f"{section} output")
        # An s3:// output is written locally first, then published: files first, commit marker last.
        local_out = Path(scratch) / "out" if storage.is_s3(args.output_dir) else Path(args.output_dir)
        metrics = execute(
            section,
            cfg,
            run,
            inputs={name: getattr(args, name) for name in inputs},
            output_dir=local_out,
            experiment=args.experiment,
            record_as=record_as,
        )
        if storage.is_s3(args.output_dir) and os.environ.get("RANK", "0").strip() in ("", "0"):
            locks.check_not_lost()
            storage.publish_dir(local_out, args.output_dir)  # rank 0 only: it alone wrote the outputs
    print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    return metrics


def _check_options(args) -> None:
    """--config, --config-json and --experiment given empty (an unset shell variable) or unusable."""
    from components._shared.platform.credential_shapes import redact
    from components._shared.platform.names import hidden_in_name

    if args.config is not None and not args.config.strip():
        raise ValueError(
            f"--config={args.config!r} is empty (an unset shell variable gives one); "
            "give the YAML file, or leave --config out."
        )
    if args.config is not None and args.config.strip() and not Path(args.config).exists():
        bare = "/" not in args.config and not args.config.endswith((".yaml", ".yml"))
        preset = f" (a preset by its name: --config pipelines/presets/{args.config}.yaml)" if bare else ""
        raise ValueError(f"--config {args.config} does not exist; it takes a YAML file{preset}.")
    if args.config_json is not None and not args.config_json.strip():
        raise ValueError(
            f"--config-json={args.config_json!r} is empty (an unset shell variable gives one); give the section as "
            "JSON, or leave --config-json out."
        )
    if args.experiment is not None and not args.experiment.strip():
        raise ValueError(
            f"--experiment={args.experiment!r} is empty (an unset shell variable gives one); give the MLflow "
            "experiment's name, or leave --experiment out (the preset's, else 'vlm')."
        )
    hidden = hidden_in_name(args.experiment or "")
    if hidden:
        raise ValueError(f"--experiment holds {hidden}, which makes it read as another name in MLflow; retype it.")
    if args.experiment is not None and redact(args.experiment) != args.experiment:
        raise ValueError(
            "--experiment looks like a credential (not shown); an experiment's name is stored on the tracking server "
            "and shown to everyone who can read it: give a plain name."
        )
    if args.experiment is not None and len(args.experiment) > MAX_EXPERIMENT_NAME:
        raise ValueError(
            f"--experiment is {len(args.experiment)} characters; MLflow holds names of at most {MAX_EXPERIMENT_NAME}."
        )


MAX_EXPERIMENT_NAME = 500  # MLflow's limit on an experiment's name


def _config_json(parser, text: str, section: str, config_cls) -> dict[str, Any]:
    """The section given as --config-json (what launchers pass), or a usage error saying what is wrong with it."""
    try:
        given = json.loads(text, object_pairs_hook=json_object)
    except json.JSONDecodeError as err:
        parser.error(f"--config-json is not valid JSON: {err}")
    except KeyGivenTwice as err:
        parser.error(f"--config-json: {err}; give each setting once.")
    except RecursionError:
        parser.error("--config-json is nested too deeply to be a stage's settings.")
    if not isinstance(given, dict):
        parser.error(f"--config-json must be a JSON object (the '{section}' section), got {type(given).__name__}.")
    if section in given and section not in config_cls.model_fields:
        parser.error(
            f"--config-json is the '{section}' section itself: give its settings without the outer "
            f'{{"{section}": ...}}.'
        )
    return given


def _dotted(tree: Any, prefix: str = "") -> list[str]:
    """`key=value` forms of a parsed override tree ({"train": {"steps": 1}} -> ["train.steps=1"])."""
    if not isinstance(tree, dict):
        return [f"{prefix}={tree}"]
    return [line for key, value in tree.items() for line in _dotted(value, f"{prefix}.{key}" if prefix else key)]


def _preset_experiment(config: str | None) -> str:
    """The `experiment` a preset given as --config names (what the DAG logs to), else "vlm"."""
    from components._shared.platform.presets import read_preset_yaml

    name = read_preset_yaml(Path(config)).get("experiment") if config else None
    return name if isinstance(name, str) and name.strip() else "vlm"


class _Once(argparse.Action):
    """A flag given twice is an error (argparse keeps the last quietly: `--data A --data B` trained on B)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.dest in getattr(namespace, "_given", set()):
            parser.error(f"{option_string} is given twice; give it once.")
        namespace._given = getattr(namespace, "_given", set()) | {self.dest}
        setattr(namespace, self.dest, values)


def _check_directory(output: str) -> None:
    """A local output directory is a directory, or can be made one: not an existing file, nor under one."""
    if output.startswith("s3://"):
        return
    path = Path(output).absolute()
    found = next((p for p in (path, *path.parents) if p.exists()), None)
    if found is not None and not found.is_dir():
        where = "is" if found == path else f"is under {str(found)!r}, which is"
        raise ValueError(
            f"--output-dir {output!r} {where} a file, not a directory; give a directory (made if missing)."
        )
    from components._shared.platform.placement import check_outside_inputs

    check_outside_inputs(path, "--output-dir")


# What a run of a stage leaves in its output directory before its result is written (a run killed mid-way, to be
# resumed): its checkpoints (or the pointer to them), its scratch folder and its lock.
_LEFT_BY_A_RUN = ("checkpoints", "checkpoints.json", ".scratch", ".qvl-lock", ".qvl-lock.json")


def _check_owner(output: str, section: str) -> None:
    """A local output directory is empty, or holds this stage's own earlier output (a retry resumes from its
    checkpoints; `section` is what the run records as, a step's own name for a step such as sft_data). Another
    stage's output, or files no run wrote, would be listed in the commit marker as this stage's output."""
    from components._shared.launch.result import RESULT_FILE

    path = Path(output)
    if output.startswith("s3://") or not path.is_dir():
        return
    for name in _LEFT_BY_A_RUN:  # a run writes, moves aside and deletes under these: never through a link
        if (path / name).is_symlink():
            raise ValueError(
                f"--output-dir {output!r} holds {name!r} as a symbolic link (to {os.readlink(path / name)!r}); a run "
                "writes and deletes checkpoints there, so it would change what the link points to. Remove the link "
                "(the run makes its own), or give an empty or new directory."
            )
    result = path / RESULT_FILE
    if result.is_file():
        try:
            stage = json.loads(result.read_text()).get("stage")
        except (ValueError, AttributeError, RecursionError):  # not a stage result qvl writes: the checks below say
            stage = None
        if stage and stage != section:
            raise ValueError(
                f"--output-dir {output!r} holds a {stage} output ({RESULT_FILE} says so); a {section} run there would "
                f"list {stage}'s files as its own. Give {section} its own directory."
            )
        return
    names = sorted(p.name for p in path.iterdir())
    foreign = [name for name in names if not name.startswith(_LEFT_BY_A_RUN)]
    if foreign and len(foreign) == len(names):  # no trace of a run (a killed one keeps its checkpoints: resumed)
        shown = ", ".join(foreign[:5]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 5 else "")
        raise ValueError(
            f"--output-dir {output!r} already holds files no {section} run wrote ({shown}); they would become part of "
            "the stage's committed output. Give an empty or new directory."
        )


def _check_apart(output: str, given: str, flag: str) -> None:
    """The output directory is neither an input nor inside or around one: the stage would write its model and
    commit marker into the data (which then no longer matches what it was), or fingerprint its own outputs as
    data and never resume."""
    from components._shared.platform import storage

    if not given or storage.is_s3(output) != storage.is_s3(given) or given.startswith("builtin:"):
        return
    if storage.is_s3(output):
        out, other = output.rstrip("/"), given.rstrip("/")
    else:
        out, other = os.path.realpath(output), os.path.realpath(given)
    if out == other or out.startswith(other + "/") or other.startswith(out + "/"):
        raise ValueError(
            f"--output-dir {output!r} is {'the same directory as' if out == other else 'inside or around'} {flag} "
            f"{given!r}: the stage would write into its own input. Give it a directory of its own."
        )
