"""clean_data: drop bad image-caption pairs from a lake; every record is kept or rejected with one reason.

1 process:        python -m components.clean_data --config pipelines/presets/tiny.yaml --lake-uri DIR/lake \
                      --output-dir OUT
In the pipeline:  list_shards_op -> clean_shard_op per shard (ParallelFor) -> merge_shards_op (fan-in),
                  the same three functions `run` calls in one process.

Per shard (shard.py; cheapest first): reader problems (unsafe_member, file_too_large, missing_image/caption,
shard_error), caption checks, safe decode, size/aspect, exact and near dedup, then the model levels on what is
left: CLIP score, NSFW, OCR text the caption never mentions (docs/stages/clean_data.md). The merge (merge.py)
repeats exact/near dedup across shards (the smallest key wins), drops kNN outliers in CLIP image space and, if a
judge model is set, the worst fraction by its caption loss; then writes kept/ and rejected/ Parquet parts,
manifest.json and report.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from components._shared.platform.tracking import Tracker
from components.clean_data.config import CleanDataConfig
from components.clean_data.merge import merge_shards
from components.clean_data.shard import clean_shard

__all__ = ["clean_shard", "list_shards", "main", "merge_shards", "run"]  # the functions the components call


def list_shards(lake_uri: str) -> list[str]:
    """The lake's shard URIs (`*.tar`, `*.parquet`), local or s3://, sorted."""
    from components._shared.platform.storage import list_lake_shards

    return list_lake_shards(str(lake_uri))


def shard_items(lake_uri: str, content_key: str = "") -> list[dict[str, str]]:
    """The lake's shards as {"uri", "content"}: `content` digests the shard's bytes (local: sha256; s3://: size and
    ETag) with `content_key` (preflight's digest of the models clean_data's config names). Each shard task takes it
    as an input, so KFP's cache re-cleans exactly the shards whose content (or whose cleaning models) changed."""
    import hashlib

    from components._shared.platform import storage

    uris = list_shards(lake_uri)
    etags = storage.list_etags(lake_uri) if storage.is_s3(lake_uri) and uris else {}
    prefix = str(lake_uri).rstrip("/") + "/"
    items = []
    for uri in uris:
        identity = etags.get(uri[len(prefix) :], "") if etags else storage.sha256_file(Path(uri))
        digest = hashlib.sha256(f"{content_key}\n{identity}".encode()).hexdigest()[:16]
        items.append({"uri": uri, "content": digest})
    return items


def run(cfg: CleanDataConfig, *, lake_uri: str, output_dir: Path, tracker: Tracker) -> dict[str, Any]:
    """list_shards -> clean_shard for each -> merge_shards, in one process (models load once)."""
    output_dir = Path(output_dir)
    work = output_dir / "_shards"
    shutil.rmtree(work, ignore_errors=True)
    shard_dirs = []
    for number, uri in enumerate(list_shards(str(lake_uri))):
        shard_dir = work / f"{number:05d}"
        clean_shard(cfg, shard_uri=uri, output_dir=shard_dir, tracker=tracker)
        shard_dirs.append(shard_dir)
    metrics = merge_shards(cfg, shard_dirs=shard_dirs, output_dir=output_dir, tracker=tracker)
    shutil.rmtree(work)
    return metrics


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(CleanDataConfig, run, section="clean_data", inputs=("lake_uri",), argv=argv)
