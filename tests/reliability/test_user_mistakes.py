"""User mistakes end in one message that names what to fix, never a traceback or a silent acceptance (issue 21).

Each case runs the sft stage's command line in process (`components.sft.stage.main`), as `qvl stage sft` does:
exit code 2, `error: ...` on stderr naming the file / record / setting, no traceback; `--debug` shows it.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from components._shared.model.sources import resolve_model
from components.sft.stage import main as sft_main
from components.synth_world.splits import write_splits
from pipelines import credentials

BASE = "builtin:tiny-qwen2_5-vl"
SFT = {
    "mode": "full",
    "min_pixels": 3136,
    "max_pixels": 3136,
    "calibration": {"enabled": False},
    "train": {"steps": 1, "samples_per_step": 2, "max_tokens_per_micro_batch": 512, "threads": 1},
    "eval": {"per_type": 1, "batch_size": 8, "max_new_tokens": 2},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    write_splits(root, seed=3, eval_per_type=1, sft_records=8, preference_pairs=4)
    return root


def _data(world: Path, tmp_path: Path, edit) -> Path:
    data = tmp_path / "data"
    shutil.copytree(world, data)
    edit(data)
    return data


def _append(name: str, payload: bytes):
    return lambda d: (d / name).write_bytes((d / name).read_bytes() + payload)


def _model(tmp_path: Path, edit) -> Path:
    model = tmp_path / "model"
    shutil.copytree(resolve_model(BASE), model)
    (model / "_COMMITTED.json").unlink(missing_ok=True)
    edit(model)
    return model


def _widen_config(model: Path) -> None:
    """config.json's text hidden size 8 wider than the weights (transformers raised its own RuntimeError)."""
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["hidden_size"] += 8
    (model / "config.json").write_text(json.dumps(config))


def _nan_weight(model: Path) -> None:
    """A checkpoint of a diverged run: one NaN in one tensor (it was blamed on optim.lr at step 1)."""
    for file in model.glob("*.safetensors"):
        tensors = load_file(str(file))
        name = next(k for k in sorted(tensors) if "mlp" in k and tensors[k].is_floating_point())
        tensors[name].view(-1)[0] = float("nan")
        save_file(tensors, str(file), metadata={"format": "pt"})
        return


def _drop_vision_weights(model: Path) -> None:
    for file in model.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: v for k, v in tensors.items() if "visual" not in k}, str(file), metadata={"format": "pt"})


def _empty_weights(model: Path) -> None:
    for file in model.glob("*.safetensors"):
        file.unlink()
    save_file({}, str(model / "model.safetensors"))


def _run(tmp_path, capsys, *, data, base=BASE, extra=(), config=None, config_text=None):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(config_text if config_text is not None else json.dumps({"sft": config or SFT}))
    argv = ["--config", str(cfg), "--output-dir", str(tmp_path / "out"), "--base-model", str(base)]
    argv += ["--data", str(data), *extra]
    with pytest.raises(SystemExit) as exit_info:
        sft_main(argv)
    return exit_info.value.code, capsys.readouterr().err


CASES = {
    "jsonl line is an array": (dict(data=_append("sft.jsonl", b"[1, 2]\n")), r"sft.jsonl:9: a list, not a record"),
    "jsonl line is a number": (dict(data=_append("sft.jsonl", b"3\n")), r"sft.jsonl:9: a int, not a record"),
    "invalid utf-8": (dict(data=_append("sft.jsonl", b'{"id": "\xff"}\n')), r"sft.jsonl:9: not UTF-8 text"),
    "invalid json": (dict(data=_append("sft.jsonl", b'{"id": \n')), r"sft.jsonl:9: not valid JSON"),
    "eval answer null": (
        dict(
            data=lambda d: (d / "eval.jsonl").write_text(
                (d / "eval.jsonl").read_text().replace('"answer": "', '"answer": null, "x": "', 1)
            )
        ),
        r"eval.jsonl:1 \(id='eval-\w+-00000'\): 'answer' must be a string",
    ),
    "config-json not an object": (dict(extra=["--config-json", "[1]"]), r"--config-json must be a JSON object"),
    "extends too long": (dict(config_text="extends: " + "a" * 5000 + "\n"), r"is not a preset name"),
    "duplicate preset section": (dict(config_text="sft: {}\nsft: {}\n"), r"'sft' appears twice|given twice|twice"),
    "bad lora regex": (
        dict(extra=["mode=lora", "lora.target_modules=['(']"]),
        r"lora.target_modules: '\(' is not a valid regex",
    ),
    "seed 2**64": (dict(extra=[f"seed={2**64}"]), r"sft.seed: Input should be less than 4294967296"),
    "betas out of range": (dict(extra=["optim.betas=[1.5, 0.9]"]), r"sft.optim.betas.0: Input should be less than 1"),
    "lora alpha inf": (
        dict(extra=["mode=lora", "lora.alpha=.inf"]),
        r"sft.lora.alpha: Input should be a finite number",
    ),
    "checkpoint uri http": (
        dict(extra=["train.checkpoint_uri=http://x/y"]),
        r"train.checkpoint_uri='http://x/y': only local paths and s3://",
    ),
    "data uri http": (dict(data="http://example.com/data"), r"--data='http://example.com/data': only local paths"),
    "data missing": (dict(data="/nonexistent/data"), r"data directory '/nonexistent/data' does not exist"),
    "garbage safetensors": (
        dict(base=lambda m: (m / "model.safetensors").write_bytes(b"garbage" * 10)),
        r"model.safetensors is not a readable safetensors file",
    ),
    "garbage config.json": (
        dict(base=lambda m: (m / "config.json").write_text("{not json")),
        r"config.json is not valid JSON",
    ),
    "weights hold no tensors": (dict(base=_empty_weights), r"holds no tensors"),
    "weights lack the vision tower": (dict(base=_drop_vision_weights), r"the checkpoint lacks \d+ weight\(s\)"),
    "config's hidden size is not the weights'": (
        dict(base=_widen_config),
        r"has \d+ of another shape than its config.json says",
    ),
    "weights hold a NaN": (dict(base=_nan_weight), r"1 weight tensor\(s\) .*non-finite .*whatever the learning rate"),
    "override key with two dots": (dict(extra=["train..steps=3"]), r"the key 'train..steps' has an empty part"),
    "a flag given twice": (dict(extra=["--data", "/elsewhere"]), r"--data is given twice; give it once"),
    "config-json key given twice": (
        dict(extra=["--config-json", '{"train": {"steps": 1}, "train": {"steps": 2}}']),
        r"--config-json: the key 'train' is given twice",
    ),
    "a misspelled preset section": (
        dict(config_text="sft: {train: {steps: 1}}\nsfft: {optim: {lr: 0.5}}\n"),
        r"unknown section\(s\) \['sfft'\] in a preset \('sfft': did you mean 'sft'\?\)",
    ),
    "a stage's setting at a preset's top level": (
        dict(config_text="sft:\ntrain: {steps: 1}\ndescription: mine\n"),
        r"unknown section\(s\) \['train'\] in a preset.*a stage's settings go inside its section",
    ),
    "an s3 location with one slash": (dict(base="s3:/bucket/model"), r"an s3 URI starts with two slashes"),
    "an empty experiment": (dict(extra=["--experiment", ""]), r"--experiment='' is empty"),
    "a preset nested thousands deep": (
        dict(config_text="sft: " + "[" * 3000 + "]" * 3000 + "\n"),
        r"nested too deeply to be a config",
    ),
    "config-json nested thousands deep": (
        dict(extra=["--config-json", "[" * 5000 + "]" * 5000]),
        r"--config-json is nested too deeply",
    ),
    "an override value nested thousands deep": (
        dict(extra=["train.steps=" + "[" * 3000 + "]" * 3000]),
        r"Override 'train.steps=\[\[.* the value is not valid YAML \(nested too deeply\)",
    ),
    "a long override value given twice": (
        dict(extra=["train.steps=1", "train.steps=" + "9" * 5000]),
        r"sets 'train.steps' again after 'train.steps=1'",
    ),
    "override key with a look-alike letter": (
        dict(extra=["tr\u0430in.steps=3"]),
        r"the key holds '\u0430' \(CYRILLIC SMALL LETTER A\), not an ASCII letter",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_user_mistake_is_one_message_naming_what_to_fix(case, world, tmp_path, capsys):
    kwargs, says = CASES[case]
    kwargs = dict(kwargs)
    if callable(kwargs.get("data")):
        kwargs["data"] = _data(world, tmp_path, kwargs["data"])
    kwargs.setdefault("data", world)
    if callable(kwargs.get("base")):
        kwargs["base"] = _model(tmp_path, kwargs["base"])
    code, err = _run(tmp_path, capsys, **kwargs)
    assert code == 2, err
    found = re.search(r"^(python -m components.sft: )?error: ", err, re.MULTILINE)
    assert found, err[-2000:]
    ours = err[found.start() :]  # (libraries log above it: transformers' load report)
    assert "Traceback" not in ours
    assert re.search(says, ours), ours[:2000]
    assert len(ours) < 6000
    assert not (tmp_path / "out" / "model").exists()  # nothing was exported


def test_debug_shows_the_traceback(world, tmp_path, capsys):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(json.dumps({"sft": SFT}))
    argv = ["--config", str(cfg), "--output-dir", str(tmp_path / "out"), "--base-model", BASE]
    with pytest.raises(ValueError, match="sft.seed"):
        sft_main([*argv, "--data", str(world), "--debug", f"seed={2**64}"])


def test_skip_policy_trains_without_bad_records_and_counts_them(world, tmp_path, capsys):
    def spoil(d: Path) -> None:
        lines = (d / "sft.jsonl").read_text().splitlines()
        broken = json.loads(lines[0])
        broken["image"] = "images/missing.png"
        empty = json.loads(lines[1])
        empty["conversations"][-1]["value"] = "  "
        (d / "sft.jsonl").write_text(
            "\n".join([json.dumps(broken), json.dumps(empty), *lines[2:], "[1]", lines[3]]) + "\n"
        )

    data = _data(world, tmp_path, spoil)
    code, err = _run(tmp_path, capsys, data=data)
    assert code == 2 and "4 bad conversation record(s)" in err  # fail (the default) lists all four at once
    config = {**SFT, "on_bad_record": "skip"}
    cfg = tmp_path / "skip.yaml"
    cfg.write_text(json.dumps({"sft": config}))
    sft_main(["--config", str(cfg), "--output-dir", str(tmp_path / "ok"), "--base-model", BASE, "--data", str(data)])
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("\n{") + 1 :] if not out.startswith("{") else out)
    assert metrics["data/skipped_records"] == 4
    assert metrics["data/skipped/image"] == 1 and metrics["data/skipped/empty"] == 1
    assert metrics["data/skipped/not_an_object"] == 1 and metrics["data/skipped/duplicate_id"] == 1
    report = (tmp_path / "ok" / "report.md").read_text()
    assert "Records skipped" in report and "sft.jsonl:10" in report and "sft.jsonl:1 " in report


@pytest.mark.parametrize(
    ("settings", "kind"),
    [
        ({"lake_uri": "s3://AKIAIOSFODNN7EXAMPLE@bucket/x"}, "an AWS access key id"),
        ({"stages": {"sft": {"note": "ghp_" + "a1B2" * 9}}}, "a GitHub token"),
        ({"stages": {"rl": {"tracking": "https://user:s3cretpass@mlflow.internal"}}}, "a URL with a password"),
        ({"kubernetes": {"hf_token": "hf_" + "x" * 34}}, "kubernetes.hf_token"),
        ({"kubernetes": {"api_key": "0123456789abcdef"}}, "a setting named like a secret"),
        ({"lake_uri": "s3://lake/x?aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}, "query"),
        ({"lake_uri": "s3://lake/x?X-Amz-Security-Token=" + "IQoJb3JpZ2luX2VjEJr" + "a" * 60}, "query"),
        ({"stages": {"rl": {"note": "IQoJb3JpZ2luX2VjEJr" + "Zb9" * 30}}}, "an AWS session token"),
        ({"model": "https://blob.example/m.tar?sv=2024&sig=Abc123Def456Ghi789"}, "query carries a credential"),
    ],
)
def test_credential_like_values_are_named_and_never_shown(settings, kind):
    with pytest.raises(ValueError) as err:
        credentials.check(settings, "preset 'x'")
    assert kind in str(err.value) and "Kubernetes secret" in str(err.value)
    for value in json.dumps(settings).split('"'):
        if len(value) > 12:
            assert value not in str(err.value)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://lake/x?X-Amz-Security-Token=IQoJb3JpZ2luX2VjEJrs3cr3tVALUE1234",
        "s3://AKIAIOSFODNN7EXAMPLE:s3cr3tVALUE1234@lake/x",
        "S3://lake/x?token=s3cr3tVALUE1234",
        "https://user:s3cr3tVALUE1234@host/x?sig=s3cr3tVALUE1234",
    ],
)
def test_a_location_with_a_credential_is_refused_without_showing_it(uri):
    """A stage's path or URI given with a credential in it (an s3:// query, user:password@) is refused where the
    stage reads its command line, and the error hides the credential."""
    from components._shared.platform.storage import check_location

    with pytest.raises(ValueError) as err:
        check_location(uri, "--lake-uri")
    assert "--lake-uri" in str(err.value) and "s3cr3tVALUE" not in str(err.value), str(err.value)


def test_ordinary_settings_and_the_shipped_presets_are_not_flagged():
    from pipelines.presets import PRESET_DIR, load_preset

    assert (
        credentials.findings({"max_new_tokens": 48, "tokens_per_second": "12345678", "s3_secret": "qvl-s3-credentials"})
        == []
    )
    for preset in sorted(PRESET_DIR.glob("*.yaml")):
        assert credentials.findings(load_preset(preset.stem).model_dump(mode="json")) == [], preset.name


def test_compile_refuses_a_preset_with_a_credential(tmp_path):
    from pipelines.compile import compile_pipeline

    preset = tmp_path / "leaky.yaml"
    jwt = "eyJhbGciOiJIUzI1.eyJzdWIiOiIxMjM0.SflKxwRJSMeKKF2QT4"
    preset.write_text(f"extends: tiny\nbase_model_uri: builtin:tiny-qwen2_5-vl\nkubernetes:\n  token: {jwt}\n")
    with pytest.raises(ValueError, match="kubernetes.token"):
        compile_pipeline(str(preset), tmp_path / "out.yaml")
    assert not (tmp_path / "out.yaml").exists()


def _spoil_for_training(d: Path) -> None:
    """Three records that passed the up-front check and stopped training mid-run: a truncated PNG, an image of
    aspect ratio 250:1 (Qwen's processor refuses over 200:1) and a JPEG cut inside its scan; and one good record
    whose image marker is in its second user turn (the encoder put the image at the first and then failed)."""
    from PIL import Image

    png = (d / "images/sft-00000.png").read_bytes()
    (d / "images/sft-00000.png").write_bytes(png[: len(png) // 2])
    Image.new("RGB", (1000, 4), "white").save(d / "images/sft-00001.png")
    Image.open(d / "images/sft-00003.png").convert("RGB").resize((224, 224)).save(d / "cut.jpg", quality=90)
    (d / "cut.jpg").write_bytes((d / "cut.jpg").read_bytes()[:-600])
    lines = [json.loads(line) for line in (d / "sft.jsonl").read_text().splitlines()]
    lines[3]["image"] = "cut.jpg"
    question, answer = lines[2]["conversations"]
    lines[2]["conversations"] = [
        {"from": "human", "value": "Look closely."},
        {"from": "gpt", "value": "Ready."},
        question,
        answer,
    ]
    (d / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_records_training_would_refuse_are_refused_before_step_one(world, tmp_path, capsys):
    data = _data(world, tmp_path, _spoil_for_training)
    code, err = _run(tmp_path, capsys, data=data)
    assert code == 2 and "3 bad conversation record(s) in sft.jsonl" in err
    assert re.search(r"sft.jsonl:1 \(id='sft-00000'\): image 'images/sft-00000.png' is truncated", err)
    aspect = r"image 'images/sft-00001.png' is 1000x4, an aspect ratio of 250:1; .* more than 200:1"
    assert re.search(r"sft.jsonl:2 \(id='sft-00001'\): " + aspect, err)
    assert re.search(r"sft.jsonl:4 \(id='sft-00003'\): image 'cut.jpg' is truncated", err)
    assert "sft.jsonl:3" not in err and not (tmp_path / "out" / "checkpoints").exists()
    cfg = tmp_path / "skip.yaml"
    cfg.write_text(json.dumps({"sft": {**SFT, "on_bad_record": "skip", "train": {**SFT["train"], "steps": 3}}}))
    sft_main(["--config", str(cfg), "--output-dir", str(tmp_path / "ok"), "--base-model", BASE, "--data", str(data)])
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("\n{") + 1 :] if not out.startswith("{") else out)
    assert metrics["data/skipped_records"] == 3 and metrics["data/skipped/image"] == 3
    assert metrics["steps"] == 3  # on the 5 records left, the later-turn one among them


TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"


@pytest.mark.parametrize(
    "override",
    [f"mode={TOKEN}", f"train.steps={TOKEN}", "train.checkpoint_uri=https://user:s3cretpass9@example.com/ck"],
)
def test_a_credential_typed_into_a_setting_is_refused_and_never_printed_back(override, world, tmp_path, capsys):
    """The setting's error repeated the value it refused ("got 'hf_...'"), printing the token in full."""
    code, err = _run(tmp_path, capsys, data=world, extra=[override])
    secret = override.split("=", 1)[1].split("@")[0].split(":")[-1]
    assert code == 2 and "<a credential, hidden>" in err and secret not in err
    result = tmp_path / "out" / "_stage_result.json"
    assert not result.exists() or secret not in result.read_text()


def test_a_preset_holding_a_credential_is_refused_before_its_settings_are_validated(tmp_path):
    from pipelines.presets import load_preset

    preset = tmp_path / "mine.yaml"
    preset.write_text(f"extends: demo\nsft: {{mode: {TOKEN}}}\n")  # also an invalid mode: validation would repeat it
    with pytest.raises(ValueError) as caught:
        load_preset(preset)
    assert "sft.mode: a Hugging Face token" in str(caught.value) and TOKEN not in str(caught.value)


def _lengthen(d: Path) -> None:
    """Record 2's answer over the micro-batch budget (512 tokens), record 5's over max_length (4096)."""
    lines = [json.loads(line) for line in (d / "sft.jsonl").read_text().splitlines()]
    lines[1]["conversations"][1]["value"] = "red " * 700
    lines[4]["conversations"][1]["value"] = "blue " * 5000
    (d / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_records_too_long_to_train_on_are_refused_or_skipped_before_step_one(world, tmp_path, capsys):
    """They stopped training at the step that drew them, and on_bad_record: skip could not skip them there."""
    data = _data(world, tmp_path, _lengthen)
    code, err = _run(tmp_path, capsys, data=data)
    assert code == 2 and "2 conversation record(s) too long to train on in sft.jsonl" in err
    budget = (
        r"sft.jsonl:2 \(id='sft-00001'\): \d+ tokens \(text \+ visual\), more than train.max_tokens_per_micro_batch=512"
    )
    assert re.search(budget, err)
    assert re.search(
        r"sft.jsonl:5 \(id='sft-00004'\): sample 'sft-00004' has \d+ tokens .* more than max_length=4096", err
    )
    assert not any((tmp_path / "out" / "checkpoints").iterdir())  # no step taken
    cfg = tmp_path / "skip.yaml"
    cfg.write_text(json.dumps({"sft": {**SFT, "on_bad_record": "skip", "train": {**SFT["train"], "steps": 2}}}))
    sft_main(["--config", str(cfg), "--output-dir", str(tmp_path / "ok"), "--base-model", BASE, "--data", str(data)])
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("\n{") + 1 :] if not out.startswith("{") else out)
    assert metrics["data/skipped_records"] == 2 and metrics["data/skipped/too_long"] == 2
    assert metrics["steps"] == 2


def test_an_output_directory_that_is_a_file_is_named(world, tmp_path, capsys):
    """Was `[Errno 17] File exists` from deep inside the checkpoint store."""
    (tmp_path / "taken").write_text("a file")
    for output, said in ((tmp_path / "taken", "is a file"), (tmp_path / "taken" / "sub", "is under")):
        with pytest.raises(SystemExit) as exit_info:
            sft_main(["--output-dir", str(output), "--base-model", BASE, "--data", str(world)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"--output-dir '{output}' {said}" in err and "Errno" not in err


def test_a_thumbnail_image_and_a_training_set_smaller_than_a_step_are_warned_about(world, tmp_path, caplog):
    from PIL import Image

    data = _data(world, tmp_path, lambda d: Image.new("RGB", (1, 1), "red").save(d / "images" / "sft-00002.png"))
    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps({"sft": {**SFT, "train": {**SFT["train"], "samples_per_step": 16}}}))
    with caplog.at_level("INFO"):
        sft_main(["--config", str(cfg), "--output-dir", str(tmp_path / "o"), "--base-model", BASE, "--data", str(data)])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    small = next(m for m in warned if "min_pixels" in m)
    assert "sft: 1 image(s) have fewer than 1/16 of min_pixels=3136" in small
    assert "(id='sft-00002'): 1x1" in small
    repeats = next(m for m in warned if "passes" in m)
    assert "1 steps x 16 samples over 8 records = 2.0 passes" in repeats and "every step repeats them" in repeats
