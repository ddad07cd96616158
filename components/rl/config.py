"""Config of the rl stage. Imports pydantic only, so pipelines/ compiles without torch."""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from components._shared.model.train_config import (
    ModuleGroup,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
    TrainedStageConfig,
    changed_fields,
)
from components._shared.platform.config import SubConfig

REWARD_NAMES = ("efficacy", "format", "reward_model", "ocr_consistency")  # rewards.REWARD_BUILDERS builds each


MAX_REWARD_WEIGHT = 1000.0  # weights are relative; a huge one overflows the reward statistics


class RolloutConfig(SubConfig):
    """Sampling from the current policy (KV cache on, batched)."""

    samples_per_prompt: Annotated[
        int, Field(ge=1, le=1024, description="Completions per prompt (GRPO's group size; at most 1024).")
    ] = 1
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 48
    temperature: Annotated[
        float,
        Field(
            gt=0,
            le=2.0,
            description=("Sampling temperature; log-probabilities for the update use the same temperature."),
        ),
    ] = 1.0
    batch_size: Annotated[int, Field(ge=1, description="Prompts per generate() call.")] = 64


class UpdateConfig(SubConfig):
    """Optimizer passes over one step's rollouts."""

    epochs: Annotated[int, Field(ge=1, le=16)] = 1
    minibatches: Annotated[int, Field(ge=1, description="Optimizer steps per epoch (rollouts split evenly).")] = 1


class PpoConfig(SubConfig):
    """PPO with a value head on the policy (the defaults follow docs/references.md, PPO settings)."""

    clip_start: Annotated[float, Field(gt=0, lt=1)] = 0.2
    clip_end: Annotated[float, Field(gt=0, lt=1)] = 0.05
    kl_coef: Annotated[float, Field(ge=0, description="Initial coefficient of the per-token KL penalty.")] = 0.05
    adaptive_kl: bool = True
    kl_target: Annotated[float, Field(gt=0, description="Per-token KL the adaptive controller steers to.")] = 0.02
    kl_horizon: Annotated[int, Field(ge=1)] = 1000
    kl_stop: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "Hard stop: training ends, keeping the current policy, once the per-token KL to the "
                "reference measured on a step's rollouts exceeds this."
            ),
        ),
    ] = 0.1
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    value_coef: Annotated[float, Field(ge=0)] = 0.1
    value_clip: Annotated[float, Field(gt=0)] = 0.2
    reward_clip: Annotated[float, Field(gt=0, description="Normalised scores are clipped to [-c, c].")] = 1.0
    group_baseline: bool = Field(
        False,
        description=(
            "Subtract from each score the mean score of the prompt's other samples in the step (leave-one-out, "
            "needs rollout.samples_per_prompt >= 2) before normalisation: the critic starts at zero and cannot tell "
            "an easy prompt from a hard one for its first steps; this baseline can."
        ),
    )

    @model_validator(mode="after")
    def _ordered(self):
        if self.clip_end > self.clip_start:
            raise ValueError(
                f"ppo.clip_end={self.clip_end} > ppo.clip_start={self.clip_start}: the clip range decays from start to "
                "end over training; swap them (or give both the same value for a constant clip)."
            )
        if self.adaptive_kl and self.kl_stop <= self.kl_target:
            raise ValueError(
                f"ppo.kl_stop={self.kl_stop} <= ppo.kl_target={self.kl_target}: the adaptive controller would steer "
                "the KL to where the hard stop ends training; keep kl_stop above kl_target (e.g. 5x it)."
            )
        return self


class TerConfig(SubConfig):
    """Task-efficacy REINFORCE (TER; docs/references.md)."""

    baseline_decay: Annotated[float, Field(ge=0, lt=1)] = 0.99
    max_grad_norm: Annotated[float, Field(gt=0, description="TER's own gradient clip (replaces optim's).")] = 0.3
    grad_ema: Annotated[
        float,
        Field(
            ge=0,
            lt=1,
            description=(
                "EMA of the clipped gradient (0.95 is a common choice); 0 = off, the default: under AdamW the "
                "smoothed, stale gradient made the demo's training reward fall (docs/stages/rl.md)."
            ),
        ),
    ] = 0.0
    importance_cap: Annotated[float, Field(ge=1)] = 2.0


class GrpoConfig(SubConfig):
    """Group-relative baseline over rollout.samples_per_prompt samples of each prompt."""

    min_group: ClassVar[int] = 2
    clip: Annotated[float, Field(gt=0, lt=1)] = 0.2
    kl_coef: Annotated[float, Field(ge=0)] = 0.04
    scale_rewards: bool = True


class DapoConfig(SubConfig):
    """DAPO: GRPO's group baseline with clip-higher, dynamic sampling, a token-level loss and overlong shaping."""

    min_group: ClassVar[int] = 2
    clip_low: Annotated[float, Field(gt=0, lt=1)] = 0.2
    clip_high: Annotated[float, Field(gt=0, lt=1, description="The wider upper clip (clip-higher).")] = 0.28
    dynamic_sampling: bool = Field(True, description="Drop groups whose samples all scored the same from the update.")
    overlong_buffer: Annotated[
        float,
        Field(ge=0, lt=1, description="Share of rollout.max_new_tokens over which the overlong penalty grows to -1."),
    ] = 0.2
    overlong_penalty: Annotated[float, Field(ge=0, description="Weight of the overlong penalty; 0 = off.")] = 1.0
    kl_coef: Annotated[float, Field(ge=0, description="k3 KL to the reference in the loss (DAPO drops it: 0).")] = 0.0

    @model_validator(mode="after")
    def _clip_higher(self) -> DapoConfig:
        if self.clip_high < self.clip_low:
            raise ValueError(
                f"dapo.clip_high={self.clip_high} < dapo.clip_low={self.clip_low}: DAPO's clip-higher widens the upper "
                "clip (it lets unlikely tokens that did well gain); give clip_high >= clip_low (the paper: 0.2 / 0.28)."
            )
        return self


class GspoConfig(SubConfig):
    """GSPO: a sequence-level importance ratio (geometric mean of the token ratios), clipped in a narrow band."""

    min_group: ClassVar[int] = 2
    clip_low: Annotated[float, Field(gt=0, lt=1)] = 3e-4
    clip_high: Annotated[float, Field(gt=0, lt=1)] = 4e-4
    kl_coef: Annotated[float, Field(ge=0)] = 0.0


class ParityConfig(SubConfig):
    """The log-probabilities the rollouts were sampled with against the trainer's (logged every step)."""

    tolerance: Annotated[
        float | None,
        Field(
            ge=0,
            description=(
                "Largest mean |sampler - trainer| token log-probability accepted at the first step; None: the model "
                "family's (docs/stages/rl.md). Exceeded: the stage stops and says which family and precision."
            ),
        ),
    ] = None
    tis_cap: Annotated[
        float,
        Field(
            ge=0,
            description=(
                "Truncated importance sampling: weight each token's policy-gradient term by min(trainer / sampler "
                "probability, tis_cap), correcting the rollouts for the sampler's mismatch; 0 = off."
            ),
        ),
    ] = 0.0


class PtxConfig(SubConfig):
    """The SFT loss mixed into every update (PPO-ptx, Ouyang et al. 2022), for every algorithm."""

    coef: Annotated[
        float,
        Field(
            ge=0,
            description=(
                "Weight of the mean token NLL of reference answers added to the RL loss of every optimizer step: "
                "records of the prompts file of `ptx.types` (default every type, whatever `prompt_types` says), drawn "
                "afresh each step and split over its minibatches like the rollouts. It holds the answers the reward "
                "cannot move where SFT left them while the RL term moves the others; 0 = off."
            ),
        ),
    ] = 0.0
    samples_per_step: Annotated[
        int, Field(ge=0, description=("Reference records per RL step; 0 = train.samples_per_step."))
    ] = 0
    types: list[str] = Field(
        default_factory=list,
        description=(
            "Question types of the ptx records; empty = every type. With RL on some types (`prompt_types`), the "
            "others alone hold the rest where SFT left them and leave the RL types free to move."
        ),
    )
    loss: Literal["nll", "kl"] = Field(
        "nll",
        description=(
            "nll: the SFT loss on the reference answers (pulls towards the reference); kl: KL(reference model || "
            "policy) over the whole vocabulary at those answers' positions (holds the SFT model's distribution there, "
            "including near-tie answers the model gives by the class prior). kl keeps the reference model's "
            "log-probabilities of the step's ptx tokens in memory: tokens x vocabulary floats."
        ),
    )


class GateConfig(SubConfig):
    """Reward-hacking monitors that fail the stage (a step gate trips after `patience` consecutive bad steps).
    A bound of 0 turns its gate off (KFP parameters cannot carry null)."""

    kl_max: Annotated[float, Field(ge=0, description="Per-token KL to the reference.")] = 1.0
    length_ratio_min: Annotated[float, Field(ge=0, description="Mean completion length / first step's.")] = 0.5
    length_ratio_max: Annotated[float, Field(ge=0)] = 2.0
    entropy_min: Annotated[float, Field(ge=0, description="Mean per-token entropy (nats).")] = 0.0
    heldout_drop_max: Annotated[
        float,
        Field(
            ge=0,
            description=(
                "Reward/accuracy divergence: the training reward rose while held-out efficacy fell by more than this."
            ),
        ),
    ] = 0.1
    patience: Annotated[int, Field(ge=1)] = 3

    @model_validator(mode="after")
    def _ordered(self):
        if self.length_ratio_min and self.length_ratio_max and self.length_ratio_min > self.length_ratio_max:
            raise ValueError(
                f"gates.length_ratio_min={self.length_ratio_min} > gates.length_ratio_max={self.length_ratio_max}: "
                "every step would trip one of them; swap them (or set one to 0 to turn that gate off)."
            )
        return self


# The algorithms (components/rl/algorithms/, one module each) and their settings blocks, by name.
ALGORITHM_SETTINGS: dict[str, type[SubConfig]] = {
    "ppo": PpoConfig,
    "ter": TerConfig,
    "grpo": GrpoConfig,
    "dapo": DapoConfig,
    "gspo": GspoConfig,
}


class RlEvalConfig(SubConfig):
    files: list[str] | None = Field(
        None,
        min_length=1,
        description=(
            "Held-out question files in the data directory (any format of docs/data.md, e.g. rl.jsonl when the "
            "policy trains on sft.jsonl: more unseen questions, narrower intervals on the efficacy change). Never the "
            "prompts file. None: dataset.yaml's eval files, else eval.jsonl."
        ),
    )
    per_type: Annotated[int | None, Field(ge=1)] = 50
    batch_size: Annotated[int, Field(ge=1)] = 64
    max_new_tokens: Annotated[int, Field(ge=1)] = 48

    @field_validator("files")
    @classmethod
    def _named_files(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(isinstance(f, str) and f.strip() for f in value):
            raise ValueError(
                f"eval.files={value!r} holds an empty name; list file names in the data directory, or leave eval.files "
                "unset (null) for dataset.yaml's eval files, else eval.jsonl."
            )
        return value


class RlConfig(TrainedStageConfig):
    """Policy optimisation of the SFT model with PPO, TER, GRPO, DAPO or GSPO on verifiable prompts, in one process or
    sharded over several (torchrun, DeepSpeed; shard.py)."""

    algorithm: str = Field("ppo", description=f"The RL algorithm: {', '.join(ALGORITHM_SETTINGS)}.")
    rewards: dict[str, float] = Field(
        default_factory=lambda: {"efficacy": 1.0},
        description=(f"Reward weights by name ({', '.join(REWARD_NAMES)}); the step reward is their weighted sum."),
    )
    prompts_file: str | None = Field(
        None,
        description=(
            "Prompt records in the data directory (any question or conversation format of docs/data.md; the first "
            "assistant turn or `answer` is the reference, the record's task scores it). None: dataset.yaml's rl "
            "files, else sft.jsonl."
        ),
    )
    prompt_types: list[str] = Field(
        default_factory=list, description="Tasks (question types) to train on; empty = all."
    )
    max_records: Annotated[int | None, Field(ge=1)] = None
    freeze: list[ModuleGroup] = Field(default_factory=list)
    min_pixels: Annotated[int, Field(ge=28 * 28)] = 56 * 56
    max_pixels: Annotated[int, Field(ge=28 * 28)] = 1280 * 28 * 28
    max_length: Annotated[int, Field(ge=16)] = 4096
    rollout: RolloutConfig = RolloutConfig()
    update: UpdateConfig = UpdateConfig()
    ppo: PpoConfig = PpoConfig()
    ter: TerConfig = TerConfig()
    grpo: GrpoConfig = GrpoConfig()
    dapo: DapoConfig = DapoConfig()
    gspo: GspoConfig = GspoConfig()
    parity: ParityConfig = ParityConfig()
    frozen_sharding: Literal["replicated", "zero3"] = Field(
        "replicated",
        description=(
            "The frozen reference model on several processes: a whole copy per process, or partitioned over them by "
            "a ZeRO-3 inference engine (1/processes of its weights each; needs train.backend: deepspeed). `qvl plan` "
            "says which fits."
        ),
    )
    ptx: PtxConfig = PtxConfig()
    gates: GateConfig = GateConfig()
    eval: RlEvalConfig = RlEvalConfig()
    train: TrainConfig = TrainConfig(steps=100, samples_per_step=16, max_tokens_per_micro_batch=4096, eval_every=50)
    optim: OptimConfig = OptimConfig(lr=1e-5)
    schedule: ScheduleConfig = ScheduleConfig(decay="constant")

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        if value not in ALGORITHM_SETTINGS:
            raise ValueError(f"unknown algorithm {value!r}; choose from {list(ALGORITHM_SETTINGS)}.")
        return value

    @field_validator("rewards")
    @classmethod
    def _known_rewards(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(REWARD_NAMES))
        if unknown:
            raise ValueError(f"unknown reward(s) {unknown}; choose from {list(REWARD_NAMES)}.")
        odd = {name: w for name, w in value.items() if not math.isfinite(w) or w < 0 or w > MAX_REWARD_WEIGHT}
        if odd:
            raise ValueError(
                f"reward weight(s) {odd} are negative, not finite or over {MAX_REWARD_WEIGHT:g}; every reward is "
                "higher-is-better, so a negative weight trains the policy to fail it, and only the weights' ratios "
                "matter: give weights in [0, 1000] (0 turns a reward off)."
            )
        if not any(value.values()):
            raise ValueError("every reward weight is 0; give at least one a non-zero weight (e.g. efficacy: 1.0).")
        return value

    @field_validator("prompts_file")
    @classmethod
    def _named_prompts(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(
                "prompts_file is empty (an unset shell variable?); name a file in the data directory, or leave it "
                "unset (null) for dataset.yaml's rl files, else sft.jsonl."
            )
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.algorithm == "ppo" and self.ppo.group_baseline and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "ppo.group_baseline needs rollout.samples_per_prompt >= 2 (the baseline is the mean of a "
                "prompt's other samples); raise it or set ppo.group_baseline: false."
            )
        group = getattr(ALGORITHM_SETTINGS[self.algorithm], "min_group", 1)
        if self.rollout.samples_per_prompt < group:
            raise ValueError(
                f"algorithm {self.algorithm} needs rollout.samples_per_prompt >= {group} (its baseline is the group "
                "mean of a prompt's samples); raise rollout.samples_per_prompt."
            )
        if self.frozen_sharding == "zero3" and self.train.backend != "deepspeed":
            raise ValueError(
                "frozen_sharding: zero3 partitions the reference with DeepSpeed; set train.backend: deepspeed or "
                "frozen_sharding: replicated."
            )
        if self.algorithm == "ter" and self.ter.grad_ema and self.train.backend == "deepspeed":
            raise ValueError(
                "ter.grad_ema needs the torch backend (DeepSpeed owns the gradients); set ter.grad_ema: 0 "
                "or train.backend: torch."
            )
        if self.prompts_file and self.prompts_file in (self.eval.files or ["eval.jsonl"]):
            raise ValueError(
                f"eval.files holds the prompts file {self.prompts_file!r}: the policy trains on those "
                "questions, so they are not held out; drop it from eval.files or train on another file."
            )
        rollouts = self.train.samples_per_step * self.rollout.samples_per_prompt
        if self.update.minibatches > rollouts:
            raise ValueError(
                f"update.minibatches={self.update.minibatches} exceeds the {rollouts} rollouts of a step "
                "(train.samples_per_step x rollout.samples_per_prompt)."
            )
        return self

    def ignored_settings(self) -> list[str]:
        """Another algorithm's settings changed from their defaults, and the clips TER replaces."""
        notes = super().ignored_settings()
        for block, settings in ALGORITHM_SETTINGS.items():
            default = settings()
            if block != self.algorithm:
                notes += [
                    f"{block}.{name}: a {block} setting; algorithm is {self.algorithm}"
                    for name in changed_fields(getattr(self, block), default)
                ]
        if not self.ptx.coef:
            notes += [
                f"ptx.{name}: ptx.coef is 0 (no SFT loss is mixed in)" for name in changed_fields(self.ptx, PtxConfig())
            ]
        if self.algorithm == "ter":
            replaced = changed_fields(self.optim, type(self).model_fields["optim"].default)
            notes += [
                f"optim.{name}: algorithm ter clips every group at ter.max_grad_norm instead"
                for name in replaced
                if name in ("max_grad_norm", "group_max_grad_norm")
            ]
        return notes
