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
    built_data: dsl.Input[dsl.Dataset] | None = None,
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
        built_data: Output of the sft_data step (sft.build_data.enabled): trained on instead of sft_data_uri.
    """
    import shutil

    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    data = built_data.path if built_data is not None else sft_data_uri
    results = run_stage(
        "sft",
        config,
        experiment=experiment,
        inputs={"base_model": model_dir(base_model.path), "data": data},
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="sft",
    )
    report_metrics(metrics, results)
    shutil.copyfile(model.path + "/report.md", report.path)


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def sft_data_op(
    clean_data: dsl.Input[dsl.Dataset],
    base_model: dsl.Input[dsl.Model],
    sft_data_uri: str,
    config: dict,
    sft_data: dsl.Output[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
    content_key: str = "",
    experiment: str = "vlm",
):
    """Build SFT conversations from the cleaned lake, scored by the pretrained model (sft.build_data; the step runs
    when sft.build_data.enabled).

    Args:
        clean_data: Output of clean_data (its kept records and images are what the questions ask about).
        base_model: Output of pretrain (its model/ scores each candidate's answer).
        sft_data_uri: The data directory whose held-out questions (eval.jsonl) the built directory keeps.
        config: SftConfig as a dict (its build_data section acts here).
        sft_data: sft.jsonl (built), eval.jsonl, built_images/, build_accounting.json, built_dropped.jsonl.
        metrics: Candidates, kept, dropped by reason, kept per question type.
        content_key: Preflight's digest of the content behind the URIs this step reads; only in the cache key.
        experiment: MLflow experiment name.
    """
    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "sft_data",
        config,
        experiment=experiment,
        inputs={"clean_data": clean_data.path, "base_model": model_dir(base_model.path), "data": sft_data_uri},
        output_dir=sft_data.path,
        record_as="sft_data",
    )
    report_metrics(metrics, results)
