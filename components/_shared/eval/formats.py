"""The data formats people have, read once into the stages' records.

Containers: JSON Lines (`.jsonl`, `.ndjson`), a JSON array (`.json`, LLaVA's own release form, pretty-printed or on
one line) and Parquet (`.parquet`, the hub's layout: an image column of {"bytes", "path"} structs or raw bytes,
read lazily row group by row group). Record shapes, detected per record or fixed by a file's `format`:

- `llava` / `sharegpt`: {"id", "image" | "images", "conversations": [{"from": "system"|"human"|"gpt", "value"}]}
  (or role/content turns; a top-level "system" string is a system turn); `<image>` marks each image's place.
- `messages`: {"messages": [{"role", "content": str | [{"type": "image"}, {"type": "text", "text"}]}], "images"}
  as TRL and Hugging Face datasets use it; an image part may carry its own "image" / "url" / "path"
  (or OpenAI's {"type": "image_url", "image_url": {"url"}}, data: URIs included).
- `flat`: {"id", "image", "question", "answer" | "answers", "type"|"task", optional "choices", "box"} (held-out).
- `preference`: {"prompt", "chosen", "rejected", "image" | "images"} (TRL's DPO layout; RLHF-V / VLFeedback
  style), the prompt a string or messages, chosen / rejected strings or one assistant message.

Images are referenced by path (inside the data directory), s3:// URI, a data: URI, or Parquet bytes. Every record
keeps `source` ("file:line", "file row N") and every bad record is reported with it, all at once.
Video is not read (a video part is refused with its source): decoding and sampling video is its own input path.
"""

from __future__ import annotations

import base64
import bisect
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD_FORMATS = ("auto", "llava", "sharegpt", "messages", "flat", "preference")
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
IMAGE_MARKER = "<image>"
MAX_REPORTED = 20
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_DATA_URI = re.compile(r"^data:image/[\w.+-]+;base64,", re.I)


class RecordError(ValueError):
    """A record that cannot be used; the message says why and how to fix it."""


@dataclass(frozen=True)
class ParquetImage:
    """An image stored in a Parquet file: row `row` of `column` (element `index` of a list column)."""

    path: str
    row: int
    column: str
    index: int | None = None


ImageRef = str | bytes | ParquetImage


# ------------------------------------------------------------------------------------------ containers ---


def iter_file(path: Path) -> Iterator[tuple[str, Any]]:
    """(source, raw record) of a data file, in file order; the container is chosen by the file's suffix."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist; name a file inside the data directory.")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from _iter_jsonl(path)
    elif suffix == ".json":
        yield from _iter_json_array(path)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise ValueError(f"{path}: unknown data file type {suffix!r}; use .jsonl, .json (an array) or .parquet.")


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """(source, record) per non-blank line; a line that is not UTF-8 or not JSON comes as an `Unparsable`, so the
    reader reports it with every other bad record."""
    with path.open("rb") as lines:
        for n, raw in enumerate(lines, 1):
            source = f"{path.name}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield (
                    source,
                    Unparsable(f"not UTF-8 text (byte {error.start} of the line); re-encode the file as UTF-8"),
                )
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                yield source, Unparsable(f"not valid JSON ({error.msg}); fix or remove that line")
                continue
            if isinstance(record, list) and n == 1:
                raise ValueError(f"{source}: a JSON array on a .jsonl line; name the file .json (one array) instead.")
            yield source, record


class Unparsable(str):
    """A data line that could not be read, with the reason (reported like any other bad record)."""


def _iter_json_array(path: Path) -> Iterator[tuple[str, dict]]:
    """Items of a top-level JSON array with the line each starts on (raw_decode walks the array item by item)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path.name}: not UTF-8 text (byte {error.start}); re-encode the file as UTF-8.") from None
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if pos < len(text) and text[pos] == "{":
        raise ValueError(
            f"{path.name}: a JSON object, not an array of records; a .json data file holds one array (LLaVA's form). "
            "Benchmark annotation files are read with their format (dataset.yaml: format: docvqa, ...)."
        )
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path.name}: not a JSON array; a .json data file holds one array of records.")
    pos = _skip_space(text, pos + 1)
    index = 0
    while pos < len(text) and text[pos] != "]":
        line = text.count("\n", 0, pos) + 1
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path.name}:{error.lineno}: not valid JSON ({error.msg}) in record {index}; fix the file."
            ) from error
        yield f"{path.name}:{line}", record
        index += 1
        pos = _skip_space(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise ValueError(
                f"{path.name}:{text.count(chr(10), 0, pos) + 1}: expected ',' or ']' after record {index - 1}."
            )


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _image_columns(schema) -> dict[str, bool]:
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
    images = _image_columns(handle.schema_arrow)
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
                if is_list:
                    record[name] = [ParquetImage(str(path), row + i, name, k) for k in range(lengths[name][i] or 0)]
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


# ---------------------------------------------------------------------------------------------- fields ---


def image_ref(value: Any, image_root: str = "") -> ImageRef:
    """One image reference of a record: a path (under `image_root`), s3:// URI, data: URI, {"path"} / {"bytes"}
    struct (HF datasets' Image feature), or a Parquet cell."""
    if isinstance(value, ParquetImage | bytes):
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            return value["bytes"] if isinstance(value["bytes"], bytes) else _data_bytes(value["bytes"])
        value = value.get("path") or value.get("url")
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"an image must be a path, s3:// URI or data: URI, got {value!r}")
    if _DATA_URI.match(value):
        return _data_bytes(value)
    if value.startswith(("http://", "https://")):
        raise RecordError(
            f"image {value[:80]!r} is a web URL; download it into the data directory (nothing is fetched)."
        )
    if value.startswith("s3://") or not image_root:
        return value
    return f"{image_root.rstrip('/')}/{value}"


def _data_bytes(text: str) -> bytes:
    try:
        return base64.b64decode(_DATA_URI.sub("", text), validate=True)
    except ValueError as error:
        raise RecordError(f"image data is not valid base64 ({error})") from error


def record_images(raw: dict, image_root: str) -> list[ImageRef]:
    value = raw.get("images")
    if value is None:
        value = raw.get("image")
        value = [] if value is None else [value]
    if not isinstance(value, list):
        value = [value]
    return [image_ref(v, image_root) for v in value]


def _text_of(content: Any, where: str, images: list, image_root: str) -> str:
    """A message's content as text with <image> markers; image parts that carry their image append it to `images`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecordError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    pieces = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RecordError(f"{where} part {k}: a text part needs a 'text' string")
            pieces.append(part["text"])
        elif kind in ("image", "image_url"):
            carried = part.get("image") or part.get("url") or part.get("path")
            if kind == "image_url":
                carried = (
                    (part.get("image_url") or {}).get("url")
                    if isinstance(part.get("image_url"), dict)
                    else part.get("image_url")
                )
            if carried is not None:
                images.append(image_ref(carried, image_root))
            pieces.append(IMAGE_MARKER)
        elif kind == "video":
            raise RecordError(f"{where} part {k}: video is not supported; drop the record or extract frames as images")
        else:
            raise RecordError(f"{where} part {k}: unknown part {part!r}; use {{'type': 'text'|'image', ...}}")
    return "\n".join(p for p in pieces if p) if any(p == IMAGE_MARKER for p in pieces) else "".join(pieces)


def conversation(raw: dict, image_root: str = "") -> tuple[list[ImageRef], list[dict]]:
    """(images, turns [{"role": system|user|assistant, "text"}]) of a conversation record in any chat shape."""
    images = record_images(raw, image_root)
    if "conversations" in raw:
        messages, key = raw["conversations"], "conversations"
    elif "messages" in raw:
        messages, key = raw["messages"], "messages"
    else:
        raise RecordError("no 'conversations' or 'messages' list")
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"'{key}' must be a non-empty list of turns")
    carried: list[ImageRef] = []
    turns = []
    if isinstance(raw.get("system"), str) and raw["system"].strip():
        turns.append({"role": "system", "text": raw["system"]})
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise RecordError(f"{key}[{i}] is {type(turn).__name__}, not a turn object")
        role = ROLES.get(str(turn.get("from") or turn.get("role")))
        if role is None:
            raise RecordError(
                f"{key}[{i}]: role {turn.get('from') or turn.get('role')!r}; use from=system|human|gpt or "
                "role=system|user|assistant"
            )
        text = _text_of(turn.get("value", turn.get("content")), f"{key}[{i}]", carried, image_root)
        if role == "system" and turns:
            raise RecordError(
                f"{key}[{i}]: a system turn is only allowed first, and once (a top-level 'system' counts)"
            )
        if role != "user" and IMAGE_MARKER in text:
            raise RecordError(f"{key}[{i}]: an image marker in a {role} turn; images go in user turns")
        turns.append({"role": role, "text": text})
    if carried and images:
        raise RecordError("images both in the record's 'images' and inside message parts; give them one way")
    images = images or carried
    markers = sum(t["text"].count(IMAGE_MARKER) for t in turns)
    if markers and markers != len(images):
        raise RecordError(f"{len(images)} image(s) but {markers} {IMAGE_MARKER} marker(s); give one marker per image")
    if not any(t["role"] == "assistant" for t in turns):
        raise RecordError("no gpt/assistant turn to learn from")
    empty = next((i for i, t in enumerate(turns) if t["role"] != "system" and not t["text"].strip()), None)
    if empty is not None:
        raise RecordError(f"turn {empty} ({turns[empty]['role']}) is empty; drop the turn or write it")
    return images, turns


def choices_of(raw: dict) -> dict[str, str] | None:
    """Multiple-choice options as {letter: text}: a dict, a list (lettered A, B, ...) or MMBench's A..E columns."""
    value = raw.get("choices", raw.get("options"))
    if value is None and all(isinstance(raw.get(c), str) for c in "AB"):
        value = {c: raw[c] for c in _LETTERS[:8] if isinstance(raw.get(c), str) and raw[c].strip()}
    if value is None:
        return None
    if isinstance(value, list):
        value = dict(zip(_LETTERS, value, strict=False))
    if not isinstance(value, dict) or len(value) < 2 or not all(isinstance(v, str) for v in value.values()):
        raise RecordError(f"choices must be two or more option strings (a list or {{letter: text}}), got {value!r}")
    return {str(k).strip().upper(): v for k, v in value.items()}


def _strip_markers(text: str) -> str:
    return "\n".join(line for line in text.replace(IMAGE_MARKER, "").splitlines() if line.strip()).strip()


def _answers(value: Any) -> list[str]:
    """Reference answers: a string, a list of strings, or VQAv2's [{"answer": ...}, ...]."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        out = [v.get("answer") if isinstance(v, dict) else v for v in value]
        if all(isinstance(v, str) for v in out):
            return [str(v) for v in out]
    raise RecordError(f"answers must be a string or a list of strings, got {value!r}")


def with_options(question: str, choices: dict[str, str]) -> str:
    """A multiple-choice prompt in MMBench / LLaVA's form, unless the question already lists its options."""
    if re.search(r"(?m)^\s*\(?A[.)]", question):
        return question
    options = "\n".join(f"{letter}. {text}" for letter, text in choices.items())
    return f"{question}\n{options}\nAnswer with the option's letter from the given choices directly."


def question(raw: dict, image_root: str = "") -> dict:
    """A held-out / RL question {"images", "question", "answers", "choices", "box"} of a flat or chat record."""
    if "question" in raw:
        if not isinstance(raw["question"], str) or not raw["question"].strip():
            raise RecordError("'question' must be a non-empty string")
        if "answers" not in raw and "answer" not in raw:
            raise RecordError("a flat record needs 'answer' (or 'answers')")
        images, text = record_images(raw, image_root), _strip_markers(raw["question"])
        answers = _answers(raw.get("answers", raw.get("answer")))
    else:
        images, turns = conversation(raw, image_root)
        user = next((t["text"] for t in turns if t["role"] == "user"), None)
        if user is None:
            raise RecordError("no human/user turn to ask")
        text = _strip_markers(user)
        answers = (
            _answers(raw["answers"])
            if "answers" in raw
            else [next(t["text"] for t in turns if t["role"] == "assistant")]
        )
    if len(images) != 1:
        raise RecordError(f"{len(images)} images; a held-out or RL question needs exactly one")
    if not any(a.strip() for a in answers) and raw.get("box") is None:
        raise RecordError("the answer is empty; give the reference answer")
    choices = choices_of(raw)
    out: dict[str, Any] = {
        "images": images,
        "question": with_options(text, choices) if choices else text,
        "answers": answers,
    }
    if choices:
        out["choices"] = choices
    box = raw.get("box")
    if box is not None:
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, int | float) for v in box)):
            raise RecordError(f"'box' must be [x1, y1, x2, y2] in image pixels, got {box!r}")
        out["box"] = [float(v) for v in box]
    return out


def _side(value: Any, name: str) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        value = value[0].get("content")
        if isinstance(value, list):
            value = "".join(p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"'{name}' must be a non-empty string (or one assistant message), got {value!r}")
    return value


def preference(raw: dict, image_root: str = "") -> dict:
    """A preference pair {"images", "prompt", "chosen", "rejected"} (TRL's DPO layout, prompt a string or messages)."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in raw]
    if missing:
        raise RecordError(f"a preference record needs prompt, chosen and rejected; missing {missing}")
    images, prompt = record_images(raw, image_root), raw["prompt"]
    if isinstance(prompt, list):
        carried: list[ImageRef] = []
        users = [
            _text_of(m.get("content"), f"prompt[{i}]", carried, image_root)
            for i, m in enumerate(prompt)
            if isinstance(m, dict) and ROLES.get(str(m.get("role"))) == "user"
        ]
        if not users:
            raise RecordError("the prompt messages hold no user turn")
        prompt, images = users[-1], images or carried
    if not isinstance(prompt, str) or not prompt.strip():
        raise RecordError(f"'prompt' must be a non-empty string or messages, got {prompt!r}")
    if len(images) != 1:
        raise RecordError(f"{len(images)} images; a preference pair needs exactly one")
    chosen, rejected = _side(raw["chosen"], "chosen"), _side(raw["rejected"], "rejected")
    if " ".join(chosen.split()) == " ".join(rejected.split()):
        raise RecordError("chosen and rejected are the same text (up to whitespace)")
    return {"images": images, "prompt": _strip_markers(prompt), "chosen": chosen, "rejected": rejected}


def detect(raw: dict) -> str:
    """The record shape of one raw record (for format: auto)."""
    if "chosen" in raw and "rejected" in raw:
        return "preference"
    if "conversations" in raw:
        return "llava"
    if "messages" in raw:
        return "messages"
    if "question" in raw:
        return "flat"
    raise RecordError(
        f"unknown record shape (keys {sorted(raw)[:8]}); expected 'conversations' (LLaVA / ShareGPT), 'messages' "
        "(chat parts), 'question' + 'answer' (flat) or 'prompt' + 'chosen' + 'rejected' (preference)"
    )
