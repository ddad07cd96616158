"""The VLM training DAG: preflight -> clean_data (fan-out over shards, merge) -> extract_features -> pretrain
(-> sft_data, when sft.build_data.enabled) -> sft -> reward_model -> rl -> distill -> select_checkpoint (-> promote,
when the preset enables it).

`build_pipeline(preset, until, for_cluster)` returns the pipeline function with the preset's configs as parameter
defaults and, for a cluster, each task's Kubernetes settings from the preset's cluster profile (pipelines/k8s.py);
`vlm_training` is the full DAG on the `prod-7b` preset, the one that is compiled and committed.
"""

from contextlib import nullcontext

from kfp import dsl

from components.clean_data.component import clean_shard_op, list_shards_op, merge_shards_op
from components.distill.component import distill_op
from components.extract_features.component import extract_features_op
from components.preflight.component import finish_pipeline_run_op, preflight_op
from components.pretrain.component import pretrain_op
from components.promote.component import promote_op
from components.reward_model.component import reward_model_op
from components.rl.component import rl_op
from components.select_checkpoint.component import select_checkpoint_op
from components.sft.component import sft_data_op, sft_op
from components.stages import dag_stages
from pipelines import credentials
from pipelines.k8s import apply_local_launch, apply_profile, apply_task_policy
from pipelines.presets import Preset, as_preset

PIPELINE_NAME = "vlm-training"
DEFAULT_PRESET = "prod-7b"


def build_pipeline(
    preset: Preset | str = DEFAULT_PRESET,
    until: str | None = None,
    for_cluster: bool = True,
    local_processes: dict[str, int] | None = None,
):
    """The pipeline function for `preset` (a loaded Preset, or a name or path read here), with the stages up to and
    including `until` (all when None).

    `for_cluster=False` (kfp.local) leaves the cluster profile out: pod settings mean nothing on one machine,
    and its environment variables (cache on the scratch PVC, launch plans) would mislead the local tasks. A cluster
    build also gets the run-level TTL / deadline and an exit task that ends the run's MLflow parent run with the
    DAG's final state (locally, `qvl run --local` owns the parent run). `local_processes` (kfp.local only) runs
    those stages under torchrun with that many processes, as a pod with several GPUs does (`qvl rehearse --preset`).
    """
    p = as_preset(preset)
    credentials.check(p.model_dump(mode="json"), f"preset '{p.name}'")  # its settings become YAML defaults
    wanted = set(dag_stages(p.stages, until))
    cluster = p.cluster_profile()

    def on_cluster(task: dsl.PipelineTask, stage: str) -> dsl.PipelineTask:
        if for_cluster:
            return apply_profile(task, stage, cluster)
        local = apply_task_policy(task, stage, cluster, retries=False)
        return apply_local_launch(local, stage, (local_processes or {}).get(stage))

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description=__doc__.splitlines()[0],
        pipeline_config=cluster.pipeline_config() if for_cluster else None,
    )
    def vlm_training(
        lake_uri: str,
        eval_data_uri: str = "",
        sft_data_uri: str = "",
        preference_data_uri: str = "",
        rl_data_uri: str = "",
        base_model_uri: str = p.base_model_uri,
        experiment: str = p.experiment,
        preflight_config: dict = p.stages["preflight"],
        clean_data_config: dict = p.stages["clean_data"],
        extract_features_config: dict = p.stages["extract_features"],
        pretrain_config: dict = p.stages["pretrain"],
        sft_config: dict = p.stages["sft"],
        reward_model_config: dict = p.stages["reward_model"],
        rl_config: dict = p.stages["rl"],
        distill_config: dict = p.stages["distill"],
        select_checkpoint_config: dict = p.stages["select_checkpoint"],
        promote_config: dict = p.stages["promote"],
    ):
        finish = finish_pipeline_run_op(experiment=experiment) if for_cluster else None
        if finish is not None:
            on_cluster(finish, "preflight").set_display_name("Finish the MLflow run").set_caching_options(False)
        with dsl.ExitHandler(finish, name="stages") if finish is not None else nullcontext():
            preflight = on_cluster(
                preflight_op(
                    lake_uri=lake_uri,
                    base_model_uri=base_model_uri,
                    config=preflight_config,
                    clean_data_config=clean_data_config,
                    extract_features_config=extract_features_config,
                    pretrain_config=pretrain_config,
                    sft_config=sft_config,
                    reward_model_config=reward_model_config,
                    rl_config=rl_config,
                    distill_config=distill_config,
                    select_checkpoint_config=select_checkpoint_config,
                    eval_data_uri=eval_data_uri,
                    sft_data_uri=sft_data_uri,
                    preference_data_uri=preference_data_uri,
                    rl_data_uri=rl_data_uri,
                    # select_checkpoint reads it too, and runs only after pretrain
                    needs_eval_data="pretrain" in wanted,
                    needs_sft_data=bool({"sft", "sft_data"} & wanted),  # distill reads it too, and runs only after sft
                    needs_preference_data="reward_model" in wanted,
                    needs_rl_data="rl" in wanted,
                    gpu_profiles=cluster.gpu_profiles(wanted) if for_cluster else {},
                    experiment=experiment,
                ),
                "preflight",
            )
            preflight.set_display_name("Preflight checks").set_caching_options(False)  # checks the world as it is now

            shards = on_cluster(
                list_shards_op(lake_uri=lake_uri, content_key=preflight.outputs["clean_data"]), "preflight"
            )
            shards.set_display_name("List lake shards").set_caching_options(False).after(preflight)
            with dsl.ParallelFor(shards.output, parallelism=16) as shard:
                clean_shard = on_cluster(
                    clean_shard_op(
                        shard_uri=shard.uri,
                        config=clean_data_config,
                        content_key=shard.content,  # the shard's bytes: KFP re-cleans what changed
                        experiment=experiment,
                    ),
                    "clean_data",
                )
                clean_shard.set_display_name("Clean shard")
            clean = on_cluster(
                merge_shards_op(
                    shards=dsl.Collected(clean_shard.outputs["shard"]),
                    config=clean_data_config,
                    experiment=experiment,
                ),
                "clean_data",
            )
            clean.set_display_name("Clean data: merge shards")

            if "extract_features" in wanted:
                features = on_cluster(
                    extract_features_op(
                        clean_data=clean.outputs["clean_data"],
                        base_model_uri=base_model_uri,
                        config=extract_features_config,
                        content_key=preflight.outputs["extract_features"],
                        experiment=experiment,
                    ),
                    "extract_features",
                )
                features.set_display_name("Extract vision features")

            if "pretrain" in wanted:
                # Retries resume from the newest committed checkpoint under train.checkpoint_uri (prod-7b: on S3; a
                # failed task's own output artifact is never uploaded).
                pretrain = on_cluster(
                    pretrain_op(
                        clean_data=clean.outputs["clean_data"],
                        features=features.outputs["features"],
                        base_model_uri=base_model_uri,
                        eval_data_uri=eval_data_uri,
                        config=pretrain_config,
                        content_key=preflight.outputs["pretrain"],
                        experiment=experiment,
                    ),
                    "pretrain",
                )
                pretrain.set_display_name("Pretrain (alignment)")

            built: dict = {}  # sft and distill train on the sft_data step's output when it runs
            if "sft_data" in wanted:
                sft_data = on_cluster(
                    sft_data_op(
                        clean_data=clean.outputs["clean_data"],
                        base_model=pretrain.outputs["model"],
                        sft_data_uri=sft_data_uri,
                        config=sft_config,
                        content_key=preflight.outputs["sft"],
                        experiment=experiment,
                    ),
                    "sft_data",
                )
                sft_data.set_display_name("Build SFT data")
                built = {"built_data": sft_data.outputs["sft_data"]}

            if "sft" in wanted:
                sft = on_cluster(
                    sft_op(
                        base_model=pretrain.outputs["model"],
                        sft_data_uri=sft_data_uri,
                        config=sft_config,
                        content_key=preflight.outputs["sft"],
                        experiment=experiment,
                        **built,
                    ),
                    "sft",
                )
                sft.set_display_name("SFT")

            if "reward_model" in wanted:
                reward = on_cluster(
                    reward_model_op(
                        base_model=sft.outputs["model"],
                        preference_data_uri=preference_data_uri,
                        config=reward_model_config,
                        content_key=preflight.outputs["reward_model"],
                        experiment=experiment,
                    ),
                    "reward_model",
                )
                reward.set_display_name("Reward model")

            if "rl" in wanted:
                rl = on_cluster(
                    rl_op(
                        base_model=sft.outputs["model"],
                        reward_model=reward.outputs["model"],
                        rl_data_uri=rl_data_uri,
                        config=rl_config,
                        content_key=preflight.outputs["rl"],
                        experiment=experiment,
                    ),
                    "rl",
                )
                rl.set_display_name("RL")

            if "distill" in wanted:
                distill = on_cluster(
                    distill_op(
                        teacher_model=rl.outputs["model"],
                        sft_data_uri=sft_data_uri,
                        config=distill_config,
                        content_key=preflight.outputs["distill"],
                        experiment=experiment,
                        **built,
                    ),
                    "distill",
                )
                distill.set_display_name("Distill")

            if "select_checkpoint" in wanted:
                select = on_cluster(
                    select_checkpoint_op(
                        clean_data=clean.outputs["clean_data"],
                        pretrain=pretrain.outputs["model"],
                        sft=sft.outputs["model"],
                        reward_model=reward.outputs["model"],
                        rl=rl.outputs["model"],
                        distill=distill.outputs["model"],
                        eval_data_uri=eval_data_uri,
                        config=select_checkpoint_config,
                        # one parameter each: KFP cannot pass a dict literal holding pipeline parameters
                        clean_data_config=clean_data_config,
                        pretrain_config=pretrain_config,
                        sft_config=sft_config,
                        reward_model_config=reward_model_config,
                        rl_config=rl_config,
                        distill_config=distill_config,
                        content_key=preflight.outputs["select_checkpoint"],
                        experiment=experiment,
                    ),
                    "select_checkpoint",
                )
                select.set_display_name("Select checkpoint")

            if "promote" in wanted:
                promote = on_cluster(
                    promote_op(champion=select.outputs["model"], config=promote_config, experiment=experiment),
                    "promote",
                )
                promote.set_display_name("Promote to serving")

    return vlm_training


vlm_training = build_pipeline()
