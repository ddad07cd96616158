"""LLaVA-scale SFT files: records per second read from one JSON array (`.json`, LLaVA's release form) against the
same records as JSON Lines (`.jsonl`, the baseline), through the stages' own reader (datasets.load_conversations:
parsing, every record's fields checked, its image path resolved).

    python bench/json_arrays.py [--records 200000 50000]

The array reader walks the array item by item with the line of each record kept up as it goes; until 2026-12-05 it
recounted the lines from the start for every record, quadratic in the file (40k records 72 s, their JSON Lines 0.4 s).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from PIL import Image

from components._shared.data import datasets

RECORD = {
    "image": "a.png",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the image? Answer in a few words."},
        {"from": "gpt", "value": "a purple triangle to the left of an orange cross"},
    ],
}


def measure(records: int, kind: str) -> float:
    """Seconds to read `records` LLaVA records from one file of `kind` ("json" array or "jsonl")."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        Image.new("RGB", (32, 32)).save(root / "a.png")
        rows = [{"id": str(i), **RECORD} for i in range(records)]
        body = json.dumps(rows) if kind == "json" else "".join(json.dumps(r) + "\n" for r in rows)
        (root / f"sft.{kind}").write_text(body)
        (root / "dataset.yaml").write_text(f"sft: [sft.{kind}]\n")
        started = time.perf_counter()
        read = len(datasets.load_conversations(root))
        seconds = time.perf_counter() - started
    assert read == records, f"read {read} of {records}"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[200_000, 50_000])
    args = parser.parse_args()
    print("records  jsonl rec/s  array rec/s  array / jsonl time")
    for n in args.records:
        lines, array = measure(n, "jsonl"), measure(n, "json")
        print(f"{n:>7}  {n / lines:>11,.0f}  {n / array:>11,.0f}  {array / lines:>18.2f}")


if __name__ == "__main__":
    main()
