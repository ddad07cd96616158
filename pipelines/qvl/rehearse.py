"""`qvl rehearse`: a real checkpoint's config through every model stage for a step or two, before GPUs are spent.

    qvl rehearse --config qwen3.5-0.8b [--stages pretrain,sft_lora] [--layers 2] [--vision-depth 4] [--out DIR]

The checkpoint is built by `real_checkpoints.build_checkpoint` (real widths, vocabulary, tokenizer, processor and
template; depth cut; random init) and the stages run as their pods run them (`python -m components.<stage>`), one
process each, on a small synthetic world with `pipelines/presets/rehearsal.yaml`. Printed per stage: pass/fail,
seconds, the stage process's peak resident memory (its own rusage) and `qvl plan`'s estimate of it. A failing
stage's log is OUT/<stage>.log and the stages that need its output are skipped. Intermediate checkpoints are
kept outside the stage outputs and deleted once a stage passed (GBs per step at real widths); the exports stay.
A stage whose estimate exceeds 85% of this machine's memory gives up what `FITS` lists (the LM frozen, a narrower
student) until it fits, or is skipped with the estimate (`fit_machine`; the Qwen4 preview's 1.4B-parameter cut on
24 GB).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

# (run, stage, inputs: flag -> template over {world}, {base} and earlier runs' output dirs, config overrides)
RUNS: list[tuple[str, str, dict[str, str], dict]] = [
    ("clean_data", "clean_data", {"lake_uri": "{world}/lake"}, {}),
    ("extract_features", "extract_features", {"clean_data": "{clean_data}", "base_model": "{base}"}, {}),
    (
        "pretrain",
        "pretrain",
        {"clean_data": "{clean_data}", "features": "{extract_features}", "base_model": "{base}", "data": "{data}"},
        {},
    ),
    ("sft_lora", "sft", {"base_model": "{pretrain}/model", "data": "{data}"}, {"mode": "lora"}),
    ("sft_full", "sft", {"base_model": "{pretrain}/model", "data": "{data}"}, {"mode": "full"}),
    ("reward_model", "reward_model", {"base_model": "{sft_lora}/model", "data": "{data}"}, {}),
    (
        "rl",
        "rl",
        {"base_model": "{sft_lora}/model", "reward_model": "{reward_model}/model", "data": "{data}"},
        {},
    ),
    ("distill", "distill", {"teacher_model": "{rl}/model", "data": "{data}"}, {}),
    (
        "select_checkpoint",
        "select_checkpoint",
        {
            "data": "{data}",
            "pretrain": "{pretrain}",
            "sft": "{sft_lora}",
            "rl": "{rl}",
            "distill": "{distill}",
            "reward_model": "{reward_model}/model",
            "clean_data": "{clean_data}",
        },
        {},
    ),
    ("promote", "promote", {"champion": "{select_checkpoint}"}, {}),  # bf16 safetensors + the serving manifest
]
RUN_NAMES = [r[0] for r in RUNS]


@dataclass
class StageRun:
    run: str
    status: str  # passed / failed / skipped
    seconds: float = 0.0
    peak_rss_gb: float = 0.0
    planned_gb: float = 0.0  # `qvl plan`'s estimate for this run on the CPU (0: a stage that does not train)
    detail: str = ""


def stage_configs(base_dir: Path) -> dict[str, dict]:
    """The rehearsal preset's stage sections, with the settings the checkpoint's family needs."""
    from components._shared.model.families import family_for
    from pipelines.presets import load_preset

    config = json.loads((base_dir / "config.json").read_text())
    family = family_for(str(config["model_type"]))
    overrides: dict = {"clean_data": {"patch_size": family.patch_size}}
    if not family.prunable:
        overrides["distill"] = {"student": {"init": "random"}}
    return load_preset("rehearsal", overrides).stages


def run_one(stage: str, config: dict, out: Path, inputs: dict[str, str], log: Path) -> StageRun:
    """One stage process; its peak RSS from os.wait4 (the child's own rusage, in KiB on Linux)."""
    cfg_file = out.parent / f"{out.name}.yaml"
    cfg_file.write_text(yaml.safe_dump({stage: config}))
    cmd = [sys.executable, "-m", f"components.{stage}", "--config", str(cfg_file), "--output-dir", str(out)]
    for name, value in inputs.items():
        cmd += [f"--{name.replace('_', '-')}", value]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out.parent}/mlflow.db", "OMP_NUM_THREADS": "2"}
    started = time.perf_counter()
    with log.open("w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    tail = "" if code == 0 else log.read_text()[-600:].strip().splitlines()[-1:]
    return StageRun(
        run=out.name,
        status="passed" if code == 0 else "failed",
        seconds=round(seconds, 1),
        peak_rss_gb=round(usage.ru_maxrss / 2**20, 2),
        detail="" if code == 0 else f"exit {code}: {tail[0] if tail else ''}",
    )


def rehearse(
    name: str, out: Path, *, runs: list[str] | None = None, layers: int = 2, vision_depth: int = 4, records: int = 120
) -> list[StageRun]:
    from components.synth_world.lake import write_world
    from pipelines.qvl.real_checkpoints import build_checkpoint, hub_config, rehearsal_cuts

    unknown = sorted(set(runs or []) - set(RUN_NAMES))
    if unknown:
        raise ValueError(f"unknown rehearsal stage(s) {unknown}; choose from {', '.join(RUN_NAMES)}.")
    hub_config(name)  # an unknown name fails here, before anything is built
    out.mkdir(parents=True, exist_ok=True)
    _say(f"rehearse {name}: building the checkpoint ({layers} LM layers, {vision_depth} ViT blocks) in {out}")
    for field, (real, kept, why) in rehearsal_cuts(name).items():
        _say(f"rehearse {name}: {field} {real:,} -> {kept:,} ({why}), to fit this machine")
    base = build_checkpoint(name, out / "checkpoint", layers=layers, vision_depth=vision_depth)
    world = out / "world"
    if not (world / "lake").exists():
        _say(f"rehearse {name}: writing a synthetic world of {records} records")
        write_world(world, records=records, seed=5)
    configs = stage_configs(base)
    values = {"world": str(world), "base": str(base), "data": str(world / "heldout")}
    wanted = set(RUN_NAMES) if not runs else {need for run in runs for need in (run, *_needs(run))}
    results: list[StageRun] = []
    for run, stage, inputs, overrides in RUNS:
        if run not in wanted:
            continue
        missing = [need for need in _direct_needs(inputs) if need not in values]
        if missing:
            results.append(StageRun(run, "skipped", detail=f"needs {', '.join(missing)}"))
            continue
        flags = {k: v.format(**values) for k, v in inputs.items()}
        config = _merge(configs[stage], {**overrides, **_checkpoints_outside(stage, out / "_checkpoints" / run)})
        config, planned, fitted = fit_machine(stage, config, base, machine_gb())
        if fitted.startswith("skipped"):
            _say(f"rehearse {name}: {run} {fitted}")
            results.append(StageRun(run, "skipped", planned_gb=round(planned, 2), detail=fitted[len("skipped: ") :]))
            continue
        _say(f"rehearse {name}: {run} ... (log: {out / f'{run}.log'}){' ' + fitted if fitted else ''}")
        result = run_one(stage, config, out / run, flags, out / f"{run}.log")
        result.planned_gb, result.detail = round(planned, 2), " ".join(filter(None, (fitted, result.detail)))
        _say(f"rehearse {name}: {run} {result.status} in {result.seconds:.0f} s {result.detail}".rstrip())
        results.append(result)
        if result.status == "passed":
            values[run] = str(out / run)
            shutil.rmtree(out / "_checkpoints" / run, ignore_errors=True)  # fp32 weights + optimizer: GBs per step
    (out / "rehearsal.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return results


LM = ["lm_lower", "lm_upper"]
# What a rehearsal run over this machine's memory gives up, step by step, until `qvl plan` says it fits.
FITS: dict[str, list[tuple[str, dict]]] = {
    "pretrain": [("LM frozen", {"stage1": {"train_lm": False}, "stage2": {"freeze": LM}})],
    "sft": [("LM frozen", {"freeze": LM})],  # mode: full only (LoRA freezes the base already)
    "reward_model": [("LM frozen", {"freeze": LM})],
    "rl": [("LM frozen", {"freeze": LM}), ("no reward-model reward", {"rewards": {"reward_model": 0.0}})],
    "distill": [("a 512-wide student", {"student": {"hidden": 512}})],
}


def machine_gb() -> float:
    """What a stage process may use here: 85% of the machine's memory (the rest: the OS, this process)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 * 0.85


def fit_machine(stage: str, config: dict, base: Path, budget_gb: float) -> tuple[dict, float, str]:
    """(config, its planned GB, what was given up to fit): a run whose plan exceeds this machine's memory takes
    the stage's FITS steps until it fits (a 122B MoE's vocabulary and experts at real widths train nowhere on
    24 GB), else is skipped with the planner's numbers instead of being killed for memory."""
    planned = _planned(stage, config, base)
    if planned <= budget_gb:
        return config, planned, ""
    steps = FITS.get(stage, []) if stage != "sft" or config.get("mode") == "full" else []
    fitted, given_up = config, []
    for what, change in steps:
        fitted = _merge(fitted, change)
        given_up.append(what)
        fits = _planned(stage, fitted, base)
        if fits <= budget_gb:
            plans = f"plan {planned:.1f} -> {fits:.1f} GB of {budget_gb:.1f}"
            return fitted, fits, f"(to fit: {', '.join(given_up)}; {plans})"
    return config, planned, f"skipped: its plan is {planned:.1f} GB, this machine gives a stage {budget_gb:.1f} GB"


def _say(line: str) -> None:
    """A progress line on stderr (a rehearsal runs for minutes; the table comes at the end on stdout)."""
    print(line, file=sys.stderr, flush=True)


def _planned(stage: str, config: dict, base: Path) -> float:
    """The memory planner's CPU estimate of a training stage on this checkpoint (pipelines/qvl/memory_plan.py)."""
    from transformers import AutoConfig

    from pipelines.presets import load_preset
    from pipelines.qvl.memory_plan import TRAINING_STAGES, meta_model, plan_stage

    if stage not in TRAINING_STAGES:
        return 0.0
    model_config = AutoConfig.from_pretrained(base)
    profile = load_preset("rehearsal").cluster_profile().stages[stage]
    return plan_stage(stage, config, profile, meta_model(model_config), model_config, device="cpu").total_gb


def _checkpoints_outside(stage: str, root: Path) -> dict:
    """train.checkpoint_uri outside the stage output, so the rehearsal can drop them and the outputs stay intact."""
    from pipelines.qvl.memory_plan import TRAINING_STAGES

    if stage not in TRAINING_STAGES:
        return {}
    train = {"train": {"checkpoint_uri": str(root)}}
    return {"stage1": train, "stage2": train} if stage == "pretrain" else train


def _direct_needs(inputs: dict[str, str]) -> list[str]:
    """The earlier runs whose outputs these input templates name."""
    return [v[1:].split("}")[0] for v in inputs.values() if v[1:].split("}")[0] in RUN_NAMES]


def _needs(run: str) -> list[str]:
    """Every run that `run` needs, directly or through the runs it needs."""
    table = {name: _direct_needs(inputs) for name, _, inputs, _ in RUNS}
    todo, seen = list(table[run]), []
    while todo:
        need = todo.pop()
        if need not in seen:
            seen.append(need)
            todo += table[need]
    return seen


def _merge(base: dict, extra: dict) -> dict:
    from components._shared.platform.presets import deep_merge

    return deep_merge(base, extra)


def table(name: str, results: list[StageRun]) -> str:
    lines = [
        f"rehearsal of {name}",
        f"{'stage':<18} {'result':<8} {'seconds':>8} {'peak RSS':>9} {'planned':>9}  detail",
    ]
    for r in results:
        planned = f"{r.planned_gb:>7.2f}GB" if r.planned_gb else f"{'-':>9}"
        lines.append(f"{r.run:<18} {r.status:<8} {r.seconds:>8.1f} {r.peak_rss_gb:>7.2f}GB {planned}  {r.detail}")
    return "\n".join(lines)
