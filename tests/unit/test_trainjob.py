"""The multi-node launcher against a fake Kubernetes API on loopback and a real S3 server: the TrainJob it
creates, success (outputs fetched, metrics returned), job failure (the task fails with the job's reason),
timeout, and cleanup in every case; plus the stage command line it sends, run for real."""

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from components._shared.launch.plan import LAUNCH_PLAN_ENV, LaunchPlan, plan_from_env
from components._shared.launch.trainjob import TrainJobFailed, run_trainjob
from components._shared.platform import storage
from tests.fake_k8s_api import FakeKubernetesApi, FakeTrainerStatusServer

SENTINEL = "sentinel-secret-4c1d"


def _plan(s3_env, **over) -> LaunchPlan:
    base = dict(
        stage="sft",
        nodes=2,
        gpus_per_node=8,
        image="ghcr.io/qwen-vl-pipeline/train:0.1.0",
        cpu="96",
        memory="1000Gi",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        shm_size="64Gi",
        scratch_pvc="qvl-scratch",
        secrets={
            "qvl-s3-credentials": ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"],
            "qvl-mlflow": ["MLFLOW_TRACKING_URI"],
        },
        labels={"qvl.stage": "sft"},
        staging_uri=f"{s3_env.uri}/trainjobs",
        namespace="qvl",
        poll_s=0.01,
        timeout_s=3600,
    )
    base.update(over)
    return LaunchPlan(**base)


def _args(job: dict) -> dict[str, str]:
    args = job["spec"]["trainer"]["args"]
    return {args[i]: args[i + 1] for i in range(2, len(args) - 1, 2)}  # after "-m components.X"


def _publish_result(job: dict, tmp_path: Path, metrics: dict) -> None:
    """What rank 0 of the job does at the end: write the stage's outputs and publish them to --output-dir."""
    out = tmp_path / "pod-output"
    (out / "model").mkdir(parents=True)
    (out / "model" / "weights.bin").write_bytes(b"weights")
    (out / "_stage_result.json").write_text(json.dumps({"stage": "sft", "status": "succeeded", "metrics": metrics}))
    storage.publish_dir(out, _args(job)["--output-dir"])


@pytest.fixture
def inputs(tmp_path, s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY_SENTINEL_CHECK", SENTINEL)
    base = tmp_path / "kfp-input-model"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    return {"base_model": str(base), "data": f"{s3_env.uri}/data"}


def test_a_successful_job_returns_the_stage_metrics_and_outputs_and_is_deleted(s3_env, inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("QVL_POD_NAME", "vlm-training-abc-sft-driver")
    monkeypatch.setenv("QVL_POD_UID", "6f1c2d3e-0000-4000-8000-000000000001")
    seen = {}

    def work(job):
        seen["job"] = job
        staged = _args(job)["--base-model"]
        seen["staged_config"] = storage.read_bytes(storage.join(staged, "config.json"))
        _publish_result(job, tmp_path, {"vqa_exact_match": 0.61})

    logged: list[str] = []
    with FakeKubernetesApi(on_create=work) as api:
        metrics = run_trainjob(
            _plan(s3_env),
            {"mode": "lora", "train": {"steps": 3}},
            inputs=inputs,
            output_dir=str(tmp_path / "task-output"),
            experiment="vlm",
            client_configuration=api.configuration(),
            log=logged.append,
        )
    assert metrics == {"vqa_exact_match": 0.61}
    assert (tmp_path / "task-output/model/weights.bin").read_bytes() == b"weights"
    job = seen["job"]
    name = job["metadata"]["name"]
    assert api.deleted == [name]
    assert any("rank 0: done" in line for line in logged), logged
    # owned by the task's pod, so Kubernetes deletes the job if the pod goes first
    assert api.jobs[name]["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "vlm-training-abc-sft-driver",
            "uid": "6f1c2d3e-0000-4000-8000-000000000001",
            "blockOwnerDeletion": False,
        }
    ]
    # the job: runtime, nodes, resources, same image, the stage's command line under torchrun
    spec = job["spec"]
    assert (
        spec["runtimeRef"]
        == {"name": "torch-distributed", "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"}
        or spec["runtimeRef"]["name"] == "torch-distributed"
    )
    trainer = spec["trainer"]
    assert trainer["numNodes"] == 2 and trainer["image"] == "ghcr.io/qwen-vl-pipeline/train:0.1.0"
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert trainer["command"] == ["torchrun"] and trainer["args"][:2] == ["-m", "components.sft"]
    args = _args(job)
    assert json.loads(args["--config-json"]) == {"mode": "lora", "train": {"steps": 3}}
    assert args["--data"] == f"{s3_env.uri}/data"  # s3:// inputs pass through
    assert args["--base-model"].startswith(f"{s3_env.uri}/trainjobs/{name}/inputs/")  # local ones are staged
    assert seen["staged_config"] == b'{"model_type": "qwen2_5_vl"}'
    assert {"name": "QVL_LAUNCHED", "value": "1"} in trainer["env"]
    # pod settings through the runtime patch: placement, volumes, secrets by reference only
    pod = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = pod["containers"][0]["env"]
    assert {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "qvl-s3-credentials", "key": "AWS_SECRET_ACCESS_KEY", "optional": True}},
    } in env
    posted = json.dumps([r.body for r in api.requests if r.method == "POST"])
    assert s3_env.server.env()["AWS_SECRET_ACCESS_KEY"] not in posted and SENTINEL not in posted


RANK_0 = textwrap.dedent(
    """
    import time
    from components._shared.platform import progress, trainjob_status

    def wait_for_send(after):  # steps go on until the reporter posted again, however slow this machine is today
        deadline = time.monotonic() + 60
        while trainjob_status._reporter._sent_at <= after and time.monotonic() < deadline:
            time.sleep(0.05)
        return trainjob_status._reporter._sent_at

    with progress.stage_scope("sft"):  # what `execute` does around the stage; TrainLoop reports every step
        progress.update("train", 1, 8, "steps", loss=2.0)
        sent = wait_for_send(-trainjob_status.MIN_INTERVAL_S)  # the reporter's "never sent"
        for step in range(2, 8):
            progress.update("train", step, 8, "steps", loss=2.0 / step)
            time.sleep(0.2)
        wait_for_send(sent)  # the newest of steps 2-7 goes out once the 5 s interval has passed
        progress.update("train", 8, 8, "steps", loss=0.25)
    """
)


def test_progress_reported_by_the_jobs_rank_0_reaches_the_job_status_and_the_task_log(s3_env, inputs, tmp_path):
    """Rank 0 of the job (a real process with what Trainer's controller injects: the status URL, its CA and a
    token) reports through progress.update; Trainer's status server (HTTPS, token checked) stores it on the
    TrainJob; the launcher, polling the job, logs each new report."""
    pods: dict[str, subprocess.Popen] = {}

    def state_of(name: str) -> str:
        return "Running" if pods[name].poll() is None else "Complete"

    logged: list[str] = []
    with FakeKubernetesApi(state_of=state_of) as api, FakeTrainerStatusServer(api, tmp_path) as server:

        def work(job):
            name = job["metadata"]["name"]
            env = {**os.environ, **server.env("qvl", name), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
            pods[name] = subprocess.Popen([sys.executable, "-c", RANK_0], env=env)
            _publish_result(job, tmp_path, {"vqa_exact_match": 0.5})

        api.on_create = work
        run_trainjob(
            _plan(s3_env, poll_s=0.2),
            {"mode": "lora"},
            inputs=inputs,
            output_dir=str(tmp_path / "task-output"),
            experiment="vlm",
            client_configuration=api.configuration(),
            log=logged.append,
        )
    (name,) = pods
    assert pods[name].returncode == 0
    assert len(server.posts) >= 3, server.posts  # the first step, one >= 5 s later, and 100% at the end
    first, final = server.posts[0], api.trainer_status[name]
    assert first["progressPercentage"] == 12 and first["estimatedRemainingSeconds"] >= 0
    metrics = {m["name"]: m["value"] for m in first["metrics"]}
    assert metrics == {"stage": "sft", "phase": "train", "current_step": "1", "total_steps": "8", "loss": "2.0"}
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    progress = [line for line in logged if line.startswith(f"[trainjob] {name}: ") and "%" in line]
    assert (
        progress[0] == f"[trainjob] {name}: 12% · train 1/8 · loss 2.0 · ~{first['estimatedRemainingSeconds']} s left"
    )
    assert len(progress) == len(server.posts) and progress[-1].startswith(f"[trainjob] {name}: 100%")


def test_a_failed_job_fails_the_task_with_the_jobs_reason_and_is_deleted(s3_env, inputs, tmp_path):
    states = ["Created", "Running", ("Failed", "PodFailed", "node-1 exited with code 1: CUDA out of memory")]
    with FakeKubernetesApi(states=states) as api:
        with pytest.raises(
            TrainJobFailed,
            match=r"qvl/qvl-sft-\w+ \(sft\) failed: PodFailed: node-1 exited with "
            r"code 1: CUDA out of memory",
        ):
            run_trainjob(
                _plan(s3_env),
                {},
                inputs=inputs,
                output_dir=str(tmp_path / "out"),
                experiment="vlm",
                client_configuration=api.configuration(),
                log=lambda line: None,
            )
    assert len(api.deleted) == 1 and api.deleted == list(api.jobs)
    assert not (tmp_path / "out").exists()


def test_a_job_past_its_timeout_fails_the_task_and_is_deleted(s3_env, inputs, tmp_path):
    now = [0.0]

    def clock():
        now[0] += 100.0  # every poll: 100 s later
        return now[0]

    with FakeKubernetesApi(states=["Created", "Running"]) as api:
        with pytest.raises(TimeoutError, match=r"did not finish in 600 s \(kubernetes.trainjob.timeout_s\)"):
            run_trainjob(
                _plan(s3_env, timeout_s=600),
                {},
                inputs=inputs,
                output_dir=str(tmp_path / "out"),
                experiment="vlm",
                client_configuration=api.configuration(),
                log=lambda line: None,
                clock=clock,
            )
    assert api.deleted == list(api.jobs)
    # polled until the deadline, not once and not forever (two GETs a poll: the SDK's state, then the progress)
    assert 8 <= api.polls[api.deleted[0]] <= 16


def test_a_task_stopped_by_sigterm_deletes_its_job(s3_env, inputs, tmp_path):
    import os
    import signal
    import threading

    before = signal.getsignal(signal.SIGTERM)
    with FakeKubernetesApi(states=["Created", "Running"]) as api:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(SystemExit, match="stopped by signal 15; deleting the TrainJob"):
            run_trainjob(
                _plan(s3_env, poll_s=0.05),
                {},
                inputs=inputs,
                output_dir=str(tmp_path / "out"),
                experiment="vlm",
                client_configuration=api.configuration(),
                log=lambda line: None,
            )
    assert api.deleted == list(api.jobs) and len(api.deleted) == 1
    assert signal.getsignal(signal.SIGTERM) is before  # the task's own handler is back


def test_a_completed_job_without_published_outputs_fails_and_is_still_deleted(s3_env, inputs, tmp_path):
    with FakeKubernetesApi() as api:
        with pytest.raises(Exception, match="output"):
            run_trainjob(
                _plan(s3_env),
                {},
                inputs=inputs,
                output_dir=str(tmp_path / "out"),
                experiment="vlm",
                client_configuration=api.configuration(),
                log=lambda line: None,
            )
    assert api.deleted == list(api.jobs)


def test_a_missing_runtime_or_staging_prefix_is_a_clear_error(s3_env, inputs, tmp_path):
    with pytest.raises(ValueError, match="staging_uri"):
        run_trainjob(
            _plan(s3_env, staging_uri="/tmp/staging"), {}, inputs=inputs, output_dir=str(tmp_path), experiment="vlm"
        )
    with FakeKubernetesApi() as api:
        with pytest.raises(Exception, match="qvl-torch-distributed"):
            run_trainjob(
                _plan(s3_env, runtime="qvl-torch-distributed"),
                {},
                inputs=inputs,
                output_dir=str(tmp_path / "out"),
                experiment="vlm",
                client_configuration=api.configuration(),
                log=lambda line: None,
            )
    assert not api.jobs  # nothing was created


def test_launch_plans_are_read_from_the_environment_and_validated():
    plan = LaunchPlan(stage="sft", nodes=1, gpus_per_node=4, image="img:1").model_dump_json()
    assert plan_from_env({LAUNCH_PLAN_ENV: plan}).processes_per_node == 4
    assert plan_from_env({LAUNCH_PLAN_ENV: plan, "QVL_LAUNCHED": "1"}) is None  # the launched processes run it
    one = LaunchPlan(stage="sft", nodes=1, gpus_per_node=1, image="img:1").model_dump_json()
    assert plan_from_env({LAUNCH_PLAN_ENV: one}) is None
    with pytest.raises(ValueError, match="stage 'select_checkpoint' runs in one process"):
        one_process = LaunchPlan(stage="select_checkpoint", gpus_per_node=8, image="i:1")
        plan_from_env({LAUNCH_PLAN_ENV: one_process.model_dump_json()})
    with pytest.raises(ValueError, match="QVL_LAUNCH_PLAN is not a valid launch plan"):
        plan_from_env({LAUNCH_PLAN_ENV: '{"stage": "sft", "gpus": 8}'})


def test_the_job_command_line_runs_the_stage_and_its_outputs_come_back_through_run_stage(s3_env, tmp_path, monkeypatch):
    """The pods' work done for real: the TrainJob's args run under python (one process) with the job's env,
    read the staged inputs from S3 and publish the outputs; run_stage returns the recorded metrics."""
    from components._shared.launch.runner import run_stage
    from components.synth_world.lake import write_splits

    data = tmp_path / "data"
    write_splits(data, seed=5, eval_per_type=2, sft_records=16, preference_pairs=2)
    config = {
        "mode": "lora",
        "min_pixels": 3136,
        "max_pixels": 12544,
        "max_records": 16,
        "train": {
            "steps": 2,
            "samples_per_step": 4,
            "max_tokens_per_micro_batch": 256,
            "threads": 1,
            "backend": "deepspeed",
            "zero_stage": 2,
        },
        "optim": {"lr": 0.01},
        "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 4},
        "calibration": {"enabled": False},
    }

    def pods(job):
        env = {e["name"]: e["value"] for e in job["spec"]["trainer"]["env"]}
        cmd = [sys.executable, *job["spec"]["trainer"]["args"]]
        done = subprocess.run(
            cmd,
            env={
                **__import__("os").environ,
                **env,
                "OMP_NUM_THREADS": "1",
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
            },
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{shlex.join(cmd)[:300]}\n{done.stderr[-3000:]}"

    with FakeKubernetesApi(on_create=pods) as api:
        plan = _plan(s3_env, gpus_per_node=0, namespace="qvl")
        monkeypatch.setenv(LAUNCH_PLAN_ENV, plan.model_dump_json())
        import components._shared.launch.trainjob as trainjob

        real = trainjob._trainer_client
        monkeypatch.setattr(trainjob, "_trainer_client", lambda p, cfg=None: real(p, api.configuration()))
        metrics = run_stage(
            "sft",
            config,
            experiment="vlm",
            inputs={"base_model": "builtin:tiny-qwen2_5-vl", "data": str(data)},
            output_dir=str(tmp_path / "task-out"),
            record_as="sft",
        )
    assert metrics["trainable_parameters"] > 0 and "vqa_exact_match" in metrics
    assert (tmp_path / "task-out/model/config.json").exists()
    assert storage.is_committed(tmp_path / "task-out")
    assert api.deleted == list(api.jobs)
