"""Before clean_data: a lake that pretrain's region term would find no box in is refused at preflight.

pretrain refuses it too (components/pretrain/regions.py), but only after clean_data and extract_features have run;
here the first records of its shards are read in order (the lake's own reader, images left undecoded) until one
carries a usable box, their GRIT-style `noun_chunks` checked as pretrain will check them.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

from components._shared.data.lake import list_lake_shards, read_shard
from components._shared.data.regions import record_regions

SAMPLE_RECORDS = 256
SAMPLE_SHARDS = 16
MAX_MEMBER_BYTES = 64 * 2**20  # what one sampled record may hold; larger members are the reader's reject


def check_lake_regions(lake_uri: str, min_score: float) -> int:
    """The number of usable region boxes found sampling the lake's shards in order (at most SAMPLE_RECORDS readable
    records from at most SAMPLE_SHARDS shards, stopping at the first box: an empty or unreadable shard is passed
    over); a ValueError naming the shards read and the reasons when the sample holds records but no box."""
    read, used, shards = 0, 0, []
    reasons: Counter[str] = Counter()
    for shard in list_lake_shards(lake_uri)[:SAMPLE_SHARDS]:
        shards.append(shard.rsplit("/", 1)[-1])
        for record in read_shard(shard, max_member_bytes=MAX_MEMBER_BYTES, errors=[]):
            if record.reject is not None or record.caption is None:
                continue
            caption = record.caption.decode("utf-8", errors="replace")
            regions, dropped = record_regions({"caption": caption, "metadata": json.dumps(record.metadata)}, min_score)
            used += len(regions)
            reasons.update(dropped)
            read += 1
            if used or read >= SAMPLE_RECORDS:
                break
        if used or read >= SAMPLE_RECORDS:
            break
    if not read:
        print(
            f"warning: pretrain.region.enabled: no readable record in the first {len(shards)} shard(s) of {lake_uri} "
            "to check for region boxes; clean_data will say what is wrong with them.",
            file=sys.stderr,
        )
    elif not used:
        said = "; ".join(f"{count} chunk(s) {reason}" for reason, count in sorted(reasons.items()))
        raise ValueError(
            f"pretrain.region.enabled, but none of the first {read} records of the lake ({', '.join(shards)}) has a "
            f"usable box ({said or 'none carries noun_chunks'}): give the lake records GRIT-style noun_chunks "
            "([start, end, x1, y1, x2, y2, score] per caption phrase, boxes relative to the image) in their JSON, or "
            "set pretrain.region.enabled: false."
        )
    return used
