"""Data readers of the model stages: data directories (local or s3://), JSONL files, conversation records,
held-out question files and the images they name.

Conversation records are LLaVA-style {"id", "image"|"images", "conversations": [{"from","value"}]} (or
role/content turns); held-out files hold {"id","image","question","answer","type"} or conversation records
with a `type`. Every error names the file, line or record id and how to fix it.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from PIL import Image

from components._shared.eval import metrics as M


def resolve_data_dir(uri: str | Path, *, scratch: Path) -> Path:
    """A local directory for a data URI (s3:// prefixes are downloaded into `scratch`)."""
    from components._shared.platform import storage

    if storage.is_s3(uri):
        return storage.fetch_dir(uri, scratch / "data", require_commit=storage.is_committed(uri))
    path = Path(uri)
    if not path.is_dir():
        raise ValueError(
            f"data directory {uri!r} does not exist; pass the held-out directory `qvl lake synth` "
            "wrote (DIR/heldout) or an s3:// prefix with eval.jsonl / sft.jsonl and images."
        )
    return path


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    """Records of a JSONL file; a clear error names the line and the missing field."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist; the data directory must hold {path.name}.")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{n}: not valid JSON ({error.msg}); fix or remove that line.") from error
        missing = [k for k in required if k not in record]
        if missing:
            raise ValueError(f"{path}:{n} (id={record.get('id')!r}): missing field(s) {missing}.")
        records.append(record)
    return records


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def load_conversations(data_dir: Path, max_records: int | None = None, *, file_name: str = "sft.jsonl") -> list[dict]:
    """sft.jsonl (or `file_name`) as [{"id", "images": [paths], "turns": [{"role","text"}], "difficulty", "type"}]."""
    records = []
    for raw in read_jsonl(data_dir / file_name, ("id", "conversations")):
        images = raw.get("images") or ([raw["image"]] if raw.get("image") else [])
        turns = []
        for i, turn in enumerate(raw["conversations"]):
            role = ROLES.get(turn.get("from") or turn.get("role"))
            text = turn.get("value", turn.get("content"))
            if role is None or not isinstance(text, str):
                raise ValueError(
                    f"conversation record {raw['id']!r} turn {i}: expected from=human|gpt (or role=user|assistant) "
                    f"and a string value, got {turn!r}."
                )
            turns.append({"role": role, "text": text})
        if not any(t["role"] == "assistant" for t in turns):
            raise ValueError(
                f"conversation record {raw['id']!r} has no gpt/assistant turn to learn from; drop or fix it."
            )
        records.append(
            {
                "id": raw["id"],
                "images": images,
                "turns": turns,
                "difficulty": raw.get("difficulty", "all"),
                "type": raw.get("type", "unknown"),
            }
        )
        if max_records and len(records) >= max_records:
            break
    text_only = [r["id"] for r in records if not r["images"]]
    if text_only and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"sft records {text_only[:3]} have no image; with several processes a text-only "
            "micro-batch leaves the vision tower out of the gradient reduction. Drop them or train them "
            "in a single-process run."
        )
    return records


MAX_IMAGE_PIXELS = 89_478_485  # Pillow's default bomb limit, enforced by imaging.decode_image


def load_image(root: Path, reference: str) -> Image.Image:
    """An image named by a data record: a path inside the data directory, or an s3:// object. Decoded through
    the same guarded decoder as the lake (format allow-list, decompression-bomb limit)."""
    from components._shared.platform import storage
    from components._shared.platform.imaging import ImageRejected, decode_image

    if storage.is_s3(reference):
        data = storage.read_bytes(reference)
    else:
        path = (root / reference).resolve()
        if root.resolve() not in path.parents:
            raise ValueError(
                f"image path {reference!r} leaves the data directory {root}; use paths inside it or s3:// URIs."
            )
        if not path.is_file():
            raise ValueError(f"image {reference!r} does not exist under the data directory {root}.")
        data = path.read_bytes()
    try:
        return decode_image(data, max_image_pixels=MAX_IMAGE_PIXELS).image
    except ImageRejected as error:
        raise ValueError(f"image {reference!r} cannot be used: {error}") from error


def load_eval_records(
    data_dir: Path, *, per_type: int | None = None, files: tuple[str, ...] | list[str] = ("eval.jsonl",)
) -> list[dict]:
    """Held-out questions {"id", "image", "question", "answer", "type", "pil"} from `files` in the data directory,
    at most `per_type` of each question type (file order), images loaded. A file holds eval.jsonl records
    ({"id","image","question","answer","type"}) or LLaVA conversation records with a `type` and one image (as
    sft.jsonl / rl.jsonl: the first human turn is the question, the first gpt turn the answer)."""
    records: list[dict] = []
    seen: dict[str, str] = {}
    for file_name in files:
        for record in _eval_file_records(data_dir, file_name):
            if record["id"] in seen:
                raise ValueError(
                    f"eval record id {record['id']!r} is in both {seen[record['id']]} and {file_name}; "
                    "held-out ids must be unique across eval files."
                )
            seen[record["id"]] = file_name
            records.append(record)
    counts: dict[str, int] = defaultdict(int)
    kept = []
    for record in records:
        if record["type"] not in M.QUESTION_TYPES:
            raise ValueError(
                f"eval record {record['id']!r}: unknown type {record['type']!r}; use one of {M.QUESTION_TYPES}."
            )
        if per_type is None or counts[record["type"]] < per_type:
            counts[record["type"]] += 1
            kept.append({**record, "pil": load_image(data_dir, record["image"])})
    return kept


def _eval_file_records(data_dir: Path, file_name: str) -> list[dict]:
    """One eval file's records in eval.jsonl's flat form (conversation records converted)."""
    path = data_dir / file_name
    first = "{}"
    if path.is_file():
        with path.open() as lines:
            first = next((line for line in lines if line.strip()), first)
    try:
        conversation_format = "conversations" in json.loads(first)
    except json.JSONDecodeError:
        conversation_format = False  # read_jsonl names the line
    if not conversation_format:
        return read_jsonl(path, ("id", "image", "question", "answer", "type"))
    return conversation_questions(data_dir, file_name, label="eval record")


def conversation_questions(data_dir: Path, file_name: str, *, label: str) -> list[dict]:
    """A conversation file (sft.jsonl / rl.jsonl format) as {"id", "image", "question", "answer", "type"}: the first
    human turn (without its <image> marker) and the first gpt turn; a record needs exactly one image."""
    out = []
    for r in load_conversations(data_dir, file_name=file_name):
        if len(r["images"]) != 1:
            raise ValueError(f"{file_name}: {label} {r['id']!r} has {len(r['images'])} images; each needs exactly one.")
        question = next((t["text"] for t in r["turns"] if t["role"] == "user"), None)
        if question is None:
            raise ValueError(f"{file_name}: {label} {r['id']!r} has no human turn to ask.")
        answer = next(t["text"] for t in r["turns"] if t["role"] == "assistant")
        out.append(
            {
                "id": r["id"],
                "image": r["images"][0],
                "question": question.replace("<image>", "").strip(),
                "answer": answer,
                "type": r["type"],
            }
        )
    return out


def prompt_turns(question: str) -> list[dict]:
    return [{"role": "user", "text": f"<image>\n{question}"}]
