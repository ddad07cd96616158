"""promote: hand select_checkpoint's champion to serving. Merged safetensors in the serving dtype (a LoRA adapter,
pickled weights or weights that do not fit the config are refused), registered in the Kubeflow Model Registry when
model_registry.server_address is set, and a KServe InferenceService manifest (kserve-huggingfaceserver, vLLM) beside.

1 process:        python -m components.promote --config pipelines/presets/tiny.yaml --champion OUT/select_checkpoint \
                      --output-dir OUT/promote
In the pipeline:  components/promote/component.py calls run_stage("promote", ...) (CPU only: nothing runs on a GPU).

Writes model/ (the promoted model), inferenceservice.yaml, promotion.json (sha256 per file, dtype, sizes, registry ids,
storage URI) and report.md. A live serving smoke test needs a cluster with KServe and a GPU; it is not run here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from components._shared.launch.result import RESULT_FILE
from components._shared.platform import storage
from components._shared.platform.tracking import Tracker
from components.promote import weights as W
from components.promote.config import PromoteConfig

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
MANIFEST = "inferenceservice.yaml"
PART_OF = "qwen-vl-pipeline"
MR_LABEL = "modelregistry.kubeflow.org"  # the labels the Model Registry's InferenceService controller links by
DEFAULT_MODEL_NAME = "qvl-vlm"
MAX_DEFAULT_LEN = 32768
NOT_HASHED = ("README.md", "qvl_model.json")  # the model card and provenance notes: not what is served


def run(
    cfg: PromoteConfig, *, champion: str, output_dir: str | Path, tracker: Tracker, artifact_uri: str = ""
) -> dict[str, Any]:
    """Check, convert, register and describe for serving the champion in `champion` (select_checkpoint's output);
    `artifact_uri` is where this stage's output will live (KFP's output artifact URI), for the storage URI."""
    output_dir = Path(output_dir)
    if not cfg.enabled:
        logger.warning(
            "promote.enabled is false: the pipeline skips this stage; run by hand, it promotes the champion anyway."
        )
    with tempfile.TemporaryDirectory(prefix="qvl-promote-") as scratch:
        source = _local_champion(champion, Path(scratch))
        selection = read_selection(source)
        promoted, info = promote_weights(cfg, source / MODEL_DIR, output_dir / MODEL_DIR)
    files = {p.name: {"size": p.stat().st_size, "sha256": storage.sha256_file(p)} for p in sorted(promoted.iterdir())}
    digest = model_digest(files)
    uri = storage_uri(cfg, artifact_uri, promoted)
    info["max_model_len"] = max_model_len(cfg, info)
    registry: dict[str, Any] = {"registered": False, "reason": "model_registry.server_address is empty"}
    if cfg.model_registry.server_address:
        registry = register(cfg, selection, uri, digest, info)
    manifest = inference_service(cfg, uri, info, registry, selection, digest)
    (output_dir / MANIFEST).write_text(_yaml(manifest))
    record = {
        "champion": selection,
        "storage_uri": uri,
        "dtype": info["dtype"],
        "digest": digest,
        "files": files,
        "weights_in": info["bytes_in"],
        "registry": registry,
        "inferenceservice": MANIFEST,
    }
    (output_dir / "promotion.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    report = report_md(cfg, record, manifest)
    (output_dir / "report.md").write_text(report)
    tracker.log_text(report, "promotion.md")
    return {
        "promoted_bytes": sum(f["size"] for f in files.values()),
        "promoted_weight_bytes": info["bytes_out"],
        "promoted_files": len(files),
        "registered": int(bool(registry["registered"])),
        "registry_reused": int(bool(registry.get("reused"))),
        "registered_model_id": registry.get("registered_model_id", ""),
        "model_version_id": registry.get("model_version_id", ""),
        "model_artifact_id": registry.get("model_artifact_id", ""),
        "model_version": registry.get("version", ""),
        "storage_uri": uri,
        "dtype": info["dtype"],
    }


def _local_champion(champion: str, scratch: Path) -> Path:
    """The champion directory, fetched from S3 first when it is an s3:// prefix (verified against its marker)."""
    if storage.is_s3(champion):
        return storage.fetch_dir(champion, scratch / "champion", require_commit=True)
    path = Path(champion)
    if not (path / MODEL_DIR).is_dir():
        raise ValueError(f"--champion {champion}: no model/ inside; pass select_checkpoint's output directory.")
    return path


def read_selection(champion: Path) -> dict[str, Any]:
    """select_checkpoint's recorded choice (selected_candidate, registered_model, registered_version, score)."""
    path = champion / RESULT_FILE
    if not path.is_file():
        raise ValueError(
            f"--champion {champion}: no {RESULT_FILE}, so not select_checkpoint's output; pass the output directory of "
            "select_checkpoint (its model/ is the champion, its result names it)."
        )
    result = json.loads(path.read_text())
    if result.get("stage") != "select_checkpoint":
        raise ValueError(
            f"--champion {champion} is {result.get('stage') or 'another stage'}'s output, not select_checkpoint's; "
            "promote hands serving the champion select_checkpoint chose: pass its output directory."
        )
    if result.get("status", "succeeded") != "succeeded":
        raise ValueError(f"{path}: select_checkpoint did not succeed ({result.get('error')}); nothing to promote.")
    metrics = result.get("metrics") or {}
    keys = ("selected_candidate", "selected_stage", "selected_score", "registered_model", "registered_version")
    return {k: metrics[k] for k in keys if metrics.get(k) not in (None, "")}


def promote_weights(cfg: PromoteConfig, source: Path, target: Path) -> tuple[Path, dict[str, Any]]:
    """Refuse what a server cannot load, check the weights fit the config, write target/ in the serving dtype."""
    files = W.weight_files(source)
    tensors = W.read_headers(source, files)
    W.check_structure(source, tensors)
    tag = W.serving_tag(tensors, cfg.dtype)
    if target.exists():
        shutil.rmtree(target)  # a retry into the same output starts clean: no stale shard survives
    target.mkdir(parents=True)
    max_bytes = int(cfg.max_shard_size_mb * 1_000_000)
    written = W.write_weights(source, tensors, target, cfg.dtype, max_bytes)
    W.copy_other_files(source, target, written, cfg.dtype, tag)
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config") or config
    info = {
        "dtype": {v: k for k, v in W.TAGS.items()}.get(tag, tag),
        "bytes_in": sum((source / f).stat().st_size for f in files),
        "bytes_out": sum((target / f).stat().st_size for f in written if f.endswith(".safetensors")),
        "max_position_embeddings": int(text.get("max_position_embeddings") or config.get("max_position_embeddings", 0)),
    }
    return target, info


def model_digest(files: dict[str, dict]) -> str:
    """sha256 over every promoted file's name and sha256 but the model card's: the identity of what is served."""
    lines = "".join(f"{name} {meta['sha256']}\n" for name, meta in sorted(files.items()) if name not in NOT_HASHED)
    return hashlib.sha256(lines.encode()).hexdigest()


def storage_uri(cfg: PromoteConfig, artifact_uri: str, promoted: Path) -> str:
    """serving.storage_uri, else this output's artifact URI + /model, else (a local run) file:// of the directory."""
    if cfg.serving.storage_uri:
        return cfg.serving.storage_uri
    if artifact_uri and re.match(r"^[a-z][a-z0-9+.-]*://", artifact_uri) and not artifact_uri.startswith("file://"):
        return artifact_uri.rstrip("/") + "/" + MODEL_DIR
    return promoted.resolve().as_uri()


def version_name(selection: dict[str, Any], digest: str) -> str:
    """The registry version: MLflow's version (else the selected candidate) + the content digest, so a retry finds
    its own version and another model never takes the name."""
    if selection.get("registered_version"):
        base = f"v{selection['registered_version']}"
    else:
        base = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(selection.get("selected_candidate") or "champion")).strip("-")
    return f"{base}-{digest[:12]}"


def register(cfg: PromoteConfig, selection: dict, uri: str, digest: str, info: dict) -> dict[str, Any]:
    """Register the promoted model with the real Model Registry client; a version of this name that already holds
    this digest (a retried task) is reused, one holding another model is an error. Returns the ids."""
    from model_registry.exceptions import StoreError

    settings = cfg.model_registry
    name = settings.model_name or selection.get("registered_model") or DEFAULT_MODEL_NAME
    version = version_name(selection, digest)
    client = _connect(cfg)
    existing = client.get_model_version(name, version) if client.get_registered_model(name) else None
    reused = existing is not None
    artifact_args = {
        "model_format_name": settings.model_format_name,
        "model_format_version": settings.model_format_version,
        "storage_key": settings.storage_key,
        "storage_path": storage.split_s3(uri)[1] if settings.storage_key and storage.is_s3(uri) else None,
    }
    if existing is None:
        try:
            client.register_model(
                name,
                uri,
                version=version,
                author=settings.author,
                version_description=settings.description or _description(selection, info),
                metadata=_metadata(selection, digest, info),
                **artifact_args,
            )
        except StoreError as err:  # created by someone else between our look-up and our call
            raise ValueError(f"Model Registry: {name} version {version}: {err}; rerun the task.") from err
    else:
        _check_same_model(name, version, existing, digest)
    model, mv = client.get_registered_model(name), client.get_model_version(name, version)
    artifact = client.get_model_artifact(name, version)
    if artifact is None:  # an earlier try stopped between creating the version and its artifact: finish it
        from model_registry.types import ModelArtifact

        artifact = client.async_runner(
            client._api.upsert_model_version_artifact(ModelArtifact(name=name, uri=uri, **artifact_args), mv.id)
        )
    return {
        "registered": True,
        "reused": reused,
        "server": settings.server_address,
        "model_name": name,
        "version": version,
        "registered_model_id": model.id,
        "model_version_id": mv.id,
        "model_artifact_id": artifact.id,
        "uri": artifact.uri,
    }


def _connect(cfg: PromoteConfig):
    """The client (it checks the connection by listing one model); a failure names the setting to fix."""
    from model_registry import ModelRegistry

    settings = cfg.model_registry
    try:
        return ModelRegistry(
            settings.server_address, settings.port, author=settings.author, is_secure=settings.is_secure
        )
    except Exception as err:  # aiohttp / OpenAPI / StoreError: all mean "cannot use this registry"
        raise ValueError(
            f"model_registry.server_address={settings.server_address!r} (port {settings.port}, is_secure "
            f"{settings.is_secure}): cannot use the Model Registry ({type(err).__name__}: {err}). Check the address "
            "and port; a secure connection reads its token from the file KF_PIPELINES_SA_TOKEN_PATH names (or the "
            "pod's service-account token)."
        ) from err


def _check_same_model(name: str, version: str, existing, digest: str) -> None:
    held = (existing.custom_properties or {}).get("qvl_digest")
    if held != digest:
        raise ValueError(
            f"Model Registry: {name} version {version} already exists and holds another model (digest {held or 'none'}"
            f", promoted {digest}). Set model_registry.model_name to another name, or archive that version."
        )


def _metadata(selection: dict, digest: str, info: dict) -> dict[str, str | int | float | bool]:
    labels = {"registered_model": "mlflow_registered_model", "registered_version": "mlflow_version"}
    meta: dict[str, str | int | float | bool] = {
        labels.get(k, k): v if isinstance(v, (int, float)) else str(v) for k, v in selection.items()
    }
    meta.update(qvl_digest=digest, dtype=info["dtype"], weight_bytes=int(info["bytes_out"]), source=PART_OF)
    return meta


def _description(selection: dict, info: dict) -> str:
    what = selection.get("selected_candidate", "the champion")
    mlflow = (
        f" (MLflow {selection['registered_model']} v{selection['registered_version']})"
        if selection.get("registered_version")
        else ""
    )
    return f"{what}{mlflow}, merged safetensors in {info['dtype']}, promoted by {PART_OF}."


def max_model_len(cfg: PromoteConfig, info: dict) -> int:
    """serving.max_model_len, else the model's max_position_embeddings capped at 32768; more than the model's is an
    error (vLLM would refuse to start), raised before anything is registered."""
    limit = info["max_position_embeddings"]
    value = cfg.serving.max_model_len or min(limit or MAX_DEFAULT_LEN, MAX_DEFAULT_LEN)
    if limit and value > limit:
        raise ValueError(
            f"serving.max_model_len={value} exceeds the model's max_position_embeddings {limit}; vLLM would refuse "
            "to start. Set it <= that, or leave it empty."
        )
    return value


def inference_service(
    cfg: PromoteConfig, uri: str, info: dict, registry: dict, selection: dict, digest: str
) -> dict[str, Any]:
    """The KServe v1beta1 InferenceService: kserve-huggingfaceserver running vLLM on the promoted weights, requests =
    limits, no root settings, labelled for the Model Registry's InferenceService controller when registered."""
    s = cfg.serving
    args = [f"--model_name={s.name}", f"--backend={s.backend}", f"--max_model_len={info['max_model_len']}"]
    args.append(f"--dtype={info['dtype']}")
    amounts = {"cpu": s.cpu, "memory": s.memory, **({s.accelerator_resource: str(s.gpus)} if s.gpus else {})}
    model: dict[str, Any] = {
        "modelFormat": {"name": cfg.model_registry.model_format_name},  # what the runtime and the registry match
        "runtime": s.runtime,
        "storageUri": uri,
        "args": args + list(s.extra_args),
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],  # the weights are local: never reach for the hub
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True},
    }
    predictor: dict[str, Any] = {"model": model}
    if s.service_account:
        predictor["serviceAccountName"] = s.service_account
    metadata: dict[str, Any] = {
        "name": s.name,
        "labels": {
            "app.kubernetes.io/part-of": PART_OF,
            "app.kubernetes.io/name": s.name,
            **_registry_labels(registry),
        },
        "annotations": _annotations(selection, registry, digest),
    }
    if s.namespace:
        metadata["namespace"] = s.namespace
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": {"predictor": predictor},
    }


def _registry_labels(registry: dict) -> dict[str, str]:
    if not registry.get("registered"):
        return {}
    labels = {
        f"{MR_LABEL}/registered-model-id": str(registry["registered_model_id"]),
        f"{MR_LABEL}/model-version-id": str(registry["model_version_id"]),
    }
    host = re.sub(r"^https?://", "", registry["server"]).split(":")[0].split("/")[0]
    parts = host.split(".")
    if len(parts) >= 3 and parts[2] == "svc":  # <service>.<namespace>.svc[.cluster.local]: the registry's own
        labels.update({f"{MR_LABEL}/name": parts[0], f"{MR_LABEL}/namespace": parts[1]})
    return labels


def _annotations(selection: dict, registry: dict, digest: str) -> dict[str, str]:
    names = {"registered_model": "mlflow-registered-model", "registered_version": "mlflow-version"}
    notes = {
        f"qvl/{names.get(k, k.replace('_', '-'))}": str(v)
        for k, v in selection.items()
        if k in (*names, "selected_candidate")
    }
    if registry.get("registered"):
        notes.update({"qvl/registry-model": registry["model_name"], "qvl/registry-version": registry["version"]})
    return {"qvl/weights-digest": digest, **notes}


def _yaml(obj: dict) -> str:
    import yaml

    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)


def report_md(cfg: PromoteConfig, record: dict, manifest: dict) -> str:
    """What was promoted, where it is registered, how to serve it, and what was not verified here."""
    reg = record["registry"]
    registered = (
        f"{'reused' if reg.get('reused') else 'registered'} `{reg['model_name']}` version `{reg['version']}` at "
        f"{reg['server']} (registered model id {reg['registered_model_id']}, version id {reg['model_version_id']}, "
        f"artifact id {reg['model_artifact_id']})."
        if reg["registered"]
        else f"not registered: {reg['reason']} (set model_registry.server_address to register)."
    )
    if reg.get("uri") and reg["uri"] != record["storage_uri"]:
        registered += (
            f" That version points at {reg['uri']} (identical weights, promoted earlier); this one serves its own."
        )
    champion, uri = record["champion"], record["storage_uri"]
    mlflow = (
        f" (MLflow `{champion.get('registered_model')}` v{champion['registered_version']})"
        if champion.get("registered_version")
        else ""
    )
    local = (
        " A local path: set serving.storage_uri before applying it to a cluster." if uri.startswith("file://") else ""
    )
    lines = [
        "# Promotion",
        "",
        f"Champion: **{champion.get('selected_candidate', 'unknown')}**{mlflow}.",
        f"Promoted as merged safetensors in **{record['dtype']}**: {len(record['files'])} files, "
        f"{sum(f['size'] for f in record['files'].values()):,} bytes (weights in: {record['weights_in']:,} bytes); "
        f"digest `{record['digest'][:16]}...`.",
        f"Storage URI: `{uri}`.{local}",
        f"Model Registry: {registered}",
        "",
        "## Serving",
        "",
        f"`kubectl apply -f {MANIFEST}` creates the KServe InferenceService below (runtime `{cfg.serving.runtime}`, "
        f"backend {cfg.serving.backend}). The project's tests check this manifest's shape offline against the "
        "Kubernetes and KServe schemas; a live serving smoke test needs a cluster with KServe and a GPU: not run.",
        "",
        "```yaml",
        _yaml(manifest).rstrip(),
        "```",
        "",
        "## Files",
        "",
        "| file | bytes | sha256 |",
        "|---|---|---|",
        *(f"| {n} | {f['size']:,} | `{f['sha256'][:16]}` |" for n, f in record["files"].items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import functools
    import sys

    from components._shared.launch.cli import stage_main

    args = sys.argv[1:] if argv is None else argv
    output = next((a.split("=", 1)[1] for a in args if a.startswith("--output-dir=")), "")
    output = output or next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--output-dir"), "")
    # an s3:// output is written locally, then published there: the storage URI is the published one
    stage = functools.partial(run, artifact_uri=output if storage.is_s3(output) else "")
    functools.update_wrapper(stage, run)
    stage_main(PromoteConfig, stage, section="promote", inputs=("champion",), argv=argv)
