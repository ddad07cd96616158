"""The lake: its shards listed (`list_lake_shards`) and their records streamed out of WebDataset tars (in memory,
never extracted) and Parquet files.

A record is the consecutive members of a tar that share a key (`KEY.jpg`, `KEY.txt`, `KEY.json`), or one
Parquet row. Readers never raise for bad content: unsafe or oversized members, a key used twice in a shard and a
key with two images or two captions become records with a `reject` reason, and a shard that breaks part-way ends
the stream with a `ShardError` describing what was lost.
"""

from __future__ import annotations

import hashlib
import io
import logging
import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from components._shared.data.containers import KeyedDecoder
from components._shared.platform import storage
from components._shared.platform.shards import TAR_SUFFIXES

logger = logging.getLogger(__name__)

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
    image_sha256: str | None = None  # set instead of `image` when the reader dropped the bytes of a rejected record


@dataclass
class ShardError:
    """The shard could not be read to its end; records before `offset` were yielded and accounted."""

    shard: str
    error: str
    records_read: int
    offset: int | None = None


def shard_name(uri: str) -> str:
    """The shard's file name (`00003.tar`), the value of the `shard` column until the merge names it (shard_names)."""
    return posixpath.basename(uri.rstrip("/")) if "://" in uri else Path(uri).name


def shard_names(uris: list[str]) -> list[str]:
    """Names for a lake's shards that cannot collide: each URI's path below the deepest folder all of them share.

    A flat lake keeps the file names (`00003.tar`); a nested one gets `part1/00000.tar` and `part2/00000.tar`.
    """
    parts = [uri.rstrip("/").split("/") for uri in uris]
    if not parts:
        return []
    common, limit = 0, min(len(p) for p in parts) - 1  # the file name always stays
    while common < limit and all(p[common] == parts[0][common] for p in parts):
        common += 1
    return ["/".join(p[common:]) for p in parts]


def open_shard(uri: str):
    """A context manager giving a binary stream of a local or s3:// shard."""
    if uri.startswith("s3://"):
        return storage.open_read(uri)
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


DUPLICATE_MEMBER_FIX = "keep one image, one caption (.txt) and at most one .json per key"


class _Group:
    """The consecutive members of one key, assembled into its Record."""

    def __init__(self, key: str, shard: str) -> None:
        self.record = Record(key=key, shard=shard)
        self.caption_member: str | None = None
        self.json_member: str | None = None
        self.image_field: str | None = None  # KEY.mask.png: an image under another field

    def reject(self, reason: str, detail: str) -> None:
        if self.record.reject is None:  # the first problem names the record's reason
            self.record.reject = (reason, detail)

    def add(self, ext: str, member: str, data: bytes | None, problem: tuple[str, str] | None) -> None:
        rec = self.record
        if problem:
            self.reject(*problem)
        if data is None:
            return
        base_ext = ext.rsplit(".", 1)[-1]
        if ext in IMAGE_EXTENSIONS:  # KEY.jpg; KEY.mask.png is another field of the sample (WebDataset), not its image
            if rec.image is None:
                rec.image, rec.image_member = data, member
            else:
                self._second("images", rec.image_member, member)
        elif base_ext in IMAGE_EXTENSIONS:
            self.image_field = self.image_field or member
        elif base_ext in CAPTION_EXTENSIONS:
            if rec.caption is None:
                rec.caption, self.caption_member = data, member
            else:
                self._second("captions", self.caption_member, member)
        elif base_ext == "json":
            if self.json_member is None:
                rec.metadata, self.json_member = _parse_metadata(data), member
            else:
                self._second(".json members", self.json_member, member)

    def _second(self, what: str, first: str | None, member: str) -> None:
        self.reject(
            "duplicate_member",
            f"key {self.record.key!r} has two {what}, {first!r} and {member!r}; {DUPLICATE_MEMBER_FIX}",
        )

    @property
    def complete(self) -> bool:
        """True when the record is settled: rejected already, or with its image and caption."""
        rec = self.record
        return rec.reject is not None or (rec.image is not None and rec.caption is not None)

    def park(self) -> None:
        """Keep only what the rejection row needs (the image's sha256) while the key waits for the shard's end."""
        rec = self.record
        if rec.image is not None:
            rec.image_sha256 = hashlib.sha256(rec.image).hexdigest()
        rec.image = rec.caption = None

    def finish(self) -> Record:
        rec = self.record
        if rec.image is None and rec.image_sha256 is None:
            field = posixpath.basename(self.image_field or "")  # WebDataset splits a name at its first dot
            said = f"; {field!r} is its field {field.split('.', 1)[-1]!r}: name the image KEY.jpg" if field else ""
            self.reject("missing_image", f"no image member (.jpg/.png/.webp) for this key{said}")
        elif rec.caption is None and self.caption_member is None:
            self.reject("missing_caption", "no caption member (.txt) for this key")
        return rec


def _parse_metadata(data: bytes) -> dict[str, Any]:
    """The `.json` member, or {"metadata_error": why}: not a JSON object, a key twice (json keeps the last), NaN."""
    decoder = KeyedDecoder()
    try:
        value = decoder.decode(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return {"metadata_error": f"invalid JSON: {exc}"[:200]}
    except RecursionError:  # one hostile record must not stop the lake: it is rejected (bad_metadata) like invalid JSON
        return {"metadata_error": "invalid JSON: nested too deeply to read"}
    problem = decoder.take_duplicates() or ("" if isinstance(value, dict) else f"not an object: {type(value).__name__}")
    return {"metadata_error": problem} if problem else value


SPLIT_KEY_FIX = (
    "WebDataset needs the members of one sample next to each other; rewrite the shard sorted by member name "
    "(e.g. `tar --sort=name`)"
)


class _TarRecords:
    """Turns a tar's members, in order, into records: one per run of consecutive members sharing a key.

    A record still missing its image or caption waits (its bytes dropped, `park`) until the shard's end, because its
    key may come back; a key that comes back is rejected as `duplicate_key` (counted once if it was waiting, as a
    second record if its record was already yielded). Memory: the shard's keys and waiting metadata, no image bytes.
    """

    def __init__(self, shard: str) -> None:
        self.shard = shard
        self.group: _Group | None = None
        self.waiting: dict[str, _Group] = {}
        self.settled: set[str] = set()  # keys whose record was yielded
        self.count = 0  # records yielded

    def switch(self, key: str, member: str, index: int) -> Iterator[Record]:
        """Start (or resume) the group of `key` when it differs from the current one, yielding what that settles."""
        if self.group is not None and key == self.group.record.key:
            return
        yield from self._close()
        if key in self.waiting:
            self.group = self.waiting.pop(key)
            self.group.reject(
                "duplicate_key",
                f"members of key {key!r} are not consecutive: {member!r} (member {index}) comes after other keys' "
                f"members; {SPLIT_KEY_FIX}",
            )
            return
        self.group = _Group(key, self.shard)
        if key in self.settled:
            self.group.reject(
                "duplicate_key",
                f"key {key!r} comes back at {member!r} (member {index}) after its record was read; these later "
                f"members are a second record with the same key; {SPLIT_KEY_FIX}",
            )

    def _close(self) -> Iterator[Record]:
        done, self.group = self.group, None
        if done is None:
            return
        if done.complete:
            self.settled.add(done.record.key)
            self.count += 1
            yield done.finish()
        else:
            done.park()
            self.waiting[done.record.key] = done

    def broken(self, error: Exception) -> Iterator[Record]:
        """The tar broke: the record being read is a `shard_error`; the waiting ones keep their own reason."""
        if self.group is not None:
            self.group.record.reject = ("shard_error", f"shard broke while reading this record: {error}"[:300])
            self.count += 1
            yield self.group.record
            self.group = None
        yield from self.end()

    def end(self) -> Iterator[Record]:
        yield from self._close()
        for done in self.waiting.values():
            self.count += 1
            yield done.finish()
        self.waiting.clear()


def _member_data(tar: tarfile.TarFile, member: tarfile.TarInfo, max_member_bytes: int):
    """(bytes, None), or (None, (reason, detail)) for a member that must not be read."""
    problem = unsafe_reason(member)
    if problem is not None:
        return None, ("unsafe_member", problem)
    if member.size > max_member_bytes:
        return None, (
            "file_too_large",
            f"member {member.name!r} has {member.size} bytes > max_file_bytes={max_member_bytes}",
        )
    handle = tar.extractfile(member)
    data = handle.read() if handle is not None else b""
    if len(data) != member.size:
        raise tarfile.ReadError(f"member {member.name!r} ends after {len(data)} of {member.size} bytes")
    return data, None


def read_tar(stream: BinaryIO, shard: str, *, max_member_bytes: int, errors: list[ShardError]) -> Iterator[Record]:
    """Records of a WebDataset tar read as a stream (`r|*`: plain or gzip/bz2/xz, no seeking, nothing written to disk).

    Consecutive members sharing a key form one record. A member that is unsafe (absolute name, `..`,
    link, device) or larger than `max_member_bytes` is never read and makes its record rejected. A key with two
    images or two captions is `duplicate_member`; a key whose members are not consecutive is `duplicate_key`
    (`_TarRecords`). If the tar breaks, the record being assembled is rejected as `shard_error` and a
    `ShardError` is appended.
    """
    records = _TarRecords(shard)
    offset = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for index, member in enumerate(tar):
                offset = member.offset
                if member.isdir():
                    continue
                key, ext = _split_member(member.name)
                yield from records.switch(key, member.name, index)
                data, problem = _member_data(tar, member, max_member_bytes)
                assert records.group is not None  # switch always leaves a group for `key`
                records.group.add(ext, member.name, data, problem)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:  # zlib/gzip errors surface as OSError
        yield from records.broken(exc)
        errors.append(
            ShardError(
                shard=shard, error=f"{type(exc).__name__}: {exc}"[:500], records_read=records.count, offset=offset
            )
        )
        return
    yield from records.end()


def _filled(row: dict[str, Any], columns: list[str]) -> str | None:
    """The first of `columns` that holds a value in this row (else the first column): img2dataset writes one of
    jpg / png / webp per row. Another filled one stays in the record's metadata."""
    return next((c for c in columns if row.get(c) is not None), columns[0] if columns else None)


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


def _describe(value: Any) -> str:
    text = repr(_json_safe(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _fallback_key(index: int, taken: set[str]) -> str:
    """`row-000000007` for a row without a key; `row-000000007~1` if a real key of the shard has that name."""
    key, n = f"row-{index:09d}", 0
    while key in taken:
        n += 1
        key = f"row-{index:09d}~{n}"
    return key


def _no_value(what: str, tried: tuple[str, ...], column: str | None, names: list[str]) -> str:
    """Why a row has no image / caption: the columns tried, and the file's own when none of them is there."""
    return (
        f"no {what} value (columns tried: {list(tried)}"
        + ("" if column else f"; the file's columns are {names[:12]}")
        + ")"
    )


def read_parquet(
    source: BinaryIO, shard: str, *, max_member_bytes: int, errors: list[ShardError], batch_rows: int = 256
) -> Iterator[Record]:
    """Records of a Parquet lake file: image column jpg|png|webp|image, caption column caption|txt, key column.

    A row without a key is named `row-NNNNNNNNN` by its index (never a name a real key of the shard has); a key used
    by an earlier row is rejected as `duplicate_key`; a caption that is not a string (a list, a number) is rejected
    as `missing_caption` naming the type.
    """
    import pyarrow.parquet as pq

    count = 0
    try:
        parquet = pq.ParquetFile(source)
        names = parquet.schema_arrow.names
        image_cols = [c for c in PARQUET_IMAGE_COLUMNS if c in names]  # a row may fill any one (jpg or png)
        caption_cols = [c for c in PARQUET_CAPTION_COLUMNS if c in names]
        real_keys = (
            {str(k) for k in parquet.read(columns=["key"]).column("key").to_pylist() if k is not None}
            if "key" in names
            else set()
        )
        first_row: dict[str, int] = {}  # key -> the row that used it first
        for batch in parquet.iter_batches(batch_size=batch_rows):
            for row in batch.to_pylist():
                key = str(row["key"]) if row.get("key") is not None else _fallback_key(count, real_keys)
                rec = Record(key=key, shard=shard)
                image_col, caption_col = _filled(row, image_cols), _filled(row, caption_cols)
                cell = row.get(image_col) if image_col else None
                image, path_only = cell, None
                if isinstance(cell, dict):  # Hugging Face datasets' {"bytes", "path"} struct
                    image, path_only = cell.get("bytes"), cell.get("path") or None
                caption = row.get(caption_col) if caption_col else None
                if isinstance(caption, str):
                    caption = caption.encode("utf-8")
                rec.metadata = {k: _json_safe(v) for k, v in row.items() if k not in (image_col, caption_col, "key")}
                if key in first_row:
                    rec.reject = (
                        "duplicate_key",
                        f"row {count} has key {key!r}, already used by row {first_row[key]} of this shard; keys must "
                        "be unique within a shard: fix the writer, or drop the key column and clean_data names the "
                        "rows row-NNNNNNNNN",
                    )
                elif image is None and path_only:
                    rec.reject = (
                        "missing_image",
                        f"image column {image_col!r} holds only a path ({str(path_only)[:80]!r}), not the image's "
                        "bytes; the lake is read from its shards alone: write the bytes into the cell (img2dataset "
                        "and datasets' Image(decode=False) with embedded files do)",
                    )
                elif image is None:
                    rec.reject = ("missing_image", _no_value("image", PARQUET_IMAGE_COLUMNS, image_col, names))
                elif not isinstance(image, bytes):
                    rec.reject = (
                        "missing_image",
                        f"image column {image_col!r} holds {type(image).__name__}, not bytes",
                    )
                elif len(image) > max_member_bytes:
                    rec.reject = ("file_too_large", f"image has {len(image)} bytes > max_file_bytes={max_member_bytes}")
                elif caption is None:
                    rec.reject = ("missing_caption", _no_value("caption", PARQUET_CAPTION_COLUMNS, caption_col, names))
                elif not isinstance(caption, bytes):
                    rec.reject = (
                        "missing_caption",
                        f"caption column {caption_col!r} holds {type(caption).__name__} {_describe(caption)}, not a "
                        "string; write one caption string (or UTF-8 bytes) per row",
                    )
                first_row.setdefault(key, count)
                rec.image, rec.image_member, rec.caption = (
                    (image if isinstance(image, bytes) else None),
                    image_col,
                    (caption if isinstance(caption, bytes) else None),
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


# -- listing a lake ----------------------------------------------------------------------------------------
LAKE_SHARD_SUFFIXES = (*TAR_SUFFIXES, ".parquet")
PIPELINE_OUTPUT_FILES = ("_COMMITTED.json", "_stage_result.json", "run_summary.json")  # a stage's or a run's output


def list_lake_files(lake_uri: str) -> tuple[list[str], list[str]]:
    """(shards, other files) of a lake: a directory or s3:// prefix (subfolders included) or one file; each sorted.
    A `NNNNN.parquet` beside a `NNNNN.tar` is img2dataset's metadata for that tar, not a shard."""
    if not storage.is_s3(lake_uri) and not storage.exists(lake_uri):
        raise ValueError(f"lake_uri={lake_uri!r} does not exist; pass img2dataset's output folder or an s3:// prefix.")
    files = storage.list_files(lake_uri)
    if not storage.is_s3(lake_uri) and Path(lake_uri).is_dir():
        odd = sorted(
            str(p)
            for p in Path(lake_uri).rglob("*")
            if p.name.endswith(LAKE_SHARD_SUFFIXES) and not p.is_file() and not p.is_dir()
        )
        if odd:  # a pipe, socket or device under a shard's name: opening it could block for ever, so it is not read
            logger.warning(
                "lake %s: %d shard-named entr%s not a regular file (a pipe, socket or device?) and not read: %s",
                lake_uri,
                len(odd),
                "y is" if len(odd) == 1 else "ies are",
                ", ".join(odd[:5]),
            )
    outputs = [uri for uri in files if uri.rsplit("/", 1)[-1] in PIPELINE_OUTPUT_FILES]
    if outputs:
        raise ValueError(
            f"lake_uri={lake_uri!r} holds a pipeline output ({outputs[0]}): its kept and rejected records would be "
            "read as lake shards. Give the lake's own folder (img2dataset's output), with no run or stage output in it."
        )
    tars = {uri.removesuffix(suffix) for uri in files for suffix in TAR_SUFFIXES if uri.endswith(suffix)}
    # img2dataset's WebDataset output puts a metadata NNNNN.parquet (no images) beside each NNNNN.tar: not a shard
    metadata = {uri for uri in files if uri.endswith(".parquet") and uri.removesuffix(".parquet") in tars}
    shards = [uri for uri in files if uri.endswith(LAKE_SHARD_SUFFIXES) and uri not in metadata]
    return shards, [uri for uri in files if uri not in shards]


def list_lake_shards(lake_uri: str) -> list[str]:
    """A lake's shards (`*.tar`, `*.tar.gz`, `*.tgz`, `*.parquet`, subfolders too), sorted; ValueError naming the URI
    and the fix when it does not exist or holds none (`list_lake_files` also returns the other files)."""
    uris, others = list_lake_files(lake_uri)
    if not uris:
        found = f" (it holds {len(others)} other file(s), e.g. {others[0]})" if others else ""
        raise ValueError(
            f"No *.tar, *.tar.gz, *.tgz or *.parquet shards under lake_uri={lake_uri!r}{found}; point it at an "
            "img2dataset WebDataset/Parquet output folder or s3:// prefix (`qvl lake synth --out DIR` writes DIR/lake)."
        )
    return uris
