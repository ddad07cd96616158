"""KFP wrapper of select_checkpoint. All logic lives in components/select_checkpoint/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def select_checkpoint_op(
    clean_data: dsl.Input[dsl.Dataset],
    pretrain: dsl.Input[dsl.Model],
    sft: dsl.Input[dsl.Model],
    reward_model: dsl.Input[dsl.Model],
    rl: dsl.Input[dsl.Model],
    distill: dsl.Input[dsl.Model],
    eval_data_uri: str,
    config: dict,
    clean_data_config: dict,
    pretrain_config: dict,
    sft_config: dict,
    reward_model_config: dict,
    rl_config: dict,
    distill_config: dict,
    model: dsl.Output[dsl.Model],
    metrics: dsl.Output[dsl.Metrics],
    model_card: dsl.Output[dsl.Markdown],
    content_key: str = "",
    experiment: str = "vlm",
):
    """Evaluate the stage outputs (and kept checkpoints) on the held-out suite, select by score and gates, export
    the winner, register it in MLflow (alias champion, runner-up challenger), write the model card.

    Args:
        clean_data: Output of clean_data (its kept / rejected counts go into the model card's data lineage).
        pretrain: Output of pretrain (a candidate).
        sft: Output of sft (a candidate).
        reward_model: Output of reward_model (scores every candidate's answers).
        rl: Output of rl (a candidate).
        distill: Output of distill (a candidate).
        eval_data_uri: Held-out questions (eval.jsonl or dataset.yaml's eval files, with images); dir or s3://.
        config: SelectCheckpointConfig as a dict.
        clean_data_config: The clean_data section (quoted in the model card, as are the five below).
        pretrain_config: The pretrain section.
        sft_config: The sft section.
        reward_model_config: The reward_model section.
        rl_config: The rl section.
        distill_config: The distill section.
        model: model/ (the winner, HF format, with the model card as README.md), candidates.json.
        metrics: selected_candidate, selected_score, registered_model, registered_version, the winner's suite.
        model_card: The model card for the KFP UI.
        content_key: Preflight's digest of the content behind the URIs this stage reads; only in the cache key.
        experiment: MLflow experiment name.
    """
    import shutil

    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "select_checkpoint",
        config,
        experiment=experiment,
        inputs={
            "data": eval_data_uri,
            "pretrain": pretrain.path,
            "sft": sft.path,
            "rl": rl.path,
            "distill": distill.path,
            "reward_model": model_dir(reward_model.path),
            "clean_data": clean_data.path,
            "stage_configs": {
                "clean_data": clean_data_config,
                "pretrain": pretrain_config,
                "sft": sft_config,
                "reward_model": reward_model_config,
                "rl": rl_config,
                "distill": distill_config,
            },
        },
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="select_checkpoint",
    )
    report_metrics(metrics, results)
    shutil.copyfile(model.path + "/model_card.md", model_card.path)
