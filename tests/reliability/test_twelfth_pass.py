"""The twelfth hostile pass (148 cases: 131 OK, 5 silent, 8 unclear, 2 tracebacks, 2 leaks), ids from its report in
brackets: the KFP token pasted into an override [SB62, SB64]; a server answering a run request without a run
[SB54]; one model stage left on the CPU in a GPU profile [PR27]; `qvl runs` on a summary whose stages are not an
object or whose preset is 100,000 characters [RU106c, RU102]; a raw lake given as --clean-data [SD16, SD20,
SD21]; counterfactual quotas that cannot be met [SD11]. The Qwen4 preview's calibration on a stray `</think>`
[Q99, Q139] is tested in tests/unit/test_qwen4_exp.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

TOKEN = "sEcReTzz9876abcdXYZ"


@pytest.mark.parametrize("pair", [f"experiment={TOKEN}", f"{TOKEN}=1", f"sft.optim.lr={TOKEN}"])
def test_the_token_in_an_override_is_refused_without_being_shown(pair, monkeypatch):
    from pipelines.submit import TOKEN_ENV, SubmitError, split_pairs

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(SubmitError, match=f"an override holds the value of {TOKEN_ENV} \\(not shown\\)") as caught:
        split_pairs(["lake_uri=s3://lake/x", pair])
    assert TOKEN not in str(caught.value)
    monkeypatch.setenv(TOKEN_ENV, "short")  # a token too short to tell from a word is not searched for
    assert split_pairs(["lake_uri=s3://lake/short"])[0] == {"lake_uri": "s3://lake/short"}


def test_a_run_request_answered_without_a_run_id_is_not_reported_as_a_run(tmp_path):
    from pipelines.submit import Prepared, SubmitError, submit

    answered = SimpleNamespace(create_run_from_pipeline_package=lambda *a, **k: SimpleNamespace(run_id=None))
    prepared = Prepared(package=tmp_path / "p.yaml", params={}, preset_name="tiny")
    with pytest.raises(SubmitError, match="answered the run request without a run id .*check the KFP UI"):
        submit(answered, prepared, experiment="e1")
    started = SimpleNamespace(create_run_from_pipeline_package=lambda *a, **k: SimpleNamespace(run_id="r-1"))
    assert submit(started, prepared, experiment="e1") == "r-1"


def test_one_model_stage_left_on_the_cpu_in_a_gpu_profile_is_refused(tmp_path):
    from pipelines.presets import load_preset

    (tmp_path / "p.yaml").write_text(
        "extends: prod-7b\nsft: {build_data: {enabled: true}}\nkubernetes: {stages: {sft_data: {gpus: 0}}}\n"
    )
    with pytest.raises(ValueError, match=r"kubernetes.stages.sft_data.gpus: 0 while distill, extract_features, "):
        load_preset(tmp_path / "p.yaml").cluster_profile()
    from pipelines.k8s import ClusterProfile

    cpu_only = load_preset("tiny").cluster_profile().model_dump()
    for stage in cpu_only["stages"].values():
        stage["gpus"] = 0
    assert ClusterProfile.model_validate(cpu_only).stages["sft_data"].gpus == 0  # a CPU-only cluster: all at 0


def test_runs_shows_a_summary_whose_stages_are_not_an_object_unreadable_and_cuts_long_cells(tmp_path):
    from pipelines.qvl.runs import find_runs, runs_table

    for name, key, value in (("c", "stages", [1, 2]), ("f", "preset", "x" * 100_000)):
        (tmp_path / name).mkdir()
        summary = {"status": "succeeded", "preset": "tiny", "stages": {"sft": {"status": "succeeded"}}, key: value}
        (tmp_path / name / "run_summary.json").write_text(json.dumps(summary))
    runs = {run.path.name: run for run in find_runs(tmp_path)}
    assert runs["c"].summary["status"] == "unreadable"
    assert "('stages' is a list, not an object of stages)" in runs["c"].summary["error"]
    table = runs_table(list(runs.values()), tmp_path)
    assert max(len(line) for line in table.splitlines()) < 200 and "x" * 57 + "..." in table


def test_a_raw_lake_given_as_clean_data_is_named_as_such(tmp_path):
    from components._shared.launch.runner import verify_inputs

    (tmp_path / "00000.tar").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds \['00000.tar'\], a raw lake's shards, not clean_data's output: run"):
        verify_inputs({"clean_data": str(tmp_path)})
    with pytest.raises(ValueError, match="a stage's output without its commit marker"):  # features: as before
        verify_inputs({"features": str(tmp_path)})


def test_a_counterfactual_share_over_the_type_cap_is_refused():
    from components.sft.config import SftConfig

    with pytest.raises(ValueError, match=r"min_counterfactual=0.5 > max_type_share=0.25: counterfactuals are one"):
        SftConfig.model_validate({"build_data": {"min_counterfactual": 0.5, "max_type_share": 0.25}})
    assert SftConfig.model_validate({"build_data": {"min_counterfactual": 0.25}}).build_data.min_counterfactual == 0.25


@pytest.mark.parametrize(
    ("status", "said"), [(500, "a server error: the KFP API is not healthy"), (404, "no KFP API"), (503, None)]
)
def test_a_health_check_answered_with_an_error_is_said_with_its_status_not_as_a_timeout(status, said):
    import http.server
    import threading

    from pipelines.submit import check_token_accepted

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name in http.server
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"http://127.0.0.1:{server.server_port}"
    try:
        if said is None:  # a proxy in front of a KFP API warming up: left to kfp.Client's retries
            check_token_accepted(host)
            return
        with pytest.raises(ValueError, match=f"{host} answered its health check with HTTP {status}: {said}"):
            check_token_accepted(host)  # [SB53]: kfp.Client retried ~25 s and said "Failed getting healthz"
    finally:
        server.shutdown()
