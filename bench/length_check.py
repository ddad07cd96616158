"""The length pass before step 1 (model/length_check.py) against reading the same records: LLaVA-like
conversations through datasets.load_conversations (the baseline: parsing and every record check), then each
record's tokens counted with the encoder's cheap upper bound (exact counts only where it exceeds the limit: what
the stages run), and counted exactly (the chat template rendered and tokenized for every record).

    python bench/length_check.py [--records 20000] [--model builtin:tiny-qwen2_5-vl]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from PIL import Image

from components._shared.data import datasets
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.length_check import conversation_tokens, keep_trainable
from components._shared.model.vlm import load_vlm
from components._shared.platform import bad_records

TURNS = [
    {"from": "human", "value": "<image>\nWhat is in the image? Answer in a few words."},
    {"from": "gpt", "value": "A purple triangle to the left of an orange cross, on a grey background."},
    {"from": "human", "value": "What colour is the shape on the right?"},
    {"from": "gpt", "value": "The cross on the right is orange."},
]
LIMIT = 2048  # train.max_tokens_per_micro_batch of the sft defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--model", default="builtin:tiny-qwen2_5-vl")
    args = parser.parse_args()
    model, processor, _ = load_vlm(args.model)
    encoder = ConversationEncoder(processor, model, min_pixels=200_704, max_pixels=1_003_520)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        Image.new("RGB", (640, 480)).save(root / "a.png")
        rows = [{"id": str(i), "image": "a.png", "conversations": TURNS} for i in range(args.records)]
        (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        started = time.perf_counter()
        records = datasets.load_conversations(root)
        read = time.perf_counter() - started
    timings = {"read (baseline)": read}
    exact = lambda r: encoder.count_tokens(r["turns"], r["image_sizes"], sample_id=r["id"])  # noqa: E731
    for name, count in (("length pass", conversation_tokens(encoder, LIMIT)), ("exact counts", exact)):
        started = time.perf_counter()
        with bad_records.policy("fail"):
            kept = keep_trainable(records, count, budget=LIMIT, what="conversation")
        timings[name] = time.perf_counter() - started
        assert len(kept) == len(records)
    print(f"{args.records} records, {args.model}, limit {LIMIT}")
    print("step               rec/s   time / read")
    for name, seconds in timings.items():
        print(f"{name:<16} {args.records / seconds:>7,.0f}   {seconds / read:>11.2f}")


if __name__ == "__main__":
    main()
