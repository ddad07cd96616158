"""Standard benchmark layouts (local copies written here in each release's own form, on real photographs) map onto
question records with the benchmark's scorer; per-benchmark results come out of the summary."""

import base64
import csv
import io
import json

import pytest

from components._shared.data import datasets
from components._shared.data.tasks import score, summarize
from components.synth_world import real_photos as P


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    return P.write_benchmarks(tmp_path_factory.mktemp("benchmarks"))


def test_each_layout_maps_onto_question_records(bench_dir):
    records = {r["benchmark"]: r for r in datasets.load_eval_records(bench_dir)}
    assert set(records) == {"vqav2", "textvqa", "docvqa", "chartqa", "refcoco", "mmbench", "pope", "coco_captions"}
    assert {b: r["scorer"] for b, r in records.items()} == {
        "vqav2": "vqa_accuracy", "textvqa": "vqa_accuracy", "docvqa": "anls", "chartqa": "relaxed_accuracy",
        "refcoco": "grounding", "mmbench": "multiple_choice", "pope": "yes_no", "coco_captions": "cider_d",
    }  # fmt: skip
    captions = [r for r in datasets.load_eval_records(bench_dir) if r["benchmark"] == "coco_captions"]
    assert [(r["id"], len(r["answers"]), r["pil"].size) for r in captions] == [
        ("42", 2, (600, 400)),
        ("73", 2, (640, 427)),
    ]
    assert captions[0]["answers"][0].startswith("A cup of espresso")  # every caption of the image, in file order
    assert records["vqav2"]["answers"] == ["coffee"] * 7 + ["espresso"] * 3
    assert records["vqav2"]["image"] == "val2014/COCO_val2014_000000000042.jpg" and records["vqav2"]["id"] == "420"
    assert records["chartqa"]["answer"] == "40" and records["chartqa"]["pil"].size == (451, 300)
    assert records["refcoco"]["box"] == [290.0, 120.0, 345.0, 410.0]  # x, y, w, h -> x1, y1, x2, y2
    assert '"the white rocket"' in records["refcoco"]["question"]
    mc = records["mmbench"]
    assert mc["choices"] == {"A": "dog", "B": "cat", "C": "bird"}  # "nan" option columns dropped
    assert mc["question"].startswith("A close-up photo.\nWhat animal is it?\nA. dog") and mc["pil"].size == (451, 300)


def test_perfect_answers_score_one_and_each_benchmark_is_summarised(bench_dir):
    records = datasets.load_eval_records(bench_dir)
    perfect = {"vqav2": "coffee", "textvqa": "rocket", "docvqa": "cameraman", "chartqa": "41",
               "mmbench": "(B) cat", "pope": None}  # fmt: skip
    rows = []
    for r in records:
        if r["benchmark"] == "coco_captions":  # CIDEr-D is scored over the set (tasks.py), not per answer
            continue
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
        datasets.load_eval_records(tmp_path)
    (tmp_path / "val_v1.0.json").write_text(json.dumps({"data": [{"question": "q", "answers": ["a"]}]}))
    with pytest.raises(ValueError, match=r"val_v1.0.json data\[0\]: the docvqa item has no field 'questionId'"):
        datasets.load_eval_records(tmp_path)
    (tmp_path / "dataset.yaml").write_text("eval: [{path: q.json, format: vqav2}]\n")
    (tmp_path / "q.json").write_text(json.dumps({"questions": []}))
    with pytest.raises(ValueError, match="vqav2 needs its annotations file"):
        datasets.load_eval_records(tmp_path)


def test_dataset_yaml_offers_every_record_shape_and_benchmark_format():
    import typing

    from components._shared.data.benchmarks import BENCHMARKS
    from components._shared.data.formats import RECORD_FORMATS
    from components._shared.data.tasks import SCORERS

    offered = set(typing.get_args(datasets.DataFile.model_fields["format"].annotation))
    assert offered == set(RECORD_FORMATS) | set(BENCHMARKS)
    assert {b.scorer for b in BENCHMARKS.values()} <= set(SCORERS)


def _write(root, files: dict, entry: str):
    for name, content in files.items():
        (root / name).write_text(content if isinstance(content, str) else json.dumps(content))
    (root / "dataset.yaml").write_text(f"eval:\n  - {entry}\n")


def _jpeg_base64(photo: str) -> str:
    buffer = io.BytesIO()
    P.photo(photo).save(buffer, format="JPEG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_vqav2_files_in_the_wrong_layout_name_the_file_and_the_layout_expected(tmp_path):
    questions = {"data_subtype": "val2014", "questions": [{"question_id": 1, "image_id": 5, "question": "q?"}]}
    annotations = {"annotations": [{"question_id": 1, "answers": [{"answer": "x"}]}]}
    entry = "{path: q.json, format: vqav2, annotations: a.json}"
    _write(tmp_path, {"q.json": questions, "a.json": annotations["annotations"]}, entry)  # annotations as a list
    with pytest.raises(
        ValueError, match=r"^a\.json: expected VQAv2's annotations file .*'annotations' list, got a list"
    ):
        datasets.load_questions(tmp_path)
    _write(tmp_path, {"q.json": questions["questions"], "a.json": annotations}, entry)  # questions as a list
    with pytest.raises(ValueError, match=r"^q\.json: expected VQAv2's questions file .*'questions' list, got a list"):
        datasets.load_questions(tmp_path)
    _write(tmp_path, {"q.json": annotations, "a.json": questions}, entry)  # the two files swapped
    with pytest.raises(ValueError, match=r"^q\.json: .*swap path and annotations"):
        datasets.load_questions(tmp_path)
    _write(tmp_path, {"q.json": questions, "a.json": {"annotations": [["x"]]}}, entry)
    with pytest.raises(ValueError, match=r"^a\.json annotations\[0\]: expected an object with 'question_id'"):
        datasets.load_questions(tmp_path)


def test_a_non_numeric_refcoco_bbox_is_reported_with_every_other_bad_record(tmp_path):
    from components._shared.platform import bad_records

    P._save_photo(tmp_path, "a.jpg", "coffee")
    rows = [
        {"id": "r1", "image": "a.jpg", "expression": "the cup", "bbox": [1, 2, "3a", 4]},
        {"id": "r2", "image": "a.jpg", "expression": "the cup", "bbox": [1, 2, None, 4]},
        {"id": "r3", "image": "a.jpg", "expression": "the cup", "bbox": [1, 2, "3", 4]},  # a numeric string is fine
        {"id": "r4", "image": "a.jpg", "bbox": [1, 2, 3, 4]},
    ]
    _write(tmp_path, {"ref.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}, "{path: ref.jsonl, format: refcoco}")
    with pytest.raises(ValueError) as caught:
        datasets.load_questions(tmp_path)
    message = str(caught.value)
    assert message.startswith("3 bad question record(s) in ref.jsonl")
    assert "ref.jsonl:1 (id='r1'): bbox[2] is '3a', not a number; give bbox as [x, y, width, height]" in message
    assert "ref.jsonl:2 (id='r2'): bbox[2] is None, not a number" in message
    assert "ref.jsonl:4 (id='r4'): no referring expression" in message
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_questions(tmp_path)
    assert [r["id"] for r in kept] == ["r3"] and kept[0]["box"] == [1.0, 2.0, 4.0, 6.0]
    assert ledger.metrics()["data/skipped_records"] == 3


def test_refcoco_rows_without_ids_get_file_index_ids(tmp_path):
    P._save_photo(tmp_path, "a.jpg", "coffee")
    rows = [
        {"image": "a.jpg", "expression": "the cup", "bbox": [1, 2, 3, 4]},
        {"image": "a.jpg", "expression": "the saucer", "bbox": [5, 6, 3, 4]},
        {"question_id": 9, "image": "a.jpg", "expression": "the spoon", "bbox": [0, 0, 3, 4]},
        {"image": "a.jpg", "expression": "the table", "bbox": [0, 0, 30, 40]},
    ]
    _write(tmp_path, {"ref.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}, "{path: ref.jsonl, format: refcoco}")
    records = datasets.load_questions(tmp_path)
    assert [r["id"] for r in records] == ["ref:0", "ref:1", "9", "ref:3"]
    assert [r["box"] for r in records][1] == [5.0, 6.0, 8.0, 10.0]


def test_chartqa_labels_are_one_answer_and_bad_ones_are_rejected_per_record(tmp_path):
    P._save_photo(tmp_path, "c.png", "chelsea")
    labels = ["12", ["12"], 3.5, None, [], ["1", "2"], "  "]
    items = [{"imgname": "c.png", "query": "Value?", "label": label} for label in labels]
    _write(tmp_path, {"test_human.json": items}, "{path: test_human.json, format: chartqa}")
    with pytest.raises(ValueError) as caught:
        datasets.load_questions(tmp_path)
    message = str(caught.value)
    assert message.startswith("4 bad question record(s) in test_human.json")
    assert "test_human.json[3]: label must be the answer (a non-empty string or a number), got None" in message
    assert "test_human.json[4]: label [] holds 0 answers; ChartQA has one per query" in message
    assert "test_human.json[5]: label ['1', '2'] holds 2 answers" in message
    assert "test_human.json[6]: label must be the answer" in message
    from components._shared.platform import bad_records

    with bad_records.policy("skip") as ledger:
        records = datasets.load_questions(tmp_path)
    assert {r["id"]: r["answer"] for r in records} == {
        "test_human:0": "12",
        "test_human:1": "12",
        "test_human:2": "3.5",
    }
    assert ledger.metrics()["data/skipped_records"] == 4


def test_mmbench_image_cells_holding_another_rows_index_are_resolved(tmp_path):
    from components._shared.platform import bad_records

    cat, dog = _jpeg_base64("chelsea"), _jpeg_base64("coffee")
    header = ["index", "question", "hint", "A", "B", "C", "D", "answer", "image"]
    rows = [
        [1000000, "What?", "nan", "dog", "cat", "nan", "nan", "A", "0"],  # points at a later row
        [0, "What?", "nan", "cat", "dog", "nan", "nan", "B", cat],
        [2, "Which?", "nan", "cat", "dog", "nan", "nan", "A", dog],
        [3, "Which?", "nan", "dog", "cat", "nan", "nan", "B", "2"],
        [4, "Which?", "nan", "dog", "cat", "nan", "nan", "B", "99"],  # no row 99
        [5, "Which?", "nan", "dog", "cat", "nan", "nan", "D", dog],  # no option D: nothing could score
    ]
    with (tmp_path / "MMBench_DEV_EN.tsv").open("w", newline="") as f:
        csv.writer(f, delimiter="\t").writerows([header, *rows])
    (tmp_path / "dataset.yaml").write_text("eval: [{path: MMBench_DEV_EN.tsv, format: mmbench}]\n")
    with pytest.raises(ValueError) as caught:
        datasets.load_questions(tmp_path)
    message = str(caught.value)
    assert message.startswith("2 bad question record(s) in MMBench_DEV_EN.tsv")
    assert "MMBench_DEV_EN.tsv:7 (id='5'): answer 'D' is not one of its options ['A', 'B']" in message
    assert (
        "MMBench_DEV_EN.tsv:6 (id='4'): image cell '99' is neither base64 image data nor the index of a row holding "
        "an image in this file; put the image's base64 (or that row's index) in the image column"
    ) in message
    with bad_records.policy("skip") as ledger:
        records = {r["id"]: r for r in datasets.load_questions(tmp_path)}
    assert ledger.metrics()["data/skipped_records"] == 2 and ledger.metrics()["data/skipped/image"] == 1
    assert list(records) == ["1000000", "0", "2", "3"]
    assert records["1000000"]["image"] == records["0"]["image"] == base64.b64decode(cat)
    assert records["3"]["image"] == records["2"]["image"] == base64.b64decode(dog)
    assert records["1000000"]["answer"] == "A" and records["1000000"]["choices"] == {"A": "dog", "B": "cat"}


def test_ids_repeat_across_benchmarks_and_are_unique_within_one(tmp_path):
    """POPE's question_id 1 and an MMBench index 1 are two records; the same id twice in one benchmark is refused."""
    root = P.write_benchmarks(tmp_path)
    tsv = root / "MMBench_DEV_EN.tsv"
    tsv.write_text(tsv.read_text().replace("\n5\t", "\n1\t"))
    records = datasets.load_eval_records(root)
    ones = {r["benchmark"]: r["question"] for r in records if r["id"] == "1"}
    assert set(ones) == {"mmbench", "pope"} and ones["pope"] == "Is there a flag in the image?"
    captions = [  # a task shared by two benchmarks: CIDEr-D takes one candidate per benchmark and id
        {"id": "1", "benchmark": b, "type": "caption", "prediction": p, "answer": "a red circle"}
        for b, p in (("a", "a red circle"), ("b", "a blue square"))
    ]
    assert 0 <= summarize(captions)["cider_d"] < 10
    (root / "pope_again.json").write_text((root / "coco_pope_random.json").read_text())
    manifest = (root / "dataset.yaml").read_text()
    (root / "dataset.yaml").write_text(
        manifest + "  - {path: pope_again.json, format: pope, images: val2014, benchmark: pope}\n"
    )
    twice = "record id '1' is in both coco_pope_random.json and pope_again.json, both of benchmark 'pope'"
    with pytest.raises(ValueError, match=f"{twice}; ids must be unique within a benchmark"):
        datasets.load_eval_records(root)


def test_an_id_that_is_not_a_string_or_an_integer_is_refused_naming_the_record(tmp_path):
    """A POPE question_id that is a list, or an id that is an object, a float, a boolean or blank, would have been
    kept as its Python repr; each is one bad record naming its line and the field."""
    root = P.write_benchmarks(tmp_path)
    pope = root / "coco_pope_random.json"
    lines = pope.read_text().splitlines()
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "question_id": [1, 2]})
    pope.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as caught:
        datasets.load_eval_records(root)
    assert "coco_pope_random.json:1" in str(caught.value)
    assert "'question_id' must be a string or an integer, got list [1, 2]" in str(caught.value)
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.png").write_bytes((root / "val2014" / first["image"]).read_bytes())
    rows = [
        {"id": value, "image": "a.png", "type": "count", "question": "How many?", "answer": "2"}
        for value in ({"n": 1}, 1.5, True, "  ", "ok-1", 7)
    ]
    (flat / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as caught:
        datasets.load_eval_records(flat)
    message = str(caught.value)
    assert message.startswith("4 bad question record(s) in eval.jsonl")
    for line, kind in ((1, "dict {'n': 1}"), (2, "float 1.5"), (3, "bool True")):
        assert f"eval.jsonl:{line}" in message and f"'id' must be a string or an integer, got {kind}" in message
    assert "'id' is empty" in message


def test_a_file_that_is_not_utf8_or_a_damaged_parquet_is_one_error_naming_it(tmp_path):
    """They were UnicodeDecodeError / pyarrow's errors naming no file (and a traceback for a cut Parquet file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    questions = {"questions": [{"question_id": 1, "image_id": 7, "question": "What is it?"}]}
    text = json.dumps(questions, indent=1).replace("What is it?", "What is \\u00e9t?").encode()
    (tmp_path / "q.json").write_bytes(text.replace(b"What", b"\xe9 What", 1))
    (tmp_path / "dataset.yaml").write_text("eval: [{path: q.json, format: vqav2, annotations: a.json}]\n")
    with pytest.raises(ValueError, match=r"^q.json:6: not UTF-8 text \(byte b'\\xe9'\); re-encode the file as UTF-8"):
        datasets.load_eval_records(tmp_path)
    (tmp_path / "MMBench_DEV_EN.tsv").write_bytes(b"index\tquestion\n1\tcaf\xe9?\n")
    (tmp_path / "dataset.yaml").write_text("eval: [{path: MMBench_DEV_EN.tsv, format: mmbench}]\n")
    with pytest.raises(ValueError, match=r"^MMBench_DEV_EN.tsv:2: not UTF-8 text"):
        datasets.load_eval_records(tmp_path)
    (tmp_path / "prefs").mkdir()
    rows = [{"prompt": "<image>Which?", "chosen": "a cat", "rejected": "a dog", "image": "x.png"}] * 50
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prefs/pairs.parquet")
    whole = (tmp_path / "prefs/pairs.parquet").read_bytes()
    (tmp_path / "dataset.yaml").write_text("preferences: [prefs/pairs.parquet]\n")
    for damaged in (whole[: len(whole) // 2], whole[:8] + b"\0" * 64 + whole[72:]):
        (tmp_path / "prefs/pairs.parquet").write_bytes(damaged)
        with pytest.raises(ValueError, match=r"^prefs/pairs.parquet: unreadable \(.*\); the file is damaged"):
            datasets.load_preferences(tmp_path)


def test_a_refcoco_image_with_two_annotations_is_a_bad_record_not_the_last_box(tmp_path):
    """MDETR's layout pairs each image entry (one expression) with one annotation; a second annotation with the same
    image id replaced the first quietly."""
    P._save_photo(tmp_path, "a.jpg", "coffee")
    data = {
        "images": [
            {"id": 1, "file_name": "a.jpg", "caption": "the cup"},
            {"id": 2, "file_name": "a.jpg", "caption": "the saucer"},
        ],
        "annotations": [
            {"image_id": 1, "bbox": [1, 2, 3, 4]},
            {"image_id": 2, "bbox": [5, 6, 7, 8]},
            {"image_id": 2, "bbox": [9, 9, 3, 3]},
        ],
    }
    _write(
        tmp_path, {"final_refcoco_testA.json": json.dumps(data)}, "{path: final_refcoco_testA.json, format: refcoco}"
    )
    with pytest.raises(ValueError) as caught:
        datasets.load_questions(tmp_path)
    assert "final_refcoco_testA.json images[1] (id='2'): 2 annotations carry this image's id" in str(caught.value)


def test_release_files_that_say_two_things_are_refused_and_a_byte_order_mark_is_read(tmp_path):
    """Kept quietly before: a key given twice in a release file's item (the last won), a second VQAv2 annotation for
    a question (its answers replaced the first's), COCO caption annotations whose image_id names no image (dropped);
    a byte-order mark made MMBench's first column unknown and POPE's first line invalid JSON."""
    P._save_photo(tmp_path, "a.jpg", "coffee")
    item = '{"questionId": 1, "question": "Q?", "question": "Other?", "answers": ["x"], "image": "a.jpg"}'
    _write(tmp_path, {"val.json": '{"data": [' + item + "]}"}, "{path: val.json, format: docvqa}")
    with pytest.raises(ValueError, match=r"^val.json: the key 'question' is given twice in one object; keep one"):
        datasets.load_questions(tmp_path)
    questions = {"data_subtype": "val2014", "questions": [{"question_id": 1, "image_id": 1, "question": "Q?"}]}
    answer = {"question_id": 1, "answers": [{"answer": "yes"}]}
    annotations = {"annotations": [answer, {**answer, "answers": [{"answer": "no"}]}]}
    _write(tmp_path, {"q.json": questions, "a.json": annotations}, "{path: q.json, annotations: a.json, format: vqav2}")
    with pytest.raises(ValueError, match=r"a.json annotations\[1\]: question_id 1 has an annotation already"):
        datasets.load_questions(tmp_path)
    captions = {
        "images": [{"id": 1, "file_name": "a.jpg"}],
        "annotations": [{"image_id": 1, "caption": "a cup"}, {"image_id": "1", "caption": "a mug"}],
    }
    _write(tmp_path, {"c.json": captions}, "{path: c.json, format: coco_captions}")
    with pytest.raises(ValueError, match=r"c.json: 1 annotation image_id\(s\) name no image of 'images' \(e.g. '1'"):
        datasets.load_questions(tmp_path)
    pope = '\ufeff{"question_id": 1, "image": "a.jpg", "text": "Is there a cup?", "label": "yes"}\n'
    _write(tmp_path, {"pope.json": pope}, "{path: pope.json, format: pope}")
    assert [r["answer"] for r in datasets.load_questions(tmp_path)] == ["yes"]
    _write(tmp_path, {"pope.json": "[\n" + pope.strip("\ufeff\n") + "\n]\n"}, "{path: pope.json, format: pope}")
    with pytest.raises(ValueError, match=r"pope.json:1: not valid JSON .*this benchmark's file is JSON Lines"):
        datasets.load_questions(tmp_path)


def test_a_benchmark_format_on_a_file_of_another_kind_names_both(tmp_path):
    """They were "not UTF-8" (Parquet read as a release JSON) and "a field is missing" (JSON Lines read as a TSV)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q?", "answer": "a"}]), tmp_path / "val.parquet")
    _write(tmp_path, {}, "{path: val.parquet, format: docvqa}")
    with pytest.raises(ValueError, match=r"^val.parquet: `format: docvqa` reads JSON .*, but this file is Parquet"):
        datasets.load_eval_records(tmp_path)
    _write(tmp_path, {"mm.jsonl": '{"index": 1, "question": "q?"}\n'}, "{path: mm.jsonl, format: mmbench}")
    with pytest.raises(
        ValueError, match=r"^mm.jsonl: `format: mmbench` reads text such as a TSV, but this file is JSON"
    ):
        datasets.load_eval_records(tmp_path)
    (tmp_path / "pope.json").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    _write(tmp_path, {}, "{path: pope.json, format: pope}")
    with pytest.raises(ValueError, match=r"^pope.json: `format: pope` reads JSON .*, but this file is binary"):
        datasets.load_eval_records(tmp_path)
    _write(tmp_path, {"tv.json": "  \n"}, "{path: tv.json, format: textvqa}")  # empty: the reader's own message
    with pytest.raises(ValueError, match=r"^tv.json:\d+: not valid JSON"):
        datasets.load_eval_records(tmp_path)
