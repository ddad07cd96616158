"""KFP wrapper of pretrain. All logic lives in components/pretrain/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def pretrain_op(
    clean_data: dsl.Input[dsl.Dataset],
    features: dsl.Input[dsl.Dataset],
    base_model_uri: str,
    eval_data_uri: str,
    config: dict,
    model: dsl.Output[dsl.Model],
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    content_key: str = "",
    experiment: str = "vlm",
):
    """Align vision and language on image-caption pairs: merger on cached features, then optionally joint from pixels.

    Args:
        clean_data: Output of clean_data (kept/part-*.parquet: images and captions).
        features: Output of extract_features (cached pre-merger ViT features).
        base_model_uri: The model to start from (local dir, s3:// prefix, builtin:NAME).
        eval_data_uri: Held-out data (eval.jsonl or dataset.yaml's, with images) for caption loss and retrieval.
        config: PretrainConfig as a dict.
        model: model/ (HF format), checkpoints/, report.md.
        metrics: Held-out caption loss before/after, retrieval R@1, throughput.
        report: The stage report for the KFP UI.
        content_key: Preflight's digest of the content behind the URIs this stage reads; only in the cache key.
        experiment: MLflow experiment name.
    """
    import shutil

    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "pretrain",
        config,
        experiment=experiment,
        inputs={
            "clean_data": clean_data.path,
            "features": features.path,
            "base_model": base_model_uri,
            "data": eval_data_uri,
        },
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="pretrain",
    )
    report_metrics(metrics, results)
    shutil.copyfile(model.path + "/report.md", report.path)
