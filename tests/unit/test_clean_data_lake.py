"""How clean_data reads a lake's layout: nested and compressed shards, tars whose members are not grouped by key,
keys used twice, captions that are not strings. Model levels are off; every record must be kept or rejected with a
reason that names it."""

import gzip
import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from components._shared.platform.tracking import NullTracker
from components.clean_data import filters
from components.clean_data.config import CleanDataConfig
from components.clean_data.stage import clean_shard, list_shards, run

CFG = CleanDataConfig(clip_enabled=False, nsfw_enabled=False, ocr_enabled=False, outlier_enabled=False)
CAPTION = b"A red circle on a plain grey background."


def _image(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _clean(shard: Path, out: Path) -> tuple[dict, dict[str, dict], list[str]]:
    """(metrics, {key: rejected row}, kept keys) of one shard."""
    metrics = clean_shard(CFG, shard_uri=str(shard), output_dir=out, tracker=NullTracker())
    rejected = pq.read_table(out / "rejected.parquet").to_pylist()
    kept = pq.read_table(out / "kept.parquet").column("key").to_pylist()
    assert metrics["records_in"] == metrics["records_kept"] + metrics["records_rejected"] == len(kept) + len(rejected)
    return metrics, {r["key"]: r for r in rejected}, kept


# --- finding 1: a caption that is not a string -------------------------------------------------------------


def test_parquet_caption_that_is_not_a_string_is_a_rejected_record_naming_its_type(tmp_path):
    shard = tmp_path / "lake" / "00000.parquet"
    shard.parent.mkdir()
    table = pa.table(
        {
            "key": ["k0", "k1", "k2"],
            "jpg": [_image(0), _image(1), _image(2)],
            "caption": [["a photo of a cat"], [], ["A red circle on a plain grey background."]],
        }
    )
    pq.write_table(table, shard)
    metrics, rejected, kept = _clean(shard, tmp_path / "out")
    assert metrics["records_in"] == 3 and kept == []
    assert metrics["rejected_by_reason"]["missing_caption"] == 3
    assert {k: r["reason"] for k, r in rejected.items()} == dict.fromkeys(["k0", "k1", "k2"], "missing_caption")
    detail = rejected["k0"]["detail"]
    assert "caption column 'caption' holds list" in detail and "write one caption string" in detail
    assert rejected["k0"]["image_hash"] is not None  # the rejection row still names the image


def test_numeric_caption_is_rejected_not_crashing_nor_read_as_empty(tmp_path):
    shard = tmp_path / "00000.parquet"
    pq.write_table(pa.table({"key": ["k0", "k1"], "jpg": [_image(0), _image(1)], "caption": [5, 0]}), shard)
    metrics, rejected, _ = _clean(shard, tmp_path / "out")
    assert metrics["records_in"] == 2 and metrics["rejected_by_reason"]["empty_caption"] == 0
    assert rejected["k0"]["reason"] == rejected["k1"]["reason"] == "missing_caption"
    assert "holds int 5" in rejected["k0"]["detail"] and "holds int 0" in rejected["k1"]["detail"]
    # the caption check itself never crashes on a non-bytes value either
    assert filters.check_caption(["x"], CFG) == (None, ("missing_caption", "caption is list, not text (UTF-8 bytes)"))


def test_hugging_face_image_cells_holding_only_a_path_say_so(tmp_path):
    """datasets' Image column saved without embedding the files: {bytes: None, path: ...}; the lake has no image."""
    shard = tmp_path / "00000.parquet"
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = pa.array([{"bytes": None, "path": "imgs/cat.jpg"}, {"bytes": _image(1), "path": None}], type=struct)
    pq.write_table(pa.table({"key": ["k0", "k1"], "image": cells, "caption": [CAPTION.decode()] * 2}), shard)
    metrics, rejected, kept = _clean(shard, tmp_path / "out")
    assert kept == ["k1"] and rejected["k0"]["reason"] == "missing_image"
    assert "image column 'image' holds only a path ('imgs/cat.jpg'), not the image's bytes" in rejected["k0"]["detail"]


# --- finding 2: nested and compressed shards, other files ------------------------------------------------------


def test_nested_and_gzip_shards_are_read_and_named_apart_other_files_reported(tmp_path, caplog):
    lake = tmp_path / "lake"
    _write(lake / "00000.tar", _tar_bytes([("a.png", _image(20)), ("a.txt", CAPTION)]))
    _write(lake / "part2" / "00000.tar", _tar_bytes([("b.png", _image(21)), ("b.txt", CAPTION)]))
    _write(
        lake / "part2" / "deeper" / "00001.tgz", gzip.compress(_tar_bytes([("c.png", _image(22)), ("c.txt", CAPTION)]))
    )
    _write(lake / "00002.tar.gz", gzip.compress(_tar_bytes([("d.png", _image(23)), ("d.txt", CAPTION)])))
    _write(lake / "00000_stats.json", b"{}")
    _write(lake / "part2" / "notes.md", b"not a shard")

    with caplog.at_level(logging.WARNING):
        shards = list_shards(str(lake))
    relative = [str(Path(s).relative_to(lake)) for s in shards]
    assert relative == ["00000.tar", "00002.tar.gz", "part2/00000.tar", "part2/deeper/00001.tgz"]
    assert "2 file(s) are not shards and are not read" in caplog.text
    assert "00000_stats.json" in caplog.text and "notes.md" in caplog.text

    out = tmp_path / "out"
    metrics = run(CFG, lake_uri=str(lake), output_dir=out, tracker=NullTracker())
    manifest = json.loads((out / "manifest.json").read_text())
    assert metrics["records_in"] == metrics["records_kept"] == 4
    assert sorted(manifest["per_shard"]) == relative  # two 00000.tar shards, two names
    kept = pq.read_table(out / "kept").to_pylist()
    assert {r["key"]: r["shard"] for r in kept} == {
        "a": "00000.tar",
        "b": "part2/00000.tar",
        "c": "part2/deeper/00001.tgz",
        "d": "00002.tar.gz",
    }
    assert "| part2/00000.tar | 1 | 1 | 0 |" in (out / "report.md").read_text()


def test_shard_names_keep_flat_lakes_and_tell_nested_ones_apart():
    from components._shared.data.lake import shard_names

    assert shard_names(["s3://b/lake/00000.tar", "s3://b/lake/00001.tar"]) == ["00000.tar", "00001.tar"]
    assert shard_names(["/l/00000.tar", "/l/p/00000.tar"]) == ["00000.tar", "p/00000.tar"]
    assert shard_names(["/l/a/00000.tar", "/l/b/00000.tar"]) == ["a/00000.tar", "b/00000.tar"]
    assert shard_names(["/l/only.tar"]) == ["only.tar"]


# --- finding 3: tar members not grouped by key, two images or captions for one key ---------------------------------


def test_tar_with_members_not_grouped_by_key_counts_each_key_once(tmp_path):
    members = [
        ("a.png", _image(10)),
        ("b.png", _image(11)),
        ("a.txt", CAPTION),
        ("b.txt", CAPTION),
    ]
    shard = _write(tmp_path / "00000.tar", _tar_bytes(members))
    metrics, rejected, kept = _clean(shard, tmp_path / "out")
    assert metrics["records_in"] == 2 and kept == []
    assert {k: r["reason"] for k, r in rejected.items()} == {"a": "duplicate_key", "b": "duplicate_key"}
    detail = rejected["a"]["detail"]
    assert "members of key 'a' are not consecutive" in detail and "'a.txt' (member 2)" in detail
    assert "tar --sort=name" in detail
    assert rejected["a"]["image_hash"] is not None  # the image's hash survives the wait for the shard's end


def test_tar_key_with_two_images_or_captions_or_coming_back_is_rejected(tmp_path):
    members = [
        ("c.jpg", _image(12)),
        ("c.png", _image(13)),
        ("c.txt", CAPTION),
        ("d.png", _image(14)),
        ("d.txt", CAPTION),
        ("d.caption", b"another caption that differs a lot"),
        ("e.png", _image(15)),
        ("e.txt", CAPTION),
        ("f.png", _image(16)),
        ("f.txt", CAPTION),
        ("e.json", b'{"late": true}'),
        ("g.png", _image(17)),  # image only, members grouped: still missing_caption
    ]
    shard = _write(tmp_path / "00000.tar", _tar_bytes(members))
    metrics, rejected, kept = _clean(shard, tmp_path / "out")
    assert metrics["records_in"] == 6  # c, d, e, f, g and the second `e` record
    assert sorted(kept) == ["e", "f"]
    reasons = sorted((r["key"], r["reason"]) for r in pq.read_table(tmp_path / "out/rejected.parquet").to_pylist())
    assert reasons == [
        ("c", "duplicate_member"),
        ("d", "duplicate_member"),
        ("e", "duplicate_key"),
        ("g", "missing_caption"),
    ]
    assert "key 'c' has two images, 'c.jpg' and 'c.png'" in rejected["c"]["detail"]
    assert "key 'd' has two captions, 'd.txt' and 'd.caption'" in rejected["d"]["detail"]
    assert "key 'e' comes back at 'e.json'" in rejected["e"]["detail"]
    assert metrics["rejected_by_reason"]["duplicate_member"] == 2


# --- finding 4: keys that collide ----------------------------------------------------------------------------


def test_parquet_fallback_keys_never_collide_and_duplicate_keys_are_rejected(tmp_path):
    shard = tmp_path / "00000.parquet"
    rows = {
        "key": [None, "row-000000000", "k2", "k2"],
        "jpg": [_image(30), _image(31), _image(32), _image(33)],
        "caption": [CAPTION.decode()] * 4,
    }
    pq.write_table(pa.table(rows), shard)
    metrics, rejected, kept = _clean(shard, tmp_path / "out")
    assert metrics["records_in"] == 4
    assert sorted(kept) == ["k2", "row-000000000", "row-000000000~1"]  # the keyless row does not take a real key
    assert len(set(kept)) == len(kept)
    assert rejected["k2"]["reason"] == "duplicate_key"
    assert "row 3 has key 'k2', already used by row 2" in rejected["k2"]["detail"]


def test_report_thumbnails_find_images_of_records_rejected_at_the_shards_end(tmp_path):
    """A record missing its caption waits (bytes dropped) until the shard's end; the run report still shows its
    image, read straight from the tar. KEY.mask.png is another field of the sample, never its image."""
    from pipelines.qvl.rejected_samples import rejected_samples

    lake = tmp_path / "lake"
    members = [("k0.jpg", _image(0)), ("k1.mask.png", _image(9)), ("k1.png", _image(1)), ("k1.txt", CAPTION)]
    _write(lake / "00000.tar", _tar_bytes(members))
    out = tmp_path / "clean"
    run(CFG, lake_uri=str(lake), output_dir=out, tracker=NullTracker())
    samples, note = rejected_samples(out, str(lake))
    assert note == "" and [key for key, _, _ in samples["missing_caption"]] == ["k0"]
    assert samples["missing_caption"][0][2] == _image(0)
    kept = pq.read_table(next((out / "kept").glob("*.parquet"))).to_pylist()
    assert [(r["key"], r["image"]) for r in kept] == [("k1", _image(1))]  # the image, not the mask
