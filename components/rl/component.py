"""KFP wrapper of rl. All logic lives in components/rl/stage.py."""

from kfp import dsl

from components._shared.platform.container_images import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def rl_op(
    base_model: dsl.Input[dsl.Model],
    reward_model: dsl.Input[dsl.Model],
    rl_data_uri: str,
    config: dict,
    model: dsl.Output[dsl.Model],
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    content_key: str = "",
    experiment: str = "vlm",
):
    """Optimise the SFT policy with PPO, TER or GRPO (config `algorithm`), guarded by reward-hacking gates.

    Args:
        base_model: Output of sft (its model/ directory is the initial policy and the frozen reference).
        reward_model: Output of reward_model (used when config.rewards gives reward_model a weight).
        rl_data_uri: Prompts and held-out questions (dataset.yaml's rl / eval files, else sft.jsonl / eval.jsonl;
            docs/data.md); a directory or s3:// prefix.
        config: RlConfig as a dict.
        model: model/ (the policy, HF format), value_head.safetensors (PPO), rollouts.jsonl, eval_predictions.jsonl.
        metrics: algorithm, efficacy_before/after, mean_length_ratio, kl_final, the per-phase timing split.
        report: The stage report for the KFP UI.
        content_key: Preflight's digest of the content behind the URIs this stage reads; only in the cache key.
        experiment: MLflow experiment name.
    """
    import shutil

    from components._shared.launch.result import model_dir, report_metrics
    from components._shared.launch.runner import run_stage

    results = run_stage(
        "rl",
        config,
        experiment=experiment,
        inputs={
            "base_model": model_dir(base_model.path),
            "reward_model": model_dir(reward_model.path),
            "data": rl_data_uri,
        },
        output_dir=model.path,
        artifacts={"model": model_dir(model.path)},
        record_as="rl",
    )
    report_metrics(metrics, results)
    shutil.copyfile(model.path + "/report.md", report.path)
