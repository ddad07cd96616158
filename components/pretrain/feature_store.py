"""extract_features' cache as pretrain's stage 1 reads it: the index checked against the model, each shard read only
from inside the features directory, each tensor checked against the index before it reaches the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from components._shared.model.families import family_for
from components._shared.model.vision_digest import vision_digest
from components._shared.model.vlm import qwen_model

RERUN = "re-run extract_features with the same base model as pretrain"


class FeatureStore:
    """Lazy access to extract_features' safetensors shards: pre-merger rows and grid of an image hash."""

    def __init__(self, features_dir: Path) -> None:
        index_file = features_dir / "index.json"
        if not index_file.is_file():
            raise ValueError(f"{features_dir} has no index.json; point --features at extract_features' output.")
        self.dir = features_dir
        try:
            self.index = json.loads(index_file.read_text())
        except ValueError as error:
            raise ValueError(f"{index_file} is not JSON ({error}); {RERUN}.") from None
        if not isinstance(self.index, dict) or not isinstance(self.index.get("images"), dict):
            raise ValueError(f"{index_file} has no 'images' map of image hash -> shard; {RERUN}.")
        self._handles: dict[str, Any] = {}
        self._check_files()

    def _check_files(self) -> None:
        """Every shard the index names is a file inside the features directory (no absolute path, no '..')."""
        root = self.dir.resolve()
        for name in sorted({str(e.get("file")) for e in self.index["images"].values() if isinstance(e, dict)}):
            path = (self.dir / name).resolve()
            if Path(name).is_absolute() or not path.is_relative_to(root):
                raise ValueError(f"{self.dir}/index.json names shard {name!r} outside the features directory; {RERUN}.")
            if not path.is_file():
                raise ValueError(f"{self.dir}/index.json names shard {name!r}, which is missing; {RERUN}.")

    def check(self, model, *, min_pixels: int, max_pixels: int) -> None:
        """The cache must come from this model's ViT at this resolution, or stage 1 trains on the wrong rows."""
        config = qwen_model(model).config
        family = family_for(config)
        hidden = family.vision_width(config.vision_config)
        levels = family.cached_levels(config.vision_config)
        if self.index.get("hidden_size") != hidden or self.index.get("cached_levels", []) != levels:
            raise ValueError(
                f"{self.dir}/index.json: features of width {self.index.get('hidden_size')} with DeepStack levels "
                f"{self.index.get('cached_levels', [])} from {self.index.get('model')!r}, but this model's vision "
                f"tower is {hidden} wide with levels {levels}; {RERUN}."
            )
        recorded = self.index.get("vision_digest")
        if not recorded:
            raise ValueError(
                f"{self.dir}/index.json records no vision_digest (features from an older extract_features, or an "
                f"edited index): nothing shows they come from this base model's vision tower; {RERUN}."
            )
        if recorded != vision_digest(qwen_model(model).visual):
            raise ValueError(
                f"{self.dir}/index.json: features from the vision tower of {self.index.get('model')!r}, whose weights "
                f"differ from this base model's (same width, another checkpoint or a retrained tower); {RERUN}."
            )
        for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if name in self.index and self.index[name] != value:
                raise ValueError(
                    f"{self.dir}/index.json: features extracted with {name}={self.index[name]} but "
                    f"pretrain.{name}={value}; set extract_features and pretrain to the same "
                    "min_pixels / max_pixels."
                )

    def __contains__(self, image_hash: str) -> bool:
        return image_hash in self.index["images"]

    def get(self, image_hash: str) -> tuple[torch.Tensor, list[int]]:
        """The image's pre-merger rows (float32) and grid; a shard that cannot be read, or a tensor whose shape or
        values do not match the index, stops the stage naming the shard and the image."""
        from safetensors import SafetensorError, safe_open

        entry = self.index["images"][image_hash]
        where = f"{self.dir}/{entry['file']} (image {image_hash})"
        try:
            handle = self._handles.get(entry["file"])
            if handle is None:
                handle = self._handles[entry["file"]] = safe_open(str(self.dir / entry["file"]), framework="pt")
            rows = handle.get_tensor(image_hash).float()
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{where} cannot be read ({error}): a truncated or damaged shard; {RERUN}.") from None
        grid = entry["grid_thw"]
        width = int(self.index.get("hidden_size") or 0) * (1 + len(self.index.get("cached_levels", [])))
        expected = (int(torch.tensor(grid).prod()), width)  # one row per patch; the cached levels side by side
        if tuple(rows.shape) != expected:
            raise ValueError(
                f"{where}: rows of shape {tuple(rows.shape)}, but the index's grid {grid} and width give {expected}; "
                f"{RERUN}."
            )
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(f"{where} holds NaN or infinite values; {RERUN}.")
        return rows, grid
