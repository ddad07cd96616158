"""Preflight: every problem it exists to catch fails fast with a message that names it."""

import json
import socket

import pytest

from components._shared.platform.tracking import NullTracker
from components.preflight.config import PreflightConfig
from components.preflight.stage import model_uris_in, rl_data_files, run


def _run(tmp_path, lake, **kwargs):
    defaults = {"model_uris": [], "stage_configs": {"clean_data": {}, "extract_features": {}}}
    defaults.update(kwargs)
    cfg = defaults.pop("cfg", PreflightConfig(check_tracking=False))
    return run(cfg, lake_uri=str(lake), output_dir=tmp_path, tracker=NullTracker(), **defaults)


@pytest.fixture
def lake(tmp_path):
    path = tmp_path / "lake"
    path.mkdir()
    (path / "00000.tar").write_bytes(b"")
    return path


def test_passes_and_counts_on_a_good_setup(tmp_path, lake):
    metrics = _run(tmp_path, lake)
    assert metrics == {"configs_validated": 2, "lake_shards": 1, "models_resolved": 0, "max_pixels": 1003520}
    assert (tmp_path / "preflight.json").exists()


def test_every_invalid_setting_of_every_stage_is_reported_at_once(tmp_path, lake):
    configs = {"clean_data": {"min_side": -1}, "extract_features": {"dtype": "int8"}}
    with pytest.raises(ValueError) as err:
        _run(tmp_path, lake, stage_configs=configs)
    assert "clean_data.min_side" in str(err.value) and "extract_features.dtype" in str(err.value)


def test_empty_lake_is_refused_with_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No .* shards under lake_uri"):
        _run(tmp_path, tmp_path / "empty")


def test_unreachable_tracking_server_is_refused(tmp_path, lake, monkeypatch):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="not reachable"):
        _run(tmp_path, lake, cfg=PreflightConfig(timeout_s=2))


def test_unknown_model_uri_is_refused(tmp_path, lake):
    with pytest.raises(ValueError, match="builtin"):
        _run(tmp_path, lake, model_uris=["builtin:no-such-model"])


def test_model_uris_are_found_in_stage_configs():
    configs = {
        "clean_data": {"clip_model": "builtin:tiny-clip", "judge_model": None},
        "extract_features": {"text_encoder": "s3://m/clip", "dtype": "bfloat16"},
        "distill": {"student": {"init": "model", "model_uri": "s3://m/qwen-3b"}, "loss": {"kl": 1.0}},
        "select_checkpoint": {"registry_name": "qvl-vlm"},
    }
    assert model_uris_in(configs) == ["builtin:tiny-clip", "s3://m/clip", "s3://m/qwen-3b"]


def test_rl_data_must_hold_the_prompts_file_and_every_held_out_file(tmp_path):
    from components.preflight.stage import required_files

    assert rl_data_files({}) == {}
    settings = rl_data_files({"prompts_file": "mine.jsonl", "eval": {"files": ["eval.jsonl", "rl.jsonl"]}})
    assert required_files(str(tmp_path), ["rl", "eval"], settings) == ["mine.jsonl", "eval.jsonl", "rl.jsonl"]
    assert required_files(str(tmp_path), ["rl", "eval"], {}) == ["sft.jsonl", "eval.jsonl"]
    (tmp_path / "dataset.yaml").write_text(
        "rl: [{path: widgets.parquet, task: widget_count}]\n"
        "eval: [{path: q.json, format: vqav2, annotations: a.json}]\ntasks: {widget_count: exact_match}\n"
    )
    assert required_files(str(tmp_path), ["rl", "eval"], {}) == ["dataset.yaml", "widgets.parquet", "q.json", "a.json"]
    (tmp_path / "dataset.yaml").write_text("rl: [{path: w.jsonl, taks: x}]\n")
    with pytest.raises(ValueError, match=r"dataset.yaml: rl\[0\].taks: Extra inputs are not permitted"):
        required_files(str(tmp_path), ["rl"], {})


def test_training_data_is_required_where_the_dag_reads_it(tmp_path, lake):
    data = tmp_path / "heldout"
    data.mkdir()
    (data / "eval.jsonl").write_text("{}\n")
    spec = lambda uri, required: {  # noqa: E731
        "eval_data_uri": {"uri": uri, "roles": ["eval"], "required": required},
        "sft_data_uri": {"uri": uri, "roles": ["sft", "eval"], "required": required},
    }
    assert _run(tmp_path, lake, data_files=spec("", False))["data_files"] == 0  # DAG cut before pretrain
    with pytest.raises(ValueError, match="pipeline parameter eval_data_uri is empty"):
        _run(tmp_path, lake, data_files=spec("", True))
    with pytest.raises(ValueError, match="heldout/sft.jsonl does not exist"):
        _run(tmp_path, lake, data_files=spec(str(data), True))
    (data / "sft.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"(?s)sft_data_uri .*sft records: 1 bad conversation.*sft.jsonl:1 .*unknown"):
        _run(tmp_path, lake, data_files=spec(str(data), True))  # every record read before any GPU is asked for
    skipping = {s: {"on_bad_record": "skip"} for s in ("pretrain", "select_checkpoint", "sft", "distill")}
    with pytest.raises(ValueError, match=r"every record of sft.jsonl is bad \(1 skipped"):
        _run(tmp_path, lake, data_files=spec(str(data), True), stage_configs=skipping)  # a wrong file, not a few bad
    conversation = {"id": "s1", "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "yes"}]}
    (data / "sft.jsonl").write_text("{}\n" + json.dumps(conversation) + "\n")
    from PIL import Image

    Image.new("RGB", (32, 32)).save(data / "e1.png")
    question = {"id": "e1", "image": "e1.png", "question": "Hi?", "answer": "yes", "task": "yes_no"}
    (data / "eval.jsonl").write_text("{}\n" + json.dumps(question) + "\n")
    counted = _run(tmp_path, lake, data_files=spec(str(data), True), stage_configs=skipping)
    assert counted["data_files"] == 3 and counted["records_to_skip"] == 2 and counted["records_checked"] == 3
    (data / "dataset.yaml").write_text("sft: [llava.json]\n")  # the manifest's files replace sft.jsonl
    with pytest.raises(ValueError, match="heldout/llava.json does not exist"):
        _run(tmp_path, lake, data_files=spec(str(data), True), stage_configs=skipping)


def test_one_visual_token_budget_for_every_stage():
    from components.preflight.stage import check_visual_budget

    same = {stage: {"min_pixels": 3136, "max_pixels": 50176} for stage in ("clean_data", "sft", "rl")}
    assert check_visual_budget(same) == 50176
    with pytest.raises(ValueError, match=r"resize images differently .*rl: 3136\.\.12544.*same in every stage"):
        check_visual_budget({**same, "rl": {"min_pixels": 3136, "max_pixels": 12544}})


def test_clean_data_counts_visual_tokens_on_the_base_models_grid(tmp_path):
    from components._shared.model.sources import resolve_model
    from components.preflight.stage import check_patch_size

    qwen3 = resolve_model("builtin:tiny-qwen3-vl")
    assert check_patch_size(qwen3, {"patch_size": 16}) == 16
    with pytest.raises(ValueError, match=r"clean_data.patch_size=14 but the base model's ViT patch is 16 \(qwen3_vl\)"):
        check_patch_size(qwen3, {})


def test_s3_training_data_is_read_whole_before_any_gpu_unless_too_large(tmp_path, s3_env):
    from components._shared.platform import storage
    from components.preflight.stage import check_records
    from components.synth_world.splits import write_splits

    data = tmp_path / "heldout"
    write_splits(data, seed=5, eval_per_type=1, sft_records=6, preference_pairs=2)
    lines = (data / "sft.jsonl").read_text().splitlines()
    broken = json.loads(lines[2])
    broken["image"] = "images/not-there.png"
    (data / "sft.jsonl").write_text("\n".join([*lines[:2], json.dumps(broken), *lines[3:]]) + "\n")
    uri = f"{s3_env.uri}/data/heldout"
    storage.publish_dir(data, uri)
    files = {"sft_data_uri": {"uri": uri, "roles": ["sft", "eval"], "required": True}}
    with pytest.raises(ValueError, match=r"(?s)sft_data_uri \(s3://.*sft.jsonl:3 .*not-there.png"):
        check_records(files, {"sft": {}}, scratch=tmp_path)
    counted = check_records(files, {"sft": {"on_bad_record": "skip"}, "distill": {"on_bad_record": "skip"}})
    assert counted["records_to_skip"] == 1 and counted["records_checked"] > 5
    assert check_records(files, {}, download_mb=0.001)["records_unchecked_uris"] == 1  # left to the stages
    assert not list(tmp_path.glob("qvl-preflight-*"))  # the download is removed


def test_content_keys_follow_what_each_stage_reads_by_uri(tmp_path):
    """A file changed behind an unchanged URI changes the key of exactly the stages that read it (the key joins the
    task's inputs, so KFP's cache re-runs them); builtin names and empty URIs are stable."""
    from components.preflight.stage import content_keys

    sft_data, eval_data, student = tmp_path / "sft", tmp_path / "eval", tmp_path / "student"
    for folder in (sft_data, eval_data, student):
        folder.mkdir()
        (folder / "a.json").write_text("{}")
    uris = {"base_model_uri": "builtin:tiny-qwen2_5-vl", "sft_data_uri": str(sft_data), "eval_data_uri": str(eval_data)}
    configs = {"distill": {"student": {"init": "model", "model_uri": str(student)}}}
    before = content_keys(uris, configs)
    assert before == content_keys(uris, configs)
    (sft_data / "a.json").write_text('{"changed": 1}')
    after_sft = content_keys(uris, configs)
    assert {s for s in before if before[s] != after_sft[s]} == {"sft", "distill"}
    (student / "a.json").write_text('{"changed": 1}')
    after_student = content_keys(uris, configs)
    assert {s for s in before if after_sft[s] != after_student[s]} == {"distill"}
    (eval_data / "a.json").write_text("[]")
    after_eval = content_keys(uris, configs)
    assert {s for s in before if after_student[s] != after_eval[s]} == {"pretrain", "select_checkpoint"}
