# Container images (docker/) and a few shortcuts. docs/images.md explains the images.
#
#   make images                       build the data (CPU) and train (CUDA) images
#   make images IMAGE_REGISTRY=reg/ml tag for your registry (compile with the same QVL_IMAGE_REGISTRY)
#   make images WITH_FLASH_ATTN=1     train image with flash-attn (also TORCH_CUDA_ARCH_LIST, DS_BUILD_OPS_LIST)
#   make image-data | image-train     one of them (data: DATA_BASE=..., DATA_TORCH_INDEX_URL=...)
#   make push                         push both tags
#   make lint-docker                  hadolint both Dockerfiles with .hadolint.yaml
#   make print-tags                   the tags, exactly as components/_shared/platform/container_images.py spells them
#   make local-base                   debootstrap a bookworm + python3.11 base image (no registry needed)
#   make images-cpu                   both images on that base, the train image for the CPU (runs here)
#   make prune-builders               remove the train image's untagged builder stages (~8.4 GB each)
#   make compile | make test          qvl compile / the default test run
#   make lint                         ruff check, ruff format --check, mypy (what CI and pre-commit run)
#   make format                       ruff format + the import order fixed in place
#
# The engine is docker when its daemon answers `docker info`, else buildah (`buildah bud --isolation chroot`,
# which needs no daemon); force one with ENGINE=docker or ENGINE=buildah.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
PYTHON ?= python3

# Tags: <registry>/<kind>:<package version>, as in components/_shared/platform/container_images.py. The version is always the
# package's (a command-line VERSION=... is ignored): an image tag that lies about its content is worse than none.
override VERSION := $(shell $(PYTHON) -c "import components; print(components.__version__)")
ifeq ($(VERSION),)
$(error could not read components.__version__ with $(PYTHON); run make from the repo root)
endif
# The registry: IMAGE_REGISTRY, else QVL_IMAGE_REGISTRY, else container_images.py's default (it reads the same
# QVL_IMAGE_REGISTRY, so `make` and `qvl compile` agree).
ifeq ($(origin IMAGE_REGISTRY),undefined)
IMAGE_REGISTRY := $(shell $(PYTHON) -c "from components._shared.platform.container_images import REGISTRY; print(REGISTRY)")
endif
TRAIN_IMAGE := $(IMAGE_REGISTRY)/train:$(VERSION)
DATA_IMAGE := $(IMAGE_REGISTRY)/data:$(VERSION)

ENGINE ?= $(shell if docker info >/dev/null 2>&1; then echo docker; \
                  elif command -v buildah >/dev/null 2>&1; then echo buildah; fi)
ifeq ($(ENGINE),buildah)
# --format docker: the OCI format drops SHELL (pipefail) from the Dockerfiles.
BUILD := buildah bud --isolation chroot --format docker --layers --force-rm
else
BUILD := $(ENGINE) build
endif
# Extra flags for the build command, e.g. BUILD_FLAGS="--pull=false" or buildah's --volume for a CA bundle.
BUILD_FLAGS ?=

REVISION := $(shell git rev-parse --short HEAD 2>/dev/null)
SOURCE := $(shell git remote get-url origin 2>/dev/null | sed -E 's#//[^/@]*@#//#')
COMMON_ARGS = --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) --build-arg SOURCE=$(SOURCE)

# Train image knobs (docs/images.md): flash-attn, GPU archs, prebuilt DeepSpeed ops.
WITH_FLASH_ATTN ?= 0
TORCH_CUDA_ARCH_LIST ?=
DS_BUILD_OPS_LIST ?=
TRAIN_ARGS = --build-arg WITH_FLASH_ATTN=$(WITH_FLASH_ATTN) \
	$(if $(TORCH_CUDA_ARCH_LIST),--build-arg TORCH_CUDA_ARCH_LIST="$(TORCH_CUDA_ARCH_LIST)") \
	$(if $(DS_BUILD_OPS_LIST),--build-arg DS_BUILD_OPS_LIST="$(DS_BUILD_OPS_LIST)")
# Data image knobs: another base (e.g. the one `make local-base` makes), the PyTorch CPU wheel index.
DATA_BASE ?=
DATA_TORCH_INDEX_URL ?=
DATA_ARGS = $(if $(DATA_BASE),--build-arg BASE=$(DATA_BASE)) \
	$(if $(DATA_TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(DATA_TORCH_INDEX_URL))

# `make local-base`: a Debian bookworm rootfs with python3.11 (+ venv) as a local image of the engine, for building
# where base images cannot be pulled. Needs root and debootstrap. It trusts the build host's CA bundle
# (HOST_CA_BUNDLE), so that pip in the builds works behind a TLS-intercepting proxy; the image stays local.
LOCAL_BASE ?= localhost/qvl-base:bookworm-py3.11
DEBIAN_MIRROR ?= http://deb.debian.org/debian
BASE_ROOTFS ?= build/bookworm-rootfs
HOST_CA_BUNDLE ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
# `make images-cpu`: both images on LOCAL_BASE, the train image with DeepSpeed's CPU accelerator and no
# prebuilt ops (no CUDA image to compile them in); its RUNs reach the package registry on the host's network.
CPU_NETWORK ?= host
CPU_TRAIN_ARGS = --build-arg BUILDER_BASE=$(LOCAL_BASE) --build-arg RUNTIME_BASE=$(LOCAL_BASE) \
	--build-arg DS_ACCELERATOR=cpu --build-arg DS_BUILD_OPS_LIST=

PRESET ?= prod-7b
PIPELINE_YAML ?= pipelines/compiled/vlm_training.yaml

.PHONY: help images images-cpu image-data image-train push lint-docker print-tags local-base buildah-base compile \
	prune-builders test lint format check-engine

help:
	@sed -n 's/^#   make/  make/p' $(MAKEFILE_LIST)

print-tags:
	@echo "TRAIN_IMAGE=$(TRAIN_IMAGE)"
	@echo "DATA_IMAGE=$(DATA_IMAGE)"

check-engine:
	@test -n "$(ENGINE)" || { echo "No image builder: start a docker daemon or install buildah (ENGINE=...)." >&2; exit 1; }

images: image-data image-train

image-data: check-engine
	$(BUILD) $(BUILD_FLAGS) -f docker/Dockerfile.data $(COMMON_ARGS) $(DATA_ARGS) -t $(DATA_IMAGE) .

image-train: check-engine
	$(BUILD) $(BUILD_FLAGS) -f docker/Dockerfile.train $(COMMON_ARGS) $(TRAIN_ARGS) -t $(TRAIN_IMAGE) .

push: check-engine
	$(ENGINE) push $(DATA_IMAGE)
	$(ENGINE) push $(TRAIN_IMAGE)

prune-builders: check-engine
	if [[ "$(ENGINE)" == docker ]]; then \
		docker image prune --force --filter label=org.qwen-vl-pipeline.stage=builder; \
	else \
		buildah rmi --prune; \
	fi

lint-docker:
	hadolint --config .hadolint.yaml docker/Dockerfile.train docker/Dockerfile.data

images-cpu: check-engine
	$(BUILD) $(BUILD_FLAGS) --network $(CPU_NETWORK) -f docker/Dockerfile.data $(COMMON_ARGS) \
		--build-arg BASE=$(LOCAL_BASE) -t $(DATA_IMAGE) .
	$(BUILD) $(BUILD_FLAGS) --network $(CPU_NETWORK) -f docker/Dockerfile.train $(COMMON_ARGS) $(CPU_TRAIN_ARGS) \
		-t $(TRAIN_IMAGE) .

local-base: check-engine
	rm -rf $(BASE_ROOTFS) $(BASE_ROOTFS).tar
	mkdir -p $(dir $(BASE_ROOTFS))
	debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-distutils,ca-certificates \
		bookworm $(BASE_ROOTFS) $(DEBIAN_MIRROR)
	$(if $(HOST_CA_BUNDLE),cp $(HOST_CA_BUNDLE) $(BASE_ROOTFS)/etc/ssl/certs/ca-certificates.crt)
	rm -rf $(BASE_ROOTFS)/var/lib/apt/lists/* $(BASE_ROOTFS)/var/cache/apt/archives/*.deb
	tar -C $(BASE_ROOTFS) -cf $(BASE_ROOTFS).tar .
	if [[ "$(ENGINE)" == docker ]]; then \
		docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
			--change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' $(BASE_ROOTFS).tar $(LOCAL_BASE) >/dev/null; \
	else \
		ctr=$$(buildah from scratch); \
		buildah add --quiet "$$ctr" $(BASE_ROOTFS).tar / >/dev/null; \
		buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
			--cmd /bin/bash "$$ctr"; \
		buildah commit --quiet --rm "$$ctr" $(LOCAL_BASE); \
	fi
	rm -rf $(BASE_ROOTFS) $(BASE_ROOTFS).tar
	@echo "Now: make images-cpu (or make image-data DATA_BASE=$(LOCAL_BASE))"

buildah-base: ENGINE = buildah
buildah-base: local-base

compile:
	QVL_IMAGE_REGISTRY=$(IMAGE_REGISTRY) $(PYTHON) -m pipelines.qvl.app compile --preset $(PRESET) --out $(PIPELINE_YAML)

test:
	$(PYTHON) -m pytest -q

lint:
	bash .ci/lint

format:
	$(PYTHON) -m ruff check --select I --fix .
	$(PYTHON) -m ruff format .
