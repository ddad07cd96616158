"""What the sixth hostile pass (158 cases; 19 silent, 8 leaks, 10 unclear, 1 hang, no traceback) found, each held.

Files of the user's deleted or written into the working directory by an empty or foreign `--out`; secrets echoed in
warnings, the compiled YAML or MLflow; inputs taken although they were another stage's, another checkpoint's or
the wrong file; messages that named nothing; a read that blocked for ever on a pipe.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines.qvl.app import app

runner = CliRunner()


# -- the working directory and a user's own folders are never written into --------------------------------------
def test_an_empty_or_foreign_run_directory_is_refused_before_anything_is_touched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mine.log").write_text("my notes")
    run = ["run", "--local", "--lake", str(tmp_path / "lake"), "--data", str(tmp_path / "data")]
    empty = runner.invoke(app, [*run, "--out", ""])
    assert "--out='' is empty (an unset shell variable gives one)" in str(empty.exception)
    project = tmp_path / "myproj"
    (project / "logs").mkdir(parents=True)
    (project / "logs" / "notes.txt").write_text("notes")
    (project / "report.html").write_text("<html>mine</html>")
    foreign = runner.invoke(app, [*run, "--out", str(project)])
    assert "holds files no qvl run wrote (logs, report.html)" in str(foreign.exception)
    assert (project / "logs" / "notes.txt").read_text() == "notes" and (tmp_path / "logs" / "mine.log").exists()
    assert (project / "report.html").read_text() == "<html>mine</html>"
    synth = runner.invoke(app, ["lake", "synth", "--out", "", "--records", "5"])
    assert "--out='' is empty" in str(synth.exception)
    tilde = runner.invoke(app, ["lake", "synth", "--out", "~/world", "--records", "5"])
    assert "starts with '~', which no shell expanded" in str(tilde.exception)
    rehearse = runner.invoke(app, ["rehearse", "--config", "qwen3.5-0.8b", "--out", ""])
    assert "--out='' is empty" in str(rehearse.exception)
    stages = runner.invoke(app, ["rehearse", "--config", "qwen3.5-0.8b", "--stages", "", "--out", "r"])
    assert "--stages='' names no run" in str(stages.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "myproj"]


def test_a_stage_output_named_with_an_unexpanded_tilde_is_refused(tmp_path, monkeypatch):
    from components.sft.stage import main as sft_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        sft_main(["--output-dir", "~/out", "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(tmp_path)])
    assert not (tmp_path / "~").exists()


def test_compile_replaces_a_symlink_at_its_target_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "link.yaml").symlink_to(victim)
    result = runner.invoke(app, ["compile", "--preset", "tiny", "--out", str(tmp_path / "link.yaml")])
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious" and not (tmp_path / "link.yaml").is_symlink()
    assert "pipelineInfo" in (tmp_path / "link.yaml").read_text()


# -- secrets are never echoed -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("registry", "says"),
    [
        ("bob:RegPw1234567@registry.example.com/qvl", "holds an '@'"),
        ("https://ghcr.io/org", "takes no scheme"),
        ("ghcr.io/My Org", "is not a registry prefix Kubernetes can pull from"),
        ("ghcr.io/MyOrg", "is not a registry prefix Kubernetes can pull from"),
    ],
)
def test_an_image_registry_kubernetes_cannot_pull_from_or_holding_a_password_is_refused(registry, says):
    from components._shared.platform.container_images import check_registry

    with pytest.raises(ValueError, match="QVL_IMAGE_REGISTRY") as refused:
        check_registry(registry)
    assert says in str(refused.value) and "RegPw" not in str(refused.value)
    assert check_registry("localhost:5000/team/qvl-images/") == "localhost:5000/team/qvl-images"


def test_endpoint_and_tracking_passwords_are_hidden_in_warnings(monkeypatch, capsys, tmp_path):
    from botocore.exceptions import EndpointConnectionError

    from components._shared.platform import s3_client
    from components._shared.platform.mlflow_tracking import MlflowTracker, _said

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://admin:EndPoInTpAsS99@127.0.0.1:9")
    s3_client._say_connection_retries(attempts=1, caught_exception=EndpointConnectionError(endpoint_url="x"))
    warned = capsys.readouterr().err
    assert "did not answer" in warned and "EndPoInTpAsS99" not in warned and "127.0.0.1:9" in warned
    error = RuntimeError("API request to http://admin:MlFlOwPaSs77@127.0.0.1:9/api failed")
    assert "MlFlOwPaSs77" not in _said(error) and "127.0.0.1:9/api" in _said(error)
    monkeypatch.delenv("QVL_MLFLOW_FALLBACK_DIR", raising=False)
    tracker = MlflowTracker(None, "run1")
    path = tracker._spill(status="FAILED")  # no directory given: a new private one, never a shared /tmp name
    assert path.parent.name.startswith("qvl-mlflow-unsent-") and path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    shutil.rmtree(path.parent)


@pytest.mark.parametrize(
    "extra_args",
    [
        ["--x-auth=Bearer abcdefSECRETbearer0123456789"],
        ["--api-key=abcdefSECRET99"],
        ["--token", "Bearer abcdefgh1234567890"],
    ],
)
def test_bearer_tokens_and_credential_flags_are_credentials(extra_args):
    from pipelines import credentials

    found = credentials.findings({"serving": {"extra_args": extra_args}})
    assert found and found[0].startswith("serving.extra_args[")
    assert credentials.findings({"serving": {"extra_args": ["--max-model-len=4096", "--api-server-count=2"]}}) == []


def _sft_argv(tmp_path: Path) -> list[str]:
    """An sft command line that fails on its own flags before reading anything."""
    return [
        "--output-dir",
        str(tmp_path / "o"),
        "--base-model",
        "builtin:tiny-qwen2_5-vl",
        "--data",
        str(tmp_path / "d"),
    ]


def test_a_stage_experiment_that_looks_like_a_credential_is_refused(tmp_path, capsys):
    from components.sft.stage import main as sft_main

    token = "ghp_" + "AbCd" * 9
    argv = _sft_argv(tmp_path)
    with pytest.raises(SystemExit):
        sft_main([*argv, "--experiment", token])
    err = capsys.readouterr().err
    assert "--experiment looks like a credential (not shown)" in err and token not in err


# -- inputs that are not what they claim ------------------------------------------------------------------------
def _stage_dir(root: Path, stage: str) -> Path:
    from components._shared.platform import storage

    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text("{}")
    (root / "_stage_result.json").write_text(json.dumps({"stage": stage, "metrics": {}}))
    storage.commit_dir(root)
    return root


def test_select_refuses_another_stages_output_and_one_output_under_two_flags(tmp_path):
    from components.select_checkpoint.candidates import find_candidates

    sft = _stage_dir(tmp_path / "sft", "sft")
    with pytest.raises(ValueError, match=r"--rl .* is the output of the sft stage"):
        find_candidates({"sft": "", "rl": str(sft)}, 0)
    anonymous = _stage_dir(tmp_path / "x", "sft")
    (anonymous / "_stage_result.json").unlink()  # a result file names its stage; without one the path is compared
    with pytest.raises(ValueError, match="inputs sft and distill name the same directory"):
        find_candidates({"sft": str(anonymous), "distill": str(anonymous)}, 0)
    assert [c.stage for c in find_candidates({"sft": str(sft), "rl": ""}, 0)] == ["sft"]


def test_features_of_another_vision_tower_of_the_same_width_are_refused(tmp_path):
    import torch

    from components._shared.model.vision_digest import vision_digest
    from components._shared.model.vlm import load_vlm, qwen_model
    from components.pretrain.feature_store import FeatureStore

    model = load_vlm("builtin:tiny-qwen2_5-vl").model
    own = vision_digest(qwen_model(model).visual)
    index = {"model": "other", "hidden_size": 64, "cached_levels": [], "images": {}, "vision_digest": own}
    index["hidden_size"] = int(qwen_model(model).visual.patch_embed.proj.out_channels)
    (tmp_path / "index.json").write_text(json.dumps(index))
    FeatureStore(tmp_path).check(model, min_pixels=1, max_pixels=1)  # its own tower's features
    with torch.no_grad():
        qwen_model(model).visual.blocks[0].mlp.down_proj.weight.add_(0.01)  # another checkpoint, same shapes
    with pytest.raises(ValueError, match="whose weights differ from this base model's"):
        FeatureStore(tmp_path).check(model, min_pixels=1, max_pixels=1)


def test_a_config_file_of_other_stages_only_an_empty_config_json_and_a_pipe_are_refused(tmp_path, capsys):
    from components._shared.platform.presets import read_preset_yaml, read_section
    from components.sft.stage import main as sft_main
    from components.stages import STAGES

    (tmp_path / "rl.yaml").write_text("rl:\n  train: {steps: 1}\n")
    with pytest.raises(ValueError, match=r"rl.yaml has no 'sft' section \(it has: rl\)"):
        read_section(tmp_path / "rl.yaml", "sft", sections=tuple(STAGES))
    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):  # it blocked for ever
        read_preset_yaml(fifo)
    argv = _sft_argv(tmp_path)
    with pytest.raises(SystemExit):
        sft_main([*argv, "--config-json", ""])
    assert "--config-json='' is empty" in capsys.readouterr().err


# -- data: a manifest outside, names too long, messages that name what to fix ------------------------------------
def _world(tmp_path: Path) -> Path:
    from components.synth_world.splits import write_splits

    data = tmp_path / "data"
    write_splits(data, seed=3, eval_per_type=1, sft_records=4, preference_pairs=2)
    return data


def test_a_manifest_symlinked_out_and_credentials_in_it_or_in_image_uris_are_refused(tmp_path):
    from components._shared.data import datasets

    data = _world(tmp_path)
    outside = tmp_path / "outside.yaml"
    outside.write_text("sft: [sft.jsonl]\n")
    (data / "dataset.yaml").symlink_to(outside)
    with pytest.raises(ValueError, match="is a symlink leading outside the data directory"):
        datasets.manifest(data)
    (data / "dataset.yaml").unlink()
    (data / "dataset.yaml").write_text('sft:\n  - {path: sft.jsonl, images: "s3://bob:DsImgSecret99@bucket/imgs"}\n')
    with pytest.raises(ValueError, match=r"sft\[0\]\.images carries a credential") as refused:
        datasets.manifest(data)
    assert "DsImgSecret99" not in str(refused.value)
    (data / "dataset.yaml").unlink()
    lines = (data / "sft.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["image"] = "s3://AKIAHOSTILE6EXAMPL1:ImgSecretValue123456@bucket/x.png"
    (data / "sft.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"sft.jsonl:1 \(id='sft-00000'\).*carries a credential") as refused:
        datasets.load_conversations(data, None)
    assert "ImgSecretValue" not in str(refused.value)


def test_names_too_long_for_metric_keys_and_tasks_that_differ_by_case_are_refused(tmp_path):
    from components._shared.data import datasets
    from components._shared.data.manifest import parse_manifest

    data = _world(tmp_path)
    lines = (data / "eval.jsonl").read_text().splitlines()
    second = json.loads(lines[1])
    second["benchmark"] = "x" * 300
    (data / "eval.jsonl").write_text("\n".join([lines[0], json.dumps(second), *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=r"eval.jsonl:2 .*use at most 64 letters"):
        datasets.load_eval_records(data)
    with pytest.raises(ValueError, match="tasks 'widget' and 'Widget' differ only by case"):
        parse_manifest("tasks: {widget: exact_match, Widget: anls}\n", "dataset.yaml")


def test_an_entrys_task_that_no_record_takes_is_said(tmp_path, caplog):
    from components._shared.data import datasets

    data = _world(tmp_path)
    (data / "dataset.yaml").write_text(
        "tasks: {widget: exact_match}\neval:\n  - {path: eval.jsonl, task: widget}\nsft: [sft.jsonl]\n"
    )
    with caplog.at_level(logging.WARNING):
        datasets.load_eval_records(data)
    assert any("gives it task 'widget', but each of its" in r.getMessage() for r in caplog.records)


def test_bad_records_of_several_files_are_named_at_once_and_odd_files_say_what_they_are(tmp_path):
    from components._shared.data import datasets
    from components._shared.data.image_checks import inspect_image

    data = _world(tmp_path)
    shutil.copy(data / "eval.jsonl", data / "more.jsonl")
    for name in ("eval.jsonl", "more.jsonl"):
        lines = (data / name).read_text().splitlines()
        (data / name).write_text("\n".join([*lines, "[1]"]) + "\n")
    (data / "dataset.yaml").write_text("eval: [eval.jsonl, more.jsonl]\nsft: [sft.jsonl]\n")
    with pytest.raises(ValueError) as both:
        datasets.load_eval_records(data)
    assert (
        str(both.value).startswith("2 files: ")
        and "in eval.jsonl" in str(both.value)
        and "in more.jsonl" in str(both.value)
    )
    (data / "images" / "page.png").write_bytes(b"<html><body>404 Not Found</body></html>")
    assert "is an HTML or XML page, not an image (a failed download" in inspect_image(data, "images/page.png")[0]
    (data / "MMBench_DEV_EN.tsv").write_text("index,question,A,B,answer\n1,q,a,b,A\n")
    (data / "dataset.yaml").write_text("eval:\n  - {path: MMBench_DEV_EN.tsv, format: mmbench}\n")
    with pytest.raises(ValueError, match=r"header line has no tab \(it looks comma-separated"):
        datasets.load_eval_records(data)


def test_a_pipe_under_a_shards_name_is_said_and_not_opened(tmp_path, caplog):
    from components._shared.data.lake import list_lake_files
    from components.synth_world.lake import write_world

    write_world(tmp_path / "w", records=10, seed=0, sft_records=2)
    os.mkfifo(tmp_path / "w" / "lake" / "00009.tar")
    with caplog.at_level(logging.WARNING):
        shards, _ = list_lake_files(str(tmp_path / "w" / "lake"))
    assert [Path(s).name for s in shards] == ["00000.tar"]
    assert any("1 shard-named entry is not a regular file" in r.getMessage() for r in caplog.records)


def test_models_build_names_the_builtins_it_builds():
    result = runner.invoke(app, ["models", "build", "tiny-qwen9"])
    assert "unknown builtin model(s) ['tiny-qwen9']; this command builds: " in str(result.exception)
