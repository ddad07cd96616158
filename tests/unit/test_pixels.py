"""uint8 pixel rows until the model: a quarter of the bytes, and the rows the model reads bit-identical.

Real photographs (scikit-image's) through each family's processor: the encoder's rows are uint8, `model_pixels`
turns them into exactly the processor's float32 rows, and a forward on the packed uint8 batch equals one on the
processor's rows. Processors whose arithmetic PixelNorm does not reproduce keep giving float rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.packing import forward_logits, generation_vision_inputs, pack
from components._shared.model.pixel_norm import PixelNorm, model_pixels
from components._shared.model.vlm import load_vlm

PIXELS = {"min_pixels": 64 * 64, "max_pixels": 320 * 320}
TURNS = [{"role": "user", "text": "<image>\nWhat is in the photo?"}, {"role": "assistant", "text": "a photo"}]


def _photos() -> list[Image.Image]:
    gray = skimage.data.camera()
    return [
        Image.fromarray(skimage.data.astronaut()),
        Image.fromarray(skimage.data.coffee()),
        Image.fromarray(skimage.data.chelsea()),
        Image.fromarray(np.stack([gray] * 3, axis=-1)).resize((333, 187)),
    ]


@pytest.fixture(scope="module", params=["builtin:tiny-qwen2_5-vl", "builtin:tiny-qwen3-vl"])
def model_and_processor(request):
    torch.manual_seed(0)
    model, processor, _ = load_vlm(request.param)
    model.eval()
    return model, processor


def _processor_rows(processor, image: Image.Image) -> torch.Tensor:
    size = {"shortest_edge": PIXELS["min_pixels"], "longest_edge": PIXELS["max_pixels"]}
    return processor.image_processor(images=[image], size=size, return_tensors="pt")["pixel_values"]


def test_rows_are_uint8_and_normalise_to_the_processors_rows_exactly(model_and_processor):
    model, processor = model_and_processor
    encoder = ConversationEncoder(processor, model, **PIXELS)
    assert encoder.pixel_norm == PixelNorm(
        mean=tuple(processor.image_processor.image_mean),
        std=tuple(processor.image_processor.image_std),
        rescale_factor=processor.image_processor.rescale_factor,
    )
    for image in _photos():
        sample = encoder.encode(TURNS, images=[image])
        reference = _processor_rows(processor, image)
        assert sample.pixel_values.dtype == torch.uint8 and sample.pixel_norm is encoder.pixel_norm
        assert sample.pixel_values.nbytes * 4 == reference.nbytes
        assert torch.equal(model_pixels(sample.pixel_values, sample.pixel_norm), reference)


def test_a_forward_on_uint8_rows_equals_one_on_the_processors_rows(model_and_processor):
    model, processor = model_and_processor
    encoder = ConversationEncoder(processor, model, **PIXELS)
    photos = _photos()
    samples = [encoder.encode(TURNS, images=[image], sample_id=f"p{i}") for i, image in enumerate(photos)]
    batch = pack(samples)
    assert batch["pixel_values"].dtype == torch.uint8 and batch["pixel_norm"] is encoder.pixel_norm
    float_batch = {**batch, "pixel_values": torch.cat([_processor_rows(processor, p) for p in photos])}
    del float_batch["pixel_norm"]
    with torch.no_grad():
        assert torch.equal(forward_logits(model, batch), forward_logits(model, float_batch))
    vision = generation_vision_inputs(samples, torch.device("cpu"))
    assert torch.equal(vision["pixel_values"], float_batch["pixel_values"])
    assert torch.equal(vision["image_grid_thw"], batch["image_grid_thw"])


def test_processors_that_pixelnorm_does_not_reproduce_keep_float_rows(model_and_processor):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model, processor = model_and_processor
    torchvision_processor = processor.image_processor
    image = _photos()[1]
    try:
        processor.image_processor = Qwen2VLImageProcessorPil(**torchvision_processor.to_dict())
        pil_encoder = ConversationEncoder(processor, model, **PIXELS)
        torchvision_processor.do_normalize = False
        processor.image_processor = torchvision_processor
        unnormalised_encoder = ConversationEncoder(processor, model, **PIXELS)
    finally:
        torchvision_processor.do_normalize = True
        processor.image_processor = torchvision_processor
    assert pil_encoder.pixel_norm is None and unnormalised_encoder.pixel_norm is None
    sample = pil_encoder.encode(TURNS, images=[image])
    assert sample.pixel_values.dtype == torch.float32 and sample.pixel_norm is None
    assert model_pixels(sample.pixel_values, None) is sample.pixel_values  # used as given


def test_uint8_rows_need_their_norm_and_mixed_processors_do_not_pack(model_and_processor):
    model, processor = model_and_processor
    encoder = ConversationEncoder(processor, model, **PIXELS)
    sample = encoder.encode(TURNS, images=[_photos()[2]])
    with pytest.raises(ValueError, match="uint8 pixel rows without their PixelNorm"):
        model_pixels(sample.pixel_values, None)
    other = encoder.encode(TURNS, images=[_photos()[0]])
    other.pixel_norm = PixelNorm(mean=(0.1, 0.2, 0.3), std=(0.5, 0.5, 0.5), rescale_factor=1 / 255)
    with pytest.raises(ValueError, match="mixes pixel rows of different image processors"):
        pack([sample, other])


def test_normalising_float_rows_leaves_the_callers_rows_alone():
    norm = PixelNorm(mean=(0.5, 0.25, 0.75), std=(0.5, 0.5, 0.25), rescale_factor=1 / 255)
    rows = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 24)
    before = rows.clone()
    out = norm(rows)
    assert torch.equal(rows, before)
    channel_of_column = torch.arange(24) // 8
    mean = torch.tensor(norm.mean)[channel_of_column] * 255
    std = torch.tensor(norm.std)[channel_of_column] * 255
    torch.testing.assert_close(out, (before - mean) / std, rtol=1e-6, atol=1e-6)
    assert torch.equal(norm(rows, inplace=True), out) and torch.equal(rows, out)  # asked to: written in place
    with pytest.raises(ValueError, match="do not split into 3 channels"):
        norm(torch.zeros(2, 10, dtype=torch.uint8))
