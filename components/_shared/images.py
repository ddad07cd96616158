"""Container images of the components, tagged with the package version (never `:latest`).

Override the registry with QVL_IMAGE_REGISTRY at compile time (e.g. your own mirror).
"""

import os

from components import __version__

REGISTRY = os.environ.get("QVL_IMAGE_REGISTRY", "ghcr.io/qwen-vl-pipeline")
TRAIN_IMAGE = f"{REGISTRY}/train:{__version__}"  # CUDA, torch, deepspeed, DALI: GPU stages
DATA_IMAGE = f"{REGISTRY}/data:{__version__}"  # CPU, OCR/NSFW models: data and control stages
