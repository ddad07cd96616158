"""KFP wrapper of promote. All logic lives in components/promote/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import DATA_IMAGE


@dsl.component(base_image=DATA_IMAGE, install_kfp_package=False)
def promote_op(
    champion: dsl.Input[dsl.Model],
    config: dict,
    model: dsl.Output[dsl.Model],
    report: dsl.Output[dsl.Markdown],
    experiment: str = "vlm",
):
    """Hand the champion to serving: merged safetensors in the serving dtype (never a LoRA adapter), registered in
    the Kubeflow Model Registry when configured, and a KServe InferenceService manifest (vLLM) beside it.

    Args:
        champion: Output of select_checkpoint (model/ = the winner in HF format, _stage_result.json = its selection).
        config: PromoteConfig as a dict.
        model: model/ (the promoted weights and processor), inferenceservice.yaml, promotion.json, report.md.
        report: The promotion report for the KFP UI.
        experiment: MLflow experiment name.
    """
    import shutil

    from components._shared.launch.result import model_dir
    from components._shared.launch.runner import run_stage

    run_stage(
        "promote",
        config,
        experiment=experiment,
        inputs={"champion": champion.path, "artifact_uri": model.uri},
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="promote",
    )
    shutil.copyfile(model.path + "/report.md", report.path)
