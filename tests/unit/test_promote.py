"""promote: the champion becomes merged safetensors in the serving dtype that the plain HF auto classes load and that
answer like the original; what a server cannot load is refused with the file and the fix; the real Model Registry
client registers it against a local stand-in of the REST API (a retry reuses its version, another model under the
same name is refused); the InferenceService validates offline against the Kubernetes and KServe schemas."""

from __future__ import annotations

import ast
import copy
import functools
import json
import os
import pickle
import shutil
from pathlib import Path

import kubernetes_validate
import pytest
import torch
import yaml
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from components._shared.launch.result import RESULT_FILE
from components._shared.model.sources import resolve_model
from components._shared.platform import storage
from components._shared.platform.tracking import NullTracker
from components.promote import weights as W
from components.promote.config import PromoteConfig
from components.promote.stage import inference_service, max_model_len, model_digest, register, run
from tests.fake_model_registry import FakeModelRegistry
from tests.hub_like import write_hub_like

BASE = "builtin:tiny-qwen2_5-vl"
SELECTION = {
    "selected_candidate": "sft",
    "registered_model": "qvl-vlm",
    "registered_version": "3",
    "selected_score": 0.7,
}
ARTIFACT_URI = "s3://qvl-artifacts/v2/artifacts/run-1/promote-op/model"  # what KFP hands the component as model.uri
K8S_VERSION = "1.32"
# The kserve==0.21.0 wheel unpacked with `pip install --no-deps --target DIR` (.ci/install.sh): its generated OpenAPI
# models are read from source; the package itself cannot be installed beside pandas 3 (it pins pandas<3).
KSERVE_TOOLS = Path(os.environ.get("QVL_KSERVE_TOOLS", str(Path.home() / ".cache/qvl-tools/kserve-0.21.0")))


@pytest.fixture(scope="module")
def champion(tmp_path_factory) -> Path:
    """select_checkpoint's output as promote reads it: model/ (the tiny Qwen2.5-VL, fp32) and _stage_result.json."""
    root = tmp_path_factory.mktemp("champion")
    shutil.copytree(resolve_model(BASE), root / "model")
    (root / "model" / "README.md").write_text("# Model card: sft\n")
    record = {"stage": "select_checkpoint", "status": "succeeded", "metrics": SELECTION}
    (root / RESULT_FILE).write_text(json.dumps(record))
    storage.commit_dir(root)  # as select_checkpoint leaves it: the command line refuses it uncommitted
    return root


@pytest.fixture(scope="module")
def promoted(champion, tmp_path_factory) -> tuple[Path, dict]:
    """The champion promoted with the defaults (bf16, no registry), in shards of at most 0.3 MB."""
    out = tmp_path_factory.mktemp("promoted")
    cfg = PromoteConfig(max_shard_size_mb=0.3)
    metrics = run(cfg, champion=str(champion), output_dir=out, tracker=NullTracker(), artifact_uri=ARTIFACT_URI)
    return out, metrics


def _copy(champion: Path, tmp_path: Path) -> Path:
    shutil.copytree(champion, tmp_path / "champion")
    return tmp_path / "champion"


def _edit_weights(model_dir: Path, edit) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------ the promoted model loads and answers


def _inputs(processor):
    from PIL import Image

    image = Image.new("RGB", (112, 112), "white")
    image.paste((200, 30, 30), (20, 20, 70, 70))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt")


def test_the_champion_is_promoted_to_bf16_safetensors_that_load_and_answer_like_it(champion, promoted):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out, metrics = promoted
    model_dir = out / "model"
    names = sorted(p.name for p in model_dir.iterdir())
    weights = [n for n in names if n.endswith(".safetensors")]
    assert not [n for n in names if n.endswith(W.PICKLE_SUFFIXES) or n.startswith("adapter")]
    assert len(weights) >= 2 and "model.safetensors.index.json" in names  # 0.3 MB shards: an index
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(weights)
    original = load_file(str(champion / "model/model.safetensors"))
    served = {k: v for w in weights for k, v in load_file(str(model_dir / w)).items()}
    assert served.keys() == original.keys() == index["weight_map"].keys()
    for name, tensor in original.items():  # every tensor is exactly the champion's, rounded to bf16
        assert served[name].dtype == torch.bfloat16 and torch.equal(served[name], tensor.to(torch.bfloat16)), name
    out_bytes = sum((model_dir / w).stat().st_size for w in weights)
    assert 0.49 < out_bytes / (champion / "model/model.safetensors").stat().st_size < 0.52
    assert metrics["promoted_weight_bytes"] == out_bytes and metrics["dtype"] == "bfloat16"
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert (model_dir / "README.md").read_text() == "# Model card: sft\n"  # the model card travels with it

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype="auto").eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    processor = AutoProcessor.from_pretrained(model_dir)
    inputs = _inputs(processor)
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        reference = AutoModelForImageTextToText.from_pretrained(champion / "model").eval()
        expected, got = reference(**inputs).logits, model(**inputs).logits.float()
    assert generated.shape[1] > inputs["input_ids"].shape[1]
    assert (expected - got).abs().max() <= 0.03 * expected.abs().max()  # bf16 weights and activations
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9


def test_hub_names_and_tied_embeddings_pass_the_structure_check(champion, tmp_path):
    from transformers import AutoModelForImageTextToText

    hub = write_hub_like(tmp_path / "hub")  # legacy config, pre-transformers-5 key names, bf16, two shards
    W.check_structure(hub, W.read_headers(hub, W.weight_files(hub)))

    tied = _copy(champion, tmp_path) / "model"
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    _edit_weights(tied, lambda t: t.pop("lm_head.weight"))
    W.check_structure(tied, W.read_headers(tied, W.weight_files(tied)))  # lm_head may be absent when tied
    _, loading = AutoModelForImageTextToText.from_pretrained(tied, output_loading_info=True)
    assert not loading["missing_keys"]  # ... as transformers agrees


# ------------------------------------------------------------------------------------ what a server cannot load


def _adapter(model_dir: Path) -> None:
    (model_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    save_file({"base_model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.zeros(8, 64)}, str(model_dir / "x"))
    (model_dir / "x").rename(model_dir / "adapter_model.safetensors")


def _lora_tensor(model_dir: Path) -> None:
    _edit_weights(model_dir, lambda t: t.update({"visual.blocks.0.attn.qkv.lora_A.default.weight": torch.zeros(8, 64)}))


def _misshaped(model_dir: Path) -> None:
    _edit_weights(model_dir, lambda t: t.update({"visual.merger.mlp.0.weight": torch.zeros(7, 7)}))


BREAKAGES = {
    "adapter": (_adapter, r"adapter_config\.json: a LoRA adapter .*vLLM.* cannot load a vision LoRA.*merge_and_unload"),
    "lora_tensor": (_lora_tensor, r"model\.safetensors: 1 LoRA tensor\(s\) such as .*qkv\.lora_A.*Merge it"),
    "missing": (
        lambda d: _edit_weights(d, lambda t: t.pop("visual.merger.mlp.0.weight")),
        r"do not fit the model .*1 missing \['model\.visual\.merger\.mlp\.0\.weight'\], 0 unexpected",
    ),
    "misshaped": (_misshaped, r"1 mis-shaped \['visual\.merger\.mlp\.0\.weight \[7, 7\] \(config: \[256, 256\]\)'\]"),
    "unexpected": (
        lambda d: _edit_weights(d, lambda t: t.update({"value_head.weight": torch.zeros(1, 64)})),
        r"0 missing \[\], 1 unexpected \['value_head\.weight'\]",
    ),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), r"no safetensors weights \(none at all"),
    "stray": (
        lambda d: shutil.copyfile(d / "model.safetensors", d / "model-old.safetensors"),
        r"weight files no index lists: \['model-old\.safetensors'\]",
    ),
}


@pytest.mark.parametrize("kind", sorted(BREAKAGES))
def test_what_a_server_cannot_load_is_refused_naming_the_file(kind, champion, tmp_path):
    source = _copy(champion, tmp_path)
    breakage, message = BREAKAGES[kind]
    breakage(source / "model")
    with pytest.raises(ValueError, match=message):
        run(PromoteConfig(), champion=str(source), output_dir=tmp_path / "out", tracker=NullTracker())
    assert not (tmp_path / "out" / "model").exists()  # refused before anything was written


def test_only_select_checkpoints_finished_output_is_promoted(champion, tmp_path, caplog):
    """Another stage's output (rl's model/ with rl's result) or a bare model directory is not a champion: promote
    would hand serving a model nothing selected, recorded as `champion: {}`."""
    source = _copy(champion, tmp_path)
    (source / RESULT_FILE).write_text(json.dumps({"stage": "rl", "status": "succeeded", "metrics": {"steps": 3}}))
    with pytest.raises(ValueError, match=r"is rl's output, not select_checkpoint's.*pass its output directory"):
        run(PromoteConfig(), champion=str(source), output_dir=tmp_path / "out", tracker=NullTracker())
    (source / RESULT_FILE).unlink()
    with pytest.raises(ValueError, match=r"no _stage_result\.json, so not select_checkpoint's output"):
        run(PromoteConfig(), champion=str(source), output_dir=tmp_path / "out", tracker=NullTracker())
    assert not (tmp_path / "out" / "model").exists()


def test_promote_run_by_hand_with_enabled_false_says_the_pipeline_would_skip_it(champion, tmp_path, caplog):
    caplog.set_level("WARNING", logger="components.promote.stage")
    metrics = run(PromoteConfig(enabled=False), champion=str(champion), output_dir=tmp_path, tracker=NullTracker())
    assert metrics["promoted_files"] >= 2
    assert "promote.enabled is false: the pipeline skips this stage" in caplog.text
    caplog.clear()
    run(PromoteConfig(enabled=True), champion=str(champion), output_dir=tmp_path, tracker=NullTracker())
    assert "promote.enabled" not in caplog.text


class _RunsCode:
    """Unpickling this creates a directory: the proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_pickled_weights_are_refused_and_never_unpickled(champion, tmp_path, monkeypatch):
    source = _copy(champion, tmp_path)
    marker = tmp_path / "unpickled"
    (source / "model" / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(marker)))

    def forbidden(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, forbidden)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: pickle-format weights .*never opened.*save_pretrained"):
        run(PromoteConfig(), champion=str(source), output_dir=tmp_path / "out", tracker=NullTracker())
    assert not marker.exists()


def test_a_cast_that_overflows_or_non_finite_weights_are_refused(tmp_path):
    save_file({"big": torch.tensor([1e6, 1.0]), "ids": torch.arange(3)}, str(tmp_path / "model.safetensors"))
    tensors = W.read_headers(tmp_path, ["model.safetensors"])
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=r"big has values beyond float16's range .*dtype: bfloat16"):
        W.write_weights(tmp_path, tensors, tmp_path / "out", "float16", 10**9)
    W.write_weights(tmp_path, tensors, tmp_path / "out", "bfloat16", 10**9)
    written = load_file(str(tmp_path / "out/model.safetensors"))
    assert written["big"].dtype == torch.bfloat16 and written["ids"].dtype == torch.int64  # integers are kept
    save_file({"nan": torch.tensor([float("nan")])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"nan \(model\.safetensors\) holds inf / nan"):
        W.write_weights(tmp_path, W.read_headers(tmp_path, ["model.safetensors"]), tmp_path / "out", "auto", 10**9)


# ------------------------------------------------------------------------------------------- the Model Registry


@pytest.fixture
def token(tmp_path, monkeypatch) -> str:
    """The registry token, in the file KF_PIPELINES_SA_TOKEN_PATH names (never a setting)."""
    (tmp_path / "token").write_text("sa-token-123")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "token"))
    return "sa-token-123"


def _registry_cfg(url: str) -> PromoteConfig:
    return PromoteConfig(model_registry={"server_address": url, "storage_key": "qvl-s3", "author": "ci"})


def _value(meta: dict) -> object:
    return next(v for k, v in meta.items() if k.endswith("_value"))


def test_the_real_client_registers_the_promoted_model_and_a_retry_reuses_its_version(champion, tmp_path, token):
    with FakeModelRegistry(token=token) as fake:
        cfg = _registry_cfg(fake.url)
        metrics = run(
            cfg, champion=str(champion), output_dir=tmp_path, tracker=NullTracker(), artifact_uri=ARTIFACT_URI
        )
        record = json.loads((tmp_path / "promotion.json").read_text())
        files = {p.name: {"sha256": storage.sha256_file(p)} for p in (tmp_path / "model").iterdir()}
        digest = model_digest(files)
        assert record["digest"] == digest and {k: v["sha256"] for k, v in record["files"].items()} == {
            k: v["sha256"] for k, v in files.items()
        }
        (model,) = fake.registered_models.values()
        (version,) = fake.versions.values()
        (artifact,) = fake.artifacts.values()
        assert (model["name"], model["owner"]) == ("qvl-vlm", "ci")  # select_checkpoint's MLflow name
        assert (version["name"], version["author"], version["registeredModelId"]) == (
            f"v3-{digest[:12]}",
            "ci",
            model["id"],
        )
        meta = {k: _value(v) for k, v in version["customProperties"].items()}
        assert meta["qvl_digest"] == digest and meta["mlflow_version"] == "3" and meta["dtype"] == "bfloat16"
        assert meta["selected_candidate"] == "sft" and meta["selected_score"] == 0.7
        assert artifact["uri"] == ARTIFACT_URI + "/model" == record["storage_uri"]
        assert (artifact["modelFormatName"], artifact["modelFormatVersion"]) == ("huggingface", "1")
        assert (artifact["storageKey"], artifact["storagePath"]) == (
            "qvl-s3",
            "v2/artifacts/run-1/promote-op/model/model",
        )
        assert {r.authorization for r in fake.requests} == {f"Bearer {token}"}
        ids = (metrics["registered_model_id"], metrics["model_version_id"], metrics["model_artifact_id"])
        assert ids == (model["id"], version["id"], artifact["id"]) and metrics["registered"] == 1
        labels = yaml.safe_load((tmp_path / "inferenceservice.yaml").read_text())["metadata"]["labels"]
        assert labels["modelregistry.kubeflow.org/registered-model-id"] == model["id"]
        assert labels["modelregistry.kubeflow.org/model-version-id"] == version["id"]

        seen = len(fake.requests)  # a retried task, into the same output: finds its own version
        again = run(cfg, champion=str(champion), output_dir=tmp_path, tracker=NullTracker(), artifact_uri=ARTIFACT_URI)
        assert (len(fake.registered_models), len(fake.versions), len(fake.artifacts)) == (1, 1, 1)
        assert not [r for r in fake.requests[seen:] if r.method != "GET"]
        assert again["registry_reused"] == 1 and again["model_version_id"] == version["id"]
        assert "reused `qvl-vlm` version" in (tmp_path / "report.md").read_text()


INFO = {"dtype": "bfloat16", "bytes_out": 10, "max_position_embeddings": 4096, "max_model_len": 4096}


def test_another_model_under_the_same_version_name_is_refused(token):
    digest = "a" * 64
    with FakeModelRegistry(token=token) as fake:
        cfg = _registry_cfg(fake.url)
        first = register(cfg, SELECTION, ARTIFACT_URI, digest, INFO)
        (version,) = fake.versions.values()
        version["customProperties"]["qvl_digest"]["string_value"] = "b" * 64  # someone else's model, same name
        with pytest.raises(ValueError, match=rf"version {first['version']} already exists and holds another model"):
            register(cfg, SELECTION, ARTIFACT_URI, digest, INFO)
        assert len(fake.versions) == 1


def test_an_interrupted_registration_is_finished_by_the_retry(token):
    from mr_openapi.exceptions import ServiceException

    with FakeModelRegistry(token=token, fail_artifact_posts=1) as fake:
        cfg = _registry_cfg(fake.url)
        with pytest.raises(ServiceException):  # the version exists, its artifact does not
            register(cfg, SELECTION, ARTIFACT_URI, "c" * 64, INFO)
        assert (len(fake.versions), len(fake.artifacts)) == (1, 0)
        done = register(cfg, SELECTION, ARTIFACT_URI, "c" * 64, INFO)
        (artifact,) = fake.artifacts.values()
        assert (len(fake.versions), done["model_artifact_id"], artifact["storageKey"]) == (1, artifact["id"], "qvl-s3")
        assert artifact["uri"] == ARTIFACT_URI and artifact["modelFormatName"] == "huggingface"


def test_without_a_registry_address_nothing_is_registered_and_the_report_says_so(promoted, token):
    out, metrics = promoted
    assert (metrics["registered"], metrics["model_version_id"]) == (0, "")
    assert json.loads((out / "promotion.json").read_text())["registry"]["registered"] is False
    assert "Model Registry: not registered: model_registry.server_address is empty" in (out / "report.md").read_text()
    unreachable = _registry_cfg("http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(ValueError, match=r"model_registry.server_address='http://127.0.0.1:9'.*cannot use"):
        register(unreachable, SELECTION, ARTIFACT_URI, "d" * 64, INFO)


# ------------------------------------------------------------------------------- the InferenceService, offline


@functools.cache
def _kserve_models() -> dict[str, tuple[dict, dict]]:
    """{class: (openapi_types, attribute_map)} of KServe's generated models, read from the wheel's source (the
    tables are literals: nothing of kserve is imported, so neither its __init__ nor its pins matter)."""
    folder = KSERVE_TOOLS / "kserve" / "models"
    if not (folder / "v1beta1_inference_service.py").is_file():
        pytest.fail(
            f"KServe's generated models are not in {folder}: pip install --no-deps --target {KSERVE_TOOLS} "
            "kserve==0.21.0 (or set QVL_KSERVE_TOOLS to where they are)."
        )
    models = {}
    for path in folder.glob("v1*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                tables = {
                    s.targets[0].id: ast.literal_eval(s.value)
                    for s in node.body
                    if isinstance(s, ast.Assign)
                    and getattr(s.targets[0], "id", "") in ("openapi_types", "attribute_map")
                }
                if len(tables) == 2:
                    models[node.name] = (tables["openapi_types"], tables["attribute_map"])
    return models


def _tables(type_name: str) -> tuple[dict, dict]:
    if type_name in _kserve_models():
        return _kserve_models()[type_name]
    import kubernetes.client

    cls = getattr(kubernetes.client, type_name, None)
    if cls is None:
        raise AssertionError(f"no schema for {type_name}")
    return cls.openapi_types, cls.attribute_map


def schema_problems(value, type_name: str, where: str = "") -> list[str]:
    """Every key not in the generated model's attribute_map and every value of the wrong type, recursively."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {value!r}"]
        return [p for i, v in enumerate(value) for p in schema_problems(v, type_name[5:-1], f"{where}[{i}]")]
    if type_name.startswith("dict("):
        inner = type_name[5:-1].split(", ", 1)[1]
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {value!r}"]
        return [p for k, v in value.items() for p in schema_problems(v, inner, f"{where}.{k}")]
    scalars = {"str": str, "bool": bool, "int": int, "float": (int, float), "datetime": str}
    if type_name in scalars:
        ok = isinstance(value, scalars[type_name]) and not (type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{where}: expected {type_name}, got {value!r}"]
    if type_name == "object":
        return []
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} mapping, got {value!r}"]
    types, names = _tables(type_name)
    by_json = {json_name: attr for attr, json_name in names.items()}
    problems = [f"{where}.{k}: not a field of {type_name}" for k in value if k not in by_json]
    for key in value.keys() & by_json.keys():
        problems += schema_problems(value[key], types[by_json[key]], f"{where}.{key}")
    return problems


POD_ONLY_IN_KSERVE = ("modelFormat", "runtime", "runtimeVersion", "storageUri", "storage", "protocolVersion")


def validate_inference_service(manifest: dict) -> None:
    """KServe's generated models for the whole object; kubernetes-validate --strict for the pod it becomes."""
    problems = schema_problems(manifest, "V1beta1InferenceService")
    assert not problems, "; ".join(problems)
    predictor = manifest["spec"]["predictor"]
    container = {k: v for k, v in predictor["model"].items() if k not in POD_ONLY_IN_KSERVE}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {k: v for k, v in manifest["metadata"].items() if k != "namespace"},
        "spec": {
            **{k: v for k, v in predictor.items() if k != "model"},
            "containers": [{"name": "kserve-container", "image": "runtime-image", **container}],
        },
    }
    try:
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        raise AssertionError(f"{err.message} (at {'.'.join(str(p) for p in err.path)})") from None


def _full_manifest() -> dict:
    cfg = PromoteConfig(
        serving={
            "name": "qvl-vlm-7b",
            "namespace": "qvl",
            "service_account": "qvl-serving",
            "gpus": 2,
            "extra_args": ["--tensor_parallel_size=2", "--limit_mm_per_prompt=image=4"],
        }
    )
    registry = {"registered": True, "server": "https://model-registry-service.kubeflow.svc.cluster.local:8443"}
    registry.update(model_name="qvl-vlm", version="v3-abc", registered_model_id="1", model_version_id="2")
    return inference_service(cfg, ARTIFACT_URI + "/model", INFO, registry, SELECTION, "e" * 64)


def test_the_inference_service_validates_against_kubernetes_and_kserve(promoted):
    out, _ = promoted
    default = yaml.safe_load((out / "inferenceservice.yaml").read_text())
    full = _full_manifest()
    for manifest in (default, full):
        validate_inference_service(manifest)
    model = full["spec"]["predictor"]["model"]
    assert (model["modelFormat"], model["runtime"], model["storageUri"]) == (
        {"name": "huggingface"},
        "kserve-huggingfaceserver",
        ARTIFACT_URI + "/model",
    )
    assert model["args"][:4] == [
        "--model_name=qvl-vlm-7b",
        "--backend=vllm",
        "--max_model_len=4096",
        "--dtype=bfloat16",
    ]
    assert (
        model["resources"]["requests"]
        == model["resources"]["limits"]
        == {
            "cpu": "4",
            "memory": "32Gi",
            "nvidia.com/gpu": "2",
        }
    )
    assert full["spec"]["predictor"]["serviceAccountName"] == "qvl-serving"
    assert full["metadata"]["labels"]["modelregistry.kubeflow.org/name"] == "model-registry-service"
    assert full["metadata"]["labels"]["modelregistry.kubeflow.org/namespace"] == "kubeflow"
    assert full["metadata"]["annotations"]["qvl/mlflow-version"] == "3"
    assert "runAsUser" not in json.dumps(full) and model["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize(
    ("path", "key", "value", "message"),
    [
        (("spec", "predictor", "model"), "storageURI", "s3://x", r"storageURI: not a field of V1beta1ModelSpec"),
        (
            ("spec", "predictor", "model", "modelFormat"),
            "nam",
            "huggingface",
            r"nam: not a field of V1beta1ModelFormat",
        ),
        (("spec", "predictor"), "serviceAcountName", "sa", r"serviceAcountName: not a field of V1beta1PredictorSpec"),
        (("spec", "predictor", "model", "resources"), "limit", {}, r"limit: not a field of V1ResourceRequirements"),
        (("spec", "predictor", "model"), "args", [3], r"args\[0\]: expected str"),
        (("spec", "predictor", "model", "securityContext"), "runAsNonRoot", "yes", r"runAsNonRoot: expected bool"),
    ],
)
def test_the_offline_validation_bites(path, key, value, message):
    manifest = copy.deepcopy(_full_manifest())
    node = manifest
    for part in path:
        node = node[part]
    node[key] = value
    with pytest.raises(AssertionError, match=message):
        validate_inference_service(manifest)


def test_kubernetes_validate_checks_the_pod_it_becomes():
    manifest = copy.deepcopy(_full_manifest())
    manifest["spec"]["predictor"]["model"]["env"] = [{"name": "HF_HUB_OFFLINE", "valu": "1"}]
    with pytest.raises(AssertionError, match=r"valu"):  # V1EnvVar knows it too; both layers see it
        validate_inference_service(manifest)
    problems = schema_problems(manifest, "V1beta1InferenceService")
    assert problems == [".spec.predictor.model.env[0].valu: not a field of V1EnvVar"]
    pod_only = copy.deepcopy(_full_manifest())  # what the generated models do not check: required fields
    pod_only["spec"]["predictor"]["model"]["env"] = [{"value": "1"}]
    assert schema_problems(pod_only, "V1beta1InferenceService") == []
    with pytest.raises(AssertionError, match=r"'name' is a required property \(at spec.containers.0.env.0\)"):
        validate_inference_service(pod_only)


# ---------------------------------------------------------------------------------------------------- the config


def test_the_config_refuses_credentials_and_bad_names_with_how_to_fix():
    cfg = PromoteConfig.model_validate({"serving": {"gpus": 2.0, "max_model_len": 8192.0}})  # KFP's floats
    assert (cfg.enabled, cfg.dtype, cfg.serving.gpus, cfg.serving.max_model_len) == (False, "bfloat16", 2, 8192)
    bad = {
        "serving.name": ({"serving": {"name": "Qwen_VL"}}, "should match pattern"),
        "managed arg": ({"serving": {"extra_args": ["--dtype=float16"]}}, r"--dtype is set by the stage"),
        "token arg": ({"serving": {"extra_args": ["--hf-token=hf_abc"]}}, r"--hf-token passes a credential"),
        "not a flag": ({"serving": {"extra_args": ["enforce_eager"]}}, r"not a --flag"),
        "userinfo": ({"model_registry": {"server_address": "https://u:p@mr.example"}}, r"holds credentials"),
        "scheme": ({"model_registry": {"server_address": "grpc://mr:9090"}}, r"use http:// or https://"),
        "storage scheme": ({"serving": {"storage_uri": "ftp://models/x"}}, r"KServe reads s3://"),
        "signed url": (
            {"serving": {"storage_uri": "https://b.s3.example/m?X-Amz-Signature=abc"}},
            r"credential in its query",
        ),
        "port": ({"model_registry": {"port": 0}}, "greater than or equal to 1"),
        "unknown key": ({"model_registry": {"token": "abc"}}, "Extra inputs are not permitted"),
        "dtype": ({"dtype": "int8"}, "Input should be 'auto'"),
    }
    for case, (data, message) in bad.items():
        with pytest.raises(ValidationError, match=message):
            PromoteConfig.model_validate(data)
            pytest.fail(case)
    assert max_model_len(PromoteConfig(), {"max_position_embeddings": 128000}) == 32768  # Qwen2.5-VL's 128k: capped
    assert max_model_len(PromoteConfig(), INFO) == 4096
    with pytest.raises(ValueError, match=r"max_model_len=8192 exceeds the model's max_position_embeddings 4096"):
        max_model_len(PromoteConfig(serving={"max_model_len": 8192}), INFO)


def test_the_command_line_promotes_and_commits_the_output(champion, tmp_path, tracking_env, capsys):
    from components.promote.stage import main

    main(["--champion", str(champion), "--output-dir", str(tmp_path / "out"), "serving.name=qvl-cli", "dtype=auto"])
    printed = json.loads(capsys.readouterr().out)
    assert (printed["dtype"], printed["registered"]) == ("float32", 0)  # auto: the champion's own dtype, no cast
    assert storage.verify_dir(tmp_path / "out") == printed["promoted_files"] + 4  # + manifest, record, report, result
    result = json.loads((tmp_path / "out" / RESULT_FILE).read_text())
    assert result["stage"] == "promote" and result["status"] == "succeeded"
    manifest = yaml.safe_load((tmp_path / "out/inferenceservice.yaml").read_text())
    assert manifest["metadata"]["name"] == "qvl-cli"
    assert manifest["spec"]["predictor"]["model"]["storageUri"] == (tmp_path / "out/model").resolve().as_uri()
    assert "A local path: set serving.storage_uri" in (tmp_path / "out/report.md").read_text()
