"""Records too long to train on, found before the first step instead of at the step that draws them.

A record longer than the stage's `max_length`, or a unit (a conversation, a preference pair) longer than
`train.max_tokens_per_micro_batch`, cannot be trained: the encoder or the micro-batch planner refuses it when a
step draws it, after hours of training, and `on_bad_record: skip` could not skip it there. So each stage counts
every record's tokens once after reading its data: the chat template's text tokens plus each image's visual tokens
from the size its header gave (`image_sizes`, read by the image checks; no image is decoded). Such records are bad
records like the readers' own: listed in one error naming file, line and id (`on_bad_record: fail`), or dropped
and counted (`skip`).

    budget = cfg.train.max_tokens_per_micro_batch
    records = keep_trainable(records, conversation_tokens(encoder, budget), budget=budget, what="conversation")
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from components._shared.platform import bad_records
from components._shared.platform.credential_shapes import shown

BUDGET_SETTING = "train.max_tokens_per_micro_batch"


def conversation_tokens(encoder, limit: int) -> Callable[[dict], int]:
    """record -> the tokens of a conversation record (its turns and its images' header sizes), counted exactly only
    where the encoder's cheap upper bound exceeds `limit` (the bound, at most `limit`, otherwise: such a record
    fits); a LLaVA-scale file is then read at about the readers' own speed (bench/length_check.py)."""

    def count(r: dict) -> int:
        bound = encoder.token_bound(r["turns"], r["image_sizes"])
        if bound <= min(limit, encoder.max_length):
            return bound
        return encoder.count_tokens(r["turns"], r["image_sizes"], sample_id=r["id"])

    return count


def keep_trainable(
    records: list[dict], count: Callable[[dict], int], *, budget: int | None, what: str, setting: str = BUDGET_SETTING
) -> list[dict]:
    """The records whose `count(record)` (a ValueError: the encoder refuses it) fits `budget` (None: no budget),
    in order; the others are settled by the open bad-record policy per file. `what` names the records
    ("conversation"), `setting` the budget's setting."""
    kept: list[dict] = []
    bad: dict[str, list[tuple[str, str]]] = defaultdict(list)  # file -> (source, reason)
    kept_per_file: dict[str, int] = defaultdict(int)
    for record in records:
        try:
            tokens = count(record)
            if budget is not None and tokens > budget:
                raise ValueError(
                    f"{tokens} tokens (text + visual), more than {setting}={budget}; raise it, or lower max_pixels "
                    "or shorten the record"
                )
        except ValueError as error:
            source = f"{record.get('source', '?')} (id={record.get('id')!r})"
            bad[record.get("file", "?")].append((source, shown(str(error).rstrip("."), 400)))
            continue
        kept.append(record)
        kept_per_file[record.get("file", "?")] += 1
    for path, refused in bad.items():
        bad_records.settle(
            path,
            refused,
            kept=kept_per_file[path],
            what=f"{what} record(s) too long to train on",
            state="too long to train on",
        )
    return kept
