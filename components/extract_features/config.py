"""Config of the extract_features stage. Imports pydantic only, so pipelines/ compiles without torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from components._shared.platform.config import StageConfig

DecodeBackend = Literal["auto", "dali", "torchvision", "pil"]
FeatureDtype = Literal["bfloat16", "float16", "float32"]


class ExtractFeaturesConfig(StageConfig):
    """Decode, smart_resize and run the frozen vision tower (up to the merger) over every kept image."""

    decode_backend: DecodeBackend = Field(
        "auto",
        description="auto = DALI (nvJPEG) when DALI imports and the model is on CUDA, else torchvision.",
    )
    min_pixels: Annotated[int, Field(ge=28 * 28, description="smart_resize lower bound; must equal clean_data's.")] = (
        56 * 56
    )
    max_pixels: Annotated[int, Field(ge=28 * 28, description="smart_resize upper bound; must equal clean_data's.")] = (
        1280 * 28 * 28
    )
    batch_size: Annotated[int, Field(ge=1, le=4096, description="Images per vision-tower forward pass.")] = 16
    images_per_shard: Annotated[int, Field(ge=1, description="Images per features-NNNNN.safetensors file.")] = 128
    dtype: FeatureDtype = Field("bfloat16", description="Dtype of the vision tower and of the stored features.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    decode_workers: Annotated[int, Field(ge=0, le=256, description="CPU decode threads; 0 decodes inline.")] = 4

    @model_validator(mode="after")
    def _pixel_bounds_ordered(self):
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels={self.min_pixels} is larger than max_pixels={self.max_pixels}; "
                "lower min_pixels or raise max_pixels (use clean_data's values)."
            )
        return self
