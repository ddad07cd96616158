"""Presets: one YAML per environment, one section per stage (see load_preset)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from components._shared.platform.presets import PRESET_TOP_LEVEL

PRESET_DIR = Path(__file__).parent
TOP_LEVEL_KEYS = set(PRESET_TOP_LEVEL)  # + `extends: PRESET`


class Preset(BaseModel):
    """A validated preset: top-level settings plus every stage section with defaults filled in."""

    model_config = ConfigDict(frozen=True)

    name: str
    description: str = ""
    base_model_uri: str = Field(description="Base model: local dir, s3:// prefix or builtin:NAME.")
    experiment: str = "vlm"
    lake_uri: str | None = Field(None, description="Default lake when none is given on the command line.")
    stages: dict[str, dict[str, Any]]
    kubernetes: dict[str, Any] = Field(default_factory=dict, description="Cluster profile (pipelines/k8s.py).")

    @field_validator("experiment")
    @classmethod
    def _visible_experiment(cls, value: str) -> str:
        """The MLflow experiment name every stage logs into: no control or invisible characters (an ESC in it would
        be compiled into the pipeline and colour every listing that prints it), not empty."""
        from components._shared.platform.names import hidden_in_name

        hidden = hidden_in_name(value)
        if hidden or not value.strip():
            raise ValueError(f"experiment {value!r} holds {hidden or 'nothing'}; give a plain name such as 'vlm'.")
        return value

    def cluster_profile(self):
        """The validated cluster profile: this preset's `kubernetes:` section over pipelines/k8s.py's defaults."""
        from pipelines.k8s import load_cluster_profile

        return load_cluster_profile(self.kubernetes)

    def pipeline_args(self) -> dict[str, Any]:
        """Keyword arguments of the pipeline function for this preset (lake_uri excluded)."""
        args: dict[str, Any] = {"base_model_uri": self.base_model_uri, "experiment": self.experiment}
        args.update({f"{stage}_config": cfg for stage, cfg in self.stages.items()})
        return args


def preset_path(name_or_path: str | Path) -> Path:
    """`tiny` -> pipelines/presets/tiny.yaml; a path to a YAML file, or any path with a '/', is used as it is (one
    that is no regular file, such as /dev/zero, is refused as such when read)."""
    path = Path(name_or_path)
    if (path.suffix in (".yaml", ".yml") or "/" in str(name_or_path)) and path.exists():
        return path
    candidate = PRESET_DIR / f"{name_or_path}.yaml"
    if not candidate.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ValueError(f"Unknown preset '{name_or_path}'. Known presets: {', '.join(known)}; or pass a YAML path.")
    return candidate


def as_preset(preset: Preset | str | Path) -> Preset:
    """A preset read once by a command and handed down as it is; a name or path is read here."""
    return preset if isinstance(preset, Preset) else load_preset(preset)


def load_preset(name_or_path: str | Path = "tiny", overrides: dict[str, Any] | None = None) -> Preset:
    """Read and validate a preset; every stage section goes through its config class (errors name the setting)."""
    from components._shared.launch.plan import check_config
    from components._shared.platform.presets import deep_merge, read_preset_yaml, validate
    from components.stages import STAGES, load_config_class
    from pipelines import credentials

    path = preset_path(name_or_path)
    data = deep_merge(read_preset_yaml(path, search=(PRESET_DIR,)), overrides or {})
    credentials.check(data, f"preset {path.name!r}")  # before validation, whose errors would repeat the value
    unknown = set(data) - TOP_LEVEL_KEYS - set(STAGES)
    if unknown:
        raise ValueError(
            f"{path}: unknown section(s) {sorted(unknown)}. Allowed: {sorted(TOP_LEVEL_KEYS | set(STAGES))}."
        )
    # None values are left out (KFP parameters cannot hold null): the config's default, None, applies again.
    stages = {
        stage: validate(load_config_class(stage), stage, data.get(stage) or {}).model_dump(
            mode="json", exclude_none=True
        )
        for stage in STAGES
    }
    top = {k: data[k] for k in TOP_LEVEL_KEYS if k in data}
    if "base_model_uri" not in top:
        raise ValueError(f"{path}: 'base_model_uri' is required (a local dir, s3:// prefix or builtin:NAME).")
    preset = Preset(name=path.stem, stages=stages, **top)
    try:
        cluster = preset.cluster_profile()  # errors name the setting, e.g. kubernetes.stages.sft.gpus
        for stage, profile in cluster.stages.items():
            if profile.gpus * profile.nodes > 1:
                check_config(stage, stages[stage])
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return preset
