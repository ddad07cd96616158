"""Preflight's check of the MLflow tracking server: reachable, and this pod's login accepted."""

from __future__ import annotations

import os


def check_tracking_server(timeout_s: float) -> str:
    """Reach an HTTP MLflow server's /health, then one authenticated API call (a server that wants a login answers
    /health without one); file and sqlite stores need no check. In a KFP task pod an unset MLFLOW_TRACKING_URI is
    an error: every stage would track into a throwaway sqlite file in its own pod."""
    from components._shared.platform.mlflow_runs import KFP_RUN_ENV

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri and os.environ.get(KFP_RUN_ENV):
        raise ValueError(
            "MLFLOW_TRACKING_URI is not set in this KFP task pod: the Secret named by cluster.mlflow_secret (default "
            "qvl-mlflow) is missing from the run's namespace or has no MLFLOW_TRACKING_URI key, so every stage would "
            "log its metrics and register its model in a sqlite file inside its own pod, lost when the pod ends. "
            "Create it (kubectl -n NAMESPACE create secret generic qvl-mlflow "
            "--from-literal=MLFLOW_TRACKING_URI=http://mlflow.qvl.svc.cluster.local:5000; docs/operations.md), "
            "or set preflight.check_tracking: false to run without a tracking server on purpose."
        )
    if not uri.startswith(("http://", "https://")):
        return "local"
    try:
        health = _mlflow_get(uri, "/health", timeout_s)
    except ValueError as err:
        raise ValueError(
            f"MLflow tracking server {uri} is not reachable ({err.__cause__}). Check MLFLOW_TRACKING_URI and that the "
            "server is up (manifests/ deploys one)."
        ) from err
    if health.status_code != 200:
        raise ValueError(f"MLflow tracking server {uri} is not reachable (/health answered HTTP {health.status_code}).")
    check_tracking_login(uri, timeout_s)
    return "server"


def _mlflow_get(uri: str, endpoint: str, timeout_s: float, **params):
    """One GET as MLflow's own client sends it: its credentials (MLFLOW_TRACKING_TOKEN, _USERNAME/_PASSWORD,
    MLFLOW_TRACKING_AUTH) and TLS settings (MLFLOW_TRACKING_SERVER_CERT_PATH, _INSECURE_TLS), no retries."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        return http_request(
            get_default_host_creds(uri.rstrip("/")),
            endpoint,
            "GET",
            params=params or None,
            max_retries=0,
            timeout=timeout_s,
            raise_on_status=False,
        )
    except (OSError, MlflowException) as err:
        raise ValueError(f"GET {endpoint} failed") from err


def check_tracking_login(uri: str, timeout_s: float) -> None:
    """One API call with the credentials MLflow itself would send, so a missing or wrong login fails here and not
    at a stage's first metric (/health answers without a login)."""
    try:
        response = _mlflow_get(uri, "/api/2.0/mlflow/experiments/search", timeout_s, max_results=1)
    except ValueError as err:
        raise ValueError(f"MLflow tracking server {uri} failed an experiments search ({err.__cause__}).") from err
    if response.status_code in (401, 403):
        raise ValueError(
            f"MLflow tracking server {uri} refused this pod's credentials (HTTP {response.status_code}). Put "
            "MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, into the Secret named "
            "by cluster.mlflow_secret (default qvl-mlflow)."
        )
    if response.status_code != 200:
        raise ValueError(
            f"MLflow tracking server {uri} answered HTTP {response.status_code} to an experiments search "
            f"({response.text[:200]!r}); check MLFLOW_TRACKING_URI points at the MLflow server itself."
        )
