"""The synthetic SFT workload of bench/gpu/sft_mfu.py: Qwen2.5-VL-7B's config, samples, packed steps, model FLOPs.

Samples are built without a tokenizer (`encoder.Sample`): random text ids below the special tokens,
<|vision_start|> + image pads + <|vision_end|>, labels on the answer only, M-RoPE positions from the model's own
`get_rope_index`, uint8 pixel rows of a random image size (normalised on the device by `PIXEL_NORM`, as the stages'
encoder rows are); `step_groups` packs them first-fit-decreasing (`plan_micro_batches`) into one row per optimizer
step, fullest first. Shapes per `Profile`: FULL for the 7B run (224..896 px sides, answers of one word to ~500
tokens), TINY for the CPU smoke run.

Model FLOPs per step (PaLM convention: attention counted non-causal, recomputation by --grad-ckpt not counted):

    6 * P_lm * T                                   LM matmuls; P_lm = LM parameters without the input embedding
                                                   (lm_head included); T = tokens in the packed row (text + visual)
  + 12 * L * d * sum_i n_i^2                       LM attention; L layers, d = hidden, n_i = length of sample i
                                                   (= "12 * layers * hidden * seq_len_per_sample * tokens")
  + k * ((P_vit - P_merger) * p + P_merger * p/4)  ViT matmuls over p patches; the merger runs on p/4 merged rows
  + (2k) * d_vit * (F * sum_img p_img^2 + W * sum_win p_win^2)
                                                   ViT attention: F full-attention blocks over each image's
                                                   patches, W windowed blocks over each window's patches

with k = 6 when the ViT trains, 2 with --freeze-vision (forward only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from components._shared.model.encoder import IGNORE_INDEX, Sample
from components._shared.model.packing import plan_micro_batches
from components._shared.model.pixel_norm import PixelNorm
from components._shared.model.vlm import qwen_model

# The synthetic rows are uint8 like the stages' (components/_shared/model/pixel_norm.py), normalised on the device.
PIXEL_NORM = PixelNorm(
    mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711), rescale_factor=1 / 255
)


@dataclass(frozen=True)
class Profile:
    """Synthetic sample shapes: image sides in patches (even), text lengths in tokens."""

    side_patches: tuple[int, int]
    prompt_tokens: tuple[int, int]
    answer_short: tuple[int, int]
    answer_medium: tuple[int, int]
    answer_long: tuple[int, int]
    budget: int


# 7B: 224..896 px sides (64..1024 visual tokens), answers from one word to ~500 tokens.
FULL = Profile((16, 64), (8, 64), (1, 8), (16, 96), (128, 512), 4096)
TINY = Profile((4, 16), (4, 24), (1, 4), (8, 32), (48, 128), 1024)


def config_7b():
    """Qwen2_5_VLConfig with the sizes of Qwen2.5-VL-7B-Instruct."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "pad_token_id": 151643,
        },
        vision_config={
            "depth": 32,
            "hidden_size": 1280,
            "num_heads": 16,
            "intermediate_size": 3420,
            "out_hidden_size": 3584,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "window_size": 112,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
            "in_channels": 3,
            "hidden_act": "silu",
        },
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
    )


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def synthetic_sample(model, rng: np.random.Generator, profile: Profile, index: int) -> Sample:
    """One user turn (prompt, image, question) and an answer (labelled), as token ids; random pixels."""
    config = qwen_model(model).config
    text = config.text_config
    specials = [
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
        text.eos_token_id,
        text.pad_token_id,
        text.bos_token_id,
    ]
    low_special = min(int(t) for t in specials if t is not None)
    vision = config.vision_config
    merge = vision.spatial_merge_size
    h, w = (merge * (_uniform(rng, profile.side_patches) // merge) for _ in range(2))
    grid = torch.tensor([[1, h, w]], dtype=torch.int64)
    n_visual = h * w // merge**2
    kind = rng.choice(3, p=[0.5, 0.3, 0.2])
    answer = _uniform(rng, (profile.answer_short, profile.answer_medium, profile.answer_long)[kind])

    def words(n: int) -> list[int]:
        return rng.integers(0, low_special, n).tolist()

    prompt, question = words(_uniform(rng, profile.prompt_tokens)), words(_uniform(rng, profile.prompt_tokens))
    ids = prompt + [config.vision_start_token_id] + [config.image_token_id] * n_visual
    ids += [config.vision_end_token_id] + question
    labels = [IGNORE_INDEX] * len(ids) + (reply := words(answer) + [text.eos_token_id])
    ids += reply
    input_ids = torch.tensor(ids, dtype=torch.int64)
    token_types = (input_ids == config.image_token_id).to(torch.int32)
    positions, _ = qwen_model(model).get_rope_index(input_ids[None], token_types[None], image_grid_thw=grid)
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    # uint8 like the encoder's rows, from their own stream: the shapes drawn above stay those of earlier runs
    pixels = torch.from_numpy(np.random.default_rng([index, 256]).integers(0, 256, (h * w, patch_dim), dtype=np.uint8))
    return Sample(
        input_ids=input_ids,
        labels=torch.tensor(labels, dtype=torch.int64),
        position_ids=positions[:, 0],
        image_grid_thw=grid,
        pixel_values=pixels,
        pixel_norm=PIXEL_NORM,
        sample_id=f"syn{index}",
    )


def step_groups(model, profile: Profile, budget: int, steps: int, seed: int) -> list[list[Sample]]:
    """The samples of `steps` packed micro-batches, fullest first: FFD over a sample pool grown until `steps` bins
    are >= 90% full."""
    rng = np.random.default_rng([seed, 31])
    samples: list[Sample] = []
    while True:
        samples += [synthetic_sample(model, rng, profile, len(samples) + i) for i in range(16)]
        groups = plan_micro_batches([s.num_tokens for s in samples], budget)
        groups.sort(key=lambda g: -sum(samples[i].num_tokens for i in g))
        full = [g for g in groups if sum(samples[i].num_tokens for i in g) >= 0.9 * budget]
        if len(full) >= steps or (len(groups) >= steps and len(samples) > 64 * steps):
            return [[samples[i] for i in g] for g in groups[:steps]]


def flops_per_step(model, samples: list[Sample], *, vision_trains: bool) -> dict[str, float]:
    """Model FLOPs of one optimizer step on the packed `samples` (formula in the module docstring)."""
    from transformers.vision_utils import get_vision_window_index

    qwen = qwen_model(model)
    text, vision = qwen.config.text_config, qwen.config.vision_config
    lm_params = sum(p.numel() for p in qwen.language_model.parameters())
    lm_params -= qwen.language_model.get_input_embeddings().weight.numel()
    lm_params += sum(p.numel() for p in model.lm_head.parameters())
    vit_params = sum(p.numel() for p in qwen.visual.parameters())
    merger_params = sum(p.numel() for p in qwen.visual.merger.parameters())
    tokens = sum(s.num_tokens for s in samples)
    grids = torch.cat([s.image_grid_thw for s in samples])
    per_image = grids.prod(-1)
    patches = int(per_image.sum())
    _, cu_windows = get_vision_window_index(
        grids,
        spatial_merge_size=vision.spatial_merge_size,
        window_size=vision.window_size,
        patch_size=vision.patch_size,
    )
    windows = torch.diff(cu_windows.to(torch.int64))
    full_blocks = len(vision.fullatt_block_indexes)
    k = 6 if vision_trains else 2
    parts = {
        "lm_matmul": 6.0 * lm_params * tokens,
        "lm_attention": 12.0 * text.num_hidden_layers * text.hidden_size * sum(s.num_tokens**2 for s in samples),
        "vit_matmul": float(k * ((vit_params - merger_params) * patches + merger_params * patches / 4)),
        "vit_attention": 2.0
        * k
        * vision.hidden_size
        * (
            full_blocks * float((per_image.double() ** 2).sum())
            + (vision.depth - full_blocks) * float((windows.double() ** 2).sum())
        ),
    }
    parts["total"] = sum(parts.values())
    parts.update(lm_params=float(lm_params), vit_params=float(vit_params), tokens=float(tokens), patches=float(patches))
    return parts
