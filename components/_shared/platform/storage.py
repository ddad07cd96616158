"""Files at local paths or `s3://bucket/prefix` URIs, with atomic, checksummed publication of directories.

S3 goes through boto3: adaptive retries, multipart transfers above a threshold, SHA-256 checksums
requested from S3 where supported, path-style addressing when a custom endpoint is set (SeaweedFS,
MinIO). Credentials and endpoint come from the standard environment variables, which boto3 reads itself:
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_DEFAULT_REGION.

A published prefix is *committed* once `_COMMITTED.json` exists in it. `publish_dir` writes that marker
last; it lists every file with size and sha256, and `fetch_dir` verifies each downloaded file against it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from components._shared.platform import s3_client
from components._shared.platform.names import misread_in_path
from components._shared.platform.s3_body import ResumableBody
from components._shared.platform.uri_text import shown, symlink_loop

COMMIT_MARKER = "_COMMITTED.json"
LOCK_FILES = (".qvl-lock", ".qvl-lock.json")  # platform/locks.py: the OS lock and its holder; never committed
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class IntegrityError(ValueError):
    """A published prefix is uncommitted, or a file does not match its commit marker."""


def is_s3(uri: str | Path) -> bool:
    return str(uri).startswith("s3://")


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")


def check_location(value: str, setting: str, *, builtin: bool = False) -> str:
    """`value` if it is a local path or an s3:// URI (or builtin:NAME where `builtin`); else a ValueError naming
    the setting: http(s)://, gs://, hf:// ... (not a folder named 'http:'), an empty value (not the working
    directory), what a listing hides or draws as '/' but is a letter (names.misread_in_path), `..` in an s3 key."""
    text = str(value)
    if not text.strip():
        raise ValueError(
            f"{setting}={text!r} is empty (an unset shell variable gives one), which would mean the working "
            "directory; give a local path or an s3:// URI."
        )
    misread = misread_in_path(text)
    if misread:
        raise ValueError(f"{setting}={shown(text)!r} {misread}")
    if text.startswith("~"):
        raise ValueError(
            f"{setting}={shown(text)!r} starts with '~', which no shell expanded (it was quoted, or read from a file): "
            "write the full path ($HOME/...)."
        )
    found = _SCHEME.match(text)
    if builtin and text.startswith("builtin:"):
        return text
    if re.match(r"(?i)s3:/?(?!/)", text):  # `s3:/bucket/x` or `s3:bucket/x`: a local path named 's3:' otherwise
        raise ValueError(f"{setting}={shown(text)!r}: an s3 URI starts with two slashes: write s3://BUCKET/PREFIX.")
    if found and not text.startswith("s3://"):
        raise ValueError(
            f"{setting}={shown(text)!r}: only local paths and s3:// URIs are supported here, not {found.group(1)}:// "
            "(copy it to S3 or to a local / mounted path first)."
        )
    if text.startswith("s3://") and "?" in text and "=" in text.partition("?")[2]:
        raise ValueError(
            f"{setting}={shown(text)!r}: an s3:// URI takes no query (?name=value); credentials come from the "
            "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, a Kubernetes secret on the "
            "cluster), not the URI. Remove everything from '?'."
        )
    if text.startswith("s3://"):
        try:
            _, key = split_s3(text)  # a malformed bucket is an error here, not at the first request
        except ValueError as err:
            raise ValueError(f"{setting}: {err}") from None
        parts = key.split("/")  # S3 keeps `a/../b` and `a//b` literally: other objects than a file system's
        odd = next((f"a {p!r} part" for p in parts if p in (".", "..")), None) or (
            "an empty part ('//')" if "" in parts[:-1] else None
        )
        if odd is not None:
            raise ValueError(
                f"{setting}={shown(text)!r}: the key holds {odd}, which S3 keeps as written (no folder is left); "
                "write the prefix out plainly."
            )
    elif not (builtin and text.startswith("builtin:")) and (loop := symlink_loop(text)):
        raise ValueError(f"{setting}={shown(text)!r}: {loop}")
    return text


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b"). Raises ValueError naming the URI when it is malformed."""
    if not is_s3(uri):
        raise ValueError(f"{shown(uri)!r} is not an S3 URI: expected s3://bucket/key (lowercase 's3://').")
    bucket, _, key = str(uri)[5:].partition("/")
    if "@" in bucket:
        raise ValueError(
            f"{shown(uri)!r} carries credentials (user:password@): an s3:// URI takes none; they come from the "
            "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a Kubernetes secret on the cluster)."
        )
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(
            f"{shown(uri)!r} has an invalid bucket name {shown(bucket)!r}: use 3-63 lowercase letters, digits, "
            f"'.' or '-', as in s3://my-bucket/prefix."
        )
    if "//" in key:
        raise ValueError(f"{shown(uri)!r} contains an empty path segment ('//'); remove the doubled slash.")
    return bucket, key


def join(uri: str | Path, *parts: str) -> str:
    """Append path parts to a local path or S3 URI."""
    if not is_s3(uri):
        return str(Path(_local(uri), *parts))
    cleaned = [p.strip("/") for p in (str(uri).rstrip("/"), *parts) if p.strip("/")]
    return "/".join(cleaned)


def _local(uri: str | Path) -> Path:
    text = str(uri)
    if text.lower().startswith("s3:") or text.startswith("S3://"):
        raise ValueError(f"{shown(text)!r} looks like a malformed S3 URI: write it as s3://bucket/key.")
    return Path(text)


# --- single files ----------------------------------------------------------------------------------


def exists(uri: str | Path) -> bool:
    """True for an existing file or a non-empty directory / S3 prefix."""
    if not is_s3(uri):
        return _local(uri).exists()
    bucket, key = split_s3(str(uri))
    if key and _head_or_missing(bucket, key, str(uri)):
        return True
    with s3_client.errors(str(uri)):
        prefix = key.rstrip("/") + "/" if key else ""
        return s3_client.client().list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0) > 0


def _head_or_missing(bucket: str, key: str, uri: str) -> bool:
    try:
        with s3_client.errors(uri):
            s3_client.client().head_object(Bucket=bucket, Key=key)
        return True
    except FileNotFoundError:
        return False


def list_files(prefix_uri: str | Path, *, suffix: str | None = None) -> list[str]:
    """Every file under a directory or S3 prefix (recursive), as full URIs, sorted."""
    if not is_s3(prefix_uri):
        root = _local(prefix_uri)
        found = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
        return sorted(str(p) for p in found if suffix is None or p.name.endswith(suffix))
    bucket, key = split_s3(str(prefix_uri))
    prefix = key.rstrip("/") + "/" if key else ""
    out = []
    with s3_client.errors(str(prefix_uri)):
        for page in s3_client.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [
                f"s3://{bucket}/{o['Key']}"
                for o in page.get("Contents", [])
                if not o["Key"].endswith("/") and (suffix is None or o["Key"].endswith(suffix))
            ]
    return sorted(out)


def list_etags(prefix_uri: str) -> dict[str, str]:
    """Every object under an S3 prefix as {key relative to the prefix: "size:ETag"} (its content's identity)."""
    bucket, key = split_s3(str(prefix_uri))
    prefix = key.rstrip("/") + "/" if key else ""
    out: dict[str, str] = {}
    with s3_client.errors(str(prefix_uri)):
        for page in s3_client.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"][len(prefix) :]] = f"{o['Size']}:{o['ETag']}"
    return out


def read_bytes(uri: str | Path) -> bytes:
    with open_read(uri) as stream:
        return stream.read()


def read_range(uri: str | Path, start: int, length: int) -> bytes:
    """`length` bytes from byte `start` (fewer at the end of the file): one ranged GET on S3, a seek locally."""
    if length <= 0:
        return b""
    if not is_s3(uri):
        with open(_local(uri), "rb") as handle:
            handle.seek(start)
            return handle.read(length)
    bucket, key = split_s3(str(uri))
    with s3_client.errors(str(uri)):
        response = s3_client.client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")
        return response["Body"].read()


def write_bytes(uri: str | Path, data: bytes) -> None:
    """Write a whole file: atomically (temp file + rename) locally, one checksummed PUT on S3."""
    if is_s3(uri):
        bucket, key = split_s3(str(uri))
        with s3_client.errors(str(uri)):
            s3_client.client().put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256")
        return
    path = _local(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def open_read(uri: str | Path) -> Iterator[IO[bytes] | ResumableBody]:
    """A binary stream: the S3 object's body (resumed across broken connections), or the local file."""
    if not is_s3(uri):
        with open(_local(uri), "rb") as handle:
            yield handle
        return
    body = ResumableBody(str(uri), *split_s3(str(uri)))
    try:
        yield body
    finally:
        body.close()


def download_file(uri: str | Path, local_path: str | Path, *, multipart_threshold: int | None = None) -> Path:
    """Copy one file to `local_path` (parents created; the file appears complete or not at all)."""
    dest = Path(local_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex}")
    try:
        if is_s3(uri):
            bucket, key = split_s3(str(uri))
            with s3_client.errors(str(uri)):
                s3_client.client().download_file(
                    bucket, key, str(tmp), Config=s3_client.transfer_config(multipart_threshold)
                )
        else:
            shutil.copyfile(_local(uri), tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def upload_file(local_path: str | Path, uri: str | Path, *, multipart_threshold: int | None = None) -> None:
    """Copy one local file to `uri`; multipart above `multipart_threshold` bytes (default 64 MiB)."""
    if not is_s3(uri):
        download_file(local_path, _local(uri))  # a local copy: same temp-file-and-rename path
        return
    bucket, key = split_s3(str(uri))
    with s3_client.errors(str(uri)):
        s3_client.client().upload_file(
            str(local_path),
            bucket,
            key,
            Config=s3_client.transfer_config(multipart_threshold),
            ExtraArgs={"ChecksumAlgorithm": "SHA256"},
        )


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- committed directories -------------------------------------------------------------------------


def _marker_for(source: Path) -> tuple[list[Path], dict[str, Any]]:
    """The files of a directory (marker excluded) and the `_COMMITTED.json` content that lists them."""
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a directory.")
    files = _output_files(source)
    marker = {
        "files": {
            p.relative_to(source).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in files
        },
        "created": datetime.now(UTC).isoformat(),
    }
    return files, marker


def _output_files(source: Path, under: Path | None = None) -> list[Path]:
    """The files a commit lists: all but the marker, lock files and set-aside runs (`ROOT.stale-KEY/` folders; a
    file named `.stale-` is listed: a reader that globs a folder would read it)."""
    return sorted(
        p
        for p in (under or source).rglob("*")
        if p.is_file()
        and p.relative_to(source).as_posix() != COMMIT_MARKER
        and p.name not in LOCK_FILES
        and not any(".stale-" in part for part in p.relative_to(source).parts[:-1])  # another run's, set aside
    )


def commit_dir(local_dir: str | Path) -> dict:
    """Mark a finished local output directory as committed, in place: `_COMMITTED.json` written last, atomically.
    Files written owner-only (safetensors saves weights 0600) get the modes the process's umask gives any other
    file, so the next stage's pod or a server running as another user can read the model."""
    files, marker = _marker_for(Path(local_dir))
    _modes_by_umask(files)
    write_bytes(Path(local_dir) / COMMIT_MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
    return marker


def _modes_by_umask(files: list[Path]) -> None:
    """Give owner-only files (no group or other bits) the read/write modes the umask allows new files."""
    mask = os.umask(0)
    os.umask(mask)
    wanted = 0o666 & ~mask
    for path in files:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077 == 0 and wanted & 0o077:
            path.chmod(mode | (wanted & 0o066))


def verify_dir(local_dir: str | Path, under: str = "") -> int:
    """Check a local committed directory (or only its subfolder `under`, the part a reader reads) against its
    marker: every listed file whole, none listed outside it, none there that it does not list (added after the
    commit: readers that list a folder would read them). Returns the number of files verified."""
    root = Path(local_dir)
    marker = read_marker(root)
    outside = [r for r in marker["files"] if r.startswith("/") or ".." in r.split("/")]
    if outside:
        raise IntegrityError(
            f"{root / COMMIT_MARKER} lists {outside[0]!r}, outside {root}; re-run the stage that produced {root}."
        )
    inside = under.strip("/") if under.strip("/") != "." else ""
    prefix = f"{inside}/" if inside else ""
    listed = {r: e for r, e in marker["files"].items() if r.startswith(prefix)}
    unlisted = [
        p.relative_to(root).as_posix()
        for p in _output_files(root, root / prefix if prefix else None)
        if p.relative_to(root).as_posix() not in listed
    ]
    if unlisted:
        shown = ", ".join(unlisted[:3]) + (f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else "")
        raise IntegrityError(
            f"{root} holds files its {COMMIT_MARKER} does not list ({shown}): added after the stage committed it. "
            f"Remove them, or re-run the stage that produced {root}."
        )
    for relative, expected in sorted(listed.items()):
        path = root / relative
        if not path.is_file() or path.stat().st_size != expected["size"] or sha256_file(path) != expected["sha256"]:
            links = path.stat().st_nlink - 1 if path.is_file() else 0  # the SFT builder links the data it was given
            linked = f"it has {links} other hard link{'s' * (links > 1)}: a file linked elsewhere was edited in place; "
            raise IntegrityError(
                f"{path} does not match {COMMIT_MARKER} (missing, truncated or modified); {linked if links else ''}"
                f"re-run the stage that produced {root}."
            )
    return len(listed)


def publish_dir(local_dir: str | Path, dest_uri: str | Path, *, multipart_threshold: int | None = None) -> dict:
    """Copy every file of `local_dir` to `dest_uri`, then write `_COMMITTED.json` last; return the marker.

    Local destinations are filled in a sibling temp dir and renamed into place (a previous publication
    at `dest_uri` is replaced). On S3 an old marker is deleted first, so readers never see a marker
    that does not match the files.
    """
    source = Path(local_dir)
    files, marker = _marker_for(source)
    marker_bytes = json.dumps(marker, indent=1, sort_keys=True).encode()
    if is_s3(dest_uri):
        bucket, key = split_s3(str(dest_uri))
        with s3_client.errors(str(dest_uri)):
            s3_client.client().delete_object(Bucket=bucket, Key=join(key, COMMIT_MARKER) if key else COMMIT_MARKER)
        for path in files:
            upload_file(
                path, join(str(dest_uri), path.relative_to(source).as_posix()), multipart_threshold=multipart_threshold
            )
        write_bytes(join(str(dest_uri), COMMIT_MARKER), marker_bytes)
        return marker
    dest = _local(dest_uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.publish-", dir=dest.parent))
    try:
        for path in files:
            target = staging / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        (staging / COMMIT_MARKER).write_bytes(marker_bytes)
        if dest.exists():
            retired = dest.with_name(f".{dest.name}.retired-{uuid.uuid4().hex}")
            os.replace(dest, retired)
            shutil.rmtree(retired, ignore_errors=True)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return marker


def is_committed(uri: str | Path) -> bool:
    marker = join(uri, COMMIT_MARKER)
    if not is_s3(marker):
        return Path(marker).is_file()
    bucket, key = split_s3(marker)
    return _head_or_missing(bucket, key, marker)


def read_marker(uri: str | Path) -> dict[str, Any]:
    """The parsed `_COMMITTED.json` of a published prefix; IntegrityError when there is none."""
    try:
        marker = json.loads(read_bytes(join(uri, COMMIT_MARKER)))
    except FileNotFoundError as error:
        raise IntegrityError(
            f"{uri} is not committed (no {COMMIT_MARKER}): its publication never finished; "
            f"re-run the stage that produces it."
        ) from error
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past the parser
        raise IntegrityError(
            f"{join(uri, COMMIT_MARKER)} is not JSON (damaged or replaced); re-run the stage that produces {uri}."
        ) from None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise IntegrityError(f"{join(uri, COMMIT_MARKER)} is malformed: expected {{'files': {{...}}, 'created': ...}}.")
    for name, entry in marker["files"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("size"), int)
            and not isinstance(entry.get("size"), bool)
        ):
            raise IntegrityError(
                f"{join(uri, COMMIT_MARKER)} is malformed: its entry for {name!r} is not "
                f"{{'size': int, 'sha256': str}} (damaged or edited); re-run the stage that produces {uri}."
            )
    return marker


def fetch_dir(uri: str | Path, local_dir: str | Path, *, require_commit: bool = True) -> Path:
    """Download a published prefix into `local_dir`, verifying every file's size and sha256 against the marker.

    With `require_commit=False` a prefix without a marker is copied as is (nothing to verify against).
    """
    dest = Path(local_dir)
    if not require_commit and not is_committed(uri):
        for file_uri in list_files(uri):
            relative = (
                file_uri[len(str(uri).rstrip("/")) + 1 :]
                if is_s3(uri)
                else Path(file_uri).relative_to(_local(uri)).as_posix()
            )
            download_file(file_uri, dest / relative)
        return dest
    marker = read_marker(uri)
    for relative, expected in sorted(marker["files"].items()):
        if relative.startswith("/") or ".." in Path(relative).parts:
            raise IntegrityError(f"{join(uri, COMMIT_MARKER)} lists an unsafe path {relative!r}.")
        file_uri, target = join(uri, relative), dest / relative
        try:
            download_file(file_uri, target)
        except FileNotFoundError as error:
            raise IntegrityError(f"{file_uri} is listed in {COMMIT_MARKER} but missing; re-publish {uri}.") from error
        size, digest = target.stat().st_size, sha256_file(target)
        if size != expected["size"] or digest != expected["sha256"]:
            target.unlink()
            raise IntegrityError(
                f"{file_uri} does not match {COMMIT_MARKER}: size {size} sha256 {digest[:12]}..., "
                f"expected size {expected['size']} sha256 {expected['sha256'][:12]}...; the object "
                f"was modified or corrupted after publication; re-publish {uri}."
            )
    write_bytes(dest / COMMIT_MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
    return dest


def list_committed(prefix_uri: str | Path) -> list[str]:
    """Immediate children of a directory / S3 prefix that hold a commit marker, sorted (others are ignored)."""
    if not is_s3(prefix_uri):
        root = _local(prefix_uri)
        directories = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return [str(p) for p in directories if (p / COMMIT_MARKER).is_file()]
    bucket, key = split_s3(str(prefix_uri))
    prefix = key.rstrip("/") + "/" if key else ""
    children: list[str] = []
    with s3_client.errors(str(prefix_uri)):
        for page in (
            s3_client.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
        ):
            children += [f"s3://{bucket}/{p['Prefix'].rstrip('/')}" for p in page.get("CommonPrefixes", [])]
    return sorted(child for child in children if is_committed(child))
