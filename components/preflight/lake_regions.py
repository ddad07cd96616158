"""Before clean_data: a lake that pretrain's region term would find no box in is refused at preflight.

pretrain refuses it too (components/pretrain/regions.py), but only after clean_data and extract_features have run;
here the first shard's first records are read (the lake's own reader, images left undecoded) and their GRIT-style
`noun_chunks` checked as pretrain will check them.
"""

from __future__ import annotations

import json
from collections import Counter

from components._shared.data.lake import ShardError, list_lake_shards, read_shard
from components._shared.data.regions import record_regions

SAMPLE_RECORDS = 256
MAX_MEMBER_BYTES = 64 * 2**20  # what one sampled record may hold; larger members are the reader's reject


def check_lake_regions(lake_uri: str, min_score: float) -> int:
    """The number of usable region boxes among the first SAMPLE_RECORDS records of the lake's first shard; a
    ValueError naming the shard and the reasons when there is none."""
    shard = list_lake_shards(lake_uri)[0]
    errors: list[ShardError] = []
    read, used = 0, 0
    reasons: Counter[str] = Counter()
    for record in read_shard(shard, max_member_bytes=MAX_MEMBER_BYTES, errors=errors):
        if record.reject is not None or record.caption is None:
            continue
        caption = record.caption.decode("utf-8", errors="replace")
        regions, dropped = record_regions({"caption": caption, "metadata": json.dumps(record.metadata)}, min_score)
        used += len(regions)
        reasons.update(dropped)
        read += 1
        if read >= SAMPLE_RECORDS:
            break
    if read and not used:
        said = "; ".join(f"{count} chunk(s) {reason}" for reason, count in sorted(reasons.items()))
        raise ValueError(
            f"pretrain.region.enabled, but none of the first {read} records of {shard} has a usable box "
            f"({said or 'none carries noun_chunks'}): give the lake records GRIT-style noun_chunks ([start, end, x1, "
            "y1, x2, y2, score] per caption phrase, boxes relative to the image) in their JSON, or set "
            "pretrain.region.enabled: false."
        )
    return used
