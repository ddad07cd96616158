"""Real photographs in every format through the model stages' data path: each record shape encodes into training
samples whose trained tokens are exactly its assistant turns, and SFT trains on all of them at once and reports
per benchmark."""

import json

import pytest
import torch

from components._shared.data import datasets
from components._shared.model.encoder import IGNORE_INDEX, ConversationEncoder
from components._shared.model.vlm import load_vlm, set_pixel_bounds
from components._shared.platform.tracking import NullTracker
from components.synth_world import real_photos as P

BASE = "builtin:tiny-qwen2_5-vl"
SFT_FILES = ["llava.json", "sharegpt.jsonl", "messages.jsonl", "photos.parquet"]
MANIFEST = """\
sft: [llava.json, sharegpt.jsonl, messages.jsonl, photos.parquet]
eval: [photo_eval.jsonl]
tasks: {photo_caption: cider_d}
"""


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("photo-data")
    P.write_all(root)
    (root / "dataset.yaml").write_text(MANIFEST)
    return root


def test_every_record_shape_encodes_with_exactly_its_answers_trained(photo_dir):
    model, processor, _ = load_vlm(BASE)
    set_pixel_bounds(processor, 3136, 12544)
    encoder = ConversationEncoder(processor, model, min_pixels=3136, max_pixels=12544)
    records = datasets.load_conversations(photo_dir)
    assert {r["file"] for r in records} == set(SFT_FILES) and len(records) == 6 + 5 + 6 + 5
    for r in records:
        images = [datasets.load_image(photo_dir, ref) for ref in r["images"]]
        sample = encoder.encode(r["turns"], images=images, sample_id=r["id"])
        assert sample.image_grid_thw.shape[0] == len(r["images"]) >= 1, r["id"]
        trained = encoder.tokenizer.decode(sample.input_ids[sample.labels != IGNORE_INDEX])
        answers = [t["text"] for t in r["turns"] if t["role"] == "assistant"]
        assert trained == "".join(f"{a}<|im_end|>" for a in answers), r["id"]
        text = encoder.tokenizer.decode(sample.input_ids)
        system = next((t["text"] for t in r["turns"] if t["role"] == "system"), None)
        if system:
            assert f"<|im_start|>system\n{system}<|im_end|>" in text and "helpful assistant" not in text


def test_sft_trains_on_every_format_and_reports_each_benchmark(photo_dir, tmp_path):
    from components.sft.config import SftConfig
    from components.sft.stage import run

    cfg = SftConfig.model_validate(
        {
            "mode": "full",
            "min_pixels": 3136,
            "max_pixels": 3136,
            "calibration": {"enabled": False},
            "train": {"steps": 3, "samples_per_step": 8, "max_tokens_per_micro_batch": 512, "threads": 1},
            "optim": {"lr": 0.01},
            "eval": {"per_type": 5, "batch_size": 16, "max_new_tokens": 8},
        }
    )
    metrics = run(cfg, base_model=BASE, data=str(photo_dir), output_dir=tmp_path, tracker=NullTracker())
    assert metrics["train_loss_final"] < metrics["train_loss_first"] and torch.isfinite(
        torch.tensor(metrics["train_loss_final"])
    )
    for benchmark in ("photo_vqa", "photo_pope", "photo_refs", "photo_captions", "photo_mc"):
        assert metrics[f"benchmark/{benchmark}/count"] == 5, benchmark
        assert 0.0 <= metrics[f"benchmark/{benchmark}"] <= 1.0
    assert "benchmark/photo_pope/f1" in metrics and "benchmark/photo_captions/cider_d" in metrics
    rows = [json.loads(line) for line in (tmp_path / "eval_predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 25 and {row["benchmark"] for row in rows} == {
        "photo_vqa", "photo_pope", "photo_refs", "photo_captions", "photo_mc"
    }  # fmt: skip
    assert "| photo_mc |" in (tmp_path / "report.md").read_text()
