"""Config of the preflight checks. Imports pydantic only."""

from typing import Annotated

from pydantic import Field

from components._shared.platform.config import StageConfig


class PreflightConfig(StageConfig):
    """Which checks run before the DAG asks for GPUs."""

    check_lake: bool = Field(True, description="List the lake and require at least one shard.")
    check_tracking: bool = Field(True, description="Reach the MLflow tracking server (HTTP URIs only).")
    resolve_models: bool = Field(
        True,
        description=(
            "Check every model URI: s3:// models where they lie (marker, sizes, config.json, safetensors headers; "
            "weights not downloaded), local and builtin ones resolved as the stages resolve them."
        ),
    )
    timeout_s: Annotated[float, Field(gt=0, le=600, description="Network timeout per check, seconds.")] = 20.0
    records_download_mb: Annotated[
        float,
        Field(
            ge=0,
            description=(
                "Read every record of s3:// training data (and its images' headers) here when the prefix holds at "
                "most this many MB; a larger one is left to each stage's own check at its start (counted in "
                "records_unchecked_uris)."
            ),
        ),
    ] = 4096.0
