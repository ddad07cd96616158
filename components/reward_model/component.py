"""KFP wrapper of reward_model. All logic lives in components/reward_model/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def reward_model_op(
    base_model: dsl.Input[dsl.Model],
    preference_data_uri: str,
    config: dict,
    model: dsl.Output[dsl.Model],
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    content_key: str = "",
    experiment: str = "vlm",
):
    """Train a Bradley-Terry reward model (scalar head on the SFT backbone) on preference pairs.

    Args:
        base_model: Output of sft (its model/ directory initialises the backbone).
        preference_data_uri: preferences.jsonl with images; a directory or s3:// prefix.
        config: RewardModelConfig as a dict.
        model: model/ (backbone in HF format + reward_head.safetensors + reward_model.json), checkpoints/.
        metrics: Held-out pair accuracy overall and per rejection kind, reward statistics.
        report: The stage report for the KFP UI.
        content_key: Preflight's digest of the content behind the URIs this stage reads; only in the cache key.
        experiment: MLflow experiment name.
    """
    import shutil

    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "reward_model",
        config,
        experiment=experiment,
        inputs={"base_model": model_dir(base_model.path), "data": preference_data_uri},
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="reward_model",
    )
    report_metrics(metrics, results)
    shutil.copyfile(model.path + "/report.md", report.path)
