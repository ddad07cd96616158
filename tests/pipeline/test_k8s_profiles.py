"""Cluster profiles: what the compiled YAML carries per stage (prod-7b), strict parsing into KFP's protos, launch
plans for multi-GPU and multi-node stages, and profile mistakes rejected with the setting's name."""

import json
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format

from pipelines.compile import compile_pipeline
from pipelines.presets import load_preset

GPU_OPS = ["extract-features-op", "sft-op", "reward-model-op", "rl-op", "distill-op", "select-checkpoint-op"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("k8s") / "vlm.yaml"
    compile_pipeline("prod-7b", out)
    spec, platform = list(yaml.safe_load_all(out.read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _env(spec, op) -> dict[str, str]:
    container = spec["deploymentSpec"]["executors"][f"exec-{op}"]["container"]
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_compiled_yaml_parses_strictly_into_the_pipeline_and_kubernetes_protos(compiled, tmp_path):
    from kfp.kubernetes import kubernetes_executor_config_pb2
    from kfp.pipeline_spec import pipeline_spec_pb2

    spec, executors = compiled
    json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec(), ignore_unknown_fields=False)
    for config in executors.values():
        json_format.ParseDict(
            config, kubernetes_executor_config_pb2.KubernetesExecutorConfig(), ignore_unknown_fields=False
        )
    with pytest.raises(json_format.ParseError):  # the strict parse does reject what the protos lack
        json_format.ParseDict(
            {**executors["exec-sft-op"], "priorityClassName": "qvl-training"},
            kubernetes_executor_config_pb2.KubernetesExecutorConfig(),
        )


@pytest.mark.parametrize("op", GPU_OPS)
def test_every_gpu_stage_carries_gpu_placement_volumes_and_secret_references(compiled, op):
    spec, executors = compiled
    k8s = executors[f"exec-{op}"]
    assert (
        spec["deploymentSpec"]["executors"][f"exec-{op}"]["container"]["resources"]["accelerator"]["resourceType"]
        == "nvidia.com/gpu"
    )
    assert k8s["nodeSelector"]["labels"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in k8s["tolerations"]
    assert k8s["emptyDirMounts"] == [
        {
            "volumeName": "dshm",
            "mountPath": "/dev/shm",
            "medium": "Memory",
            "sizeLimit": k8s["emptyDirMounts"][0]["sizeLimit"],
        }
    ]
    assert k8s["pvcMount"][0]["mountPath"] == "/scratch" and k8s["pvcMount"][0]["constant"] == "qvl-scratch"
    assert {s["secretName"] for s in k8s["secretAsEnv"]} == {"qvl-s3-credentials", "qvl-mlflow"}
    assert k8s["securityContext"]["runAsNonRoot"] is True
    assert k8s["podMetadata"]["labels"]["app.kubernetes.io/part-of"] == "qwen-vl-pipeline"
    assert _env(spec, op)["QVL_CACHE_DIR"] == "/scratch/qvl-cache"


def test_a_multi_gpu_stage_gets_a_torchrun_plan_and_a_multi_node_stage_a_small_launcher_pod(compiled):
    spec, executors = compiled
    sft = json.loads(_env(spec, "sft-op")["QVL_LAUNCH_PLAN"])
    assert (sft["nodes"], sft["gpus_per_node"], sft["image"]) == (1, 8, "ghcr.io/qwen-vl-pipeline/train:0.1.0")
    rl = json.loads(_env(spec, "rl-op")["QVL_LAUNCH_PLAN"])  # rl shards its rollouts over the pod's 8 GPUs too
    assert (rl["nodes"], rl["gpus_per_node"]) == (1, 8)
    assert "QVL_LAUNCH_PLAN" not in _env(spec, "select-checkpoint-op")  # one process
    pretrain = spec["deploymentSpec"]["executors"]["exec-pretrain-op"]["container"]
    assert "accelerator" not in pretrain["resources"]  # the TrainJob's pods hold the GPUs, not the watcher
    assert pretrain["resources"]["resourceCpuRequest"] == "2"
    plan = json.loads(_env(spec, "pretrain-op")["QVL_LAUNCH_PLAN"])
    assert (plan["nodes"], plan["gpus_per_node"], plan["runtime"]) == (2, 8, "qvl-torch-distributed")
    assert plan["staging_uri"] == "s3://qvl-checkpoints/trainjobs" and plan["shm_size"] == "64Gi"
    assert plan["secrets"]["qvl-s3-credentials"] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"]
    assert {"key": "dedicated", "operator": "Equal", "value": "gpu-training", "effect": "NoSchedule"} in plan[
        "tolerations"
    ]
    assert "nodeSelector" not in executors["exec-pretrain-op"]  # no GPU placement for the watcher pod
    # its pod's name and uid (downward API) make it the TrainJob's owner
    assert {f["name"]: f["fieldPath"] for f in executors["exec-pretrain-op"]["fieldPathAsEnv"]} == {
        "QVL_POD_NAME": "metadata.name",
        "QVL_POD_UID": "metadata.uid",
        "QVL_KFP_RUN_ID": "metadata.labels['pipeline/runid']",
    }


def test_every_task_knows_its_kfp_run_and_task_name_outside_its_cache_key(compiled):
    """The run id comes from the label KFP's API server puts on every pod of a run (downward API), the task name is
    a constant: neither is a task input, so caching still matches across runs; system metrics every 10 s."""
    spec, executors = compiled
    for name, executor in spec["deploymentSpec"]["executors"].items():
        fields = {f["name"]: f["fieldPath"] for f in executors[name].get("fieldPathAsEnv", [])}
        assert fields["QVL_KFP_RUN_ID"] == "metadata.labels['pipeline/runid']", name
        env = {e["name"]: e["value"] for e in executor["container"]["env"]}
        assert env["QVL_SYSTEM_METRICS_S"] == "10", name
        assert env["QVL_KFP_TASK"] == name.removeprefix("exec-"), name
    for task in spec["components"]["comp-exit-handler-1"]["dag"]["tasks"].values():
        assert not any("runid" in json.dumps(value) for value in task.get("inputs", {}).get("parameters", {}).values())


def test_cpu_stages_stay_on_cpu_pods_and_preflight_is_never_cached(compiled):
    spec, executors = compiled
    for op in ("preflight-op", "list-shards-op", "clean-shard-op", "merge-shards-op"):
        assert "accelerator" not in spec["deploymentSpec"]["executors"][f"exec-{op}"]["container"]["resources"]
        assert "tolerations" not in executors[f"exec-{op}"]
    assert spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["preflight-op"]["cachingOptions"] == {}


def test_local_runs_get_no_pod_settings_and_no_retries(tmp_path):  # a failure fails again (ninth pass RG01)
    from kfp import compiler

    from pipelines.vlm_training import build_pipeline

    out = tmp_path / "local.yaml"
    compiler.Compiler().compile(build_pipeline("prod-7b", for_cluster=False), str(out))
    docs = list(yaml.safe_load_all(out.read_text()))
    assert len(docs) == 1  # no kubernetes platform spec
    env = docs[0]["deploymentSpec"]["executors"]["exec-sft-op"]["container"]["env"]
    assert env == [{"name": "QVL_KFP_TASK", "value": "sft-op"}]  # no scratch paths, no launch plan
    assert "retryPolicy" not in docs[0]["root"]["dag"]["tasks"]["sft-op"]  # the cluster's: 3 (test_compile)
    assert "finish-pipeline-run-op" not in docs[0]["root"]["dag"]["tasks"]  # `qvl run --local` ends its own run


@pytest.mark.parametrize(
    "section, message",
    [
        ({"stages": {"preflight": {"gpus": 1}}}, r"kubernetes.stages.preflight.gpus: preflight runs on the CPU image"),
        (
            {"stages": {"select_checkpoint": {"gpus": 8}}},
            r"kubernetes.stages.select_checkpoint: select_checkpoint runs in one process, so 8 GPUs would sit idle",
        ),
        (
            {"stages": {"sft": {"nodes": 2, "gpus": 8}}},
            r"kubernetes.stages.sft.nodes: .*set kubernetes.trainjob.staging_uri",
        ),
        ({"stages": {"sfx": {"gpus": 1}}}, r"unknown stage\(s\) \['sfx'\]"),
        ({"stages": {"sft": {"gpu": 1}}}, r"sft.gpu: unknown setting; did you mean kubernetes.stages.sft.gpus\?"),
        ({"stages": {"sft": {"gpus": 8}}}, r"sft.train.backend: sft on several GPUs or nodes needs backend: deepspeed"),
        # values Kubernetes (or kfp, in words naming no setting) would refuse after the preset compiled
        ({"stages": {"sft": {"gpus": True}}}, r"kubernetes.stages.sft.gpus: .*true is a boolean where a number"),
        ({"stages": {"sft": {"labels": {"team name": "a"}}}}, r"stages.sft.labels: .*'team name' is not a label"),
        ({"stages": {"sft": {"node_selector": {"pool": "gpu pool"}}}}, r"node_selector: .*'gpu pool' is not a label v"),
        ({"scratch_pvc": "QVL-Scratch"}, r"kubernetes.scratch_pvc: .*'QVL-Scratch' is not a Kubernetes object name"),
        ({"s3_secret": ""}, r"kubernetes.s3_secret: .*'' is not a Kubernetes object name"),
        ({"image_pull_secrets": ["regcred", "Reg Cred"]}, r"kubernetes.image_pull_secrets: .*'Reg Cred' is not a"),
        ({"stages": {"sft": {"memory_limit": "32Gi"}}}, r"stages.sft: .*memory_limit 32Gi is below the request memory"),
        ({"stages": {"sft": {"cpu": "4", "cpu_limit": "500m"}}}, r"stages.sft: .*cpu_limit 500m is below the request"),
        ({"stages": {"sft": {"cpu": "two"}}}, r"kubernetes.stages.sft.cpu: .*'two' is not a CPU quantity"),
        ({"stages": {"sft": {"memory": "1.5Gi"}}}, r"kubernetes.stages.sft.memory: .*'1.5Gi' is not a memory quantity"),
        ({"stages": {"sft": {"backoff": "soon"}}}, r"kubernetes.stages.sft.backoff: .*'soon' is not a duration"),
        ({"scratch_mount_path": "scratch"}, r"kubernetes.scratch_mount_path: .*not a mount path"),
    ],
)
def test_profile_mistakes_are_rejected_naming_the_setting(section, message):
    with pytest.raises(ValueError, match=message):
        load_preset("demo", overrides={"kubernetes": section})


def test_presets_without_a_kubernetes_section_get_one_gpu_per_model_stage():
    cluster = load_preset("demo").cluster_profile()
    assert cluster.stages["sft"].gpus == 1 and cluster.stages["clean_data"].gpus == 0
    assert cluster.stages["preflight"].caching is False


def test_the_values_kubernetes_accepts_pass_and_compile(tmp_path):
    """The other side of the checks above: prefixed keys, annotations with free text, millicores, power-of-two
    units, minutes and hours."""
    section = {
        "image_pull_secrets": ["regcred"],
        "stages": {
            "sft": {
                "labels": {"team.example.com/owner": "vision-lab", "cost_center": "r.d-42"},
                "annotations": {"example.com/note": "retrained nightly; ask #vision"},
                "node_selector": {"cloud.google.com/gke-nodepool": "a100-pool"},
                "cpu": "7500m",
                "cpu_limit": "8",
                "memory": "60000Mi",
                "memory_limit": "64Gi",
                "backoff": "2m",
                "backoff_max": "1h",
            }
        },
    }
    preset = load_preset("demo", overrides={"kubernetes": section})
    out = compile_pipeline(preset, tmp_path / "p.yaml")
    platform = list(yaml.safe_load_all(Path(out).read_text()))[1]
    sft = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-sft-op"]
    assert sft["podMetadata"]["labels"]["team.example.com/owner"] == "vision-lab"
    assert sft["nodeSelector"]["labels"]["cloud.google.com/gke-nodepool"] == "a100-pool"
