"""Records that used to pass the start check and then stop or silently change training: each is refused when the
data is read, with the file, line (or row), record and field named and the fix said; nothing is dropped unnamed."""

import base64
import io
import json
import re

import pytest
from PIL import Image

from components._shared.data import datasets
from components._shared.data import formats as F
from components._shared.platform import bad_records

H = lambda text: {"from": "human", "value": text}  # noqa: E731
G = lambda text: {"from": "gpt", "value": text}  # noqa: E731


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def data(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    return tmp_path


def _jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _error(load, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        load(*args, **kwargs)
    assert not isinstance(caught.value, TypeError)
    return str(caught.value)


def _line(message: str, source: str) -> str:
    """The line of a bad-record report that names `source`."""
    found = [line for line in message.splitlines() if line.strip().startswith(source)]
    assert found, (source, message)
    return found[0]


# --------------------------------------------------------------------------- 1. null Parquet image cells ---


def test_null_parquet_image_cells_are_refused_naming_row_column_and_element(data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    good = {"bytes": _png(), "path": None}
    conversation = [[H("<image>What colour?"), G("red")]]
    cells = [good, None, {"bytes": None, "path": None}, {"bytes": b"", "path": None}]
    table = pa.table({"image": pa.array(cells, type=struct), "conversations": pa.array(conversation * 4)})
    pq.write_table(table, data / "one.parquet")
    message = _error(datasets.load_conversations, data, file_name="one.parquet")
    assert message.startswith("3 bad conversation record(s) in one.parquet")
    assert "one.parquet row 0" not in message
    line = _line(message, "one.parquet row 1")
    assert "image cell one.parquet row 1 column 'image' holds no image (bytes null, no path)" in line
    assert "give it or drop the row" in line
    assert "column 'image' holds no image (bytes null" in _line(message, "one.parquet row 2")
    assert "column 'image' holds no image (bytes empty" in _line(message, "one.parquet row 3")

    lists = pa.table(
        {
            "images": pa.array([[good, None]], type=pa.list_(struct)),
            "conversations": pa.array([[H("<image><image>Same?"), G("yes")]]),
        }
    )
    pq.write_table(lists, data / "list.parquet")
    message = _error(datasets.load_conversations, data, file_name="list.parquet")
    assert "list.parquet row 0 column 'images' element 1 holds no image" in _line(message, "list.parquet row 0")
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_conversations(data, file_name="one.parquet")
    assert len(kept) == 1 and ledger.metrics() == {"data/skipped_records": 3, "data/skipped/image": 3}


# ------------------------------------------------------------------- 2. images under an unexpected key ---


def test_images_under_another_key_are_refused_not_trained_text_only(data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "picture": pa.array([{"bytes": _png(), "path": None}]),
            "conversations": pa.array([[H("What colour?"), G("red")]]),
        }
    )
    pq.write_table(table, data / "pic.parquet")
    message = _error(datasets.load_conversations, data, file_name="pic.parquet")
    line = _line(message, "pic.parquet row 0")
    assert "field 'picture' holds a Parquet image column" in line
    assert "read only from 'image' (one) or 'images'" in line and "rename the field" in line
    pq.write_table(pa.table({"jpg": pa.array([_png()], type=pa.binary()), "question": ["Colour?"], "answer": ["red"]}),
                   data / "raw.parquet")  # fmt: skip
    (data / "dataset.yaml").write_text("eval: [{path: raw.parquet, task: exact_match}]\n")
    message = _error(datasets.load_questions, data)
    assert "field 'jpg' holds a Parquet image column" in _line(message, "raw.parquet row 0")
    (data / "dataset.yaml").unlink()

    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    records = [
        {"id": "uri", "img": uri, "conversations": [H("What colour?"), G("red")]},
        {"id": "files", "image_files": ["a.png"], "conversations": [H("What colour?"), G("red")]},
        {"id": "struct", "photo": {"bytes": base64.b64encode(_png()).decode()}, "conversations": [H("Hi?"), G("red")]},
        {"id": "second", "image": "a.png", "thumb": uri, "conversations": [H("<image>Hi?"), G("red")]},
        {"id": "beside", "images": [], "image": "a.png", "conversations": [H("Colour?"), G("red")]},
        {"id": "ok", "image": "a.png", "file_name": "a.png", "conversations": [H("<image>Colour?"), G("red")]},
    ]
    _jsonl(data / "sft.jsonl", records)
    message = _error(datasets.load_conversations, data)
    assert message.startswith("5 bad conversation record(s) in sft.jsonl")
    assert "'image' is given beside 'images' and is not among them" in _line(message, "sft.jsonl:5 (id='beside')")
    assert "field 'img' holds a data: URI image" in _line(message, "sft.jsonl:1 (id='uri')")
    assert "field 'image_files' holds a list of images" in _line(message, "sft.jsonl:2 (id='files')")
    assert "field 'photo' holds an image struct" in _line(message, "sft.jsonl:3 (id='struct')")
    assert "field 'thumb' holds a data: URI image" in _line(message, "sft.jsonl:4 (id='second')")
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_conversations(data)
    assert [r["id"] for r in kept] == ["ok"] and kept[0]["images"] == ["a.png"]  # file_name beside image: metadata
    assert ledger.metrics() == {"data/skipped_records": 5, "data/skipped/image": 5}


# ------------------------------------------------------------------------- 3. image bytes of a wrong type ---


def test_image_bytes_of_a_wrong_type_are_a_record_error_not_a_traceback(data):
    records = [
        {"id": "ints", "image": {"bytes": [1, 2, 3]}, "conversations": [H("<image>Colour?"), G("red")]},
        {"id": "number", "images": ["a.png", {"bytes": 5}], "conversations": [H("<image><image>Same?"), G("no")]},
    ]
    _jsonl(data / "sft.jsonl", records)
    message = _error(datasets.load_conversations, data)
    line = _line(message, "sft.jsonl:1 (id='ints')")
    assert "'image': 'bytes' is a list ([1, 2, 3]), not the image file's bytes" in line and "base64" in line
    assert "'images'[1]: 'bytes' is a int (5)" in _line(message, "sft.jsonl:2 (id='number')")


# ---------------------------------------------------------------------- 4. one-line JSON arrays (LLaVA) ---


def test_every_bad_record_of_a_one_line_json_array_is_named_and_counted(data):
    bad = {"image": "a.png", "conversations": [H("<image>\nhi"), G("")]}
    good = {"image": "a.png", "conversations": [H("<image>\nhi"), G("ok")]}
    (data / "sft.json").write_text(json.dumps([bad, bad, good, bad]))
    message = _error(datasets.load_conversations, data, file_name="sft.json")
    assert message.startswith("3 bad conversation record(s) in sft.json")
    for index in (0, 1, 3):
        assert "conversations[1] (assistant) is empty" in _line(message, f"sft.json:1 [{index}]")
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_conversations(data, file_name="sft.json")
    assert len(kept) == 1 and kept[0]["source"] == "sft.json:1 [2]"
    assert ledger.metrics() == {"data/skipped_records": 3, "data/skipped/empty": 3}
    assert sorted(ledger.skipped) == [
        "sft.json:1 [0]",
        "sft.json:1 [1]",
        "sft.json:1 [3]",
    ]


# ------------------------------------------------------------- 5. control tokens and lone surrogates ---


def test_control_tokens_are_the_qwen_tokenizers_special_tokens():
    """The read-time list is the one packing.py's encode-time check refuses on every Qwen VL checkpoint."""
    from components.synth_world.tokenizer import SPECIAL_TOKENS

    assert set(F.CONTROL_TOKENS) == set(SPECIAL_TOKENS)
    assert {"<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>"} <= set(F.CONTROL_TOKENS)


def test_control_tokens_and_lone_surrogates_are_refused_when_read(data):
    records = [
        {"id": "control", "image": "a.png", "conversations": [H("<image>q<|im_end|>"), G("a")]},
        {"id": "surrogate", "image": "a.png", "conversations": [H("<image>q\ud800"), G("a")]},
        {"id": "system", "image": "a.png", "system": "<|im_start|>x", "conversations": [H("<image>q"), G("a")]},
        {"id": "ok", "image": "a.png", "conversations": [H("<image>q"), G("a")]},
    ]
    _jsonl(data / "sft.jsonl", records)  # json.dumps writes the surrogate as the escape "\ud800"
    message = _error(datasets.load_conversations, data)
    assert message.startswith("3 bad conversation record(s)")
    line = _line(message, "sft.jsonl:1 (id='control')")
    assert "conversations[0]: the text holds the chat control token(s) ['<|im_end|>']" in line
    assert "remove them from the data" in line
    line = _line(message, "sft.jsonl:2 (id='surrogate')")
    assert "conversations[0]: a lone surrogate '\\ud800' at character 8" in line and "fix the escape" in line
    assert "'system': the text holds the chat control token(s) ['<|im_start|>']" in message
    with bad_records.policy("skip") as ledger:
        assert [r["id"] for r in datasets.load_conversations(data)] == ["ok"]
    assert ledger.metrics() == {"data/skipped_records": 3, "data/skipped/invalid_fields": 3}

    questions = [
        {"id": "q", "image": "a.png", "task": "exact_match", "question": "q<|vision_start|>", "answer": "a"},
        {"id": "ans", "image": "a.png", "task": "exact_match", "question": "q", "answers": ["a", "b\udfff"]},
        {"id": "mc", "image": "a.png", "task": "multiple_choice", "question": "q", "choices": ["x", "y<|im_end|>"],
         "answer": "A"},
    ]  # fmt: skip
    _jsonl(data / "eval.jsonl", questions)
    message = _error(datasets.load_questions, data)
    assert "'question': the text holds the chat control token(s)" in _line(message, "eval.jsonl:1 (id='q')")
    assert "answer 1: a lone surrogate" in _line(message, "eval.jsonl:2 (id='ans')")
    assert "'choices' B: the text holds" in _line(message, "eval.jsonl:3 (id='mc')")
    pairs = [{"id": "p", "image": "a.png", "prompt": "q", "chosen": "a<|endoftext|>", "rejected": "b"}]
    _jsonl(data / "preferences.jsonl", pairs)
    message = _error(datasets.load_preferences, data)
    assert "'chosen': the text holds the chat control token(s) ['<|endoftext|>']" in _line(
        message, "preferences.jsonl:1"
    )


# ------------------------------------------------------------- 6. multi-turn records are refused, not cut ---


def test_multi_turn_questions_are_refused_not_cut_to_the_first_exchange(data):
    records = [
        {"id": "two", "image": "a.png", "task": "exact_match",
         "conversations": [H("<image>What colour?"), G("red"), H("What shape?"), G("square")]},
        {"id": "sys", "image": "a.png", "task": "exact_match",
         "conversations": [{"from": "system", "value": "Be terse."}, H("<image>Colour?"), G("red")]},
        {"id": "ok", "image": "a.png", "task": "exact_match", "conversations": [H("<image>Colour?"), G("red")]},
    ]  # fmt: skip
    _jsonl(data / "eval.jsonl", records)
    message = _error(datasets.load_questions, data)
    line = _line(message, "eval.jsonl:1 (id='two')")
    assert "turns ['user', 'assistant', 'user', 'assistant']: a held-out or RL question is one user turn" in line
    assert "split the conversation into one record per question" in line
    assert "turns ['system', 'user', 'assistant']" in _line(message, "eval.jsonl:2 (id='sys')")
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_questions(data)
    assert [r["id"] for r in kept] == ["ok"] and ledger.metrics()["data/skipped_records"] == 2


def test_preference_prompts_and_answers_are_checked_like_conversations(data):
    (data / "b.png").write_bytes(_png())
    user = {"role": "user", "content": "<image>Describe"}
    pairs = [
        {"id": "multi", "image": "a.png", "chosen": "crimson", "rejected": "blue",
         "prompt": [{"role": "system", "content": "Be terse."}, user, {"role": "assistant", "content": "A box"},
                    {"role": "user", "content": "What colour exactly?"}]},
        {"id": "typo", "image": "a.png", "chosen": "a", "rejected": "b",
         "prompt": [{"role": "human_typo", "content": "<image>zzz"}, {"role": "user", "content": "q"}]},
        {"id": "both", "image": "a.png", "chosen": "a", "rejected": "b",
         "prompt": [{"role": "user", "content": [{"type": "image", "image": "b.png"}, {"type": "text", "text": "q"}]}]},
        {"id": "markers", "image": "a.png", "prompt": "<image><image>compare", "chosen": "a", "rejected": "b"},
        {"id": "chosen-image", "image": "a.png", "prompt": "q", "rejected": "b",
         "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]},
        {"id": "chosen-turns", "image": "a.png", "prompt": "q", "rejected": "b",
         "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"id": "chosen-user", "image": "a.png", "prompt": "q", "rejected": "b",
         "chosen": [{"role": "user", "content": "a"}]},
        {"id": "loose", "image": "a.png", "prompt": ["hello", user], "chosen": "a", "rejected": "b"},
        {"id": "kind", "image": "a.png", "prompt": "q", "chosen": "a", "rejected": "b", "kind": 3},
        {"id": "ok", "image": "a.png", "prompt": [user], "chosen": [{"role": "assistant", "content": "A red box."}],
         "rejected": "A blue box."},
    ]  # fmt: skip
    _jsonl(data / "preferences.jsonl", pairs)
    message = _error(datasets.load_preferences, data)
    assert message.startswith("9 bad preference record(s) in preferences.jsonl")
    assert "'kind' 3: a pair's rejection kind names its pair-accuracy metric" in _line(message, "preferences.jsonl:9")
    line = _line(message, "preferences.jsonl:1 (id='multi')")
    assert "'prompt' messages ['system', 'user', 'assistant', 'user']: a preference prompt is one user message" in line
    assert "'prompt'[0]: role 'human_typo'; use role=system|user|assistant" in _line(message, "preferences.jsonl:2")
    assert "images both in the record's 'image(s)' and inside prompt parts" in _line(message, "preferences.jsonl:3")
    assert "1 image(s) but 2 <image> marker(s)" in _line(message, "preferences.jsonl:4")
    assert "'chosen': an image part in the answer; images go in the prompt" in _line(message, "preferences.jsonl:5")
    assert "'chosen' holds 2 messages; an answer is one assistant message" in _line(message, "preferences.jsonl:6")
    assert "'chosen'[0]: a user message; the answer is one message with role=assistant" in message
    assert "'prompt'[0] is str, not a message object" in _line(message, "preferences.jsonl:8")
    with bad_records.policy("skip") as ledger:
        (kept,) = datasets.load_preferences(data)
    assert kept["id"] == "ok" and kept["prompt"] == "Describe" and kept["chosen"] == "A red box."
    assert ledger.metrics()["data/skipped_records"] == 9


# ------------------------------------------------------------------------------------------ 7. small ones ---


def test_a_byte_order_mark_does_not_hide_the_records(data):
    record = {"id": "r", "image": "a.png", "conversations": [H("<image>Colour?"), G("red")]}
    (data / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([record]).encode())
    (data / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(record).encode() + b"\n")
    for name in ("bom.json", "bom.jsonl"):
        (kept,) = datasets.load_conversations(data, file_name=name)
        assert kept["id"] == "r" and kept["turns"][1]["text"] == "red"


def test_task_names_must_be_usable_as_metric_names(data):
    (data / "dataset.yaml").write_text('tasks: {"q&a (v2)": exact_match}\n')
    with pytest.raises(ValueError) as caught:
        datasets.manifest(data)
    message = str(caught.value)
    assert "dataset.yaml: task name 'q&a (v2)': use at most 64 letters, digits, '_', '.', '-'" in message
    assert "task/<name>" in message and "e.g. 'q_a__v2_'" in message
    (data / "dataset.yaml").write_text("tasks: {qa.v2: exact_match, chart-value_1: relaxed_accuracy}\n")
    assert set(datasets.manifest(data).tasks) == {"qa.v2", "chart-value_1"}
    # a name ending in a newline passed (`$` matches before it) and MLflow then refused every metric of the stage
    (data / "dataset.yaml").write_text('tasks: {"foo\\n": exact_match}\n')
    with pytest.raises(ValueError, match=r"task name 'foo\\n': use at most 64 letters"):
        datasets.manifest(data)
    (data / "dataset.yaml").unlink()
    _jsonl(data / "eval.jsonl", [{"id": "q", "image": "a.png", "task": "color", "question": "Colour?", "answer": "red",
                                  "benchmark": "heldout\n"}])  # fmt: skip
    assert "eval.jsonl:1 (id='q'): benchmark 'heldout\\n': use at most 64 letters" in _error(
        datasets.load_questions, data
    )


def test_a_system_prompt_that_is_not_text_or_blank_is_refused(data):
    records = [
        {"id": "list", "image": "a.png", "system": ["be nice"], "conversations": [H("<image>hi"), G("yo")]},
        {"id": "blank", "image": "a.png",
         "conversations": [{"from": "system", "value": "  "}, H("<image>hi"), G("yo")]},
        {"id": "unset", "image": "a.png", "system": "", "conversations": [H("<image>hi"), G("yo")]},
    ]  # fmt: skip
    _jsonl(data / "sft.jsonl", records)
    message = _error(datasets.load_conversations, data)
    assert message.startswith("2 bad conversation record(s)")
    assert "'system' must be a string (the system prompt), got list" in _line(message, "sft.jsonl:1 (id='list')")
    line = _line(message, "sft.jsonl:2 (id='blank')")
    assert (
        "conversations[0] (system) is empty (nothing visible); drop the turn to keep the model's default "
        "system prompt, or write" in line
    )
    with bad_records.policy("skip") as ledger:
        (kept,) = datasets.load_conversations(data)
    assert [t["role"] for t in kept["turns"]] == ["user", "assistant"]  # an empty top-level 'system': no system turn
    assert ledger.metrics() == {
        "data/skipped_records": 2,
        "data/skipped/empty": 1,
        "data/skipped/invalid_fields": 1,
    }


def test_skip_reasons_tell_a_wrong_type_from_an_empty_value(data):
    assert bad_records.reason_of("'chosen' must be a non-empty string (or one assistant message), got [1]") == (
        "invalid_fields"
    )
    assert bad_records.reason_of("'chosen' is empty; write the answer or drop the pair") == "empty"
    assert bad_records.reason_of("chosen and rejected are the same text (up to whitespace)") == "identical_pair"
    pairs = [
        {"id": "type", "image": "a.png", "prompt": "q", "chosen": 5, "rejected": "b"},
        {"id": "blank", "image": "a.png", "prompt": "q", "chosen": " ", "rejected": "b"},
        {"id": "same", "image": "a.png", "prompt": "q", "chosen": "a  b", "rejected": "a b"},
        {"id": "ok", "image": "a.png", "prompt": "q", "chosen": "a", "rejected": "b"},
    ]
    _jsonl(data / "preferences.jsonl", pairs)
    message = _error(datasets.load_preferences, data)
    assert "'chosen' must be a string or one assistant message, got int" in _line(message, "preferences.jsonl:1")
    with bad_records.policy("skip") as ledger:
        datasets.load_preferences(data)
    assert ledger.metrics() == {
        "data/skipped_records": 3,
        "data/skipped/empty": 1,
        "data/skipped/identical_pair": 1,
        "data/skipped/invalid_fields": 1,
    }


# ------------------------------------------------------------------------ answers the task's scorer can use ---


def test_answers_no_prediction_could_score_on_are_refused_when_read(data):
    """A multiple-choice answer outside its options, or a yes_no answer other than yes / no, used to pass the read
    and stop evaluation (or RL's rewards) only when the first prediction was scored."""
    (data / "dataset.yaml").write_text("tasks: {pick: multiple_choice, present: yes_no}\n")
    records = [
        {"id": "mc-ok", "image": "a.png", "task": "pick", "question": "Colour?", "choices": ["red", "blue"],
         "answer": "A"},
        {"id": "mc-bad", "image": "a.png", "task": "pick", "question": "Colour?", "choices": ["red", "blue"],
         "answer": "dog"},
        {"id": "yn-ok", "image": "a.png", "task": "present", "question": "A cat?", "answer": "Yes"},
        {"id": "yn-bad", "image": "a.png", "task": "present", "question": "A cat?", "answer": "true"},
    ]  # fmt: skip
    _jsonl(data / "eval.jsonl", records)
    message = _error(datasets.load_questions, data)
    assert message.startswith("2 bad question record(s) in eval.jsonl")
    assert "answer ['DOG'] is not one of the options ['A', 'B']; give the answer as one of the options' keys" in _line(
        message, "eval.jsonl:2 (id='mc-bad')"
    )
    assert "a yes_no task needs yes/no answers, got ['true']" in _line(message, "eval.jsonl:4 (id='yn-bad')")
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_questions(data)
    assert [r["id"] for r in kept] == ["mc-ok", "yn-ok"] and ledger.metrics()["data/skipped_records"] == 2


def test_grounding_answers_without_a_box_are_refused_when_read(data):
    """A grounding record with no box in its answer and no 'box' field scores 0 whatever is predicted: as an RL
    prompt it trained on a reward that is always 0 without a word. Refused when read (rl prompts and held-out
    alike), or skipped and counted; the synthetic world's "(x1,y1),(x2,y2)", a [x1, y1, x2, y2] list and a 'box'
    field are kept."""
    (data / "dataset.yaml").write_text("rl: [rl.jsonl]\ntasks: {refer: grounding}\n")
    records = [
        {"id": "g-ok", "image": "a.png", "type": "grounding", "question": "Where is the circle?",
         "answer": "(10,12),(40,44)"},
        {"id": "g-list", "image": "a.png", "task": "refer", "question": "The dog?", "answer": "[1, 2, 30, 40]"},
        {"id": "g-field", "image": "a.png", "task": "refer", "question": "The cat?", "answer": "the cat",
         "box": [1, 2, 30, 20]},
        {"id": "g-bad", "image": "a.png", "type": "grounding", "question": "Where is the square?",
         "answer": "top left"},
    ]  # fmt: skip
    _jsonl(data / "rl.jsonl", records)
    message = _error(datasets.conversation_questions, data, None)
    assert message.startswith("1 bad question record(s) in rl.jsonl")
    assert "a grounding answer needs a box" in _line(message, "rl.jsonl:4 (id='g-bad')")
    with bad_records.policy("skip") as ledger:
        kept = datasets.conversation_questions(data, None)
    assert [r["id"] for r in kept] == ["g-ok", "g-list", "g-field"] and ledger.metrics()["data/skipped_records"] == 1


def test_turns_out_of_order_and_marker_lookalikes_are_refused(data):
    """A leading assistant turn answers nothing and a trailing user turn is never answered (both used to be kept and
    tokenised, teaching nothing); two turns in a row by one role; '<Image>' stayed text while its image moved."""
    records = [
        {"id": "ends-user", "image": "a.png", "conversations": [H("<image>q1"), G("a1"), H("q2")]},
        {"id": "starts-gpt", "image": "a.png", "conversations": [G("hello"), H("<image>q1"), G("a1")]},
        {"id": "two-gpt", "image": "a.png", "conversations": [H("<image>q1"), G("a1"), G("a2")]},
        {"id": "lookalike", "image": "a.png", "conversations": [H("<Image> what"), G("a")]},
        {"id": "ok", "image": "a.png", "system": "Be terse.",
         "conversations": [H("<image>q"), G("a"), H("q2"), G("b")]},
    ]  # fmt: skip
    _jsonl(data / "sft.jsonl", records)
    message = _error(datasets.load_conversations, data)
    assert message.startswith("4 bad conversation record(s) in sft.jsonl")
    assert "conversations[2]: the conversation ends on a user turn that nothing answers" in _line(
        message, "sft.jsonl:1 (id='ends-user')"
    )
    assert "conversations[0]: the conversation starts with an assistant turn" in _line(message, "sft.jsonl:2")
    assert "conversations[2]: a second assistant turn in a row; merge it" in _line(message, "sft.jsonl:3")
    assert "conversations[0]: '<Image>' looks like the image marker but is not; write <image>" in _line(
        message, "sft.jsonl:4"
    )
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_conversations(data)
    assert [r["id"] for r in kept] == ["ok"] and ledger.metrics()["data/skipped_records"] == 4


def test_boxes_without_area_and_choices_that_collide_are_refused(data):
    """JSON true/false are ints to Python (a box [true, 0, false, 1] was read as [1, 0, 0, 1]); an inverted box
    scores every prediction 0; options 'a' and 'A' became one option, losing the other."""
    records = [
        {"id": "bool", "image": "a.png", "task": "grounding", "question": "where", "answer": "",
         "box": [True, 0, False, 1]},
        {"id": "inverted", "image": "a.png", "task": "grounding", "question": "where", "answer": "",
         "box": [50, 40, 10, 5]},
        {"id": "collide", "image": "a.png", "task": "multiple_choice", "question": "Pick",
         "choices": {"a": "cat", "A": "dog"}, "answer": "A"},
        {"id": "ok", "image": "a.png", "task": "grounding", "question": "where", "answer": "", "box": [1, 2, 10, 12]},
        {"id": "unread", "image": "a.png", "task": "color", "question": "Colour?", "answer": "red",
         "box": [1, 2, 9, 9]},
    ]  # fmt: skip
    _jsonl(data / "eval.jsonl", records)
    message = _error(datasets.load_questions, data)
    assert message.startswith("4 bad question record(s) in eval.jsonl")
    assert "'box' given, but task 'color' is scored by exact_match, which does not read a box" in _line(
        message, "eval.jsonl:5"
    )
    assert "'box' must be [x1, y1, x2, y2] in image pixels, got [True, 0, False, 1]" in _line(message, "eval.jsonl:1")
    assert "(x2 must exceed x1 and y2 exceed y1: a box with area), got [50, 40, 10, 5]" in _line(
        message, "eval.jsonl:2"
    )
    assert "choices ['a', 'A'] name an option twice once upper-cased" in _line(message, "eval.jsonl:3")
    with bad_records.policy("skip"):
        assert [r["box"] for r in datasets.load_questions(data)] == [[1.0, 2.0, 10.0, 12.0]]


def test_rl_prompts_take_a_conversations_first_exchange_counted_and_said(data, capsys):
    """RL prompts default to the SFT conversations: a multi-turn or system-prompted one gives its first user turn and
    the answer to it (documented in rl.prompts_file), counted on stderr, instead of stopping the RL stage."""
    (data / "b.png").write_bytes((data / "a.png").read_bytes())
    records = [
        {"id": "two", "image": "a.png", "task": "exact_match",
         "conversations": [H("<image>What colour?"), G("red"), H("What shape?"), G("square")]},
        {"id": "sys", "image": "a.png", "task": "exact_match",
         "conversations": [{"from": "system", "value": "Be terse."}, H("<image>Colour?"), G("red")]},
        {"id": "later-image", "images": ["a.png", "b.png"], "task": "exact_match",
         "conversations": [H("<image>Colour?"), G("red"), H("<image>And this one?"), G("red")]},
        {"id": "one", "image": "a.png", "task": "exact_match", "conversations": [H("<image>Colour?"), G("red")]},
    ]  # fmt: skip
    _jsonl(data / "sft.jsonl", records)
    prompts = {r["id"]: r for r in datasets.conversation_questions(data, None)}
    assert [(p["question"], p["answers"]) for p in prompts.values()] == [
        ("What colour?", ["red"]),
        ("Colour?", ["red"]),
        ("Colour?", ["red"]),
        ("Colour?", ["red"]),
    ]
    assert prompts["later-image"]["image"] == "a.png" and "shortened" not in prompts["two"]
    assert "note: 3 of 4 RL prompts of sft.jsonl are the first exchange of a longer conversation" in (
        capsys.readouterr().err
    )


def test_choices_beyond_z_or_blank_are_bad_records(data):
    """A list of 30 options kept A-Z and dropped the last 4 without a word; blank options were kept."""
    records = [
        {"id": "thirty", "image": "a.png", "task": "multiple_choice", "question": "Pick",
         "choices": [f"option {n}" for n in range(30)], "answer": "A"},
        {"id": "blank", "image": "a.png", "task": "multiple_choice", "question": "Pick",
         "choices": {"A": "cat", "B": "  "}, "answer": "A"},
        {"id": "ok", "image": "a.png", "task": "multiple_choice", "question": "Pick",
         "choices": ["cat", "dog"], "answer": "B"},
    ]  # fmt: skip
    _jsonl(data / "eval.jsonl", records)
    message = _error(datasets.load_questions, data)
    assert message.startswith("2 bad question record(s) in eval.jsonl")
    assert "30 choices; at most 26 options (A to Z) are lettered" in _line(message, "eval.jsonl:1")
    assert "hold a blank option letter or text" in _line(message, "eval.jsonl:2")


def test_boxes_off_the_image_animated_images_non_numbers_and_look_alike_ids_are_bad_records(data):
    """Each was kept quietly: a box off its 32x24 image (scored against a place the image lacks), an animated PNG
    (trained on its first frame), `Infinity` in a record (JSON has none; copied into the record), and an id that
    differs from another only by white space or a zero-width space (two records to the reader, one to anyone
    reading the results)."""
    frames = [Image.new("RGB", (32, 24), c) for c in ("red", "blue")]
    frames[0].save(data / "anim.png", save_all=True, append_images=frames[1:])
    box = {"image": "a.png", "task": "grounding", "question": "where", "answer": ""}
    lines = [
        json.dumps({"id": "negative", **box, "box": [-5, 0, 10, 10]}),
        json.dumps({"id": "outside", **box, "box": [10, 10, 40, 20]}),
        json.dumps({"id": "rounding", **box, "box": [0, 0, 32.4, 24]}),
        json.dumps({"id": "animated", "image": "anim.png", "task": "color", "question": "Colour?", "answer": "red"}),
        '{"id": "inf", "image": "a.png", "task": "color", "question": "Colour?", "answer": "red", "score": Infinity}',
        json.dumps({"id": "q1 ", "image": "a.png", "task": "color", "question": "Colour?", "answer": "red"}),
        json.dumps({"id": "q\u200b1", "image": "a.png", "task": "color", "question": "Colour?", "answer": "red"}),
    ]
    (data / "eval.jsonl").write_text("\n".join(lines) + "\n")
    message = _error(datasets.load_questions, data)
    assert message.startswith("5 bad question record(s) in eval.jsonl")
    assert "box [-5.0, 0.0, 10.0, 10.0] is not inside its 32x24 image" in _line(message, "eval.jsonl:1")
    assert "box [10.0, 10.0, 40.0, 20.0] is not inside its 32x24 image" in _line(message, "eval.jsonl:2")
    assert "image 'anim.png' is animated (2 frames)" in _line(message, "eval.jsonl:4")
    assert "Infinity is not a JSON value" in _line(message, "eval.jsonl:5")
    assert "'id' 'q\\u200b1' holds an invisible formatting character (ZERO WIDTH SPACE)" in _line(
        message, "eval.jsonl:7"
    )
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_questions(data)
    assert [r["id"] for r in kept] == ["rounding", "q1 "] and ledger.metrics()["data/skipped/box"] == 2


def test_an_empty_file_list_and_an_entrys_unknown_task_are_named_in_the_manifest(data):
    """`sft: []` read the default file instead; an entry's task was unchecked when its records carry their own."""
    (data / "dataset.yaml").write_text("sft: []\n")
    assert "sft is an empty list; name its files, or leave sft out" in _error(datasets.load_conversations, data)
    (data / "dataset.yaml").write_text("eval: [{path: eval.jsonl, task: exact_matchh}]\n")
    _jsonl(data / "eval.jsonl", [{"id": "a", "image": "a.png", "task": "color", "question": "C?", "answer": "red"}])
    assert "eval entry 'eval.jsonl': unknown task 'exact_matchh'" in _error(datasets.load_questions, data)


def test_records_that_say_two_things_are_refused_not_read_one_way(data):
    """A second hostile pass found records kept with half of them dropped: synonyms that disagree (`from` human and
    `role` assistant in one turn; an image part's `image` and `url`), two shapes in one record, `task` and `type`
    naming different tasks, a curriculum level that is not a name (a traceback once a curriculum ran), and options
    on a task that scores the answer's text (the prompt asked for a letter the reference never is)."""
    (data / "b.png").write_bytes(_png())
    turn = lambda **kw: kw  # noqa: E731
    records = [
        {
            "id": "roles",
            "image": "a.png",
            "conversations": [turn(**{"from": "human", "role": "assistant", "value": "<image>Q"}), G("A")],
        },
        {
            "id": "texts",
            "image": "a.png",
            "conversations": [turn(**{"from": "human", "value": "<image>Q", "content": "B"}), G("A")],
        },
        {
            "id": "parts",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": "a.png", "url": "b.png"}, {"type": "text", "text": "Q"}],
                },
                {"role": "assistant", "content": "A"},
            ],
        },
        {
            "id": "shapes",
            "image": "a.png",
            "conversations": [H("<image>Q"), G("A")],
            "messages": [{"role": "user", "content": "x"}],
        },
        {"id": "level", "image": "a.png", "difficulty": ["basic"], "conversations": [H("<image>Q"), G("A")]},
        {"id": "null-level", "image": "a.png", "difficulty": None, "conversations": [H("<image>Q"), G("A")]},
    ]
    _jsonl(data / "sft.jsonl", records)
    message = _error(datasets.load_conversations, data)
    assert message.startswith("5 bad conversation record(s) in sft.jsonl")
    assert "conversations[0]: 'from' and 'role' are both given and differ; keep one" in _line(message, "sft.jsonl:1")
    assert "'value' and 'content' are both given and differ" in _line(message, "sft.jsonl:2")
    assert "part 0: 'image' and 'url' are both given and differ" in _line(message, "sft.jsonl:3")
    assert "the record holds 'conversations' and 'messages': two record shapes" in _line(message, "sft.jsonl:4")
    assert "'difficulty' must be a level's name (a string such as 'basic'), got ['basic']" in _line(
        message, "sft.jsonl:5"
    )
    with bad_records.policy("skip"):
        assert [r["difficulty"] for r in datasets.load_conversations(data)] == ["all"]  # a null level is none given
    questions = [
        {"id": "both", "image": "a.png", "question": "Q", "answer": "red", "task": "color", "type": "count"},
        {
            "id": "options",
            "image": "a.png",
            "question": "Q",
            "answer": "red",
            "task": "color",
            "choices": ["red", "blue"],
        },
        {
            "id": "chat",
            "image": "a.png",
            "question": "Q",
            "answer": "red",
            "task": "color",
            "conversations": [H("Q"), G("A")],
        },
    ]
    _jsonl(data / "eval.jsonl", questions)
    message = _error(datasets.load_questions, data)
    assert "'task' 'color' and 'type' 'count' disagree; give one of them" in _line(message, "eval.jsonl:1")
    assert "'choices' given, but task 'color' is scored by exact_match" in _line(message, "eval.jsonl:2")
    assert "the record holds 'conversations' and 'question'" in _line(message, "eval.jsonl:3")


def test_an_entrys_declared_format_must_be_its_records_and_annotations_only_go_with_vqav2(data):
    _jsonl(data / "eval.jsonl", [{"id": "q", "image": "a.png", "question": "Q", "answer": "red", "task": "color"}])
    (data / "dataset.yaml").write_text("eval: [{path: eval.jsonl, format: llava}]\n")
    assert "dataset.yaml gives 'eval.jsonl' format: llava, but this record is flat" in _error(
        datasets.load_questions, data
    )
    (data / "dataset.yaml").write_text("eval: [{path: eval.jsonl, annotations: nothere.json}]\n")
    assert "gives annotations, which only format: vqav2 reads" in _error(datasets.load_questions, data)
    (data / "dataset.yaml").write_text("eval: [eval.jsonl]\n")
    (data / "dataset.json").write_text('{"eval": ["eval.jsonl"]}')
    assert "holds both dataset.yaml and dataset.json" in _error(datasets.load_questions, data)
    (data / "dataset.yaml").unlink()
    (data / "dataset.json").rename(data / "dataset.yml")
    assert "holds dataset.yml, not dataset.yaml: name it dataset.yaml" in _error(datasets.load_questions, data)


def test_a_training_file_under_another_name_is_refused_however_it_is_linked_or_copied(data):
    """normpath caught `./sft.jsonl`; a symlink, a hard link or a copy trained twice or on held-out data, exit 0."""
    import os
    import shutil

    _jsonl(data / "sft.jsonl", [{"id": "s", "image": "a.png", "conversations": [H("<image>Q"), G("A")]}])
    _jsonl(data / "eval.jsonl", [{"id": "q", "image": "a.png", "question": "Q", "answer": "red", "task": "color"}])
    os.symlink("sft.jsonl", data / "linked.jsonl")
    os.link(data / "sft.jsonl", data / "hard.jsonl")
    shutil.copy(data / "sft.jsonl", data / "copy.jsonl")
    for other in ("linked.jsonl", "hard.jsonl", "copy.jsonl"):
        (data / "dataset.yaml").write_text(f"sft: [sft.jsonl, {other}]\n")
        assert "hold the same bytes (a link or a copy): sft would train on the same training records twice" in (
            _error(datasets.load_conversations, data)
        )
        (data / "dataset.yaml").write_text(f"sft: [sft.jsonl]\neval: [eval.jsonl, {other}]\n")
        assert "would train on held-out records" in _error(datasets.load_conversations, data)


def test_image_paths_that_go_wrong_say_how(data):
    """A NUL character, the data directory itself, a symlink out of it and a name in another Unicode form (macOS
    writes NFD) were 'embedded null byte', 'leaves the data directory' or 'does not exist'."""
    import os
    import unicodedata

    (data / unicodedata.normalize("NFD", "café.png")).write_bytes(_png())
    os.symlink("/tmp", data / "out")
    cases = {
        "nul": "a.png\u0000.txt",
        "dir": "./",
        "link": "out/x.png",
        "nfd": unicodedata.normalize("NFC", "café.png"),
    }
    records = [{"id": k, "image": v, "question": "Q", "answer": "red", "task": "color"} for k, v in cases.items()]
    _jsonl(data / "eval.jsonl", records)
    message = _error(datasets.load_questions, data)
    assert "holds a NUL character" in _line(message, "eval.jsonl:1")
    assert "names the data directory itself, not an image file" in _line(message, "eval.jsonl:2")
    assert "leads outside the data directory" in _line(message, "eval.jsonl:3") and "through the symlink 'out'" in (
        _line(message, "eval.jsonl:3")
    )
    assert "is written in another Unicode form: rename one" in _line(message, "eval.jsonl:4")


def test_a_parquet_image_column_of_nulls_is_refused_and_a_cells_path_is_under_the_entrys_folder(data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": ["a"], "image": pa.array([None], type=pa.null()), "question": ["Q"], "answer": ["red"]})
    pq.write_table(table, data / "eval.parquet")
    (data / "dataset.yaml").write_text("eval: [{path: eval.parquet, task: color}]\n")
    assert "the column 'image' holds no image in any row (every value is null)" in _error(datasets.load_questions, data)
    (data / "pics").mkdir()
    (data / "pics" / "c.png").write_bytes(_png())
    cell = pa.array([{"bytes": None, "path": "c.png"}], type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"id": ["a"], "image": cell, "question": ["Q"], "answer": ["red"]}), data / "eval.parquet")
    (data / "dataset.yaml").write_text("eval: [{path: eval.parquet, task: color, images: pics}]\n")
    assert datasets.load_questions(data)[0]["image_sizes"] == [(32, 24)]  # was "'c.png' does not exist"


def test_parquet_columns_of_surprising_types_are_named_by_their_cause(tmp_path):
    """A text field stored as bytes was read as an image column ("'id' must be a string, got ParquetImage"); an image
    nested one struct deeper was "an image must be a path, got None"; a null list of images was a text-only record."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    png = buffer.getvalue()
    conv = [{"from": "human", "value": "<image>\nWhat color?"}, {"from": "gpt", "value": "red"}]
    cell = {"bytes": png, "path": "x.png"}
    (tmp_path / "dataset.yaml").write_text("sft: [sft.parquet]\n")

    def refused(table, match):
        pq.write_table(table, tmp_path / "sft.parquet")
        with pytest.raises(ValueError, match=match):
            datasets.load_conversations(tmp_path)

    binary_id = pa.table({"id": pa.array([b"a"], pa.binary()), "conversations": [conv], "image": [cell]})
    refused(binary_id, r"sft.parquet: the column 'id' is binary \(bytes\), not text.*pa.string\(\)")
    nested = pa.table({"id": ["a"], "conversations": [conv], "image": [{"img": cell}]})
    refused(nested, r"row 0 \(id='a'\): 'image': an image object has 'bytes' and/or 'path'.*keys \['img'\]")
    images = pa.array([[cell], None], pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))
    null_list = pa.table({"id": ["a", "b"], "conversations": [conv, conv], "images": images})
    refused(null_list, r"row 1 \(id='b'\): .*the image list in sft.parquet row 1 column 'images' is null; write \[\]")


def test_an_image_named_relative_to_a_data_file_in_a_subfolder_suggests_images(tmp_path):
    (tmp_path / "llava" / "pics").mkdir(parents=True)
    Image.new("RGB", (32, 32), "red").save(tmp_path / "llava" / "pics" / "a.png")
    record = {"id": "a", "image": "pics/a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat color?"}, {"from": "gpt", "value": "red"}]}  # fmt: skip
    (tmp_path / "llava" / "train.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "dataset.yaml").write_text("sft: [llava/train.jsonl]\n")
    with pytest.raises(ValueError, match=r"'pics/a.png' does not exist .* add `images: llava` to the file's dataset"):
        datasets.load_conversations(tmp_path)
    (tmp_path / "dataset.yaml").write_text("sft: [{path: llava/train.jsonl, images: llava}]\n")
    assert [r["id"] for r in datasets.load_conversations(tmp_path)] == ["a"]


def test_ids_that_differ_only_by_a_look_alike_letter_of_another_script_are_one_id(data):
    """`q-а1` with a Cyrillic "а" was a second record beside `q-a1`: two ids that look the same. Ids in one script, or
    mixing scripts without a twin, stay ids."""
    row = {"image": "a.png", "task": "color", "question": "Colour?", "answer": "red"}
    ids = ["q-a1", "q-\u0430" + "1", "\u03b1\u03b2-7", "图片-a1", "фото-1", "ru_фото_2", "ΑΒ-9"]
    _jsonl(data / "eval.jsonl", [{"id": i, **row} for i in ids])
    message = _error(datasets.load_questions, data)
    assert message.startswith("1 bad question record(s) in eval.jsonl")
    assert "'а' is CYRILLIC SMALL LETTER A); ids must be unique" in _line(message, "eval.jsonl:2")
    with bad_records.policy("skip") as ledger:
        kept = datasets.load_questions(data)
    assert [r["id"] for r in kept] == [i for i in ids if i != "q-\u0430" + "1"]
    assert ledger.metrics()["data/skipped/duplicate_id"] == 1


def test_held_out_and_preference_records_that_would_lose_a_field_are_refused(data):
    """Third hostile pass: each was read one way and the rest dropped quietly."""
    (data / "b.png").write_bytes(_png())
    q = {"image": "a.png", "task": "color", "question": "Colour?"}
    chat = [H("<image>\nColour?"), G("cat")]
    _jsonl(
        data / "eval.jsonl",
        [
            {"id": "two-answers", **q, "answer": "red", "answers": ["blue"]},
            {"id": "turn-vs-answers", "image": "a.png", "task": "color", "conversations": chat, "answers": ["dog"]},
            {"id": "system", **q, "answer": "red", "system": "Be brief."},
            {"id": "marker", **q, "answer": "<image> red"},
            {"id": "agrees", **q, "answer": "Red", "answers": ["red", "crimson"]},  # one of them: fine
        ],
    )
    message = _error(datasets.load_questions, data)
    assert message.startswith("4 bad question record(s) in eval.jsonl")
    assert "'answer' 'red' is not among 'answers' ['blue']: the record says two things" in _line(
        message, "eval.jsonl:1"
    )
    assert "the assistant turn 'cat' is not among 'answers' ['dog']" in _line(message, "eval.jsonl:2")
    assert "'system': a held-out or RL question is asked without a system prompt" in _line(message, "eval.jsonl:3")
    assert "an answer holds <image>; the image goes with the question" in _line(message, "eval.jsonl:4")
    pair = {"image": "a.png", "prompt": "Which?", "chosen": "a cat", "rejected": "a dog"}
    _jsonl(
        data / "preferences.jsonl",
        [
            {"id": "p1", **pair, "rejected_image": "b.png"},
            {"id": "p2", **pair, "system": "Be brief."},
            {"id": "p3", **pair, "image_id": 7},  # an id, not an image
        ],
    )
    message = _error(datasets.load_preferences, data)
    assert message.startswith("2 bad preference record(s)")
    assert "'rejected_image' names another image: a pair is both answers to one prompt on one image" in message
    assert "'system' would be dropped" in _line(message, "preferences.jsonl:2")


@pytest.mark.parametrize("text", ["# just comments\n", "0\n", "false\n", "[]\n", ""])
def test_a_manifest_that_says_nothing_is_refused_not_read_as_none(data, text):
    """A dataset.yaml of comments (or 0, false, []) was read as no manifest: the default files trained instead."""
    (data / "dataset.yaml").write_text(text)
    with pytest.raises(ValueError, match=r"dataset.yaml: expected a mapping of roles"):
        datasets.manifest(data)


def test_a_manifest_that_is_no_file_or_not_utf8_is_named(data):
    (data / "dataset.yaml").mkdir()
    with pytest.raises(ValueError, match=r"dataset.yaml is not a file \(a directory or a pipe\?\)"):
        datasets.manifest(data)
    (data / "dataset.yaml").rmdir()
    (data / "dataset.yaml").write_bytes("sft: [caf\u00e9.jsonl]\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"dataset.yaml: not UTF-8 text \(byte b'\\xe9' at 9\); save it as UTF-8"):
        datasets.manifest(data)


def test_a_null_id_is_no_id(data):
    """`"id": null` became the id 'None' (two of them: "id 'None' appears more than once")."""
    row = {"id": None, "image": "a.png", "task": "color", "question": "Colour?", "answer": "red"}
    _jsonl(data / "eval.jsonl", [row, row])
    assert [r["id"] for r in datasets.load_questions(data)] == ["eval:0", "eval:1"]


def test_a_jpeg_with_data_after_its_end_is_whole_and_one_cut_short_is_not(data):
    """A phone's motion photo (a JPEG with its video appended, over 64 KiB) was refused as "truncated"."""
    import numpy as np

    from components._shared.data.image_checks import probe_image

    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="JPEG")
    jpeg = buffer.getvalue()
    (data / "motion.jpg").write_bytes(jpeg + bytes(range(256)) * 400)  # 100 KiB after the end-of-image marker
    (data / "cut.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    assert probe_image(data, "motion.jpg") is None
    assert "is truncated" in probe_image(data, "cut.jpg")


def test_a_turn_weight_other_than_one_is_refused_not_trained(data):
    """ShareGPT / axolotl's per-turn `"weight": 0` ("do not train on this turn") was ignored: the turn trained."""
    conversations = [H("<image>\nColour?"), {**G("red"), "weight": 0}, H("Shape?"), {**G("square"), "weight": 1}]
    _jsonl(data / "sft.jsonl", [{"id": "w", "image": "a.png", "conversations": conversations}])
    assert "conversations[1]: 'weight' 0 is not read (every assistant turn trains)" in _error(
        datasets.load_conversations, data
    )


@pytest.mark.parametrize(
    ("manifest", "says"),
    [
        ("eval: [{path: pope.jsonl, format: pope, task: color}]", "has format: pope, scored by its own yes_no; drop"),
        ("tasks: {pope: exact_match}", "task 'pope' is a benchmark format's name, scored otherwise"),
        ("tasks: {yes_no: exact_match}", "task 'yes_no' is a scorer's name, scored otherwise"),
    ],
)
def test_a_benchmarks_or_scorers_name_never_takes_another_scorer(data, manifest, says):
    """Each replaced the release's own scorer quietly (POPE scored by exact match, counted in vqa_exact_match)."""
    (data / "dataset.yaml").write_text(manifest + "\n")
    with pytest.raises(ValueError, match=re.escape(says)):
        datasets.manifest(data)


def test_files_an_image_reader_cannot_read_or_that_are_pipes_are_named_by_kind(data):
    """SVG, HEIC and AVIF were "cannot identify image file", an empty file the same; a pipe "does not exist"."""
    import os

    from components._shared.data.image_checks import probe_image

    (data / "e.png").write_bytes(b"")
    (data / "s.png").write_text('<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>')
    (data / "h.heic").write_bytes(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(64))
    (data / "a.avif").write_bytes(b"\0\0\0\x1cftypavif\0\0\0\0avifmif1" + bytes(64))
    empty = "image 'e.png' is an empty file (0 bytes); fetch the image again or drop the record"
    assert probe_image(data, "e.png") == empty  # nothing to convert (I04)
    kinds = {
        "s.png": "an SVG file",
        "h.heic": "a HEIC file",
        "a.avif": "an AVIF file",
    }
    for name, kind in kinds.items():
        assert probe_image(data, name) == f"image {name!r} is {kind}; only JPEG, PNG, WEBP are read: convert it"
    os.mkfifo(data / "pipe.png")
    assert "is not a regular file (a directory or a pipe?)" in probe_image(data, "pipe.png")
    os.mkfifo(data / "sft.jsonl")
    assert "sft.jsonl is not a regular file (a pipe or a device?)" in _error(datasets.load_conversations, data)


def test_yaml_booleans_where_the_manifest_wants_names_are_explained(data):
    """`tasks: {true: yes_no}` reads the key as a boolean: explained; YAML 1.1's `on` (read as true before) is the
    word typed."""
    (data / "dataset.yaml").write_text("tasks: {true: yes_no}\n")
    with pytest.raises(ValueError, match=r"YAML reads true and false as booleans: quote such a name"):
        datasets.manifest(data)
    (data / "dataset.yaml").write_text("tasks: {on: yes_no}\n")
    assert datasets.manifest(data).tasks == {"on": "yes_no"}


def test_a_flat_records_hint_goes_before_its_question_as_mmbench_puts_it(data):
    """A flat multiple-choice record's `hint` was kept only as an unused label."""
    row = {"id": "h", "image": "a.png", "task": "multiple_choice", "question": "Which colour?", "answer": "A"}
    _jsonl(data / "eval.jsonl", [{**row, "choices": ["red", "blue"], "hint": "Look at the square."}])
    (record,) = datasets.load_questions(data)
    assert record["question"].startswith("Look at the square.\nWhich colour?\nA. red\nB. blue\n")
    assert "hint" not in record


def test_file_level_oddities_are_one_message_naming_the_file(data):
    """A JSON5 trailing comma was read; CR-only line ends were one "Extra data" error for three records; UTF-16 JSON
    Lines said "not UTF-8" on line 1 and "not valid JSON" after."""
    row = {"id": "a", "image": "a.png", "conversations": [H("<image>\nColour?"), G("red")]}
    (data / "sft.json").write_text(json.dumps([row]).rstrip("]") + ",]")
    (data / "dataset.yaml").write_text("sft: [sft.json]\n")
    assert "sft.json:1: a ',' before the array's ']'; drop it." in _error(datasets.load_conversations, data)
    (data / "dataset.yaml").unlink()
    lines = [json.dumps({**row, "id": str(i)}) for i in range(3)]
    (data / "sft.jsonl").write_bytes("\r".join(lines).encode())
    assert "sft.jsonl: its lines end in a bare CR" in _error(datasets.load_conversations, data)
    (data / "sft.jsonl").write_bytes("\n".join(lines).encode("utf-16"))
    assert "sft.jsonl: UTF-16 text (its byte-order mark says so); save it as UTF-8." in _error(
        datasets.load_conversations, data
    )


def test_a_choice_answer_given_as_the_options_text_names_the_option(data):
    row = {"id": "t", "image": "a.png", "task": "multiple_choice", "question": "Which?", "choices": ["red", "blue"]}
    _jsonl(data / "eval.jsonl", [{**row, "answer": "Blue"}])
    assert "('Blue' is option B's text); give the answer as one of the options' keys" in _error(
        datasets.load_questions, data
    )


def test_a_records_own_shortened_label_is_not_read_as_the_readers_note(data):
    """A raw `shortened: true` was carried as a label and then counted as a conversation cut to its first exchange."""
    row = {"id": "s", "image": "a.png", "task": "color", "question": "Colour?", "answer": "red", "shortened": True}
    _jsonl(data / "eval.jsonl", [row])
    (record,) = datasets.load_questions(data)
    assert "shortened" not in record


def test_a_numeric_answer_names_its_own_field_and_says_to_quote_it(data):
    _jsonl(data / "eval.jsonl", [
        {"id": "n", "image": "a.png", "task": "count", "question": "How many?", "answer": 2},
        {"id": "l", "image": "a.png", "task": "count", "question": "How many?", "answers": [1]},
    ])  # fmt: skip
    message = _error(datasets.load_questions, data)
    line = _line(message, "eval.jsonl:1")
    assert "'answer' must be a string or a list of strings, got 2 (a number: write it as a string, e.g. \"2\")" in line
    assert "'answers' must be a string or a list of strings, got [1]" in _line(message, "eval.jsonl:2")
