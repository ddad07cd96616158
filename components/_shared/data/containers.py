"""The containers data files come in, read record by record: JSON Lines (`.jsonl`, `.ndjson`), a JSON array (`.json`,
LLaVA's release form, pretty-printed or on one line; either JSON shape is read whatever the suffix says) and Parquet
(`.parquet`, the hub's layout: image columns of {"bytes", "path"} structs or raw bytes, read lazily row group by row
group). Each record comes with its `source` ("file:line", "file:line [index in the array]", "file row N");
data/formats.py reads the record shapes.
"""

from __future__ import annotations

import bisect
import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components._shared.platform.names import twin_of
from components._shared.platform.placement import DATA_FILES, STAGE_RESULT
from components._shared.platform.storage import COMMIT_MARKER


@dataclass(frozen=True)
class ParquetImage:
    """An image stored in a Parquet file: row `row` of `column` (element `index` of a list column)."""

    path: str
    row: int
    column: str
    index: int | None = None
    root: str = ""  # the entry's image folder (dataset.yaml `images:`): a path in the cell is under it
    null_list: bool = False  # the row's list of images is null, not a list: refused like a null image cell


class KeyedDecoder(json.JSONDecoder):
    """json's decoder that notes what it would accept quietly: keys given twice in one object (json keeps the last;
    other readers keep the first, so such a record means different things to different tools) and NaN / Infinity
    (not JSON: other readers refuse them, and a non-finite number copied into a record poisons what sums it).
    `take_duplicates()` after each record."""

    def __init__(self) -> None:
        super().__init__(object_pairs_hook=self._pairs, parse_constant=self._constant)
        self._problems: list[str] = []

    def _pairs(self, pairs: list[tuple[str, Any]]) -> dict:
        record = dict(pairs)
        if len(record) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self._problems.append(f"the key {key!r} is given twice in one object; keep one")
                seen.add(key)
        return record

    def _constant(self, name: str) -> None:
        self._problems.append(f"{name} is not a JSON value (JSON has no NaN or infinity); write a number or null")

    def take_duplicates(self) -> str | None:
        """Why the record just decoded is bad (a key given twice, a NaN), or None; resets for the next record."""
        problems, self._problems = self._problems, []
        return problems[0] if problems else None


def _json_problem(error: Exception) -> str:
    """A line's JSON failure as a bad record's reason."""
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON ({error.msg}); fix or remove that line"
    if isinstance(error, RecursionError):
        return "JSON nested deeper than the reader's recursion limit; flatten or remove that line"
    return f"not readable as JSON ({error}); fix or remove that line"  # e.g. an integer of over 4,300 digits


# ------------------------------------------------------------------------------------------ containers ---


PACKED = {".gz": "gunzip", ".bz2": "bunzip2", ".xz": "unxz", ".zst": "unzstd", ".zip": "unzip"}


def iter_file(path: Path) -> Iterator[tuple[str, Any]]:
    """(source, raw record) of a data file, in file order; the container is chosen by the file's suffix."""
    if path.is_dir():
        raise ValueError(
            f"{path} is a directory; name a data file (.jsonl, .json or .parquet) inside the data directory."
        )
    if not path.is_file():
        what = "is not a regular file (a pipe or a device?)" if path.exists() else "does not exist"
        twin, how = twin_of(path) or (None, "")
        if twin is not None:
            what += f" as spelled; {ascii(twin.name)} does: the same letters in {how} (retype the name)"
        packed = next((p for p in path.parent.glob(f"{glob.escape(path.name)}.*") if p.suffix in PACKED), None)
        if packed is not None and twin is None:  # a compressed copy is not read: say what to do with it
            what += f"; {ascii(packed.name)} does, compressed ({PACKED[packed.suffix]} it: the stages read plain files)"
        marker = next((n for n in (COMMIT_MARKER, STAGE_RESULT) if (path.parent / n).is_file()), None)
        data_files = (*DATA_FILES, "preferences.jsonl")  # an sft.build_data output is a stage output and data
        if marker is not None and twin is None and not any((path.parent / n).exists() for n in data_files):
            raise ValueError(
                f"{path} {what}: {path.parent} is a stage's output (it holds {marker}), not a data directory; give "
                "the data directory (eval.jsonl, sft.jsonl, preferences.jsonl or a dataset.yaml; docs/data.md)."
            )
        raise ValueError(f"{path} {what}; name a file inside the data directory.")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        yield from _iter_json_array(path) if _holds_an_array(path) else _iter_jsonl(path)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise ValueError(f"{path}: unknown data file type {suffix!r}; use .jsonl, .json (an array) or .parquet.")


def _holds_an_array(path: Path) -> bool:
    """Whether a JSON data file holds one array rather than JSON Lines, by its content (the suffix is often wrong:
    arrays saved as .jsonl, JSON Lines as .json). An array starts with '['; a .json whose first line is a whole
    object followed by more lines is JSON Lines; any other .json goes to the array reader, which says what it holds."""
    with path.open("rb") as handle:
        lines = (line.strip() for line in handle)
        first = next((line for line in lines if line), b"").removeprefix(b"\xef\xbb\xbf").lstrip()
        if first.startswith(b"["):
            return True
        if path.suffix.lower() != ".json":
            return False
        try:
            whole_object = isinstance(json.loads(first), dict)
        except ValueError:  # not JSON on its own (a pretty-printed object) or not UTF-8
            return True
        return not (whole_object and any(lines))


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """(source, record) per non-blank line; a line that is not UTF-8 or not JSON comes as an `Unparsable`, so the
    reader reports it with every other bad record."""
    _check_line_endings(path)
    decoder = KeyedDecoder()
    with path.open("rb") as lines:
        for n, raw in enumerate(lines, 1):
            source = f"{path.name}:{n}"
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark may start the file
            except UnicodeDecodeError as error:
                yield (
                    source,
                    Unparsable(f"not UTF-8 text (byte {error.start} of the line); re-encode the file as UTF-8"),
                )
                continue
            if not line.strip():
                continue
            try:
                record = decoder.decode(line)
            except (ValueError, RecursionError) as error:
                decoder.take_duplicates()
                yield source, Unparsable(_json_problem(error))
                continue
            twice = decoder.take_duplicates()
            yield source, (Unparsable(twice) if twice else record)


def _check_line_endings(path: Path) -> None:
    """A UTF-16 file, or one whose lines end in a bare CR (classic Mac), is one error for the file, not one per line."""
    with path.open("rb") as f:
        head = f.read(1 << 16)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(f"{path.name}: UTF-16 text (its byte-order mark says so); save it as UTF-8.")
    if b"\r" in head and b"\n" not in head:
        raise ValueError(f"{path.name}: its lines end in a bare CR (an old Mac export); convert them to LF line ends.")


class Unparsable(str):
    """A data line that could not be read, with the reason (reported like any other bad record)."""


def _iter_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    """Items of a top-level JSON array with the line each starts on and its index in the array (`file:LINE [INDEX]`:
    LLaVA's releases are one line, so the line alone names no record); raw_decode walks the array item by item."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark may start the file
    except UnicodeDecodeError as error:
        raise ValueError(f"{path.name}: not UTF-8 text (byte {error.start}); re-encode the file as UTF-8.") from None
    decoder = KeyedDecoder()
    pos = _skip_space(text, 0)
    if pos < len(text) and text[pos] == "{":
        raise ValueError(
            f"{path.name}: a JSON object, not an array of records; a .json data file holds one array (LLaVA's form). "
            "Benchmark annotation files are read with their format (dataset.yaml: format: docvqa, ...)."
        )
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path.name}: not a JSON array; a .json data file holds one array of records.")
    pos = _skip_space(text, pos + 1)
    index, line, counted = 0, 1, 0  # the line number kept up as the walk goes (recounting from 0 is quadratic)
    while pos < len(text) and text[pos] != "]":
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path.name}:{error.lineno}: not valid JSON ({error.msg}) in record {index}; fix the file."
            ) from error
        except (ValueError, RecursionError) as error:  # the walk cannot go on past a record it could not read
            raise ValueError(f"{path.name}:{line}: record {index}: {_json_problem(error)}.") from None
        twice = decoder.take_duplicates()
        yield f"{path.name}:{line} [{index}]", (Unparsable(twice) if twice else record)
        index += 1
        pos = _skip_space(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
            if pos < len(text) and text[pos] == "]":  # JSON5's trailing comma: other readers refuse the file
                raise ValueError(
                    f"{path.name}:{text.count(chr(10), 0, pos) + 1}: a ',' before the array's ']'; drop it."
                )
        elif pos < len(text) and text[pos] != "]":
            raise ValueError(
                f"{path.name}:{text.count(chr(10), 0, pos) + 1}: expected ',' or ']' after record {index - 1}."
            )
    if pos >= len(text):
        raise ValueError(f"{path.name}: the JSON array has no closing ']' (cut short?); fix or re-export the file.")
    rest = _skip_space(text, pos + 1)
    if rest < len(text):
        raise ValueError(
            f"{path.name}:{text.count(chr(10), 0, rest) + 1}: more follows the JSON array that ends on line "
            f"{text.count(chr(10), 0, pos) + 1}; a data file holds one array, or one record per line (JSON Lines)."
        )


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


TEXT_FIELDS = frozenset(  # record fields that are text in every shape (data/formats.py): never a bytes column
    "id question_id question answer answers text caption prompt chosen rejected task type content value from role "
    "hint expression label category benchmark difficulty format source".split()
)


def _image_columns(schema, file_name: str) -> dict[str, bool]:
    """Columns that hold images: {name: is a list column}; a struct with a "bytes" field, or raw binary."""
    import pyarrow as pa

    def is_image(kind) -> bool:
        return (
            pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)
            or (pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0)
        )

    out = {}
    for field in schema:
        if field.name in TEXT_FIELDS and (pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)):
            raise ValueError(
                f"{file_name}: the column {field.name!r} is binary (bytes), not text: write it as a "
                "string column (pyarrow: pa.string(); decode the bytes as UTF-8 first). Raw-bytes columns are images."
            )
        if is_image(field.type):
            out[field.name] = False
        elif (pa.types.is_list(field.type) or pa.types.is_large_list(field.type)) and is_image(field.type.value_type):
            out[field.name] = True
    return out


def _iter_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    """Rows as dicts, image cells as ParquetImage references (read later, one row group at a time)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(path)
    names = handle.schema_arrow.names
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # rows as dicts would keep one of them without a word
        raise ValueError(f"{path.name}: the column(s) {twice} appear more than once; keep one of each.")
    images = _image_columns(handle.schema_arrow, path.name)
    empty = [f.name for f in handle.schema_arrow if f.name in ("image", "images") and str(f.type) == "null"]
    if empty and handle.metadata.num_rows:  # pyarrow's type for a column holding only nulls: text-only records
        raise ValueError(
            f"{path.name}: the column {empty[0]!r} holds no image in any row (every value is null); fill it, or drop "
            "the column for text-only records."
        )
    others = [name for name in handle.schema_arrow.names if name not in images]
    leaves = [handle.schema.column(i).path for i in range(len(handle.schema))]
    # a list column's lengths from a leaf other than the image bytes (the struct's "path"), so no image is read here
    length_of = {
        name: next((p for p in leaves if p.startswith(f"{name}.") and not p.endswith(".bytes")), name)
        for name, is_list in images.items()
        if is_list
    }
    row = 0
    for group in range(handle.num_row_groups):
        table = handle.read_row_group(group, columns=others)
        lengths = {
            name: pc.list_value_length(handle.read_row_group(group, columns=[leaf]).column(0)).to_pylist()
            for name, leaf in length_of.items()
        }
        for i, record in enumerate(table.to_pylist()):
            for name, is_list in images.items():
                if is_list and lengths[name][i] is None:  # not text-only (the hub writes [] for that): images lost
                    record[name] = ParquetImage(str(path), row + i, name, null_list=True)
                elif is_list:
                    record[name] = [ParquetImage(str(path), row + i, name, k) for k in range(lengths[name][i])]
                else:
                    record[name] = ParquetImage(str(path), row + i, name)
            yield f"{path.name} row {row + i}", record
        row += table.num_rows


def read_parquet_image(ref: ParquetImage) -> tuple[bytes | None, str | None]:
    """(bytes, path) of a Parquet image cell; a struct cell may hold a path instead of bytes."""
    offsets = _group_offsets(ref.path)
    group = bisect.bisect_right(offsets, ref.row) - 1
    value = _row_group_column(ref.path, group, ref.column)[ref.row - offsets[group]]
    if ref.index is not None:
        value = value[ref.index]
    if isinstance(value, dict):
        return value.get("bytes"), value.get("path")
    return value, None


_OFFSETS: dict[str, list[int]] = {}


def _group_offsets(path: str) -> list[int]:
    if path not in _OFFSETS:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        offsets, total = [], 0
        for g in range(meta.num_row_groups):
            offsets.append(total)
            total += meta.row_group(g).num_rows
        _OFFSETS[path] = offsets
    return _OFFSETS[path]


_GROUP_CACHE: dict[tuple[str, int, str], list] = {}


def _row_group_column(path: str, group: int, column: str) -> list:
    """One row group's image column as Python values; the two most recent are kept (a shuffled sampler rereads)."""
    key = (path, group, column)
    if key not in _GROUP_CACHE:
        import pyarrow.parquet as pq

        if len(_GROUP_CACHE) >= 2:
            _GROUP_CACHE.pop(next(iter(_GROUP_CACHE)))
        _GROUP_CACHE[key] = pq.ParquetFile(path).read_row_group(group, columns=[column])[column].to_pylist()
    return _GROUP_CACHE[key]
