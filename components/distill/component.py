"""KFP wrapper of distill. All logic lives in components/distill/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def distill_op(
    teacher_model: dsl.Input[dsl.Model],
    sft_data_uri: str,
    config: dict,
    model: dsl.Output[dsl.Model],
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    content_key: str = "",
    experiment: str = "vlm",
    built_data: dsl.Input[dsl.Dataset] | None = None,
):
    """Distill the RL policy into a smaller student (pruned from the teacher, random, or a given checkpoint).

    Args:
        teacher_model: Output of rl (its model/ directory is the frozen teacher).
        sft_data_uri: Conversations to distill on and held-out questions (sft.jsonl / eval.jsonl or dataset.yaml).
        config: DistillConfig as a dict.
        model: model/ (the student, HF format), student.json, checkpoints/, eval_predictions.jsonl.
        metrics: student_score_ratio, student_param_ratio, teacher and student held-out suites, speedup.
        report: The stage report for the KFP UI.
        content_key: Preflight's digest of the content behind the URIs this stage reads; only in the cache key.
        experiment: MLflow experiment name.
        built_data: Output of the sft_data step (sft.build_data.enabled): distilled on instead of sft_data_uri.
    """
    import shutil

    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    data = built_data.path if built_data is not None else sft_data_uri
    results = run_stage(
        "distill",
        config,
        experiment=experiment,
        inputs={"teacher_model": model_dir(teacher_model.path), "data": data},
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="distill",
    )
    report_metrics(metrics, results)
    shutil.copyfile(model.path + "/report.md", report.path)
