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
    assert "until='nope'" in str(result.exception)


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
