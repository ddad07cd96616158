"""The real-format set of `qvl lake synth --real`: an img2dataset lake whose every record clean_data keeps or rejects
for its known reason, and a data directory in the layouts users download that every reader takes."""

import json
import tarfile

import pyarrow.parquet as pq
import pytest

from components._shared.data import datasets
from components._shared.data.benchmarks import BENCHMARKS
from components._shared.platform.tracking import NullTracker
from components.clean_data.config import CleanDataConfig
from components.clean_data.stage import run
from components.synth_world import real_set


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    out = tmp_path_factory.mktemp("real")
    return out, real_set.write_real_set(out)


def test_lake_is_img2dataset_shaped_and_every_record_is_accounted_for(real, tmp_path):
    out, counts = real
    lake = out / "lake"
    assert sorted(p.name for p in lake.iterdir()) == ["00000.parquet", "00000.tar", "00000_stats.json"]
    with tarfile.open(lake / "00000.tar") as tar:
        names = tar.getnames()
        meta = json.loads(tar.extractfile("000000000.json").read())
    keys = {n.split(".")[0] for n in names}
    assert len(keys) == counts["lake_records"] == 24 and len(names) == 3 * 24  # image, .txt, .json per sample
    assert {"url", "key", "status", "caption", "width", "height"} <= set(meta) and meta["key"] == "000000000"
    assert pq.read_table(lake / "00000.parquet").num_rows == 24
    expected = real_set.write_lake(tmp_path / "lake")  # the same bytes again, with the reasons
    cfg = CleanDataConfig(clip_enabled=False, ocr_enabled=False, nsfw_enabled=False, outlier_enabled=False)
    metrics = run(cfg, lake_uri=str(tmp_path / "lake"), output_dir=tmp_path / "out", tracker=NullTracker())
    kept = pq.read_table(sorted((tmp_path / "out" / "kept").glob("part-*.parquet"))).to_pylist()
    rejected = pq.read_table(sorted((tmp_path / "out" / "rejected").glob("part-*.parquet"))).to_pylist()
    assert {r["key"] for r in kept} == {k for k, reason in expected.items() if reason is None}
    assert {r["key"]: r["reason"] for r in rejected} == {k: v for k, v in expected.items() if v}
    assert set(expected.values()) - {None} == real_set.LAKE_DEFECTS
    assert metrics["records_in"] == 24 == metrics["records_kept"] + metrics["records_rejected"]


def test_data_directory_reads_in_every_role(real):
    out, _ = real
    data = out / "data"
    sft = datasets.load_conversations(data)
    assert any(r["turns"][0]["role"] == "system" for r in sft)
    assert max(len(r["images"]) for r in sft) == 3 and sum(len(r["images"]) > 1 for r in sft) == 2
    assert json.loads((data / "sft" / "llava_instruct.json").read_text())[0]["conversations"]  # one JSON array
    pairs = datasets.load_preferences(data)
    assert len(pairs) == 10 and all(p["chosen"] != p["rejected"] for p in pairs)
    held_out = datasets.load_eval_records(data)
    assert {r["benchmark"] for r in held_out} == set(BENCHMARKS)  # only standard benchmarks, every layout
    prompts = datasets.load_questions(data, role="rl")
    assert len(prompts) == len(real_set.QA) and {p["type"] for p in prompts} == {"photo_qa"}
    assert {p["scorer"] for p in prompts} == {"exact_match"}
    assert {r["difficulty"] for r in sft} == {"basic", "advanced"}  # what the prod presets' curricula name
