"""Config of the clean_data stage. Imports pydantic only, so pipelines/ can import it at compile time.

Filters run cheapest first; each has its thresholds and, where it costs a model, an enable flag.
The model levels follow the five-level cleaning of docs/references.md: CLIP score, NSFW, OCR-vs-caption,
embedding-cluster outliers, and a self-judge that drops the worst fraction by the judge VLM's caption loss.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from components._shared.platform.config import StageConfig

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")


class CleanDataConfig(StageConfig):
    """Drop bad image-caption pairs from a lake and account for every record."""

    # Decoding and size.
    max_image_pixels: Annotated[
        int, Field(ge=1, description="Pillow pixel limit; bigger declared sizes are 'decompression_bomb'.")
    ] = 89_478_485
    max_file_bytes: Annotated[
        int, Field(ge=1, description="Largest image or caption member read into memory ('file_too_large').")
    ] = 64 * 1024 * 1024
    allowed_formats: Annotated[
        list[str],
        Field(
            min_length=1,
            default_factory=lambda: list(ALLOWED_FORMATS),
            description="Image formats decoded; others are 'unsupported_format'.",
        ),
    ]
    min_side: Annotated[int, Field(ge=1, description="Shorter image side below this is 'too_small' (pixels).")] = 32
    max_side: Annotated[int, Field(ge=1, description="Longer image side above this is 'too_large' (pixels).")] = 12_000
    max_aspect_ratio: Annotated[
        float,
        Field(
            ge=1.0, le=200.0, description="long/short side above this is 'extreme_aspect'; Qwen2.5-VL refuses > 200."
        ),
    ] = 4.0

    # Captions.
    max_caption_chars: Annotated[int, Field(ge=1, description="Longer captions are 'caption_too_long'.")] = 2000
    garbage_caption_enabled: bool = Field(
        True, description="Reject camera file names, hex, URL-only, repeated or letter-poor captions."
    )
    min_caption_words: Annotated[
        int, Field(ge=1, description="Fewer real words (2+ letters, a vowel) is 'garbage_caption'.")
    ] = 2
    min_letter_ratio: Annotated[
        float,
        Field(
            ge=0.0, le=1.0, description="Share of letters among non-space characters below this is 'garbage_caption'."
        ),
    ] = 0.5
    max_repeated_chars: Annotated[
        int, Field(ge=2, description="A run of the same character longer than this is 'garbage_caption'.")
    ] = 5

    # Dedup.
    near_dedup_enabled: bool = Field(
        True, description="Reject images whose pHash is within near_dedup_max_distance of a kept one."
    )
    near_dedup_max_distance: Annotated[
        int, Field(ge=0, le=16, description="pHash Hamming distance (of 64 bits) that counts as a near duplicate.")
    ] = 6
    near_dedup_max_thumb_diff: float | None = Field(
        4.0,
        ge=0.0,
        le=255.0,
        description="A pHash match must also have 16x16 RGB thumbnails within this mean abs difference (0-255); "
        "pHash ignores colour, so simple images of different colours collide. None trusts pHash alone.",
    )

    # Target processor (visual_tokens column).
    patch_size: Literal[14, 16] = Field(
        14,
        description="ViT patch of the target model: 14 for Qwen2-VL / Qwen2.5-VL, 16 for Qwen3-VL / Qwen3.5 (images "
        "resize to multiples of 2x this); preflight checks it against the base model.",
    )
    min_pixels: Annotated[int, Field(ge=28 * 28, description="min_pixels of the target processor.")] = 4 * 28 * 28
    max_pixels: Annotated[int, Field(ge=28 * 28, description="max_pixels of the target processor.")] = 1280 * 28 * 28

    # Level 1: CLIP image-text agreement.
    clip_enabled: bool = Field(
        True, description="Score every pair with CLIP; below clip_min_score is 'low_clip_score'."
    )
    clip_model: str = Field(
        "builtin:tiny-clip", min_length=1, description="CLIP model dir, s3:// prefix or builtin:NAME."
    )
    clip_min_score: Annotated[
        float,
        Field(ge=-1.0, le=1.0, description="Cosine similarity threshold (0.25 is the usual value for OpenAI CLIP)."),
    ] = 0.25
    clip_threshold_from_model: bool = Field(
        False,
        description="Use the model's builtin.json recommended_threshold instead of clip_min_score (builtin models are "
        "calibrated on their world).",
    )
    clip_batch_size: Annotated[int, Field(ge=1, le=4096, description="Pairs per CLIP forward pass.")] = 64

    # Level 2: NSFW.
    nsfw_enabled: bool = Field(
        True, description="Run nudenet's detector; max exposed-class score above nsfw_threshold is 'nsfw'."
    )
    nsfw_threshold: Annotated[
        float, Field(gt=0.0, le=1.0, description="Detector score above which an exposed class counts.")
    ] = 0.6

    # Level 3: OCR text the caption never mentions.
    ocr_enabled: bool = Field(True, description="Detect text on every image, read it where boxes are found.")
    ocr_min_confidence: Annotated[
        float, Field(ge=0.0, le=1.0, description="Recognised words below this confidence are ignored.")
    ] = 0.8
    ocr_min_word_chars: Annotated[int, Field(ge=1, description="Shorter OCR words are ignored (noise).")] = 3
    ocr_max_unmentioned_words: Annotated[
        int, Field(ge=0, description="More confident OCR words missing from the caption is 'ocr_caption_mismatch'.")
    ] = 0
    ocr_detect_side: Annotated[
        int,
        Field(ge=32, le=2048, description="Longer side the text detector shrinks big images to (smaller is faster)."),
    ] = 640
    ocr_min_box_aspect: Annotated[
        float,
        Field(
            ge=0.0,
            description="Detected boxes narrower than this (width/height) are not read: a 3+ letter word is "
            "wider; 0 reads every box.",
        ),
    ] = 1.2
    onnx_threads: Annotated[
        int,
        Field(ge=0, le=256, description="Threads per ONNX model (OCR, NSFW); 0 = onnxruntime's default (all cores)."),
    ] = 0
    torch_threads: Annotated[
        int,
        Field(
            ge=0,
            le=256,
            description="torch intra-op threads for a shard's CLIP scoring; 0 = torch's default (all cores). "
            "Set it (and onnx_threads) to cores / shards running at once, or they oversubscribe the CPU.",
        ),
    ] = 0

    # Level 4: embedding-cluster outliers (global, in merge).
    outlier_enabled: bool = Field(
        True, description="Reject kept images far from their nearest neighbours in CLIP image space."
    )
    outlier_k: Annotated[int, Field(ge=1, le=256, description="Neighbours averaged for the outlier distance.")] = 10
    outlier_mad_z: Annotated[
        float,
        Field(gt=0.0, description="Threshold = median + z * 1.4826 * MAD of kNN distances (conservative by default)."),
    ] = 8.0
    outlier_reference_size: Annotated[
        int,
        Field(
            ge=16, description="Neighbours are searched in a random reference sample of this size (bounds the cost)."
        ),
    ] = 20_000
    outlier_min_records: Annotated[
        int, Field(ge=2, description="Below this many kept records the outlier level is skipped.")
    ] = 100

    # Level 5: self-judge (optional).
    judge_model: str | None = Field(
        None, description="Image-text-to-text model (dir, s3:// or builtin:NAME); None skips the self-judge."
    )
    judge_drop_fraction: Annotated[
        float, Field(ge=0.0, lt=1.0, description="Worst fraction by judge caption loss dropped as 'self_judge'.")
    ] = 0.1
    judge_batch_size: Annotated[int, Field(ge=1, le=512, description="Pairs per judge forward pass.")] = 8
    judge_prompt: str = Field(
        "Describe the image.", min_length=1, description="User turn before the caption in the judge's chat template."
    )

    # Output.
    output_shard_records: Annotated[int, Field(ge=1, description="Rows per final kept/rejected Parquet part.")] = 10_000
    score_samples: Annotated[
        int, Field(ge=0, description="Score values per filter kept in shard_report.json for histograms.")
    ] = 2000

    @field_validator("allowed_formats")
    @classmethod
    def _known_formats(cls, value: list[str]) -> list[str]:
        upper = [v.upper() for v in value]
        unknown = sorted(set(upper) - set(ALLOWED_FORMATS))
        if unknown:
            raise ValueError(
                f"allowed_formats has {unknown}; choose from {list(ALLOWED_FORMATS)} (other formats are never decoded)."
            )
        return upper

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels={self.min_pixels} > max_pixels={self.max_pixels}; lower min_pixels or raise max_pixels."
            )
        if self.min_side > self.max_side:
            raise ValueError(
                f"min_side={self.min_side} > max_side={self.max_side}; every image would be rejected, fix one of them."
            )
        return self
