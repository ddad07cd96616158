"""Security checks over the code, the loaders, the containers and what a stage leaves behind."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("components", "pipelines", "bench")
UNPICKLERS = {
    ("pickle", "load"),
    ("pickle", "loads"),
    ("dill", "load"),
    ("dill", "loads"),
    ("joblib", "load"),
    ("cloudpickle", "load"),
    ("cloudpickle", "loads"),
    ("pd", "read_pickle"),
    ("pandas", "read_pickle"),
}


def _calls():
    for directory in CODE_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    yield path.relative_to(ROOT), node


def _dotted(func) -> tuple[str, str] | None:
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id, func.attr
    return None


def _keyword(node: ast.Call, name: str):
    return next((k.value for k in node.keywords if k.arg == name), None)


def test_no_code_path_unpickles_or_trusts_remote_code():
    """Every torch.load passes weights_only=True, trust_remote_code is only ever the literal False, nothing calls
    an unpickler or np.load(allow_pickle=True)."""
    problems, torch_loads, remote_code_flags, calls = [], 0, 0, 0
    for path, node in _calls():
        calls += 1
        name = _dotted(node.func)
        where = f"{path}:{node.lineno}"
        if name == ("torch", "load"):
            torch_loads += 1
            value = _keyword(node, "weights_only")
            if not (isinstance(value, ast.Constant) and value.value is True):
                problems.append(f"{where}: torch.load without weights_only=True")
        if name in UNPICKLERS:
            problems.append(f"{where}: {'.'.join(name)} unpickles")
        if name and name[1] == "load" and name[0] in ("np", "numpy"):
            value = _keyword(node, "allow_pickle")
            if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
                problems.append(f"{where}: np.load with allow_pickle")
        flag = _keyword(node, "trust_remote_code")
        if flag is not None:
            remote_code_flags += 1
            if not (isinstance(flag, ast.Constant) and flag.value is False):
                problems.append(f"{where}: trust_remote_code is not the literal False")
    print(
        f"checked {calls} calls: {torch_loads} torch.load (all weights_only=True), {remote_code_flags} "
        "trust_remote_code flags (all False), no unpickler"
    )
    assert not problems, "\n".join(problems)
    assert torch_loads >= 1 and remote_code_flags >= 5  # the scan sees the loaders it is meant to police


def test_model_directories_with_pickle_weights_are_refused(tmp_path):
    from components._shared.model.sources import resolve_model
    from components._shared.model.vlm import load_vlm

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    torch.save({"w": torch.zeros(1)}, model_dir / "pytorch_model.bin")
    for load in (resolve_model, load_vlm):
        with pytest.raises(ValueError, match="pickle"):
            load(str(model_dir))


class _Payload:
    """Unpickling this runs `touch MARKER`: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_carrying_code_is_refused_without_running_it(tmp_path):
    from safetensors.torch import save_file

    from components._shared.model.checkpoint import load_torch_state

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, str(tmp_path / "trainable.safetensors"))
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Payload(marker), "scheduler": {}}, tmp_path / "optimizer.pt")
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|global"):
        load_torch_state(tmp_path, model, optimizer, scheduler)
    assert not marker.exists()


def test_containers_run_as_a_non_root_user_and_hold_no_secrets():
    dockerfiles = sorted((ROOT / "docker").glob("Dockerfile*"))
    assert dockerfiles
    for dockerfile in dockerfiles:
        lines = [line.strip() for line in dockerfile.read_text().splitlines()]
        users = [line.split(None, 1)[1] for line in lines if line.upper().startswith("USER ")]
        assert users, f"{dockerfile.name} never switches away from root"
        uid = users[-1].split(":")[0]
        assert uid not in ("root", "0"), f"{dockerfile.name} ends as {users[-1]}"
        secretish = [line for line in lines if re.match(r"(?i)(ENV|ARG)\s+\S*(SECRET|PASSWORD|TOKEN|ACCESS_KEY)", line)]
        assert not secretish, f"{dockerfile.name} bakes a credential into the image: {secretish}"
    print(f"{len(dockerfiles)} Dockerfiles end as a non-root USER and set no credential")


def test_no_secret_value_reaches_outputs_mlflow_or_logs(tmp_path):
    """A clean_data run with credentials in its environment (as the Kubernetes secrets put them there): the
    values appear in none of its outputs, the MLflow store (params, tags, metrics, artifacts) or its logs."""
    from components.synth_world.lake import write_world

    write_world(tmp_path / "world", records=40, seed=4)
    canaries = {
        "AWS_SECRET_ACCESS_KEY": "canary-secret-4f1c9b",
        "AWS_ACCESS_KEY_ID": "canary-key-8d2e77",
        "QVL_TEST_TOKEN": "canary-token-0a5b3c",
    }
    out = tmp_path / "out"
    env = {**os.environ, **canaries, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "components.clean_data",
        "--lake-uri",
        str(tmp_path / "world/lake"),
        "--output-dir",
        str(out),
        "clip_enabled=false",
        "nsfw_enabled=false",
        "ocr_enabled=false",
        "outlier_enabled=false",
        "min_pixels=3136",
        "max_pixels=50176",
    ]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    haystacks = [("stdout", done.stdout.encode()), ("stderr", done.stderr.encode())]
    haystacks += [
        (str(p.relative_to(tmp_path)), p.read_bytes())
        for p in tmp_path.rglob("*")
        if p.is_file() and "world" not in p.parts
    ]
    assert (tmp_path / "mlflow.db").exists() and any(out.rglob("*"))
    assert _leaks(haystacks, canaries) == []
    # the scan itself can fail: a value planted in an output is found
    assert _leaks([*haystacks, ("out/planted.txt", b"x" + canaries["AWS_ACCESS_KEY_ID"].encode())], canaries) == [
        ("AWS_ACCESS_KEY_ID", "out/planted.txt")
    ]
    print(
        f"scanned {len(haystacks)} outputs, logs and MLflow files "
        f"({sum(len(d) for _, d in haystacks) / 1e6:.1f} MB): no credential value"
    )


def _leaks(haystacks: list[tuple[str, bytes]], canaries: dict[str, str]) -> list[tuple[str, str]]:
    return [(name, where) for where, data in haystacks for name, value in canaries.items() if value.encode() in data]
