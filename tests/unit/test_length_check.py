"""model/length_check.keep_trainable: records over the budget or refused by the encoder are bad records, per file,
under the open on_bad_record policy (listed in one error, or skipped and counted)."""

import pytest

from components._shared.model.length_check import keep_trainable
from components._shared.platform import bad_records


def _records():
    out = []
    for file, lengths in (("a/one.jsonl", [10, 900, 20]), ("two.jsonl", [30, 5000])):
        for line, n in enumerate(lengths, 1):
            out.append({"id": f"{file}-{line}", "file": file, "source": f"{file.split('/')[-1]}:{line}", "n": n})
    return out


def _count(record: dict) -> int:
    if record["n"] > 4096:
        raise ValueError(f"sample {record['id']!r} has {record['n']} tokens (text + visual), more than max_length=4096")
    return record["n"]


def test_records_over_the_budget_are_listed_by_file_line_and_id_under_fail():
    with bad_records.policy("fail"), pytest.raises(ValueError) as error:
        keep_trainable(_records(), _count, budget=512, what="conversation")
    message = str(error.value)
    assert message.startswith("1 conversation record(s) too long to train on in a/one.jsonl")
    assert (
        "one.jsonl:2 (id='a/one.jsonl-2'): 900 tokens (text + visual), more than train.max_tokens_per_micro_batch=512"
        in message
    )


def test_skip_keeps_the_rest_in_order_and_counts_each_refusal_once_per_file_path():
    with bad_records.policy("skip") as ledger:
        kept = keep_trainable(_records(), _count, budget=512, what="conversation")
    assert [r["id"] for r in kept] == ["a/one.jsonl-1", "a/one.jsonl-3", "two.jsonl-1"]
    assert set(ledger.skipped) == {"a/one.jsonl:2 (id='a/one.jsonl-2')", "two.jsonl:2 (id='two.jsonl-2')"}
    assert ledger.metrics() == {"data/skipped_records": 2, "data/skipped/too_long": 2}


def test_a_file_with_no_record_left_is_an_error_even_under_skip():
    records = [r for r in _records() if r["file"] == "two.jsonl" and r["n"] > 100]
    with (
        bad_records.policy("skip"),
        pytest.raises(ValueError, match=r"every record of two.jsonl is too long to train on \(1 skipped"),
    ):
        keep_trainable(records, _count, budget=None, what="rl prompt", setting="max_length")


def test_without_a_budget_only_what_the_encoder_refuses_is_bad():
    with bad_records.policy("skip") as ledger:
        kept = keep_trainable(_records(), _count, budget=None, what="rl prompt", setting="max_length")
    assert len(kept) == 4 and len(ledger.skipped) == 1
