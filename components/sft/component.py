"""KFP wrapper of sft. All logic lives in components/sft/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def sft_op(
    base_model: dsl.Input[dsl.Model],
    sft_data_uri: str,
    config: dict,
    model: dsl.Output[dsl.Model],
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    content_key: str = "",
    experiment: str = "vlm",
):
    """Instruction-tune the pretrained VLM (LoRA / QLoRA / full), evaluate held-out VQA, calibrate.

    Args:
        base_model: Output of pretrain (its model/ directory is the base).
        sft_data_uri: Conversations and held-out questions (sft.jsonl / eval.jsonl or dataset.yaml); dir or s3://.
        config: SftConfig as a dict.
        model: model/ (merged, HF format), adapter/, checkpoints/, eval_predictions.jsonl, calibration.json.
        metrics: VQA exact match per type vs the majority baseline, padding efficiency, ECE before/after.
        report: The stage report for the KFP UI.
        content_key: Preflight's digest of the content behind the URIs this stage reads; only in the cache key.
        experiment: MLflow experiment name.
    """
    import shutil

    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "sft",
        config,
        experiment=experiment,
        inputs={"base_model": model_dir(base_model.path), "data": sft_data_uri},
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="sft",
    )
    report_metrics(metrics, results)
    shutil.copyfile(model.path + "/report.md", report.path)
