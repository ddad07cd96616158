"""Standard benchmarks from the local copies users have (nothing is downloaded), mapped onto flat question records.

Each loader reads the benchmark's own release layout and yields (source, record) with "question", "answer(s)",
"image" and, where the benchmark has them, "choices" or "box"; its scorer is the benchmark's (data/tasks.py).
dataset.yaml names the file and the format, e.g. `{path: TextVQA_0.5.1_val.json, format: textvqa, images:
train_images}`; a second file (VQAv2's annotations) is `annotations:`.

| format | files | scorer |
|---|---|---|
| vqav2 | v2_OpenEnded_mscoco_*_questions.json + annotations: v2_mscoco_*_annotations.json | vqa_accuracy |
| textvqa | TextVQA_0.5.1_{val,train}.json ({"data": [...]}) | vqa_accuracy |
| docvqa | {train,val}_v1.0(_withQT).json ({"data": [...]}) | anls |
| chartqa | {test,val}_{human,augmented}.json ([{imgname, query, label: str or [str]}]) | relaxed_accuracy |
| refcoco | MDETR's final_refcoco*.json (COCO style), or rows {bbox x,y,w,h, expression} (JSONL, Parquet) | grounding |
| mmbench | MMBench_*.tsv (index, question, hint, A..D, answer, image base64 or a row's index) | multiple_choice |
| pope | coco_pope_{random,popular,adversarial}.json (JSON lines: question_id, image, text, label) | yes_no |
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from components._shared.data.formats import RecordError, iter_file
from components._shared.platform.strict_yaml import KeyGivenTwice, json_object

Rows = Iterator[tuple[str, dict]]
GROUNDING_PROMPT = 'Locate "{expression}" in the image and output its bbox coordinates in JSON format.'


@dataclass(frozen=True)
class Benchmark:
    """`items(file, annotations)` yields (source, the release's item); `record(item)` maps one onto a flat record
    (a missing field raises KeyError, reported with the item's source)."""

    scorer: str
    items: Callable[[Path, Path | None], Rows]
    record: Callable[[dict], dict]
    contents: tuple[str, ...] = ("json",)  # what the release file is (file_contents): another is named at once

    def read(self, name: str, path: Path, annotations: Path | None) -> Rows:
        """The release's items, after checking that the file is the kind this benchmark ships."""
        _check_file(path)
        found = file_contents(path)
        if found != "empty" and found not in self.contents:
            wanted = " or ".join(CONTENT_NAMES[kind] for kind in self.contents)
            raise ValueError(
                f"{path.name}: `format: {name}` reads {wanted}, but this file is {CONTENT_NAMES[found]}; name the "
                f"benchmark's own release file in dataset.yaml, or drop `format: {name}` for records of this "
                "project's own shapes (docs/data.md)."
            )
        return self.items(path, annotations)


CONTENT_NAMES = {
    "json": "JSON (or JSON Lines)",
    "parquet": "Parquet",
    "text": "text such as a TSV",
    "binary": "binary, not text",
}


def file_contents(path: Path) -> str:
    """What a file holds, from its first bytes: parquet, json (an object or array, or JSON Lines), text, binary or
    empty."""
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if not text:
        return "empty"  # the reader says what an empty release file lacks
    if text[:1] in (b"{", b"["):
        return "json"
    return "binary" if b"\0" in head else "text"  # text not in UTF-8 is named by its reader, with the line


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"{path} is a directory; name the benchmark's file in dataset.yaml.")
    if not path.is_file():
        what = "is not a regular file (a pipe or a device?)" if path.exists() else "does not exist"
        raise ValueError(f"{path} {what}; name the benchmark's file in dataset.yaml.")


def _json(path: Path):
    """A release file's JSON; a key given twice in one object is refused (json keeps the last quietly)."""
    _check_file(path)
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=json_object)
    except json.JSONDecodeError as error:
        lines = " (more than one JSON document: a JSON Lines file?)" if error.msg == "Extra data" else ""
        raise ValueError(f"{path.name}:{error.lineno}: not valid JSON ({error.msg}){lines}.") from error
    except KeyGivenTwice as error:
        raise ValueError(f"{path.name}: {error}; keep one.") from None


def _data_list(path: Path, _: Path | None = None) -> Rows:
    """The items of a {"data": [...]} release file (TextVQA, DocVQA)."""
    value = _json(path)
    if not (isinstance(value, dict) and isinstance(value.get("data"), list)):
        raise ValueError(f"{path.name}: expected an object with a 'data' list (the benchmark's release layout).")
    for i, item in enumerate(value["data"]):
        yield f"{path.name} data[{i}]", item


def _list(path: Path, _: Path | None = None) -> Rows:
    value = _json(path)
    if not isinstance(value, list):
        raise ValueError(f"{path.name}: expected a JSON list of items (the benchmark's release layout).")
    for i, item in enumerate(value):
        yield f"{path.name}[{i}]", {**item, "_index": i, "_stem": path.stem} if isinstance(item, dict) else item


def _json_lines(path: Path, _: Path | None = None) -> Rows:
    """JSON lines whatever the suffix (POPE ships them as .json)."""
    _check_file(path)
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if line.strip():
            try:
                yield f"{path.name}:{n}", json.loads(line, object_pairs_hook=json_object)
            except json.JSONDecodeError as error:
                array = " (a JSON array: this benchmark's file is JSON Lines, one object per line)"
                hint = array if n == 1 and line.strip() == "[" else ""
                raise ValueError(f"{path.name}:{n}: not valid JSON ({error.msg}){hint}.") from error
            except KeyGivenTwice as error:
                raise ValueError(f"{path.name}:{n}: {error}; keep one.") from None


def coco_image(image_id: int, split: str) -> str:
    """COCO's file name of an image id (COCO_val2014_000000262148.jpg)."""
    return f"COCO_{split}_{int(image_id):012d}.jpg"


def _shape(value) -> str:
    """What a JSON value is, for format errors: 'a list of 3 items', 'an object with keys [...]'."""
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:6]}"
    return f"a {type(value).__name__}"


def _vqav2_items(path: Path, annotations: Path | None) -> Rows:
    """VQAv2's two files: {"data_subtype", "questions": [...]} and {"annotations": [{question_id, answers}]}."""
    if annotations is None:
        raise ValueError(f"{path.name}: vqav2 needs its annotations file (dataset.yaml: annotations: ...).")
    questions, answer_file = _json(path), _json(annotations)
    if not (isinstance(questions, dict) and isinstance(questions.get("questions"), list)):
        swapped = ""
        if isinstance(questions, dict) and "annotations" in questions:
            swapped = " (it looks like the annotations file: swap path and annotations)"
        raise ValueError(
            f"{path.name}: expected VQAv2's questions file (v2_OpenEnded_mscoco_*_questions.json), an object with a "
            f"'questions' list, got {_shape(questions)}{swapped}; name that file as the dataset.yaml entry's path."
        )
    if not (isinstance(answer_file, dict) and isinstance(answer_file.get("annotations"), list)):
        raise ValueError(
            f"{annotations.name}: expected VQAv2's annotations file (v2_mscoco_*_annotations.json), an object with an "
            f"'annotations' list, got {_shape(answer_file)}; name that file as the dataset.yaml entry's annotations."
        )
    answers = {}
    for i, a in enumerate(answer_file["annotations"]):
        if not (isinstance(a, dict) and "question_id" in a):
            raise ValueError(
                f"{annotations.name} annotations[{i}]: expected an object with 'question_id' and 'answers' "
                f"(VQAv2's annotation), got {_shape(a)}; fix or remove that entry."
            )
        if a["question_id"] in answers:
            raise ValueError(
                f"{annotations.name} annotations[{i}]: question_id {a['question_id']!r} has an annotation already; "
                "keep one per question."
            )
        answers[a["question_id"]] = a
    split = questions.get("data_subtype", "val2014")
    for i, q in enumerate(questions["questions"]):
        source = f"{path.name} questions[{i}]"
        if not isinstance(q, dict):
            yield source, q  # reported by the reader as not a record object
            continue
        yield source, {**q, "_split": split, "_annotation": answers.get(q.get("question_id"))}


def _vqav2(item: dict) -> dict:
    if item["_annotation"] is None:
        raise RecordError(f"question_id {item['question_id']} has no annotation in the annotations file")
    given = item["_annotation"].get("answers")
    if not (isinstance(given, list) and given and all(isinstance(a, dict) and "answer" in a for a in given)):
        raise RecordError(
            f"its annotation's 'answers' must be VQAv2's list of {{answer: ...}} objects, got {given!r}; fix the "
            "annotations file"
        )
    try:
        image = coco_image(item["image_id"], item["_split"])
    except (TypeError, ValueError) as error:
        raise RecordError(f"image_id must be COCO's integer image id, got {item['image_id']!r}") from error
    return {
        "id": str(item["question_id"]),
        "image": image,
        "question": item["question"],
        "answers": [a["answer"] for a in given],
    }


def _textvqa(item: dict) -> dict:
    return {
        "id": str(item["question_id"]),
        "image": f"{item['image_id']}.jpg",
        "question": item["question"],
        "answers": item["answers"],
    }


def _docvqa(item: dict) -> dict:
    if not item.get("answers"):
        raise RecordError("no answers (DocVQA's test split has none; evaluate on val)")
    return {
        "id": str(item["questionId"]),
        "image": item["image"],
        "question": item["question"],
        "answers": item["answers"],
    }


def _chartqa(item: dict) -> dict:
    """ChartQA's release has one answer per query, a string in "label" (HuggingFaceM4/ChartQA: a one-item list)."""
    label = item["label"]
    if isinstance(label, list):
        if len(label) != 1:
            raise RecordError(
                f"label {label!r} holds {len(label)} answers; ChartQA has one per query (a string, or a one-item "
                "list): fix or drop the record"
            )
        label = label[0]
    finite = not isinstance(label, float) or math.isfinite(label)
    if isinstance(label, bool) or not isinstance(label, str | int | float) or not finite or not str(label).strip():
        raise RecordError(
            f"label must be the answer (a non-empty string or a number), got {label!r}; give the reference answer "
            "or drop the record"
        )
    return {
        "id": f"{item['_stem']}:{item['_index']}",
        "image": item["imgname"],
        "question": item["query"],
        "answer": str(label),
    }


def _number(value) -> float | None:
    """A finite number from a number or numeric string, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _xywh(box) -> list[float]:
    if not (isinstance(box, list) and len(box) == 4):
        raise RecordError(f"bbox must be [x, y, width, height], got {box!r}")
    numbers: list[float] = []
    for k, value in enumerate(box):
        number = _number(value)
        if number is None:
            raise RecordError(f"bbox[{k}] is {value!r}, not a number; give bbox as [x, y, width, height] in pixels")
        numbers.append(number)
    x, y, w, h = numbers
    if w <= 0 or h <= 0:
        raise RecordError(f"bbox {box!r} has no area; give bbox as [x, y, width, height] with width, height > 0")
    return [x, y, x + w, y + h]


def _refcoco_items(path: Path, _: Path | None) -> Rows:
    """MDETR's COCO-style final_refcoco*.json, else rows (JSON lines / Parquet, lmms-eval's layout)."""
    data = _json(path) if path.suffix == ".json" else None
    if isinstance(data, dict):
        images, annotations = data.get("images"), data.get("annotations", [])
        if not (isinstance(images, list) and isinstance(annotations, list)):
            raise ValueError(
                f"{path.name}: expected MDETR's COCO-style layout, an object with 'images' and 'annotations' lists, "
                f"got {_shape(data)}; or give rows (a JSON list, JSON lines or Parquet)."
            )
        boxes: dict[object, list] = {}  # image id -> its annotations' boxes
        for i, a in enumerate(annotations):
            if not (isinstance(a, dict) and "image_id" in a and "bbox" in a):
                raise ValueError(
                    f"{path.name} annotations[{i}]: expected an object with 'image_id' and 'bbox', got {_shape(a)}; "
                    "fix or remove that entry."
                )
            boxes.setdefault(a["image_id"], []).append(a["bbox"])
        for i, image in enumerate(images):
            source = f"{path.name} images[{i}]"
            if not isinstance(image, dict):
                yield source, image  # reported by the reader as not a record object
                continue
            found = boxes.get(image.get("id"), [])
            item = {
                **image,
                "bbox": found[0] if found else None,
                "_boxes": len(found),
                "expression": image.get("caption"),
            }
            yield source, {**item, "_stem": path.stem, "_index": i}
        return
    for i, (source, row) in enumerate(iter_file(path)):
        yield source, {**row, "_stem": path.stem, "_index": i} if isinstance(row, dict) else row


def _coco_captions_items(path: Path, _: Path | None) -> Rows:
    """COCO Captions' captions_*.json (NoCaps and Flickr30k in Karpathy's COCO form use it too): an 'images' list
    and an 'annotations' list of {image_id, caption}; one item per image with all its captions."""
    data = _json(path)
    if not (
        isinstance(data, dict) and isinstance(data.get("images"), list) and isinstance(data.get("annotations"), list)
    ):
        raise ValueError(
            f"{path.name}: expected COCO Captions' layout, an object with 'images' and 'annotations' lists, got "
            f"{_shape(data)}."
        )
    captions: dict = {}
    for i, a in enumerate(data["annotations"]):
        if not (isinstance(a, dict) and "image_id" in a and isinstance(a.get("caption"), str)):
            raise ValueError(
                f"{path.name} annotations[{i}]: expected an object with 'image_id' and a 'caption' string, got "
                f"{_shape(a)}; fix or remove that entry."
            )
        captions.setdefault(a["image_id"], []).append(a["caption"])
    ids = {image.get("id") for image in data["images"] if isinstance(image, dict)}
    strays = [image_id for image_id in captions if image_id not in ids]
    if strays:  # their captions would be dropped without a word (an id written "1" for the image 1, say)
        raise ValueError(
            f"{path.name}: {len(strays)} annotation image_id(s) name no image of 'images' (e.g. {strays[0]!r}; the "
            f"images' ids are like {next(iter(ids), None)!r}); fix the ids or drop those annotations."
        )
    for i, image in enumerate(data["images"]):
        item = {**image, "captions": captions.get(image.get("id"), [])} if isinstance(image, dict) else image
        yield f"{path.name} images[{i}]", item


def _coco_captions(item: dict) -> dict:
    if not item["captions"]:
        raise RecordError("no caption (an annotation with the image's id)")
    return {"id": str(item["id"]), "image": item["file_name"], "question": "Describe the image.",
            "answers": item["captions"]}  # fmt: skip


def _refcoco(item: dict) -> dict:
    expression = item.get("expression") or item.get("caption") or item.get("answer") or item.get("question")
    if isinstance(expression, list):
        expression = expression[0] if expression else None
    if not isinstance(expression, str) or not expression.strip():
        raise RecordError("no referring expression (expression / caption / answer)")
    if item.get("bbox") is None:
        raise RecordError("no bbox (an annotation with the image's id)")
    if item.get("_boxes", 1) > 1:
        raise RecordError(
            f"{item['_boxes']} annotations carry this image's id; a referring expression names one box: keep one"
        )
    given = next((item[k] for k in ("question_id", "id") if item.get(k) is not None), None)
    return {
        "id": str(given) if given is not None else f"{item['_stem']}:{item['_index']}",  # rows without ids: FILE:INDEX
        "image": item.get("image") or item["file_name"],
        "question": GROUNDING_PROMPT.format(expression=expression),
        "answer": "",
        "box": _xywh(item["bbox"]),
    }


def _tsv(path: Path, _: Path | None = None) -> Rows:
    _check_file(path)
    csv.field_size_limit(sys.maxsize)  # MMBench's images are base64 cells
    with path.open(encoding="utf-8-sig", newline="") as f:  # a byte-order mark may start the file
        header = f.readline()
        if header.strip() and "\t" not in header:
            comma = " (it looks comma-separated: a spreadsheet saved as CSV?)" if "," in header else ""
            raise ValueError(
                f"{path.name}: its header line has no tab{comma}; MMBench files are tab-separated (.tsv): save it "
                "with tabs between the columns."
            )
        f.seek(0)
        for n, row in enumerate(csv.DictReader(f, delimiter="\t"), 2):
            yield f"{path.name}:{n}", row


_IMAGE_REFERENCE_CHARS = 64  # VLMEvalKit: an image cell of at most 64 characters is another row's index


def _mmbench_items(path: Path, _: Path | None = None) -> Rows:
    """MMBench's rows, each with the file's {index: image cell} (VLMEvalKit's TSVs store a repeated image once; later
    rows hold the index of the row that has it)."""
    rows = list(_tsv(path))
    images = {row["index"].strip(): row["image"] for _, row in rows if _present(row.get("index")) and "image" in row}
    for source, row in rows:
        yield source, {**row, "_images": images}


def _present(value) -> bool:
    return isinstance(value, str) and bool(value.strip()) and value.strip().lower() != "nan"


def _mmbench(row: dict) -> dict:
    """Options in columns A..E, the hint before the question, the image base64 inline (MMBench's own prompt)."""
    question = f"{row['hint']}\n{row['question']}" if _present(row.get("hint")) else row["question"]
    if not _present(row.get("answer")):
        raise RecordError("no answer (MMBench's test split has none; evaluate on dev)")
    if not _present(row.get("image")):
        raise RecordError("no image cell")
    image = row["image"].strip()
    if len(image) <= _IMAGE_REFERENCE_CHARS:  # the index of the row holding this image
        target = row.get("_images", {}).get(image)
        if not _present(target) or len(target.strip()) <= _IMAGE_REFERENCE_CHARS:
            raise RecordError(
                f"image cell {image!r} is neither base64 image data nor the index of a row holding an image in this "
                "file; put the image's base64 (or that row's index) in the image column"
            )
        image = target.strip()
    choices = {c: row[c] for c in "ABCDE" if _present(row.get(c))}
    if row["answer"].strip() not in choices:
        raise RecordError(
            f"answer {row['answer']!r} is not one of its options {list(choices)} (columns A..E); no prediction "
            "could score on it: fix the answer or the option columns"
        )
    return {
        "id": str(row["index"]),
        "image": "data:image/jpeg;base64," + image,
        "question": question,
        "choices": choices,
        "answer": row["answer"].strip(),
    }


def _pope(row: dict) -> dict:
    return {"id": str(row["question_id"]), "image": row["image"], "question": row["text"], "answer": row["label"]}


BENCHMARKS: dict[str, Benchmark] = {
    "vqav2": Benchmark("vqa_accuracy", _vqav2_items, _vqav2),
    "textvqa": Benchmark("vqa_accuracy", _data_list, _textvqa),
    "docvqa": Benchmark("anls", _data_list, _docvqa),
    "chartqa": Benchmark("relaxed_accuracy", _list, _chartqa),
    "refcoco": Benchmark("grounding", _refcoco_items, _refcoco, ("json", "parquet")),
    "mmbench": Benchmark("multiple_choice", _mmbench_items, _mmbench, ("text",)),
    "pope": Benchmark("yes_no", _json_lines, _pope),
    "coco_captions": Benchmark("cider_d", _coco_captions_items, _coco_captions),
}
