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


def test_a_kfp_task_pod_without_a_tracking_uri_is_refused(tmp_path, lake, monkeypatch):
    """The mlflow secret mounts optionally: missing, each stage would track into a sqlite file inside its pod."""
    from components._shared.platform.mlflow_runs import KFP_RUN_ENV

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv(KFP_RUN_ENV, "run-1")
    with pytest.raises(ValueError, match=r"MLFLOW_TRACKING_URI is not set in this KFP task pod.*qvl-mlflow"):
        _run(tmp_path, lake, cfg=PreflightConfig(timeout_s=2))
    assert _run(tmp_path, lake, cfg=PreflightConfig(check_tracking=False))["lake_shards"] == 1  # the opt-out
    monkeypatch.delenv(KFP_RUN_ENV)
    assert _run(tmp_path, lake, cfg=PreflightConfig(timeout_s=2))["tracking"] == "local"  # qvl run --local


@pytest.fixture
def login_server():
    """An MLflow-like server that answers /health to anyone and its API only with `Authorization: Bearer s3cret`."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            ok = self.path == "/health" or self.headers.get("Authorization") == "Bearer s3cret"
            body = b"OK" if self.path == "/health" else b'{"experiments": []}'
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body) if ok else 0))
            self.end_headers()
            if ok:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_a_tracking_server_that_wants_a_login_is_checked_with_the_pods_credentials(
    tmp_path, lake, monkeypatch, login_server
):
    uri, seen = login_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"refused this pod's credentials \(HTTP 401\).*MLFLOW_TRACKING_TOKEN"):
        _run(tmp_path, lake, cfg=PreflightConfig(timeout_s=5))
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cret")
    assert _run(tmp_path, lake, cfg=PreflightConfig(timeout_s=5))["tracking"] == "server"
    assert seen[-1][0].startswith("/api/2.0/mlflow/experiments/search") and seen[-1][1] == "Bearer s3cret"


def test_s3_models_are_checked_where_they_lie_without_downloading_weights(tmp_path, s3_env, monkeypatch):
    """Preflight runs on a small CPU pod: an s3:// model is checked by its marker, object sizes, config.json and
    safetensors headers; a broken one is named, and no weights reach the pod's disk."""
    from components._shared.model.sources import resolve_model
    from components._shared.platform import storage
    from components.preflight.stage import check_model, check_patch_size

    local = resolve_model("builtin:tiny-qwen2_5-vl", cache_dir=tmp_path / "build")
    monkeypatch.setenv("QVL_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"{s3_env.uri}/models/tiny"
    storage.publish_dir(local, uri)
    where, config = check_model(uri + "/")
    assert where == uri and config["model_type"] == "qwen2_5_vl"
    assert check_patch_size(config, {"patch_size": 14}) == 14
    assert not (tmp_path / "cache").exists()  # nothing downloaded

    weights = sorted(p.name for p in local.glob("*.safetensors"))[0]
    data = (local / weights).read_bytes()
    bucket, key = storage.split_s3(f"{uri}/{weights}")
    client = s3_env.client()
    client.put_object(Bucket=bucket, Key=key, Body=data[:-10])  # a truncated upload
    with pytest.raises(ValueError, match=rf"{weights} is listed in _COMMITTED.json with {len(data)} bytes but is"):
        check_model(uri)
    client.put_object(Bucket=bucket, Key=key, Body=b"\xff" * 8 + data[8:])  # same size, header length garbage
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file \(header length"):
        check_model(uri)
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}'  # no end offset: named, no traceback
    client.put_object(
        Bucket=bucket,
        Key=key,
        Body=(len(header) + (len(data) - 8 - len(header))).to_bytes(8, "little")
        + header
        + b" " * (len(data) - 8 - len(header)),
    )
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file \(header is not a table"):
        check_model(uri)
    client.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(ValueError, match="but is missing"):
        check_model(uri)

    (local.parent / "pickled").mkdir()
    pickled = local.parent / "pickled"
    for file in local.iterdir():
        (pickled / file.name).write_bytes(file.read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"not really")
    storage.publish_dir(pickled, f"{s3_env.uri}/models/pickled")
    with pytest.raises(ValueError, match=r"pickle-format weights \['pytorch_model.bin'\]"):
        check_model(f"{s3_env.uri}/models/pickled")
    with pytest.raises(ValueError, match="no readable _COMMITTED.json"):
        check_model(f"{s3_env.uri}/models/nothing-here")


def test_a_stage_output_given_where_its_model_belongs_names_the_model_folder(tmp_path):
    """`--reward-model OUT/reward_model` (the stage's output, not its model/) says which directory to pass."""
    from components._shared.model.sources import resolve_model

    stage_output = tmp_path / "reward_model"
    (stage_output / "model").mkdir(parents=True)
    (stage_output / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"that is a stage's output directory.*pass {stage_output / 'model'}\."):
        resolve_model(str(stage_output))
    (stage_output / "model" / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json; point at a from_pretrained"):
        resolve_model(str(stage_output))


def test_unknown_model_uri_is_refused(tmp_path, lake):
    with pytest.raises(ValueError, match="builtin"):
        _run(tmp_path, lake, model_uris=["builtin:no-such-model"])


def test_model_uris_are_found_in_stage_configs():
    configs = {
        "clean_data": {"clip_model": "builtin:tiny-clip", "judge_model": None},
        "extract_features": {"dtype": "bfloat16"},
        "rl": {"reward_model": "s3://m/rm"},
        "distill": {"student": {"init": "model", "model_uri": "s3://m/qwen-3b"}, "loss": {"kl": 1.0}},
        "select_checkpoint": {"registry_name": "qvl-vlm"},
    }
    assert model_uris_in(configs) == ["builtin:tiny-clip", "s3://m/rm", "s3://m/qwen-3b"]


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
    with pytest.raises(
        ValueError, match=r"dataset.yaml: rl\[0\].taks: unknown field of a file entry; did you mean task\?"
    ):
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
    (data / "sft.jsonl").write_text('{"id": "s0"}\n')  # not eval.jsonl's bytes: that is a held-out leak of its own
    with pytest.raises(ValueError, match=r"(?s)sft_data_uri .*sft records: 1 bad conversation.*sft.jsonl:1 .*unknown"):
        _run(tmp_path, lake, data_files=spec(str(data), True))  # every record read before any GPU is asked for
    # every reader of the data skips (pretrain is left out: its held-out captions are a check of their own,
    # tests/unit/test_preflight_fit.py)
    skipping = {s: {"on_bad_record": "skip"} for s in ("select_checkpoint", "sft", "distill")}
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


def test_pretrains_caption_check_waits_for_a_dag_that_runs_pretrain(tmp_path, lake):
    """`qvl run --until clean_data` with held-out data of no captions: preflight refused it for pretrain's sake
    (sixth hostile pass); the check belongs to a DAG that runs pretrain, whose eval data is then required."""
    from PIL import Image

    data = tmp_path / "heldout"
    data.mkdir()
    Image.new("RGB", (32, 32)).save(data / "e1.png")
    question = {"id": "e1", "image": "e1.png", "question": "Hi?", "answer": "yes", "task": "yes_no"}
    (data / "eval.jsonl").write_text(json.dumps(question) + "\n")
    stages = {"clean_data": {}, "extract_features": {}, "pretrain": {}}
    files = lambda required: {"eval_data_uri": {"uri": str(data), "roles": ["eval"], "required": required}}  # noqa: E731
    assert "heldout_captions" not in _run(tmp_path, lake, data_files=files(False), stage_configs=stages)
    with pytest.raises(ValueError, match="held-out data has 0 caption records; pretrain needs >= 2"):
        _run(tmp_path, lake, data_files=files(True), stage_configs=stages)
