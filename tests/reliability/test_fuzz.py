"""Fuzzed inputs beyond the tar path of tests/unit/test_hostile_inputs.py: JSON sidecars in
tars, Parquet shards (valid files with hostile values, and random bytes), stage configs and command-line
overrides. Property: no crash other than a clear, typed error; every record accounted."""

import io
import json
import tarfile
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from components._shared.platform.tracking import NullTracker
from components.clean_data.config import CleanDataConfig
from components.clean_data.stage import clean_shard

CFG = CleanDataConfig(
    clip_enabled=False, nsfw_enabled=False, ocr_enabled=False, outlier_enabled=False, max_image_pixels=4_000_000
)
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_JPEG = io.BytesIO()
Image.new("RGB", (64, 48), (200, 30, 30)).save(_JPEG, "JPEG")
JPEG = _JPEG.getvalue()


def _accounted(metrics: dict, n: int) -> None:
    assert metrics["records_in"] == n
    assert metrics["records_kept"] + metrics["records_rejected"] == n
    assert sum(metrics["rejected_by_reason"].values()) == metrics["records_rejected"]


def _clean(shard: Path, out: Path) -> dict:
    return clean_shard(CFG, shard_uri=str(shard), output_dir=out, tracker=NullTracker())


json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(
    sidecars=st.lists(
        st.one_of(st.binary(max_size=120), json_values.map(lambda v: json.dumps(v).encode())), min_size=1, max_size=5
    )
)
def test_json_sidecars_of_any_shape_never_crash_and_every_record_is_accounted(sidecars):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with tarfile.open(tmp / "00000.tar", "w") as tar:
            for i, sidecar in enumerate(sidecars):
                for name, data in (
                    (f"{i:04d}.jpg", JPEG),
                    (f"{i:04d}.txt", b"a red square on a white page"),
                    (f"{i:04d}.json", sidecar),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        _accounted(_clean(tmp / "00000.tar", tmp / "out"), len(sidecars))


@FUZZ
@given(
    rows=st.lists(
        st.tuples(
            st.one_of(st.just(JPEG), st.binary(max_size=64), st.none()),
            st.one_of(st.text(max_size=40), st.none()),
            st.one_of(st.text(max_size=10), st.integers(), st.none()),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_parquet_shards_with_hostile_values_never_crash_and_every_row_is_accounted(rows):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        table = pa.table(
            {
                "image": pa.array([r[0] for r in rows], pa.binary()),
                "caption": pa.array([r[1] for r in rows], pa.string()),
                "extra": pa.array([None if r[2] is None else str(r[2]) for r in rows], pa.string()),
            }
        )
        pq.write_table(table, tmp / "00000.parquet")
        _accounted(_clean(tmp / "00000.parquet", tmp / "out"), len(rows))


@FUZZ
@given(data=st.binary(max_size=400))
def test_random_bytes_as_a_parquet_shard_are_a_shard_error_not_a_crash(data):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "00000.parquet").write_bytes(b"PAR1" + data + b"PAR1")
        metrics = _clean(tmp / "00000.parquet", tmp / "out")
        assert metrics["shard_errors"] == 1 and metrics["records_in"] == 0  # reported, nothing half-read


config_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
)


@FUZZ
@pytest.mark.parametrize("stage", ["clean_data", "extract_features", "pretrain", "sft", "reward_model", "rl"])
@given(data=st.data())
def test_stage_configs_reject_any_bad_value_with_an_error_naming_the_setting(stage, data):
    from components._shared.platform.presets import validate
    from components.stages import load_config_class

    config_cls = load_config_class(stage)
    fields = sorted(config_cls.model_fields)
    section = data.draw(st.dictionaries(st.sampled_from(fields + ["not_a_setting"]), config_values, max_size=4))
    try:
        validate(config_cls, stage, section)
    except ValueError as error:
        message = str(error)
        assert f"Invalid config for stage '{stage}'" in message or stage in message, message
        assert any(key in message for key in section), message  # the error names a setting it was given


@FUZZ
@given(pairs=st.lists(st.text(max_size=20), max_size=4))
@example(pairs=["\x80="])  # found by a run: the non-ASCII key's message did not say key=value
@example(pairs=["a..b=1"])
def test_command_line_overrides_parse_or_say_how_to_write_them(pairs):
    from components._shared.platform.presets import parse_overrides

    try:
        parsed = parse_overrides(pairs)
    except ValueError as error:
        assert "key=value" in str(error)
    else:
        assert isinstance(parsed, dict)
