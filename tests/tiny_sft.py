"""A briefly fine-tuned tiny Qwen2.5-VL for the tests of the stages downstream of SFT (rl, distill, select).

A random init answers nothing in the data's format (its samples all score 0, its distribution is near uniform),
so those stages need a model that has seen the data. One recipe, sized per test by `steps` and `train` fields.
"""

from pathlib import Path

from components._shared.platform.tracking import NullTracker

BASE = "builtin:tiny-qwen2_5-vl"


def train_tiny_sft(data_dir: Path, out: Path, *, steps: int, **train) -> Path:
    """Full SFT of the builtin tiny model on `data_dir` (3,136-pixel images, lr 0.01); returns `out`/model."""
    from components.sft.config import SftConfig
    from components.sft.stage import run as sft

    cfg = SftConfig.model_validate(
        {
            "mode": "full",
            "min_pixels": 3136,
            "max_pixels": 3136,
            "calibration": {"enabled": False},
            "train": {"steps": steps, "samples_per_step": 8, "max_tokens_per_micro_batch": 512, "threads": 1, **train},
            "optim": {"lr": 0.01},
            "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 6},
        }
    )
    sft(cfg, base_model=BASE, data=str(data_dir), output_dir=out, tracker=NullTracker())
    return Path(out) / "model"
