"""`qvl rehearse --preset P`: the whole DAG at a production preset's settings, on this machine, before any GPU.

    qvl rehearse --preset prod-7b [--data DIR --lake URI] [--out DIR]

Every task runs through kfp.local as `qvl run --local` runs it (preflight through select_checkpoint, and promote when
the preset enables it), with the preset's own settings: modes, LoRA targets, DeepSpeed stages, curriculum phases,
reward mix, algorithm and its update, select weights and gates. What changes is declared, one row per setting, in
OUT/rehearsal_cuts.json and the printed table:

- sizes: steps, samples per step, records, evaluation sizes, generated tokens, image pixels, threads;
- the base model (and distill's student): the preset's checkpoint built by `real_checkpoints.build_checkpoint` with
  its real vocabulary, tokenizer, processor and chat template, depth cut, widths cut to what two processes fit in
  this machine's memory (`--width real` keeps them), random init;
- what needs a cluster: checkpoints on a local folder instead of S3, the model registry left out (the serving
  manifest is still written), select on the CPU, and the seed gates at 0 (a random-init model meets none; the metrics
  they name are still checked against the data);
- what needs trained models: the CLIP filter runs the builtin CLIP with its threshold at -1 (no real CLIP here).

Stages whose cluster profile has several GPUs run under torchrun with 2 CPU processes (the launch plan their pods
get, `components/_shared/launch/plan.py`). Without --data / --lake it runs on the real-format set of
`qvl lake synth --real` (written to OUT/real-set). Writes OUT/run_summary.json, OUT/report.html and
OUT/rehearsal.json, and prints per stage: pass/fail, seconds, peak memory of its largest process and the planner's
estimate for one process of this run (`planned_gb`: an upper bound at full micro-batches).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from components._shared.platform.presets import deep_merge

PROCESSES = 2  # torchrun processes where the cluster profile has several GPUs
NARROW = {"text_hidden": 512, "vision_heads": 2}  # the base model's cut widths; the student's LM half of it
# stage -> the size settings cut (merged over the preset; train blocks and curricula are cut below)
SIZES: dict[str, dict[str, Any]] = {
    "clean_data": {"min_pixels": 3136, "max_pixels": 12544},
    "extract_features": {"min_pixels": 3136, "max_pixels": 12544, "decode_workers": 1},
    "pretrain": {"max_records": 16, "eval": {"heldout_captions": 4, "retrieval_candidates": 4}},
    "sft": {"max_records": 16},
    "reward_model": {"max_records": 8},
    "rl": {"max_records": 8, "rollout": {"max_new_tokens": 8, "batch_size": 4}},
    "distill": {"max_records": 8, "on_policy": {"max_new_tokens": 8}},
    "select_checkpoint": {},
}
EVAL = {"per_type": 2, "batch_size": 4, "max_new_tokens": 8}
# One step a phase (curriculum phases: one each), with its checkpoint and evaluation: every phase's code runs once;
# a second step costs minutes (rl's at 16 PPO minibatches) and adds no path.
TRAIN = {"steps": 1, "samples_per_step": 4, "threads": 1, "log_every": 1}


@dataclass
class Cut:
    setting: str
    preset: Any
    rehearsal: Any
    why: str


@dataclass
class StageRow:
    stage: str
    status: str
    seconds: float
    peak_rss_gb: float
    planned_gb: float
    processes: int


def _flat(node: Any, where: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{where}.{key}" if where else key))
        return out
    return {where: node}


def _train_cut(checkpoints: Path, stage: str) -> dict:
    cut = {**TRAIN, "eval_every": TRAIN["steps"], "checkpoint_every": TRAIN["steps"]}
    return {**cut, "checkpoint_uri": str(checkpoints / stage)}


def size_overrides(stages: dict[str, dict], checkpoints: Path) -> dict[str, dict]:
    """The cut of each stage section: SIZES, every train block, curriculum phases of one step, evaluation sizes."""
    out: dict[str, dict] = {}
    for stage, section in stages.items():
        cut: dict[str, Any] = dict(SIZES.get(stage, {}))
        if "min_pixels" in section and stage not in ("clean_data", "extract_features"):
            cut.update(min_pixels=3136, max_pixels=12544)
        for key, value in section.items():
            if key == "train":
                cut["train"] = _train_cut(checkpoints, stage)
            elif isinstance(value, dict) and isinstance(value.get("train"), dict):  # pretrain's stage1 / stage2
                cut[key] = {"train": _train_cut(checkpoints, f"{stage}-{key}")}
            elif key == "eval" and "per_type" in value:
                cut["eval"] = EVAL
            elif key == "schedule" and value.get("warmup_steps", 0) > 0:
                cut["schedule"] = {"warmup_steps": 0}
        for key in ("stage1", "stage2"):
            if isinstance(section.get(key), dict) and section[key].get("schedule", {}).get("warmup_steps", 0) > 0:
                cut[key] = deep_merge(cut.get(key, {}), {"schedule": {"warmup_steps": 0}})
        if section.get("curriculum"):
            cut["curriculum"] = [{**phase, "steps": 1} for phase in section["curriculum"]]
            steps = len(section["curriculum"])
            cut["train"] = {**cut.get("train", {}), "steps": steps, "eval_every": steps, "checkpoint_every": steps}
        if stage == "rl":  # every PPO minibatch gets a rollout on each process
            per_prompt = section["rollout"]["samples_per_prompt"]
            need = max(TRAIN["samples_per_step"], -(-section["update"]["minibatches"] * PROCESSES // per_prompt))
            cut["train"] = {**cut["train"], "samples_per_step": need}
        if cut:
            out[stage] = cut
    return out


def cluster_overrides(stages: dict[str, dict]) -> tuple[dict[str, dict], dict[str, str]]:
    """What needs a cluster or trained models, with why."""
    why = {
        "clean_data.clip_model": "no real CLIP checkpoint here: the builtin CLIP runs the filter",
        "clean_data.clip_min_score": "the builtin CLIP's scores mean nothing on photographs: the filter keeps all",
        "clean_data.clip_threshold_from_model": "the threshold above applies",
        "select_checkpoint.device": "no GPU here",
        "promote.model_registry.server_address": "no model registry here; the serving manifest is still written",
    }
    out: dict[str, dict] = {
        "clean_data": {"clip_model": "builtin:tiny-clip", "clip_min_score": -1.0, "clip_threshold_from_model": False},
        "select_checkpoint": {"device": "cpu"},
        "promote": {"model_registry": {"server_address": ""}},
    }
    gates = stages["select_checkpoint"].get("min_gates") or {}
    if gates:
        out["select_checkpoint"]["min_gates"] = dict.fromkeys(gates, 0.0)
        for name in gates:
            why[f"select_checkpoint.min_gates.{name}"] = (
                "a random-init model meets no gate; the metric is still checked"
            )
    return out, why


def checkpoint_name(uri: str) -> str:
    from pipelines.qvl.memory_plan import _checkpoint_named_by
    from pipelines.qvl.real_checkpoints import checkpoint_names

    name = _checkpoint_named_by(uri, checkpoint_names())
    if not name:
        raise ValueError(
            f"{uri} names no checkpoint `qvl rehearse` can build ({', '.join(checkpoint_names())}): the rehearsal "
            "builds the preset's base model from its config in pipelines/checkpoints/."
        )
    return name


REHEARSAL_FILES = frozenset({"real-set", "models", "checkpoints", "rehearsal_cuts.json", "rehearsal.json"})


def rehearsal_dir(root: Path, name: str) -> Path:
    """ROOT/PRESET for `qvl rehearse --preset NAME --out ROOT`, checked before anything is written: the preset loads
    and names a checkpoint the rehearsal builds, the subfolder is the preset's own name made safe (never `..`), ROOT
    is no lake or data directory (the real set's shards would join it), and the subfolder is new or a run's own."""
    import re

    from pipelines.presets import load_preset
    from pipelines.qvl.local_run import check_run_dir

    preset = load_preset(name)
    checkpoint_name(preset.base_model_uri)
    student = preset.stages["distill"].get("student", {}).get("model_uri")
    if student:
        checkpoint_name(student)
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", preset.name).strip(".") or "preset"
    if root.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.suffix in (".tar", ".jsonl", ".parquet"))
        found += [n for n in ("dataset.yaml", "_COMMITTED.json", "world.json") if (root / n).exists()]
        if found:
            raise ValueError(
                f"--out {root} holds data ({', '.join(found[:5])}): the rehearsal writes its real set and every "
                "stage's output under it. Give a new directory or an earlier rehearsal's (e.g. runs/rehearsal)."
            )
    check_run_dir(root / slug, ours=REHEARSAL_FILES)
    return root / slug


def rehearsal_preset(name: str, out: Path, *, real_widths: bool = False, layers: int = 2, vision_depth: int = 4):
    """(the preset with its sizes cut and the models built, the declared cuts)."""
    from pipelines.presets import load_preset
    from pipelines.qvl.real_checkpoints import build_checkpoint

    preset = load_preset(name)
    widths = {} if real_widths else NARROW
    base_name = checkpoint_name(preset.base_model_uri)
    base = build_checkpoint(base_name, out / "models" / base_name, layers=layers, vision_depth=vision_depth, **widths)
    models: dict[str, Any] = {"base_model_uri": str(base)}
    why = {"base_model_uri": f"{base_name} at {layers} LM layers, {vision_depth} ViT blocks"}
    why["base_model_uri"] += (
        "" if real_widths else f", LM {NARROW['text_hidden']} wide, ViT {NARROW['vision_heads']} heads"
    )
    student = preset.stages["distill"].get("student", {})
    if student.get("model_uri"):
        student_name = checkpoint_name(student["model_uri"])
        half = {"text_hidden": NARROW["text_hidden"] // 2, "vision_heads": 2} if not real_widths else {}
        path = build_checkpoint(
            student_name, out / "models" / student_name, layers=1, vision_depth=vision_depth, **half
        )
        models["distill"] = {"student": {"model_uri": str(path)}}
        why["distill.student.model_uri"] = f"{student_name} cut like the base model (1 LM layer)"
    return cut_preset(name, out / "checkpoints", models, why)


def cut_preset(name: str, checkpoints: Path, models: dict[str, Any], why: dict[str, str]):
    """(preset `name` with its sizes and cluster needs cut and `models` (base, student) in place, the declared
    cuts)."""
    from pipelines.presets import load_preset

    preset = load_preset(name)
    cluster, cluster_why = cluster_overrides(preset.stages)
    overrides = deep_merge(deep_merge(size_overrides(preset.stages, checkpoints), cluster), models)
    retried = [stage for stage, profile in preset.cluster_profile().stages.items() if profile.retries]
    if retried:  # a stage that fails here fails the same way again: no retries, no backoff
        overrides["kubernetes"] = {"stages": {stage: {"retries": 0} for stage in retried}}
        cluster_why["kubernetes.stages"] = "a rehearsal fails fast: no retries"
    cut = load_preset(name, overrides)
    return cut, _declared(preset, cut, {**why, **cluster_why})


def _declared(preset, cut, why: dict[str, str]) -> list[Cut]:
    before = _flat({"base_model_uri": preset.base_model_uri, "kubernetes": preset.kubernetes, **preset.stages})
    after = _flat({"base_model_uri": cut.base_model_uri, "kubernetes": cut.kubernetes, **cut.stages})
    rows = []
    for setting in sorted(set(before) | set(after)):
        if before.get(setting) != after.get(setting):
            reason = next((w for key, w in why.items() if setting.startswith(key)), "size (a rehearsal is minutes)")
            rows.append(Cut(setting, before.get(setting), after.get(setting), reason))
    return rows


def processes(preset) -> dict[str, int]:
    """Stages whose cluster profile has several GPUs (or nodes): they run under torchrun with PROCESSES processes."""
    from components._shared.launch.plan import MULTI_PROCESS_STAGES

    cluster = preset.cluster_profile()
    return {s: PROCESSES for s in MULTI_PROCESS_STAGES if cluster.stages[s].gpus * cluster.stages[s].nodes > 1}


def planned_gb(preset, stage: str, config, launched: dict[str, int]) -> float:
    """The planner's arithmetic for one process of this run (PROCESSES processes, the stage's ZeRO stage and bf16, a
    full micro-batch of train.max_tokens_per_micro_batch) plus a process's baseline: an upper bound, since the
    rehearsal's micro-batches hold a few hundred tokens."""
    from transformers import AutoConfig

    from components._shared.model.memory_plan import BASELINE_GB, TRAINING_STAGES, meta_model, plan_stage
    from components.preflight.fit import Profile
    from pipelines.qvl.memory_plan import known_config

    if stage not in TRAINING_STAGES:
        return 0.0

    def resolve(uri: str):
        return AutoConfig.from_pretrained(uri) if Path(uri).is_dir() else known_config(uri)

    profile = Profile(gpus=launched.get(stage, 1))
    plan = plan_stage(
        stage, preset.stages[stage], profile, meta_model(config), config, resolve=resolve, suggest_fix=False
    )
    return round(plan.total_gb + BASELINE_GB, 2)


def rehearse_preset(
    name: str,
    out: Path,
    *,
    data: str | None = None,
    lake: str | None = None,
    real_widths: bool = False,
    console=None,
) -> tuple[dict, list[StageRow], list[Cut]]:
    """Run the whole DAG of preset `name` cut to this machine; returns (run summary, table rows, declared cuts)."""
    from transformers import AutoConfig

    from components.stages import dag_stages
    from pipelines.qvl.local_run import run_local

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (data is None) != (lake is None):
        raise ValueError("give both --data and --lake, or neither (the real-format set of `qvl lake synth --real`).")
    if data is None:
        from components.synth_world.real_set import write_real_set

        written = write_real_set(out / "real-set")
        data, lake = written["data"], written["lake"]
    preset, cuts = rehearsal_preset(name, out, real_widths=real_widths)
    (out / "rehearsal_cuts.json").write_text(json.dumps([asdict(c) for c in cuts], indent=2, default=str) + "\n")
    launched = processes(preset)
    config = AutoConfig.from_pretrained(preset.base_model_uri)  # the built base model's, read once for the planner
    summary = run_local(
        lake_uri=str(lake),
        out_dir=out,
        data_uri=str(data),
        preset=preset,
        console=console,
        processes=launched,
        prepared_dir=True,  # its own directory: the real set, the built checkpoint and the cuts are written there
    )
    peaks = summary.get("task_peak_rss_gb", {})
    rows = []
    for stage in ["preflight", *dag_stages(preset.stages, None)]:
        result = summary["stages"].get(stage, {})
        peak = max((gb for task, gb in peaks.items() if _stage_of_task(task) == stage), default=0.0)
        rows.append(
            StageRow(
                stage=stage,
                status=result.get("status", "not run"),
                seconds=round(float(result.get("seconds") or 0.0), 1),
                peak_rss_gb=round(peak, 2),
                planned_gb=planned_gb(preset, stage, config, launched),
                processes=launched.get(stage, 1),
            )
        )
    (out / "rehearsal.json").write_text(
        json.dumps({"preset": name, "stages": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    return summary, rows, cuts


def _stage_of_task(task: str) -> str:
    from pipelines.qvl.progress_view import stage_of

    return stage_of(task.split("-")[0])  # a repeated task's log: clean_shard_op-2


def table(name: str, rows: list[StageRow], cuts: list[Cut]) -> str:
    lines = [f"rehearsal of preset {name} (the whole DAG; {len(cuts)} settings cut: OUT/rehearsal_cuts.json)"]
    lines.append(f"{'stage':<18} {'result':<10} {'procs':>5} {'seconds':>8} {'peak RSS':>9} {'planned':>9}")
    for r in rows:
        planned = f"{r.planned_gb:>7.2f}GB" if r.planned_gb else f"{'-':>9}"
        lines.append(
            f"{r.stage:<18} {r.status:<10} {r.processes:>5} {r.seconds:>8.1f} {r.peak_rss_gb:>7.2f}GB {planned}"
        )
    return "\n".join(lines)
