"""The data formats people have, on real photographs: each format read into the stages' records, awkward image
encodings decoded, bad records reported by file and line (all of them at once)."""

import json
import re
import shutil

import numpy as np
import pytest

from components._shared.data import datasets
from components.synth_world import real_photos as P


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    paths = P.write_all(root)
    return root, paths


def _manifest(root, text):
    (root / "dataset.yaml").write_text(text)


def test_awkward_encodings_decode_to_the_upright_rgb_photo(photos):
    root, paths = photos
    for name, path in paths.items():
        image = datasets.load_image(root, path)
        assert image.mode == "RGB" and image.size == P.PHOTOS[name][0], name
        reference = np.asarray(P.photo(name), dtype=np.float32)
        difference = np.abs(np.asarray(image, dtype=np.float32) - reference).mean()
        assert difference < 12, (name, difference)  # lossy JPEG / WebP / 64-colour palette, but the same picture
    rotated_wrongly = np.asarray(P.photo("astronaut").transpose(0), dtype=np.float32)  # what ignoring EXIF gives
    upright = np.asarray(datasets.load_image(root, paths["astronaut"]), dtype=np.float32)
    assert np.abs(upright - rotated_wrongly).mean() > 30
    gray = datasets.load_image(root, "images/camera_gray.jpg")
    assert gray.mode == "RGB" and np.ptp(np.asarray(gray), axis=2).max() <= 1  # grayscale copied to 3 channels


def test_llava_array_pretty_printed_and_jsonl_read_the_same(photos, tmp_path):
    root, paths = photos
    by_format = {}
    for name in ("llava.json", "llava.jsonl"):
        records = datasets.load_conversations(root, file_name=name)
        by_format[name] = [{k: r[k] for k in ("id", "images", "turns", "type")} for r in records]
    assert by_format["llava.json"] == by_format["llava.jsonl"]
    records = datasets.load_conversations(root, file_name="llava.json")
    assert len(records) == 6 and records[0]["type"] == "photo_caption"
    assert records[0]["source"] == "llava.json:2 [0]"  # the line the record starts on, its index in the array
    pair = records[-1]
    assert pair["images"] == [paths["chelsea"], paths["rocket"]] and pair["turns"][0]["text"].count("<image>") == 2
    shutil.copytree(root / "images", tmp_path / "images")
    one_line = tmp_path / "one_line.json"  # LLaVA's release files are one line: no AttributeError, no "not JSON"
    one_line.write_text(json.dumps(P.llava_records(paths)))
    assert len(datasets.load_conversations(tmp_path, file_name="one_line.json")) == 6


def test_either_json_shape_is_read_whatever_the_suffix(photos, tmp_path):
    """A JSON array saved as .jsonl gave one "not valid JSON" error per line; JSON Lines saved as .json were refused."""
    root, _ = photos
    shutil.copytree(root / "images", tmp_path / "images")
    expected = [
        {k: r[k] for k in ("id", "images", "turns")} for r in datasets.load_conversations(root, file_name="llava.json")
    ]
    shutil.copy(root / "llava.json", tmp_path / "array.jsonl")  # pretty-printed, one record over many lines
    shutil.copy(root / "llava.jsonl", tmp_path / "lines.json")
    records = {name: datasets.load_conversations(tmp_path, file_name=name) for name in ("array.jsonl", "lines.json")}
    for name, read in records.items():
        assert [{k: r[k] for k in ("id", "images", "turns")} for r in read] == expected, name
    assert records["array.jsonl"][0]["source"] == "array.jsonl:2 [0]" and records["lines.json"][1]["source"] == (
        "lines.json:2"
    )
    text = (root / "llava.json").read_text()
    (tmp_path / "cut.jsonl").write_text(text[: text.rindex("]")])
    (tmp_path / "more.json").write_text(text + (root / "llava.jsonl").read_text())
    for name, reason in (("cut.jsonl", "has no closing ']'"), ("more.json", "more follows the JSON array")):
        with pytest.raises(ValueError, match=re.escape(reason)) as caught:
            datasets.load_conversations(tmp_path, file_name=name)
        assert "\n" not in str(caught.value)  # one line says what the file holds and what to do


def test_sharegpt_system_turns_are_kept_first(photos):
    root, _ = photos
    records = datasets.load_conversations(root, file_name="sharegpt.jsonl")
    assert [r["turns"][0]["role"] for r in records] == ["system"] * 5
    assert records[1]["turns"][0]["text"] == "You describe photos in one sentence."  # the top-level field
    assert [t["role"] for t in records[0]["turns"]] == ["system", "user", "assistant"]


def test_messages_with_content_parts_and_carried_images(photos):
    root, paths = photos
    records = datasets.load_conversations(root, file_name="messages.jsonl")
    assert records[0]["turns"][0] == {"role": "user", "text": "<image>\nIs there a flag in the image?"}
    assert records[0]["id"] == "messages:0"  # no id in the file: the file and index name it
    last = records[-1]
    assert last["images"] == [paths["coffee"], paths["camera"]]
    assert [t["role"] for t in last["turns"]] == ["system", "user", "assistant"]
    assert last["turns"][1]["text"] == "<image>\n<image>\nWhich one is black and white?"


def test_parquet_images_are_read_lazily_across_row_groups(photos):
    root, _ = photos
    records = datasets.load_conversations(root, file_name="photos.parquet")
    assert [r["source"] for r in records[:3]] == [
        "photos.parquet row 0",
        "photos.parquet row 1",
        "photos.parquet row 2",
    ]
    for record, name in zip(records, P.NAMES, strict=True):
        (ref,) = record["images"]
        assert isinstance(ref, datasets.F.ParquetImage)
        image = datasets.load_image(root, ref)
        assert np.array_equal(np.asarray(image), np.asarray(P.photo(name)))  # lossless PNG bytes, row by row


def test_a_pair_differing_in_whitespace_and_an_empty_answer_are_refused(tmp_path):
    P.photo("coffee").save(tmp_path / "c.png")
    pair = {"id": "p", "image": "c.png", "prompt": "Describe it.", "chosen": "A cup.", "rejected": "A  cup. "}
    (tmp_path / "preferences.jsonl").write_text(json.dumps(pair) + "\n")
    with pytest.raises(ValueError, match=r"preferences.jsonl:1 \(id='p'\): chosen and rejected are the same text"):
        datasets.load_preferences(tmp_path)
    question = {"id": "q", "image": "c.png", "question": "What is it?", "answer": " ", "task": "exact_match"}
    (tmp_path / "eval.jsonl").write_text(json.dumps(question) + "\n")
    with pytest.raises(ValueError, match=r"eval.jsonl:1 \(id='q'\): the answer is empty"):
        datasets.load_eval_records(tmp_path)


@pytest.mark.parametrize(
    "rejected",
    [
        "a CUP.",  # case
        "\uff21 cup\uff0e",  # full-width letters (NFKC)
        "A\u00a0cup.",  # a no-break space
        "A c\u200bup.",  # zero-width space
        "A cu\u200cp\u200d.",  # zero-width non-joiner, joiner
        "\ufeffA cup.",  # a byte-order mark
        "\u00adA cup.\n\t",  # a soft hyphen, surrounding whitespace
    ],
)
def test_a_pair_differing_in_nothing_a_reader_sees_is_refused(tmp_path, rejected):
    P.photo("coffee").save(tmp_path / "c.png")
    pairs = [
        {"id": "same", "image": "c.png", "prompt": "Describe it.", "chosen": "A cup.", "rejected": rejected},
        {"id": "blank", "image": "c.png", "prompt": "Describe it.", "chosen": "A cup.", "rejected": "\u200b\u2060"},
        {"id": "differs", "image": "c.png", "prompt": "Describe it.", "chosen": "A cup.", "rejected": "A cap."},
    ]
    (tmp_path / "preferences.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with pytest.raises(ValueError) as caught:
        datasets.load_preferences(tmp_path)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("2 bad preference record(s) in preferences.jsonl")
    assert "preferences.jsonl:1 (id='same'): chosen and rejected are the same text to a reader" in lines[1]
    assert "preferences.jsonl:2 (id='blank'): 'rejected' is empty" in lines[2]


def test_preferences_in_trl_layout_with_a_data_uri(photos):
    root, paths = photos
    pairs = datasets.load_preferences(root)
    assert len(pairs) == 21 and pairs[0]["image"] == paths["astronaut"] and pairs[0]["prompt"] == "Describe it."
    assert pairs[0]["chosen"].startswith("An astronaut") and pairs[0]["rejected"].startswith("A cup")
    inline = pairs[-1]
    assert isinstance(inline["image"], bytes) and datasets.load_image(root, inline["image"]).size == (451, 300)


def test_eval_questions_carry_task_benchmark_choices_and_boxes(photos):
    root, _ = photos
    _manifest(root, "eval: [photo_eval.jsonl]\n")
    try:
        records = datasets.load_eval_records(root)
    finally:
        (root / "dataset.yaml").unlink()
    by_id = {r["id"]: r for r in records}
    assert len(records) == 25 and {r["benchmark"] for r in records} == {
        "photo_vqa", "photo_pope", "photo_refs", "photo_captions", "photo_mc"
    }  # fmt: skip
    assert by_id["vqa-coffee"]["answers"] == ["coffee"] * 6 + ["espresso"] * 4
    assert by_id["vqa-coffee"]["scorer"] == "vqa_accuracy"
    mc = by_id["mc-chelsea"]
    assert mc["choices"] == {"A": "blue", "B": "brown", "C": "green", "D": "red"}
    assert mc["question"].endswith("C. green\nD. red\nAnswer with the option's letter from the given choices directly.")
    assert by_id["ref-rocket"]["box"] == [290.0, 120.0, 345.0, 410.0] and by_id["ref-rocket"]["pil"].size == (640, 427)


def test_dataset_yaml_names_files_tasks_and_image_folders(photos, tmp_path):
    root, paths = photos
    shutil.copytree(root / "images", tmp_path / "pics")
    rows = [{"id": f"w{k}", "image": f"{name}.{ext}", "question": "How many widgets?", "answer": "3"}
            for k, (name, ext) in enumerate([("astronaut", "jpg"), ("chelsea", "webp")])]  # fmt: skip
    (tmp_path / "widgets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _manifest(
        tmp_path,
        "tasks: {widget_count: exact_match}\neval:\n  - {path: widgets.jsonl, task: widget_count, images: pics}\n",
    )
    records = datasets.load_eval_records(tmp_path)
    assert [r["image"] for r in records] == ["pics/astronaut.jpg", "pics/chelsea.webp"]
    assert {r["type"] for r in records} == {"widget_count"} and records[0]["benchmark"] == "widgets"
    _manifest(tmp_path, "eval:\n  - {path: widgets.jsonl, task: widget_count}\n")
    with pytest.raises(ValueError, match=r"dataset.yaml eval entry 'widgets.jsonl': unknown task 'widget_count'"):
        datasets.load_eval_records(tmp_path)  # the entry's task is checked once, before any record is read
    _manifest(tmp_path, "eval: [{path: widgets.jsonl, fromat: llava}]\n")
    with pytest.raises(ValueError, match="dataset.yaml.*fromat"):
        datasets.load_eval_records(tmp_path)
    _manifest(tmp_path, "tasks: {color: anls}\n")
    with pytest.raises(ValueError, match="'color' is a builtin task"):
        datasets.manifest(tmp_path)


@pytest.mark.parametrize(
    "entry, field",
    [
        ("../outside/eval.jsonl", "path"),
        ("{OUTSIDE}/eval.jsonl", "path"),
        ("{path: eval.jsonl, images: ../outside}", "images"),
        ("{path: eval.jsonl, images: {OUTSIDE}}", "images"),
        ("{path: v2_questions.json, format: vqav2, annotations: ../outside/eval.jsonl}", "annotations"),
    ],
)
def test_dataset_yaml_paths_outside_the_data_directory_are_refused(tmp_path, entry, field):
    """`../x.jsonl`, an absolute path, or an images / annotations folder out of the directory: never read."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    for folder in (data, outside):
        folder.mkdir()
        P.photo("coffee").save(folder / "c.png")
        question = {"id": "q", "image": "c.png", "question": "What drink?", "answer": "coffee", "task": "exact_match"}
        (folder / "eval.jsonl").write_text(json.dumps(question) + "\n")
    entry = entry.replace("{OUTSIDE}", str(outside))
    _manifest(data, f"eval:\n  - {entry}\n")
    with pytest.raises(ValueError, match=rf"data file entry .*: {field} .* resolves outside the data directory"):
        datasets.load_eval_records(data)
    _manifest(data, "eval:\n  - {path: eval.jsonl, images: .}\n")  # inside it: read as before
    assert [r["id"] for r in datasets.load_eval_records(data)] == ["q"]


HUMAN, GPT = {"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "yo"}
BAD_RECORDS = [  # (record, the reason its line must be reported with; None: a good record)
    ({"id": "ok", "image": "a.png", "conversations": [HUMAN, GPT]}, None),
    ({"id": "no-answer", "image": "a.png", "conversations": [HUMAN]}, "no gpt/assistant turn"),
    ({"id": "markers", "images": ["a.png", "b.png"], "conversations": [HUMAN, GPT]}, "2 image.s. but 1 <image> marker"),
    (
        {"id": "late-system", "image": "a.png", "conversations": [HUMAN, {"from": "system", "value": "x"}, GPT]},
        "system turn is only allowed first",
    ),
    (
        {
            "id": "video",
            "messages": [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "x"}],
        },
        "video is not supported",
    ),
    ({"id": "web", "image": "https://example.com/a.png", "conversations": [HUMAN, GPT]}, "web URL"),
    ({"id": "tool", "conversations": [{"from": "tool", "value": "x"}, GPT]}, "role 'tool'"),
    ({"id": "missing", "image": "gone.png", "conversations": [HUMAN, GPT]}, "image 'gone.png' does not exist"),
    ({"id": "not-an-image", "image": "notes.png", "conversations": [HUMAN, GPT]}, "'notes.png' is text, not an image"),
    (
        {"id": "typo", "imgae": "a.png", "conversations": [{"from": "human", "value": "hi"}, GPT]},
        "field 'imgae' holds an image path",
    ),
    (
        {"id": "empty", "image": "a.png", "conversations": [HUMAN, {"from": "gpt", "value": " "}]},
        "conversations.1. .assistant. is empty",
    ),
]
BAD_LINES = [(json.dumps(record), reason) for record, reason in BAD_RECORDS]


def test_every_bad_record_is_reported_with_its_line(tmp_path):
    """All of them at once and before any training: missing or unreadable images are found by reading every header."""
    P.photo("chelsea").save(tmp_path / "a.png")
    P.photo("rocket").save(tmp_path / "b.png")
    (tmp_path / "notes.png").write_text("not a picture")
    (tmp_path / "sft.jsonl").write_text("\n".join(line for line, _ in BAD_LINES) + "\n")
    with pytest.raises(ValueError) as caught:
        datasets.load_conversations(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{len(BAD_LINES) - 1} bad conversation record(s) in sft.jsonl")
    for n, (_, reason) in enumerate(BAD_LINES, 1):
        if reason:
            assert any(f"sft.jsonl:{n} " in line and re.search(reason, line) for line in message.splitlines()), reason
    (tmp_path / "sft.jsonl").write_text('{"id": 1}\n{"id": 2\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:2: not valid JSON"):
        datasets.load_conversations(tmp_path)
    (tmp_path / "broken.json").write_text('[\n  {"id": "a", "conversations": []},\n  {"id": "b",, }\n]')
    with pytest.raises(ValueError, match=r"broken.json:3: not valid JSON .* in record 1"):
        datasets.load_conversations(tmp_path, file_name="broken.json")


def test_parquet_questions_with_a_raw_bytes_image_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"question_id": 7, "image": P._png_bytes("coffee"), "question": "What drink?", "answer": "coffee"},
        {"question_id": 8, "image": P._png_bytes("rocket"), "question": "What is it?", "answer": "a rocket"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "vqa.parquet", row_group_size=1)
    _manifest(tmp_path, "eval: [{path: vqa.parquet, task: exact_match}]\n")
    records = datasets.load_eval_records(tmp_path)
    assert [r["id"] for r in records] == ["7", "8"] and records[1]["benchmark"] == "vqa"
    assert [r["pil"].size for r in records] == [(600, 400), (640, 427)]
    assert records[1]["source"] == "vqa.parquet row 1"


def test_records_json_reads_ambiguously_or_not_at_all_are_bad_records_naming_their_line(tmp_path):
    """A key given twice (json keeps the last, other readers the first), nesting past the recursion limit (it was a
    RecursionError traceback) and an integer of 5,000 digits (Python's limit, an error naming no line)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    P.photo("chelsea").save(tmp_path / "a.png")
    good = {"id": "ok", "image": "a.png", "conversations": [HUMAN, GPT]}
    twice = json.dumps(good).replace('"id": "ok"', '"id": "t", "image": "b.png"')
    lines = [json.dumps(good), twice, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"n": ' + "9" * 5000 + "}"]
    (tmp_path / "sft.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as caught:
        datasets.load_conversations(tmp_path)
    message = str(caught.value)
    assert message.startswith("3 bad conversation record(s) in sft.jsonl")
    assert "sft.jsonl:2: the key 'image' is given twice in one object" in message
    assert "sft.jsonl:3: JSON nested deeper than the reader's recursion limit" in message
    assert "sft.jsonl:4: not readable as JSON (Exceeds the limit (4300 digits)" in message
    (tmp_path / "arr.json").write_text("[\n" + json.dumps(good) + ",\n" + twice + "\n]\n")
    with pytest.raises(ValueError, match=r"arr.json:3 \[1\]: the key 'image' is given twice"):
        datasets.load_conversations(tmp_path, file_name="arr.json")
    table = pa.Table.from_arrays([pa.array(["p"]), pa.array(["a"]), pa.array(["b"])], ["prompt", "chosen", "chosen"])
    pq.write_table(table, tmp_path / "pairs.parquet")
    (tmp_path / "dataset.yaml").write_text("preferences: [pairs.parquet]\n")
    with pytest.raises(ValueError, match=r"pairs.parquet: the column\(s\) \['chosen'\] appear more than once"):
        datasets.load_preferences(tmp_path)


def test_a_training_file_listed_twice_or_also_held_out_is_refused(tmp_path):
    """`sft: [sft.jsonl, ./sft.jsonl]` trained each record twice; `sft` naming the eval file trained on the held-out
    questions, both with exit 0; rl's own check compared the paths as written (`./heldout.jsonl` passed)."""
    P.photo("chelsea").save(tmp_path / "a.png")
    record = {"id": "r", "image": "a.png", "conversations": [HUMAN, GPT]}
    (tmp_path / "sft.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "heldout.jsonl").write_text(json.dumps(record) + "\n")
    _manifest(tmp_path, "sft: [sft.jsonl, images/../sft.jsonl]\neval: [heldout.jsonl]\n")
    with pytest.raises(ValueError, match=r"sft files name 'images/../sft.jsonl' twice \(also as 'sft.jsonl'\)"):
        datasets.load_conversations(tmp_path)
    _manifest(tmp_path, "sft: [./heldout.jsonl]\neval: [heldout.jsonl]\n")
    with pytest.raises(ValueError, match=r"\['heldout.jsonl'\] are both sft and held-out \(eval\) files"):
        datasets.load_conversations(tmp_path)
    _manifest(tmp_path, "sft: [sft.jsonl]\nrl: [./heldout.jsonl]\neval: [heldout.jsonl]\n")
    with pytest.raises(ValueError, match=r"are both rl and held-out"):
        datasets.conversation_questions(tmp_path, None)


def test_whole_file_mistakes_say_what_the_path_is(tmp_path):
    """Each said "does not exist", named no file, or was pydantic's raw text."""
    from PIL import Image

    P.photo("chelsea").save(tmp_path / "a.png")
    (tmp_path / "dir.png").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "anim.gif")
    lines = [
        {"id": n, "image": image, "conversations": [HUMAN, GPT]} for n, image in enumerate(["dir.png", "anim.gif"])
    ]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError) as caught:
        datasets.load_conversations(tmp_path)
    message = str(caught.value)
    assert "image 'dir.png' under the data directory" in message and "is not a regular file" in message
    assert "image 'anim.gif' is a GIF file; only JPEG, PNG, WEBP are read: convert it" in str(caught.value)
    with pytest.raises(ValueError, match=r"--data '.*sft.jsonl' is a file; give the directory that holds it"):
        datasets.resolve_data_dir(tmp_path / "sft.jsonl", scratch=tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    for entry, says in [
        ("sft: [empty.jsonl]", r"^empty.jsonl holds no records; fill it or leave it out of dataset.yaml"),
        ("sft: [dir.png]", r"dir.png is a directory; name a data file"),
        ("sft: ['']", r"dataset.yaml: sft lists an empty file name"),
        ("sft: ['https://user:pw0rd@host/x.jsonl']", r"sft\[0\] carries a credential \(hidden\)"),
        ("sft: ['https://host/x.jsonl']", r"path is a URL; nothing is fetched"),
    ]:
        _manifest(tmp_path, entry + "\n")
        with pytest.raises(ValueError, match=says):
            datasets.load_conversations(tmp_path)


def test_the_options_prompt_names_the_kind_of_key_the_record_uses():
    """Numeric option keys were asked for "the option's letter"."""
    from components._shared.data.choices import with_options

    lettered = with_options("Which?", {"A": "cat", "B": "dog"})
    assert lettered.endswith("A. cat\nB. dog\nAnswer with the option's letter from the given choices directly.")
    numbered = with_options("Which?", {"1": "cat", "2": "dog"})
    assert numbered.endswith("1. cat\n2. dog\nAnswer with the option's number from the given choices directly.")
    assert "option's label" in with_options("Which?", {"YES": "cat", "NO": "dog"})
    assert with_options("Which?\n(1) cat\n(2) dog", {"1": "cat", "2": "dog"}) == "Which?\n(1) cat\n(2) dog"


def test_options_are_shown_unless_the_question_lists_exactly_them():
    """A question starting "A.I. systems" was taken for one that lists its options (they were never shown); one that
    listed other options than its 'choices' was asked as it was."""
    from components._shared.data.choices import with_options
    from components._shared.data.formats import RecordError

    shown = with_options("A.I. systems: which one is shown?", {"A": "robot", "B": "toaster"})
    assert shown.startswith("A.I. systems: which one is shown?\nA. robot\nB. toaster\nAnswer with")
    listed = "Which animal?\nA. Dog\n(B) cat."
    assert with_options(listed, {"A": "dog", "B": "cat"}) == listed  # the same options, listed: kept as written
    with pytest.raises(RecordError, match=r"lists option\(s\) \['A. dog', 'B. cat'\] that are not its 'choices'"):
        with_options("Which colour?\nA. dog\nB. cat", {"A": "red", "B": "blue", "C": "green"})
    with pytest.raises(RecordError, match=r"lists option\(s\) \['A. red'\]"):
        with_options("Which colour?\nA. red", {"A": "red", "B": "blue"})  # some of them


@pytest.mark.parametrize(
    ("reference", "says"),
    [
        ("images\\x.png", "has backslashes (a Windows path?)"),
        ("file:///data/x.png", "file:// is not read (local paths and s3:// are); copy the image"),
        ("gs://bucket/x.png", "gs:// is not read"),
        ("S3://bucket/x.png", "write s3:// in lower case"),
        ("data:application/octet-stream;base64,AAAA", "a data: URI is read only as data:image/<type>;base64"),
        ("iVBORw0KGgo" + "A" * 300, "looks like base64 bytes; write it as data:image/<type>;base64"),
    ],
)
def test_image_references_in_a_form_not_read_are_named_by_their_form(reference, says):
    """Each was "does not exist under the data directory" (a base64 one echoed 400 characters of it)."""
    from components._shared.data.formats import RecordError, image_ref

    with pytest.raises(RecordError, match=re.escape(says)) as caught:
        image_ref(reference, "root")
    assert len(str(caught.value)) < 200
    assert image_ref("s3://bucket/x.png", "root") == "s3://bucket/x.png" and image_ref("a:1.png", "r") == "r/a:1.png"
