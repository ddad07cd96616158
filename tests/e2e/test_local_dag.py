"""The DAG runs locally (kfp.local) on the tiny preset: preflight, clean_data fan-out/merge, extract_features,
pretrain, sft, reward_model, rl, distill, select_checkpoint; caching reuses unchanged stages and re-runs what a changed
config reaches."""

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from components.synth_world.lake import write_world

    out = tmp_path_factory.mktemp("world")
    write_world(out, records=400, seed=3)  # two shards: the fan-out really fans out
    return out


@pytest.fixture(scope="module")
def summary(world, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("run")
    (out.parent / f"{out.name}.console.txt").write_text(_qvl_run(world, out))
    return json.loads((out / "run_summary.json").read_text()), out


def _qvl_run(world: Path, out: Path, preset: str = "tiny") -> str:
    """`qvl run --local` as a user runs it, not on a terminal (CI's view); returns what the console got."""
    cmd = [
        sys.executable,
        "-m",
        "pipelines.qvl.app",
        "run",
        "--local",
        "--preset",
        preset,
        "--cache",
        "--lake",
        str(world / "lake"),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_the_console_gets_a_short_view_and_every_tasks_output_goes_to_its_log(summary):
    data, out = summary
    console = (out.parent / f"{out.name}.console.txt").read_text().splitlines()
    assert len(console) < 100, "\n".join(console)
    for stage in data["stages"]:
        (done,) = [line for line in console if line.split()[1:2] == [stage] and "succeeded in" in line]
    assert "VQA" in "\n".join(console) and "champion" in "\n".join(console)
    noise = ("executor_input", "executorInput", "UserWarning", "RuntimeWarning", "Loading weights", "INFO")
    assert not [line for line in console if any(word in line for word in noise)]
    logs = Path(data["logs"])
    tasks = {path.stem for path in logs.glob("*.log")}
    assert {"preflight_op", "list_shards_op", "clean_shard_op", "clean_shard_op-2", "merge_shards_op"} <= tasks
    assert {f"{stage}_op" for stage in data["stages"] if stage != "clean_data"} <= tasks
    assert "Executing task" in (logs / "kfp.log").read_text()  # kfp.local's own lines
    assert "Got executor_input" in (logs / "sft_op.log").read_text()  # the task's whole stream
    page = (out / "report.html").read_text()
    assert Path(data["report"]) == (out / "report.html").resolve()
    assert any(line.strip().startswith("report:") and line.endswith("report.html") for line in console)
    for stage in data["stages"]:
        assert f'id="stage-{stage}"' in page, stage


def test_every_stage_succeeded_with_the_summary_schema(summary):
    data, _ = summary
    assert data["status"] == "succeeded"
    assert set(data["stages"]) == {
        "preflight",
        "clean_data",
        "extract_features",
        "pretrain",
        "sft",
        "reward_model",
        "rl",
        "distill",
        "select_checkpoint",
        "promote",
    }
    for stage, result in data["stages"].items():
        assert result["status"] == "succeeded", stage
        assert isinstance(result["metrics"], dict) and isinstance(result["artifacts"], dict)


def test_clean_data_accounting_in_the_summary(summary, world):
    metrics = summary[0]["stages"]["clean_data"]["metrics"]
    lines = (world / "ground_truth.jsonl").read_text().splitlines()
    assert metrics["records_in"] == len(lines)
    assert metrics["records_kept"] + metrics["records_rejected"] == metrics["records_in"]
    assert sum(metrics["rejected_by_reason"].values()) == metrics["records_rejected"]
    defects = sum(1 for line in lines if json.loads(line)["defect"])
    assert metrics["records_rejected"] >= 0.9 * defects


def test_features_cover_every_kept_image(summary):
    stages = summary[0]["stages"]
    index = json.loads((Path(stages["extract_features"]["artifacts"]["features"]) / "index.json").read_text())
    assert len(index["images"]) == stages["clean_data"]["metrics"]["records_kept"]


def test_pretrain_and_sft_report_the_issue_metrics_and_load(summary):
    stages = summary[0]["stages"]
    pretrain, sft = stages["pretrain"]["metrics"], stages["sft"]["metrics"]
    for key in ("heldout_caption_loss_initial", "heldout_caption_loss_final", "retrieval_r1"):
        assert isinstance(pretrain[key], float), key
    assert pretrain["heldout_caption_loss_final"] < pretrain["heldout_caption_loss_initial"]
    for key in ("vqa_exact_match", "vqa_majority_baseline", "padding_efficiency", "ece"):
        assert isinstance(sft[key], float), key
    # the training effects themselves are asserted on the demo preset (tests/e2e/test_demo.py): 8 steps here
    assert stages["reward_model"]["metrics"]["heldout_pairs"] > 0
    rl = stages["rl"]["metrics"]
    assert rl["algorithm"] == "ppo" and rl["steps"] >= 1
    for key in (
        "efficacy_before",
        "efficacy_after",
        "mean_length_ratio",
        "kl_final",
        "seconds_generation",
        "seconds_update",
    ):
        assert isinstance(rl[key], float), key
    distill = stages["distill"]["metrics"]
    assert distill["student_param_ratio"] < 0.5 and distill["heldout_kl_final"] < distill["heldout_kl_init"]
    from transformers import AutoModelForImageTextToText, AutoProcessor

    for stage in ("pretrain", "sft", "rl", "distill"):
        path = stages[stage]["artifacts"]["model"]
        assert AutoModelForImageTextToText.from_pretrained(path).config.model_type == "qwen2_5_vl"
        AutoProcessor.from_pretrained(path)


def test_one_parent_mlflow_run_with_nested_stage_runs(summary):
    data, _ = summary
    mlflow.set_tracking_uri(data["mlflow_tracking_uri"])
    client = MlflowClient()
    parent = client.get_run(data["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{data['mlflow_run_id']}'"
    )
    names = {run.data.tags.get("qvl.stage") for run in children}
    assert {
        "preflight",
        "clean_data",
        "extract_features",
        "pretrain",
        "sft",
        "reward_model",
        "rl",
        "distill",
        "select_checkpoint",
    } <= names
    clean = next(r for r in children if r.data.tags.get("qvl.stage") == "clean_data")
    assert clean.data.metrics["records_in"] == data["stages"]["clean_data"]["metrics"]["records_in"]
    assert "report.html" in {a.path for a in client.list_artifacts(parent.info.run_id)}  # the run's page
    sft = next(r for r in children if r.data.tags.get("qvl.stage") == "sft")
    assert "report.md" in {a.path for a in client.list_artifacts(sft.info.run_id)}  # each stage's page


def test_a_rerun_with_unchanged_inputs_reuses_every_stage(summary, world):
    first, out = summary
    console = _qvl_run(world, out)
    second = json.loads((out / "run_summary.json").read_text())
    assert second["status"] == "succeeded"
    assert second["stages"]["preflight"]["status"] == "succeeded"  # never cached
    for stage in (
        "clean_data",
        "extract_features",
        "pretrain",
        "sft",
        "reward_model",
        "rl",
        "distill",
        "select_checkpoint",
    ):
        assert second["stages"][stage]["status"] == "cached", stage
        assert [line for line in console.splitlines() if line.split()[1:3] == [stage, "cached"]], stage
        assert second["stages"][stage]["metrics"] == first["stages"][stage]["metrics"]
        assert second["stages"][stage]["artifacts"] == first["stages"][stage]["artifacts"]


def test_select_checkpoint_registers_a_champion_that_loads_from_the_registry(summary):
    data, _ = summary
    select = data["stages"]["select_checkpoint"]["metrics"]
    assert select["selected_candidate"].split("@")[0] in ("pretrain", "sft", "rl", "distill")
    assert isinstance(select["selected_score"], float)
    assert select["registered_model"] == "qvl-tiny" and select["registered_version"] == "1"
    from transformers import AutoModelForImageTextToText, AutoProcessor

    mlflow.set_tracking_uri(data["mlflow_tracking_uri"])
    local = mlflow.artifacts.download_artifacts(artifact_uri="models:/qvl-tiny@champion")
    assert AutoModelForImageTextToText.from_pretrained(local).config.model_type == "qwen2_5_vl"
    AutoProcessor.from_pretrained(local)
    assert "## Data lineage" in (Path(local) / "README.md").read_text()


def test_a_changed_sft_config_reruns_sft_and_what_follows_only(summary, world, tmp_path):
    first, out = summary
    preset = tmp_path / "tiny-sft-seed.yaml"
    from pipelines.presets import PRESET_DIR

    preset.write_text(f"extends: {PRESET_DIR / 'tiny.yaml'}\nsft: {{seed: 1}}\n")
    _qvl_run(world, out, preset=str(preset))
    third = json.loads((out / "run_summary.json").read_text())
    assert third["status"] == "succeeded"
    for stage in ("clean_data", "extract_features", "pretrain"):
        assert third["stages"][stage]["status"] == "cached", stage
    for stage in ("sft", "reward_model", "rl", "distill", "select_checkpoint"):
        assert third["stages"][stage]["status"] == "succeeded", stage
    assert third["stages"]["sft"]["artifacts"] != first["stages"]["sft"]["artifacts"]


def test_the_champion_is_promoted_as_bf16_safetensors_with_a_serving_manifest(summary):
    """promote (on in the tiny preset): what select_checkpoint registered, as bf16 safetensors that load with the
    Auto classes, and the KServe InferenceService pointing at them (no registry address here: not registered)."""
    import torch
    import yaml
    from transformers import AutoModelForImageTextToText

    stages = summary[0]["stages"]
    metrics, out = stages["promote"]["metrics"], Path(stages["promote"]["artifacts"]["output"])
    assert metrics["registered"] == 0 and metrics["promoted_files"] >= 4
    model_dir = Path(stages["promote"]["artifacts"]["model"])
    assert sorted(p.suffix for p in model_dir.glob("*.safetensors")) and not list(model_dir.glob("*.bin"))
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    manifest = yaml.safe_load((out / "inferenceservice.yaml").read_text())
    assert manifest["kind"] == "InferenceService" and manifest["metadata"]["name"] == "qvl-tiny"
    assert manifest["spec"]["predictor"]["model"]["storageUri"].endswith("/model")
