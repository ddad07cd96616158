"""Model factory: loading, student configs, module groups, and the optimizer groups built from them."""

import pytest
import torch

from components._shared.model.backends import build_optimizer, clip_per_group
from components._shared.model.train_config import OptimConfig
from components._shared.model.vlm import (
    MODULE_GROUPS,
    build_student,
    count_parameters,
    freeze,
    load_vlm,
    module_group,
    named_groups,
    save_vlm,
)


@pytest.fixture(scope="module")
def tiny():
    return load_vlm("builtin:tiny-qwen2_5-vl")


def test_module_groups_cover_every_parameter_once(tiny):
    model = tiny.model
    groups = named_groups(model)
    assert tuple(groups) == MODULE_GROUPS
    names = [n for params in groups.values() for n, _ in params]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert module_group("model.visual.blocks.0.attn.qkv.weight", vision_blocks=2, lm_layers=2) == "vision_lower"
    assert module_group("model.visual.blocks.1.mlp.up_proj.weight", vision_blocks=2, lm_layers=2) == "vision_upper"
    assert (
        module_group("base_model.model.model.visual.merger.mlp.0.lora_A.default.weight", vision_blocks=2, lm_layers=2)
        == "merger"
    )
    assert (
        module_group("model.language_model.layers.1.self_attn.q_proj.weight", vision_blocks=2, lm_layers=2)
        == "lm_upper"
    )
    assert module_group("lm_head.weight", vision_blocks=2, lm_layers=2) == "lm_upper"
    assert module_group("model.language_model.embed_tokens.weight", vision_blocks=2, lm_layers=2) == "lm_lower"


def test_per_group_learning_rates_and_clipping(tiny):
    model = tiny.model
    optim = OptimConfig(
        lr=1e-3, group_lr={"vision_lower": 1e-5}, max_grad_norm=1.0, group_max_grad_norm={"merger": 0.01}
    )
    optimizer, names = build_optimizer(model, optim)
    by_name = {g["name"]: g for g in optimizer.param_groups}
    assert by_name["vision_lower"]["lr"] == 1e-5 and by_name["lm_upper"]["lr"] == 1e-3
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    norms = clip_per_group(optimizer)
    merger_norm = torch.sqrt(sum((p.grad**2).sum() for p in by_name["merger"]["params"]))
    assert norms["merger"] > 1.0 and float(merger_norm) == pytest.approx(0.01, rel=1e-4)
    lm_norm = torch.sqrt(sum((p.grad**2).sum() for p in by_name["lm_upper"]["params"]))
    assert float(lm_norm) == pytest.approx(1.0, rel=1e-4)
    model.zero_grad(set_to_none=True)


def test_freeze_rejects_unknown_groups(tiny):
    with pytest.raises(ValueError, match="unknown module group"):
        freeze(tiny[0], ("vision",))


@pytest.mark.parametrize("family", ["builtin:tiny-qwen2_5-vl", "builtin:tiny-qwen2-vl"])
def test_student_is_smaller_same_family_and_round_trips_through_auto_classes(family, tmp_path):
    teacher, processor, _ = load_vlm(family)
    student = build_student(teacher.config, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vision_depth=1)
    ratio = count_parameters(student) / count_parameters(teacher)
    assert ratio < 0.7 and type(student) is type(teacher)  # the fixed-width ViT patch embedding dominates at tiny scale
    text = student.config.text_config
    assert sum(text.rope_parameters["mrope_section"]) * 2 == text.hidden_size // text.num_attention_heads
    save_vlm(student, processor, tmp_path / "student", metadata={"teacher": "tiny"})
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "student")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, student.eval()(input_ids=ids).logits, atol=1e-6)
    # the student's merger feeds its narrower LM: a real image goes through end to end
    import numpy as np
    from PIL import Image

    from components._shared.model.encoder import ConversationEncoder
    from components._shared.model.packing import forward_logits, pack

    encoder = ConversationEncoder(processor, student, min_pixels=3136, max_pixels=12544)
    image = Image.fromarray(np.zeros((56, 84, 3), dtype=np.uint8))
    batch = pack(
        [encoder.encode([{"role": "user", "text": "<image>\nhi"}, {"role": "assistant", "text": "a"}], images=[image])]
    )
    with torch.no_grad():
        assert forward_logits(student, batch).shape[-1] == teacher.config.text_config.vocab_size
    with pytest.raises(ValueError, match="hidden must divide by heads"):
        build_student(teacher.config, layers=1, hidden=30, heads=4)


def test_loading_refuses_other_model_types(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        load_vlm(str(tmp_path))


def test_a_model_with_a_non_finite_weight_is_never_exported(tmp_path):
    model, processor, _ = load_vlm("builtin:tiny-qwen2_5-vl")
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "merger" in n).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=r"refusing to export: 1 weight tensor\(s\) hold non-finite values.*merger"):
        save_vlm(model, processor, tmp_path / "model")
    assert not (tmp_path / "model").exists()
