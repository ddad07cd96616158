"""Stage execution: results recorded for the run summary, failures recorded and re-raised, metrics flattened."""

import json

import pytest

from components._shared.launch.result import RESULT_FILE, SUMMARY_DIR_ENV, flatten_metrics
from components._shared.launch.runner import execute
from components._shared.platform.config import StageConfig


class ToyConfig(StageConfig):
    factor: float = 2.0


def toy_run(cfg, *, value, output_dir, tracker):
    (output_dir / "out.txt").write_text(str(value * cfg.factor))
    return {"doubled": value * cfg.factor, "by_reason": {"a": 1, "b": 2}, "backend": "pil"}


def failing_run(cfg, *, value, output_dir, tracker):
    raise ValueError(f"record 7: value {value} is bad")


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv(SUMMARY_DIR_ENV, str(tmp_path / "results"))
    monkeypatch.delenv("QVL_MLFLOW_PARENT_RUN_ID", raising=False)
    return tmp_path


def test_flatten_keeps_numbers_and_flattens_dicts():
    assert flatten_metrics({"a": 1, "b": {"c": 2.5, "d": "x"}, "e": True, "f": "s"}) == {"a": 1.0, "b.c": 2.5, "e": 1.0}


def test_success_is_recorded_in_output_and_summary_dir(env):
    metrics = execute(
        "toy", ToyConfig(), toy_run, inputs={"value": 3}, output_dir=env / "out", experiment="t", record_as="toy"
    )
    assert metrics["doubled"] == 6.0
    assert (env / "out" / "out.txt").read_text() == "6.0"
    for path in (env / "out" / RESULT_FILE, env / "results" / "toy.json"):
        result = json.loads(path.read_text())
        assert result["status"] == "succeeded"
        assert result["metrics"]["by_reason"] == {"a": 1, "b": 2}
        assert result["artifacts"]["output"] == str(env / "out")


def test_failure_is_recorded_then_raised(env):
    with pytest.raises(ValueError, match="record 7"):
        execute(
            "toy",
            ToyConfig(),
            failing_run,
            inputs={"value": 3},
            output_dir=env / "out",
            experiment="t",
            record_as="toy",
        )
    result = json.loads((env / "results" / "toy.json").read_text())
    assert result["status"] == "failed"
    assert "record 7" in result["error"] and result["user_error"] is True  # a ValueError: the console shows it alone


def test_unrecorded_shard_run_writes_no_summary(env):
    execute("toy", ToyConfig(), toy_run, inputs={"value": 1}, output_dir=env / "shard", experiment="t", record_as=None)
    assert not (env / "results").exists()
    assert not (env / "shard" / RESULT_FILE).exists()


def test_output_is_committed_last_and_only_on_success(env):
    from components._shared.platform import storage

    execute("toy", ToyConfig(), toy_run, inputs={"value": 2}, output_dir=env / "ok", experiment="t", record_as="toy")
    marker = storage.read_marker(env / "ok")
    assert set(marker["files"]) == {"out.txt", RESULT_FILE}
    with pytest.raises(ValueError):
        execute(
            "toy",
            ToyConfig(),
            failing_run,
            inputs={"value": 2},
            output_dir=env / "bad",
            experiment="t",
            record_as="toy",
        )
    assert not storage.is_committed(env / "bad")


def test_a_modified_committed_input_is_refused(env):
    from components._shared.platform.storage import IntegrityError

    execute("toy", ToyConfig(), toy_run, inputs={"value": 2}, output_dir=env / "up", experiment="t", record_as="up")
    (env / "up" / "out.txt").write_text("tampered")
    with pytest.raises(IntegrityError, match="out.txt"):
        execute(
            "toy",
            ToyConfig(),
            toy_run,
            inputs={"value": str(env / "up")},
            output_dir=env / "down",
            experiment="t",
            record_as="down",
        )


class NotesConfig(ToyConfig):
    def ignored_settings(self) -> list[str]:
        return ["factor: no effect here"]


def test_settings_without_effect_are_said_at_the_start_and_kept_with_the_result(env, capsys):
    execute("toy", NotesConfig(), toy_run, inputs={"value": 3}, output_dir=env / "out", experiment="t", record_as="toy")
    assert "warning: setting without effect: toy.factor: no effect here" in capsys.readouterr().err
    result = json.loads((env / "results" / "toy.json").read_text())
    assert result["ignored_settings"] == ["toy.factor: no effect here"]
    assert "ignored_settings" not in json.loads((env / "out" / RESULT_FILE).read_text())["metrics"]


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
        ({"RANK": "-1"}, "RANK='-1' is not a whole number"),
        ({"LOCAL_RANK": "٣"}, "LOCAL_RANK='٣' is not a whole number"),  # an Arabic-Indic digit: isdigit() but no rank
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: a run has at least one process"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ],
)
def test_a_launcher_variable_that_is_no_rank_is_named_before_the_stage_runs(env, monkeypatch, variables, named):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=named):
        execute(
            "toy", ToyConfig(), toy_run, inputs={"value": 3}, output_dir=env / "out", experiment="t", record_as="toy"
        )
    assert not (env / "out").exists()  # nothing ran


def test_launcher_variables_that_agree_pass(env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", " 1 ")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "")
    metrics = execute(
        "toy", ToyConfig(), toy_run, inputs={"value": 3}, output_dir=env / "out", experiment="t", record_as="toy"
    )
    assert metrics["doubled"] == 6.0
