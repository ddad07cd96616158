"""The tenth hostile pass's SFT-builder leftovers: one object boxed thousands of times counted once [BD_nc_many2];
a lake with no usable region chunk told why, not to change the quotas [BD_nc_none ... BD_meta_list]; all captions
empty said as such [BD_cap_empty]; one enormous caption not used instead of stopping the build [BD_cap_long]."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components._shared.data.regions import DUPLICATE, TOO_MANY, record_regions
from components.sft import build_data
from components.sft.config import SftConfig


def _record(caption: str, chunks, image_hash: str = "h0", image: bytes = b"") -> dict:
    return {
        "image_hash": image_hash,
        "caption": caption,
        "image": image,
        "metadata": json.dumps({"noun_chunks": chunks}),
    }


def test_jittered_boxes_of_one_phrase_are_one_object_and_a_flood_of_chunks_is_cut():
    chunk = [2, 7, 0.1, 0.1, 0.5, 0.5, 0.9]
    jittered = [[*chunk[:2], chunk[2] + k * 1e-5, *chunk[3:]] for k in range(3000)]
    regions, dropped = record_regions(_record("a shape.", jittered), 0.5)
    assert len(regions) == 1  # "How many shapes are there?" -> 1, not 301
    assert dropped.count(TOO_MANY) == 3000 - 256 and dropped.count(DUPLICATE) == 255
    apart = [chunk, [2, 7, 0.6, 0.6, 0.9, 0.9, 0.9]]  # the same phrase over another box: two objects
    assert len(record_regions(_record("a shape.", apart), 0.5)[0]) == 2


def test_no_usable_region_chunk_names_the_chunks_reasons_and_the_caption_only_way_out():
    lake = {"records": 30, "region_chunks_used": 0, "region_chunks_not_used": {"span outside the caption": 30}}
    with pytest.raises(ValueError, match=r"no region chunk of the 30 kept records .*span outside the caption.*") as err:
        build_data.check_regions_used(lake, ["caption", "color", "count"])
    assert "build_data.templates: [caption]" in str(err.value) and "['color', 'count']" in str(err.value)
    with pytest.raises(ValueError, match="no record has noun_chunks in its metadata"):
        build_data.check_regions_used({**lake, "region_chunks_not_used": {}}, ["count"])
    build_data.check_regions_used(lake, ["caption"])  # captions alone need no region


def _clean(tmp_path: Path, records: list[dict]) -> Path:
    (tmp_path / "clean" / "kept").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "clean" / "kept" / "part-00000.parquet")
    return tmp_path / "clean"


def test_kept_records_whose_captions_are_all_empty_are_said_as_such(tmp_path):
    clean = _clean(tmp_path, [_record("", [], f"h{i}") for i in range(30)])
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "eval.jsonl").write_text("")
    with pytest.raises(ValueError, match="its 30 kept records all have an empty caption"):
        build_data.run(
            SftConfig(),
            clean_data=str(clean),
            base_model="builtin:tiny-qwen2_5-vl",
            data=str(tmp_path / "data"),
            output_dir=tmp_path / "out",
            tracker=None,
        )


def test_a_caption_longer_than_half_the_context_is_not_used_and_counted(tmp_path):
    import io

    from PIL import Image

    from components._shared.model.encoder import ConversationEncoder
    from components._shared.model.vlm import load_vlm

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    chunk = [2, 12, 0.1, 0.1, 0.6, 0.6, 0.9]
    short = _record("a red square.", [chunk], "h1", buf.getvalue())
    long = _record("a red square. " + "word " * 40_000, [chunk], "h2", buf.getvalue())
    loaded = load_vlm("builtin:tiny-qwen2_5-vl")
    cfg = SftConfig(max_length=1024)
    encoder = ConversationEncoder(loaded.processor, loaded.model, min_pixels=3136, max_pixels=50176, max_length=1024)
    images, candidates, lake = build_data.generate(cfg, [short, long], encoder, "absolute")
    assert list(images) == ["h1"] and {c.image for c in candidates} == {"h1"}
    assert lake["not_used"] == {"the caption is longer than half of max_length (512 tokens)": 1}
