"""KFP wrapper of extract_features. All logic lives in components/extract_features/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def extract_features_op(
    clean_data: dsl.Input[dsl.Dataset],
    base_model_uri: str,
    config: dict,
    features: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
    content_key: str = "",
    experiment: str = "vlm",
):
    """Cache the frozen vision tower's pre-merger features of every kept image (safetensors shards + index).

    Args:
        clean_data: Output of clean_data (kept/part-*.parquet).
        base_model_uri: The model whose vision tower is used (local dir, s3:// prefix, builtin:NAME).
        config: ExtractFeaturesConfig as a dict.
        features: features-*.safetensors and index.json.
        metrics: Images, visual tokens and throughput, for the KFP UI.
        content_key: Preflight's digest of the content behind the URIs this stage reads; only in the cache key.
        experiment: MLflow experiment name.
    """
    from components._shared.launch.result import report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "extract_features",
        config,
        experiment=experiment,
        inputs={"clean_data": clean_data.path, "base_model": base_model_uri},
        output_dir=features.path,
        artifacts={"features": features.path},
        record_as="extract_features",
    )
    report_metrics(metrics, results)
