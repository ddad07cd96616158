"""An S3 object's body read as a stream that survives a connection broken mid-read (storage.open_read)."""

from __future__ import annotations

import io
import time
from typing import Any

from components._shared.platform import s3_client

STREAM_ATTEMPTS = 6


class ResumableBody(io.RawIOBase):
    """An S3 object's body that survives a connection broken mid-read (a reset, a truncated answer, a read
    timeout): the read is retried with a GET of the rest of the object (`Range` from the bytes already returned,
    `If-Match` the first answer's ETag, so a replaced object is an error, never a splice). boto3 retries
    failed *requests* itself; nothing retries a body that breaks after the answer started. The first GET asks
    for the object's checksum (validated when the whole body is read in one go)."""

    def __init__(self, uri: str, bucket: str, key: str) -> None:
        super().__init__()
        self.uri = uri
        self.bucket, self.key = bucket, key
        self.offset, self.etag = 0, None
        self.body = self._get()

    def _get(self):
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key}
        if self.offset:
            kwargs["Range"] = f"bytes={self.offset}-"
        else:
            kwargs["ChecksumMode"] = "ENABLED"
        if self.etag:
            kwargs["IfMatch"] = self.etag
        with s3_client.errors(self.uri):
            response = s3_client.client().get_object(**kwargs)
        self.etag = self.etag or response.get("ETag")
        return response["Body"]

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        from botocore.exceptions import (
            FlexibleChecksumError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        for attempt in range(STREAM_ATTEMPTS):
            try:
                data = self.body.read(None if size is None or size < 0 else size)
                self.offset += len(data)
                return data
            except (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, FlexibleChecksumError) as error:
                if attempt == STREAM_ATTEMPTS - 1:
                    raise OSError(
                        f"reading {self.uri} broke off {STREAM_ATTEMPTS} times at byte {self.offset}: {error}"
                    ) from error
                # a checksum mismatch of a whole-object read means nothing was kept: start that read again
                self.body.close()
                time.sleep(min(2.0, 0.05 * 2**attempt))
                self.body = self._get()
        raise AssertionError("unreachable")

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.body.close()
        super().close()
