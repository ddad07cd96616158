"""Values that look like credentials never enter a compiled pipeline or a submitted run's parameters.

A KFP parameter is stored in the compiled YAML, the run's record on the server and the UI, readable by anyone who
can see the run. Credentials belong in the Kubernetes secrets the cluster profile mounts (pipelines/k8s.py:
`cluster.s3_secret` for AWS_*, `cluster.mlflow_secret` for MLflow auth; manifests/). `check` is called on every
preset's settings when the pipeline is built (compile, `qvl run --local`, submit) and on the submitted parameters.

Detected: cloud and service keys by their published shapes (AWS access key ids, GitHub, Hugging Face, OpenAI,
Slack, Google API keys, Databricks tokens, JWTs, PEM private keys, AWS session tokens), URLs carrying a password
(`scheme://user:pw@`) or a credential in their query (`?X-Amz-Security-Token=`, `?aws_secret_access_key=`, `?sig=`),
and a non-trivial value under a setting named like a secret (`*_secret`, `password`, `*_token`, `api_key`, ...).
The error names the setting and the kind, never the value.
"""

from __future__ import annotations

import re
from typing import Any

SHAPES = (
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[0-9A-Z]{16}\b")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})\b")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("an OpenAI-style API key", re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{20,}\b")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b")),
    ("a Databricks token", re.compile(r"\bdapi[0-9a-f]{32}\b")),
    ("a JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a URL with a password", re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:[^/\s@]+@")),
    # AWS session tokens are base64 of a protobuf whose first bytes are fixed: "IQoJb3JpZ2lu..." today, "FwoG..." before
    ("an AWS session token", re.compile(r"\b(?:IQoJb3JpZ2lu|FwoGZXIvYXdz|FQoGZXIvYXdz)[A-Za-z0-9/+=]{16,}")),
    (
        "a URL whose query carries a credential",
        re.compile(
            r"[?&;](?:x-amz-(?:security-token|credential|signature)|aws_(?:secret_access_key|session_token|access_key_id)"
            r"|(?:access_|auth_|session_|id_)?token|secret(?:_key)?|password|passwd|api_?key|key|sig|signature)=[^&\s]+",
            re.IGNORECASE,
        ),
    ),
)
SECRET_NAME = re.compile(
    r"(?:^|_)(?:secret|secret_key|password|passwd|token|api_key|apikey|access_key|private_key|credentials?|auth)$",
    re.IGNORECASE,
)
SECRET_NAMES_OK = {"s3_secret", "mlflow_secret"}  # the *names* of Kubernetes secrets, not their values
HINT = (
    "Remove it, rotate it if it was shared, and let the pod read it from a Kubernetes secret instead: the cluster "
    "profile mounts cluster.s3_secret (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL) and "
    "cluster.mlflow_secret (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN / USERNAME / PASSWORD) as environment "
    "variables (docs/submitting.md, manifests/); `qvl submit` reads the KFP token from $KFP_TOKEN."
)


def findings(value: Any, where: str = "") -> list[str]:
    """'setting: kind' for each value under `value` (dicts and lists walked) that looks like a credential."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            if (
                isinstance(item, str)
                and str(key) not in SECRET_NAMES_OK
                and SECRET_NAME.search(str(key))
                and _nontrivial(item)
            ):
                found.append(f"{path}: a value under a setting named like a secret")
            else:
                found += findings(item, path)
    elif isinstance(value, list | tuple):
        for n, item in enumerate(value):
            found += findings(item, f"{where}[{n}]")
    elif isinstance(value, str):
        found += [f"{where or '(value)'}: {kind}" for kind, shape in SHAPES if shape.search(value)]
    return found


def check(value: Any, what: str) -> None:
    """Raise ValueError naming every credential-like setting of `value` (a preset, the run's parameters)."""
    found = findings(value)
    if found:
        listed = "\n  ".join(found[:20])
        raise ValueError(f"{what} holds what looks like a credential (the value is not shown):\n  {listed}\n{HINT}")


def _nontrivial(text: str) -> bool:
    """A value worth refusing under a secret-like name: 8+ characters, no spaces (not 'none', '', a comment)."""
    stripped = text.strip()
    return len(stripped) >= 8 and " " not in stripped and stripped.lower() not in ("changeme", "required")
