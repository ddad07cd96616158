"""Every family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, the Qwen4 preview) packs exactly and caches features exactly.

Packed per-sample logits equal the padded batch's (fp32, rel. error <= 1e-5) on rows that mix image sizes, text
lengths and multi-image samples; Qwen3.5's linear-attention layers leak between packed samples without the
sample lengths (so the equality can fail); the cached-feature path (DeepStack levels included) equals pixels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.families import FAMILIES, SUPPORTED_MODEL_TYPES, family_for
from components._shared.model.packing import batch_pixels, forward_logits, image_embeddings, pack, pad, per_sample_loss
from components._shared.model.pixel_norm import model_pixels
from components._shared.model.sources import resolve_model
from components._shared.model.vlm import load_vlm, named_groups, qwen_model
from components.extract_features.stage import load_vision_tower, pre_merger_features

BUILTINS = {
    "qwen2_vl": "builtin:tiny-qwen2-vl",
    "qwen2_5_vl": "builtin:tiny-qwen2_5-vl",
    "qwen3_vl": "builtin:tiny-qwen3-vl",
    "qwen3_5": "builtin:tiny-qwen3_5",
    "qwen4_exp": "builtin:tiny-qwen4_exp",
}
SIZES = [(128, 128), (64, 192), (256, 128), (96, 96), (160, 64)]
PIXELS = {"min_pixels": 64 * 64, "max_pixels": 256 * 256}


@pytest.fixture(scope="module", params=list(BUILTINS))
def family_model(request):
    torch.manual_seed(0)
    model, processor, _ = load_vlm(BUILTINS[request.param])
    model.eval()
    return request.param, model, processor, ConversationEncoder(processor, model, **PIXELS)


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _samples(encoder):
    out = []
    for i, (h, w) in enumerate(SIZES):
        images = [_image(h, w, i)] if i != 3 else [_image(h, w, i), _image(64, 64, 99)]  # one two-image sample
        prompt = "".join("<image>" for _ in images) + "\nWhat color is the circle?" + " please" * i
        turns = [
            {"role": "user", "text": prompt},
            {"role": "assistant", "text": "red " * (i + 1)},
            {"role": "user", "text": "And the square?"},
            {"role": "assistant", "text": "blue"},
        ]
        out.append(encoder.encode(turns, images=images, sample_id=f"s{i}"))
    return out


def _split_packed(logits: torch.Tensor, samples) -> list[torch.Tensor]:
    return list(logits[0].split([s.num_tokens for s in samples]))


def _worst_relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def test_every_family_is_registered_with_its_model_types():
    assert set(FAMILIES) == set(BUILTINS)
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp"} == set(
        SUPPORTED_MODEL_TYPES
    )
    with pytest.raises(ValueError, match="'llava'.*not supported.*qwen3_5"):
        family_for("llava")


def test_builtin_keeps_the_family_structure(family_model):
    name, model, processor, _ = family_model
    config = qwen_model(model).config
    family = family_for(model)
    assert family.name == name and config.model_type == name
    assert processor.image_processor.patch_size == family.patch_size
    if name == "qwen3_vl":
        assert config.vision_config.deepstack_visual_indexes == [0, 1, 2]
        assert len(qwen_model(model).visual.deepstack_merger_list) == 3
    if name == "qwen3_5":
        assert config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert config.text_config.rope_parameters["partial_rotary_factor"] == 0.25
    if name == "qwen2_5_vl":
        assert config.vision_config.fullatt_block_indexes == [1]


def test_encoding_equals_the_processor_with_the_checkpoints_own_template(family_model):
    """Token ids, grid and pixels as the processor makes them from its own chat template; labels exactly on the
    assistant text and its end token (Qwen3.5's empty think block after the last user turn is context)."""
    name, _, processor, encoder = family_model
    image = _image(84, 140, 7)
    turns = [
        {"role": "user", "text": "<image>\nHow many shapes?"},
        {"role": "assistant", "text": "3"},
        {"role": "user", "text": "And circles?"},
        {"role": "assistant", "text": "two circles"},
    ]
    sample = encoder.encode(turns, images=[image])
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": [{"type": "text", "text": "And circles?"}]},
        {"role": "assistant", "content": "two circles"},
    ]
    text = processor.apply_chat_template(messages, tokenize=False, **family_for(name).template_kwargs)
    size = {"shortest_edge": PIXELS["min_pixels"], "longest_edge": PIXELS["max_pixels"]}
    reference = processor(text=[text], images=[image], return_tensors="pt", images_kwargs={"size": size})
    assert torch.equal(reference["input_ids"][0], sample.input_ids)
    assert torch.equal(reference["image_grid_thw"][0], sample.image_grid_thw[0])
    assert sample.pixel_values.dtype == torch.uint8  # normalised only where the rows reach the model: bit-identical
    assert torch.equal(reference["pixel_values"], model_pixels(sample.pixel_values, sample.pixel_norm))
    assert processor.tokenizer.decode(sample.input_ids[sample.labels != -100]) == "3<|im_end|>two circles<|im_end|>"
    has_system = "<|im_start|>system" in processor.tokenizer.decode(sample.input_ids)
    assert has_system == (name in ("qwen2_vl", "qwen2_5_vl"))  # Qwen3 templates add no default system turn
    if name == "qwen3_5":
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\ntwo circles<|im_end|>\n")
        prompt = encoder.encode(turns[:1], images=[image], add_generation_prompt=True)
        assert processor.tokenizer.decode(prompt.input_ids).endswith("assistant\n<think>\n\n</think>\n\n")


def test_a_generated_answer_with_a_stray_think_tag_is_encoded_as_the_template_shows_it(family_model):
    """A sampled answer may hold `</think>` (the tiny Qwen3.5 sampled one in an RL run): Qwen3's templates move what
    precedes it into the reasoning block, so the encoder would refuse the verbatim answer; RL and the reward model
    score the answer as a conversation shows it, the text after the tag. Other families keep it verbatim."""
    name, _, _, encoder = family_model
    template = encoder.template
    if "</think>" not in template.template:
        assert template.shown_answer("a </think>\nb") == "a </think>\nb"
        return
    assert template.shown_answer("a </think>\n\nb") == "b" and template.shown_answer("plain") == "plain"
    turns = [{"role": "user", "text": "<image>\nWhat shape?"}, {"role": "assistant", "text": "a </think>\n\nb"}]
    with pytest.raises(ValueError, match="changes assistant text"):
        encoder.encode(turns, images=[_image(56, 56, 1)])
    shown = [turns[0], {"role": "assistant", "text": template.shown_answer(turns[1]["text"])}]
    sample = encoder.encode(shown, images=[_image(56, 56, 1)])
    assert encoder.tokenizer.decode(sample.input_ids[sample.labels != -100]) == "b<|im_end|>"


def test_packed_logits_equal_padded_for_every_family(family_model):
    _, model, processor, encoder = family_model
    samples = _samples(encoder)
    assert len({s.num_tokens for s in samples}) == len(samples)
    with torch.no_grad():
        packed = pack(samples)
        packed_logits = forward_logits(model, packed)
        padded = pad(samples, processor.tokenizer.pad_token_id)
        padded_logits = forward_logits(model, padded)
    padded_rows = [padded_logits[b, : s.num_tokens] for b, s in enumerate(samples)]
    assert _worst_relative(_split_packed(packed_logits, samples), padded_rows) <= 1e-5
    losses = per_sample_loss(packed_logits, packed), per_sample_loss(padded_logits, padded)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)


def test_qwen3_5_linear_attention_leaks_across_packed_samples_without_their_lengths():
    model, processor, _ = load_vlm(BUILTINS["qwen3_5"])
    model.eval()
    samples = _samples(ConversationEncoder(processor, model, **PIXELS))
    packed = pack(samples)
    with torch.no_grad():
        exact = forward_logits(model, packed)
        leaky = model(  # the same packed row and positions, but no sample lengths reach the linear attention
            input_ids=packed["input_ids"],
            pixel_values=batch_pixels(packed),
            image_grid_thw=packed["image_grid_thw"],
            position_ids=packed["position_ids"],
            use_cache=False,
        ).logits
        alone = [forward_logits(model, pack([s]))[0] for s in samples]
    assert _worst_relative(_split_packed(exact, samples), alone) <= 1e-5
    first, *later = _split_packed(leaky, samples)
    torch.testing.assert_close(first, alone[0], rtol=1e-5, atol=1e-6)  # the first sample has nothing before it
    assert _worst_relative(later, alone[1:]) > 1e-3


def test_cached_features_equal_the_pixel_path_for_every_family(family_model):
    """The feature cache stores what each family's mergers read (Qwen3-VL: + its DeepStack blocks' outputs)."""
    name, model, processor, encoder = family_model
    tower, _ = load_vision_tower(resolve_model(BUILTINS[name]), dtype=torch.float32, device=torch.device("cpu"))
    images = [_image(h, w, i) for i, (h, w) in enumerate(SIZES[:3])]
    turns = [{"role": "user", "text": "<image>\nDescribe the image."}, {"role": "assistant", "text": "a red circle"}]
    pixel_samples = [encoder.encode(turns, images=[image]) for image in images]
    features = [
        pre_merger_features(tower, model_pixels(s.pixel_values, s.pixel_norm), s.image_grid_thw)[0]
        for s in pixel_samples
    ]  # what extract_features writes per image
    levels = 1 + len(family_for(model).cached_levels(qwen_model(model).config.vision_config))
    assert features[0].shape[-1] == levels * tower.patch_embed.proj.out_channels
    cached_samples = [
        encoder.encode(turns, grids=[s.image_grid_thw[0]], features=[f])
        for s, f in zip(pixel_samples, features, strict=True)
    ]
    with torch.no_grad():
        by_pixels, by_cache = pack(pixel_samples), pack(cached_samples)
        tokens_pixels, tokens_cache = image_embeddings(model, by_pixels), image_embeddings(model, by_cache)
        logits = forward_logits(model, by_pixels), forward_logits(model, by_cache)
    assert len(tokens_cache.deepstack) == levels - 1
    torch.testing.assert_close(tokens_cache.embeds, tokens_pixels.embeds, rtol=1e-5, atol=1e-6)
    for a, b in zip(tokens_cache.deepstack, tokens_pixels.deepstack, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float((logits[1] - logits[0]).abs().max() / logits[0].abs().max()) <= 1e-5


def test_deepstack_mergers_are_merger_parameters(family_model):
    """Freezing `merger` must freeze every module that projects into the LM, DeepStack's included."""
    name, model, _, _ = family_model
    groups = {group: [n for n, _ in params] for group, params in named_groups(model).items()}
    assert all(".visual." in n for n in groups["merger"])
    deepstack = [n for n in groups["merger"] if "deepstack_merger_list" in n]
    assert bool(deepstack) == (name == "qwen3_vl")
    assert not any("deepstack" in n for g, names in groups.items() if g != "merger" for n in names)
    assert any("pos_embed" in n for n in groups["vision_lower"]) == (name in ("qwen3_vl", "qwen3_5", "qwen4_exp"))


@pytest.mark.parametrize("name", list(BUILTINS))
def test_default_lora_adapts_every_family_merger_and_its_attention_kinds(name):
    from components.sft.config import SftConfig
    from components.sft.stage import build_model

    model = build_model(SftConfig.model_validate({"mode": "lora"}), BUILTINS[name]).model
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert any(".visual.merger." in n for n in adapted) and any(".attn.qkv" in n for n in adapted)
    assert any("deepstack_merger_list" in n for n in adapted) == (name == "qwen3_vl")
    assert any(".linear_attn." in n for n in adapted) == (name in ("qwen3_5", "qwen4_exp"))
    with pytest.raises(ValueError, match=f"gave no adapter on.*this {name} model's defaults"):
        build_model(SftConfig.model_validate({"mode": "lora", "lora": {"target_modules": ["lm_head"]}}), BUILTINS[name])


def test_a_tied_embedding_is_the_output_head_and_stays_trainable_when_the_lower_lm_is_frozen():
    from transformers import AutoModelForImageTextToText

    from components._shared.model.vlm import freeze

    config = load_vlm(BUILTINS["qwen3_vl"])[0].config
    config.tie_word_embeddings = True  # as in Qwen3-VL-2B / Qwen2.5-VL-3B / Qwen3.5-0.8B
    model = AutoModelForImageTextToText.from_config(config)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    groups = {group: [p for _, p in params] for group, params in named_groups(model).items()}
    assert any(p is model.lm_head.weight for p in groups["lm_upper"])
    assert not any(p is model.lm_head.weight for p in groups["lm_lower"])
    freeze(model, ("lm_lower",))
    assert model.lm_head.weight.requires_grad


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_5"])
def test_clean_data_judge_scores_captions_at_the_stage_resolution_like_the_trainer(name):
    """The self-judge's caption loss equals the trainer's for the same pair: images resized within the stage's
    bounds (not the processor's saved ones) and the family's own prompt (Qwen3.5: no thinking block)."""
    from components.clean_data.filters import CaptionJudge

    low, high = 64 * 64, 96 * 96
    judge = CaptionJudge(resolve_model(BUILTINS[name]), "Describe the image.", min_pixels=low, max_pixels=high)
    images = [_image(200, 120, 1), _image(90, 90, 2)]
    captions = ["a red circle", "two blue squares on the left"]
    losses = judge.losses(images, captions)
    model, processor, _ = load_vlm(BUILTINS[name])
    encoder = ConversationEncoder(processor, model.eval(), min_pixels=low, max_pixels=high)
    samples = [
        encoder.encode(
            [{"role": "user", "text": "<image>\nDescribe the image."}, {"role": "assistant", "text": c}], images=[i]
        )
        for i, c in zip(images, captions, strict=True)
    ]
    with torch.no_grad():
        batch = pack(samples)
        expected = per_sample_loss(forward_logits(model, batch), batch)
    np.testing.assert_allclose(losses, expected.numpy(), rtol=1e-4)


def _loop(model, encoder, tmp_path, loss_fn=None):
    from components._shared.model.checkpoint import CheckpointStore
    from components._shared.model.train_config import OptimConfig, ScheduleConfig, TrainConfig
    from components._shared.model.training import LoopData, LoopSettings, Phase, TrainLoop, default_loss

    samples = _samples(encoder)[:2]
    train = TrainConfig(steps=2, samples_per_step=2, max_tokens_per_micro_batch=4096, threads=1)
    return TrainLoop(
        model,
        LoopSettings(train, OptimConfig(lr=1e-3), ScheduleConfig()),
        LoopData(phases=[Phase("all", 2, [0, 1])], sample=lambda i: samples[i]),
        CheckpointStore(tmp_path / "ckpt"),
        loss_fn=loss_fn or default_loss,
    )


def test_a_run_records_what_it_trains_and_proves_the_frozen_groups_did_not_move(tmp_path):
    from components._shared.model.training import default_loss
    from components._shared.model.vlm import freeze

    model, processor, _ = load_vlm(BUILTINS["qwen3_vl"])
    encoder = ConversationEncoder(processor, model, **PIXELS)
    freeze(model, ("vision_lower", "vision_upper", "merger"))
    result = _loop(model, encoder, tmp_path / "a").run()
    merger = result.parameters["merger"]
    assert merger["trainable"] == 0 and merger["frozen"] > 0  # the DeepStack mergers included
    deepstack = sum(p.numel() for n, p in model.named_parameters() if "deepstack_merger_list" in n)
    main = sum(p.numel() for n, p in model.named_parameters() if ".visual.merger." in n)
    assert merger["frozen"] == deepstack + main
    assert result.parameters["lm_upper"]["trainable"] > 0

    leaked = next(p for n, p in model.named_parameters() if "deepstack_merger_list" in n)

    def leaky_loss(m, batch, samples):  # something updates a frozen tensor behind the optimizer's back
        with torch.no_grad():
            leaked.add_(1e-3)
        return default_loss(m, batch, samples)

    with pytest.raises(RuntimeError, match="frozen tensor.*changed during training.*group merger"):
        _loop(model, encoder, tmp_path / "b", leaky_loss).run()


def test_an_encoder_does_not_keep_its_model_alive():
    """Pretrain stage 2 reloads the model; stage 1's must be freed though its encoder and samples live on."""
    import gc
    import weakref

    model, processor, _ = load_vlm(BUILTINS["qwen3_5"])
    encoder = ConversationEncoder(processor, model, **PIXELS)
    sample = _samples(encoder)[0]
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    turns = [{"role": "user", "text": "<image>\nWhat color is the circle?"}]
    again = encoder.encode(turns, images=[_image(128, 128, 0)])
    assert again.position_ids.shape == (3, again.num_tokens) and sample.num_tokens > 0


def test_qwen3_5_packed_gradients_are_the_same_with_gradient_checkpointing():
    """Checkpointing recomputes each layer in backward, after the forward's context is gone: the linear-attention
    layers must still see the packed samples' lengths there, or the gradients silently change."""
    from components._shared.model.packing import token_loss

    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, processor, _ = load_vlm(BUILTINS["qwen3_5"])
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        batch = pack(_samples(ConversationEncoder(processor, model, **PIXELS))[:3])
        loss, _ = token_loss(forward_logits(model, batch), batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    worst = max(
        float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max().clamp_min(1e-12)) for n in grads[0]
    )
    assert worst <= 1e-4


def test_token_counts_from_image_headers_equal_the_encoding_for_every_family(family_model, tmp_path):
    """model/length_check.py counts every record before step 1 from its images' header sizes: the count equals the
    encoded sample's length for every family, image size and turn layout, an EXIF-rotated JPEG included (decoded
    upright, so its header's width and height swap)."""
    from components._shared.data.image_cache import DecodedImages
    from components._shared.data.image_checks import inspect_image

    _, _, _, encoder = family_model
    rotated = _image(60, 200, 5)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: decoded 60 wide, 200 high
    rotated.save(tmp_path / "turned.jpg", exif=exif)
    problem, size = inspect_image(tmp_path, "turned.jpg")
    assert problem is None and size == (60, 200)
    decoded = DecodedImages(tmp_path)("turned.jpg")
    cases = [([decoded], [size])] + [([_image(h, w, i)], [(w, h)]) for i, (h, w) in enumerate(SIZES)]
    cases.append(([_image(300, 40, 1), _image(40, 40, 2)], [(40, 300), (40, 40)]))
    for images, sizes in cases:
        turns = [
            {"role": "user", "text": "<image>" * len(images) + "\nWhat is shown?"},
            {"role": "assistant", "text": "a red circle " * len(sizes)},
            {"role": "user", "text": "And then?"},
            {"role": "assistant", "text": "nothing"},
        ]
        assert encoder.count_tokens(turns, sizes) == encoder.encode(turns, images=images).num_tokens
        prompt = turns[:1]
        counted = encoder.count_tokens(prompt, sizes, add_generation_prompt=True)
        assert counted == encoder.encode(prompt, images=images, add_generation_prompt=True).num_tokens
    _, model, processor, _ = family_model
    short = ConversationEncoder(processor, model, **PIXELS, max_length=20)
    long = [{"role": "user", "text": "<image>\nhi"}, {"role": "assistant", "text": "x " * 40}]
    with pytest.raises(ValueError, match=r"sample 'long' has \d+ tokens \(text \+ visual\), more than max_length=20"):
        short.count_tokens(long, [(64, 64)], sample_id="long")


def test_the_cheap_token_bound_is_never_below_the_exact_count(family_model, tmp_path):
    """length_check counts exactly only where token_bound exceeds the limit, so the bound must hold for every
    shape of conversation: a system turn, several turns, unmarked images (placed at the first user turn), markers in
    a later turn, two images, non-ASCII and marker-adjacent text; and for the synthetic world's SFT records."""
    from components._shared.data import datasets
    from components.synth_world.splits import write_splits

    _, _, _, encoder = family_model
    write_splits(tmp_path, seed=5, eval_per_type=1, sft_records=40, preference_pairs=2)
    cases = [(r["turns"], r["image_sizes"]) for r in datasets.load_conversations(tmp_path)]
    u, a, s = "user", "assistant", "system"
    cases += [
        ([{"role": s, "text": "Be brief."}, {"role": u, "text": "Colour?"}, {"role": a, "text": "red"}], [(64, 64)]),
        (
            [
                {"role": u, "text": "Hi"},
                {"role": a, "text": "Hello"},
                {"role": u, "text": "<image>\nThis?"},
                {"role": a, "text": "a cat"},
            ],
            [(300, 40)],
        ),  # fmt: skip
        (
            [{"role": u, "text": "<image><image>\nSame? äöü 東京 😀"}, {"role": a, "text": "no\n\n  spaced "}],
            [(64, 64), (128, 32)],
        ),  # fmt: skip
        ([{"role": u, "text": "Describe."}, {"role": a, "text": "x" * 300}], [None]),
    ]
    for turns, sizes in cases:
        assert encoder.token_bound(turns, sizes) >= encoder.count_tokens(turns, sizes)
