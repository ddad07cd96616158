"""What the eighth hostile pass (294 cases; 22 silent, 19 unclear, 2 tracebacks, 1 hang) found, each held.

Its report's ids are in brackets: committed outputs tampered with after their commit [T01, T_extravalid, T_noresult,
T_dotdot, T_garbage], region and calibration settings that train nothing [g19c, g18, g34, G22, G29, G36, K02, K23],
submission forms [S06, S08, S09, S11, S13], YAML forms [P04, P10, P14, O19], invisible characters [Y_zwsp, Y_nfd,
r_bidi, t_faint_all], run directories inside outputs [R07, RH08, R17], and the rest [L07, L08, PB04, PB06, RN07,
e_emptylist, V01].
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from components._shared.platform import storage
from pipelines.qvl.app import app

runner = CliRunner()


def _committed_output(root: Path) -> Path:
    """A stage output as a stage leaves it: model/ and kept/ files, the result record, the marker last."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "model.safetensors").write_bytes(b"weights" * 100)
    (root / "model" / "qvl_model.json").write_text('{"confidence_temperature": 1.5}\n')
    (root / "kept").mkdir()
    (root / "kept" / "part-00000.parquet").write_bytes(b"PAR1 rows PAR1")
    (root / "_stage_result.json").write_text("{}")
    storage.commit_dir(root)
    return root


# -- committed outputs tampered with ------------------------------------------------------------------------------
def test_a_model_inside_a_committed_output_is_verified_against_the_outputs_marker(tmp_path):
    from components._shared.launch.runner import verify_inputs

    out = _committed_output(tmp_path / "sft")
    assert verify_inputs({"base_model": str(out / "model")}) == 1
    weights = out / "model" / "model.safetensors"
    weights.write_bytes(b"Weights" + weights.read_bytes()[7:])  # same size, one byte changed [T01]
    with pytest.raises(storage.IntegrityError, match=r"model.safetensors does not match _COMMITTED.json"):
        verify_inputs({"base_model": str(out / "model")})


def test_files_added_to_a_committed_output_are_refused_not_read(tmp_path):
    from components._shared.launch.runner import verify_inputs

    out = _committed_output(tmp_path / "clean")
    (out / "kept" / "part-00001.parquet").write_bytes(b"PAR1 more rows PAR1")  # [T_extravalid]
    with pytest.raises(storage.IntegrityError, match=r"kept/part-00001.parquet\): added after the stage committed"):
        verify_inputs({"clean_data": str(out)})
    (out / "kept" / "part-00001.parquet").unlink()
    (out / "checkpoints.stale-ab12").mkdir()  # a set-aside run's files and lock files are not the output's
    (out / "checkpoints.stale-ab12" / "x.bin").write_bytes(b"x")
    (out / ".qvl-lock").write_text("")
    assert verify_inputs({"clean_data": str(out)}) == 1


def test_an_input_only_a_stage_makes_must_exist_and_be_committed(tmp_path):
    from components._shared.launch.runner import verify_inputs

    with pytest.raises(ValueError, match=r"--clean-data .*no/such: no such directory; give the output directory"):
        verify_inputs({"clean_data": str(tmp_path / "no" / "such")})  # [V01]
    bare = tmp_path / "bare"  # neither marker nor result record [T_noresult]
    (bare / "kept").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--clean-data .*bare is, or lies in, a stage.s output without its commit"):
        verify_inputs({"clean_data": str(bare)})


def test_a_marker_that_is_not_json_or_lists_a_path_outside_is_refused_naming_it(tmp_path):
    out = _committed_output(tmp_path / "out")
    marker = json.loads((out / storage.COMMIT_MARKER).read_text())
    (tmp_path / "afile").write_bytes(b"outside")
    marker["files"]["../afile"] = {"size": 7, "sha256": storage.sha256_file(tmp_path / "afile")}  # [T_dotdot]
    (out / storage.COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(storage.IntegrityError, match=r"lists '../afile', outside"):
        storage.verify_dir(out)
    (out / storage.COMMIT_MARKER).write_text("not json {")  # [T_garbage]
    with pytest.raises(storage.IntegrityError, match=r"_COMMITTED.json is not JSON \(damaged or replaced\)"):
        storage.verify_dir(out)


def test_a_run_directory_inside_a_committed_output_is_refused_before_anything_is_said(tmp_path):
    out = _committed_output(tmp_path / "clean")
    args = ["run", "--local", "--lake", str(tmp_path / "lake"), "--data", str(tmp_path / "data")]
    result = runner.invoke(app, [*args, "--out", str(out / "sub")])  # [R07]
    assert "lies inside" in str(result.exception) and "a stage's committed output" in str(result.exception)
    assert not (out / "sub").exists() and "Running preset" not in result.output
    result = runner.invoke(app, ["rehearse", "--preset", "prod-7b", "--out", str(out / "model")])  # [RH08]
    assert "lies inside" in str(result.exception) and not (out / "model" / "prod-7b").exists()
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "run"), "--runner", "podman"])  # [R17]
    assert "--runner 'podman': choose subprocess or docker" in str(result.exception)
    assert "Running preset" not in result.output


# -- region and calibration settings that train nothing -----------------------------------------------------------
def _record(caption: str, chunks: list) -> dict:
    return {"caption": caption, "image_hash": "h", "metadata": json.dumps({"noun_chunks": chunks})}


def test_region_chunks_out_of_range_or_repeated_are_counted_and_one_phrase_is_refused():
    from components._shared.data.regions import DUPLICATE, MALFORMED, record_regions
    from components.pretrain.config import RegionConfig
    from components.pretrain.regions import collect_regions

    caption = "a red square and a blue circle"
    square, circle = [2, 12, 0.1, 0.1, 0.4, 0.4, 1.0], [19, 30, 0.5, 0.5, 0.9, 0.9, 0.8]
    regions, dropped = record_regions(_record(caption, [square, [*square[:6], 2.5], square, circle]), 0.0)
    assert [r.phrase for r in regions] == ["red square", "blue circle"]
    assert dropped == [MALFORMED, DUPLICATE]  # a score of 2.5 is no probability [g18]; a repeat is one box [g34]
    cfg = RegionConfig(enabled=True)
    _, metrics = collect_regions([_record(caption, [square, circle])] * 3, cfg)
    assert metrics["region_phrases"] == 2 and metrics["region_boxes"] == 6
    with pytest.raises(ValueError, match=r"3 of the 3 usable boxes .* name one phrase \(.red square., case"):  # [g19c]
        collect_regions([_record(caption, [square])] * 3, cfg)


def test_region_and_calibration_settings_that_do_nothing_are_refused_or_said():
    from components.pretrain.config import PretrainConfig, RegionConfig
    from components.sft.config import SftConfig

    with pytest.raises(ValueError, match="greater than or equal to 0.01"):  # [G22]: 1e-9 trained at loss 1e8
        RegionConfig(temperature=1e-9)
    with pytest.raises(ValueError, match="weights are all 0: the region term would train nothing"):  # [G29]
        RegionConfig(enabled=True, schedule=[{"fraction": 1, "weight": 0}])
    ignored = PretrainConfig.model_validate({"region": {"temperature": 0.5}}).ignored_settings()  # [G36]
    assert ignored == ["region.temperature: a region setting; region.enabled is false"]
    ignored = SftConfig.model_validate({"calibration": {"fraction": 0.3}}).ignored_settings()  # [K23, K25]
    assert ignored == ["calibration.fraction: the temperature's share; calibration.fit_temperature is false"]


# -- submission, YAML and invisible characters --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("ftp://127.0.0.1:9", r"the scheme must be http or https \(got ftp\)"),  # [S08]
        ("http://127.0.0.1:9/#frag", "has a query or fragment"),  # [S09]
        ("http://127.0.0.1:9/?a=1", "has a query or fragment"),
        ("http://127.0.0.1:99999", "the port must be a number from 1 to 65535"),  # [S11]
        ("http://127.0.0.1:0", "the port must be a number from 1 to 65535"),
        ("http://", "names no host"),
    ],
)
def test_a_host_the_client_cannot_use_is_named_before_compiling(host, said):
    from pipelines.submit import SubmitError, check_host

    with pytest.raises(SubmitError, match=said):
        check_host(host)


def test_hosts_the_client_uses_pass():
    from pipelines.submit import check_host

    for host in ("https://kfp.example.com/pipeline", "http://127.0.0.1:8888", "http://[::1]:8080/x"):
        check_host(host)


def test_a_bearer_prefix_in_the_token_and_invisible_characters_in_names_are_refused(monkeypatch):
    from pipelines.submit import SubmitError, check_submission

    monkeypatch.setenv("KFP_TOKEN", "Bearer abcdef123456")  # [S06]
    with pytest.raises(SubmitError, match=r"holds a space \(\"Bearer ...\"\?\): give the token alone"):
        check_submission("exp", None, None)
    monkeypatch.setenv("KFP_TOKEN", "abcdef123456")
    with pytest.raises(SubmitError, match="RIGHT-TO-LEFT OVERRIDE"):  # [S13]: reads as another name in the UI
        check_submission("prod\u202eved", None, None)
    check_submission("exp", "run-1", "ns")


def test_yaml_forms_that_read_as_something_else_are_refused(tmp_path):
    from components._shared.platform.presets import parse_overrides, read_preset_yaml

    with pytest.raises(ValueError, match=r"'1_6' reads as 16 in YAML 1.1 \(its '_' are dropped\)"):  # [P10]
        parse_overrides(["lora.r=1_6"])
    with pytest.raises(ValueError, match=r"'1e-400' is too small for a float"):  # [O19]
        parse_overrides(["optim.lr=1e-400"])
    assert parse_overrides(["a=0e0", "b=abc_def", "c=1e-300"]) == {"a": 0.0, "b": "abc_def", "c": 1e-300}
    merged = tmp_path / "merged.yaml"
    merged.write_text("extends: tiny\nsft: {<<: {mode: full}}\n")  # [P14]
    with pytest.raises(ValueError, match=r"YAML merge keys \(<<\) are not read here"):
        read_preset_yaml(merged)
    null = tmp_path / "null.yaml"
    null.write_text("extends:\nsft: {mode: full}\n")  # [P04]
    with pytest.raises(ValueError, match=r"extends: is empty \(null\); name the preset"):
        read_preset_yaml(null)


def test_invisible_characters_in_data_are_named(tmp_path):
    from components._shared.data.containers import iter_file
    from components._shared.data.formats import RecordError
    from components._shared.data.manifest import manifest
    from components._shared.data.text_checks import check_text

    (tmp_path / "sft.jsonl").write_text("{}\n")
    (tmp_path / "dataset.yaml").write_text('sft: ["sft.jsonl\\u200b"]\n')  # [Y_zwsp]
    with pytest.raises(ValueError, match=r"'sft.jsonl\\u200b' holds an invisible formatting character \(ZERO WIDTH"):
        manifest(tmp_path)
    (tmp_path / "caf\u00e9.jsonl").write_text("{}\n")  # saved composed; named decomposed [Y_nfd]
    with pytest.raises(ValueError, match=r"does not exist as spelled; 'caf\\xe9.jsonl' does: the same letters"):
        list(iter_file(tmp_path / "cafe\u0301.jsonl"))
    with pytest.raises(RecordError, match=r"a bidirectional embedding or override U\+202E at character 3"):  # [r_bidi]
        check_text("red\u202esquare", "the answer")
    assert check_text("\u05e9\u05dc\u05d5\u05dd \u200fok", "the answer")  # right-to-left text and its marks stay


# -- the rest -----------------------------------------------------------------------------------------------------
def test_lake_synth_bounds_its_counts_and_seed_naming_the_option(tmp_path):
    for option, value in (("--records", "2000000000"), ("--seed", "99999999999999999999")):  # [L08, L07]
        result = runner.invoke(app, ["lake", "synth", option, value, "--out", str(tmp_path / "w")])
        assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output
    assert not (tmp_path / "w").exists()


def test_publishing_a_broken_summary_says_so_and_qvl_runs_refuses_an_empty_root(tmp_path):
    from pipelines.qvl.published import main

    for name, text in (("garbage", "nope{"), ("list", "[]")):  # [PB04, PB06]
        (tmp_path / name).mkdir()
        (tmp_path / name / "run_summary.json").write_text(text)
        with pytest.raises(SystemExit, match=r"run_summary.json: not a run summary"):
            main([str(tmp_path / name), "machine"])
    result = runner.invoke(app, ["runs", ""])  # [RN07]
    assert "ROOT='' is empty" in str(result.exception)


def test_an_empty_answers_list_is_said_to_be_empty():
    from components._shared.data.formats import RecordError, _answers

    with pytest.raises(RecordError, match=r"'answers' is an empty list; give the reference answer"):  # [e_emptylist]
        _answers([])
