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

from components._shared.platform.credential_shapes import SHAPES

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
