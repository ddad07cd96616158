"""select_checkpoint: the rule picks the best candidate that passes the gates and fails naming every candidate when
none does; on real stage outputs it skips what it cannot use with the reason, registers the champion and the
challenger in MLflow, and the champion loads from the registry alias with the plain HF auto classes and answers
a held-out question correctly."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from components._shared.platform import storage
from components._shared.platform.mlflow_runs import stage_tracker
from components._shared.platform.tracking import NullTracker
from components.select_checkpoint.config import SelectCheckpointConfig
from components.select_checkpoint.stage import Candidate, NoCandidatePasses, choose, judge, run
from components.synth_world.splits import write_splits
from tests.tiny_sft import train_tiny_sft

BASE = "builtin:tiny-qwen2_5-vl"


def _candidate(name, **metrics):
    return Candidate(name, name.split("@")[0], model_dir=None, metrics={"parameters": 100.0, **metrics})


def test_the_rule_picks_the_best_candidate_that_passes_every_gate():
    cfg = SelectCheckpointConfig(
        weights={"vqa_exact_match": 1.0, "anls": 0.5, "latency_ms": -0.01},
        min_gates={"grounding_accuracy": 0.5},
        max_gates={"latency_ms": 50},
    )
    candidates = [
        _candidate("sft", vqa_exact_match=0.60, anls=0.4, latency_ms=10, grounding_accuracy=0.7),  # 0.70
        _candidate("rl", vqa_exact_match=0.80, anls=0.4, latency_ms=10, grounding_accuracy=0.4),  # best score, gated
        _candidate("distill", vqa_exact_match=0.55, anls=0.5, latency_ms=2, grounding_accuracy=0.6),  # 0.78
        _candidate("pretrain", vqa_exact_match=0.9, anls=0.9, latency_ms=90, grounding_accuracy=0.9),  # too slow
        _candidate("sft@step-1", vqa_exact_match=0.7, anls=0.4, latency_ms=10),  # no grounding
    ]
    for c in candidates:
        judge(c, cfg)
    assert candidates[2].score == pytest.approx(0.55 + 0.25 - 0.02)
    assert candidates[1].failed_gates == ["grounding_accuracy 0.4 < 0.5"]
    assert candidates[3].failed_gates == ["latency_ms 90 > 50"]
    assert candidates[4].failed_gates == ["grounding_accuracy nan < 0.5"]  # a metric the suite lacks fails its gate
    winner, runner_up = choose(candidates)
    assert (winner.name, runner_up.name) == ("distill", "sft")

    tie = [_candidate("big", vqa_exact_match=0.5, parameters=200.0), _candidate("small", vqa_exact_match=0.5)]
    for c in tie:
        judge(c, SelectCheckpointConfig(weights={"vqa_exact_match": 1.0}))
    assert choose(tie)[0].name == "small"


def test_no_passing_candidate_fails_naming_each_failure():
    cfg = SelectCheckpointConfig(min_gates={"anls": 0.45})
    candidates = [_candidate("sft", anls=0.2), _candidate("rl", anls=0.3)]
    for c in candidates:
        judge(c, cfg)
    skipped = _candidate("distill")
    skipped.skipped = "identical to the stage's output model"
    with pytest.raises(NoCandidatePasses, match=r"(?s)sft: anls 0.2 < 0.45.*rl: anls 0.3 < 0.45.*distill: identical"):
        choose([*candidates, skipped])


def test_config_rejects_unknown_metrics():
    with pytest.raises(ValidationError, match=r"min_gates: unknown metric\(s\) \['grounding'\]"):
        SelectCheckpointConfig(min_gates={"grounding": 0.6})
    with pytest.raises(ValidationError, match="weights are all 0"):
        SelectCheckpointConfig(weights={"anls": 0.0})
    SelectCheckpointConfig(weights={"exact_match/ocr": 1.0}, max_gates={"parameters": 1e9})
    with pytest.raises(ValidationError, match=r"unknown metric\(s\) \['benchmark/doc vqa'\].*benchmark/<name>"):
        SelectCheckpointConfig(min_gates={"benchmark/doc vqa": 0.4})


def test_the_config_knows_the_synthetic_tasks():
    from components._shared.data.tasks import SYNTHETIC_TASKS
    from components.select_checkpoint.config import QUESTION_TYPES

    assert QUESTION_TYPES == SYNTHETIC_TASKS  # the config imports pydantic only, so it keeps its own copy


def test_gates_and_weights_per_benchmark():
    from components.select_checkpoint.stage import check_weighted_metrics

    cfg = SelectCheckpointConfig(
        weights={"benchmark/docvqa": 1.0, "benchmark/pope/f1": 0.5},
        min_gates={"benchmark/refcoco": 0.68, "benchmark/docvqa": 0.45},
    )
    candidates = [
        _candidate("sft", **{"benchmark/docvqa": 0.50, "benchmark/pope/f1": 0.8, "benchmark/refcoco": 0.70}),  # 0.9
        _candidate("rl", **{"benchmark/docvqa": 0.60, "benchmark/pope/f1": 0.9, "benchmark/refcoco": 0.60}),  # gated
        _candidate("distill", **{"benchmark/docvqa": 0.44, "benchmark/pope/f1": 1.0, "benchmark/refcoco": 0.90}),
    ]
    for c in candidates:
        judge(c, cfg)
    check_weighted_metrics(candidates, cfg)
    assert candidates[0].score == pytest.approx(0.9)
    assert candidates[1].failed_gates == ["benchmark/refcoco 0.6 < 0.68"]
    assert candidates[2].failed_gates == ["benchmark/docvqa 0.44 < 0.45"]
    assert choose(candidates)[0].name == "sft"
    synthetic = SelectCheckpointConfig()  # weights the synthetic world's metrics: none in this data
    with pytest.raises(
        ValueError,
        match=r"weights name \['anls', 'cider_d', 'grounding_accuracy', 'vqa_exact_match'\].*"
        r"does not yield them: \['benchmark/docvqa', 'benchmark/pope/f1', 'benchmark/refcoco', 'parameters'\]",
    ):
        check_weighted_metrics(candidates, synthetic)


@pytest.fixture(scope="module")
def stage_outputs(tmp_path_factory):
    """A held-out world, an untrained 'pretrain' output and a briefly fine-tuned 'sft' output with checkpoints."""
    from components._shared.model.vlm import load_vlm, save_vlm

    root = tmp_path_factory.mktemp("select")
    write_splits(root / "data", seed=5, eval_per_type=3, sft_records=200, preference_pairs=8)
    model, processor, _ = load_vlm(BASE)
    save_vlm(model, processor, root / "pretrain" / "model")
    train_tiny_sft(root / "data", root / "sft", steps=200, checkpoint_every=100, keep_checkpoints=3)
    (root / "sft" / "_stage_result.json").write_text(json.dumps({"metrics": {"steps": 200}, "seconds": 1.0}))
    for stage in ("pretrain", "sft"):  # finished outputs, as the stage runner leaves them
        storage.commit_dir(root / stage)
    return root


def _select_cfg(**over):
    return SelectCheckpointConfig.model_validate(
        {
            "stages": ["pretrain", "sft"],
            "min_pixels": 3136,
            "max_pixels": 3136,
            "checkpoints_per_stage": 1,
            "weights": {"vqa_exact_match": 1.0},
            "registry_name": "qvl-test",
            "eval": {"per_type": 3, "batch_size": 32, "max_new_tokens": 8},
            **over,
        }
    )


def test_select_registers_the_champion_which_loads_from_the_registry_and_answers(
    stage_outputs, tracking_env, tmp_path, monkeypatch
):
    import mlflow
    from transformers import AutoModelForImageTextToText, AutoProcessor

    monkeypatch.chdir(tmp_path)  # MLflow's local artifact store lands in ./mlruns
    root = stage_outputs
    with stage_tracker("select_checkpoint", experiment="select-test") as tracker:
        metrics = run(
            _select_cfg(),
            data=str(root / "data"),
            pretrain=str(root / "pretrain"),
            sft=str(root / "sft"),
            output_dir=tmp_path / "out",
            tracker=tracker,
            stage_configs={"sft": {"mode": "full"}},
        )
    candidates = {c["name"]: c for c in json.loads((tmp_path / "out/candidates.json").read_text())}
    assert set(candidates) == {"pretrain", "sft", "sft@step-0000200", "sft@step-0000100"}
    assert candidates["sft@step-0000200"]["skipped"] == "identical to the stage's output model"
    evaluated = {n: c["score"] for n, c in candidates.items() if not c["skipped"]}
    assert set(evaluated) == {"pretrain", "sft", "sft@step-0000100"}
    assert metrics["selected_candidate"] == max(evaluated, key=evaluated.get) != "pretrain"
    assert metrics["selected_score"] == pytest.approx(max(evaluated.values()))
    assert metrics["registered_model"] == "qvl-test" and metrics["registered_version"] == "1"
    assert metrics["challenger_version"] == "2"
    card = (tmp_path / "out/model_card.md").read_text()
    assert f"Selected **{metrics['selected_candidate']}**" in card and "mode: full" in card
    assert card == (tmp_path / "out/model/README.md").read_text()

    local = mlflow.artifacts.download_artifacts(artifact_uri="models:/qvl-test@champion", dst_path=str(tmp_path / "dl"))
    assert (tmp_path / "dl/README.md").read_text() == card
    model = AutoModelForImageTextToText.from_pretrained(local).eval()
    processor = AutoProcessor.from_pretrained(local)
    rows = [json.loads(line) for line in (tmp_path / "out/eval_predictions.jsonl").read_text().splitlines()]
    right = next(r for r in rows if r["score"] == 1.0 and r["type"] != "caption")  # the champion gets some right
    record = next(
        json.loads(line)
        for line in (root / "data/eval.jsonl").read_text().splitlines()
        if json.loads(line)["id"] == right["id"]
    )
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": record["question"]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(
        text=[text], images=[Image.open(root / "data" / record["image"]).convert("RGB")], return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0].strip()
    assert answer == right["prediction"] and right["prediction"].lower() == str(record["answer"]).lower()

    # a retried task (same config and inputs, a new MLflow run) gets the same versions back, not new ones
    with stage_tracker("select_checkpoint", experiment="select-test") as tracker:
        again = run(
            _select_cfg(),
            data=str(root / "data"),
            pretrain=str(root / "pretrain"),
            sft=str(root / "sft"),
            output_dir=tmp_path / "retry",
            tracker=tracker,
            stage_configs={"sft": {"mode": "full"}},
        )
    assert (again["registered_version"], again["challenger_version"]) == ("1", "2")
    client = mlflow.MlflowClient()
    assert sorted(int(v.version) for v in client.search_model_versions("name='qvl-test'")) == [1, 2]
    with stage_tracker("select_checkpoint", experiment="select-test") as tracker:  # another selection: a new one
        other = run(
            _select_cfg(checkpoints_per_stage=0),
            data=str(root / "data"),
            pretrain=str(root / "pretrain"),
            sft=str(root / "sft"),
            output_dir=tmp_path / "other",
            tracker=tracker,
        )
    assert (
        other["registered_version"] == "3"
        and str(client.get_model_version_by_alias("qvl-test", "champion").version) == "3"
    )


def test_select_fails_clearly_when_no_candidate_passes(stage_outputs, tmp_path):
    root = stage_outputs
    with pytest.raises(NoCandidatePasses, match=r"(?s)pretrain: vqa_exact_match .* < 0.99.*sft: vqa_exact_match"):
        run(
            _select_cfg(min_gates={"vqa_exact_match": 0.99}, register_winner=False),
            data=str(root / "data"),
            pretrain=str(root / "pretrain"),
            sft=str(root / "sft"),
            output_dir=tmp_path,
            tracker=NullTracker(),
        )
    assert len(json.loads((tmp_path / "candidates.json").read_text())) == 4  # every candidate accounted for
    broken = tmp_path / "broken"
    shutil.copytree(root / "pretrain", broken)
    (broken / "model/config.json").unlink()
    with pytest.raises(ValueError, match="has no model/config.json; pass the pretrain stage's output directory"):
        run(
            _select_cfg(),
            data=str(root / "data"),
            pretrain=str(broken),
            sft="",
            output_dir=tmp_path / "b",
            tracker=NullTracker(),
        )


def test_checkpoints_kept_on_s3_are_found_through_the_stage_outputs_pointer(stage_outputs, s3_env, tmp_path):
    """A stage trained with train.checkpoint_uri=s3://... keeps its checkpoints there and names the root in
    OUTPUT/checkpoints.json; select lists, downloads (sha256-checked) and scores them like local ones."""
    from components._shared.model import checkpoint as ckpt
    from components._shared.platform import storage

    root = stage_outputs
    sft = tmp_path / "sft"
    shutil.copytree(root / "sft", sft, ignore=shutil.ignore_patterns("checkpoints"))
    remote = f"{s3_env.uri}/ckpt/sft-0123"
    for step in sorted((root / "sft" / "checkpoints").glob("step-*")):
        staging = tmp_path / "staging" / step.name
        shutil.copytree(step, staging, ignore=shutil.ignore_patterns(storage.COMMIT_MARKER))
        storage.publish_dir(staging, f"{remote}/{step.name}")
    ckpt.write_pointer(sft, [remote])
    assert ckpt.read_pointer(sft) == [remote] and ckpt.read_pointer(root / "pretrain") == []
    run(
        _select_cfg(register_winner=False),
        data=str(root / "data"),
        pretrain=str(root / "pretrain"),
        sft=str(sft),
        output_dir=tmp_path / "out",
        tracker=NullTracker(),
    )
    candidates = {c["name"]: c for c in json.loads((tmp_path / "out/candidates.json").read_text())}
    assert set(candidates) == {"pretrain", "sft", "sft@step-0000200", "sft@step-0000100"}
    assert candidates["sft@step-0000200"]["skipped"] == "identical to the stage's output model"
    assert candidates["sft@step-0000100"]["checkpoint"] == f"{remote}/step-0000100"
    assert not candidates["sft@step-0000100"]["skipped"] and candidates["sft@step-0000100"]["metrics"]


def test_stages_name_checkpoint_roots_outside_their_output(tmp_path):
    from components._shared.model import checkpoint as ckpt

    (tmp_path / "a").mkdir()
    ckpt.write_pointer(tmp_path / "a", [str(tmp_path / "a" / "checkpoints")])
    assert not (tmp_path / "a" / ckpt.POINTER_FILE).exists()  # inside the output: nothing to point at
    write_splits(tmp_path / "data", seed=6, eval_per_type=1, sft_records=16, preference_pairs=4)
    train_tiny_sft(
        tmp_path / "data", tmp_path / "sft", steps=2, checkpoint_every=1, checkpoint_uri=str(tmp_path / "kept")
    )
    (root,) = ckpt.read_pointer(tmp_path / "sft")
    assert root.startswith(str(tmp_path / "kept" / "sft-")) and (Path(root) / "step-0000001").is_dir()


def test_a_stage_output_that_did_not_finish_is_no_candidate(tmp_path):
    """A stage directory without its commit marker (the stage failed, was stopped, or still runs) is refused, naming
    the input; committed, the same directory is a candidate."""
    from components._shared.model.vlm import load_vlm, save_vlm
    from components.select_checkpoint.candidates import find_candidates

    model, processor, _ = load_vlm(BASE)
    save_vlm(model, processor, tmp_path / "sft" / "model")
    with pytest.raises(ValueError, match=r"input sft=.*has no _COMMITTED\.json: the sft stage did not finish"):
        find_candidates({"sft": str(tmp_path / "sft")}, per_stage=0)
    storage.commit_dir(tmp_path / "sft")
    assert [c.name for c in find_candidates({"sft": str(tmp_path / "sft")}, per_stage=0)] == ["sft"]


def test_a_damaged_intermediate_checkpoint_is_skipped_with_its_reason(stage_outputs, tmp_path):
    """A truncated trainable.safetensors (a disk that filled, a copy cut short) costs that candidate, not the stage:
    it is listed as skipped naming the file, and the others are scored."""
    root = stage_outputs
    sft = tmp_path / "sft"
    shutil.copytree(root / "sft", sft)
    damaged = sft / "checkpoints" / "step-0000100" / "trainable.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    run(
        _select_cfg(register_winner=False, stages=["sft"]),
        data=str(root / "data"),
        pretrain="",
        sft=str(sft),
        output_dir=tmp_path / "out",
        tracker=NullTracker(),
    )
    candidates = {c["name"]: c for c in json.loads((tmp_path / "out/candidates.json").read_text())}
    assert set(candidates) == {"sft", "sft@step-0000200", "sft@step-0000100"}
    assert "step-0000100/trainable.safetensors cannot be read" in candidates["sft@step-0000100"]["skipped"]
    assert "damaged checkpoint" in candidates["sft@step-0000100"]["skipped"]
    assert not candidates["sft"]["skipped"] and candidates["sft"]["metrics"]
