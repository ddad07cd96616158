"""clean_data: drop bad image-caption pairs from a lake; every record is kept or rejected with one reason.

1 process:        python -m components.clean_data --config pipelines/presets/tiny.yaml --lake-uri DIR/lake \
                      --output-dir OUT
In the pipeline:  list_shards_op -> clean_shard_op per shard (ParallelFor) -> merge_shards_op (fan-in),
                  the same three functions `run` calls in one process.

Per shard (shard.py; cheapest first): reader problems (unsafe_member, file_too_large, missing_image/caption,
duplicate_key/member, shard_error), caption checks, safe decode, size/aspect, exact and near dedup, then the model
levels on what is left: CLIP score, NSFW, OCR text the caption never mentions (docs/stages/clean_data.md). The merge
(merge.py) names the shards apart (shard_names), repeats exact/near dedup across shards (the smallest key wins),
drops kNN outliers in CLIP image space and, if a judge model is set, the worst fraction by its caption loss; then
writes kept/ and rejected/ Parquet parts, manifest.json and report.md.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from components._shared.platform.tracking import Tracker
from components.clean_data.config import CleanDataConfig
from components.clean_data.merge import merge_shards
from components.clean_data.shard import clean_shard

logger = logging.getLogger(__name__)

__all__ = ["clean_shard", "list_shards", "main", "merge_shards", "run"]  # the functions the components call


def list_shards(lake_uri: str) -> list[str]:
    """The lake's shard URIs (`*.tar`, `*.tar.gz`, `*.tgz`, `*.parquet`, subfolders included), local or s3://, sorted.

    Other files in the lake (img2dataset's `*_stats.json`, stray files) are not read; a warning names how many and
    the first few, so none is skipped silently.
    """
    from components._shared.data.lake import LAKE_SHARD_SUFFIXES, list_lake_files, list_lake_shards

    shards, others = list_lake_files(str(lake_uri))
    if not shards:
        return list_lake_shards(str(lake_uri))  # raises: no shard, naming the lake and the fix
    if others:
        shown = ", ".join(others[:5]) + (f", ... ({len(others) - 5} more)" if len(others) > 5 else "")
        logger.warning(
            "lake_uri=%s: %d file(s) are not shards and are not read: %s (shards end in %s; move other files out of "
            "the lake to silence this)",
            lake_uri,
            len(others),
            shown,
            " ".join(LAKE_SHARD_SUFFIXES),
        )
    return shards


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
