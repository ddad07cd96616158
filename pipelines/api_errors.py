"""What talking to the KFP API can raise, and one line for it with the token hidden (qvl submit and qvl wait)."""

from __future__ import annotations

import os

from components._shared.platform.credential_shapes import shown


def api_errors() -> tuple[type[BaseException], ...]:
    """What talking to the API can raise: refusals (ApiException), network errors, kfp's healthz TimeoutError and
    its ValueErrors (e.g. two experiments with the name)."""
    import kfp_server_api
    import urllib3

    return kfp_server_api.ApiException, urllib3.exceptions.HTTPError, OSError, TimeoutError, ValueError


def describe_api_error(err: BaseException) -> str:
    """One line for an API refusal or a network error (kfp_server_api.ApiException carries status and body)."""
    status, reason, body = getattr(err, "status", None), getattr(err, "reason", None), getattr(err, "body", None)
    if status:
        text = f"HTTP {status} {reason or ''}".strip()
        text = f"{text}: {body.decode() if isinstance(body, bytes) else body}" if body else text
    else:
        text = f"{type(err).__name__}: {err}"
    from pipelines.submit import TOKEN_ENV

    token = os.environ.get(TOKEN_ENV, "")
    # submit refuses a token under 8 characters; replaced, "e" would turn every e of the message into <KFP_TOKEN>
    return shown(text.replace(token, "<KFP_TOKEN>") if len(token.strip()) >= 8 else text, 2000)
