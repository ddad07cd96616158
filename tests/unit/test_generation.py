"""Rollouts and evaluation sample with the stage's settings only, not the checkpoint's generation_config.json.

The checkpoint here is hub-like: Qwen2.5-VL-Instruct's generation_config.json (repetition_penalty 1.05,
temperature 0.1, top_p 0.001, top_k 1, do_sample true). The RL stage scores a rollout with a plain softmax at its
temperature; the log-probabilities of the sampled tokens under the sampler must equal those scores.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from PIL import Image

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.packing import pack
from components._shared.model.vlm import load_vlm
from components.rl import rollout as rollout_module
from components.rl.rollout import RolloutEngine, split_by_sample, token_outputs
from tests.hub_like import write_hub_like


@pytest.fixture(scope="module")
def hub_like(tmp_path_factory):
    model, processor, _ = load_vlm(write_hub_like(tmp_path_factory.mktemp("hub") / "Qwen2.5-VL-tiny-Instruct"))
    assert model.generation_config.repetition_penalty == 1.05  # the checkpoint's settings are really loaded
    return model.eval(), processor


def _records(n: int = 4) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "id": f"r{i}",
            "question": "What color is the circle?",
            "pil": Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)),
        }
        for i in range(n)
    ]


def _sampled_and_scored(model, processor, monkeypatch, n: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per rollout (`n` per record, one generate() call): log-probs of its tokens under the sampler (generate's
    processed scores) and as RL scores them."""
    encoder = ConversationEncoder(processor, model, min_pixels=112 * 112, max_pixels=112 * 112)
    engine = RolloutEngine(encoder, max_new_tokens=12, temperature=0.7, batch_size=4 * n, max_tokens=4096)
    captured = []
    original = model.generate

    def spy(**kwargs):
        out = original(**kwargs, output_scores=True, return_dict_in_generate=True)
        captured.append(torch.stack(out.scores, dim=1).log_softmax(-1))  # (B, steps, V): what was sampled from
        return out.sequences

    monkeypatch.setattr(model, "generate", spy)
    rollouts = engine.sample(model, _records(), samples_per_prompt=n)
    sampled = [
        captured[0][b, torch.arange(len(r.completion_ids)), torch.tensor(r.completion_ids)]
        for b, r in enumerate(rollouts)
    ]
    samples = [r.sample for r in rollouts]
    with torch.no_grad():
        scored = token_outputs(model, pack(samples), engine.temperature, engine.suppressed)["logprobs"]
    return sampled, split_by_sample(scored, samples)


def test_sampled_log_probs_equal_the_scored_ones_on_a_hub_like_checkpoint(hub_like, monkeypatch):
    sampled, scored = _sampled_and_scored(*hub_like, monkeypatch)
    for a, b in zip(sampled, scored, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert hub_like[0].generation_config.repetition_penalty == 1.05  # restored for serving


def test_with_the_checkpoints_sampling_settings_they_would_differ(hub_like, monkeypatch):
    monkeypatch.setattr(rollout_module, "own_generation_config", lambda model: contextlib.nullcontext())
    sampled, scored = _sampled_and_scored(*hub_like, monkeypatch, n=4)
    worst = max(float((a - b).abs().max()) for a, b in zip(sampled, scored, strict=True))
    assert worst > 1e-3  # the repetition penalty leaks in: 10x the tolerance the equality holds to


def test_every_rollout_carries_its_image_preprocessed_as_the_trainer_does(hub_like):
    model, processor = hub_like
    encoder = ConversationEncoder(processor, model, min_pixels=56 * 56, max_pixels=112 * 112)
    engine = RolloutEngine(encoder, max_new_tokens=3, temperature=1.0, batch_size=4, max_tokens=4096)
    records = _records(3)
    rollouts = engine.sample(model, records, samples_per_prompt=2)
    for rollout in rollouts:
        pixels, grid = encoder.prepare_image(rollout.record["pil"])  # what SFT and the scorer feed the model
        assert torch.equal(rollout.sample.pixel_values, pixels) and torch.equal(rollout.sample.image_grid_thw[0], grid)
        assert int((rollout.sample.input_ids == encoder.image_token_id).sum()) == int(grid.prod()) // 4
    text_only = encoder.encode([{"role": "user", "text": "What color?"}], add_generation_prompt=True)
    with pytest.raises(ValueError, match="rl record 'r0': its rollout prompt has 0 image tokens for 0 visual rows"):
        rollout_module._check_prompt_images(records[0], text_only, encoder.merge_unit, encoder.image_token_id)
