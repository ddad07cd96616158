"""The Qwen4 preview (`qwen4_exp`): the tiny builtin holds every piece of the architecture, and a packed row equals
its samples run one by one (logits, loss and gradients, fp32) because the pieces that carry state across tokens
run per sample: without that, the per-layer n-gram embeddings alone leak one sample into the next."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.families import family_for
from components._shared.model.packing import batch_pixels, forward_logits, pack, token_loss
from components._shared.model.vlm import load_vlm, qwen_model

BUILTIN = "builtin:tiny-qwen4_exp"
PIXELS = {"min_pixels": 64 * 64, "max_pixels": 128 * 128}


def _samples(encoder, n: int = 4):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        image = Image.fromarray(rng.integers(0, 255, (64 + 32 * i, 96, 3), dtype=np.uint8))
        turns = [
            {"role": "user", "text": "<image>\nWhat color is the circle?" + " please" * i},
            {"role": "assistant", "text": "red " * (i + 1)},
        ]
        out.append(encoder.encode(turns, images=[image], sample_id=f"s{i}"))
    return out


def _worst(a, b) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def test_the_builtin_holds_every_piece_of_the_preview():
    model = load_vlm(BUILTIN).model
    text = qwen_model(model).config.text_config
    assert family_for(model).name == "qwen4_exp" and model.config.model_type == "qwen4_exp"
    assert text.layer_types == ["linear_attention"] * 3 + ["indexed_attention"]
    assert text.ple_layer_ids == [1] and text.hc_count == 2 and text.num_experts == 4
    layers = qwen_model(model).language_model.layers
    assert layers[0].ple is not None and layers[3].self_attn.indexer is not None
    assert layers[0].mlp.shared_expert is not None


def test_packed_equals_one_by_one_and_the_ngram_embeddings_leak_without_the_lengths():
    model, processor, _ = load_vlm(BUILTIN)
    model.eval()
    samples = _samples(ConversationEncoder(processor, model, **PIXELS))
    packed = pack(samples)
    with torch.no_grad():
        exact = forward_logits(model, packed)[0].split([s.num_tokens for s in samples])
        alone = [forward_logits(model, pack([s]))[0] for s in samples]
        assert _worst(exact, alone) <= 1e-5
        ple = qwen_model(model).language_model.layers[0].ple
        segmented = type(ple)
        ple.__class__ = segmented.__mro__[1]  # the library's own PLE layer; the linear attention stays per sample
        try:
            with family_for(model).packed_samples([s.num_tokens for s in samples]):
                leaky = model(
                    input_ids=packed["input_ids"],
                    pixel_values=batch_pixels(packed),
                    image_grid_thw=packed["image_grid_thw"],
                    position_ids=packed["position_ids"],
                    use_cache=False,
                ).logits[0]
        finally:
            ple.__class__ = segmented
    first, *later = leaky.split([s.num_tokens for s in samples])
    torch.testing.assert_close(first, alone[0], rtol=1e-5, atol=1e-6)  # nothing comes before the first sample
    assert _worst(later, alone[1:]) > 1e-4


def test_a_packed_rows_gradients_equal_its_samples_one_by_one_with_and_without_checkpointing():
    grads = {}
    for way in ("alone", "packed", "packed+checkpointing"):
        torch.manual_seed(0)
        model, processor, _ = load_vlm(BUILTIN)
        model.train()
        if way.endswith("checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        samples = _samples(ConversationEncoder(processor, model, **PIXELS), 3)
        rows = [pack(samples)] if way != "alone" else [pack([s]) for s in samples]
        total = sum(token_loss(forward_logits(model, row), row)[0] for row in rows)
        total.backward()
        grads[way] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(".ple." in n for n in grads["alone"]) and any(".experts" in n for n in grads["alone"])
    # the indexer's top-k choice carries no gradient: it trains by its own loss, which transformers does not have
    assert not any(".indexer." in n for n in grads["alone"])
    for way in ("packed", "packed+checkpointing"):
        assert grads[way].keys() == grads["alone"].keys()
        worst = max(
            float((grads[way][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads["alone"].items()
        )
        assert worst <= 1e-4, way


def test_the_memory_plan_counts_a_tokens_experts_not_a_dense_mlp():
    from pipelines.qvl.memory_plan import plan

    text = qwen_model(load_vlm(BUILTIN).model).config.text_config
    assert family_for("qwen4_exp").lm_mlp_width(text) == 2 * 64 + 64  # top-2 experts of 64 and the shared one
    name, plans = plan("tiny-qwen4_exp")
    assert name == BUILTIN and [p.stage for p in plans] == ["pretrain", "sft", "reward_model", "rl", "distill"]


def test_the_routers_balance_loss_is_reported_and_added_as_the_checkpoints_forward_adds_it():
    from components._shared.model.training import default_loss

    model, processor, _ = load_vlm(BUILTIN)
    samples = _samples(ConversationEncoder(processor, model, **PIXELS), 2)
    batch = pack(samples)
    text = qwen_model(model).config.text_config
    with torch.no_grad():
        plain, targets, extra = default_loss(model, batch, samples)
        assert 0 < extra["router_balance_loss"] < 100 and not text.output_router_logits  # logged, not added
        text.output_router_logits = True  # the checkpoint asks for it: added with router_aux_loss_coef
        added, _, again = default_loss(model, batch, samples)
    expected = plain + text.router_aux_loss_coef * again["router_balance_loss"] * targets
    torch.testing.assert_close(added, expected, rtol=1e-5, atol=1e-6)
    dense, dense_processor, _ = load_vlm("builtin:tiny-qwen2_5-vl")
    dense_samples = _samples(ConversationEncoder(dense_processor, dense, **PIXELS), 2)
    with torch.no_grad():
        assert default_loss(dense, pack(dense_samples), dense_samples)[2] == {}  # no experts, no router term


def test_calibration_scores_a_generated_answer_holding_a_stray_think_end_as_the_template_shows_it():
    """Qwen3.5's template (the preview's too) moves what precedes `</think>` into the reasoning block; an untrained
    model's prediction holding one made sft fail after training (the twelfth pass's Q99)."""
    from components.sft.config import SftConfig
    from components.sft.stage import calibrate

    model, processor, _ = load_vlm(BUILTIN)
    encoder = ConversationEncoder(processor, model, **PIXELS)
    image = Image.new("RGB", (64, 64), (200, 20, 20))
    records = [
        {"id": f"q{i}", "type": "color", "question": "What color?", "answer": "red", "pil": image} for i in range(4)
    ]
    predictions = ["red</think>", "x</think>\n\nred", "</think>", "blue"]
    rows = [{"prediction": p, "score": float(p.endswith("red"))} for p in predictions]
    cfg = SftConfig.model_validate({"calibration": {"fit_temperature": False}})
    measured = calibrate(cfg, model.eval(), encoder, records, rows)
    assert 0.0 <= measured["ece"] <= 1.0
