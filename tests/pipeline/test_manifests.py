"""Kustomize manifests (manifests/): each renders, each object validates offline, names and security hold.

Built-in kinds: kubernetes-validate --strict (unknown fields fail). Kubeflow Trainer CRDs: the typed models of
kubeflow_trainer_api (from_dict drops unknown keys silently: the round trip must give the input back), and
the pod templates inside them: kubernetes-validate again, wrapped as a batch/v1 Job.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pydantic
import pytest
import yaml
from kubeflow_trainer_api import models as trainer_models

K8S_VERSION = "1.32"  # a version kubernetes-validate ships schemas for
MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
KUSTOMIZATIONS = {
    "base": MANIFESTS / "base",
    "dev": MANIFESTS / "overlays/dev",
    "prod": MANIFESTS / "overlays/prod",
}
NAMESPACE = "qvl"
MLFLOW_URI = "http://mlflow.qvl.svc.cluster.local:5000"  # the one value a template may carry
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TYPED_MODELS = {
    (TRAINER_API, "TrainingRuntime"): trainer_models.TrainerV1alpha1TrainingRuntime,
    (TRAINER_API, "ClusterTrainingRuntime"): trainer_models.TrainerV1alpha1ClusterTrainingRuntime,
    (TRAINER_API, "TrainJob"): trainer_models.TrainerV1alpha1TrainJob,
}
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding", "ClusterTrainingRuntime"}
LAUNCHER_SA = {"kind": "ServiceAccount", "name": "default-editor", "namespace": NAMESPACE}


# ----------------------------------------------------- rendering, and the checks (each has a test that bites)


@functools.cache
def _render_text(name: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH: install kubectl (>= 1.31, kustomize is built in) to render manifests/.")
    proc = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZATIONS[name])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode:
        pytest.fail(f"kubectl kustomize {KUSTOMIZATIONS[name]} failed:\n{proc.stderr}")
    return proc.stdout


def render(name: str) -> list[dict]:
    """The objects of one kustomization (a fresh copy: tests may not share mutations)."""
    return [doc for doc in yaml.safe_load_all(_render_text(name)) if doc]


def ident(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('namespace', '-')}/{meta.get('name')}"


def find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} named {name}, found {len(hits)}"
    return hits[0]


def _differences(given, back, path: str = "") -> list[str]:
    """Where the typed model's to_dict() differs from the input: dropped (unknown) keys and changed values."""
    if isinstance(given, dict) and isinstance(back, dict):
        out = [f"{path}.{k}: not in the schema (dropped)" for k in given if k not in back]
        out += [f"{path}.{k}: added by the model" for k in back if k not in given]
        for key in given.keys() & back.keys():
            out += _differences(given[key], back[key], f"{path}.{key}")
        return out
    if isinstance(given, list) and isinstance(back, list) and len(given) == len(back):
        return [d for i, (g, b) in enumerate(zip(given, back, strict=True)) for d in _differences(g, b, f"{path}[{i}]")]
    return [] if given == back else [f"{path}: {given!r} came back as {back!r}"]


def _validate_builtin(obj: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        raise AssertionError(
            f"{where}: no Kubernetes {K8S_VERSION} schema for {obj.get('apiVersion')} "
            f"{obj.get('kind')} (a CRD needs an entry in TYPED_MODELS)"
        ) from None
    except kubernetes_validate.ValidationError as err:
        at = ".".join(str(p) for p in err.path)
        raise AssertionError(f"{where}: {err.message} (at {at or 'top level'})") from None


def _validate_typed(obj: dict, model) -> None:
    try:
        parsed = model.from_dict(copy.deepcopy(obj))
    except pydantic.ValidationError as err:
        raise AssertionError(f"{ident(obj)}: {model.__name__} rejects it: {err}") from None
    problems = _differences(obj, parsed.to_dict())
    assert not problems, f"{ident(obj)} does not round-trip through {model.__name__}: " + "; ".join(problems)
    for rjob in ((obj.get("spec") or {}).get("template") or {}).get("spec", {}).get("replicatedJobs") or []:
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": rjob["name"]},
            "spec": rjob["template"]["spec"],
        }
        _validate_builtin(job, f"{ident(obj)} replicatedJobs[{rjob['name']}]")


def validate(obj: dict) -> None:
    """Raise AssertionError naming the object and the problem (CRDs: typed model; the rest: API schema)."""
    model = TYPED_MODELS.get((obj.get("apiVersion"), obj.get("kind")))
    if model is not None:
        _validate_typed(obj, model)
    else:
        _validate_builtin(obj, ident(obj))


def secret_problems(obj: dict) -> list[str]:
    """Templates only: every Secret value empty, except the in-cluster MLflow URI."""
    if obj.get("kind") != "Secret":
        return []
    values = {**(obj.get("data") or {}), **(obj.get("stringData") or {})}
    return [
        f"{ident(obj)}: {key} has a value in git"
        for key, value in values.items()
        if value
        and not (obj["metadata"]["name"] == "qvl-mlflow" and key == "MLFLOW_TRACKING_URI" and value == MLFLOW_URI)
    ]


def pod_specs(node, where: str = ""):
    """Every pod spec (a mapping with a `containers` list) anywhere in an object, with where it is."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield where, node
        for key, value in node.items():
            yield from pod_specs(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from pod_specs(value, f"{where}[{i}]")


def image_problem(image: str) -> str | None:
    ref, _, digest = image.partition("@")
    last = ref.rsplit("/", 1)[-1]
    tag = last.partition(":")[2]
    if not tag and not digest:
        return f"{image}: no tag (pin a version)"
    if tag == "latest":
        return f"{image}: :latest (pin a version)"
    return None


def container_problems(obj: dict) -> list[str]:
    """Pinned images; non-root (runAsNonRoot, uid != 0), no privilege escalation, all capabilities dropped."""
    problems = []
    for where, pod in pod_specs(obj):
        pod_sc = pod.get("securityContext") or {}
        for c in pod["containers"] + (pod.get("initContainers") or []):
            at = f"{ident(obj)}{where} container {c.get('name')}"
            sc = c.get("securityContext") or {}
            if problem := image_problem(c.get("image", "")):
                problems.append(f"{at}: {problem}")
            if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                problems.append(f"{at}: runAsNonRoot is not true")
            if sc.get("runAsUser", pod_sc.get("runAsUser")) in (0, None):
                problems.append(f"{at}: runAsUser is root or unset")
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{at}: allowPrivilegeEscalation is not false")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{at}: capabilities do not drop ALL")
    return problems


def allows(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r.get("verbs", [])
        for r in rules
    )


def mlflow_container(objs: list[dict]) -> dict:
    pod = find(objs, "Deployment", "mlflow")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "mlflow")


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


# ------------------------------------------------------------------------------------- every kustomization


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renders_and_every_object_validates(name):
    objs = render(name)
    assert objs, f"{name} rendered nothing"
    for obj in objs:
        validate(obj)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_namespaces(name):
    for obj in render(name):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert namespace is None, f"{ident(obj)} is cluster-scoped"
        else:
            assert namespace == NAMESPACE, (
                f"{ident(obj)} must be in namespace {NAMESPACE} (set `namespace:` in the kustomization)"
            )


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_secrets_are_templates_and_containers_are_hardened(name):
    objs = render(name)
    problems = [p for obj in objs for p in secret_problems(obj) + container_problems(obj)]
    assert not problems, "\n".join(problems)
    assert find(objs, "Secret", "qvl-mlflow")["stringData"] == {"MLFLOW_TRACKING_URI": MLFLOW_URI}
    s3 = find(objs, "Secret", "qvl-s3-credentials")["stringData"]
    assert set(s3) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_references_resolve(name):
    """Every secret (and key), claim and priority class a pod names is rendered alongside it."""
    objs = render(name)
    secrets = {
        o["metadata"]["name"]: {**(o.get("data") or {}), **(o.get("stringData") or {})}
        for o in objs
        if o["kind"] == "Secret"
    }
    claims = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}
    priorities = {o["metadata"]["name"] for o in objs if o["kind"] == "PriorityClass"}
    for obj in objs:
        for where, pod in pod_specs(obj):
            at = f"{ident(obj)}{where}"
            for vol in pod.get("volumes") or []:
                if "persistentVolumeClaim" in vol:
                    assert vol["persistentVolumeClaim"]["claimName"] in claims, f"{at}: volume {vol['name']}"
            if "priorityClassName" in pod:
                assert pod["priorityClassName"] in priorities, at
            for c in pod["containers"]:
                mounts = {m["name"] for m in c.get("volumeMounts") or []}
                assert mounts <= {v["name"] for v in pod.get("volumes") or []}, f"{at}: mounts without volumes"
                for e in c.get("env") or []:
                    ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                    if ref:
                        assert ref["key"] in secrets.get(ref["name"], {}), f"{at}: {e['name']} -> {ref}"
                for src in c.get("envFrom") or []:
                    if "secretRef" in src:
                        assert src["secretRef"]["name"] in secrets, f"{at}: envFrom {src}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_names_the_pipeline_uses(name):
    objs = render(name)
    assert find(objs, "Namespace", NAMESPACE)
    assert find(objs, "PersistentVolumeClaim", "qvl-scratch")
    prio = find(objs, "PriorityClass", "qvl-training")
    assert prio["value"] > 0 and prio["globalDefault"] is False and prio["preemptionPolicy"] == "PreemptLowerPriority"
    assert prio.get("description")

    service = find(objs, "Service", "mlflow")
    port = next(p for p in service["spec"]["ports"] if p["port"] == 5000)
    deployment = find(objs, "Deployment", "mlflow")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items(), "the Service selects no MLflow pod"
    assert port["targetPort"] in {p["name"] for p in mlflow_container(objs)["ports"]}
    url = urlsplit(MLFLOW_URI)
    assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert url.port == port["port"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_launcher_rbac(name):
    """What components/_shared/launch/trainjob.py and the Kubeflow SDK call, granted to the pipeline pods."""
    objs = render(name)
    role = find(objs, "Role", "qvl-trainjob-launcher")
    binding = find(objs, "RoleBinding", "qvl-trainjob-launcher")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "qvl-trainjob-launcher",
    }
    assert LAUNCHER_SA in binding["subjects"]
    for verb in ("create", "get", "list", "watch", "delete", "patch"):
        assert allows(role["rules"], "trainer.kubeflow.org", "trainjobs", verb), verb
    for group, resource, verb in [
        ("trainer.kubeflow.org", "trainingruntimes", "get"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods/log", "get"),
        ("", "events", "list"),
    ]:
        assert allows(role["rules"], group, resource, verb), (group, resource, verb)
    assert not allows(role["rules"], "", "secrets", "get"), "the launcher needs no secret access"

    cluster_role = find(objs, "ClusterRole", "qvl-trainjob-launcher")
    cluster_binding = find(objs, "ClusterRoleBinding", "qvl-trainjob-launcher")
    assert allows(cluster_role["rules"], "trainer.kubeflow.org", "clustertrainingruntimes", "get")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {"clustertrainingruntimes"}
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in cluster_role["rules"])
    assert cluster_binding["roleRef"]["name"] == "qvl-trainjob-launcher" and LAUNCHER_SA in cluster_binding["subjects"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_mlflow_server(name):
    objs = render(name)
    c = mlflow_container(objs)
    argv = c["command"] + c["args"]
    assert argv[:2] == ["mlflow", "server"]
    for flag in (
        "--host=0.0.0.0",
        "--port=5000",
        "--artifacts-destination=s3://qvl-mlflow-artifacts",
        "--serve-artifacts",
    ):
        assert flag in argv, flag
    env = env_of(c)
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]["value"] == "false"
    assert env["AWS_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"] == {  # optional: AWS S3 itself needs none
        "name": "qvl-s3-credentials",
        "key": "AWS_ENDPOINT_URL",
        "optional": True,
    }
    assert "MLFLOW_S3_ENDPOINT_URL" not in env  # MLflow hands it to boto3 as is: empty = "Invalid endpoint"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
    assert c["resources"]["requests"] and c["resources"]["limits"]
    pod_sc = find(objs, "Deployment", "mlflow")["spec"]["template"]["spec"]["securityContext"]
    assert (
        pod_sc["runAsUser"] == 1000
        and pod_sc["fsGroup"] == 1000
        and pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    )


def test_mlflow_accepts_the_host_the_pipeline_uses():
    """MLflow >= 3.5 answers 403 to Host headers outside its allow-list; ours must pass."""
    from mlflow.server.security_utils import is_allowed_host_header

    allowed = [
        h.strip() for h in env_of(mlflow_container(render("base")))["MLFLOW_SERVER_ALLOWED_HOSTS"]["value"].split(",")
    ]
    assert is_allowed_host_header(allowed, urlsplit(MLFLOW_URI).netloc)
    assert is_allowed_host_header(allowed, "localhost:5000")
    assert not is_allowed_host_header(allowed, "evil.example.com")


def test_the_pipeline_code_names_these_objects():
    """pipelines/k8s.py defaults, the prod-7b preset and the image tag agree with the manifests."""
    from components import __version__
    from pipelines.k8s import load_cluster_profile

    objs = render("prod")
    profile = load_cluster_profile(None)
    find(objs, "PersistentVolumeClaim", profile.scratch_pvc)
    find(objs, "Secret", profile.s3_secret)
    find(objs, "Secret", profile.mlflow_secret)
    preset = yaml.safe_load((MANIFESTS.parent / "pipelines/presets/prod-7b.yaml").read_text())
    runtime = find(objs, "TrainingRuntime", load_cluster_profile(preset["kubernetes"]).trainjob.runtime)
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert node["securityContext"]["runAsUser"] == profile.run_as_user
    assert node["containers"][0]["image"].endswith(f"/train:{__version__}"), "bump the runtime image with the version"
    assert {m["mountPath"] for m in node["containers"][0]["volumeMounts"]} >= {
        profile.scratch_mount_path,
        "/dev/shm",
    }


# ---------------------------------------------------------------------------------------------- dev vs prod


def test_dev_is_one_node():
    objs = render("dev")
    scratch = find(objs, "PersistentVolumeClaim", "qvl-scratch")["spec"]
    assert scratch["accessModes"] == ["ReadWriteOnce"] and scratch["resources"]["requests"]["storage"] == "200Gi"
    assert not [o for o in objs if o["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime")], (
        "dev uses the stock torch-distributed ClusterTrainingRuntime"
    )
    deployment = find(objs, "Deployment", "mlflow")["spec"]
    assert deployment["replicas"] == 1 and deployment["strategy"]["type"] == "Recreate"
    assert "--backend-store-uri=sqlite:////mlflow/db/mlflow.db" in mlflow_container(objs)["args"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in deployment["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["qvl-mlflow-db"]
    assert find(objs, "PersistentVolumeClaim", "qvl-mlflow-db")["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_prod_is_multi_node():
    objs = render("prod")
    scratch = find(objs, "PersistentVolumeClaim", "qvl-scratch")["spec"]
    assert scratch["accessModes"] == ["ReadWriteMany"] and scratch["resources"]["requests"]["storage"] == "2Ti"
    assert "storageClassName" not in scratch, "left to the cluster default (or patched by the operator)"

    c = mlflow_container(objs)
    assert env_of(c)["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"] == {
        "name": "qvl-mlflow-db",
        "key": "MLFLOW_BACKEND_STORE_URI",
    }
    assert not [a for a in c["args"] if "backend-store-uri" in a or "sqlite" in a], "prod must not use sqlite"
    assert find(objs, "Secret", "qvl-mlflow-db")["stringData"] == {"MLFLOW_BACKEND_STORE_URI": ""}
    deployment = find(objs, "Deployment", "mlflow")["spec"]
    assert deployment["replicas"] == 2 and deployment["strategy"]["type"] == "RollingUpdate"
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "qvl-mlflow-db"]


def test_prod_training_runtime():
    """The runtime the launcher references in prod, as the Kubeflow SDK (kubeflow==0.5.0) reads it."""
    from kubeflow.trainer.backends.kubernetes import utils as sdk_utils

    runtime = find(render("prod"), "TrainingRuntime", "qvl-torch-distributed")
    assert runtime["apiVersion"] == TRAINER_API
    parsed = trainer_models.TrainerV1alpha1TrainingRuntime.from_dict(runtime)
    trainer = sdk_utils.get_runtime_trainer(
        runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"],
        parsed.spec.template.spec.replicated_jobs,
        parsed.spec.ml_policy,
    )
    assert trainer.framework == "torch" and trainer.num_nodes >= 2 and trainer.device == "gpu"
    assert "torchrun" in " ".join(trainer.command)

    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "qvl-training"
    (node,) = pod["containers"]
    assert node["name"] == "node"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[mounts["/scratch"]]["persistentVolumeClaim"]["claimName"] == "qvl-scratch"


# ------------------------------------------------------------------------------------------ the checks bite


def _deployment() -> dict:
    return copy.deepcopy(find(render("base"), "Deployment", "mlflow"))


def _runtime() -> dict:
    return copy.deepcopy(find(render("prod"), "TrainingRuntime", "qvl-torch-distributed"))


def _set(obj: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = obj
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return obj


@pytest.mark.parametrize(
    "broken, expected",
    [
        (lambda: _set(_deployment(), "spec.template.spec.containers.0.bogusField", 1), "bogusField"),
        (lambda: _set(_deployment(), "spec.replicas", "two"), "two"),
        (
            lambda: _set(_deployment(), "spec.template.spec.volumes.0.persistentVolumeClaim.readonly", True),
            "readonly",
        ),
        (
            lambda: _set(_runtime(), "spec.mlPolicy.torch", {"numProcPerNode": "auto"}),
            "numProcPerNode",
        ),  # removed in v2.2
        (lambda: _set(_runtime(), "spec.mlPolicy.numNodes", "2"), "numNodes"),
        (
            lambda: _set(
                _runtime(),
                "spec.template.spec.replicatedJobs.0.template.spec.template.spec.containers.0.gpus",
                8,
            ),
            "gpus",
        ),
        (
            lambda: {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
            "no Kubernetes",
        ),
    ],
)
def test_validation_rejects_broken_objects(broken, expected):
    with pytest.raises(AssertionError, match=expected):
        validate(broken())


def test_policy_checks_reject_bad_objects():
    filled = {
        "kind": "Secret",
        "metadata": {"name": "qvl-s3-credentials"},
        "stringData": {"AWS_ACCESS_KEY_ID": "AKIA"},
    }
    assert secret_problems(filled)
    moved = {
        "kind": "Secret",
        "metadata": {"name": "qvl-mlflow"},
        "stringData": {"MLFLOW_TRACKING_URI": "http://x"},
    }
    assert secret_problems(moved)

    assert image_problem("ghcr.io/mlflow/mlflow:latest") and image_problem("ghcr.io/mlflow/mlflow")
    assert image_problem("localhost:5000/mlflow"), "a registry port is not a tag"
    assert not image_problem("localhost:5000/mlflow:v3") and not image_problem("mlflow@sha256:" + "0" * 64)

    root = _deployment()
    pod = root["spec"]["template"]["spec"]
    pod["securityContext"]["runAsUser"] = 0
    pod["containers"][0]["securityContext"] = {}
    problems = " ".join(container_problems(root))
    for needle in ("runAsUser", "allowPrivilegeEscalation", "capabilities"):
        assert needle in problems, needle
    pod["securityContext"].pop("runAsNonRoot")
    assert "runAsNonRoot" in " ".join(container_problems(root))

    assert not allows(
        [{"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"], "verbs": ["get"]}],
        "trainer.kubeflow.org",
        "trainjobs",
        "create",
    )
