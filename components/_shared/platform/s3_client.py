"""The boto3 side of storage.py: one S3 client per credential set, the transfer settings, and botocore errors
turned into built-in ones whose message names the URI and what to do.

Endpoint, credentials and region come from the standard AWS variables (AWS_ENDPOINT_URL for non-AWS S3 such as
MinIO or SeaweedFS); on Kubernetes they are mounted from the S3 secret.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

from components._shared.platform.env_numbers import env_number

MULTIPART_ENV, MULTIPART_DEFAULT_MB = "QVL_S3_MULTIPART_THRESHOLD_MB", 64.0


_CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for non-AWS S3); "
    "on Kubernetes, mount them from the S3 secret (manifests/, pipelines/k8s.py)"
)


def client():
    """The S3 client for the current AWS_* environment (cached per distinct setting)."""
    env = tuple(
        os.environ.get(k)
        for k in (
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
        )
    )
    return _client_for(env)


@functools.lru_cache(maxsize=8)
def _client_for(env: tuple[str | None, ...]):
    import boto3
    from botocore.config import Config

    custom_endpoint = bool(env[0] or env[1])
    config = Config(
        retries={"mode": "adaptive", "max_attempts": 10},
        s3={"addressing_style": "path" if custom_endpoint else "auto"},
        request_checksum_calculation="when_supported",
        response_checksum_validation="when_supported",
    )
    region = env[4] or env[5] or "us-east-1"
    client = boto3.session.Session().client("s3", region_name=region, config=config)
    if custom_endpoint:
        # SeaweedFS stalls a PUT sent with "Expect: 100-continue" after a zero-byte PUT on the same
        # connection (until the read timeout). The header only saves bandwidth on rejected uploads.
        from botocore.handlers import add_expect_header

        client.meta.events.unregister("before-call.s3", add_expect_header)
    client.meta.events.register("needs-retry.s3", _say_connection_retries)
    return client


def _endpoint() -> str:
    """The S3 endpoint requests go to, for messages (a password in it hidden)."""
    from components._shared.platform.credential_shapes import redact

    return redact(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3")


def _say_connection_retries(attempts: int = 0, caught_exception: BaseException | None = None, **_) -> None:
    """A warning when a request could not connect (botocore retries it up to 10 times over about a minute), at the
    first failure and the fifth, instead of a silent minute before the error; returns None, so botocore's own retry
    decision stands."""
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(caught_exception, BotoConnectionError) and attempts in (1, 5):
        endpoint = _endpoint()
        print(
            f"warning: S3 endpoint {endpoint} did not answer ({type(caught_exception).__name__}, attempt {attempts}); "
            "retrying for up to a minute. Check AWS_ENDPOINT_URL and that the S3 service is up.",
            file=sys.stderr,
            flush=True,
        )


def transfer_config(multipart_threshold: int | None):
    """boto3 transfer settings: multipart above the threshold (QVL_S3_MULTIPART_THRESHOLD_MB, default 64)."""
    from boto3.s3.transfer import TransferConfig

    if multipart_threshold is None:
        mb = env_number(MULTIPART_ENV, MULTIPART_DEFAULT_MB, unit="MB")
        multipart_threshold = int(mb * 1024**2)
    threshold = multipart_threshold
    return TransferConfig(multipart_threshold=threshold, multipart_chunksize=max(threshold, 5 * 1024**2))


@contextlib.contextmanager
def errors(uri: str) -> Iterator[None]:
    """Turn botocore errors into built-in ones whose message names the URI and what to do."""
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    try:
        yield
    except NoCredentialsError as error:
        raise PermissionError(f"No S3 credentials to access {uri}: {_CREDENTIALS_HINT}.") from error
    except EndpointConnectionError as error:
        raise ConnectionError(
            f"Cannot reach the S3 endpoint for {uri} ({error}); check AWS_ENDPOINT_URL and that the S3 service is up."
        ) from error
    except ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        listing = error.operation_name in ("ListObjectsV2", "ListObjects")
        if listing and status == 404 and code != "NoSuchBucket":  # S3 answers a listing's 404 with NoSuchBucket
            endpoint = _endpoint()
            raise ConnectionError(
                f"Listing {uri} got a bare HTTP 404 from {endpoint}, which an S3 service never answers to a listing "
                "(a missing bucket is NoSuchBucket): the endpoint is not an S3 API; check AWS_ENDPOINT_URL (host, "
                "port, path)."
            ) from error
        if code in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(f"{uri} does not exist.") from error
        if code == "NoSuchBucket":
            raise FileNotFoundError(f"Bucket of {uri} does not exist; create it or fix the URI.") from error
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise PermissionError(
                f"S3 refused access to {uri} ({code}): check the credentials; {_CREDENTIALS_HINT}."
            ) from error
        raise OSError(f"S3 request for {uri} failed: {error}") from error
    except BotoCoreError as error:
        raise OSError(f"S3 request for {uri} failed: {error}") from error
