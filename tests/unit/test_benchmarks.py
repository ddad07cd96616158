"""Standard benchmark layouts (local copies written here in each release's own form, on real photographs) map onto
question records with the benchmark's scorer; per-benchmark results come out of the summary."""

import base64
import csv
import io
import json

import pytest

from components._shared.eval import readers
from components._shared.eval.tasks import score, summarize
from tests import real_photos as P


def _save(root, name, photo):
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    P.photo(photo).save(root / name)
    return name


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchmarks")
    # VQAv2: questions + annotations, COCO file names under val2014/
    _save(root, "val2014/COCO_val2014_000000000042.jpg", "coffee")
    (root / "v2_questions.json").write_text(json.dumps({
        "data_subtype": "val2014",
        "questions": [{"image_id": 42, "question": "What is in the cup?", "question_id": 420}],
    }))  # fmt: skip
    (root / "v2_annotations.json").write_text(json.dumps({"annotations": [{
        "question_id": 420, "image_id": 42,
        "answers": [{"answer": a, "answer_id": i} for i, a in enumerate(["coffee"] * 7 + ["espresso"] * 3)],
    }]}))  # fmt: skip
    # TextVQA: {"data": [...]}, images <image_id>.jpg
    _save(root, "train_images/ab12.jpg", "rocket")
    (root / "TextVQA_0.5.1_val.json").write_text(json.dumps({"dataset_name": "textvqa", "data": [
        {"question_id": 7, "image_id": "ab12", "question": "What is on the pad?", "answers": ["rocket"] * 10},
    ]}))  # fmt: skip
    # DocVQA: {"data": [...]} with image paths
    _save(root, "documents/doc1.png", "camera")
    (root / "val_v1.0.json").write_text(json.dumps({"data": [
        {"questionId": 11, "question": "What is the title?", "image": "documents/doc1.png", "docId": 1,
         "answers": ["Cameraman", "the cameraman"]},
    ]}))  # fmt: skip
    # ChartQA: a list of {imgname, query, label}, images in png/
    _save(root, "png/chart1.png", "chelsea")
    (root / "test_human.json").write_text(json.dumps([{"imgname": "chart1.png", "query": "Value?", "label": 40}]))
    # RefCOCO, MDETR's COCO-style final_refcoco_testA.json
    _save(root, "coco/COCO_train2014_000000000007.jpg", "rocket")
    (root / "final_refcoco_testA.json").write_text(json.dumps({
        "images": [{"id": 3, "file_name": "COCO_train2014_000000000007.jpg", "caption": "the white rocket",
                    "height": 427, "width": 640}],
        "annotations": [{"id": 1, "image_id": 3, "bbox": [290, 120, 55, 290]}],
    }))  # fmt: skip
    # MMBench TSV: options in columns, the image base64 inline
    buffer = io.BytesIO()
    P.photo("chelsea").save(buffer, format="JPEG")
    with (root / "MMBench_DEV_EN.tsv").open("w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["index", "question", "hint", "A", "B", "C", "D", "answer", "category", "image"])
        writer.writerow([5, "What animal is it?", "A close-up photo.", "dog", "cat", "bird", "nan", "B", "animals",
                         base64.b64encode(buffer.getvalue()).decode()])  # fmt: skip
    # POPE: JSON lines in a .json file
    _save(root, "val2014/COCO_val2014_000000000310.jpg", "astronaut")
    pope = [(1, "Is there a flag in the image?", "yes"), (2, "Is there a dog in the image?", "no")]
    (root / "coco_pope_random.json").write_text("".join(
        json.dumps({"question_id": i, "image": "COCO_val2014_000000000310.jpg", "text": text, "label": label}) + "\n"
        for i, text, label in pope
    ))  # fmt: skip
    (root / "dataset.yaml").write_text("""\
eval:
  - {path: v2_questions.json, format: vqav2, annotations: v2_annotations.json, images: val2014}
  - {path: TextVQA_0.5.1_val.json, format: textvqa, images: train_images}
  - {path: val_v1.0.json, format: docvqa}
  - {path: test_human.json, format: chartqa, images: png}
  - {path: final_refcoco_testA.json, format: refcoco, images: coco}
  - {path: MMBench_DEV_EN.tsv, format: mmbench}
  - {path: coco_pope_random.json, format: pope, images: val2014}
""")
    return root


def test_each_layout_maps_onto_question_records(bench_dir):
    records = {r["benchmark"]: r for r in readers.load_eval_records(bench_dir)}
    assert set(records) == {"vqav2", "textvqa", "docvqa", "chartqa", "refcoco", "mmbench", "pope"}
    assert {b: r["scorer"] for b, r in records.items()} == {
        "vqav2": "vqa_accuracy", "textvqa": "vqa_accuracy", "docvqa": "anls", "chartqa": "relaxed_accuracy",
        "refcoco": "grounding", "mmbench": "multiple_choice", "pope": "yes_no",
    }  # fmt: skip
    assert records["vqav2"]["answers"] == ["coffee"] * 7 + ["espresso"] * 3
    assert records["vqav2"]["image"] == "val2014/COCO_val2014_000000000042.jpg" and records["vqav2"]["id"] == "420"
    assert records["chartqa"]["answer"] == "40" and records["chartqa"]["pil"].size == (451, 300)
    assert records["refcoco"]["box"] == [290.0, 120.0, 345.0, 410.0]  # x, y, w, h -> x1, y1, x2, y2
    assert '"the white rocket"' in records["refcoco"]["question"]
    mc = records["mmbench"]
    assert mc["choices"] == {"A": "dog", "B": "cat", "C": "bird"}  # "nan" option columns dropped
    assert mc["question"].startswith("A close-up photo.\nWhat animal is it?\nA. dog") and mc["pil"].size == (451, 300)


def test_perfect_answers_score_one_and_each_benchmark_is_summarised(bench_dir):
    records = readers.load_eval_records(bench_dir)
    perfect = {"vqav2": "coffee", "textvqa": "rocket", "docvqa": "cameraman", "chartqa": "41",
               "mmbench": "(B) cat", "pope": None}  # fmt: skip
    rows = []
    for r in records:
        if r["benchmark"] == "refcoco":  # a Qwen2.5-VL answer in the pixels of the resized image
            frame = {"box_convention": "absolute", "image_size": (640, 427), "model_size": (320, 213.5)}
            prediction, r = '[{"bbox_2d": [145, 60, 172.5, 205]}]', {**r, **frame}
        else:
            prediction = perfect[r["benchmark"]] or ("Yes." if r["answer"] == "yes" else "No, there is not.")
        assert score(prediction, r) == 1.0, r["benchmark"]
        rows.append({**r, "prediction": prediction, "score": score(prediction, r)})
    out = summarize(rows)
    for b in ("vqav2", "textvqa", "docvqa", "chartqa", "refcoco", "mmbench", "pope"):
        assert out[f"benchmark/{b}"] == 1.0, b
    assert out["benchmark/pope/count"] == 2 and out["benchmark/pope/f1"] == 1.0


def test_a_broken_release_file_names_the_item(bench_dir, tmp_path):
    (tmp_path / "val_v1.0.json").write_text(
        json.dumps({"data": [{"questionId": 1, "question": "q", "image": "x.png"}]})
    )
    (tmp_path / "dataset.yaml").write_text("eval: [{path: val_v1.0.json, format: docvqa}]\n")
    with pytest.raises(ValueError, match=r"val_v1.0.json data\[0\] \(id='1'\): no answers \(DocVQA's test split"):
        readers.load_eval_records(tmp_path)
    (tmp_path / "val_v1.0.json").write_text(json.dumps({"data": [{"question": "q", "answers": ["a"]}]}))
    with pytest.raises(ValueError, match=r"val_v1.0.json data\[0\]: the docvqa item has no field 'questionId'"):
        readers.load_eval_records(tmp_path)
    (tmp_path / "dataset.yaml").write_text("eval: [{path: q.json, format: vqav2}]\n")
    (tmp_path / "q.json").write_text(json.dumps({"questions": []}))
    with pytest.raises(ValueError, match="vqav2 needs its annotations file"):
        readers.load_eval_records(tmp_path)


def test_dataset_yaml_offers_every_record_shape_and_benchmark_format():
    import typing

    from components._shared.eval.benchmarks import BENCHMARKS
    from components._shared.eval.formats import RECORD_FORMATS
    from components._shared.eval.tasks import SCORERS

    offered = set(typing.get_args(readers.DataFile.model_fields["format"].annotation))
    assert offered == set(RECORD_FORMATS) | set(BENCHMARKS)
    assert {b.scorer for b in BENCHMARKS.values()} <= set(SCORERS)
