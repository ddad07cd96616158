"""clean_data against hostile lakes: broken images, bombs, unsafe tar members, broken shards, random bytes.

Model levels are off here (they are covered by test_clean_data.py); every record must still be accounted.
"""

import io
import json
import random
import struct
import tarfile
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from components._shared.platform.tracking import NullTracker
from components.clean_data import filters
from components.clean_data.config import CleanDataConfig
from components.clean_data.stage import clean_shard, list_shards, merge_shards, run

CFG = CleanDataConfig(
    clip_enabled=False, nsfw_enabled=False, ocr_enabled=False, outlier_enabled=False, max_image_pixels=4_000_000
)


def _image(size=(64, 48), fmt="JPEG", seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, size=(size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).resize(size, Image.Resampling.NEAREST).save(buf, fmt)
    return buf.getvalue()


def _bomb_png(width=100_000, height=100_000) -> bytes:
    def chunk(tag, body):
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def _write_tar(path: Path, members) -> Path:
    """members: (name, bytes) for files, or a ready TarInfo (links, devices)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                name, data = member
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _special(name, kind, target="") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _caption(text="A red circle on a plain grey background."):
    return text.encode()


def _truncated_png() -> bytes:
    data = _image((120, 90), "PNG", seed=3)
    return data[: len(data) // 2]


HOSTILE = [
    ("000001.jpg", b"\x00\x01garbage" * 50),
    ("000001.txt", _caption()),
    ("000002.png", _truncated_png()),
    ("000002.txt", _caption()),
    ("000003.jpg", b""),
    ("000003.txt", _caption()),
    ("000004.png", _bomb_png()),
    ("000004.txt", _caption()),
    ("000005.jpg", _image(seed=5)),
    ("000005.txt", b"\xff\xfe bad \xc3\x28 utf8"),
    ("000006.jpg", _image(seed=6)),
    ("000007.txt", _caption()),
    ("../evil.txt", b"escaped"),
    ("/abs.jpg", _image(seed=8)),
    _special("000008.jpg", tarfile.SYMTYPE, "/etc/passwd"),
    ("000008.txt", _caption()),
    _special("000009.jpg", tarfile.LNKTYPE, "000012.jpg"),
    _special("000010.jpg", tarfile.CHRTYPE),
    ("000011.png", _image((2000, 40), "PNG", seed=11)),
    ("000011.txt", _caption()),
    ("000012.jpg", _image(seed=12)),
    ("000012.txt", _caption("Two shapes: a blue square and a red circle.")),
    ("000013.gif", _image(fmt="GIF", seed=13)),
    ("000013.txt", _caption()),
    ("000014.bmp", _image(fmt="BMP", seed=14)),
    ("000014.txt", _caption()),
    ("000015.jpg", _image((10, 10), seed=15)),
    ("000015.txt", _caption()),
    ("000016.jpg", _image(seed=16)),
    ("000016.txt", b"   \n"),
    ("000017.jpg", _image(seed=17)),
    ("000017.txt", b"IMG_1234.JPG"),
    ("000018.jpg", _image(seed=12)),
    ("000018.txt", _caption("The same picture again, a copy.")),
    ("000019.webp", _image(fmt="WEBP", seed=19)),
    ("000019.txt", _caption("A small webp picture of noise.")),
    ("000019.json", b"{not json"),
]
EXPECTED = {
    "000001": "undecodable",
    "000002": "truncated_image",
    "000003": "empty_file",
    "000004": "decompression_bomb",
    "000005": "caption_not_utf8",
    "000006": "missing_caption",
    "000007": "missing_image",
    "../evil": "unsafe_member",
    "/abs": "unsafe_member",
    "000008": "unsafe_member",
    "000009": "unsafe_member",
    "000010": "unsafe_member",
    "000011": "extreme_aspect",
    "000013": "unsupported_format",
    "000014": "unsupported_format",
    "000015": "too_small",
    "000016": "empty_caption",
    "000017": "garbage_caption",
    "000018": "exact_duplicate",
    "000019": "bad_metadata",  # a good WEBP and caption, but its .json is not JSON: its fields would be lost unsaid
}


def _rejected(out: Path) -> dict[str, str]:
    table = pq.read_table(out / "rejected.parquet")
    return dict(zip(table.column("key").to_pylist(), table.column("reason").to_pylist(), strict=True))


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_hostile_tar_each_record_rejected_with_its_reason(tmp_path, monkeypatch):
    lake = tmp_path / "lake"
    lake.mkdir()
    _write_tar(lake / "00000.tar", HOSTILE)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "out"
    metrics = clean_shard(CFG, shard_uri=str(lake / "00000.tar"), output_dir=out, tracker=NullTracker())

    assert _rejected(out) == EXPECTED
    kept = pq.read_table(out / "kept.parquet").to_pylist()
    assert [r["key"] for r in kept] == ["000012"]
    assert metrics["records_in"] == 21 == metrics["records_kept"] + metrics["records_rejected"]
    report = json.loads((out / "shard_report.json").read_text())
    assert report["rejected_by_reason"]["unsafe_member"] == 5 and report["shard_error"] is None
    assert sum(report["rejected_by_reason"].values()) == report["records_rejected"] == 20
    # nothing escaped: the only files are the lake, and the three outputs
    assert _files_under(cwd) == set() and not (tmp_path / "evil.txt").exists() and not Path("/abs.jpg").exists()
    assert _files_under(out) == {"kept.parquet", "rejected.parquet", "shard_report.json"}


def test_broken_tar_keeps_what_was_read_and_reports_the_rest(tmp_path):
    members = []
    for i in range(10):
        members += [
            (f"{i:06d}.jpg", _image(seed=100 + i)),
            (f"{i:06d}.txt", _caption(f"Noise picture number {i} here.")),
        ]
    good = _write_tar(tmp_path / "good.tar", members).read_bytes()
    with tarfile.open(tmp_path / "good.tar") as tar:
        cut = next(m.offset_data + m.size // 2 for m in tar.getmembers() if m.name == "000006.jpg")
    broken = good[:cut]  # the tar ends inside record 000006's image
    (tmp_path / "lake").mkdir()
    (tmp_path / "lake" / "00000.tar").write_bytes(broken)
    (tmp_path / "lake" / "00001.tar").write_bytes(b"this is not a tar file at all" * 40)
    out = tmp_path / "out"
    metrics = run(CFG, lake_uri=str(tmp_path / "lake"), output_dir=out, tracker=NullTracker())

    manifest = json.loads((out / "manifest.json").read_text())
    first, second = manifest["per_shard"]["00000.tar"], manifest["per_shard"]["00001.tar"]
    assert (first["records_in"], first["records_kept"], first["rejected_by_reason"]["shard_error"]) == (7, 6, 1)
    assert first["records_rejected"] == 1 and first["shard_error"]["records_read"] == 7
    assert "Error" in first["shard_error"]["error"]
    assert second["records_in"] == 0 and second["shard_error"] is not None
    assert metrics["shard_errors"] == 2 and metrics["records_in"] == first["records_in"]
    assert not (out / "_shards").exists()


def test_parquet_lake_and_merge_accounting(tmp_path):
    lake = tmp_path / "lake"
    lake.mkdir()
    rows = [
        {
            "key": f"p{i:03d}",
            "jpg": _image(seed=200 + i),
            "caption": f"Noise picture number {i} in parquet.",
            "url": f"https://x/{i}.jpg",
        }
        for i in range(6)
    ]
    rows[2]["jpg"] = None
    rows[3]["caption"] = "0x3f2a9bc1d4e5f6a7"
    rows[4]["jpg"] = rows[0]["jpg"]  # exact duplicate of p000
    pq.write_table(pa.Table.from_pylist(rows), lake / "00000.parquet")
    _write_tar(lake / "00001.tar", [("t000.jpg", rows[0]["jpg"]), ("t000.txt", _caption("Cross-shard copy of p000."))])
    shards = list_shards(str(lake))
    assert [Path(s).name for s in shards] == ["00000.parquet", "00001.tar"]
    dirs = []
    for i, uri in enumerate(shards):
        clean_shard(CFG, shard_uri=uri, output_dir=tmp_path / f"s{i}", tracker=NullTracker())
        dirs.append(tmp_path / f"s{i}")
    metrics = merge_shards(CFG, shard_dirs=dirs, output_dir=tmp_path / "final", tracker=NullTracker())

    kept = pq.read_table(tmp_path / "final/kept/part-00000.parquet")
    assert sorted(kept.column("key").to_pylist()) == ["p000", "p001", "p005"]
    assert kept.column("image_hash").to_pylist() == sorted(kept.column("image_hash").to_pylist())
    assert json.loads(kept.to_pylist()[0]["metadata"])["url"].startswith("https://x/")
    rejected = pq.read_table(tmp_path / "final/rejected/part-00000.parquet").to_pylist()
    assert {(r["key"], r["reason"]) for r in rejected} == {
        ("p002", "missing_image"),
        ("p003", "garbage_caption"),
        ("p004", "exact_duplicate"),
        ("t000", "exact_duplicate"),
    }
    assert (
        metrics["records_in"] == 7
        and metrics["records_kept"] == 3
        and metrics["rejected_by_reason"]["exact_duplicate"] == 2
    )
    manifest = json.loads((tmp_path / "final/manifest.json").read_text())
    assert manifest["per_shard"]["00001.tar"] == {
        "records_in": 1,
        "records_kept": 0,
        "records_rejected": 1,
        "rejected_by_reason": manifest["per_shard"]["00001.tar"]["rejected_by_reason"],
        "shard_error": None,
    }
    assert "kept/part-00000.parquet" in manifest["files"] and (tmp_path / "final/report.md").is_file()


def test_a_lake_with_no_record_kept_fails_in_clean_data_naming_the_reasons_and_the_columns(tmp_path):
    """A Parquet lake whose columns clean_data does not know: every record is rejected, and the stage fails there
    (counts per reason, an example, the file's columns), not two stages later in pretrain's data filter."""
    lake = tmp_path / "lake"
    lake.mkdir()
    rows = [{"uid": f"r{i}", "image_bytes": _image(seed=300 + i), "text": _caption()} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), lake / "00000.parquet")
    with pytest.raises(ValueError) as err:
        run(CFG, lake_uri=str(lake), output_dir=tmp_path / "out", tracker=NullTracker())
    message = str(err.value)
    assert "kept no record of the lake's 4" in message and "missing_image 4" in message
    assert "the file's columns are ['uid', 'image_bytes', 'text']" in message
    assert str(tmp_path / "out" / "report.md") in message and (tmp_path / "out" / "report.md").is_file()


def test_parquet_rows_are_read_from_whichever_image_column_they_fill(tmp_path):
    """img2dataset-like files with `jpg` and `png` columns, each row filling one: the png rows were rejected as having
    no image. A second caption column is not dropped: it stays in the record's metadata."""
    rows = [
        {"key": f"r{i}", "jpg": None if i % 2 else _image(seed=400 + i), "png": _image(seed=400 + i, fmt="PNG") if i % 2
         else None, "caption": f"Noise picture number {i} in parquet.", "txt": f"other text {i}"}
        for i in range(4)
    ]  # fmt: skip
    (tmp_path / "lake").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "lake" / "00000.parquet")
    metrics = clean_shard(CFG, shard_uri=str(tmp_path / "lake" / "00000.parquet"), output_dir=tmp_path / "s",
                          tracker=NullTracker())  # fmt: skip
    kept = pq.read_table(tmp_path / "s" / "kept.parquet").to_pylist()
    assert metrics["records_kept"] == 4 and sorted(r["key"] for r in kept) == ["r0", "r1", "r2", "r3"]
    assert {json.loads(r["metadata"])["txt"] for r in kept} == {f"other text {i}" for i in range(4)}


def test_missing_lake_and_bad_shard_dirs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list_shards(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"No \*\.tar, .* or \*\.parquet shards under"):
        list_shards(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="lacks"):
        merge_shards(CFG, shard_dirs=[tmp_path / "empty"], output_dir=tmp_path / "o", tracker=NullTracker())


@pytest.mark.parametrize(
    "text",
    [
        "IMG_1234.JPG",
        "DSC00042",
        "DSC00042.jpg",
        "3f9a0b1c2d3e4f5a6b7c",
        "https://cdn3.example.com/ab12/77.jpg",
        "aaaaaaaaaaaa",
        "!!!!!!!!",
        "#$%&*@^~+=<>",
        "Screenshot 2021-03-14 at 5.12.33.png",
        "spam spam spam spam",
        "ok",
    ],
)
def test_garbage_captions_flagged(text):
    assert filters.garbage_caption(text, min_words=2, min_letter_ratio=0.5, max_repeated_chars=5)


@pytest.mark.parametrize(
    "text",
    [
        "A red circle on a plain background.",
        ('Two shapes: a blue square on the left and a green cross on the right, with the word "cat".'),
        "一只红色的猫坐在沙发上",
        "Ein rotes Quadrat über einem grünen Kreis.",
        "Photo of the 2024 Tour de France",
    ],
)
def test_real_captions_pass(text):
    assert filters.garbage_caption(text, min_words=2, min_letter_ratio=0.5, max_repeated_chars=5) is None


def test_phash_index_matches_brute_force():
    rng = random.Random(0)
    base = [rng.getrandbits(64) for _ in range(300)]
    # near copies: flip 0..8 bits of some hashes
    queries = [b ^ sum(1 << rng.randrange(64) for _ in range(rng.randrange(9))) for b in base[:100]]
    queries += [rng.getrandbits(64) for _ in range(100)]
    index = filters.PhashIndex(max_distance=6)
    for i, h in enumerate(base):
        index.add(h, i)
    for q in queries:
        best = min(((h ^ q).bit_count(), i) for i, h in enumerate(base))
        found = index.find(q)
        if best[0] <= 6:
            assert found is not None and found[1] == best[0]
        else:
            assert found is None


def test_knn_outlier_flags_the_far_point():
    rng = np.random.default_rng(0)
    cluster = rng.normal(size=(200, 16)) * 0.05 + np.eye(16)[0]
    points = np.vstack([cluster, np.eye(16)[5]]).astype(np.float32)
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    scores = filters.knn_outlier_scores(points, k=5, reference_size=64, seed=0)
    threshold = filters.robust_threshold(scores, 8.0)
    assert np.nonzero(scores > threshold)[0].tolist() == [200]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(
        st.tuples(st.binary(max_size=300), st.binary(max_size=80), st.sampled_from(["jpg", "png", "webp", "gif"])),
        min_size=1,
        max_size=6,
    )
)
def test_random_bytes_never_crash_and_are_accounted(records):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        members = []
        for i, (image, caption, ext) in enumerate(records):
            members += [(f"{i:04d}.{ext}", image), (f"{i:04d}.txt", caption)]
        _write_tar(tmp / "00000.tar", members)
        metrics = clean_shard(CFG, shard_uri=str(tmp / "00000.tar"), output_dir=tmp / "out", tracker=NullTracker())
        assert metrics["records_in"] == len(records)
        assert metrics["records_kept"] + metrics["records_rejected"] == len(records)
        assert sum(metrics["rejected_by_reason"].values()) == metrics["records_rejected"]
        assert pq.read_table(tmp / "out/rejected.parquet").num_rows == metrics["records_rejected"]


def test_a_shard_runs_torch_on_the_threads_its_config_names(tmp_path):
    """kfp.local cleans two shards at once: torch_threads: 1 keeps each on one core (docs/benchmarks.md)."""
    import torch

    lake = tmp_path / "lake"
    lake.mkdir()
    _write_tar(lake / "00000.tar", [("000001.jpg", _image()), ("000001.txt", _caption())])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        metrics = clean_shard(
            CFG.model_copy(update={"torch_threads": 1}),
            shard_uri=str(lake / "00000.tar"),
            output_dir=tmp_path / "out",
            tracker=NullTracker(),
        )
        assert torch.get_num_threads() == 1
        assert metrics["records_kept"] == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="torch_threads"):
        CleanDataConfig(torch_threads=-1)
