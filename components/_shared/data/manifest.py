"""dataset.yaml: the data directory's own description (docs/data.md), read and validated once. Per role the files to
read, each with its format, task, benchmark name and image folder, and the tasks it declares (name -> scorer);
without one the synthetic world's names are read: sft.jsonl, eval.jsonl, preferences.jsonl."""

from __future__ import annotations

import difflib
import os
import re
import unicodedata
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from components._shared.data import tasks as T
from components._shared.data.benchmarks import BENCHMARKS
from components._shared.data.file_checks import TRAINING_ROLES, check_distinct_contents, check_training_files
from components._shared.platform.names import hidden_in_name, twin_of

MANIFEST = "dataset.yaml"
BENCHMARK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # 64 at most: metric keys stay under MLflow's 250
ROLES_DEFAULT = {"sft": "sft.jsonl", "eval": "eval.jsonl", "rl": "sft.jsonl", "preferences": "preferences.jsonl"}


class DataFile(BaseModel):
    """One data file of dataset.yaml: its path in the data directory and how to read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(min_length=1)
    format: Literal[
        "auto", "llava", "sharegpt", "messages", "flat", "preference",
        "vqav2", "textvqa", "docvqa", "chartqa", "refcoco", "mmbench", "pope", "coco_captions",
    ] = "auto"  # fmt: skip
    annotations: str | None = Field(None, description="The benchmark's second file (VQAv2's annotations).")
    task: str | None = Field(None, description="The task of records that name none (their 'task' / 'type').")
    benchmark: str | None = Field(
        None, pattern=BENCHMARK_NAME.pattern, description="Name of the file's results (default its stem)."
    )
    images: str = Field("", description="Directory (in the data directory) that relative image paths start from.")


class Manifest(BaseModel):
    """dataset.yaml: the data directory's own description; without one, the synthetic world's file names."""

    model_config = ConfigDict(extra="forbid")
    tasks: dict[str, str] = Field(default_factory=dict, description="Task name -> scorer (data/tasks.py SCORERS).")
    sft: list[DataFile | str] = Field(default_factory=list)
    eval: list[DataFile | str] = Field(default_factory=list)
    rl: list[DataFile | str] = Field(default_factory=list)
    preferences: list[DataFile | str] = Field(default_factory=list)
    _root: Path | None = PrivateAttr(None)  # the data directory (manifest() sets it): files compared by content

    def files(self, role: str, names: list[str] | tuple[str, ...] | None = None) -> list[DataFile]:
        """The files `role` reads: `names` (a stage setting) or the manifest's list, else the default file. A
        training role's file listed twice (its records would train twice) or also held out is refused."""
        listed = self._entries(role)
        if names:
            known = {f.path: f for r in ("sft", "eval", "rl", "preferences") for f in self._listed(r)}
            files = [known.get(n, DataFile(path=n)) for n in names]
        elif listed:
            files = [
                f if f.benchmark or role != "eval" else f.model_copy(update={"benchmark": _default_name(f)})
                for f in listed
            ]
        else:
            files = [DataFile(path=ROLES_DEFAULT[role])]
        if role == "eval":  # one file listed twice: its records would be scored twice, as two benchmarks (Y03)
            check_training_files(role, [f.path for f in files], [])
        if role in TRAINING_ROLES:
            held_out = [f.path for f in self._listed("eval")]
            check_training_files(role, [f.path for f in files], held_out)
            if self._root is not None:
                check_distinct_contents(self._root, role, [f.path for f in files], held_out)
        return files

    def _entries(self, role: str) -> list[DataFile]:
        return [DataFile(path=f) if isinstance(f, str) else f for f in getattr(self, role)]

    def _listed(self, role: str) -> list[DataFile]:
        return self._entries(role) or [DataFile(path=ROLES_DEFAULT[role])]


def _stem(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem).lstrip("_.-") or "data"


def _default_name(spec: DataFile) -> str:
    """A file's benchmark name: the benchmark format's own (docvqa, pope, ...), else the file's stem."""
    return spec.format if spec.format in BENCHMARKS else _stem(spec.path)


def manifest(data_dir: Path) -> Manifest:
    """The data directory's dataset.yaml (or dataset.json), validated; an empty manifest when there is none."""
    odd = [data_dir / n for n in (MANIFEST, "dataset.json") if (data_dir / n).exists() and not (data_dir / n).is_file()]
    if odd:  # a directory or a pipe under the name: read as no manifest, the default files would be trained
        raise ValueError(f"{odd[0]} is not a file (a directory or a pipe?); make it the manifest file, or remove it.")
    found = [data_dir / name for name in (MANIFEST, "dataset.json") if (data_dir / name).is_file()]
    if len(found) > 1:
        raise ValueError(f"{data_dir} holds both {MANIFEST} and dataset.json; keep the one that describes the data.")
    if found and data_dir.resolve() not in found[0].resolve().parents:
        raise ValueError(
            f"{found[0]} is a symlink leading outside the data directory (to {found[0].resolve()}); the data's "
            "description belongs with the data, as its files and images do: copy it into the directory."
        )
    if not found:  # a manifest under another name would be ignored: the default files read instead
        misnamed = [f"dataset{s}" for s in (".yml", ".YAML", ".JSON") if (data_dir / f"dataset{s}").is_file()]
        if misnamed:
            raise ValueError(f"{data_dir} holds {misnamed[0]}, not {MANIFEST}: name it {MANIFEST} to be read.")
    try:
        result = parse_manifest(found[0].read_text(encoding="utf-8-sig"), str(found[0])) if found else Manifest()
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{found[0]}: not UTF-8 text (byte {error.object[error.start : error.start + 1]!r} at "
            f"{error.start}); save it as UTF-8."
        ) from None
    result._root = data_dir
    for role in ("sft", "eval", "rl", "preferences"):
        for entry in result._entries(role):
            if entry.images and (data_dir / entry.images).is_file():
                raise ValueError(
                    f"{found[0]}: {role} entry {entry.path!r} gives images: {entry.images!r}, a file; images: names "
                    "the directory that relative image paths start from."
                )
            if entry.images and not (data_dir / entry.images).exists():
                raise ValueError(f"{found[0]}: {role} entry {entry.path!r}: {_missing_images(data_dir, entry.images)}")
    return result


def _missing_images(data_dir: Path, images: str) -> str:
    """Why an `images:` folder is not found: spelled in another Unicode form than the folder (both print alike) or
    in another case, or absent."""
    path = data_dir / images
    twins = [(data_dir / unicodedata.normalize(form, images), "another Unicode form") for form in ("NFC", "NFD")]
    found = twin_of(path)  # the last part in another case (or form)
    for twin, how in [*twins, *([found] if found else [])]:
        if twin != path and twin.is_dir():
            return (
                f"images: {ascii(images)} does not exist as spelled; {ascii(os.path.relpath(twin, data_dir))} "
                f"does: the same letters in {how}. Retype the name in dataset.yaml."
            )
    return f"images: {images!r} does not exist in {data_dir}; name the folder the records' image paths start from."


def _credentials_in(value, path: str = "") -> str | None:
    """The setting path (sft[0].images) of the first string in a manifest that holds a credential's shape."""
    from components._shared.platform.credential_shapes import redact

    if isinstance(value, str):
        return path or "a value" if redact(value) != value else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = _credentials_in(item, where)
        if found:
            return found
    return None


def parse_manifest(text: str, where: str) -> Manifest:
    """A dataset.yaml's text, validated (fields, task names and their scorers); errors name `where`."""
    from pydantic import ValidationError

    from components._shared.platform import strict_yaml

    raw = strict_yaml.load(text, where)
    if not isinstance(raw, dict):  # comments only, 0, false, []: read as no manifest, the default files trained
        raise ValueError(f"{where}: expected a mapping of roles (sft:, eval:, ...), got {raw!r}; see docs/data.md.")
    try:
        result = Manifest.model_validate(raw)
    except ValidationError as error:
        hint = " (YAML reads true and false as booleans: quote such a name)" if _booleans(raw) else ""
        raise ValueError(f"{where}: {_describe(error)}{hint}; see docs/data.md for the fields.") from error
    carrying = _credentials_in(raw)
    if carrying:
        raise ValueError(
            f"{where}: {carrying} carries a credential (hidden); S3 credentials come from the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a Kubernetes secret on the cluster): give the location alone."
        )
    for role in ("sft", "eval", "rl", "preferences"):
        if role in result.model_fields_set and not getattr(result, role):
            raise ValueError(
                f"{where}: {role} is an empty list; name its files, or leave {role} out (then "
                f"{ROLES_DEFAULT[role]} is read if the directory has it)."
            )
        if any(isinstance(f, str) and not f.strip() for f in getattr(result, role)):
            raise ValueError(f"{where}: {role} lists an empty file name; name each file (or leave the list out).")
        for entry in result._entries(role):
            _check_entry_names(where, role, entry)
    folded: dict[str, str] = {}
    for task in result.tasks:
        if task.lower() in folded:
            raise ValueError(
                f"{where}: tasks {folded[task.lower()]!r} and {task!r} differ only by case; their metrics would be "
                "confused in dashboards that fold case: give them distinct names."
            )
        folded[task.lower()] = task
        if not BENCHMARK_NAME.fullmatch(task):
            raise ValueError(
                f"{where}: task name {task!r}: use at most 64 letters, digits, '_', '.', '-' and start with a letter "
                f"or digit (it names the metrics task/<name> and count/<name>), e.g. "
                f"{re.sub(r'[^A-Za-z0-9_.-]', '_', task)[:64]!r}."
            )
        if task in T.BUILTIN_TASKS:
            raise ValueError(f"{where}: task {task!r} is a builtin task; give your task another name.")
        taken = "a benchmark format" if task in BENCHMARKS else "a scorer" if task in T.SCORERS else None
        if taken and result.tasks[task] != (BENCHMARKS[task].scorer if task in BENCHMARKS else task):
            raise ValueError(
                f"{where}: task {task!r} is {taken}'s name, scored otherwise; give your task another name."
            )
        T.resolve(task, result.tasks, where=f"{where} tasks")
    for role in ("sft", "eval", "rl", "preferences"):  # an entry's task, whether or not its records name their own
        for entry in result._entries(role):
            if entry.task is not None and entry.format in BENCHMARKS:  # the release's own scorer, or a wrong one
                raise ValueError(
                    f"{where}: {role} entry {entry.path!r} has format: {entry.format}, scored by its own "
                    f"{BENCHMARKS[entry.format].scorer}; drop task: {entry.task}."
                )
            if entry.task is not None:
                T.resolve(entry.task, result.tasks, where=f"{where} {role} entry {entry.path!r}")
            if entry.annotations and entry.format != "vqav2":
                raise ValueError(
                    f"{where}: {role} entry {entry.path!r} gives annotations, which only format: vqav2 reads (its "
                    f"answers file); this entry's format is {entry.format}: drop annotations or fix the format."
                )
    return result


def _check_entry_names(where: str, role: str, entry: DataFile) -> None:
    """An entry's path, images folder and annotations file as names a listing shows: '/' between folders (a Windows
    '\\' is read as part of one name: thirteenth pass, Y13), no white space at an edge, no invisible character."""
    names = (entry.path, entry.images, entry.annotations or "")
    windows = [v for v in names if "\\" in v]
    if windows:
        raise ValueError(
            f"{where}: {role} entry {windows[0]!r} holds '\\' (a Windows path?); paths in dataset.yaml "
            f"use '/': {windows[0].replace(chr(92), '/')!r}."
        )
    spaced = [v for v in names if v != v.strip()]
    if spaced:
        raise ValueError(
            f"{where}: {role} entry {spaced[0]!r} begins or ends with white space (invisible in messages); "
            "remove it, or rename the file."
        )
    hidden = [v for v in names if hidden_in_name(v)]
    if hidden:
        raise ValueError(
            f"{where}: {role} entry {ascii(hidden[0])} holds {hidden_in_name(hidden[0])}; retype the name."
        )


def _booleans(value) -> bool:
    """Whether a parsed YAML document holds a boolean key or value (where the manifest wants names)."""
    if isinstance(value, dict):
        return any(isinstance(k, bool) or _booleans(v) for k, v in value.items())
    return isinstance(value, bool) or (isinstance(value, list) and any(_booleans(v) for v in value))


def _describe(error) -> str:
    """pydantic's errors as `eval[0].fromat: Extra inputs are not permitted` (the str branch of a file entry left
    out when the entry is a mapping)."""
    lines = []
    for e in error.errors():
        loc = [part for part in e["loc"] if part not in ("DataFile", "str")]
        if "str" in e["loc"] and isinstance(e.get("input"), dict):
            continue
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        if e["type"] == "extra_forbidden":  # a role or an entry field this reader does not know (thirteenth pass)
            names = sorted(Manifest.model_fields if len(loc) == 1 else DataFile.model_fields)
            close = difflib.get_close_matches(str(loc[-1]).lower(), names, n=1, cutoff=0.6)
            what = "role (or tasks)" if len(loc) == 1 else "field of a file entry"
            near = f"did you mean {close[0]}? " if close else ""
            lines.append(f"{where}: unknown {what}; {near}the known ones are {', '.join(names)} (lower case)")
            continue
        lines.append(f"{where}: {e['msg']}")
    return "; ".join(lines)
