"""Submit the pipeline to a Kubeflow Pipelines cluster (what `qvl submit` runs).

    KFP_TOKEN=... qvl submit --host https://kfp.example.com/pipeline --experiment vlm-prod \\
        lake_uri=s3://lake/laion-sub eval_data_uri=s3://data/heldout sft_data_uri=s3://data/sft \\
        sft.optim.lr=1e-5 --wait --timeout 259200

`key=value` pairs are either pipeline parameters (`lake_uri=...`, undotted) or dotted preset settings
(`sft.optim.lr=1e-5`, `rl.train.steps=500`). Preset settings are merged into the preset and validated before
anything is sent (a bad key fails naming the setting); the preset is compiled to a temporary YAML with them as
parameter defaults, and each changed stage's whole config is also sent as its `<stage>_config` run parameter,
so the KFP UI shows it with the run. The bearer token comes from the environment (`KFP_TOKEN`) only: it goes
in the Authorization header and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import time
import unicodedata
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from components._shared.platform.credential_shapes import redact, shown  # noqa: F401 - redact: app.submit
from components._shared.platform.names import draws_nothing, hidden_in_name
from pipelines import credentials

# Pipeline parameters settable as `key=value` (the stage configs are set through dotted preset settings).
PIPELINE_PARAMS = (
    "lake_uri",
    "eval_data_uri",
    "sft_data_uri",
    "preference_data_uri",
    "rl_data_uri",
    "base_model_uri",
    "experiment",
)
TOKEN_ENV = "KFP_TOKEN"
SUCCESS_STATES = {"SUCCEEDED"}
# Terminal states that are not a success (a run-level SKIPPED trained nothing). "ERROR" is the v1 API's name.
FAILED_STATES = {"FAILED", "CANCELED", "SKIPPED", "ERROR"}


class SubmitError(ValueError):
    """Bad input, found before anything is sent."""


class RunFailed(RuntimeError):
    """The run ended in a state other than SUCCEEDED."""

    def __init__(self, state: str, message: str):
        super().__init__(message)
        self.state = state


class RunTimeout(TimeoutError):
    """The run was still going when --timeout ran out."""


@dataclass(frozen=True)
class Prepared:
    """What will be sent: the compiled package and the run parameters."""

    package: Path
    params: dict[str, Any]
    preset_name: str


def split_pairs(pairs: list[str], *, later_wins: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """`key=value` pairs -> (pipeline parameters, nested preset overrides); unknown keys fail listing the valid ones.

    Parameter values stay strings (they are all string parameters); dotted settings are parsed as YAML scalars.
    """
    from components._shared.platform.presets import deep_merge, parse_overrides
    from components.stages import STAGES

    params: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    seen: dict[str, str] = {}
    token = os.environ.get(TOKEN_ENV, "").strip()
    for pair in pairs:
        if len(token) >= 8 and token in pair:  # a pasted token: a parameter is stored on the server, shown in the UI
            raise SubmitError(
                f"an override holds the value of {TOKEN_ENV} (not shown): it would be sent as a run parameter or "
                f"setting, stored on the server and shown in the UI (or printed in a message). Remove it: the token "
                f"is read from {TOKEN_ENV} only."
            )
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SubmitError(f"'{pair}' is not key=value (examples: lake_uri=s3://bucket/lake, sft.optim.lr=1e-5).")
        if key in seen and not later_wins:
            raise SubmitError(f"{key} is given twice ({shown(seen[key], 80)!r} and {shown(raw, 80)!r}); give it once.")
        seen[key] = raw
        if "." in key:
            overrides = deep_merge(overrides, parse_overrides([pair]))
        elif key in PIPELINE_PARAMS:
            params[key] = raw
        else:
            stage = key.removesuffix("_config")
            hint = (
                f" Stage settings are dotted: {stage}.SETTING=VALUE (e.g. sft.optim.lr=1e-5)."
                if stage in STAGES
                else " Stage settings are dotted, e.g. sft.optim.lr=1e-5."
            )
            raise SubmitError(f"Unknown pipeline parameter '{key}'. Parameters: {', '.join(PIPELINE_PARAMS)}.{hint}")
    return params, overrides


def read_params_file(path: Path) -> list[str]:
    """A JSON/YAML mapping of pipeline parameters (a data manifest: lake_uri, eval_data_uri, ...) as key=value pairs.

    Keys that are not pipeline parameters fail, listing the valid ones; pairs given after these override them.
    """
    from components._shared.platform import strict_yaml

    if Path(path).exists() and not Path(path).is_file():
        raise SubmitError(
            f"--params-file {path} is not a regular file (a directory or a pipe?); give the JSON/YAML file."
        )
    try:
        data = strict_yaml.load(Path(path).read_text(), f"--params-file {path}")  # JSON is YAML
    except OSError as err:
        raise SubmitError(f"--params-file {path}: {err}") from None
    except ValueError as err:
        raise SubmitError(str(err)) from None
    if not isinstance(data, dict):
        raise SubmitError(
            f'--params-file {path}: expected a mapping of pipeline parameters, e.g. {{"lake_uri": "s3://bucket/lake"}}.'
        )
    unknown = sorted(str(k) for k in data if k not in PIPELINE_PARAMS)
    if unknown:
        raise SubmitError(
            f"--params-file {path}: unknown pipeline parameter(s) {unknown}. Parameters: {', '.join(PIPELINE_PARAMS)}."
        )
    bad = sorted(k for k, v in data.items() if not isinstance(v, str))
    if bad:
        raise SubmitError(f"--params-file {path}: {bad} must be strings (URIs or names).")
    return [f"{key}={value}" for key, value in data.items()]


def prepare(
    preset: str, pairs: list[str], workdir: Path, *, force: bool = False, echo: Callable[[str], None] = print
) -> Prepared:
    """Validate the pairs against the preset and compile it (with the overrides) into `workdir`.

    Every check happens here, before a client exists: a bad setting never reaches the cluster.
    """
    from components.stages import STAGES
    from pipelines.compile import compile_pipeline
    from pipelines.presets import load_preset

    params, overrides = split_pairs(pairs, later_wins=True)  # --params-file's first, the command line's after
    try:
        credentials.check(params, "the run's parameters")  # stored on the server and shown in the UI
        credentials.check(overrides, "the settings given on the command line")
        resolved = load_preset(preset, overrides)  # validates every stage; errors name the setting
    except ValueError as err:
        raise SubmitError(str(err)) from None
    lake_uri = params.get("lake_uri") or resolved.lake_uri
    if not lake_uri:
        raise SubmitError(
            f"lake_uri is required: add lake_uri=s3://BUCKET/PREFIX (preset '{resolved.name}' sets no default lake)."
        )
    params["lake_uri"] = lake_uri
    for name in [k for k in PIPELINE_PARAMS if k.endswith("_uri")]:
        if params.get(name):
            check_cluster_location(name, str(params[name]), echo=echo)
    for stage in overrides:
        if stage in STAGES:  # the whole section: a dict parameter is replaced, not merged, by KFP
            params[f"{stage}_config"] = resolved.stages[stage]

    from pipelines.qvl.memory_plan import preset_refusals

    unfit = preset_refusals(resolved)
    if unfit and not force:
        raise SubmitError(
            "a training stage does not fit its GPUs; change the setting named or pass --force:\n" + "\n".join(unfit)
        )
    for line in unfit:
        echo(f"warning: does not fit (--force): {line}")
    package = compile_pipeline(resolved, workdir / "vlm_training.yaml")  # the preset as read and checked above
    check_no_token(f"the preset {resolved.name!r} (a value in it, compiled into the pipeline)", package.read_text())
    return Prepared(package=Path(package), params=params, preset_name=resolved.name)


def check_cluster_location(name: str, value: str, *, echo: Callable[[str], None] = print) -> None:
    """A run's data location must be one the cluster's pods can read: an s3:// URI with a valid bucket, an absolute
    path on a volume they mount (said as a warning), or for base_model_uri also builtin:NAME or a hub id. A path
    relative to this machine's working directory would name nothing on the cluster."""
    from components._shared.platform.storage import check_location

    try:
        check_location(value, name, builtin=name == "base_model_uri")
    except ValueError as err:
        raise SubmitError(str(err)) from None
    if value.startswith(("s3://", "builtin:")):
        return
    hub_id = name == "base_model_uri" and re.fullmatch(r"[\w.-]+/[\w.-]+", value) and not Path(value).exists()
    if hub_id:
        raise SubmitError(
            f"{name}={value!r} looks like a hub id; the stages read models from s3://, a mounted path or builtin:NAME "
            "only (no hub download on the cluster). Download it once (huggingface-cli download "
            f"{value} --local-dir DIR), upload DIR (aws s3 sync DIR s3://BUCKET/models/NAME) and pass that URI."
        )
    if not value.startswith("/"):
        raise SubmitError(
            f"{name}={value!r} is a path relative to this machine's working directory; the pipeline runs on the "
            f"cluster, whose pods cannot read it. Upload it (aws s3 sync {value} s3://BUCKET/PREFIX) and pass the "
            "s3:// URI, or give an absolute path on a volume the pods mount."
        )
    echo(f"warning: {name}={value} is a local path: the cluster's pods read it only if a volume they mount holds it.")


def check_no_token(flag: str, value: str | None) -> None:
    """Refuse a command-line value holding $KFP_TOKEN's value, without showing it: --host is printed in messages and
    the run's URL, the run's names are stored on the server and shown in the UI (thirteenth pass, F03-F06)."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if value and len(token) >= 8 and (token in value or token in unquote(value)):  # shorter: refused as a token
        raise SubmitError(
            f"{flag} holds the value of {TOKEN_ENV} (not shown): it would be printed in messages or stored on the "
            f"server and shown in the UI. Remove it: the token is read from {TOKEN_ENV} only."
        )


def check_host(host: str) -> None:
    """--host as the KFP client needs it: scheme://HOST[:PORT][/PATH], nothing else (no user, query, blanks, token)."""
    check_no_token("--host", host)
    odd = next((c for c in host if c.isspace() or not c.isprintable() or draws_nothing(c)), None)
    if odd is not None:  # named by its code point: a variation selector printed as itself shows nothing (S04)
        named = f"U+{ord(odd):04X} {unicodedata.name(odd, '')}".strip()
        raise SubmitError(
            f"--host {ascii(shown(host, 200))} holds {ascii(odd)} at character {host.index(odd)} ({named}: a space, "
            "tab or invisible character): a URL has none; retype it as scheme://HOST[:PORT][/PATH]."
        )
    foreign = next((c for c in host if not c.isascii()), None)
    if foreign is not None:  # a look-alike letter (Cyrillic 'а') or a full-width ':' reads as the host it is not
        named = f"U+{ord(foreign):04X} {unicodedata.name(foreign, '')}".strip()
        raise SubmitError(
            f"--host {ascii(shown(host, 200))} holds {ascii(foreign)} at character {host.index(foreign)} ({named}), "
            "not an ASCII character: it can read as another host, which would receive the token. Retype it in "
            "ASCII; an internationalised domain name is given in its xn-- (punycode) form."
        )
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/@]*@", host):
        raise SubmitError(
            f"--host {shown(host, 200)!r} carries a user or password; give the endpoint alone and the token in the "
            f"environment ({TOKEN_ENV}): a credential in --host would be printed in messages and the run's URL."
        )
    scheme, sep, _ = host.partition("://")
    if sep and scheme.lower() in ("http", "https") and scheme not in ("http", "https"):
        raise SubmitError(f"--host '{shown(host, 200)}': write the scheme in lowercase ({scheme.lower()}://).")
    if sep and re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*", scheme) and scheme.lower() not in ("http", "https"):
        raise SubmitError(f"--host '{shown(host, 200)}': the scheme must be http or https (got {scheme}).")
    if not host.startswith(("http://", "https://")):
        raise SubmitError(
            f"--host '{shown(host, 200)}' needs a scheme: https://HOST[/PATH] (or http://127.0.0.1:PORT)."
        )
    try:
        parts = urlsplit(host)
    except ValueError:  # an IPv6 host opened with '[' and not closed
        raise SubmitError(f"--host '{shown(host, 200)}': an IPv6 address opened with '[' is not closed.") from None
    if parts.query or parts.fragment or host.endswith(("?", "#")):
        raise SubmitError(
            f"--host '{shown(host, 200)}' has a query or fragment ('?' or '#'); the client adds the API's paths to "
            "the host, so give scheme://HOST[:PORT][/PATH] alone."
        )
    try:
        port = parts.port
    except ValueError:
        port = 0  # not a number, or past 65535
    if port == 0 and ":" in parts.netloc.rpartition("]")[2]:  # a port was given (after an IPv6 host's ']')
        raise SubmitError(f"--host '{shown(host, 200)}': the port must be a number from 1 to 65535.")
    if not parts.hostname:
        raise SubmitError(f"--host '{shown(host, 200)}' names no host; give https://HOST[/PATH].")


NAMESPACE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")  # a Kubernetes namespace: a DNS-1123 label


def check_submission(experiment: str, run_name: str | None, namespace: str | None) -> None:
    """The names a run is filed under and the token, checked before any request: not empty, no credential shapes
    (they are stored on the server and shown in the UI), a namespace Kubernetes accepts, a token without control
    characters (a token file with Windows line endings; the token itself is never shown)."""
    for flag, value in (("--experiment", experiment), ("--run-name", run_name), ("--namespace", namespace)):
        check_no_token(flag, value)
    for flag, value in (("--experiment", experiment), ("--run-name", run_name)):
        if value is not None and not value.strip():
            raise SubmitError(f"{flag}={value!r} is empty (an unset shell variable?); give a name, or leave it out.")
        if value is not None and any(c in "\n\r\x85\u2028\u2029" for c in value):
            raise SubmitError(f"{flag} holds a line break; give a name on one line.")
        hidden = hidden_in_name(value or "")
        if hidden:  # controls, right-to-left overrides, zero-width characters: a name that reads as another
            raise SubmitError(f"{flag} holds {hidden}, which makes it read as another name in the UI; retype it.")
    try:
        credentials.check({"--experiment": experiment, "--run-name": run_name or ""}, "the run's names")
    except ValueError as err:
        raise SubmitError(str(err)) from None
    if namespace is not None and not NAMESPACE.fullmatch(namespace):
        raise SubmitError(
            f"--namespace {shown(namespace, 80)!r} is not a Kubernetes namespace: lowercase letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters."
        )
    token = os.environ.get(TOKEN_ENV, "")
    if token and (token != token.strip() or any(ord(c) < 32 or ord(c) == 127 for c in token)):
        raise SubmitError(
            f"{TOKEN_ENV} holds a line break, a space at an end or a control character (a token file saved with "
            f"Windows line endings?); strip it: export {TOKEN_ENV}=$(tr -d '\\r\\n ' < FILE). It is not shown."
        )
    if token.lower().startswith("bearer ") or " " in token:
        raise SubmitError(
            f'{TOKEN_ENV} holds a space ("Bearer ..."?): give the token alone; the client adds "Bearer ". It is '
            "not shown."
        )
    if token and len(token) < 8:  # too short to be told from a word in messages: it could not be hidden there
        raise SubmitError(
            f"{TOKEN_ENV} is {len(token)} character(s) long: not a bearer token (a placeholder or a truncated value?); "
            "give the token. It is not shown."
        )
    if not token.isascii():  # an HTTP header is Latin-1 at most, and tokens are ASCII: a pasted wrong value
        raise SubmitError(f"{TOKEN_ENV} holds characters that are not ASCII; a bearer token is ASCII. It is not shown.")


class _QuietKfp(logging.Filter):
    """Drops the root-logger records kfp's client writes (a traceback per health-check attempt, with the server's
    response body, which may repeat the token it was sent)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}kfp{os.sep}" not in record.pathname


PASSING = (502, 503, 504)  # a gateway or proxy between the laptop and a KFP API that is starting or restarting


def check_token_accepted(host: str) -> None:
    """One health-check request with $KFP_TOKEN: a server that refuses it (HTTP 401 / 403), has no KFP API there
    (404) or fails (500, 501, 505 and up) is said so at once; a gateway's or a warming proxy's passing answer (502,
    503, 504), no answer and anything else are left to kfp.Client, which retries for ~25 s."""
    import urllib.error
    import urllib.request

    token = os.environ.get(TOKEN_ENV)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{host.rstrip('/')}/apis/v2beta1/healthz", headers=headers)
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            said = "refused $KFP_TOKEN" if token else "needs a token: set $KFP_TOKEN (docs/submitting.md)"
            raise ValueError(f"{shown(host, 200)} {said} (HTTP {error.code} on its health check).") from None
        if error.code == 404 or (error.code >= 500 and error.code not in PASSING):  # kfp.Client: ~25 s, a timeout
            why = (
                "no KFP API there (a wrong path in --host?)"
                if error.code == 404
                else "a server error: the KFP API is not healthy (kubectl -n kubeflow get pods), retry when it is"
            )
            raise ValueError(f"{shown(host, 200)} answered its health check with HTTP {error.code}: {why}.") from None
    except (urllib.error.URLError, OSError, ValueError):
        pass


def make_client(host: str, namespace: str | None = None):
    """A kfp.Client for `host`, authenticated with $KFP_TOKEN when it is set (never from an argument)."""
    check_host(host)
    check_token_accepted(host)
    import kfp

    quiet, root = _QuietKfp(), logging.getLogger()
    root.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "This client only works with KFP v2.0.0-beta.2 and later"
            return kfp.Client(
                host=host, existing_token=os.environ.get(TOKEN_ENV) or None, namespace=namespace or "kubeflow"
            )
    finally:
        root.removeFilter(quiet)


def run_url(host: str, run_id: str) -> str:
    return f"{host.rstrip('/')}/#/runs/details/{run_id}"


def submit(
    client, prepared: Prepared, *, experiment: str, run_name: str | None = None, namespace: str | None = None
) -> str:
    """Create the experiment when missing and start the run; returns the run id."""
    name = run_name or f"vlm-training {prepared.preset_name} {datetime.now(UTC):%Y-%m-%d %H-%M-%S}"
    with contextlib.redirect_stdout(sys.stderr):  # kfp prints its own links; stdout stays ours
        result = client.create_run_from_pipeline_package(
            str(prepared.package),
            arguments=prepared.params,
            run_name=name,
            experiment_name=experiment,
            namespace=namespace,
        )
    run_id = getattr(result, "run_id", None)
    if not isinstance(run_id, str) or not run_id.strip():  # a proxy or another service answering 200
        raise SubmitError(
            f"the server answered the run request without a run id ({shown(repr(result), 200)}): it may not be the "
            "KFP API (a proxy or login page at --host?), and whether a run started is unknown; check the KFP UI "
            "before submitting again."
        )
    return run_id


def wait(
    client,
    run_id: str,
    *,
    timeout: float | None = None,
    poll_interval: float = 30.0,
    on_state: Callable[[str], None] = lambda state: None,
    max_api_errors: int = 5,
) -> str:
    """Poll the run until it ends; returns "SUCCEEDED", raises RunFailed (naming the state) or RunTimeout.

    Unlike kfp.Client.wait_for_run_completion this ends on CANCELED too, and a few consecutive API errors
    (a restarting API server) are retried instead of failing the wait.
    """
    import kfp_server_api
    import urllib3

    start, seen, errors = time.monotonic(), None, 0
    while True:
        try:
            run = client.get_run(run_id)
            errors = 0
        except (kfp_server_api.ApiException, urllib3.exceptions.HTTPError) as err:
            status = getattr(err, "status", 0) or 0
            errors += 1
            if (400 <= status < 500 and status != 429) or errors > max_api_errors:
                raise
            run = None
        if run is not None:
            state = str(run.state or "RUNTIME_STATE_UNSPECIFIED").upper()
            if state != seen:
                on_state(state)
                seen = state
            if state in SUCCESS_STATES:
                return state
            if state in FAILED_STATES:
                detail = getattr(run.error, "message", None) if run.error else None
                raise RunFailed(
                    state, f"Run {run_id} finished in state {state}" + (f": {detail}" if detail else "") + "."
                )
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            raise RunTimeout(
                f"Run {run_id} is still {seen or 'unknown'} after {timeout:g}s (--timeout); it keeps "
                "running on the cluster."
            )
        time.sleep(poll_interval if timeout is None else max(0.0, min(poll_interval, timeout - elapsed)))


def compile_and_submit(
    *,
    host: str,
    experiment: str,
    preset: str,
    pairs: list[str],
    run_name: str | None,
    namespace: str | None,
    echo: Callable[[str], None],
    params_file: Path | None = None,
    force: bool = False,
) -> tuple[Any, str]:
    """Validate, plan (a training stage that cannot fit its GPUs stops here unless `force`), compile into a temporary
    directory, submit; returns (client, run_id)."""
    with tempfile.TemporaryDirectory(prefix="qvl-submit-") as tmp:
        try:  # everything before the client: a refusal here means nothing was sent (exit 2, not "submitting failed")
            check_host(host)
            check_submission(experiment, run_name, namespace)
            split_pairs(pairs)  # the command line's own pairs: a key given twice there is refused
            if params_file is not None:
                pairs = read_params_file(params_file) + list(pairs)
            prepared = prepare(preset, pairs, Path(tmp), force=force, echo=echo)
        except SubmitError:
            raise
        except ValueError as err:  # a setting, an override or the preset
            raise SubmitError(str(err)) from err
        client = make_client(host, namespace)
        run_id = submit(client, prepared, experiment=experiment, run_name=run_name, namespace=namespace)
    echo(f"Run URL: {run_url(host, run_id)}")
    echo(f"Run id:  {run_id}")
    return client, run_id
