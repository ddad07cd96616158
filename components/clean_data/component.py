"""KFP wrappers of clean_data: list the lake's shards, clean each shard (fan-out), merge (fan-in).

All logic lives in components/clean_data/stage.py.
"""

from kfp import dsl

from components._shared.platform.container_images import DATA_IMAGE


@dsl.component(base_image=DATA_IMAGE, install_kfp_package=False)
def list_shards_op(lake_uri: str, content_key: str = "") -> list[dict]:
    """The lake's shards (img2dataset tars or Parquet files), sorted, as {"uri", "content"}: `content` digests the
    shard's bytes with `content_key` (preflight's digest of clean_data's models), for the shard task's cache key."""
    from components.clean_data.stage import shard_items

    return shard_items(lake_uri, content_key)


@dsl.component(base_image=DATA_IMAGE, install_kfp_package=False)
def clean_shard_op(
    shard_uri: str, config: dict, shard: dsl.Output[dsl.Dataset], content_key: str = "", experiment: str = "vlm"
):
    """Filter one shard: every record kept or rejected with one reason (kept.parquet, rejected.parquet).

    Args:
        shard_uri: One shard of the lake.
        config: CleanDataConfig as a dict.
        shard: This shard's kept/rejected records and shard_report.json.
        content_key: The shard's content digest (list_shards_op); only in the cache key.
        experiment: MLflow experiment name (the merge task logs for all shards).
    """
    from components._shared.launch.runner import run_stage

    run_stage(
        "clean_data",
        config,
        experiment=experiment,
        function="clean_shard",
        inputs={"shard_uri": shard_uri},
        output_dir=shard.path,
        record_as=None,
    )


@dsl.component(base_image=DATA_IMAGE, install_kfp_package=False)
def merge_shards_op(
    shards: dsl.Input[list[dsl.Dataset]],
    config: dict,
    clean_data: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    experiment: str = "vlm",
):
    """Cross-shard dedup and outliers, final Parquet shards keyed by image hash, manifest and report.

    Args:
        shards: The outputs of every clean_shard_op task.
        config: CleanDataConfig as a dict.
        clean_data: kept/ and rejected/ Parquet shards plus manifest.json (exact accounting).
        metrics: records_in / kept / rejected and rejections per reason, for the KFP UI.
        report: Counts per reason and score histograms.
        experiment: MLflow experiment name.
    """
    import shutil
    from pathlib import Path

    from components._shared.launch.result import report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "clean_data",
        config,
        experiment=experiment,
        function="merge_shards",
        inputs={"shard_dirs": [Path(s.path) for s in shards]},
        output_dir=clean_data.path,
        artifacts={"clean_data": clean_data.path, "report": report.path},
        record_as="clean_data",
    )
    shutil.copyfile(Path(clean_data.path) / "report.md", report.path)
    report_metrics(metrics, results)
