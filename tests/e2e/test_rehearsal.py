"""`qvl rehearse` on the smallest real config of every family (real widths, vocabulary, tokenizer, processor and
template; 2 LM layers, 4 ViT blocks, as in the docs table). Qwen3.5-0.8B (the newest, vocabulary 248,320) runs the
stages up to LoRA SFT and on through the reward model to rl, each with its seconds and peak memory, `qvl plan`'s
estimate within 25% of the measured peak of every training stage (rl's included), the LoRA SFT result loading with
the Auto classes; Qwen2-VL-2B, Qwen2.5-VL-3B and Qwen3-VL-2B run up to pretrain (the family-specific paths: their
processors and patch sizes in clean_data, the DeepStack levels of Qwen3-VL's feature cache, packing and attention
in pretrain) within CI's budget. Every stage of each, promote included, is the full table in docs/benchmarks.md."""

import json
import re

import pytest

from pipelines.qvl.rehearse import rehearse

pytestmark = pytest.mark.slow


def test_rehearsal_of_qwen3_5_runs_the_stages_up_to_rl_at_real_shapes(tmp_path):
    from transformers import AutoConfig, AutoProcessor

    results = rehearse("qwen3.5-0.8b", tmp_path, runs=["sft_lora", "rl"], layers=2, vision_depth=4)
    runs = ["clean_data", "extract_features", "pretrain", "sft_lora", "reward_model", "rl"]
    assert [r.run for r in results] == runs
    assert all(r.status == "passed" for r in results), [(r.run, r.detail) for r in results]
    assert all(r.seconds > 0 and r.peak_rss_gb > 0.3 for r in results)
    planned = {r.run: r.planned_gb / r.peak_rss_gb for r in results if r.planned_gb}
    assert set(planned) == {"pretrain", "sft_lora", "reward_model", "rl"}  # the training runs, with qvl plan's estimate
    for run, ratio in planned.items():  # rl: policy, value head, frozen reference, reward model and rollouts
        assert 0.75 <= ratio <= 1.25, (run, planned)
    assert json.loads((tmp_path / "rehearsal.json").read_text())[-1]["run"] == "rl"
    model_dir = tmp_path / "sft_lora" / "model"
    assert AutoConfig.from_pretrained(model_dir).text_config.vocab_size == 248320
    assert len(AutoProcessor.from_pretrained(model_dir).tokenizer) == 248077
    sft = json.loads((tmp_path / "sft_lora" / "_stage_result.json").read_text())["metrics"]
    assert sft["merge_max_abs_logit_diff"] < 1e-3  # the merged export equals the adapter model


@pytest.mark.parametrize("name", ["qwen2-vl-2b", "qwen2.5-vl-3b", "qwen3-vl-2b"])
def test_rehearsal_of_each_other_familys_smallest_checkpoint_runs_up_to_pretrain(name, tmp_path, capsys):
    from transformers import AutoConfig

    results = rehearse(name, tmp_path, runs=["pretrain"], layers=2, vision_depth=4)
    progress = capsys.readouterr().err  # minutes of work: each run said as it starts and ends
    assert f"rehearse {name}: building the checkpoint" in progress
    assert f"rehearse {name}: pretrain ... (log: {tmp_path / 'pretrain.log'})" in progress
    assert re.search(rf"rehearse {re.escape(name)}: pretrain passed in \d+ s", progress)
    assert [r.run for r in results] == ["clean_data", "extract_features", "pretrain"]
    assert all(r.status == "passed" for r in results), [(r.run, r.detail) for r in results]
    (pretrain,) = [r for r in results if r.planned_gb]
    assert 0.75 <= pretrain.planned_gb / pretrain.peak_rss_gb <= 1.25, (pretrain.planned_gb, pretrain.peak_rss_gb)
    config = AutoConfig.from_pretrained(tmp_path / "pretrain" / "model")
    assert config.model_type == AutoConfig.from_pretrained(tmp_path / "checkpoint").model_type
    metrics = json.loads((tmp_path / "pretrain" / "_stage_result.json").read_text())["metrics"]
    assert metrics["heldout_caption_loss_final"] < metrics["heldout_caption_loss_initial"]


def test_an_unknown_stage_or_checkpoint_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint 'qwen5'; known: qwen2-vl-2b"):
        rehearse("qwen5", tmp_path)
    with pytest.raises(ValueError, match=r"unknown rehearsal stage\(s\) \['dpo'\]; choose from clean_data"):
        rehearse("qwen3.5-0.8b", tmp_path, runs=["dpo"])


def test_rehearsal_of_the_qwen4_preview_at_real_widths_runs_up_to_pretrain(tmp_path, capsys):
    """qwen3.8-flash (122B at full depth): widths and vocabulary kept, experts and the n-gram table's rows cut as
    said; pretrain's plan exceeds this machine with the LM trained in stage 1, so it runs with the LM frozen."""
    from transformers import AutoConfig

    results = rehearse("qwen3.8-flash", tmp_path, runs=["pretrain"], layers=2, vision_depth=4)
    progress = capsys.readouterr().err
    assert "rehearse qwen3.8-flash: num_experts 512 -> 16 (the routed experts; each one's width kept)" in progress
    assert all(r.status == "passed" for r in results), [(r.run, r.detail) for r in results]
    (pretrain,) = [r for r in results if r.planned_gb]
    assert pretrain.detail.startswith("(to fit: LM frozen; plan ")
    # qvl plan counts the steady state; loading this 5.5 GB fp32 model peaks at 12 GB and stays at 9 (the bf16 file
    # mapped beside it), which the plan misses at this size: 11.7 GB planned, 17.4 measured (docs/models.md)
    assert 0.6 <= pretrain.planned_gb / pretrain.peak_rss_gb <= 1.25, (pretrain.planned_gb, pretrain.peak_rss_gb)
    text = AutoConfig.from_pretrained(tmp_path / "pretrain" / "model").text_config
    assert (text.hidden_size, text.vocab_size, text.num_experts, text.hc_count) == (2048, 248320, 16, 4)
    log = (tmp_path / "pretrain.log").read_text()
    assert "the LM instead: sdpa over each packed row's block-causal mask" in log  # no packed kernel for the indexer
