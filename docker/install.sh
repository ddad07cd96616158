#!/usr/bin/env bash
# Install the package into the image's Python (a venv on PATH): `pip install .` (not editable, no dev extras)
# with the torch / torchvision / deepspeed pins of pyproject.toml, which the Dockerfiles pass as ARGs
# (tests/pipeline/test_images.py checks that the two agree). Three steps, one Docker layer each, so that a
# change to the code does not rebuild torch and DeepSpeed's ops, and a new dependency does not either:
#
#   bash docker/install.sh torch                    torch, torchvision, DeepSpeed (+ ops), flash-attn if asked
#   bash docker/install.sh deps pyproject.toml      the package's dependencies
#   bash docker/install.sh package SRC_DIR          the package itself, then `pip check`
#
# Environment (the Dockerfiles' ARGs):
#   TORCH_VERSION TORCHVISION_VERSION DEEPSPEED_VERSION   required
#   TORCH_INDEX_URL      optional index for torch/torchvision only (e.g. the CPU wheels of the PyTorch index)
#   DS_BUILD_OPS_LIST    DeepSpeed ops to prebuild, e.g. "CPU_ADAM FUSED_ADAM UTILS" (empty: all JIT)
#   WITH_FLASH_ATTN      1 to build flash-attn (FLASH_ATTN_VERSION) from source; long, see docs/images.md
#   VERSION              when set, must equal components.__version__ (the tag the image gets)
set -euo pipefail

: "${TORCH_VERSION:?}" "${TORCHVISION_VERSION:?}" "${DEEPSPEED_VERSION:?}"
pip=(python -m pip install --no-cache-dir --disable-pip-version-check --root-user-action=ignore)

# The pins are constraints of every step: a dependency asking for another torch fails the build instead of
# silently replacing the pair that imports together.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\ntorchvision==%s\ndeepspeed==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" "$DEEPSPEED_VERSION" \
    >"$constraints"

install_torch() {
    local torch_index=()
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then torch_index=(--index-url "$TORCH_INDEX_URL"); fi
    "${pip[@]}" "${torch_index[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

    # DeepSpeed builds against the installed torch, so without build isolation (an isolated build would fetch
    # another torch); these are its build requirements.
    "${pip[@]}" -c "$constraints" numpy packaging "setuptools>=70.1" wheel ninja psutil py-cpuinfo hjson
    local op
    for op in ${DS_BUILD_OPS_LIST:-}; do export "DS_BUILD_${op}=1"; done
    DS_BUILD_OPS=0 "${pip[@]}" -c "$constraints" --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
    if [[ -n "${DS_BUILD_OPS_LIST:-}" ]]; then
        # setup.py skips a requested op it finds incompatible with only a warning; fail the build instead.
        # shellcheck disable=SC2086  # one argument per op
        python - ${DS_BUILD_OPS_LIST} <<'PY'
import sys

from deepspeed.git_version_info import installed_ops

missing = [op for op in sys.argv[1:] if not installed_ops.get(op.lower())]
if missing:
    sys.exit(f"DeepSpeed ops requested but not prebuilt: {missing}; installed_ops={installed_ops}")
print("DeepSpeed prebuilt ops:", sorted(op for op, built in installed_ops.items() if built))
PY
    fi

    if [[ "${WITH_FLASH_ATTN:-0}" == 1 ]]; then
        : "${FLASH_ATTN_VERSION:?WITH_FLASH_ATTN=1 needs FLASH_ATTN_VERSION}"
        # Built here against this torch/CUDA (never a downloaded prebuilt wheel), for TORCH_CUDA_ARCH_LIST's archs.
        "${pip[@]}" -c "$constraints" einops
        FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$(tr -d . <<<"${TORCH_CUDA_ARCH_LIST:-8.0;9.0}")" \
            "${pip[@]}" -c "$constraints" --no-build-isolation "flash-attn==$FLASH_ATTN_VERSION"
    fi
}

install_deps() {
    local pyproject=${1:?usage: install.sh deps PATH/TO/pyproject.toml}
    local requirements
    requirements=$(mktemp)
    python - "$pyproject" >"$requirements" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
    "${pip[@]}" -c "$constraints" -r "$requirements"
    rm -f "$requirements"
}

install_package() {
    local src=${1:?usage: install.sh package SRC_DIR}
    # A tag that says 0.2.0 on an image holding 0.1.0 would be worse than no image.
    if [[ -n "${VERSION:-}" ]]; then
        local package_version
        package_version=$(cd "$src" && python -c "import components; print(components.__version__)")
        if [[ "$package_version" != "$VERSION" ]]; then
            echo "install.sh: VERSION=$VERSION but the package is $package_version; build with 'make images'." >&2
            exit 1
        fi
    fi
    "${pip[@]}" -c "$constraints" "$src"
    python -m pip check
}

step=${1:?usage: install.sh torch | deps PYPROJECT | package SRC_DIR}
shift
case "$step" in
    torch) install_torch ;;
    deps) install_deps "$@" ;;
    package) install_package "$@" ;;
    *) echo "install.sh: unknown step '$step' (torch, deps, package)" >&2; exit 2 ;;
esac
