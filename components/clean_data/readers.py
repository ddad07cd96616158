"""Stream records out of lake shards: WebDataset tars (in memory, never extracted) and Parquet files.

A record is the members of a tar that share a key (`KEY.jpg`, `KEY.txt`, `KEY.json`), or one Parquet row.
Readers never raise for bad content: unsafe or oversized members become records with a `reject` reason,
and a shard that breaks part-way ends the stream with a `ShardError` describing what was lost.
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "image", "img", "gif", "bmp", "tif", "tiff", "avif", "heic", "jxl")
CAPTION_EXTENSIONS = ("txt", "caption")
PARQUET_IMAGE_COLUMNS = ("jpg", "png", "webp", "image")
PARQUET_CAPTION_COLUMNS = ("caption", "txt")


@dataclass
class Record:
    """One sample as read from the lake; `reject` is set when the reader already knows it is unusable."""

    key: str
    shard: str
    image: bytes | None = None
    image_member: str | None = None
    caption: bytes | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    reject: tuple[str, str] | None = None  # (reason, detail)


@dataclass
class ShardError:
    """The shard could not be read to its end; records before `offset` were yielded and accounted."""

    shard: str
    error: str
    records_read: int
    offset: int | None = None


def shard_name(uri: str) -> str:
    """The shard's file name (`00003.tar`), the value of the `shard` column."""
    return posixpath.basename(uri.rstrip("/")) if "://" in uri else Path(uri).name


def open_shard(uri: str):
    """A context manager giving a binary stream of a local or s3:// shard."""
    if uri.startswith("s3://"):
        from components._shared.platform.storage import open_read

        return open_read(uri)
    return open(uri, "rb")


def _split_member(name: str) -> tuple[str, str]:
    """WebDataset convention: key is the path up to the first dot of the basename, the rest the extension."""
    directory, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(directory, stem) if directory else stem, ext.lower()


def unsafe_reason(member: tarfile.TarInfo) -> str | None:
    """Why a tar member must not be touched, or None when it is a plain file with a relative, contained name."""
    name = member.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return f"absolute member name {name!r}"
    if ".." in name.replace("\\", "/").split("/"):
        return f"member name {name!r} climbs out with '..'"
    if member.issym() or member.islnk():
        return f"member {name!r} is a link to {member.linkname!r}"
    if member.isdev() or member.isfifo():
        return f"member {name!r} is a device or fifo"
    if not member.isfile():
        return f"member {name!r} is not a regular file (type {member.type!r})"
    return None


class _Group:
    def __init__(self, key: str, shard: str) -> None:
        self.record = Record(key=key, shard=shard)
        self.captions: list[str] = []

    def add(self, ext: str, member: str, data: bytes | None, problem: tuple[str, str] | None) -> None:
        rec = self.record
        if problem and rec.reject is None:
            rec.reject = problem
        if data is None:
            return
        base_ext = ext.rsplit(".", 1)[-1]
        if base_ext in IMAGE_EXTENSIONS and rec.image is None:
            rec.image, rec.image_member = data, member
        elif base_ext in CAPTION_EXTENSIONS and rec.caption is None:
            rec.caption = data
        elif base_ext == "json":
            rec.metadata = _parse_metadata(data)

    def finish(self) -> Record:
        rec = self.record
        if rec.reject is None and rec.image is None:
            rec.reject = ("missing_image", "no image member (.jpg/.png/.webp) for this key")
        elif rec.reject is None and rec.caption is None:
            rec.reject = ("missing_caption", "no caption member (.txt) for this key")
        return rec


def _parse_metadata(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return {"metadata_error": f"invalid JSON: {exc}"[:200]}
    return (
        value if isinstance(value, dict) else {"metadata_error": f"expected a JSON object, got {type(value).__name__}"}
    )


def read_tar(stream: BinaryIO, shard: str, *, max_member_bytes: int, errors: list[ShardError]) -> Iterator[Record]:
    """Records of a WebDataset tar read as a stream (`r|*`: no seeking, nothing written to disk).

    Consecutive members sharing a key form one record. A member that is unsafe (absolute name, `..`,
    link, device) or larger than `max_member_bytes` is never read and makes its record rejected. If the
    tar breaks, the record being assembled is rejected as `shard_error` and a `ShardError` is appended.
    """
    count = 0
    group: _Group | None = None
    offset = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                offset = member.offset
                if member.isdir():
                    continue
                key, ext = _split_member(member.name)
                if group is None or key != group.record.key:
                    if group is not None:
                        count += 1
                        yield group.finish()
                    group = _Group(key, shard)
                problem = unsafe_reason(member)
                if problem is not None:
                    group.add(ext, member.name, None, ("unsafe_member", problem))
                    continue
                if member.size > max_member_bytes:
                    group.add(
                        ext,
                        member.name,
                        None,
                        (
                            "file_too_large",
                            f"member {member.name!r} has {member.size} bytes > max_file_bytes={max_member_bytes}",
                        ),
                    )
                    continue
                handle = tar.extractfile(member)
                data = handle.read() if handle is not None else b""
                if len(data) != member.size:
                    raise tarfile.ReadError(f"member {member.name!r} ends after {len(data)} of {member.size} bytes")
                group.add(ext, member.name, data, None)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:  # zlib/gzip errors surface as OSError
        if group is not None:
            group.record.reject = ("shard_error", f"shard broke while reading this record: {exc}"[:300])
            count += 1
            yield group.record
            group = None
        errors.append(
            ShardError(shard=shard, error=f"{type(exc).__name__}: {exc}"[:500], records_read=count, offset=offset)
        )
        return
    if group is not None:
        yield group.finish()


def _first_column(names: list[str], candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in names), None)


def _json_safe(value: Any) -> Any:
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def read_parquet(
    source: BinaryIO, shard: str, *, max_member_bytes: int, errors: list[ShardError], batch_rows: int = 256
) -> Iterator[Record]:
    """Records of a Parquet lake file: image column jpg|png|webp|image, caption column caption|txt, key column."""
    import pyarrow.parquet as pq

    count = 0
    try:
        parquet = pq.ParquetFile(source)
        names = parquet.schema_arrow.names
        image_col = _first_column(names, PARQUET_IMAGE_COLUMNS)
        caption_col = _first_column(names, PARQUET_CAPTION_COLUMNS)
        for batch in parquet.iter_batches(batch_size=batch_rows):
            for row in batch.to_pylist():
                key = str(row["key"]) if row.get("key") is not None else f"row-{count:09d}"
                rec = Record(key=key, shard=shard)
                image = row.get(image_col) if image_col else None
                if isinstance(image, dict):  # Hugging Face datasets' {"bytes", "path"} struct
                    image = image.get("bytes")
                caption = row.get(caption_col) if caption_col else None
                if isinstance(caption, str):
                    caption = caption.encode("utf-8")
                rec.metadata = {k: _json_safe(v) for k, v in row.items() if k not in (image_col, caption_col, "key")}
                if image is None:
                    rec.reject = ("missing_image", f"no image value (columns tried: {list(PARQUET_IMAGE_COLUMNS)})")
                elif not isinstance(image, bytes):
                    rec.reject = (
                        "missing_image",
                        f"image column {image_col!r} holds {type(image).__name__}, not bytes",
                    )
                elif len(image) > max_member_bytes:
                    rec.reject = ("file_too_large", f"image has {len(image)} bytes > max_file_bytes={max_member_bytes}")
                elif caption is None:
                    rec.reject = (
                        "missing_caption",
                        f"no caption value (columns tried: {list(PARQUET_CAPTION_COLUMNS)})",
                    )
                rec.image, rec.image_member, rec.caption = (
                    (image if isinstance(image, bytes) else None),
                    image_col,
                    caption,
                )
                count += 1
                yield rec
    except Exception as exc:  # noqa: BLE001 - a broken Parquet file is a shard error, not a crash
        errors.append(ShardError(shard=shard, error=f"{type(exc).__name__}: {exc}"[:500], records_read=count))


def read_shard(uri: str, *, max_member_bytes: int, errors: list[ShardError]) -> Iterator[Record]:
    """Records of one shard (tar or Parquet, local or s3://); problems are appended to `errors`."""
    shard = shard_name(uri)
    try:
        opened = open_shard(uri)
        stream = opened.__enter__()
    except (OSError, ValueError) as exc:
        errors.append(ShardError(shard=shard, error=f"cannot open {uri}: {exc}"[:500], records_read=0))
        return
    try:
        if uri.endswith(".parquet"):
            seekable = getattr(stream, "seekable", lambda: False)()
            source = stream if seekable else io.BytesIO(stream.read())
            yield from read_parquet(source, shard, max_member_bytes=max_member_bytes, errors=errors)
        else:
            yield from read_tar(stream, shard, max_member_bytes=max_member_bytes, errors=errors)
    finally:
        opened.__exit__(None, None, None)
