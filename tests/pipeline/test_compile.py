"""The compiled pipeline: stage order, Kubernetes settings, no secrets, and the committed YAML is current."""

import re

import pytest
import yaml

from pipelines.compile import COMPILED, compile_pipeline

SENTINEL = "sentinel-secret-value-4f1c"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[dict, dict, str]:
    out = tmp_path_factory.mktemp("compiled") / "vlm_training.yaml"
    with pytest.MonkeyPatch.context() as mp:
        # Credentials present in the compiling environment must not leak into the YAML.
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"):
            mp.setenv(var, SENTINEL)
        mp.delenv("QVL_IMAGE_REGISTRY", raising=False)
        compile_pipeline("prod-7b", out)
    text = out.read_text()
    docs = list(yaml.safe_load_all(text))
    return docs[0], (docs[1] if len(docs) > 1 else {}), text


def _normalize(text: str) -> list:
    """Parsed documents without the SDK version (the header comment's dict order is not stable)."""
    text = re.sub(r"kfp==[0-9.]+", "kfp==X", re.sub(r"sdkVersion: kfp-[0-9.]+", "sdkVersion: X", text))
    return list(yaml.safe_load_all(text))


def _tasks(spec: dict) -> dict:
    """The stage tasks: inside the exit handler's sub-DAG on a cluster build (its exit task ends the MLflow run)."""
    root = spec["root"]["dag"]["tasks"]
    return spec["components"]["comp-exit-handler-1"]["dag"]["tasks"] if "exit-handler-1" in root else root


def test_a_cluster_build_ends_its_mlflow_run_in_an_exit_task_and_sets_run_ttls(compiled):
    spec, platform, _ = compiled
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "finish-pipeline-run-op"}
    finish = root["finish-pipeline-run-op"]
    assert finish["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert finish["inputs"]["parameters"]["status"]["taskFinalStatus"]["producerTask"] == "exit-handler-1"
    assert finish["cachingOptions"] == {}  # never cached: it ends this run's parent
    assert platform["platforms"]["kubernetes"]["pipelineConfig"] == {
        "resourceTtlOnSuccess": 86400,
        "resourceTtlOnFailure": 604800,
        "activeDeadlineSeconds": 604800,
    }


def test_committed_yaml_is_current(compiled):
    assert COMPILED.exists(), "Run `qvl compile` and commit pipelines/compiled/vlm_training.yaml."
    assert _normalize(compiled[2]) == _normalize(COMPILED.read_text()), (
        "pipelines/compiled/vlm_training.yaml is stale: run `qvl compile` and commit it."
    )


def test_stage_order(compiled):
    tasks = _tasks(compiled[0])
    assert "preflight-op" in tasks["list-shards-op"]["dependentTasks"]
    # The fan-out lives in a ParallelFor sub-DAG; the merge collects from it.
    loops = [name for name, task in tasks.items() if name.startswith("for-loop")]
    assert len(loops) == 1
    assert loops[0] in tasks["merge-shards-op"]["dependentTasks"]
    assert "merge-shards-op" in tasks["extract-features-op"]["dependentTasks"]
    assert {"merge-shards-op", "extract-features-op"} <= set(tasks["pretrain-op"]["dependentTasks"])
    # every stage also takes preflight's content key for what it reads by URI (part of its cache key)
    assert sorted(tasks["sft-op"]["dependentTasks"]) == ["preflight-op", "pretrain-op"]
    assert sorted(tasks["reward-model-op"]["dependentTasks"]) == ["preflight-op", "sft-op"]
    assert tasks["sft-op"]["inputs"]["parameters"]["content_key"]["taskOutputParameter"] == {
        "outputParameterKey": "sft",
        "producerTask": "preflight-op",
    }


@pytest.mark.parametrize(
    "op, gpus, retries",
    [
        ("extract-features-op", 1, 2),
        ("sft-op", 8, 3),
        ("reward-model-op", 8, 3),
        ("rl-op", 8, 3),
        ("distill-op", 8, 3),
        ("select-checkpoint-op", 1, 2),
    ],
)
def test_model_stages_request_their_gpus_shm_and_retries(compiled, op, gpus, retries):
    spec, platform, _ = compiled
    executor = spec["deploymentSpec"]["executors"][f"exec-{op}"]["container"]
    assert executor["resources"]["accelerator"]["resourceCount"] == str(gpus)
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"][f"exec-{op}"]
    assert k8s["emptyDirMounts"][0]["mountPath"] == "/dev/shm"
    assert _tasks(spec)[op]["retryPolicy"]["maxRetryCount"] == retries


def test_stage_configs_are_pipeline_parameters_with_the_preset_defaults(compiled):
    from pipelines.presets import load_preset

    params = compiled[0]["root"]["inputDefinitions"]["parameters"]
    preset = load_preset("prod-7b")
    for stage in ("pretrain", "sft", "reward_model", "rl", "distill"):
        assert params[f"{stage}_config"]["defaultValue"] == preset.stages[stage]
    assert preset.stages["sft"]["lora"]["r"] == 64


def test_preflight_is_never_cached(compiled):
    assert _tasks(compiled[0])["preflight-op"]["cachingOptions"] == {}


def test_extract_features_requests_a_gpu_and_shm(compiled):
    spec, platform, _ = compiled
    executor = spec["deploymentSpec"]["executors"]["exec-extract-features-op"]["container"]
    assert executor["resources"]["accelerator"]["resourceCount"] == "1"
    assert executor["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-extract-features-op"]
    assert k8s["emptyDirMounts"][0]["mountPath"] == "/dev/shm"
    assert any(t["key"] == "nvidia.com/gpu" for t in k8s["tolerations"])


def test_credentials_come_from_kubernetes_secrets_only(compiled):
    spec, platform, text = compiled
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, executor in k8s.items():
        secret_names = {
            s.get("secretName") or s.get("secretNameParameter", {}).get("runtimeValue", {}).get("constant")
            for s in executor.get("secretAsEnv", [])
        }
        assert "qvl-s3-credentials" in secret_names, name
        mlflow = [s for s in executor["secretAsEnv"] if s.get("secretName") == "qvl-mlflow"]
        assert len(mlflow) == 1 and mlflow[0]["optional"] is True, name  # each key optional: auth is the server's
        assert {k["secretKey"] for k in mlflow[0]["keyToEnv"]} == {
            "MLFLOW_TRACKING_URI",
            "MLFLOW_TRACKING_TOKEN",
            "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD",
        }, name
    assert SENTINEL not in text
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert not any("secret" in p.lower() or "password" in p.lower() for p in params)


def test_images_are_pinned_to_the_package_version(compiled):
    from components import __version__

    for name, executor in compiled[0]["deploymentSpec"]["executors"].items():
        image = executor["container"]["image"]
        assert image.endswith(f":{__version__}"), (name, image)


def test_a_preset_can_extend_another_and_change_only_some_settings(tmp_path):
    from pipelines.presets import load_preset

    demo, ter = load_preset("demo"), load_preset("demo-ter")
    assert demo.stages["rl"]["algorithm"] == "ppo" and ter.stages["rl"]["algorithm"] == "ter"
    assert ter.stages["sft"] == demo.stages["sft"] and ter.base_model_uri == demo.base_model_uri
    (tmp_path / "a.yaml").write_text("extends: b\nbase_model_uri: builtin:tiny-qwen2_5-vl\n")
    (tmp_path / "b.yaml").write_text("extends: a\n")
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        load_preset(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: missing\n")
    with pytest.raises(ValueError, match="extends 'missing'"):
        load_preset(tmp_path / "c.yaml")
    (tmp_path / "mine.yaml").write_text("extends: tiny\nsft: {mode: full}\n")  # a project preset, from anywhere
    mine = load_preset(tmp_path / "mine.yaml")
    assert mine.stages["sft"]["mode"] == "full" and mine.stages["rl"] == load_preset("tiny").stages["rl"]


@pytest.mark.parametrize("preset", ["prod-qwen3-vl-8b", "prod-qwen3.5-9b"])
def test_the_newer_families_prod_presets_compile_to_their_committed_yaml_and_fit_their_gpus(preset, tmp_path):
    """Golden like prod-7b's, and `qvl plan` says every training stage fits the profile's GPUs."""
    from pipelines.qvl.memory_plan import plan, refusals

    committed = COMPILED.parent / f"vlm_training-{preset}.yaml"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QVL_IMAGE_REGISTRY", raising=False)
        out = compile_pipeline(preset, tmp_path / "p.yaml")
    assert _normalize(out.read_text()) == _normalize(committed.read_text()), (
        f"{committed} is stale: run `qvl compile --preset {preset} --out {committed}` and commit it."
    )
    name, plans = plan(preset)
    assert name in ("qwen3-vl-8b", "qwen3.5-9b") and refusals(plans) == []
    spec = _normalize(committed.read_text())[0]
    defaults = spec["root"]["inputDefinitions"]["parameters"]["clean_data_config"]["defaultValue"]
    assert defaults["patch_size"] == 16
