"""extract_features: cache the frozen vision tower's pre-merger features of every kept image.

1 process (CPU/tiny):  python -m components.extract_features --config pipelines/presets/tiny.yaml \
                           --clean-data OUT/clean_data --base-model builtin:tiny-qwen2_5-vl \
                           --output-dir OUT/features
1 GPU (DALI decode):   python -m components.extract_features --config pipelines/presets/prod-7b.yaml \
                           --clean-data OUT/clean_data --base-model s3://models/Qwen2.5-VL-7B-Instruct \
                           --output-dir OUT/features
One process per node and GPU; multi-GPU sharding of the kept parts is not implemented yet.
In the pipeline:       components/extract_features/component.py calls run_stage("extract_features", ...).

Reads clean_data's `kept/part-*.parquet`, decodes each image (decode.py), resizes and patchifies it exactly as
Qwen2VLImageProcessor does, runs the vision tower up to (not including) the merger and writes
`features-NNNNN.safetensors` ("<image_hash>" -> [rows, hidden], "<image_hash>.grid_thw" -> int64 [3]) and
`index.json`. The rows are stored
in processor order (the tower's window-attention permutation undone), so `merger(rows)` is the tower's output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from components._shared.model.device import resolve_device
from components._shared.model.families import family_for
from components._shared.model.sources import resolve_model
from components._shared.model.vision_digest import weights_digest
from components._shared.platform import progress
from components._shared.platform.tracking import Tracker
from components.extract_features.config import ExtractFeaturesConfig
from components.extract_features.decode import (
    JPEG_MAGIC,
    DaliJpegDecoder,
    PatchSpec,
    choose_backend,
    decode_pil,
    decode_torchvision,
    patch_rows,
    resize_for_qwen,
)

INPUT_COLUMNS = ("image_hash", "image", "image_format", "caption", "visual_tokens", "width", "height")
INDEX_FILE = "index.json"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Record:
    image_hash: str
    image: bytes
    image_format: str | None
    caption: str
    visual_tokens: int | None
    size: tuple[int, int] | None = None  # (width, height) clean_data measured, upright


class _MergeGroupsAsRows(torch.nn.Module):
    """Takes the merger's place: returns each merge group's pre-merger rows unchanged, side by side in a row.

    The tower applies its own window-attention un-permutation to the merger output, per merge group, so the
    rows come back in processor order and no merger weight is ever run.
    """

    def __init__(self, merge_unit: int) -> None:
        super().__init__()
        self.merge_unit = merge_unit

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.reshape(-1, self.merge_unit * hidden_states.shape[-1])


def _vision_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The vision tower's tensors from the model's safetensors files, with the `visual.` prefix removed."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"{model_dir}: no model.safetensors(.index.json); only safetensors checkpoints are loaded (never pickle)."
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                for prefix in ("model.visual.", "visual."):
                    if key.startswith(prefix):
                        state[key[len(prefix) :]] = handle.get_tensor(key)
                        break
    return state


def _model_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_vision_tower(
    model_dir: Path, *, dtype: torch.dtype, device: torch.device, weights: dict[str, torch.Tensor] | None = None
) -> tuple[torch.nn.Module, PatchSpec]:
    """The frozen vision tower of a Qwen VL checkpoint, its mergers replaced (_MergeGroupsAsRows); `weights`: its
    vision weights when the caller has read them already (`_vision_weights`)."""
    config = _model_config(model_dir)
    try:
        family = family_for(config)
    except ValueError as err:
        raise ValueError(f"base_model {model_dir}: {err}") from None
    tower_cls = family.vision_tower_class()
    flash = device.type == "cuda" and dtype != torch.float32 and importlib.util.find_spec("flash_attn") is not None
    tower = tower_cls._from_config(
        config.vision_config, attn_implementation="flash_attention_2" if flash else "sdpa", dtype=dtype
    )
    missing, unexpected = tower.load_state_dict(_vision_weights(model_dir) if weights is None else weights, strict=True)
    missing = [key for key in missing if not key.startswith("merger.")]
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: vision weights do not fit the config (missing {missing[:5]}, unexpected {unexpected[:5]})."
        )
    merge_size = int(config.vision_config.spatial_merge_size)
    tower.merger = _MergeGroupsAsRows(merge_size * merge_size)
    for level in range(len(family.cached_levels(config.vision_config))):  # DeepStack: their inputs are cached too
        tower.deepstack_merger_list[level] = _MergeGroupsAsRows(merge_size * merge_size)
    tower.requires_grad_(False).eval().to(device)
    return tower, PatchSpec.from_model_dir(model_dir, config.vision_config)


@torch.no_grad()
def pre_merger_features(tower: torch.nn.Module, rows: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """Per image [tokens_pre_merge, hidden * levels] features of a packed batch (rows of n images, grid_thw [n, 3]):
    the last block's output, then each cached DeepStack block's output (Qwen3-VL), side by side."""
    dtype = next(tower.parameters()).dtype
    output = tower(rows.to(dtype), grid_thw=grid_thw)
    hidden = output.last_hidden_state.shape[-1]
    levels = [output.pooler_output, *(getattr(output, "deepstack_features", None) or [])]
    features = torch.cat([level.reshape(-1, hidden) for level in levels], dim=-1)
    return list(features.split(grid_thw.prod(-1).tolist()))


def count_rows(parts: list[Path]) -> int:
    """Rows in the parquet files, from their footers (nothing decoded)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(path).metadata.num_rows for path in parts)


def iter_records(parts: list[Path], batch_size: int) -> Iterator[list[Record]]:
    """Kept records in file order, `batch_size` at a time (a file's last batch may be short)."""
    import pyarrow.parquet as pq

    for path in parts:
        handle = pq.ParquetFile(path)
        names = set(handle.schema_arrow.names)
        lacking = [column for column in ("image_hash", "image") if column not in names]
        if lacking:
            raise ValueError(f"{path}: missing column(s) {lacking}; expected clean_data's kept parquet format.")
        columns = [column for column in INPUT_COLUMNS if column in names]
        for table in handle.iter_batches(batch_size=batch_size, columns=columns):
            data = table.to_pydict()
            count = len(data["image_hash"])
            yield [
                Record(
                    image_hash=data["image_hash"][i],
                    image=data["image"][i],
                    image_format=data.get("image_format", [None] * count)[i],
                    caption=data.get("caption", [""] * count)[i] or "",
                    visual_tokens=data.get("visual_tokens", [None] * count)[i],
                    size=(data["width"][i], data["height"][i]) if "width" in data and "height" in data else None,
                )
                for i in range(count)
            ]


def _decode_error(record: Record, backend: str, err: BaseException) -> ValueError:
    return ValueError(
        f"image_hash {record.image_hash}: cannot decode its {record.image_format or 'image'} bytes with the "
        f"{backend} backend ({type(err).__name__}: {err}); clean_data should have rejected it - "
        "rerun clean_data on this lake."
    )


class BatchPreparer:
    """Decodes and resizes a batch of records with the chosen backend (uint8 on CPU, float on GPU)."""

    def __init__(self, cfg: ExtractFeaturesConfig, backend: str, device: torch.device, spec: PatchSpec) -> None:
        self.cfg, self.backend, self.spec = cfg, backend, spec
        self.pool = ThreadPoolExecutor(cfg.decode_workers) if cfg.decode_workers > 0 else None
        self.dali = None
        if backend == "dali":
            device_id = (device.index or 0) if device.type == "cuda" else None
            self.dali = DaliJpegDecoder(
                max_batch_size=cfg.batch_size, device_id=device_id, num_threads=max(1, cfg.decode_workers)
            )

    def _resize(self, record: Record, image: torch.Tensor) -> torch.Tensor:
        decoded = (image.shape[-1], image.shape[-2])
        if record.size is not None and decoded != tuple(record.size):  # same token count possible when transposed
            raise ValueError(
                f"image_hash {record.image_hash}: decoded {decoded[0]}x{decoded[1]} by the {self.backend} backend, "
                f"but clean_data measured {record.size[0]}x{record.size[1]} (an EXIF orientation one decoder applies "
                "and the other does not?): the features would be of another picture; try decode_backend: pil"
            )
        try:
            return resize_for_qwen(
                image, factor=self.spec.factor, min_pixels=self.cfg.min_pixels, max_pixels=self.cfg.max_pixels
            )
        except ValueError as err:  # smart_resize refuses aspect ratios over 200
            raise ValueError(f"image_hash {record.image_hash}: cannot be resized for the model ({err}).") from None

    def _cpu_one(self, record: Record) -> torch.Tensor:
        decode: Callable[[bytes], torch.Tensor] = decode_pil if self.backend == "pil" else decode_torchvision
        try:
            image = decode(record.image)
        except Exception as err:  # noqa: BLE001 - any decoder failure names the record
            raise _decode_error(record, "pil" if self.backend == "pil" else "torchvision", err) from None
        return self._resize(record, image)

    def __call__(self, records: list[Record]) -> list[torch.Tensor]:
        if self.dali is not None:
            return self._with_dali(records)
        if self.pool is None:
            return [self._cpu_one(record) for record in records]
        return list(self.pool.map(self._cpu_one, records))

    def _with_dali(self, records: list[Record]) -> list[torch.Tensor]:
        assert self.dali is not None  # __call__ routes here only with a decoder
        jpeg = [i for i, record in enumerate(records) if (record.image or b"")[:3] == JPEG_MAGIC]
        out: list[torch.Tensor | None] = [None] * len(records)
        try:
            decoded = self.dali([records[i].image for i in jpeg])
        except Exception as dali_err:  # noqa: BLE001 - find the record DALI choked on and name it
            for i in jpeg:
                self._cpu_one(records[i])
            raise ValueError(
                f"DALI failed on the batch starting at image_hash {records[0].image_hash}: {dali_err}"
            ) from None
        for i, image in zip(jpeg, decoded, strict=True):
            out[i] = self._resize(records[i], image)
        for i, record in enumerate(records):
            if out[i] is None:  # PNG/WebP: alpha to composite, decoded on the CPU
                out[i] = self._cpu_one(record)
        return cast("list[torch.Tensor]", out)  # every slot is filled above

    def batches(self, batches: Iterator[list[Record]]) -> Iterator[tuple[list[Record], list[torch.Tensor]]]:
        """Prepared batches, the next one decoding in a background thread while the caller runs the model."""
        if self.pool is None:
            for records in batches:
                yield records, self(records)
            return
        with ThreadPoolExecutor(1) as ahead:
            pending = None
            for records in batches:
                future = ahead.submit(self, records)
                if pending is not None:
                    yield pending[0], pending[1].result()
                pending = (records, future)
            if pending is not None:
                yield pending[0], pending[1].result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


class ShardWriter:
    """Writes `features-NNNNN.safetensors` files of `images_per_shard` images each and remembers the index."""

    def __init__(self, output_dir: Path, images_per_shard: int) -> None:
        self.output_dir, self.images_per_shard = output_dir, images_per_shard
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_images = 0
        self.shards = 0
        self.feature_bytes = 0
        self.index: dict[str, dict[str, Any]] = {}

    def add(self, image_hash: str, features: torch.Tensor, grid_thw: tuple[int, int, int], visual_tokens: int) -> None:
        self.pending[image_hash] = features.contiguous()
        self.pending[f"{image_hash}.grid_thw"] = torch.tensor(grid_thw, dtype=torch.int64)
        self.index[image_hash] = {
            "file": self._name(self.shards),
            "visual_tokens": visual_tokens,
            "grid_thw": list(grid_thw),
        }
        self.feature_bytes += features.numel() * features.element_size()
        self.pending_images += 1
        if self.pending_images == self.images_per_shard:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.output_dir / self._name(self.shards)
        save_file(self.pending, str(path.with_suffix(".tmp")), metadata={"format": "pt"})
        os.replace(path.with_suffix(".tmp"), path)
        self.pending, self.pending_images, self.shards = {}, 0, self.shards + 1

    @staticmethod
    def _name(shard: int) -> str:
        return f"features-{shard:05d}.safetensors"


def run(
    cfg: ExtractFeaturesConfig,
    *,
    clean_data: str | Path,
    base_model: str | Path,
    output_dir: str | Path,
    tracker: Tracker,
) -> dict[str, Any]:
    """Cache pre-merger vision features of clean_data's kept images; returns counts, bytes and throughput."""
    started = time.perf_counter()
    clean_data, output_dir = Path(clean_data), Path(output_dir)
    parts = sorted((clean_data / "kept").glob("part-*.parquet"))
    if not parts:
        raise ValueError(f"{clean_data}/kept has no part-*.parquet files; point --clean-data at clean_data's output.")
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*output_dir.glob("features-*.safetensors"), output_dir / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a rerun into the same directory must not leave old shards behind
    device = resolve_device(cfg.device)
    backend = choose_backend(cfg.decode_backend, device)
    model_dir = resolve_model(str(base_model))
    stored = _vision_weights(model_dir)  # read once: the digest is of the weights as stored, whatever dtype runs
    digest = weights_digest(stored)
    tower, spec = load_vision_tower(model_dir, dtype=_DTYPES[cfg.dtype], device=device, weights=stored)
    del stored
    tracker.set_tags({"decode_backend": backend})

    preparer = BatchPreparer(cfg, backend, device, spec)
    writer = ShardWriter(output_dir, cfg.images_per_shard)
    duplicates = visual_tokens_total = 0
    hidden_size = int(tower.patch_embed.proj.out_channels)
    cached_levels = family_for(_model_config(model_dir)).cached_levels(tower.config)
    total = count_rows(parts)
    try:
        for step, (records, images) in enumerate(preparer.batches(iter_records(parts, cfg.batch_size))):
            skipped, tokens = cache_batch(records, images, tower, spec, writer, cfg, device)
            duplicates, visual_tokens_total = duplicates + skipped, visual_tokens_total + tokens
            tracker.log_metrics({"extract/images": float(len(writer.index))}, step=step)
            progress.update("extract", min(total, (step + 1) * cfg.batch_size), total, "images")
        writer.flush()
    finally:
        preparer.close()
    del tower

    index = {
        "model": str(base_model),
        "vision_digest": digest,
        "dtype": cfg.dtype,
        "hidden_size": hidden_size,
        "cached_levels": cached_levels,  # DeepStack blocks stored after the last block's rows (Qwen3-VL)
        "merge_size": spec.merge_size,
        "min_pixels": cfg.min_pixels,
        "max_pixels": cfg.max_pixels,
        "images": writer.index,
    }
    (output_dir / f"{INDEX_FILE}.tmp").write_text(json.dumps(index, indent=1, sort_keys=True))
    os.replace(output_dir / f"{INDEX_FILE}.tmp", output_dir / INDEX_FILE)

    seconds = time.perf_counter() - started
    images_written = len(writer.index)
    return {
        "images": images_written,
        "duplicates_skipped": duplicates,
        "visual_tokens_total": visual_tokens_total,
        "feature_bytes": writer.feature_bytes,
        "shards": writer.shards,
        "seconds": round(seconds, 3),
        "images_per_second": round(images_written / seconds, 3) if seconds > 0 else 0.0,
        "decode_backend": backend,
    }


def cache_batch(records: list[Record], images: list[torch.Tensor], tower, spec, writer, cfg, device) -> tuple[int, int]:
    """Run the frozen tower on a batch's new images and add their pre-merger rows to the shard writer; returns
    (exact duplicates skipped, visual tokens written)."""
    keep, in_batch = [], set()
    for i, record in enumerate(records):
        if record.image_hash not in writer.index and record.image_hash not in in_batch:  # exact duplicates
            keep.append(i)
            in_batch.add(record.image_hash)
    prepared = [patch_rows(images[i].to(device), spec) for i in keep]
    if not prepared:
        return len(records) - len(keep), 0
    rows = torch.cat([r for r, _ in prepared])
    grids = torch.tensor([g for _, g in prepared], dtype=torch.int64, device=device)
    features = pre_merger_features(tower, rows, grids)
    written = 0
    for i, feats, (_, grid) in zip(keep, features, prepared, strict=True):
        record, tokens = records[i], feats.shape[0] // spec.merge_size**2
        if record.visual_tokens is not None and record.visual_tokens != tokens:
            raise ValueError(
                f"image_hash {record.image_hash}: clean_data counted {record.visual_tokens} visual "
                f"tokens, the model gives {tokens} at min_pixels={cfg.min_pixels}, "
                f"max_pixels={cfg.max_pixels}: the two stages differ in min_pixels/max_pixels, or in the model "
                f"(this one resizes to multiples of {spec.factor} pixels; a model of another "
                "family, e.g. Qwen3-VL's 16-pixel patches against Qwen2.5-VL's 14, counts other tokens): give both "
                "stages the same pixel bounds and the same base model."
            )
        writer.add(record.image_hash, feats.to("cpu", copy=True), grid, tokens)  # copy: split views share storage
        written += tokens
    return len(records) - len(keep), written


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(ExtractFeaturesConfig, run, section="extract_features", inputs=("clean_data", "base_model"), argv=argv)
