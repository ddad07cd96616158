"""The twelfth hostile pass's leftovers, ids from its report in brackets: a look-alike letter in a setting's choice or
an `extends:` name printed back unexplained [SD12, PR37]; `build_data.include_given` copying a record sft refuses into
the build, said only after the GPU step and naming the build's file [SD93, SD98]; a lake record whose .json caption
is not its .txt caption cleaned without a word [LK_d]."""

from __future__ import annotations

import io
import json
import logging
import tarfile

import pytest
from PIL import Image


def test_a_look_alike_letter_in_a_settings_choice_is_named():
    from components._shared.platform.config import format_validation_error
    from components.sft.config import SftConfig

    with pytest.raises(Exception) as caught:  # noqa: PT011 - pydantic's ValidationError, rewritten below
        SftConfig.model_validate({"build_data": {"templates": ["\u0441aption"]}})
    message = format_validation_error("sft", caught.value)
    assert "(got 'сaption'; 'с' is CYRILLIC SMALL LETTER ES (U+0441), not an ASCII letter: retype it" in message
    with pytest.raises(Exception) as plain:  # noqa: PT011
        SftConfig.model_validate({"build_data": {"templates": ["captions"]}})
    assert "ASCII" not in format_validation_error("sft", plain.value)  # a plain typo: no word of letters


def test_a_look_alike_letter_in_an_extends_name_is_named(tmp_path):
    from components._shared.platform.presets import read_preset_yaml

    (tmp_path / "p.yaml").write_text("extends: t\u0456ny\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'і' is CYRILLIC SMALL LETTER BYELORUSSIAN-UKRAINIAN I \(U\+0456\)"):
        read_preset_yaml(tmp_path / "p.yaml")
    (tmp_path / "q.yaml").write_text("extends: tinyy\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"none of .* exists\.$"):
        read_preset_yaml(tmp_path / "q.yaml")


def _given(tmp_path, first_role: str):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32), "red").save(data / "a.png")
    turns = [{"from": "human", "value": "<image>\nWhat color?"}, {"from": "gpt", "value": "Red."}]
    good = {"id": "g1", "image": "a.png", "conversations": turns}
    bad = {"id": "g2", "image": "missing.png", "conversations": [{"from": first_role, "value": "<image>\nHi"}]}
    (data / "sft.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    return data


def test_a_given_record_sft_would_refuse_is_said_by_the_builder_naming_data(tmp_path):
    from components._shared.platform import bad_records
    from components.sft.build_data import check_given

    data = _given(tmp_path, "gpt")
    with pytest.raises(ValueError, match=r"include_given copies --data .*'s sft.jsonl into the build as it is") as e:
        check_given(str(data), data, include_given=True)
    assert "sft.jsonl:2 (id='g2')" in str(e.value) and "fix or drop them" in str(e.value)
    check_given(str(data), data, include_given=False)  # not copied: not read
    with bad_records.policy("skip"):  # sft drops and counts them itself
        check_given(str(data), data, include_given=True)


def _shard(path, json_caption):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "blue").save(buf, "PNG")
    with tarfile.open(path, "w") as tar:
        for key, caption in (("000001", "a blue square on a plain field"), ("000002", "a blue square again here")):
            meta = {} if json_caption is None else {"caption": json_caption if key == "000001" else caption}
            for name, body in ((".png", buf.getvalue()), (".txt", caption.encode()), (".json", json.dumps(meta))):
                body = body.encode() if isinstance(body, str) else body
                info = tarfile.TarInfo(key + name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))


@pytest.mark.parametrize("json_caption, differs", [(["a", "b"], 1), ("another caption", 1), (None, 0)])
def test_a_json_caption_other_than_the_txt_one_is_counted_and_said(tmp_path, caplog, json_caption, differs):
    from components._shared.platform.tracking import NullTracker
    from components.clean_data.config import CleanDataConfig
    from components.clean_data.stage import run

    (tmp_path / "lake").mkdir()
    _shard(tmp_path / "lake" / "00000.tar", json_caption)
    cfg = CleanDataConfig(clip_enabled=False, nsfw_enabled=False, ocr_enabled=False, outlier_enabled=False)
    with caplog.at_level(logging.WARNING):
        metrics = run(cfg, lake_uri=str(tmp_path / "lake"), output_dir=tmp_path / "out", tracker=NullTracker())
    assert metrics["json_caption_differs"] == differs
    assert metrics["records_kept"] + metrics["records_rejected"] == 2
    said = "hold a 'caption' in their .json other than their .txt caption (e.g. key '000001'" in caplog.text
    assert said == bool(differs)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["json_caption_differs"]["count"] == differs
