"""Data readers of the model stages: data directories (local or s3://), their dataset.yaml, the records of each
role (sft conversations, held-out and RL questions, preference pairs) and the images they name.

A data directory describes itself in dataset.yaml (data/manifest.py, docs/data.md): per role the files to read, each
with its format, task, benchmark name and image folder, and the tasks it declares (name -> scorer). Without one the
synthetic world's names are read: sft.jsonl, eval.jsonl, preferences.jsonl. The formats are data/formats.py's.
Every error names the file, line or record id and how to fix it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import defaultdict
from pathlib import Path

from PIL import Image

from components._shared.data import formats as F
from components._shared.data import tasks as T
from components._shared.data.benchmarks import BENCHMARKS
from components._shared.data.file_checks import naming_the_file
from components._shared.data.image_checks import MAX_IMAGE_PIXELS, local_image_path
from components._shared.data.manifest import (  # noqa: F401 - MANIFEST, Manifest, parse_manifest: this module's API too
    BENCHMARK_NAME,
    MANIFEST,
    ROLES_DEFAULT,
    DataFile,
    Manifest,
    _stem,
    manifest,
    parse_manifest,
)
from components._shared.data.preference_checks import check_pair_fields, repeated_pairs
from components._shared.data.record_ids import check_ids, id_as_seen, said_twice
from components._shared.data.record_images import check_record_images, check_stray_images
from components._shared.platform import bad_records
from components._shared.platform.credential_shapes import shown
from components._shared.platform.shards import tar_shards


def resolve_data_dir(uri: str | Path, *, scratch: Path) -> Path:
    """A local directory for a data URI (s3:// prefixes are downloaded into `scratch`)."""
    from components._shared.platform import storage

    if storage.is_s3(uri):
        return storage.fetch_dir(uri, scratch / "data", require_commit=storage.is_committed(uri))
    path = Path(uri)
    if path.is_file():
        raise ValueError(
            f"--data {str(uri)!r} is a file; give the directory that holds it (and dataset.yaml, or the default file "
            f"names), here {str(path.parent)!r}."
        )
    if not path.is_dir():
        raise ValueError(
            f"data directory {uri!r} does not exist; pass the held-out directory `qvl lake synth` "
            "wrote (DIR/heldout) or an s3:// prefix with eval.jsonl / sft.jsonl and images."
        )
    data_files = [p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet", ".tsv", ".yaml")]
    shards = tar_shards(path)
    if shards and not data_files:
        raise ValueError(
            f"--data {str(uri)!r} holds lake shards ({', '.join(shards[:3])}), not training data: --data takes "
            "the directory of eval.jsonl / sft.jsonl (or a dataset.yaml); the lake goes to clean_data's --lake-uri."
        )
    return path


logger = logging.getLogger(__name__)

CONSUMED = {"image", "images", "conversations", "messages", "task", "system", "question", "answer", "answers",
            "choices", "options", "box", "prompt", "chosen", "rejected", "question_id", "hint",
            "shortened"}  # fmt: skip


def _raw_id(raw) -> str | None:
    """The id a raw record or benchmark item gives itself, for error messages."""
    if not isinstance(raw, dict):
        return None
    value = next((raw[k] for k in ("id", "question_id", "questionId", "index") if raw.get(k) is not None), None)
    return None if value is None else str(value)


def _read(data_dir: Path, spec: DataFile, convert, what: str) -> list[dict]:
    """Every record of one file through `convert(raw, spec) -> record`. All bad records are reported at once
    (a ValueError listing them), or dropped and counted under `on_bad_record: skip` (platform/bad_records.py)."""
    out: list[dict] = []
    bad: list[tuple[str, str]] = []  # (source, reason)
    _check_inside(data_dir, spec)
    benchmark = BENCHMARKS.get(spec.format)
    if benchmark is None:
        items = F.iter_file(data_dir / spec.path)
    else:
        annotations = data_dir / spec.annotations if spec.annotations else None
        items = benchmark.read(spec.format, data_dir / spec.path, annotations)
    seen: dict[tuple[str | None, str], str] = {}  # (benchmark, id as seen) -> id: unique within a benchmark
    took_entry_task = False  # whether a record named no task of its own (the entry's `task` is for those)
    for n, (source, raw) in enumerate(naming_the_file(items, data_dir / spec.path, spec.path)):
        try:
            if isinstance(raw, F.Unparsable):
                raise F.RecordError(str(raw))
            if not isinstance(raw, dict):
                raise F.RecordError(f"a {type(raw).__name__}, not a record object")
            check_ids(raw)
            if benchmark is not None:
                raw, shape = benchmark.record(raw), "flat"
            else:
                shape = _declared_shape(raw, spec)
            check_stray_images(raw, paths=False)  # before the shape's own errors ("0 images") hide the cause
            took_entry_task = took_entry_task or not (raw.get("task") or raw.get("type"))
            record = convert(raw, shape, spec)
            check_record_images(data_dir, raw, record, "" if spec.images else str(Path(spec.path).parent))
            given = next((raw[k] for k in ("id", "question_id") if raw.get(k) is not None), None)  # null: no id
            record_id = str(given if given is not None else f"{_stem(spec.path)}:{n}")
            first = seen.get((record.get("benchmark"), id_as_seen(record_id)))
            if first is not None:
                raise F.RecordError(said_twice(record_id, first))
        except KeyError as error:
            bad.append((source, f"the {spec.format} item has no field {error}"))
            continue
        except F.RecordError as error:
            reason = shown(str(error), 400)  # a record's value of any size
            raw_id = _raw_id(raw)
            bad.append((f"{source} (id={raw_id!r})" if raw_id is not None else source, reason))
            continue
        seen[record.get("benchmark"), id_as_seen(record_id)] = record_id
        for key, value in raw.items():  # the record's own labels (a preference pair's kind, a benchmark category)
            if key not in record and key not in CONSUMED and isinstance(value, str | int | float | bool):
                record[key] = value
        record["id"], record["source"], record["file"] = record_id, source, spec.path
        out.append(record)
    if not out and not bad:
        raise ValueError(f"{spec.path} holds no records; fill it or leave it out of dataset.yaml.")
    if spec.task and out and not took_entry_task:  # every record named its own task (even the entry's one)
        logger.warning(
            "%s: dataset.yaml gives it task %r, but each of its %d record(s) names its own ('task' / 'type'), so the "
            "entry's task applies to none of them; drop it from the entry, or from the records",
            spec.path,
            spec.task,
            len(out),
        )
    bad_records.settle(spec.path, bad, kept=len(out), what=f"bad {what} record(s)")
    return out


def _declared_shape(raw: dict, spec: DataFile) -> str:
    """The record's shape: detected (format: auto), or the entry's format, which the record must have (a flat record
    under `format: llava` was read as flat without a word)."""
    found = F.detect(raw)
    if spec.format in ("auto", found) or (spec.format == "sharegpt" and found == "llava"):
        return found if spec.format == "auto" else spec.format
    raise F.RecordError(
        f"dataset.yaml gives {spec.path!r} format: {spec.format}, but this record is {found} (keys "
        f"{sorted(raw)[:6]}); fix the entry's format (or leave it out: auto) or the record"
    )


def _check_inside(data_dir: Path, spec: DataFile) -> None:
    """The entry's path, annotations and images folder resolve inside the data directory (an s3:// images folder
    aside): a `../x.jsonl` or an absolute path would read files the data directory does not hold."""
    root = data_dir.resolve()
    named = {"path": spec.path, "annotations": spec.annotations, "images": spec.images}
    for field, value in named.items():
        if not value or (field == "images" and value.startswith("s3://")):
            continue
        if "://" in value:
            raise ValueError(
                f"data file entry {spec.path!r}: {field} is a URL; nothing is fetched: copy the file into the data "
                "directory and name it relative to it."
            )
        where = (data_dir / value).resolve()
        if where != root and root not in where.parents:
            raise ValueError(
                f"data file entry {spec.path!r}: {field} {value!r} resolves outside the data directory {data_dir}; "
                "name it relative to the data directory (no '..', no absolute path), or copy it into the directory."
            )


def _task_name(raw: dict, spec: DataFile) -> str | None:
    task, kind = raw.get("task"), raw.get("type")
    if task and kind and task != kind:
        raise F.RecordError(f"'task' {task!r} and 'type' {kind!r} disagree; give one of them")
    return task or kind or spec.task


def _difficulty(raw: dict) -> str:
    """A curriculum level's name ("all" when none is given)."""
    level = raw.get("difficulty")
    if level is None:  # not given (or a table's empty cell): every phase's
        return "all"
    if not isinstance(level, str) or not level.strip():
        raise F.RecordError(f"'difficulty' must be a level's name (a string such as 'basic'), got {level!r}")
    return level


def _conversation(raw: dict, shape: str, spec: DataFile) -> dict:
    if shape in ("flat", "preference"):
        raise F.RecordError(f"a {shape} record where a conversation is expected (conversations / messages)")
    images, turns = F.conversation(raw, spec.images)
    return {
        "images": images,
        "turns": turns,
        "difficulty": _difficulty(raw),
        "type": _task_name(raw, spec) or "unknown",
    }


def load_conversations(
    data_dir: Path, max_records: int | None = None, *, file_name: str | None = None, role: str = "sft"
) -> list[dict]:
    """Conversation records {"id", "images", "turns": [{"role": system|user|assistant, "text"}], "difficulty",
    "type", "source"} of the role's files (dataset.yaml, else sft.jsonl), any chat shape (formats.py)."""
    info = manifest(data_dir)
    records: list[dict] = []
    for spec in info.files(role, [file_name] if file_name else None):
        records += _read(data_dir, spec, _conversation, "conversation")
    records = records[:max_records] if max_records else records
    text_only = [r["id"] for r in records if not r["images"]]
    if text_only and int(os.environ.get("WORLD_SIZE", "").strip() or 1) > 1:
        raise ValueError(
            f"sft records {text_only[:3]} have no image; with several processes a text-only "
            "micro-batch leaves the vision tower out of the gradient reduction. Drop them or train them "
            "in a single-process run."
        )
    return records


def _question(tasks: dict[str, str], *, first_exchange: bool = False):
    def convert(raw: dict, shape: str, spec: DataFile) -> dict:
        if shape == "preference":
            raise F.RecordError("a preference record where a question is expected")
        q = F.question(raw, spec.images, first_exchange=first_exchange)
        name = _task_name(raw, spec) or (spec.format if spec.format in BENCHMARKS else None)
        declared = {spec.format: BENCHMARKS[spec.format].scorer, **tasks} if spec.format in BENCHMARKS else tasks
        if name is None:
            raise F.RecordError("no task: give the record a 'task' (or 'type') or set the file's task in dataset.yaml")
        try:
            task = T.resolve(str(name), declared, where="")
        except ValueError as error:
            raise F.RecordError(str(error)) from None
        images = q.pop("images")
        benchmark = raw.get("benchmark") or spec.benchmark
        if benchmark is not None and not (isinstance(benchmark, str) and BENCHMARK_NAME.fullmatch(benchmark)):
            raise F.RecordError(
                f"benchmark {shown(str(benchmark), 80)!r}: use at most 64 letters, digits, '_', '.', '-' (a metric "
                "name part)"
            )
        record = {"image": images[0], **q, "answer": q["answers"][0], "type": task.name, "benchmark": benchmark}
        if not task.builtin:
            record["scorer"] = task.scorer
        if task.scorer == "multiple_choice" and "choices" not in record:
            raise F.RecordError("a multiple_choice task needs 'choices' (a list or {letter: text}, or A..D columns)")
        if task.scorer != "multiple_choice" and "choices" in record:  # the prompt would ask for a letter
            raise F.RecordError(
                f"'choices' given, but task {task.name!r} is scored by {task.scorer}, which compares the answer text "
                "(the prompt would ask for an option's letter); use a multiple_choice task or drop the choices"
            )
        if task.scorer != "grounding" and record.get("box") is not None:  # nothing would read it
            raise F.RecordError(
                f"'box' given, but task {task.name!r} is scored by {task.scorer}, which does not read a box; use a "
                "grounding task or drop the box"
            )
        check = T.SCORERS[task.scorer].check
        try:  # an answer its scorer cannot use fails here, not after generation or in RL's rewards
            check and check(record)
        except ValueError as error:
            raise F.RecordError(str(error).removeprefix(f"record {record.get('id')!r}: ").rstrip(".")) from None
        return record

    return convert


def load_questions(
    data_dir: Path, files: list[str] | tuple[str, ...] | None = None, *, role: str = "eval"
) -> list[dict]:
    """Question records {"id", "image", "question", "answer", "answers", "type" (the task), "scorer", "benchmark",
    optional "choices" / "box", "source"} of the role's files. Held-out ids are unique within a benchmark (POPE's
    question 1 and MMBench's index 1 are two records; results are kept by benchmark and id); RL prompt ids are unique
    across the files (RL keys its caches by id). RL prompts (role "rl") take a longer conversation's first exchange,
    counted and said; a held-out question must be one exchange."""
    info = manifest(data_dir)
    records: list[dict] = []
    seen: dict[tuple[str | None, str], str] = {}  # (benchmark, id) -> file
    problems: list[str] = []  # every file's bad records in one error: one pass over the messages fixes them all
    for spec in info.files(role, files):
        try:
            read = _read(data_dir, spec, _question(info.tasks, first_exchange=role == "rl"), "question")
        except ValueError as error:
            problems.append(str(error))
            continue
        shortened = sum(bool(r.pop("shortened", False)) for r in read)
        if shortened:
            print(
                f"note: {shortened} of {len(read)} RL prompts of {spec.path} are the first exchange of a longer "
                "conversation (its system prompt and later turns are not used)",
                file=sys.stderr,
                flush=True,
            )
        for record in read:
            key = (record["benchmark"] if role == "eval" else None, id_as_seen(record["id"]))
            if key in seen:
                raise ValueError(_repeated_id(record["id"], key[0], role, seen[key], spec.path))
            seen[key] = spec.path
            records.append(record)
    if problems:
        raise ValueError(problems[0] if len(problems) == 1 else f"{len(problems)} files: " + "\n".join(problems))
    return records


def _repeated_id(record_id: str, benchmark: str | None, role: str, first: str, second: str) -> str:
    where = f"record id {record_id!r} is in both {first} and {second}"
    if role != "eval":
        return f"{where}; RL prompt ids must be unique across files (RL keys its caches by id): renumber one file's."
    scope = f"both of benchmark {benchmark!r}" if benchmark else "neither naming a benchmark"
    return (
        f"{where}, {scope}; ids must be unique within a benchmark: renumber one file's ids, or give it another "
        "`benchmark:` in dataset.yaml."
    )


def conversation_questions(data_dir: Path, file_name: str | None, *, label: str = "rl prompt") -> list[dict]:
    """RL prompts as question records: `file_name`, else dataset.yaml's rl files, else sft.jsonl."""
    default = Path(data_dir) / ROLES_DEFAULT["rl"]
    if not file_name and not manifest(data_dir).rl and not default.is_file():
        raise ValueError(
            f"{label}s: rl.prompts_file is unset and the data directory lists no rl files (dataset.yaml), so they are "
            f"read from the default {default}, which does not exist; set rl.prompts_file to a question or "
            "conversation file in the data directory, or list rl files in its dataset.yaml (docs/data.md)."
        )
    return load_questions(data_dir, [file_name] if file_name else None, role="rl")


def _preference(raw: dict, shape: str, spec: DataFile) -> dict:
    check_pair_fields(raw)
    pair = F.preference(raw, spec.images)
    return {"image": pair.pop("images")[0], **pair}


def load_preferences(data_dir: Path, max_records: int | None = None) -> list[dict]:
    """Preference pairs {"id", "image", "prompt", "chosen", "rejected", "source"} (dataset.yaml's preferences files,
    else preferences.jsonl)."""
    records: list[dict] = []
    for spec in manifest(data_dir).files("preferences"):
        records += _read(data_dir, spec, _preference, "preference")
    repeats = repeated_pairs(records)
    ledger = bad_records.current()
    if repeats and not (ledger is not None and ledger.skipping):
        listed = "\n  ".join(
            f"{r['source']} (id={r['id']!r}): {how} as {f['source']} (id={f['id']!r})" for f, r, how in repeats[:5]
        )
        raise ValueError(
            f"{len(repeats)} preference pair(s) given again: each would train twice (or both ways) and could land on "
            f"both sides of the held-out split; drop the repeats (or set on_bad_record: skip):\n  {listed}"
        )
    if repeats and ledger is not None:
        for first, repeat, how in repeats:
            ledger.skip(repeat["source"], f"{how} as {first['source']}")
        dropped = {id(r) for _, r, _ in repeats}
        records = [r for r in records if id(r) not in dropped]
    return records[:max_records] if max_records else records


def load_image(root: Path, reference: F.ImageRef) -> Image.Image:
    """An image named by a data record: a path inside the data directory, an s3:// object, bytes (a data: URI) or a
    Parquet cell. Decoded through the same guarded decoder as the lake (format allow-list, decompression-bomb
    limit, EXIF orientation applied, RGB)."""
    from components._shared.platform import storage
    from components._shared.platform.image_decode import ImageRejected, decode_image

    if isinstance(reference, F.ParquetImage):
        data, path_in_cell = F.read_parquet_image(reference)
        name = f"{Path(reference.path).name} row {reference.row} column {reference.column!r}"
        if data is None and path_in_cell:
            return load_image(root, F.image_ref(path_in_cell, reference.root))
    elif isinstance(reference, bytes):
        data, name = reference, f"<{len(reference)} bytes>"
    elif storage.is_s3(reference):
        data, name = storage.read_bytes(reference), reference
    else:
        data, name = local_image_path(root, reference).read_bytes(), reference
    try:
        return decode_image(data or b"", max_image_pixels=MAX_IMAGE_PIXELS).image
    except ImageRejected as error:
        raise ValueError(f"image {name!r} cannot be used: {error}") from error


def load_eval_records(
    data_dir: Path, *, per_type: int | None = None, files: tuple[str, ...] | list[str] | None = None
) -> list[dict]:
    """Held-out question records (load_questions) with their image loaded as "pil", at most `per_type` of each
    task per benchmark (file order)."""
    counts: dict[tuple, int] = defaultdict(int)
    kept = []
    for record in load_questions(data_dir, files):
        key = (record["benchmark"], record["type"])
        if per_type is None or counts[key] < per_type:
            counts[key] += 1
            kept.append({**record, "pil": load_image(data_dir, record["image"])})
    return kept


def prompt_turns(question: str) -> list[dict]:
    return [{"role": "user", "text": f"<image>\n{question}"}]
