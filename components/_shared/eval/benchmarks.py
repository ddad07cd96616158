"""Standard benchmarks from the local copies users have (nothing is downloaded), mapped onto flat question records.

Each loader reads the benchmark's own release layout and yields (source, record) with "question", "answer(s)",
"image" and, where the benchmark has them, "choices" or "box"; its scorer is the benchmark's (eval/tasks.py).
dataset.yaml names the file and the format, e.g. `{path: TextVQA_0.5.1_val.json, format: textvqa, images:
train_images}`; a second file (VQAv2's annotations) is `annotations:`.

| format | files | scorer |
|---|---|---|
| vqav2 | v2_OpenEnded_mscoco_*_questions.json + annotations: v2_mscoco_*_annotations.json | vqa_accuracy |
| textvqa | TextVQA_0.5.1_{val,train}.json ({"data": [...]}) | vqa_accuracy |
| docvqa | {train,val}_v1.0(_withQT).json ({"data": [...]}) | anls |
| chartqa | {test,val}_{human,augmented}.json ([{imgname, query, label}]) | relaxed_accuracy |
| refcoco | MDETR's final_refcoco*.json (COCO style), or rows {bbox x,y,w,h, expression} (JSONL, Parquet) | grounding |
| mmbench | MMBench_*.tsv (index, question, hint, A..D, answer, image base64) | multiple_choice |
| pope | coco_pope_{random,popular,adversarial}.json (JSON lines: question_id, image, text, label) | yes_no |
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from components._shared.eval.formats import RecordError, iter_file

Rows = Iterator[tuple[str, dict]]
GROUNDING_PROMPT = 'Locate "{expression}" in the image and output its bbox coordinates in JSON format.'


@dataclass(frozen=True)
class Benchmark:
    """`items(file, annotations)` yields (source, the release's item); `record(item)` maps one onto a flat record
    (a missing field raises KeyError, reported with the item's source)."""

    scorer: str
    items: Callable[[Path, Path | None], Rows]
    record: Callable[[dict], dict]


def _json(path: Path):
    if not path.is_file():
        raise ValueError(f"{path} does not exist; name the benchmark's file in dataset.yaml.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path.name}:{error.lineno}: not valid JSON ({error.msg}).") from error


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
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                yield f"{path.name}:{n}", json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path.name}:{n}: not valid JSON ({error.msg}).") from error


def coco_image(image_id: int, split: str) -> str:
    """COCO's file name of an image id (COCO_val2014_000000262148.jpg)."""
    return f"COCO_{split}_{int(image_id):012d}.jpg"


def _vqav2_items(path: Path, annotations: Path | None) -> Rows:
    if annotations is None:
        raise ValueError(f"{path.name}: vqav2 needs its annotations file (dataset.yaml: annotations: ...).")
    questions = _json(path)
    split = questions.get("data_subtype", "val2014")
    answers = {a["question_id"]: a for a in _json(annotations)["annotations"]}
    for i, q in enumerate(questions["questions"]):
        yield f"{path.name} questions[{i}]", {**q, "_split": split, "_annotation": answers.get(q.get("question_id"))}


def _vqav2(item: dict) -> dict:
    if item["_annotation"] is None:
        raise RecordError(f"question_id {item['question_id']} has no annotation in the annotations file")
    return {
        "id": str(item["question_id"]),
        "image": coco_image(item["image_id"], item["_split"]),
        "question": item["question"],
        "answers": [a["answer"] for a in item["_annotation"]["answers"]],
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
    return {
        "id": f"{item['_stem']}:{item['_index']}",
        "image": item["imgname"],
        "question": item["query"],
        "answer": str(item["label"]),
    }


def _xywh(box) -> list[float]:
    if not (isinstance(box, list) and len(box) == 4):
        raise RecordError(f"bbox must be [x, y, width, height], got {box!r}")
    x, y, w, h = (float(v) for v in box)
    return [x, y, x + w, y + h]


def _refcoco_items(path: Path, _: Path | None) -> Rows:
    """MDETR's COCO-style final_refcoco*.json, else rows (JSON lines / Parquet, lmms-eval's layout)."""
    data = _json(path) if path.suffix == ".json" else None
    if isinstance(data, dict):
        boxes = {a["image_id"]: a["bbox"] for a in data.get("annotations", [])}
        for i, image in enumerate(data["images"]):
            yield (
                f"{path.name} images[{i}]",
                {**image, "bbox": boxes.get(image.get("id")), "expression": image.get("caption")},
            )
        return
    yield from iter_file(path)


def _refcoco(item: dict) -> dict:
    expression = item.get("expression") or item.get("caption") or item.get("answer") or item.get("question")
    if isinstance(expression, list):
        expression = expression[0] if expression else None
    if not isinstance(expression, str) or not expression.strip():
        raise RecordError("no referring expression (expression / caption / answer)")
    if item.get("bbox") is None:
        raise RecordError("no bbox (an annotation with the image's id)")
    return {
        "id": str(item.get("question_id", item.get("id"))),
        "image": item.get("image") or item["file_name"],
        "question": GROUNDING_PROMPT.format(expression=expression),
        "answer": "",
        "box": _xywh(item["bbox"]),
    }


def _tsv(path: Path, _: Path | None = None) -> Rows:
    csv.field_size_limit(sys.maxsize)  # MMBench's images are base64 cells
    with path.open(encoding="utf-8", newline="") as f:
        for n, row in enumerate(csv.DictReader(f, delimiter="\t"), 2):
            yield f"{path.name}:{n}", row


def _present(value) -> bool:
    return isinstance(value, str) and bool(value.strip()) and value.strip().lower() != "nan"


def _mmbench(row: dict) -> dict:
    """Options in columns A..E, the hint before the question, the image base64 inline (MMBench's own prompt)."""
    question = f"{row['hint']}\n{row['question']}" if _present(row.get("hint")) else row["question"]
    if not _present(row.get("answer")):
        raise RecordError("no answer (MMBench's test split has none; evaluate on dev)")
    if not _present(row.get("image")):
        raise RecordError("no image cell")
    return {
        "id": str(row["index"]),
        "image": "data:image/jpeg;base64," + row["image"],
        "question": question,
        "choices": {c: row[c] for c in "ABCDE" if _present(row.get(c))},
        "answer": row["answer"],
    }


def _pope(row: dict) -> dict:
    return {"id": str(row["question_id"]), "image": row["image"], "question": row["text"], "answer": row["label"]}


BENCHMARKS: dict[str, Benchmark] = {
    "vqav2": Benchmark("vqa_accuracy", _vqav2_items, _vqav2),
    "textvqa": Benchmark("vqa_accuracy", _data_list, _textvqa),
    "docvqa": Benchmark("anls", _data_list, _docvqa),
    "chartqa": Benchmark("relaxed_accuracy", _list, _chartqa),
    "refcoco": Benchmark("grounding", _refcoco_items, _refcoco),
    "mmbench": Benchmark("multiple_choice", _tsv, _mmbench),
    "pope": Benchmark("yes_no", _json_lines, _pope),
}
