"""clean_data on a lake of real photographs: the awkward encodings (EXIF-rotated, CMYK, palette, 16-bit grayscale,
WebP) are kept, the real defects (a re-encoded copy, a truncated file, a duplicate, an empty caption) rejected with
their reason, every record accounted for."""

import pyarrow.parquet as pq

from components._shared.platform.tracking import NullTracker
from components.clean_data.config import CleanDataConfig
from components.clean_data.stage import run
from components.synth_world import real_photos as P


def test_clean_data_keeps_awkward_encodings_and_rejects_real_defects(tmp_path):
    expected = P.write_photo_lake(tmp_path / "lake")
    # the tiny CLIP and the OCR / NSFW models judge content; this test is about decoding and accounting
    cfg = CleanDataConfig(clip_enabled=False, ocr_enabled=False, nsfw_enabled=False, outlier_enabled=False)
    metrics = run(cfg, lake_uri=str(tmp_path / "lake"), output_dir=tmp_path / "out", tracker=NullTracker())
    kept = pq.read_table(sorted((tmp_path / "out" / "kept").glob("part-*.parquet"))).to_pylist()
    rejected = pq.read_table(sorted((tmp_path / "out" / "rejected").glob("part-*.parquet"))).to_pylist()
    assert {r["key"] for r in kept} == {k for k, reason in expected.items() if reason is None}
    assert {r["key"]: r["reason"] for r in rejected} == {k: v for k, v in expected.items() if v}
    assert metrics["records_in"] == len(expected) == metrics["records_kept"] + metrics["records_rejected"]
