"""clean_data's kept records (its `kept/part-*.parquet` files), read by pretrain and by sft's data builder."""

from __future__ import annotations

from pathlib import Path

from components._shared.platform.shards import tar_shards


def load_kept(
    clean_data: Path, max_records: int | None, *, with_images: bool = True, with_metadata: bool = False
) -> list[dict]:
    """clean_data's kept records: image_hash, caption and, only when needed, the image bytes and the metadata."""
    import pyarrow.parquet as pq

    parts = sorted((clean_data / "kept").glob("part-*.parquet"))
    if not parts:
        shards = tar_shards(clean_data)[:3]
        raw = f" it holds {shards}, a raw lake's shards: run clean_data on it first;" if shards else ""
        raise ValueError(
            f"{clean_data}/kept has no part-*.parquet files;{raw} point --clean-data at clean_data's output (the "
            "directory holding kept/)."
        )
    columns = ["image_hash", "caption"] + (["image"] if with_images else []) + (["metadata"] if with_metadata else [])
    rows: list[dict] = []
    for part in parts:
        names = pq.ParquetFile(part).schema_arrow.names  # with the metadata, where it came from: its lake key, shard
        found = [c for c in ("key", "shard") if with_metadata and c in names]
        table = pq.read_table(part, columns=columns + found).to_pylist()
        rows += [r for r in table if r["caption"]]
        if max_records and len(rows) >= max_records:
            return rows[:max_records]
    return rows


def kept_count(clean_data: Path) -> int:
    """How many records clean_data kept, captions empty or not (the Parquet footers' row counts)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(part).metadata.num_rows for part in sorted((clean_data / "kept").glob("part-*.parquet")))
