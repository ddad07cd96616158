"""The shape of the code, asserted: import arrows one way, no cycles, small files and functions, every imported
package declared, and `qvl compile` free of torch."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from components.stages import STAGES
from tests.codebase import ROOT, cycles, import_graph, module_name, source_files

STAGE_PACKAGES = tuple(STAGES)  # the registry names every stage package
# _shared's layers: an arrow may only point to a lower layer (data, model and launch side by side above platform;
# eval, which runs a model on data, above both).
LAYERS = {"platform": 0, "data": 1, "model": 1, "launch": 1, "eval": 2}
ALLOWED_UP = {
    # builtin:NAME model URIs are built by the synthetic world (imported lazily, only there).
    ("components._shared.model.sources", "components.synth_world"),
    ("components._shared.model.sources", "components.synth_world.builtin_models"),
}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS = {
    # The pipeline function is the DAG: one task per stage and its wiring, read top to bottom like the stage
    # list; KFP needs every task inside the @dsl.pipeline body, and build_pipeline is the closure that holds it.
    "pipelines/vlm_training.py:build_pipeline",
    "pipelines/vlm_training.py:vlm_training",
    # A KFP component: 20 typed parameters and their Args documentation (the KFP UI shows them), one call.
    "components/preflight/component.py:preflight_op",
    # The synthetic world's generators and the builtin CLIP's training loop: their RNG order decides the data and
    # the cached helper models bit for bit; lake.py's code even keys that cache. Split with the next recipe change.
    "components/synth_world/clip.py:train_clip",
    "components/synth_world/lake.py:write_lake",
    "components/synth_world/splits.py:write_splits",
    # Structured pruning: reworked for the newer model generations (the model-family work), split then.
    "components/distill/prune.py:plan_pruning",
    "components/distill/prune.py:measure_importance",
}


def _stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "components" and parts[1] in STAGE_PACKAGES else None


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_shared_imports_no_stage_nor_pipelines_and_its_layers_point_down():
    bad = []
    for module, deps in import_graph().items():
        if not module.startswith("components._shared."):
            continue
        layer = module.split(".")[2]
        for dep in deps:
            if (module, dep) in ALLOWED_UP:
                continue
            if dep.startswith("pipelines") or _stage_of(dep) or dep.startswith("components.synth_world"):
                bad.append(f"{module} -> {dep}")
            elif dep.startswith("components._shared.") and layer in LAYERS:
                target = dep.split(".")[2]
                if target in LAYERS and target != layer and LAYERS[target] >= LAYERS[layer]:
                    bad.append(f"{module} -> {dep} (layer {layer} may not import {target})")
    assert bad == []


def test_stages_talk_through_artifacts_not_imports():
    bad = [
        f"{module} -> {dep}"
        for module, deps in import_graph().items()
        for dep in deps
        if _stage_of(module) and _stage_of(dep) and _stage_of(dep) != _stage_of(module)
    ]
    assert bad == []


def test_stage_logic_never_imports_kfp():
    bad = []
    for path in source_files():
        module = module_name(path)
        if _stage_of(module) and not module.endswith(".component"):
            if re.search(r"^\s*(from|import) kfp\b", path.read_text(), re.M):
                bad.append(module)
    assert bad == []


def test_files_stay_small():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in source_files()}
    long = {path: n for path, n in lengths.items() if n > MAX_FILE_LINES}
    assert long == {}, f"files over {MAX_FILE_LINES} lines: split them by responsibility"


def test_functions_stay_short():
    long = {}
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{path.relative_to(ROOT)}:{node.name}"
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS:
                    long[name] = length
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps"


def test_every_imported_package_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name.lower().replace("_", "-") for r in project["dependencies"]}
    owners = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("components", "pipelines", "tests", "bench"):
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [])}
                if not dists & declared:
                    undeclared.setdefault(top, str(path.relative_to(ROOT)))
    assert undeclared == {}, "imported but not in pyproject.toml [project] dependencies"


def test_qvl_compile_does_not_import_torch(tmp_path):
    """Compiling the pipeline (CI, a laptop without a GPU stack) needs kfp and pydantic, never torch."""
    code = (
        "import sys\n"
        "from pipelines.compile import compile_pipeline\n"
        f"compile_pipeline('prod-7b', {str(tmp_path / 'p.yaml')!r})\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'deepspeed', 'peft') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout
    assert (tmp_path / "p.yaml").stat().st_size > 10_000


def test_the_local_runner_still_matches_kfp_local_cache_lookups(tmp_path):
    """pipelines/qvl/local_run.py wraps kfp.local's LocalCache.get to learn which tasks were cache hits (kfp has no
    hook for it; docs/architecture.md): the executor must still look hits up through that method, and a hit must
    still hand back artifacts with their URIs (where the earlier run's _stage_result.json lies)."""
    from kfp import dsl
    from kfp.local import cache as kfp_cache
    from kfp.local.orchestrator import task_executor

    assert "local_cache.get(cache_key)" in inspect.getsource(task_executor)
    (tmp_path / "artifact").mkdir()
    local = kfp_cache.LocalCache(str(tmp_path / "cache"))
    local.put("key", {"output": dsl.Model(name="output", uri=str(tmp_path / "artifact"))})

    from pipelines.qvl.local_run import _recording_cache_hits

    original = kfp_cache.LocalCache.get
    with _recording_cache_hits() as hits:
        assert local.get("key") is not None and local.get("missing") is None
    assert [h["output"].uri for h in hits] == [str(tmp_path / "artifact")]
    assert kfp_cache.LocalCache.get is original  # restored after the run


def test_the_local_runner_still_matches_kfp_locals_task_stream():
    """pipelines/qvl/local_run.py replaces kfp.local's `run_local_subprocess` to send each task's output to its log
    file (docs/architecture.md): the subprocess handler must still call it by its module-level name with the
    full command and env, and the lightweight components' command must still name the function it runs."""
    from kfp.local import subprocess_task_handler

    source = inspect.getsource(subprocess_task_handler.SubprocessTaskHandler.run)
    assert "run_local_subprocess(" in source and "full_command=full_command" in source and "env_vars=" in source
    assert list(inspect.signature(subprocess_task_handler.run_local_subprocess).parameters) == [
        "full_command",
        "env_vars",
    ]
    from components.sft.component import sft_op
    from pipelines.qvl.task_logs import task_name as _task_name

    container = sft_op.component_spec.implementation.container
    assert _task_name([*container.command, *container.args]) == "sft_op"


@pytest.mark.parametrize("path", [".ci/run", ".pre-commit-config.yaml", ".github/workflows/pr.yml", "Makefile"])
def test_every_entry_point_runs_the_same_gates(path):
    text = (ROOT / path).read_text()
    if path == ".pre-commit-config.yaml":
        assert all(hook in text for hook in ("ruff check", "ruff format", "mypy"))
    else:
        assert ".ci/lint" in text
    lint = (ROOT / ".ci/lint").read_text()
    assert all(cmd in lint for cmd in ("ruff check .", "ruff format --check .", "mypy"))


def test_the_training_loop_takes_a_handful_of_parameters_and_hands_its_model_to_the_callbacks():
    """TrainLoop is built from its settings, its data and its store (docs/architecture.md): no side channels on the
    model (the export dtype travels in LoadedVlm) nor module-level lists (set-aside checkpoints are in the result)."""
    from components._shared.model import checkpoint, vlm
    from components._shared.model.training import TrainLoop, TrainResult

    params = [p for p in inspect.signature(TrainLoop.__init__).parameters if p != "self"]
    assert params == ["model", "settings", "data", "checkpoints", "tracker", "loss_fn", "extra"]
    assert "set_aside" in TrainResult.__dataclass_fields__ and not hasattr(checkpoint, "SET_ASIDE")
    assert vlm.LoadedVlm._fields == ("model", "processor", "stored_dtype")
    sources = "\n".join(p.read_text() for p in source_files())
    assert "qvl_checkpoint_dtype" not in sources


def test_the_docker_runner_still_matches_kfp_locals_container_start():
    """pipelines/qvl/docker_tasks.py replaces kfp.local's `run_docker_container` (docs/images.md): the docker handler
    must still call it by its module-level name with the client, image, command and volumes as keywords."""
    from kfp.local import docker_task_handler

    source = inspect.getsource(docker_task_handler.DockerTaskHandler.run)
    assert "run_docker_container(" in source
    assert all(f"{name}=" in source for name in ("client", "image", "command", "volumes"))
    parameters = list(inspect.signature(docker_task_handler.run_docker_container).parameters)
    assert parameters[:4] == ["client", "image", "command", "volumes"]
