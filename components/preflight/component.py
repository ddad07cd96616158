"""KFP wrapper of the preflight checks. Logic lives in components/preflight/stage.py."""

from typing import NamedTuple

from kfp import dsl

from components._shared.platform.container_images import DATA_IMAGE


@dsl.component(base_image=DATA_IMAGE, install_kfp_package=False)
def preflight_op(
    lake_uri: str,
    base_model_uri: str,
    config: dict,
    clean_data_config: dict,
    extract_features_config: dict,
    pretrain_config: dict,
    sft_config: dict,
    reward_model_config: dict,
    rl_config: dict,
    distill_config: dict,
    select_checkpoint_config: dict,
    report: dsl.Output[dsl.Artifact],
    eval_data_uri: str = "",
    sft_data_uri: str = "",
    preference_data_uri: str = "",
    rl_data_uri: str = "",
    needs_eval_data: bool = False,
    needs_sft_data: bool = False,
    needs_preference_data: bool = False,
    needs_rl_data: bool = False,
    gpu_profiles: dict = {},  # noqa: B006 - KFP reads the default from the signature; never mutated
    experiment: str = "vlm",
) -> NamedTuple(  # type: ignore[valid-type]  # KFP's form for several output parameters
    "ContentKeys",
    [
        ("clean_data", str),
        ("extract_features", str),
        ("pretrain", str),
        ("sft", str),
        ("reward_model", str),
        ("rl", str),
        ("distill", str),
        ("select_checkpoint", str),
    ],
):
    """Validate every stage config, reach the lake / MLflow / S3, resolve the models. Never cached. Returns, per
    stage, a digest of the content behind the URIs it reads (stage.py: content_keys), which its task takes as an
    input so that KFP's cache key changes with that content.

    Args:
        lake_uri: Lake directory or s3:// prefix (img2dataset tars or Parquet).
        base_model_uri: Base model (local dir, s3:// prefix, or builtin:NAME).
        config: PreflightConfig as a dict.
        clean_data_config: The clean_data section, validated here before any work starts.
        extract_features_config: The extract_features section, validated here too.
        pretrain_config: The pretrain section.
        sft_config: The sft section.
        reward_model_config: The reward_model section.
        rl_config: The rl section.
        distill_config: The distill section.
        select_checkpoint_config: The select_checkpoint section.
        eval_data_uri: Held-out data (must hold eval.jsonl, or its dataset.yaml's files).
        sft_data_uri: SFT data (must hold sft.jsonl and eval.jsonl, or its dataset.yaml's files).
        needs_eval_data: Whether this DAG runs pretrain (then eval_data_uri must be set).
        needs_sft_data: Whether this DAG runs sft (then sft_data_uri must be set).
        preference_data_uri: Preference pairs (must hold preferences.jsonl).
        needs_preference_data: Whether this DAG runs reward_model (then preference_data_uri must be set).
        rl_data_uri: RL prompts (must hold its dataset.yaml's files, or the rl section's prompts_file / eval.files).
        needs_rl_data: Whether this DAG runs rl (then rl_data_uri must be set).
        gpu_profiles: The pods of this DAG's training stages (stage -> gpus, nodes, accelerator_type; empty on one
            machine): each stage is planned on its pod's GPUs and one that cannot fit stops the run here.
        report: preflight.json with what was checked and where the models resolved to.
        experiment: MLflow experiment name.
    """
    import json
    from collections import namedtuple

    from components._shared.launch.runner import run_stage
    from components.preflight.stage import data_requirements, model_uris_in

    stage_configs = {
        "clean_data": clean_data_config,
        "extract_features": extract_features_config,
        "pretrain": pretrain_config,
        "sft": sft_config,
        "reward_model": reward_model_config,
        "rl": rl_config,
        "distill": distill_config,
        "select_checkpoint": select_checkpoint_config,
    }
    data_files = data_requirements(
        {
            "eval_data_uri": (eval_data_uri, needs_eval_data),
            "sft_data_uri": (sft_data_uri, needs_sft_data),
            "preference_data_uri": (preference_data_uri, needs_preference_data),
            "rl_data_uri": (rl_data_uri, needs_rl_data),
        },
        rl_config,
        sft_config,
    )
    run_stage(
        "preflight",
        config,
        experiment=experiment,
        inputs={
            "lake_uri": lake_uri,
            "model_uris": [base_model_uri, *model_uris_in(stage_configs)],
            "stage_configs": stage_configs,
            "data_files": data_files,
            "gpu_profiles": gpu_profiles,
            "uris": {
                "base_model_uri": base_model_uri,
                "eval_data_uri": eval_data_uri,
                "sft_data_uri": sft_data_uri,
                "preference_data_uri": preference_data_uri,
                "rl_data_uri": rl_data_uri,
            },
        },
        output_dir=report.path,
        record_as="preflight",
    )
    keys = json.loads(open(report.path + "/preflight.json").read())["content_keys"]
    return namedtuple("ContentKeys", list(keys))(**keys)


@dsl.component(base_image=DATA_IMAGE, install_kfp_package=False)
def finish_pipeline_run_op(status: dsl.PipelineTaskFinalStatus, experiment: str = "vlm"):
    """The pipeline's exit task: end its MLflow parent run with the DAG's final state (cluster runs; a local run's
    parent is ended by `qvl run --local`, and KFP's own MLflow integration ends the parents it creates).

    Args:
        status: The final state of the DAG's tasks (KFP fills it in).
        experiment: MLflow experiment name.
    """
    from components._shared.platform.mlflow_runs import finish_kfp_pipeline_run

    print(finish_kfp_pipeline_run(status.state, experiment=experiment), flush=True)
