"""The `qvl` command line: lake synth, compile, stage errors, run's argument checks."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from pipelines.qvl.app import app

runner = CliRunner()


def test_lake_synth_writes_a_world_with_ground_truth(tmp_path):
    result = runner.invoke(app, ["lake", "synth", "--out", str(tmp_path / "w"), "--records", "60", "--seed", "2"])
    assert result.exit_code == 0, result.output
    counts = json.loads(result.stdout[result.stdout.index("{") :])
    assert counts["lake"]["records"] == 60
    assert len((tmp_path / "w" / "ground_truth.jsonl").read_text().splitlines()) == 60
    assert sorted(p.name for p in (tmp_path / "w" / "lake").glob("*.tar")) == ["00000.tar"]


def test_compile_writes_a_parseable_pipeline(tmp_path):
    out = tmp_path / "p.yaml"
    result = runner.invoke(app, ["compile", "--preset", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    spec = next(yaml.safe_load_all(out.read_text()))
    assert spec["pipelineInfo"]["name"] == "vlm-training"
    defaults = spec["root"]["inputDefinitions"]["parameters"]["base_model_uri"]["defaultValue"]
    assert defaults == "builtin:tiny-qwen2_5-vl"


def test_stage_with_an_invalid_setting_names_it(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("clean_data:\n  min_side: -3\n")
    result = runner.invoke(
        app,
        [
            "stage",
            "clean_data",
            "--config",
            str(cfg),
            "--lake-uri",
            str(tmp_path / "lake"),
            "--output-dir",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2  # one message, no traceback (platform/user_errors.py)
    assert "error: " in result.stderr and "clean_data.min_side" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("flag", ["--output-dir", "--lake-uri", "--config"])
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_path_argument_is_refused_naming_the_flag(tmp_path, monkeypatch, flag, empty):
    """`--output-dir "$UNSET"` is refused, not run in the working directory."""
    (tmp_path / "cfg.yaml").write_text("clean_data: {}\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    given = {
        "--config": str(tmp_path / "cfg.yaml"),
        "--lake-uri": str(tmp_path / "lake"),
        "--output-dir": str(tmp_path / "o"),
    }
    given[flag] = empty
    result = runner.invoke(app, ["stage", "clean_data", *(part for pair in given.items() for part in pair)])
    assert result.exit_code == 2 and f"error: {flag}={empty!r} is empty" in result.stderr, result.output
    assert list(work.iterdir()) == [] and not (tmp_path / "o").exists()  # nothing written anywhere


@pytest.mark.parametrize(("output", "says"), [("data", "the same directory as"), ("data/out", "inside or around")])
def test_an_output_directory_that_is_or_holds_an_input_is_refused(tmp_path, output, says):
    """`--output-dir` equal to `--data` wrote the model and commit marker into the data (exit 0); inside it, every
    rerun fingerprinted its own outputs as data and set its checkpoints aside instead of resuming."""
    (tmp_path / "data").mkdir()
    args = ["stage", "sft", "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(tmp_path / "data")]
    result = runner.invoke(app, [*args, "--output-dir", str(tmp_path / output)])
    assert result.exit_code == 2 and f"error: --output-dir '{tmp_path / output}' is {says} --data" in result.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == []  # nothing written into the data


@pytest.mark.parametrize("given", [[], ["--reward-model", ""]])
def test_rl_runs_without_a_reward_model_flag_until_its_rewards_name_one(tmp_path, given):
    """rl's reward model is optional (left out, or '' as the DAG passes an unused input): only a reward mix that
    weights it needs it, and that is refused naming the setting, not taken as the working directory."""
    (tmp_path / "cfg.yaml").write_text("rl:\n  rewards: {efficacy: 1.0, reward_model: 0.5}\n")
    args = ["stage", "rl", "--config", str(tmp_path / "cfg.yaml"), "--base-model", "builtin:tiny-qwen2_5-vl"]
    (tmp_path / "data").mkdir()
    result = runner.invoke(app, [*args, *given, "--data", str(tmp_path / "data"), "--output-dir", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.output
    assert "rl.rewards uses reward_model (weight 0.5) but the stage got no reward model" in result.stderr


def test_run_refuses_non_local_and_unknown_stage(tmp_path):
    not_local = runner.invoke(app, ["run", "--lake", str(tmp_path)])
    assert not_local.exit_code == 2 and not_local.stderr.startswith("error: `qvl run` runs locally (--local)")
    lake = tmp_path / "lake"
    args = ["run", "--local", "--lake", str(lake), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "o")]
    result = runner.invoke(app, [*args, "--until", "nope"])
    assert result.exit_code != 0
    assert "--until 'nope' is not a stage to stop at" in str(result.exception)
    assert "Running preset" not in result.output  # refused before the run is said to start (ninth pass, R14)
    missing = runner.invoke(app, [*args[:-2], "--out", str(tmp_path / "o"), "--until", "clean_data"])
    assert f"--lake {lake} does not exist" in str(missing.exception) and "Running preset" not in missing.output


def test_run_without_data_or_with_its_directory_inside_the_lake_is_refused_before_it_starts(tmp_path):
    lake = tmp_path / "lake"
    lake.mkdir()
    result = runner.invoke(app, ["run", "--local", "--lake", str(lake), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"error: no --data given, and its default beside the lake ({tmp_path / 'heldout'}" in result.stderr
    (tmp_path / "heldout").mkdir()
    inside = runner.invoke(app, ["run", "--local", "--lake", str(lake), "--out", str(lake / "run")])
    assert f"--out {lake / 'run'} is inside --lake {lake}" in str(inside.exception)
    assert not (lake / "run").exists() and not (tmp_path / "o").exists()  # refused before anything was made


def test_stage_help_and_unknown_stage_print_usage_not_a_traceback():
    shown = runner.invoke(app, ["stage", "--help"])
    assert shown.exit_code == 0 and shown.exception is None
    assert "Stages: preflight, clean_data" in shown.output
    unknown = runner.invoke(app, ["stage", "clean-data"])
    assert unknown.exit_code == 2 and isinstance(unknown.exception, SystemExit)
    assert "Unknown stage 'clean-data'" in unknown.output and "select_checkpoint" in unknown.output


def test_overrides_may_sit_between_options_and_select_needs_only_the_stages_it_compares(tmp_path):
    """`sft.x=1 --output-dir O rl.y=2` was "unrecognized arguments"; select_checkpoint asked for all six stage
    inputs although it compares those given. Both now reach the stage's own checks."""
    (tmp_path / "data").mkdir()
    args = ["stage", "rl", "gates.length_ratio_min=3", "--base-model", "builtin:tiny-qwen2_5-vl"]
    result = runner.invoke(app, [*args, "--data", str(tmp_path / "data"), "gates.length_ratio_max=2", "--output-dir"])
    assert result.exit_code == 2 and "expected one argument" in result.stderr  # argparse still checks the options
    result = runner.invoke(
        app, [*args, "--data", str(tmp_path / "data"), "gates.length_ratio_max=2", "--output-dir", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.output
    assert "gates.length_ratio_min=3.0 > gates.length_ratio_max=2.0" in result.stderr  # both overrides were read
    select = ["stage", "select_checkpoint", "--data", str(tmp_path / "data"), "--output-dir", str(tmp_path / "s")]
    result = runner.invoke(app, [*select, "--sft", str(tmp_path / "sft")])
    assert result.exit_code == 2 and "the following arguments are required" not in result.stderr, result.output
    assert f"select_checkpoint input sft='{tmp_path / 'sft'}' has no model/config.json" in result.stderr


def test_a_reward_model_given_as_the_model_to_train_from_is_refused(tmp_path):
    """rl from the reward model's model/ trained a policy from the Bradley-Terry backbone, its head ignored, exit 0."""
    reward_model = tmp_path / "reward_model" / "model"
    reward_model.mkdir(parents=True)
    (reward_model / "config.json").write_text("{}")
    (reward_model / "reward_head.safetensors").write_bytes(b"")
    (tmp_path / "data").mkdir()
    args = ["stage", "rl", "--base-model", str(reward_model), "--data", str(tmp_path / "data")]
    result = runner.invoke(app, [*args, "--output-dir", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        f"--base-model {reward_model} is a reward model (reward_head.safetensors beside its backbone)" in result.stderr
    )
    assert not (tmp_path / "o" / "model").exists()  # refused before any data was read or model loaded


def test_an_output_directory_of_another_stage_or_of_other_files_is_refused(tmp_path):
    """A folder of one's own files (listed in the commit marker, a text file shipped in model/) or a finished sft
    output given to reward_model (sft's adapter/ and calibration listed as the reward model's) were taken, exit 0;
    this stage's own earlier output, or a killed run's checkpoints, are still resumed into."""
    (tmp_path / "data").mkdir()
    args = ["stage", "reward_model", "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(tmp_path / "data")]
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "thesis.txt").write_text("mine")
    result = runner.invoke(app, [*args, "--output-dir", str(mine)])
    assert (
        result.exit_code == 2 and "already holds files no reward_model run wrote (notes, thesis.txt)" in result.stderr
    )
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "_stage_result.json").write_text(json.dumps({"stage": "sft", "status": "succeeded"}))
    result = runner.invoke(app, [*args, "--output-dir", str(sft)])
    assert (
        result.exit_code == 2
        and f"--output-dir '{sft}' holds a sft output (_stage_result.json says so)" in result.stderr
    )
    killed = tmp_path / "killed"
    (killed / "checkpoints").mkdir(parents=True)
    (killed / "report.md").write_text("half written")
    result = runner.invoke(app, [*args, "--output-dir", str(killed)])
    assert "already holds files" not in result.stderr and "holds a" not in result.stderr  # went on to the data
    assert f"{tmp_path / 'data'}" in result.stderr and result.exit_code == 2, result.output
    assert sorted(p.name for p in mine.iterdir()) == ["notes", "thesis.txt"]  # nothing written into the refused ones


def test_the_lake_given_as_training_data_is_named_as_a_lake(tmp_path):
    (tmp_path / "lake").mkdir()
    (tmp_path / "lake" / "00000.tar").write_bytes(b"")
    args = ["stage", "sft", "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(tmp_path / "lake")]
    result = runner.invoke(app, [*args, "--output-dir", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "holds lake shards (00000.tar), not training data" in result.stderr and "--lake-uri" in result.stderr


def test_command_line_mistakes_the_fifth_pass_found_are_named(tmp_path, monkeypatch):
    """Each was taken silently or answered with a message naming nothing: a compile target that is not YAML (kfp's
    words after 7 s), another preset compiled over the committed prod-7b pipeline, --timeout without --wait,
    rehearse flags of the other mode, --until preflight, an overlong experiment name (MLflow refused it and the stage
    ran on as in an outage), a stage override written with its section's prefix."""
    result = runner.invoke(app, ["compile", "--preset", "tiny", "--out", str(tmp_path / "p.json")])
    assert (
        result.exit_code == 2
        and "a pipeline with Kubernetes settings compiles to YAML; end it in .yaml" in result.stderr
    )
    monkeypatch.setattr("pipelines.compile.COMPILED", tmp_path / "compiled" / "vlm_training.yaml")
    (tmp_path / "compiled").mkdir()
    result = runner.invoke(app, ["compile", "--preset", "tiny"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "compiled").iterdir()) == ["vlm_training-tiny.yaml"]
    result = runner.invoke(app, ["submit", "--host", "http://127.0.0.1:9", "--experiment", "e", "--timeout", "5"])
    assert result.exit_code == 2 and "--timeout applies only with --wait" in result.stderr
    both = runner.invoke(app, ["rehearse", "--config", "qwen3.5-0.8b", "--preset", "tiny"])
    assert both.exit_code == 2 and "error: --config and --preset exclude each other" in both.stderr
    other = runner.invoke(app, ["rehearse", "--config", "qwen3.5-0.8b", "--data", str(tmp_path)])
    assert (
        other.exit_code == 2 and "error: --data belong to --preset; with --config they would be ignored" in other.stderr
    )
    (tmp_path / "data").mkdir()
    until = [
        "run",
        "--local",
        "--lake",
        str(tmp_path / "lake"),
        "--data",
        str(tmp_path / "data"),
        "--until",
        "preflight",
    ]
    assert "preflight runs first in every DAG" in str(
        runner.invoke(app, [*until, "--out", str(tmp_path / "o")]).exception
    )
    stage = ["stage", "reward_model", "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(tmp_path / "data")]
    long = runner.invoke(app, [*stage, "--output-dir", str(tmp_path / "r"), "--experiment", "e" * 501])
    assert long.exit_code == 2 and "--experiment is 501 characters; MLflow holds names of at most 500" in long.stderr
    prefixed = runner.invoke(app, [*stage, "--output-dir", str(tmp_path / "r"), "reward_model.train.steps=1"])
    assert prefixed.exit_code == 2
    assert "override reward_model.train.steps=1: a stage's overrides are relative to its section" in prefixed.stderr
    wrapped = runner.invoke(app, [*stage, "--output-dir", str(tmp_path / "r"), "--config-json", '{"reward_model": {}}'])
    assert wrapped.exit_code == 2 and "--config-json is the 'reward_model' section itself" in wrapped.stderr
