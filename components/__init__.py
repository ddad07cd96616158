"""Stage code of the Qwen-VL training pipeline. One sub-package per stage; `_shared` holds plumbing only."""

__version__ = "0.1.0"
