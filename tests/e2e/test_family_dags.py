"""The local DAG runs end to end on the tiny builtin of each newer family (Qwen2-VL, Qwen3-VL, Qwen3.5, the Qwen4
preview), with every stage's metrics in run_summary.json; every stage's model loads with the Auto classes and
answers about an image. The tiny preset (Qwen2.5-VL) is tests/e2e/test_local_dag.py."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from components.stages import dag_stages
from pipelines.presets import load_preset

pytestmark = pytest.mark.e2e

FAMILIES = {
    "tiny-qwen2-vl": "qwen2_vl",
    "tiny-qwen3-vl": "qwen3_vl",
    "tiny-qwen3_5": "qwen3_5",
    "tiny-qwen4_exp": "qwen4_exp",
}
STAGES = {"preflight", *dag_stages(load_preset("tiny").stages)}  # the family presets extend tiny


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from components.synth_world.lake import write_world

    out = tmp_path_factory.mktemp("world")
    write_world(out, records=400, seed=3)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def run(request, world, tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp(request.param)
    cmd = [sys.executable, "-m", "pipelines.qvl.app", "run", "--local", "--preset", request.param]
    proc = subprocess.run(
        [*cmd, "--lake", str(world / "lake"), "--out", str(out)], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return FAMILIES[request.param], json.loads((out / "run_summary.json").read_text())


def test_every_stage_succeeds_and_reports_its_metrics(run):
    family, summary = run
    assert summary["status"] == "succeeded" and set(summary["stages"]) == STAGES
    for stage, result in summary["stages"].items():
        assert result["status"] == "succeeded", stage
        assert result["metrics"], stage
    metrics = summary["stages"]
    assert metrics["clean_data"]["metrics"]["records_kept"] > 0
    assert (
        metrics["pretrain"]["metrics"]["heldout_caption_loss_final"]
        < metrics["pretrain"]["metrics"]["heldout_caption_loss_initial"]
    )
    assert metrics["distill"]["metrics"]["student_param_ratio"] < 0.5


def test_every_model_loads_with_the_auto_classes_and_answers_about_an_image(run):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from components._shared.model.families import FAMILIES as KNOWN

    family, summary = run
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (128, 96, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    for stage in ("pretrain", "sft", "rl", "distill", "select_checkpoint"):
        path = summary["stages"][stage]["artifacts"]["model"]
        model = AutoModelForImageTextToText.from_pretrained(path).eval()
        processor = AutoProcessor.from_pretrained(path)
        assert model.config.model_type == family, stage
        text = processor.apply_chat_template(messages, add_generation_prompt=True, **KNOWN[family].template_kwargs)
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert out.shape[1] > inputs["input_ids"].shape[1], stage
