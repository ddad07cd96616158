"""extract_features: cached features equal the processor + vision tower's; the files follow the contract."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw
from safetensors import safe_open

from components._shared.platform.image_decode import visual_tokens as clean_data_visual_tokens
from components._shared.platform.tracking import NullTracker
from components.extract_features.config import ExtractFeaturesConfig
from components.extract_features.decode import (
    PatchSpec,
    dali_importable,
    decode_pil,
    decode_torchvision,
    patch_rows,
    resize_for_qwen,
)
from components.extract_features.stage import run

torch.set_num_threads(1)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 200 * 200
# (width, height, format, mode): non-square, JPEG and PNG, one RGBA PNG, one larger than max_pixels.
IMAGES = [
    (150, 100, "JPEG", "RGB"),
    (97, 203, "PNG", "RGB"),
    (230, 130, "JPEG", "RGB"),
    (120, 120, "PNG", "RGBA"),
    (300, 260, "JPEG", "RGB"),
    (60, 90, "JPEG", "L"),
]


def _picture(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    image = Image.fromarray(np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width - 20)), int(rng.integers(0, height - 20))
        draw.ellipse([x0, y0, x0 + 20, y0 + 15], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    if mode == "RGBA":
        image = image.convert("RGBA")
        image.putalpha(Image.fromarray((np.mgrid[0:height, 0:width][1] * 255 // width).astype(np.uint8)))
    return image.convert(mode) if mode == "L" else image


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen2.5-VL with its image processor, and a clean_data output: 6 images in 2 parquet files."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    root = tmp_path_factory.mktemp("extract_features")
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },  # block 0 windowed, block 1 full attention
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model_dir = root / "tiny_vlm"
    model.save_pretrained(model_dir)
    processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor.save_pretrained(model_dir)

    rows = []
    for seed, (width, height, fmt, mode) in enumerate(IMAGES):
        data = _encode(_picture(width, height, mode, seed), fmt)
        rows.append(
            {
                "image_hash": f"{seed:02d}" + "ab" * 31,
                "key": f"{seed:05d}",
                "shard": "00000",
                "image": data,
                "image_format": fmt.lower(),
                "caption": f"a picture number {seed} with red circles",
                "width": width,
                "height": height,
                "visual_tokens": clean_data_visual_tokens(height, width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
            }
        )
    clean = root / "clean_data"
    _write_kept(clean, rows)
    return {
        "root": root,
        "model": model,
        "model_dir": model_dir,
        "processor": processor,
        "clean": clean,
        "rows": rows,
    }


def _write_kept(clean: Path, rows: list[dict]) -> None:
    (clean / "kept").mkdir(parents=True, exist_ok=True)
    half = len(rows) // 2
    for part, chunk in enumerate([rows[:half], rows[half:]]):
        pq.write_table(pa.Table.from_pylist(chunk), clean / "kept" / f"part-{part:05d}.parquet")


def _cfg(**overrides) -> ExtractFeaturesConfig:
    base = {
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "batch_size": 4,
        "images_per_shard": 3,
        "device": "cpu",
        "decode_backend": "torchvision",
        "decode_workers": 1,
        "dtype": "float32",
    }
    return ExtractFeaturesConfig(**{**base, **overrides})


def _load(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    index = json.loads((out / "index.json").read_text())
    tensors = {}
    for name in sorted({entry["file"] for entry in index["images"].values()}):
        with safe_open(str(out / name), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    return index, tensors


def _reference(visual, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """The tower's own pre-merger rows (at the merger's input, window order undone) and its final output."""
    from transformers.vision_utils import get_vision_window_index

    captured = {}
    handle = visual.merger.register_forward_hook(lambda module, args, output: captured.update(rows=args[0]))
    with torch.no_grad():
        output = visual(pixel_values.to(visual.dtype), grid_thw=grid_thw)
    handle.remove()
    window_index, _ = get_vision_window_index(
        grid_thw, spatial_merge_size=2, window_size=visual.window_size, patch_size=14
    )
    hidden = captured["rows"].shape[-1]
    rows = captured["rows"].reshape(-1, 4, hidden)[torch.argsort(window_index)].reshape(-1, hidden)
    return rows, output.pooler_output


@pytest.fixture(scope="module")
def fp32_run(world):
    out = world["root"] / "features_fp32"
    tracker = NullTracker()
    metrics = run(
        _cfg(), clean_data=world["clean"], base_model=str(world["model_dir"]), output_dir=out, tracker=tracker
    )
    return out, metrics, tracker


def test_fp32_features_equal_processor_and_tower(world, fp32_run):
    out, metrics, _ = fp32_run
    index, tensors = _load(out)
    visual = world["model"].model.visual
    for row in world["rows"]:
        image = Image.open(io.BytesIO(row["image"]))
        reference = world["processor"](images=[image], return_tensors="pt")
        expected_rows, expected_output = _reference(visual, reference["pixel_values"], reference["image_grid_thw"])
        cached = tensors[row["image_hash"]]
        assert cached.dtype == torch.float32 and cached.shape == expected_rows.shape == (cached.shape[0], 64)
        torch.testing.assert_close(cached, expected_rows, atol=1e-5, rtol=1e-5)
        # The merger on the cached rows is the tower's output: pretrain can train the merger on these.
        with torch.no_grad():
            torch.testing.assert_close(visual.merger(cached), expected_output, atol=1e-5, rtol=1e-5)
        grid = reference["image_grid_thw"][0]
        assert tensors[f"{row['image_hash']}.grid_thw"].tolist() == grid.tolist()
        assert tensors[f"{row['image_hash']}.grid_thw"].dtype == torch.int64
        tokens = int(grid.prod()) // 4
        assert (
            cached.shape[0] // 4
            == tokens
            == index["images"][row["image_hash"]]["visual_tokens"]
            == row["visual_tokens"]
        )
    assert metrics["images"] == len(IMAGES) and metrics["decode_backend"] == "torchvision"
    assert metrics["visual_tokens_total"] == sum(row["visual_tokens"] for row in world["rows"])
    assert metrics["feature_bytes"] == sum(t.numel() * 4 for k, t in tensors.items() if not k.endswith(".grid_thw"))


def test_windowed_images_really_reorder(world):
    """Guard for the test above: the largest image spans several attention windows, so order matters."""
    from transformers.vision_utils import get_vision_window_index

    image = Image.open(io.BytesIO(world["rows"][4]["image"]))
    grid = world["processor"](images=[image], return_tensors="pt")["image_grid_thw"]
    window_index, _ = get_vision_window_index(grid, spatial_merge_size=2, window_size=112, patch_size=14)
    assert not torch.equal(window_index, torch.arange(len(window_index)))


def test_pixel_rows_bit_identical_to_processor(world):
    spec = PatchSpec.from_model_dir(world["model_dir"], world["model"].config.vision_config)
    for row in world["rows"]:
        reference = world["processor"](images=[Image.open(io.BytesIO(row["image"]))], return_tensors="pt")
        resized = resize_for_qwen(
            decode_torchvision(row["image"]), factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
        )
        rows, grid = patch_rows(resized, spec)
        assert list(grid) == reference["image_grid_thw"][0].tolist()
        if row["image_format"] == "png" and Image.open(io.BytesIO(row["image"])).mode == "RGBA":
            # alpha compositing rounds like imaging.decode_image (paste), the processor uses alpha_composite
            assert (rows - reference["pixel_values"]).abs().max() < 0.03
        else:
            assert torch.equal(rows, reference["pixel_values"])


def test_index_and_shards(world, fp32_run):
    out, metrics, tracker = fp32_run
    index = json.loads((out / "index.json").read_text())
    assert set(index) == {
        "model",
        "dtype",
        "hidden_size",
        "cached_levels",
        "vision_digest",
        "merge_size",
        "min_pixels",
        "max_pixels",
        "images",
    }
    assert index["model"] == str(world["model_dir"]) and index["dtype"] == "float32"
    assert index["hidden_size"] == 64 and index["merge_size"] == 2
    assert index["cached_levels"] == []  # Qwen2.5-VL has no DeepStack
    assert set(index["images"]) == {row["image_hash"] for row in world["rows"]}
    files = sorted(p.name for p in out.glob("features-*.safetensors"))
    assert files == ["features-00000.safetensors", "features-00001.safetensors"] and metrics["shards"] == 2
    for name in files:
        with safe_open(str(out / name), framework="pt") as handle:
            hashes = {k for k in handle.keys() if not k.endswith(".grid_thw")}  # noqa: SIM118
        assert len(hashes) == 3 and all(index["images"][h]["file"] == name for h in hashes)
    assert tracker.metrics["extract/images"] == len(IMAGES)


def test_bf16_features_within_tolerance(world, tmp_path):
    out = tmp_path / "features_bf16"
    run(
        _cfg(dtype="bfloat16", images_per_shard=100, decode_workers=0),
        clean_data=world["clean"],
        base_model=str(world["model_dir"]),
        output_dir=out,
        tracker=NullTracker(),
    )
    index, tensors = _load(out)
    assert index["dtype"] == "bfloat16" and len(list(out.glob("features-*.safetensors"))) == 1
    visual = world["model"].model.visual
    for row in world["rows"][:3]:
        reference = world["processor"](images=[Image.open(io.BytesIO(row["image"]))], return_tensors="pt")
        expected, _ = _reference(visual, reference["pixel_values"], reference["image_grid_thw"])  # fp32 truth
        cached = tensors[row["image_hash"]]
        assert cached.dtype == torch.bfloat16
        error = (cached.float() - expected).abs().max() / expected.abs().max()
        assert error < 0.02, f"bf16 relative error {error:.4f}"  # measured ~0.007


def test_backends_decode_the_same_pixels(world):
    for row in world["rows"]:
        torchvision_pixels, pil_pixels = decode_torchvision(row["image"]), decode_pil(row["image"])
        assert torchvision_pixels.shape == pil_pixels.shape == (3, row["height"], row["width"])
        assert (torchvision_pixels.int() - pil_pixels.int()).abs().max() <= 1
    if dali_importable():
        from components.extract_features.decode import DaliJpegDecoder

        jpegs = [row["image"] for row in world["rows"] if row["image_format"] == "jpeg"]
        decoded = DaliJpegDecoder(max_batch_size=2, device_id=None, num_threads=1)(jpegs)
        for data, image in zip(jpegs, decoded, strict=True):
            assert torch.equal(image, decode_torchvision(data))


@pytest.mark.skipif(not dali_importable(), reason="nvidia.dali does not import")
def test_dali_backend_on_cpu_gives_the_same_features(world, fp32_run, tmp_path):
    metrics = run(
        _cfg(decode_backend="dali", decode_workers=2, images_per_shard=100),
        clean_data=world["clean"],
        base_model=str(world["model_dir"]),
        output_dir=tmp_path / "out",
        tracker=NullTracker(),
    )
    assert metrics["decode_backend"] == "dali" and metrics["images"] == len(IMAGES)
    (_, dali_tensors), (_, torchvision_tensors) = _load(tmp_path / "out"), _load(fp32_run[0])
    assert dali_tensors.keys() == torchvision_tensors.keys()
    for key, tensor in torchvision_tensors.items():
        torch.testing.assert_close(dali_tensors[key], tensor, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "form", ["P8", "P4", "P2", "P1", "P8-tRNS", "L1", "L2", "L4", "L8", "LA", "RGBA", "I16", "RGB"]
)
def test_every_png_form_decodes_to_the_pixels_pillow_gives(form):
    """torchvision 0.29 returns other colours than Pillow for palette and low-bit PNGs (seventh hostile pass): the
    cached features must be of the pixels clean_data scored."""
    rng = np.random.default_rng(3)
    rgb = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    if form.startswith("P"):
        bits = int(form[1])
        image = rgb.quantize(2**bits)
        options = {"bits": bits} if bits < 8 else {}
        if form.endswith("tRNS"):
            options["transparency"] = 0
        image.save(buffer, "PNG", **options)
    elif form[0] == "L" and form[1:].isdigit() and form != "L8":
        bits = int(form[1:])
        gray = rgb.convert("L").point(lambda v: (v >> (8 - bits)) * (255 // (2**bits - 1)))
        gray.save(buffer, "PNG", bits=bits)
    elif form == "I16":
        Image.fromarray(rng.integers(0, 65536, (24, 32), dtype=np.uint16)).save(buffer, "PNG")
    else:
        rgb.convert(form[:4] if form != "L8" else "L").save(buffer, "PNG")
    data = buffer.getvalue()
    torchvision_pixels, pil_pixels = decode_torchvision(data), decode_pil(data)
    assert torchvision_pixels.shape == pil_pixels.shape == (3, 24, 32)
    assert (torchvision_pixels.int() - pil_pixels.int()).abs().max() <= 1, form


def test_exif_orientation_is_applied():
    image = _picture(80, 40, "RGB", 7)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: a viewer sees 40x80
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif)
    assert decode_torchvision(buffer.getvalue()).shape == decode_pil(buffer.getvalue()).shape == (3, 80, 40)


def test_pil_backend_and_duplicates(world, tmp_path):
    rows = world["rows"][:2] + [dict(world["rows"][0])]  # an exact duplicate of the first image
    clean = tmp_path / "clean"
    _write_kept(clean, rows)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "features-00007.safetensors").write_bytes(b"left over from an earlier run")
    metrics = run(
        _cfg(decode_backend="pil", decode_workers=0),
        clean_data=clean,
        base_model=str(world["model_dir"]),
        output_dir=tmp_path / "out",
        tracker=NullTracker(),
    )
    assert metrics["images"] == 2 and metrics["duplicates_skipped"] == 1 and metrics["decode_backend"] == "pil"
    assert [p.name for p in (tmp_path / "out").glob("features-*")] == ["features-00000.safetensors"]


def test_undecodable_record_names_its_hash(world, tmp_path):
    rows = [
        dict(world["rows"][0]),
        dict(world["rows"][1], image=b"\xff\xd8\xff\xe0 not really a jpeg", image_hash="bad" * 4),
    ]
    clean = tmp_path / "clean"
    _write_kept(clean, rows)
    with pytest.raises(ValueError, match="image_hash badbadbadbad: cannot decode"):
        run(
            _cfg(),
            clean_data=clean,
            base_model=str(world["model_dir"]),
            output_dir=tmp_path / "out",
            tracker=NullTracker(),
        )


def test_visual_token_mismatch_names_the_settings(world, tmp_path):
    with pytest.raises(ValueError, match=r"image_hash 00ab.*min_pixels=3136, max_pixels=10000"):
        run(
            _cfg(max_pixels=100 * 100),
            clean_data=world["clean"],
            base_model=str(world["model_dir"]),
            output_dir=tmp_path / "out",
            tracker=NullTracker(),
        )


def test_qwen2_vl_tower_without_window_attention(world, tmp_path):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(1)
    model = Qwen2VLForConditionalGeneration(
        Qwen2VLConfig(
            text_config={
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 512,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            },
            vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
        )
    ).eval()
    model.save_pretrained(tmp_path / "qwen2_vl")
    clean = tmp_path / "clean"
    _write_kept(clean, world["rows"][:2])
    run(
        _cfg(),
        clean_data=clean,
        base_model=str(tmp_path / "qwen2_vl"),
        output_dir=tmp_path / "out",
        tracker=NullTracker(),
    )
    index, tensors = _load(tmp_path / "out")
    assert index["hidden_size"] == 32
    for row in world["rows"][:2]:
        reference = world["processor"](images=[Image.open(io.BytesIO(row["image"]))], return_tensors="pt")
        with torch.no_grad():
            expected = model.model.visual(reference["pixel_values"], grid_thw=reference["image_grid_thw"]).pooler_output
            torch.testing.assert_close(
                model.model.visual.merger(tensors[row["image_hash"]]), expected, atol=1e-5, rtol=1e-5
            )


def test_missing_input_is_a_clear_error(world, tmp_path):
    with pytest.raises(ValueError, match="kept has no part-"):
        run(
            _cfg(),
            clean_data=tmp_path,
            base_model=str(world["model_dir"]),
            output_dir=tmp_path / "out",
            tracker=NullTracker(),
        )


def test_config_coerces_kfp_floats():
    cfg = ExtractFeaturesConfig.model_validate({"batch_size": 8.0, "images_per_shard": 2.0, "max_pixels": 40000.0})
    assert (cfg.batch_size, cfg.images_per_shard, cfg.max_pixels) == (8, 2, 40000)
    assert isinstance(cfg.batch_size, int)
