"""The eleventh hostile pass (252 cases: 13 silent, 16 unclear, 8 tracebacks): the classes fixed, ids from its
report in brackets. A symlink loop anywhere a location is given [U23, U25-U29]; `//` in an s3 key [CL20, S03];
a run summary whose stage entry is not an object [RT_sd_list]; a lake record whose JSON is not an object
[R_DJ10]; with the sft_data step on, preflight checks sft's curriculum against what the builder makes and checks
sft_data_uri when the DAG stops at the step [SD_curr_pf, SD_pf_dsy_untilsd]; given data the build would break
[B22, B27, B28]; `<image>` in a caption [R_img_tok]; an ESC in a preset's experiment [E04]; a bad override in
`qvl submit` said as such, not as a failed submission [R_P13]."""

from __future__ import annotations

import io
import json

import pytest
import yaml
from kfp import compiler
from PIL import Image

from components._shared.platform.storage import check_location


@pytest.fixture
def loop(tmp_path):
    link = tmp_path / "loop"
    link.symlink_to(link)
    return link


def test_a_symlink_loop_is_refused_naming_the_setting_wherever_a_location_is_checked(loop, tmp_path):
    from pipelines.qvl.local_run import check_run_args

    with pytest.raises(ValueError, match=r"--data='.*loop': a symbolic link loop .*point it at a real file"):
        check_location(str(loop), "--data")
    (tmp_path / "lake").mkdir()
    with pytest.raises(ValueError, match="--data=.*a symbolic link loop"):  # qvl run resolved it first [U28]
        check_run_args(tmp_path / "run", str(tmp_path / "lake"), str(loop), "subprocess")
    assert check_location(str(tmp_path / "lake"), "--lake") == str(tmp_path / "lake")


def test_an_empty_part_in_an_s3_key_is_refused_like_dot_dot():
    with pytest.raises(ValueError, match=r"the key holds an empty part \('//'\)"):
        check_location("s3://bucket//lake", "lake_uri")
    assert check_location("s3://bucket/lake/", "lake_uri") == "s3://bucket/lake/"  # a trailing slash is a prefix


def test_a_stage_entry_that_is_not_an_object_is_shown_unreadable_not_a_crash(tmp_path):
    from pipelines.qvl.runs import find_runs

    (tmp_path / "a").mkdir()
    summary = {"status": "succeeded", "stages": {"sft_data": [1, 2], "sft": {"status": "succeeded", "metrics": {}}}}
    (tmp_path / "a" / "run_summary.json").write_text(json.dumps(summary))
    (run,) = find_runs(tmp_path)
    assert run.stages["sft_data"]["status"] == "unreadable (not a JSON object)" and run.stages["sft"]["metrics"] == {}


def test_a_lake_record_whose_json_is_not_an_object_is_rejected_as_bad_metadata():
    from components._shared.data.lake import Record, _parse_metadata
    from components.clean_data.config import CleanDataConfig
    from components.clean_data.records import Timer
    from components.clean_data.shard import _cheap_checks

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 10)).save(buf, format="PNG")
    for member in (b"[" * 100_000 + b"]" * 100_000, b"{not json", b"[1, 2]"):
        rec = Record("k", "s.tar", buf.getvalue(), "k.png", b"a green square", _parse_metadata(member))
        rejected = _cheap_checks(rec, CleanDataConfig(), Timer())
        assert isinstance(rejected, dict) and rejected["reason"] == "bad_metadata", rejected


def test_with_the_step_on_preflight_checks_the_curriculum_against_the_builders_difficulties():
    from components.preflight.fit import check_curriculum
    from components.preflight.stage import sft_records

    sft = {
        "build_data": {"enabled": True, "templates": ["caption", "color", "count", "shape"], "min_counterfactual": 0}
    }
    sft["build_data"]["max_type_share"] = 0.25
    made = sft_records(sft, None)
    assert made == [{"difficulty": "basic"}]
    with pytest.raises(ValueError, match=r"'advanced'\].*match no training record"):
        check_curriculum({**sft, "curriculum": [{"name": "hard", "difficulties": ["advanced"]}]}, made)
    assert sft_records({}, [{"difficulty": "x"}]) == [{"difficulty": "x"}]  # off: the given conversations
    assert sft_records({"build_data": {"enabled": True, "include_given": True}}, None) is None  # not known yet


def test_preflight_checks_the_sft_data_when_the_dag_stops_at_the_step(tmp_path):
    from pipelines.presets import load_preset
    from pipelines.vlm_training import build_pipeline

    (tmp_path / "p.yaml").write_text("extends: tiny\nsft: {build_data: {enabled: true}}\n")
    compiler.Compiler().compile(
        build_pipeline(load_preset(tmp_path / "p.yaml"), "sft_data", for_cluster=False), str(tmp_path / "c.yaml")
    )
    spec = yaml.safe_load((tmp_path / "c.yaml").read_text())
    needs = spec["root"]["dag"]["tasks"]["preflight-op"]["inputs"]["parameters"]["needs_sft_data"]
    assert needs["runtimeValue"]["constant"] is True


def test_given_data_the_build_would_break_is_refused(tmp_path):
    from components.sft.build_data import check_given

    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(ValueError, match="include_given: --data .* has no sft.jsonl"):  # [B22]
        check_given(str(data), data, include_given=True)
    (data / "sft.jsonl").write_text(json.dumps({"id": "built-000003", "image": "a.png", "conversations": []}) + "\n")
    with pytest.raises(ValueError, match=r"sft.jsonl:1: id 'built-000003' has the form the built rows take"):  # [B27]
        check_given(str(data), data, include_given=True)
    check_given(str(data), data, include_given=False)  # not trained on: no clash
    (data / "built_images").mkdir()
    with pytest.raises(ValueError, match="has a built_images/ folder, the name the builder writes"):  # [B28]
        check_given(str(data), data, include_given=False)


def test_a_caption_holding_the_image_placeholder_is_not_used_and_counted():
    from components._shared.model.encoder import ConversationEncoder
    from components._shared.model.vlm import load_vlm
    from components.sft import build_data
    from components.sft.config import SftConfig

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    chunk = [2, 12, 0.1, 0.1, 0.6, 0.6, 0.9]
    rows = [
        {"image_hash": h, "caption": c, "image": buf.getvalue(), "metadata": json.dumps({"noun_chunks": [chunk]})}
        for h, c in (("h1", "a red square."), ("h2", "a red square <image> here."))
    ]
    loaded = load_vlm("builtin:tiny-qwen2_5-vl")
    encoder = ConversationEncoder(loaded.processor, loaded.model, min_pixels=3136, max_pixels=50176)
    images, _, lake = build_data.generate(SftConfig(), rows, encoder, "absolute")
    assert list(images) == ["h1"] and lake["not_used"] == {"the caption holds '<image>', the image placeholder": 1}


def test_an_experiment_name_with_a_control_character_is_refused(tmp_path):
    from pipelines.presets import load_preset

    (tmp_path / "p.yaml").write_text('extends: tiny\nexperiment: "vlm\\x1b[31mred"\n')
    with pytest.raises(ValueError, match=r"experiment 'vlm\\x1b\[31mred' holds a control character"):
        load_preset(tmp_path / "p.yaml")


def test_a_bad_override_in_submit_is_refused_before_anything_is_sent(monkeypatch):
    from pipelines import submit as sub

    monkeypatch.setattr(sub, "make_client", lambda *a, **k: pytest.fail("a client was made"))
    with pytest.raises(sub.SubmitError, match=r"Override 'sft.lora.r=\[\[\[\[': the value is not valid YAML"):
        sub.compile_and_submit(
            host="http://127.0.0.1:9",
            experiment="vlm",
            preset="tiny",
            pairs=["lake_uri=s3://bucket/lake", "sft.lora.r=[[[["],
            run_name=None,
            namespace=None,
            echo=lambda line: None,
        )
