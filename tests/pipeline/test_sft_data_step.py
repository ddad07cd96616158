"""The sft_data step (sft.build_data.enabled): in the DAG between pretrain and sft on one GPU, its output what sft and
distill read; absent, and refused as --until, when off; preflight then asks sft_data_uri for held-out questions only."""

import pytest
import yaml
from kfp import compiler

from components.preflight.stage import check_data, data_requirements
from components.stages import dag_stages
from pipelines.presets import load_preset
from pipelines.vlm_training import build_pipeline


def _compiled(tmp_path, enabled: bool) -> tuple[dict, dict]:
    (tmp_path / "p.yaml").write_text(f"extends: prod-7b\nsft: {{build_data: {{enabled: {str(enabled).lower()}}}}}\n")
    out = tmp_path / "compiled.yaml"
    compiler.Compiler().compile(build_pipeline(load_preset(tmp_path / "p.yaml")), str(out))
    spec, platform = yaml.safe_load_all(out.read_text())
    return spec, platform


def test_the_step_feeds_sft_and_distill_and_runs_on_one_gpu(tmp_path):
    spec, platform = _compiled(tmp_path, enabled=True)
    tasks = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    step = tasks["sft-data-op"]
    assert {"merge-shards-op", "pretrain-op", "preflight-op"} <= set(step["dependentTasks"])
    for consumer in ("sft-op", "distill-op"):
        given = tasks[consumer]["inputs"]["artifacts"]["built_data"]["taskOutputArtifact"]
        assert given == {"outputArtifactKey": "sft_data", "producerTask": "sft-data-op"}, consumer
    executor = spec["deploymentSpec"]["executors"]["exec-sft-data-op"]["container"]
    assert executor["resources"]["accelerator"]["resourceCount"] == "1"  # scoring: one process
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-sft-data-op"]
    assert k8s["emptyDirMounts"][0]["mountPath"] == "/dev/shm"


def test_off_by_default_with_no_task_and_no_built_input(tmp_path):
    spec, _ = _compiled(tmp_path, enabled=False)
    tasks = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert "sft-data-op" not in tasks
    assert "built_data" not in tasks["sft-op"]["inputs"].get("artifacts", {})
    for preset in ("demo", "tiny", "prod-7b", "prod-qwen3-vl-8b", "prod-qwen3.5-9b"):
        assert "sft_data" not in dag_stages(load_preset(preset).stages), preset


def test_until_a_step_that_is_off_is_refused_naming_its_setting():
    stages = load_preset("tiny").stages
    with pytest.raises(ValueError, match=r"--until sft_data: sft\.build_data\.enabled is not true"):
        dag_stages(stages, "sft_data")
    with pytest.raises(ValueError, match=r"--until promote: promote\.enabled is not true"):
        dag_stages({**stages, "promote": {"enabled": False}}, "promote")
    on = {**stages, "sft": {**stages["sft"], "build_data": {"enabled": True}}}
    assert dag_stages(on, "sft_data")[-2:] == ["pretrain", "sft_data"]


def test_preflight_asks_built_only_sft_data_for_held_out_questions(tmp_path):
    (tmp_path / "eval.jsonl").write_text("{}\n")
    built = {"build_data": {"enabled": True}}
    needs = data_requirements({"sft_data_uri": (str(tmp_path), True)}, {}, built)
    assert needs["sft_data_uri"]["roles"] == ["eval"] and check_data(needs) == 1
    given_too = data_requirements(
        {"sft_data_uri": (str(tmp_path), True)}, {}, {"build_data": {**built["build_data"], "include_given": True}}
    )
    with pytest.raises(ValueError, match="needs sft.jsonl"):
        check_data(given_too)
    with pytest.raises(ValueError, match="needs sft.jsonl"):  # off: the conversations are trained on as given
        check_data(data_requirements({"sft_data_uri": (str(tmp_path), True)}, {}, {}))
    (tmp_path / "dataset.yaml").write_text("eval: [eval.jsonl]\n")
    with pytest.raises(ValueError, match="holds a dataset.yaml; the sft_data step .* set build_data.enabled: false"):
        check_data(needs)
    unused = data_requirements({"rl_data_uri": (str(tmp_path / "nowhere"), False)}, {}, {})
    assert check_data(unused) == 0  # a URI no stage of this DAG reads (--until stops before rl) is not looked at
