"""What the stage docs name exists: every dotted setting a docs/stages/<stage>.md names in backticks whose first part
is a field of that stage's config (`ppo.kl_stop`, `train.eval_every`) is a setting of the config, so a renamed or
removed setting cannot stay documented."""

import re

import pytest
from pydantic import BaseModel

from components.stages import STAGES, load_config_class
from tests.codebase import ROOT

SETTING = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:: [^`]*)?`")
FILES = ("json", "jsonl", "py", "md", "yaml", "safetensors", "parquet", "png", "tar", "db", "html", "pt")
DOCUMENTED = sorted(stage for stage in STAGES if (ROOT / "docs" / "stages" / f"{stage}.md").is_file())


def _resolves(config: type[BaseModel], path: list[str]) -> bool:
    field = config.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _resolves(annotation, path[1:])
    return getattr(annotation, "__origin__", None) is dict  # a dict setting: its keys are the user's


@pytest.mark.parametrize("stage", DOCUMENTED)
def test_every_setting_a_stage_doc_names_is_a_setting(stage):
    config = load_config_class(stage)
    text = (ROOT / "docs" / "stages" / f"{stage}.md").read_text()
    named = {m.group(1) for m in SETTING.finditer(text) if m.group(1).rsplit(".", 1)[1] not in FILES}
    ours = {name for name in named if name.split(".")[0] in config.model_fields}
    missing = sorted(name for name in ours if not _resolves(config, name.split(".")))
    assert missing == [], f"docs/stages/{stage}.md names settings {stage} does not have"
