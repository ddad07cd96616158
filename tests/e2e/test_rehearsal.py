"""`qvl rehearse` on the smallest real config of the newest family (Qwen3.5-0.8B: real widths, vocabulary 248,320,
its tokenizer, processor and template; 2 LM layers, 4 ViT blocks, as in the docs table): the stages up to LoRA
SFT pass, each with its seconds and peak memory, `qvl plan`'s estimate is within 25% of the measured peak, and the
result loads with the Auto classes. The full table is docs/benchmarks.md."""

import json

import pytest

from pipelines.rehearse import rehearse

pytestmark = pytest.mark.slow


def test_rehearsal_of_qwen3_5_runs_the_stages_up_to_lora_sft_at_real_shapes(tmp_path):
    from transformers import AutoConfig, AutoProcessor

    results = rehearse("qwen3.5-0.8b", tmp_path, runs=["sft_lora"], layers=2, vision_depth=4)
    assert [r.run for r in results] == ["clean_data", "extract_features", "pretrain", "sft_lora"]
    assert all(r.status == "passed" for r in results), [(r.run, r.detail) for r in results]
    assert all(r.seconds > 0 and r.peak_rss_gb > 0.3 for r in results)
    planned = {r.run: r.planned_gb / r.peak_rss_gb for r in results if r.planned_gb}
    assert set(planned) == {"pretrain", "sft_lora"}  # the training runs, with qvl plan's estimate
    assert 0.75 <= planned["pretrain"] <= 1.25, planned
    assert 0.75 <= planned["sft_lora"] <= 1.25, planned
    assert json.loads((tmp_path / "rehearsal.json").read_text())[-1]["run"] == "sft_lora"
    model_dir = tmp_path / "sft_lora" / "model"
    assert AutoConfig.from_pretrained(model_dir).text_config.vocab_size == 248320
    assert len(AutoProcessor.from_pretrained(model_dir).tokenizer) == 248077
    sft = json.loads((tmp_path / "sft_lora" / "_stage_result.json").read_text())["metrics"]
    assert sft["merge_max_abs_logit_diff"] < 1e-3  # the merged export equals the adapter model


def test_an_unknown_stage_or_checkpoint_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint 'qwen5'; known: qwen2-vl-2b"):
        rehearse("qwen5", tmp_path)
    with pytest.raises(ValueError, match=r"unknown rehearsal stage\(s\) \['dpo'\]; choose from clean_data"):
        rehearse("qwen3.5-0.8b", tmp_path, runs=["dpo"])
