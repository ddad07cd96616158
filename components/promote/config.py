"""Config of the promote stage. Imports pydantic only, so pipelines/ compiles without torch.

No setting holds a credential: the Model Registry client reads its bearer token from the file that the environment
variable KF_PIPELINES_SA_TOKEN_PATH names (else the pod's service-account token), S3 access comes from the secrets of
`serving.service_account` (KServe) or the data connection `model_registry.storage_key` names.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, field_validator

from components._shared.platform.config import PATTERN_WORDS, StageConfig, SubConfig

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # RFC 1123 label: namespaces, service accounts, secrets
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # KServe's InferenceService names start with a letter
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"  # a Kubernetes resource quantity
RESOURCE_NAME = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
PATTERN_WORDS.update(  # what a refused value must look like, said in words (thirteenth pass: M04, M07)
    {
        DNS_LABEL: "a Kubernetes name: lower-case letters, digits and '-', starting and ending with a letter or digit",
        DNS_1035_LABEL: "a Kubernetes service name: lower-case letters, digits and '-', starting with a letter",
        DNS_SUBDOMAIN: "a Kubernetes object name: lower-case letters, digits, '-' and '.'",
        QUANTITY: "a Kubernetes quantity: a number with an optional unit, e.g. 32Gi or 500m (write Gi, not GB)",
        RESOURCE_NAME: "a Kubernetes resource name such as nvidia.com/gpu",
    }
)
STORAGE_SCHEMES = ("s3", "gs", "pvc", "oci", "hf", "https", "http", "hdfs", "webhdfs", "model-registry")
MANAGED_ARGS = ("model_name", "model_id", "model_dir", "backend", "max_model_len", "dtype")  # set by the stage
REPEATABLE_ARGS = frozenset({"middleware"})  # vLLM's flags taken several times (action="append")
SECRET_WORDS = re.compile(r"token|secret|passw|api[-_]?key|credential|signature|access[-_]?key", re.IGNORECASE)


def _no_userinfo(value: str, setting: str) -> str:
    """Refuse `user:password@` in a URL: credentials never go into a setting (they would land in the pipeline
    spec, the KFP UI and MLflow)."""
    parts = urlsplit(value if "://" in value else f"//{value}")
    if parts.username or parts.password:
        raise ValueError(
            f"{setting} holds credentials ('user:password@'); remove them. The registry token is read from the file "
            "named by KF_PIPELINES_SA_TOKEN_PATH (or the pod's service-account token); S3 keys come from a secret."
        )
    leaked = [key for key in parse_qs(parts.query) if SECRET_WORDS.search(key)]
    if leaked:
        raise ValueError(f"{setting} carries a credential in its query ({leaked}); remove it and use a secret.")
    return value


class ModelRegistrySettings(SubConfig):
    """Where and how the promoted model is registered in the Kubeflow Model Registry (the `model-registry` client)."""

    server_address: str = Field(
        "",
        max_length=500,
        description=(
            "Model Registry REST address, e.g. https://model-registry-service.kubeflow.svc.cluster.local or "
            "http://model-registry-service.kubeflow.svc.cluster.local:8080; empty = do not register (the report says "
            "so)."
        ),
    )
    port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        None, description="REST port; empty = from the address (its :port, else 8080 for http://, 443 otherwise)."
    )
    is_secure: bool | None = Field(
        None,
        description=(
            "TLS and a bearer token; empty = from the address scheme (https:// or none: yes, http://: no). A secure "
            "connection needs the token file KF_PIPELINES_SA_TOKEN_PATH names (or the pod's service-account token)."
        ),
    )
    author: str = Field("qwen-vl-pipeline", min_length=1, max_length=200, description="Author of the version.")
    model_name: str = Field(
        "",
        max_length=200,
        pattern=r"^$|^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Registered model name; empty = select_checkpoint's MLflow registered model, else qvl-vlm.",
    )
    model_format_name: str = Field(
        "huggingface",
        min_length=1,
        max_length=100,
        description=(
            "What KServe matches against a runtime's supportedModelFormats: 'huggingface' is the format "
            "kserve-huggingfaceserver (vLLM or HF backend) serves, and a safetensors HF directory is exactly that."
        ),
    )
    model_format_version: str = Field("1", min_length=1, max_length=50, description="kserve-huggingfaceserver's: 1.")
    storage_key: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Name of the S3 data-connection secret the registry's deploy flow mounts (storageKey); no keys.",
    )
    description: str = Field("", max_length=2000, description="Version description (default: what was promoted).")

    @field_validator("server_address")
    @classmethod
    def _address(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) and not value.startswith(("http://", "https://")):
            raise ValueError(f"server_address {value!r}: use http:// or https:// (or a bare host name).")
        return _no_userinfo(value, "model_registry.server_address") if value else value


class ServingSettings(SubConfig):
    """The KServe InferenceService written beside the promoted model (kserve-huggingfaceserver with vLLM)."""

    name: str = Field(
        "qvl-vlm",
        max_length=63,
        pattern=DNS_1035_LABEL,
        description="InferenceService name: lower-case letters, digits and '-', starting with a letter (<= 63).",
    )
    namespace: str | None = Field(None, max_length=63, pattern=DNS_LABEL, description="Empty = kubectl's namespace.")
    runtime: str = Field(
        "kserve-huggingfaceserver", max_length=253, pattern=DNS_SUBDOMAIN, description="(Cluster)ServingRuntime."
    )
    backend: Literal["vllm", "huggingface", "auto"] = Field(
        "vllm", description="huggingfaceserver --backend: vllm serves merged weights; auto falls back to transformers."
    )
    max_model_len: Annotated[int, Field(ge=128, le=1_048_576)] | None = Field(
        None,
        description=(
            "Context length vLLM reserves KV cache for; empty = the model's max_position_embeddings, capped at 32768 "
            "(Qwen2.5-VL's 128k would not fit beside the weights on one GPU)."
        ),
    )
    gpus: Annotated[int, Field(ge=0, le=16)] = 1
    accelerator_resource: str = Field("nvidia.com/gpu", max_length=253, pattern=RESOURCE_NAME)
    cpu: str = Field("4", pattern=QUANTITY, description="CPU request = limit (a Kubernetes quantity).")
    memory: str = Field("32Gi", pattern=QUANTITY, description="Memory request = limit (a Kubernetes quantity).")
    service_account: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Service account whose secrets give KServe's storage initializer S3 access (serviceAccountName).",
    )
    storage_uri: str = Field(
        "",
        max_length=2000,
        description=(
            "Where the server reads the model; empty = the promoted model's own artifact URI + '/model'. "
            f"Schemes: {', '.join(STORAGE_SCHEMES)} (model-registry:// needs the registry's storage initializer)."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=50,
        description="More huggingfaceserver / vLLM flags, e.g. --limit_mm_per_prompt=image=4 or --enforce_eager.",
    )

    @field_validator("storage_uri")
    @classmethod
    def _storage_uri(cls, value: str) -> str:
        value = value.strip()
        if not value:
            return value
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if scheme not in STORAGE_SCHEMES:
            raise ValueError(
                f"storage_uri {value!r}: KServe reads {', '.join(s + '://' for s in STORAGE_SCHEMES)}; give one of "
                "those (or leave it empty for the promoted model's artifact URI)."
            )
        return _no_userinfo(value, "serving.storage_uri")

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, value: list[str]) -> list[str]:
        seen: dict[str, str] = {}
        for arg in value:
            flag = arg.split("=", 1)[0]
            name = flag[2:].replace("-", "_")
            if name in seen and name not in REPEATABLE_ARGS:  # argparse keeps the last: one of them is dropped
                raise ValueError(
                    f"extra_args: {flag} is given twice ({seen[name]!r} and {arg!r}); the server would keep the last "
                    "alone: give it once."
                )
            seen[name] = arg
            if not flag.startswith("--") or any(c.isspace() for c in flag):
                raise ValueError(f"extra_args: {arg!r} is not a --flag[=value] argument; write e.g. --enforce_eager.")
            if flag[2:].replace("-", "_") in MANAGED_ARGS:
                raise ValueError(
                    f"extra_args: {flag} is set by the stage; use serving.name / backend / max_model_len or dtype."
                )
            if SECRET_WORDS.search(flag):
                raise ValueError(f"extra_args: {flag} passes a credential; give it to the server from a secret.")
        return value


class PromoteConfig(StageConfig):
    """Hand the champion to serving: merged safetensors in the serving dtype (never a LoRA adapter), registered in
    the Kubeflow Model Registry when configured, and a KServe InferenceService manifest (vLLM) beside it."""

    enabled: bool = Field(False, description="The pipeline runs the promote step only when true.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Serving weights' dtype; auto = the champion's own (no cast)."
    )
    max_shard_size_mb: Annotated[float, Field(gt=0, le=100_000)] = Field(
        5000, description="Largest safetensors shard written (MB); more than one shard gets an index."
    )
    model_registry: ModelRegistrySettings = ModelRegistrySettings()
    serving: ServingSettings = ServingSettings()
