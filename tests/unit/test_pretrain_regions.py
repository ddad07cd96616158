"""Region-phrase alignment in pretrain: GRIT-style boxes read, checked and counted; boxes placed on the merged grid;
the schedule; a loss that prefers a box's own phrase; and the stage trains with it on the synthetic world's boxes."""

import hashlib
import io
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from components._shared.data.regions import BOX, MALFORMED, SCORE, SPAN, Region, record_regions
from components._shared.model.encoder import Sample
from components._shared.platform.tracking import NullTracker
from components.extract_features.config import ExtractFeaturesConfig
from components.extract_features.stage import run as extract
from components.pretrain.config import PretrainConfig, RegionConfig
from components.pretrain.regions import RegionTerm, box_cells, collect_regions
from components.pretrain.stage import run
from components.synth_world.splits import write_splits
from components.synth_world.world import caption, noun_chunks, random_scene, render

BASE = "builtin:tiny-qwen2_5-vl"
PIXELS = {"min_pixels": 3136, "max_pixels": 50176}
CAPTION = 'A red triangle on the left and a blue cross on the right, with the word "cake".'


def _record(chunks, caption_text=CAPTION, key="k1") -> dict:
    return {"image_hash": key, "caption": caption_text, "metadata": json.dumps({"noun_chunks": chunks})}


def test_the_synthetic_lake_boxes_name_the_drawn_objects_in_reading_order():
    rng = np.random.default_rng(0)
    for _ in range(20):
        scene = random_scene(rng, 160, 120, word="cake")
        text = caption(scene, rng)
        chunks = noun_chunks(scene, text)
        named = [o for o in scene.ordered()]
        objects = [c for c in chunks if text[int(c[0]) : int(c[1])] != "cake"]
        assert [text[int(c[0]) : int(c[1])] for c in objects] == [o.name for o in named]
        for c, o in zip(objects, named, strict=True):
            x1, y1, x2, y2 = o.box
            assert c[2:6] == [round(x1 / 160, 4), round(y1 / 120, 4), round(x2 / 160, 4), round(y2 / 120, 4)]
        word = [c for c in chunks if text[int(c[0]) : int(c[1])] == "cake"]
        assert len(word) == (1 if '"cake"' in text else 0)
    # a caption naming other objects than the scene's (a mismatched lake record) gets no box for them
    scene = random_scene(np.random.default_rng(1), 160, 120, n_objects=1)
    assert noun_chunks(scene, "A purple circle.") == [] or scene.objects[0].name == "purple circle"


def test_each_chunk_is_used_or_dropped_with_its_reason():
    chunks = [
        [2, 14, 0.1, 0.2, 0.4, 0.6, 0.9],  # "red triangle"
        [33, 43, 0.6, 0.1, 0.9, 0.5],  # "blue cross", no score
        [2, 14, 0.1, 0.2],  # too short
        [2, 14, 0.1, 0.2, 0.4, 0.6, True],  # a boolean is not a score
        [70, 200, 0.1, 0.2, 0.4, 0.6, 1.0],  # past the caption's end
        [2, 14, 0.5, 0.2, 0.4, 0.6, 1.0],  # x1 > x2
        [2, 14, 0.1, 0.2, 0.4, 1.5, 1.0],  # outside the image
        [2, 14, 0.1, 0.2, 0.4, 0.6, 0.1],  # scored under min_score
    ]
    regions, dropped = record_regions(_record(chunks), min_score=0.5)
    assert regions == [Region("red triangle", (0.1, 0.2, 0.4, 0.6)), Region("blue cross", (0.6, 0.1, 0.9, 0.5))]
    assert dropped == [MALFORMED, MALFORMED, SPAN, BOX, BOX, SCORE]
    assert len(regions) + len(dropped) == len(chunks)
    assert record_regions({"image_hash": "x", "caption": CAPTION, "metadata": "{}"}, 0.0) == ([], [])
    assert record_regions(_record({"not": "a list"}), 0.0) == ([], [MALFORMED])


def test_collect_regions_counts_and_warns_and_refuses_a_run_with_no_box(caplog):
    two = [[2, 14, 0.1, 0.2, 0.4, 0.6, 1.0], [0, 500, 0, 0, 1, 1, 1.0], [0, 1, 0.5, 0.5, 0.9, 0.9, 1.0]]
    records = [_record(two), _record([], key="k2")]
    with caplog.at_level(logging.WARNING):
        per_record, metrics = collect_regions(records, RegionConfig(enabled=True))
    assert [len(r) for r in per_record] == [2, 0]
    assert metrics == {"region_records": 1, "region_boxes": 2, "region_phrases": 2, "region_dropped": 1}
    assert "1 region chunk(s) not used: span outside the caption (e.g. image_hash k1)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # named where a user finds it when clean_data's output says (PT9)
        collect_regions([{**records[0], "key": "000042", "shard": "00003.tar"}], RegionConfig(enabled=True))
    assert "span outside the caption (e.g. lake key '000042' of shard 00003.tar)" in caplog.text
    with pytest.raises(ValueError, match=r"none of the 2 kept records has a usable box.*1 span outside the caption"):
        collect_regions([_record([[0, 500, 0, 0, 1, 1, 1.0]]), _record([], key="k2")], RegionConfig(enabled=True))


def test_a_box_covers_every_merged_cell_it_touches_and_at_least_one():
    assert box_cells((0.0, 0.0, 1.0, 1.0), 4, 6) == (slice(0, 4), slice(0, 6))
    assert box_cells((0.2, 0.3, 0.5, 0.5), 4, 6) == (slice(1, 2), slice(1, 3))  # rows 1.2-2.0, cols 1.2-3.0
    assert box_cells((0.99, 0.99, 1.0, 1.0), 4, 6) == (slice(3, 4), slice(5, 6))
    assert box_cells((0.5, 0.5, 0.5001, 0.5001), 4, 6) == (slice(2, 3), slice(3, 4))


def test_the_weight_follows_the_seed_schedule_over_both_stages():
    term = RegionTerm(RegionConfig(enabled=True), tokenizer=None, merge=2, offset=0, total=20)

    class Loop:
        step = 0

    term.loop = Loop()
    weights = []
    for offset in (0, 10):  # stage 1 then stage 2, 10 steps each
        term.offset = offset
        for step in range(10):
            term.loop.step = step
            weights.append(term.weight())
    assert weights == [0.1] * 6 + [0.3] * 8 + [0.05] * 6


class _Tokens:
    """A tokenizer whose phrase ids are fixed rows of the embedding table below."""

    IDS = {" red triangle": [0, 1], " blue cross": [2], " cake": [3]}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.IDS[text]}


class _Model:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = torch.nn.Embedding.from_pretrained(table)

    def get_input_embeddings(self):
        return self.table


def _sample(regions, grid=(1, 4, 4)) -> Sample:
    n = 4
    zeros = torch.zeros(n, dtype=torch.long)
    sample = Sample(zeros, zeros, torch.zeros(3, n, dtype=torch.long), torch.tensor([grid]))
    sample.meta["regions"] = regions
    return sample


def test_the_loss_pools_the_tokens_under_each_box_and_prefers_its_own_phrase():
    table = torch.eye(4, 8)  # phrase "red triangle" -> mean of e0, e1; "blue cross" -> e2; "cake" -> e3
    term = RegionTerm(RegionConfig(enabled=True, temperature=0.1), _Tokens(), merge=2, offset=0, total=1)
    regions = [Region("red triangle", (0.0, 0.0, 0.5, 0.5)), Region("blue cross", (0.5, 0.5, 1.0, 1.0))]
    grid = torch.zeros(2, 2, 8)  # the sample's 2 x 2 merged cells, raster order
    grid[0, 0] = table[0] + table[1]
    grid[1, 1] = table[2]
    other = torch.zeros(4, 8)  # a second sample's image (no regions) before it in the row
    embeds = torch.cat([other, grid.reshape(4, 8)])
    samples = [_sample([]), _sample(regions)]
    rows, phrases = term.pooled(embeds, samples)
    assert phrases == ["red triangle", "blue cross"]
    assert torch.equal(rows[0], grid[0, 0]) and torch.equal(rows[1], grid[1, 1])
    model = _Model(table)
    aligned = term(model, embeds, samples)
    swapped = term(model, torch.cat([other, grid.flip(0).flip(1).reshape(4, 8)]), samples)
    assert float(aligned) < 0.01 and float(swapped) > 5.0
    # one distinct phrase: nothing to contrast, zero with a graph
    embeds.requires_grad_(True)
    single = term(model, embeds, [_sample(regions[:1])])
    single.backward()
    assert float(single.detach()) == 0.0 and embeds.grad is not None


@pytest.fixture(scope="module")
def world_inputs(tmp_path_factory):
    """Kept records of the synthetic world with their lake JSON (noun_chunks), features and held-out data."""
    root = tmp_path_factory.mktemp("regions")
    rng = np.random.default_rng(5)
    rows = []
    for i in range(32):
        scene = random_scene(rng, 112, 112)
        text = caption(scene, rng)
        buf = io.BytesIO()
        render(scene).save(buf, format="PNG")
        data = buf.getvalue()
        chunks = noun_chunks(scene, text) + ([[0, 999, 0, 0, 1, 1, 1.0]] if i == 0 else [])  # one bad chunk
        rows.append(
            {
                "image_hash": hashlib.sha256(data).hexdigest(),
                "image": data,
                "caption": text,
                "image_format": "PNG",
                "key": f"{i:09d}",
                "metadata": json.dumps({"noun_chunks": chunks}),
            }
        )
    (root / "clean/kept").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "clean/kept/part-00000.parquet")
    extract(
        ExtractFeaturesConfig(**PIXELS, dtype="float32", decode_workers=0, batch_size=16),
        clean_data=root / "clean",
        base_model=BASE,
        output_dir=root / "features",
        tracker=NullTracker(),
    )
    write_splits(root / "heldout", seed=4, eval_per_type=8, sft_records=8, preference_pairs=2)
    return root, sum(len(json.loads(r["metadata"])["noun_chunks"]) for r in rows)


class _Metrics(NullTracker):
    def __init__(self):
        super().__init__()
        self.logged: list[dict] = []

    def log_metrics(self, metrics, step=None):
        self.logged.append(dict(metrics))


def test_pretrain_trains_with_the_region_term_and_accounts_for_every_chunk(world_inputs, tmp_path):
    root, chunks = world_inputs
    train = {"steps": 8, "samples_per_step": 16, "max_tokens_per_micro_batch": 1024, "threads": 1, "log_every": 1}
    cfg = PretrainConfig.model_validate(
        {
            **PIXELS,
            "stage1": {"train": train, "optim": {"lr": 0.01}},
            "region": {"enabled": True, "schedule": [{"fraction": 1.0, "weight": 1.0}]},
            "eval": {"heldout_captions": 4, "retrieval_candidates": 4},
        }
    )
    tracker = _Metrics()
    metrics = run(
        cfg,
        clean_data=str(root / "clean"),
        features=str(root / "features"),
        base_model=BASE,
        data=str(root / "heldout"),
        output_dir=tmp_path,
        tracker=tracker,
    )
    assert metrics["region_records"] == 32 and metrics["region_dropped"] == 1
    assert metrics["region_boxes"] + metrics["region_dropped"] == chunks
    region = [v for m in tracker.logged for k, v in m.items() if k.startswith("stage1/") and k.endswith("/region")]
    assert len(region) == 8 and region[-1] < 0.8 * region[0]  # the merger learns where each phrase is


def test_region_supervision_without_boxes_in_the_data_is_refused(world_inputs, tmp_path):
    root, _ = world_inputs
    table = pq.read_table(root / "clean/kept/part-00000.parquet").drop(["metadata"])
    (tmp_path / "clean/kept").mkdir(parents=True)
    table = table.append_column("metadata", pa.array(["{}"] * table.num_rows))
    pq.write_table(table, tmp_path / "clean/kept/part-00000.parquet")
    cfg = PretrainConfig.model_validate({**PIXELS, "region": {"enabled": True}})
    with pytest.raises(ValueError, match="none of the 32 kept records has a usable box"):
        run(
            cfg,
            clean_data=str(tmp_path / "clean"),
            features=str(root / "features"),
            base_model=BASE,
            data=str(root / "heldout"),
            output_dir=tmp_path / "out",
            tracker=NullTracker(),
        )
