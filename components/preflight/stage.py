"""Preflight checks: fail in seconds, on a CPU pod, what would otherwise fail an hour into a GPU stage.

1 process:  python -m components.preflight --output-dir /tmp/pf --lake-uri DIR --model-uris builtin:tiny-qwen2_5-vl \
                --stage-configs pipelines/presets/tiny.yaml
In the pipeline: components/preflight/component.py (never cached).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from components._shared.platform.tracking import Tracker
from components.preflight.config import PreflightConfig
from components.preflight.fit import check_curriculum, check_fits, check_pretrain_captions, check_selection
from components.preflight.tracking_server import check_tracking_server


def validate_stage_configs(stage_configs: dict[str, dict[str, Any]]) -> int:
    """Validate every stage section; one error lists every invalid setting of every stage."""
    from components._shared.platform.presets import validate
    from components.stages import STAGES, load_config_class

    problems = []
    for stage, data in stage_configs.items():
        if stage not in STAGES:
            problems.append(f"Unknown stage section '{stage}'. Known: {', '.join(STAGES)}.")
            continue
        try:
            validate(load_config_class(stage), stage, data or {})
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("\n".join(problems))
    return len(stage_configs)


def ignored_settings(stage_configs: dict[str, dict[str, Any]]) -> list[str]:
    """Every stage's settings that have no effect in its configuration ("stage.setting: why"), said before any GPU
    is asked for; each stage says its own again when it runs."""
    from components._shared.platform.presets import validate
    from components.stages import STAGES, load_config_class

    return [
        f"{stage}.{note}"
        for stage, data in stage_configs.items()
        if stage in STAGES
        for note in validate(load_config_class(stage), stage, data or {}).ignored_settings()
    ]


def check_visual_budget(stage_configs: dict[str, dict[str, Any]]) -> int:
    """Every stage resizes images within the same [min_pixels, max_pixels]: one visual-token budget for cleaning,
    the feature cache, training, rollouts and evaluation. Returns max_pixels; raises naming the stages that differ."""
    from components._shared.platform.presets import validate
    from components.stages import STAGES, load_config_class

    bounds = {}
    for stage, data in stage_configs.items():
        if stage in STAGES:
            cfg = validate(load_config_class(stage), stage, data or {})
            if hasattr(cfg, "min_pixels") and hasattr(cfg, "max_pixels"):
                bounds[stage] = (cfg.min_pixels, cfg.max_pixels)
    if len(set(bounds.values())) > 1:
        listed = ", ".join(f"{stage}: {low}..{high}" for stage, (low, high) in bounds.items())
        raise ValueError(
            f"the stages resize images differently ({listed}); set min_pixels / max_pixels the same in every "
            "stage, or images get other visual tokens in training than in cleaning, rollouts and evaluation."
        )
    return next(iter(bounds.values()))[1] if bounds else 0


def check_patch_size(model: Path | dict[str, Any], clean_data: dict[str, Any]) -> int:
    """clean_data counts visual tokens on the base model's grid: its patch_size must be the model's ViT patch.
    `model`: the model's directory or its parsed config.json."""
    config = model if isinstance(model, dict) else json.loads((Path(model) / "config.json").read_text())
    patch = (config.get("vision_config") or {}).get("patch_size")
    wanted = clean_data.get("patch_size", 14)
    if patch is not None and patch != wanted:
        raise ValueError(
            f"clean_data.patch_size={wanted} but the base model's ViT patch is {patch} "
            f"({config.get('model_type')}); set clean_data.patch_size: {patch}."
        )
    return int(patch or wanted)


def count_lake_shards(lake_uri: str) -> int:
    """Number of shards (tar/parquet) in the lake; an empty, missing or unreachable lake is an error."""
    from components._shared.data.lake import list_lake_shards

    try:
        return len(list_lake_shards(lake_uri))
    except (OSError, PermissionError) as err:  # unreachable S3, missing credentials: name the lake
        raise ValueError(f"Cannot list the lake at {lake_uri}: {err}") from err


def check_model(uri: str) -> tuple[str, dict[str, Any]]:
    """(where the model is, its config.json) for one model URI. An s3:// model is checked where it lies, weights
    not downloaded (a 7B model would fill this CPU pod's disk on every run; each stage downloads and verifies what
    it loads); local directories and builtin models are resolved as the stages resolve them."""
    from components._shared.model.sources import check_s3_model, resolve_model

    if uri.strip().startswith("s3://"):
        return uri.strip().rstrip("/"), check_s3_model(uri)["config"]
    path = resolve_model(uri)
    return str(path), json.loads((path / "config.json").read_text())


def model_uris_in(stage_configs: dict[str, dict[str, Any]]) -> list[str]:
    """Model URIs named by stage configs (fields `*_model`, `*_model_uri`, `model_uri`, nested too)."""
    uris = []

    def visit(data: dict[str, Any]) -> None:
        for key, value in (data or {}).items():
            if isinstance(value, dict):  # nested blocks, e.g. distill.student.model_uri
                visit(value)
            elif isinstance(value, str) and value and (key.endswith(("_model", "_model_uri")) or key == "model_uri"):
                uris.append(value)

    for data in stage_configs.values():
        visit(data)
    return uris


# The URI parameters each stage reads (besides the artifacts KFP passes it, which KFP hashes itself).
# clean_data's lake is digested per shard by list_shards_op (so only changed shards re-run); its key here covers the
# models its config names.
STAGE_URI_INPUTS: dict[str, tuple[str, ...]] = {
    "clean_data": (),
    "extract_features": ("base_model_uri",),
    "pretrain": ("base_model_uri", "eval_data_uri"),
    "sft": ("sft_data_uri",),
    "reward_model": ("preference_data_uri",),
    "rl": ("rl_data_uri",),
    "distill": ("sft_data_uri",),
    "select_checkpoint": ("eval_data_uri",),
}


def content_keys(uris: dict[str, str], stage_configs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per stage, a digest of what lies behind the URIs it reads: its URI parameters and the model URIs its config
    names (a lake, an s3:// model, a data folder), by content (`checkpoint.content_identity`: an s3:// prefix by its
    objects' sizes and ETags, a local folder by every file's sha256). Handed to the stage's task as an input, it
    puts that content into KFP's cache key: new shards in the same lake, a model re-uploaded under the same prefix,
    re-run the stages that read them instead of serving an old result."""
    import hashlib

    from components._shared.model.checkpoint import content_identity

    identity: dict[str, str] = {}
    keys = {}
    for stage, params in STAGE_URI_INPUTS.items():
        named = [uris.get(param, "") for param in params] + model_uris_in({stage: stage_configs.get(stage) or {}})
        digest = hashlib.sha256()
        for uri in named:
            if uri not in identity:
                identity[uri] = content_identity(uri)
            digest.update(f"{uri}\n{identity[uri]}\n".encode())
        keys[stage] = digest.hexdigest()[:16]
    return keys


def check_data(data_files: dict[str, dict[str, Any]]) -> int:
    """Require the files under each needed data URI ({parameter: {"uri", "roles", "names", "required"}}): those its
    dataset.yaml lists for the roles (validated), else the synthetic world's names; returns how many were found. An
    empty URI that a stage of this DAG needs is an error naming the pipeline parameter; a URI that no stage of this
    DAG reads (`qvl run --until` stops before it) is not looked at."""
    from components._shared.platform import storage

    found = 0
    for parameter, spec in data_files.items():
        uri = spec.get("uri") or ""
        if not uri or not spec.get("required"):
            if spec.get("required"):
                raise ValueError(
                    f"pipeline parameter {parameter} is empty, but a stage of this DAG reads it; pass "
                    f"{parameter}=s3://bucket/prefix (a data directory: docs/data.md)."
                )
            continue
        if spec.get("built_from") and storage.exists(storage.join(uri, "dataset.yaml")):
            raise ValueError(
                f"{parameter} {uri} holds a dataset.yaml; the sft_data step (sft.build_data.enabled) writes the plain "
                "layout and cannot yet rewrite one: give a directory with eval.jsonl, or set build_data.enabled: false."
            )
        for name in required_files(uri, spec.get("roles") or [], spec.get("names") or {}):
            if not storage.exists(storage.join(uri, name)):
                raise ValueError(
                    f"{storage.join(uri, name)} does not exist; the training data at {uri} needs {name} "
                    "(its dataset.yaml, or without one the synthetic world's files: `qvl lake synth --out DIR` "
                    "writes DIR/heldout with eval.jsonl and sft.jsonl)."
                )
            found += 1
    return found


# the stages that read each data parameter: their on_bad_record decides what preflight does with a bad record
DATA_READERS = {
    "eval_data_uri": ["pretrain", "select_checkpoint"],
    "sft_data_uri": ["sft", "distill"],
    "preference_data_uri": ["reward_model"],
    "rl_data_uri": ["rl"],
}


def check_records(
    data_files: dict[str, dict[str, Any]],
    stage_configs: dict[str, dict[str, Any]],
    *,
    download_mb: float = 4096.0,
    scratch: Path | None = None,
    kept: dict[tuple[str, str], list[dict]] | None = None,
) -> dict[str, int]:
    """Read every record of each data directory the DAG uses, as its stages will (fields, images' headers, ids):
    one error lists the bad records of all of them, unless every stage reading that data skips bad records
    (on_bad_record: skip), when they are counted instead. An s3:// prefix is downloaded for it when it holds at
    most `download_mb` MB; a larger one is left to each stage's check at its start (records_unchecked_uris)."""
    import tempfile

    from components._shared.platform import bad_records

    checked, skipped, problems = 0, set(), []
    with tempfile.TemporaryDirectory(prefix="qvl-preflight-", dir=scratch) as downloads:
        local = _local_data(data_files, download_mb, Path(downloads))
        for parameter, spec in data_files.items():
            uri = spec.get("uri") or ""
            directory = local.get(uri)
            if directory is None or not spec.get("required"):
                continue
            readers_of = [(stage_configs.get(s) or {}) for s in DATA_READERS.get(parameter, []) if s in stage_configs]
            skip = bool(readers_of) and all(c.get("on_bad_record") == "skip" for c in readers_of)
            with bad_records.policy("skip" if skip else "fail") as ledger:
                for role in spec.get("roles") or []:
                    try:
                        records = _load_role(role, directory, (spec.get("names") or {}).get(role))
                        checked += len(records)
                        if kept is not None:  # what later checks read (the held-out tasks select_checkpoint scores)
                            kept[parameter, role] = [{k: v for k, v in r.items() if k != "pil"} for r in records]
                    except ValueError as err:
                        problems.append(f"{parameter} ({uri}), {role} records: {err}")
            skipped |= {f"{uri}/{source}" for source in ledger.skipped}  # a file two parameters share: counted once
    if problems:
        raise ValueError("\n".join(problems))
    unchecked = sum(1 for directory in local.values() if directory is None)
    return {"records_checked": checked, "records_to_skip": len(skipped), "records_unchecked_uris": unchecked}


def _local_data(data_files: dict[str, dict[str, Any]], download_mb: float, downloads: Path) -> dict[str, Path | None]:
    """{uri: a local directory of it} for the data URIs: local ones as they are, s3:// ones of at most
    `download_mb` MB downloaded into `downloads`, larger ones None (their stages check them)."""
    from components._shared.data import datasets
    from components._shared.platform import storage

    local: dict[str, Path | None] = {}
    for uri in dict.fromkeys(spec.get("uri") or "" for spec in data_files.values() if spec.get("required")):
        if not uri:
            continue
        if not storage.is_s3(uri):
            local[uri] = Path(uri) if Path(uri).is_dir() else None
            continue
        size_mb = sum(int(v.split(":", 1)[0]) for v in storage.list_etags(uri).values()) / 1e6
        if size_mb > download_mb:
            print(f"preflight: {uri} holds {size_mb:.0f} MB (> records_download_mb); its stages check its records.")
            local[uri] = None
        else:
            local[uri] = datasets.resolve_data_dir(uri, scratch=downloads / str(len(local)))
    return local


def _load_role(role: str, directory: Path, names: list[str] | None) -> list[dict]:
    """The records a stage reads for `role` ('sft', 'eval', 'rl', 'preferences'), checked as it checks them."""
    from components._shared.data import datasets

    if role == "sft":
        return datasets.load_conversations(directory, file_name=names[0] if names else None)
    if role == "preferences":
        return datasets.load_preferences(directory)
    return datasets.load_questions(directory, names, role=role)


def required_files(uri: str, roles: list[str], names: dict[str, list[str]]) -> list[str]:
    """The files the roles read from the data at `uri`: dataset.yaml's (and the manifest itself), else the defaults."""
    from components._shared.data import datasets
    from components._shared.platform import storage

    manifest_uri = storage.join(uri, datasets.MANIFEST)
    if storage.exists(manifest_uri):
        manifest = datasets.parse_manifest(storage.read_bytes(manifest_uri).decode("utf-8"), manifest_uri)
        prefix = [datasets.MANIFEST]
    else:
        manifest, prefix = datasets.Manifest(), []
    files = [f for role in roles for f in manifest.files(role, names.get(role))]
    paths = [f.path for f in files] + [f.annotations for f in files if f.annotations]
    return list(dict.fromkeys(prefix + paths))


DATA_ROLES = {
    "eval_data_uri": ["eval"],
    "sft_data_uri": ["sft", "eval"],  # sft and distill
    "preference_data_uri": ["preferences"],
    "rl_data_uri": ["rl", "eval"],
}


def data_requirements(
    data: dict[str, tuple[str, bool]], rl_config: dict, sft_config: dict | None = None
) -> dict[str, dict]:
    """{parameter: {"uri", "roles", "names", "required"}} for the data URIs: `data` maps each parameter to (URI,
    whether this DAG runs a stage that needs it); the roles each serves and the rl stage's file settings. SFT data
    built by the DAG's sft_data step (sft.build_data.enabled) needs only the held-out questions of sft_data_uri,
    unless build_data.include_given trains on its conversations too."""
    build = (sft_config or {}).get("build_data") or {}
    built = build.get("enabled") is True
    return {
        name: {
            "uri": uri,
            "roles": ["eval"]
            if name == "sft_data_uri" and built and not build.get("include_given")
            else DATA_ROLES[name],
            "built_from": name == "sft_data_uri" and built,
            "names": rl_data_files(rl_config) if name == "rl_data_uri" else {},
            "required": required,
        }
        for name, (uri, required) in data.items()
    }


def sft_records(sft_config: dict[str, Any], given: list[dict] | None) -> list[dict] | None:
    """What sft will train on, for its curriculum check (None: not known before it runs): the given conversations,
    or with the sft_data step on one stand-in per difficulty the builder's templates make (and the given ones with
    include_given)."""
    from components.stages import is_enabled, load_config_class

    if not is_enabled("sft_data", {"sft": sft_config}):
        return given
    build = load_config_class("sft").model_validate(sft_config).build_data
    if build.include_given and given is None:
        return None
    return (given or [] if build.include_given else []) + [{"difficulty": d} for d in sorted(build.difficulties())]


def rl_data_files(rl_config: dict[str, Any]) -> dict[str, list[str]]:
    """The rl stage's own file settings by role (prompts_file, eval.files); unset ones follow dataset.yaml."""
    out = {}
    if rl_config.get("prompts_file"):
        out["rl"] = [rl_config["prompts_file"]]
    if (rl_config.get("eval") or {}).get("files"):
        out["eval"] = list(rl_config["eval"]["files"])
    return out


def run(
    cfg: PreflightConfig,
    *,
    lake_uri: str,
    model_uris: list[str],
    stage_configs: dict[str, dict[str, Any]],
    output_dir: Path,
    tracker: Tracker,
    data_files: dict[str, dict[str, Any]] | None = None,
    uris: dict[str, str] | None = None,
    gpu_profiles: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Validate configs, then reach the lake, the data, the tracking server and the models; raise on the first
    failure. Writes preflight.json with the metrics, where the models resolved to and each stage's content key
    (`content_keys` of `uris`: the pipeline's URI parameters by name)."""
    metrics: dict[str, Any] = {"configs_validated": validate_stage_configs(stage_configs)}
    ignored = ignored_settings(stage_configs)
    for note in ignored:
        print(f"warning: setting without effect: {note}", file=sys.stderr, flush=True)
    metrics["max_pixels"] = check_visual_budget(stage_configs)
    if cfg.check_lake:
        metrics["lake_shards"] = count_lake_shards(lake_uri)
        region = (stage_configs.get("pretrain") or {}).get("region") or {}
        if region.get("enabled"):
            from components.preflight.lake_regions import check_lake_regions

            metrics["lake_region_boxes_sampled"] = check_lake_regions(lake_uri, float(region.get("min_score", 0.0)))
    records: dict[tuple[str, str], list[dict]] = {}
    if data_files:
        metrics["data_files"] = check_data(data_files)
        metrics.update(
            check_records(
                data_files, stage_configs, download_mb=cfg.records_download_mb, scratch=output_dir, kept=records
            )
        )
        # only for the stages this DAG runs (`qvl run --until` stops before some): their data is "required"
        runs = {name for name, need in data_files.items() if need.get("required")}
        if "select_checkpoint" in stage_configs and "eval_data_uri" in runs and ("eval_data_uri", "eval") in records:
            check_selection(
                stage_configs["select_checkpoint"],
                records["eval_data_uri", "eval"],
                reward_model="reward_model" in stage_configs,
            )
        trained = sft_records(stage_configs.get("sft") or {}, records.get(("sft_data_uri", "sft")))
        if "sft" in stage_configs and "sft_data_uri" in runs and trained is not None:
            check_curriculum(stage_configs["sft"], trained)
        if "pretrain" in stage_configs and "eval_data_uri" in runs and ("eval_data_uri", "eval") in records:
            metrics["heldout_captions"] = check_pretrain_captions(records["eval_data_uri", "eval"])
    if cfg.check_tracking:
        metrics["tracking"] = check_tracking_server(cfg.timeout_s)
    resolved: dict[str, str] = {}
    if cfg.resolve_models:
        configs = {}
        for uri in dict.fromkeys(u for u in model_uris if u):
            resolved[uri], configs[uri] = check_model(uri)
        metrics["models_resolved"] = len(resolved)
        if model_uris and model_uris[0] and "clean_data" in stage_configs:  # the first URI is the base model
            metrics["patch_size"] = check_patch_size(configs[model_uris[0]], stage_configs["clean_data"] or {})
        if gpu_profiles and model_uris and model_uris[0]:  # the planner: every training stage fits its pod's GPUs
            metrics["stages_planned"] = check_fits(stage_configs, gpu_profiles, configs[model_uris[0]], configs)
    keys = content_keys(uris or {}, stage_configs)
    (output_dir / "preflight.json").write_text(
        json.dumps(
            {"metrics": metrics, "models": resolved, "content_keys": keys, "ignored_settings": ignored}, indent=2
        )
    )
    return metrics


def main(argv: list[str] | None = None) -> None:
    import argparse

    import yaml

    from components._shared.launch.cli import stage_main

    # model_uris and stage_configs arrive as text on the command line: parse them before the generic runner.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model-uris", default="")
    pre.add_argument("--stage-configs", default=None)
    known, rest = pre.parse_known_args(argv)
    from components.stages import DAG_ORDER

    preset = yaml.safe_load(Path(known.stage_configs).read_text()) if known.stage_configs else {}
    stage_configs = {k: (preset or {}).get(k) or {} for k in DAG_ORDER if k in (preset or {})}

    def _run(cfg, *, lake_uri, output_dir, tracker):
        return run(
            cfg,
            lake_uri=lake_uri,
            model_uris=[u for u in known.model_uris.split(",") if u] + model_uris_in(stage_configs),
            stage_configs=stage_configs,
            output_dir=output_dir,
            tracker=tracker,
        )

    stage_main(PreflightConfig, _run, section="preflight", inputs=("lake_uri",), argv=rest)
