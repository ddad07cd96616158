"""The packer: template-exact encoding, first-fit-decreasing plans, and packed == unpadded == padded numerics."""

import numpy as np
import pytest
import torch
from PIL import Image

from components._shared.model.attention import PACKED_SDPA, segment_lengths
from components._shared.model.encoder import IGNORE_INDEX, ConversationEncoder
from components._shared.model.packing import (
    batch_tokens,
    forward_logits,
    pack,
    pad,
    per_sample_loss,
    plan_micro_batches,
)
from components._shared.model.pixel_norm import model_pixels
from components._shared.model.vlm import load_vlm

SIZES = [(112, 112), (56, 168), (224, 112), (84, 84), (140, 70), (168, 56)]


@pytest.fixture(scope="module", params=["builtin:tiny-qwen2_5-vl", "builtin:tiny-qwen2-vl"])
def model_and_encoder(request):
    torch.manual_seed(0)
    model, processor, _ = load_vlm(request.param)
    model.eval()
    return model, processor, ConversationEncoder(processor, model, min_pixels=56 * 56, max_pixels=224 * 224)


def _samples(encoder, n=None):
    rng = np.random.default_rng(0)
    out = []
    for i, (h, w) in enumerate(SIZES[:n]):
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        turns = [
            {"role": "user", "text": "<image>\nWhat color is the circle?" + " please" * i},
            {"role": "assistant", "text": "red " * (i + 1)},
            {"role": "user", "text": "And the square?"},
            {"role": "assistant", "text": "blue"},
        ]
        out.append(encoder.encode(turns, images=[image], sample_id=f"s{i}"))
    return out


def test_encoding_matches_the_processor_chat_template(model_and_encoder):
    _, processor, encoder = model_and_encoder
    image = Image.fromarray(np.full((84, 140, 3), 200, dtype=np.uint8))
    sample = encoder.encode(
        [{"role": "user", "text": "<image>\nHow many shapes?"}, {"role": "assistant", "text": "3"}], images=[image]
    )
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]},
        {"role": "assistant", "content": "3"},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    reference = processor(
        text=[text],
        images=[image],
        return_tensors="pt",
        images_kwargs={"size": {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}},
    )
    assert torch.equal(reference["input_ids"][0], sample.input_ids)
    assert torch.equal(reference["image_grid_thw"][0], sample.image_grid_thw[0])
    assert sample.pixel_values.dtype == torch.uint8  # a quarter of the processor's float32 bytes until the model
    assert torch.equal(reference["pixel_values"], model_pixels(sample.pixel_values, sample.pixel_norm))
    # only "3<|im_end|>" is trained
    trained = sample.input_ids[sample.labels != IGNORE_INDEX]
    assert processor.tokenizer.decode(trained) == "3<|im_end|>"


def test_packed_losses_and_logits_equal_unpacked_and_padded(model_and_encoder):
    model, processor, encoder = model_and_encoder
    samples = _samples(encoder)
    assert len({s.num_tokens for s in samples}) == len(samples)  # mixed lengths and image sizes
    with torch.no_grad():
        packed = pack(samples)
        packed_logits = forward_logits(model, packed)
        packed_loss = per_sample_loss(packed_logits, packed)
        padded = pad(samples, processor.tokenizer.pad_token_id)
        padded_loss = per_sample_loss(forward_logits(model, padded), padded)
        single_logits = [forward_logits(model, pack([s]))[0] for s in samples]
        single_loss = torch.stack(
            [per_sample_loss(lg[None], pack([s]))[0] for lg, s in zip(single_logits, samples, strict=True)]
        )
    rel = lambda a, b: float(((a - b).abs() / b.abs().clamp_min(1e-6)).max())  # noqa: E731
    print(
        f"packed vs single rel err {rel(packed_loss, single_loss):.2e}, vs padded {rel(packed_loss, padded_loss):.2e}"
    )
    assert rel(packed_loss, single_loss) <= 1e-5
    assert rel(padded_loss, single_loss) <= 1e-5
    assert torch.allclose(packed_logits[0], torch.cat(single_logits), rtol=1e-5, atol=1e-5)


def test_per_sample_attention_equals_the_block_causal_mask(model_and_encoder):
    """sdpa_packed (per-sample SDPA over a packed row) against transformers' sdpa with its block-causal mask, on a
    packed row and on the padded batch (which sdpa_packed hands to sdpa), losses and logits."""
    model, processor, encoder = model_and_encoder
    samples = _samples(encoder)
    packed, padded = pack(samples), pad(samples, processor.tokenizer.pad_token_id)
    assert model.config._attn_implementation == PACKED_SDPA  # what load_vlm gives every stage
    try:
        with torch.no_grad():
            ours = forward_logits(model, packed), forward_logits(model, padded)
            model.set_attn_implementation("sdpa")
            theirs = forward_logits(model, packed), forward_logits(model, padded)
    finally:
        model.set_attn_implementation(PACKED_SDPA)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), float((a - b).abs().max())
    assert torch.allclose(per_sample_loss(ours[0], packed), per_sample_loss(theirs[0], packed), rtol=1e-5)


def test_segment_lengths_split_a_packed_row_at_position_restarts():
    row = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert segment_lengths(row) == [3, 2, 4]
    assert segment_lengths(torch.arange(7)[None]) is None  # one plain sequence: sdpa's own causal path
    assert segment_lengths(torch.tensor([[0, 0, 0]])) == [1, 1, 1]


def test_packing_without_restarting_text_positions_leaks_between_samples(model_and_encoder):
    """The control that shows the exactness test can fail: one causal mask over the whole row is not exact, whether
    the text positions do not restart (and no bounds come from the host) or the host's bounds say one sample."""
    model, _, encoder = model_and_encoder
    samples = _samples(encoder, 3)
    with torch.no_grad():
        packed = pack(samples)
        exact = per_sample_loss(forward_logits(model, packed), packed)
        unbounded = {k: v for k, v in packed.items() if k not in ("sample_lengths", "cu_seqlens", "max_seqlen")}
        leaky = dict(unbounded, position_ids=packed["position_ids"].clone())
        leaky["position_ids"][0, 0] = torch.arange(leaky["position_ids"].shape[-1])
        length = packed["position_ids"].shape[-1]
        one_sample = dict(packed, sample_lengths=[length], cu_seqlens=torch.tensor([0, length]), max_seqlen=length)
        for wrong_batch in (leaky, one_sample):
            wrong = per_sample_loss(forward_logits(model, wrong_batch), wrong_batch)
            assert torch.allclose(exact[0], wrong[0])  # the first sample sees nothing before it
            assert float((exact[1:] - wrong[1:]).abs().max()) > 1e-4


def test_first_fit_decreasing_plan():
    costs = [50, 30, 70, 20, 40, 60, 10, 20]
    plan = plan_micro_batches(costs, max_tokens=100)
    assert sorted(i for b in plan for i in b) == list(range(len(costs)))
    assert all(sum(costs[i] for i in b) <= 100 for b in plan)
    assert len(plan) == 3  # 300 tokens in 3 full bins: FFD is optimal here
    assert plan == plan_micro_batches(costs, max_tokens=100)  # deterministic
    with pytest.raises(ValueError, match="sample #2 has 70 tokens.*max_tokens_per_micro_batch"):
        plan_micro_batches(costs, max_tokens=60)


def test_padding_efficiency_of_packed_vs_padded(model_and_encoder):
    _, processor, encoder = model_and_encoder
    samples = _samples(encoder)
    packed_real, packed_slots = batch_tokens(pack(samples))
    padded_real, padded_slots = batch_tokens(pad(samples, processor.tokenizer.pad_token_id))
    assert packed_real == packed_slots == padded_real == sum(s.num_tokens for s in samples)
    assert padded_slots > padded_real


def test_encoder_rejects_bad_conversations(model_and_encoder):
    model, _, encoder = model_and_encoder
    image = Image.fromarray(np.zeros((56, 56, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="'bad' turn 0: expected role"):
        encoder.encode([{"role": "tool", "text": "x"}], images=[image], sample_id="bad")
    with pytest.raises(ValueError, match="'late' turn 1: expected role 'user' or 'assistant' \\(or 'system' first\\)"):
        encoder.encode(
            [{"role": "user", "text": "<image> hi"}, {"role": "system", "text": "x"}], images=[image], sample_id="late"
        )
    with pytest.raises(ValueError, match="more <image> placeholders than images"):
        encoder.encode([{"role": "user", "text": "<image><image> hi"}], images=[image], sample_id="two")
    with pytest.raises(ValueError, match="max_length"):
        ConversationEncoder(encoder_processor(encoder), model, min_pixels=3136, max_pixels=50176, max_length=8).encode(
            [{"role": "user", "text": "<image> hi"}], images=[image], sample_id="long"
        )


def test_a_system_turn_replaces_the_templates_default_and_is_never_trained(model_and_encoder):
    _, _, encoder = model_and_encoder
    image = Image.fromarray(np.zeros((56, 56, 3), dtype=np.uint8))
    turns = [{"role": "user", "text": "<image> What is it?"}, {"role": "assistant", "text": "A square."}]
    plain = encoder.encode(turns, images=[image], sample_id="plain")
    own = encoder.encode([{"role": "system", "text": "Answer in one word."}, *turns], images=[image], sample_id="own")
    text = encoder.tokenizer.decode(own.input_ids)
    assert "<|im_start|>system\nAnswer in one word.<|im_end|>" in text
    assert "You are a helpful assistant." in encoder.tokenizer.decode(plain.input_ids)
    assert "You are a helpful assistant." not in text
    trained = encoder.tokenizer.decode(own.input_ids[own.labels != -100])
    assert trained == encoder.tokenizer.decode(plain.input_ids[plain.labels != -100]) == "A square.<|im_end|>"


def encoder_processor(encoder):
    class _Processor:  # the two parts the encoder uses
        tokenizer = encoder.tokenizer
        image_processor = encoder.image_processor

    return _Processor()


def test_an_image_marker_in_a_later_user_turn_puts_the_image_there(model_and_encoder):
    """Only a record without any marker gets its images at the first user turn (it was so for every record: the
    later turn's marker then had no image left and training stopped mid-run)."""
    _, _, encoder = model_and_encoder
    image = Image.fromarray(np.zeros((56, 56, 3), dtype=np.uint8))
    turns = [
        {"role": "user", "text": "Hello."},
        {"role": "assistant", "text": "Hi."},
        {"role": "user", "text": "<image>\nWhat is it?"},
        {"role": "assistant", "text": "A square."},
    ]
    text = encoder.tokenizer.decode(encoder.encode(turns, images=[image], sample_id="later").input_ids)
    assert text.index("Hi.") < text.index("<|vision_start|>") < text.index("What is it?")
    unmarked = [{**turns[0], "text": "What is it?"}, turns[3]]
    text = encoder.tokenizer.decode(encoder.encode(unmarked, images=[image], sample_id="unmarked").input_ids)
    assert text.index("<|vision_start|>") < text.index("What is it?")
