"""Model URIs -> a validated local Hugging Face directory.

Accepted forms:
    /path/to/dir       a from_pretrained directory (config.json; weights only as *.safetensors)
    s3://bucket/prefix a committed prefix (has _COMMITTED.json), downloaded once into the cache and verified
    builtin:NAME       a builtin tiny model (components/synth_world/builtin_models.py), copied from the package when
                       it ships (synth_world/shipped.py: tiny-clip) or built once into the cache

The cache is `cache_dir` or env QVL_CACHE_DIR or ~/.cache/qvl. Builds and downloads go into a temporary
directory under a file lock and are renamed into place when complete, so several processes may ask at
once and a crash never leaves a half-built model behind.

Import rule exception (docs/architecture.md): `builtin:` imports components.synth_world lazily, here only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
UNSAFE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
REWARD_HEAD_FILE = "reward_head.safetensors"  # beside a reward model's backbone (reward_models.py)


def check_not_reward_model(uri: str, setting: str, *, expected: str = "the SFT stage's model/") -> None:
    """A local reward model (its backbone with the Bradley-Terry head beside it) given where a stage starts its policy
    or model from: it would train from the reward model's backbone with the head ignored. `expected` names what
    belongs there (distill's teacher is rl's model)."""
    path = Path(uri)
    if "://" not in uri and not uri.startswith(BUILTIN_PREFIX) and (path / REWARD_HEAD_FILE).is_file():
        raise ValueError(
            f"{setting} {uri} is a reward model ({REWARD_HEAD_FILE} beside its backbone), not a model to train from; "
            f"give {expected} (or the model the stage should start from)."
        )


LOCK_TIMEOUT_S = 3600  # a demo build takes minutes; waiting longer means the holder is stuck


def default_cache_dir() -> Path:
    """QVL_CACHE_DIR if set, else ~/.cache/qvl."""
    return Path(os.environ.get("QVL_CACHE_DIR") or Path.home() / ".cache" / "qvl")


def resolve_model(uri: str, *, cache_dir: Path | None = None) -> Path:
    """A local, validated HF model directory for `uri` (see the module docstring for the forms)."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"Model URI {uri!r} is empty; {_accepted_forms()}")
    uri = uri.strip()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if uri.startswith(BUILTIN_PREFIX):
        return _resolve_builtin(uri[len(BUILTIN_PREFIX) :], cache)
    if uri.startswith("s3://"):
        return _resolve_s3(uri, cache)
    if "://" in uri or (":" in uri.split("/")[0] and not Path(uri).exists()):
        raise ValueError(f"Unsupported model URI scheme in {uri!r}; {_accepted_forms()}")
    path = Path(uri).expanduser()
    if not path.is_dir():
        raise ValueError(f"Model directory {uri!r} does not exist (or is not a directory); {_accepted_forms()}")
    return validate_model_dir(path)


def validate_model_dir(path: Path) -> Path:
    """Check that `path` is an HF directory whose weights are safetensors only; returns it."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        raise ValueError(
            f"Model directory {path} has no config.json, but {path / 'model'} has: that is a stage's output "
            f"directory, which holds its model in model/; pass {path / 'model'}."
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"Model directory {path} has no config.json; point at a from_pretrained/save_pretrained directory."
        )
    unsafe = sorted(
        p.relative_to(path).as_posix() for p in path.rglob("*") if p.suffix.lower() in UNSAFE_WEIGHT_SUFFIXES
    )
    if unsafe:
        raise ValueError(
            f"Model directory {path} holds pickle-format weights {unsafe}; they can run code when loaded. Convert to "
            "safetensors (model.save_pretrained(dir) in transformers >= 5 writes *.safetensors) and remove those files."
        )
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"Model directory {path} has no *.safetensors weights; save the model with save_pretrained.")
    _check_readable(path)
    return path


def read_json_file(path: Path, kind: str, fix: str, *, shown: str | None = None) -> Any:
    """The JSON in `path`; a ValueError naming it (`shown`, default the path), what it should be and `fix` when it
    is not UTF-8 JSON or is nested past the parser (a traceback otherwise)."""
    where = shown or str(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply to be {kind}; {fix}.") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{where} is not valid JSON ({err}); {fix}.") from None


def _check_readable(path: Path) -> None:
    """config.json is a JSON object and every *.safetensors header parses, with at least one tensor in all: a
    truncated download or a stray file is named here, not as a decoder traceback mid-load."""
    from safetensors import SafetensorError, safe_open

    config = read_json_file(path / "config.json", "a model config", "re-download or re-save the model")
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ValueError(f"{path / 'config.json'} has no model_type; it is not a transformers model config.")
    tensors = 0
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                tensors += len(list(handle.keys()))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is not a readable safetensors file ({err}); re-download or re-save it.") from None
    if tensors == 0:
        raise ValueError(f"Model directory {path} holds no tensors in its *.safetensors files; it has no weights.")


def check_s3_model(uri: str) -> dict:
    """Check a committed s3:// model where it lies, without downloading its weights (preflight: a CPU pod with no
    room for a 7B model). The marker lists config.json and *.safetensors and no pickle-format file; every listed
    object is there with its listed size; config.json matches its sha256 and names a model_type; every
    safetensors header parses (two ranged reads per file) and its tensors fit in the file. Returns the parsed
    config.json under "config" with the file count and bytes. The bytes themselves are verified by each stage's
    download (`resolve_model`)."""
    from components._shared.platform import storage

    prefix = uri.strip().rstrip("/")
    try:
        marker = storage.read_marker(prefix)
    except (storage.IntegrityError, OSError) as error:
        raise ValueError(
            f"Model prefix {uri} has no readable _COMMITTED.json marker ({error}); publish it with "
            "storage.publish_dir so downloads can be verified."
        ) from error
    files = marker["files"]
    unsafe = sorted(name for name in files if Path(name).suffix.lower() in UNSAFE_WEIGHT_SUFFIXES)
    if unsafe:
        raise ValueError(
            f"Model prefix {uri} holds pickle-format weights {unsafe}; they can run code when loaded. Convert to "
            "safetensors (model.save_pretrained(dir) in transformers >= 5) and re-publish."
        )
    weights = sorted(name for name in files if name.endswith(".safetensors") and "/" not in name)
    if "config.json" not in files or not weights:
        raise ValueError(
            f"Model prefix {uri} lists no config.json or no top-level *.safetensors in its _COMMITTED.json; "
            "publish a save_pretrained directory."
        )
    present = storage.list_etags(prefix) if storage.is_s3(prefix) else {}
    for name, expected in sorted(files.items()):
        size = int(present[name].split(":", 1)[0]) if name in present else None
        if size != expected["size"]:
            found = "missing" if size is None else f"{size} bytes"
            raise ValueError(
                f"{prefix}/{name} is listed in _COMMITTED.json with {expected['size']} bytes but is {found}; "
                f"re-publish {uri}."
            )
    raw = storage.read_bytes(f"{prefix}/config.json")
    if hashlib.sha256(raw).hexdigest() != files["config.json"]["sha256"]:
        raise ValueError(f"{prefix}/config.json does not match its sha256 in _COMMITTED.json; re-publish {uri}.")
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{prefix}/config.json is not valid JSON ({err}); re-publish {uri}.") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ValueError(f"{prefix}/config.json has no model_type; it is not a transformers model config.")
    tensors = sum(_safetensors_tensor_count(f"{prefix}/{name}", files[name]["size"]) for name in weights)
    if tensors == 0:
        raise ValueError(f"Model prefix {uri} holds no tensors in its *.safetensors files; it has no weights.")
    return {"config": config, "files": len(files), "bytes": sum(f["size"] for f in files.values())}


MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit on a header


def _data_end(entry) -> int | None:
    """Where a safetensors header entry's bytes end, or None when it has no [begin, end] pair of ints."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(v) is int for v in offsets)):
        return None
    return offsets[1] if 0 <= offsets[0] <= offsets[1] else None


def _safetensors_tensor_count(uri: str, size: int) -> int:
    """Tensors in a safetensors file, read from its header alone (8-byte length + JSON); raises on a header that
    does not parse or tensors that end past the file."""
    from components._shared.platform import storage

    problem = None
    length = int.from_bytes(storage.read_range(uri, 0, 8), "little") if size >= 8 else 0
    if not 0 < length <= min(size - 8, MAX_SAFETENSORS_HEADER):
        problem = f"header length {length} for a {size}-byte file"
    else:
        try:
            header = json.loads(storage.read_range(uri, 8, length))
        except (ValueError, UnicodeDecodeError) as err:
            header, problem = None, f"header is not JSON ({err})"
        if header is not None:
            entries = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
            ends = [end for end in map(_data_end, (entries or {}).values()) if end is not None]
            if entries is None or len(ends) != len(entries):
                problem = "header is not a table of tensors with data_offsets [begin, end]"
            elif ends and max(ends) > size - 8 - length:
                problem = f"tensors end at byte {max(ends)} of a {size - 8 - length}-byte data section"
            else:
                return len(entries)
    raise ValueError(f"{uri} is not a readable safetensors file ({problem}); re-save the model and re-publish it.")


def describe(uri: str, *, cache_dir: Path | None = None) -> dict:
    """What `uri` resolves to: local path, model type, architectures, and builtin.json when present."""
    path = resolve_model(uri, cache_dir=cache_dir)
    config = json.loads((path / "config.json").read_text())
    info = {
        "uri": uri,
        "path": str(path),
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }
    if (path / "builtin.json").is_file():
        info["builtin"] = json.loads((path / "builtin.json").read_text())
    return info


def _resolve_builtin(name: str, cache: Path) -> Path:
    from components.synth_world import builtin_models  # documented exception to "_shared imports no stage"

    if name not in builtin_models.BUILTIN_NAMES:
        raise ValueError(f"Unknown builtin model {name!r}; {_accepted_forms()}")
    target = cache / f"{name}-{builtin_models.recipe_version(name)}"
    return _materialize(target, lambda tmp: builtin_models.provide(name, tmp))


def _resolve_s3(uri: str, cache: Path) -> Path:
    from components._shared.platform import storage

    prefix = uri.rstrip("/")
    try:
        marker = storage.read_bytes(storage.join(prefix, "_COMMITTED.json"))
    except Exception as error:
        raise ValueError(
            f"Model prefix {uri} has no readable _COMMITTED.json marker ({error}); publish it with "
            "storage.publish_dir so downloads can be verified."
        ) from error
    key = hashlib.sha256(prefix.encode() + b"\n" + marker).hexdigest()
    target = cache / "s3" / key
    return _materialize(target, lambda tmp: storage.fetch_dir(prefix, tmp, require_commit=True))


def _materialize(target: Path, produce) -> Path:
    """Return `target` once it is complete; otherwise produce it into a temp dir under a lock and rename it in."""
    from filelock import FileLock

    if target.is_dir():
        return validate_model_dir(target)
    lock = str(target) + ".lock"
    try:  # filelock reads a lock file it cannot create as one held by another process, and waits an hour
        target.parent.mkdir(parents=True, exist_ok=True)
        Path(lock).touch()
    except OSError as error:
        raise OSError(
            f"the model cache {target.parent} cannot be written ({error.strerror or error}); set QVL_CACHE_DIR to a "
            "directory this user can write (the images' user is uid 1000)"
        ) from None
    with FileLock(lock, timeout=LOCK_TIMEOUT_S):
        if target.is_dir():  # another process finished while we waited
            return validate_model_dir(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            produce(tmp)
            validate_model_dir(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _accepted_forms() -> str:
    from components.synth_world.builtin_models import BUILTIN_NAMES

    names = ", ".join(f"builtin:{n}" for n in BUILTIN_NAMES)
    return f"accepted forms: a local model directory, s3://bucket/prefix (a committed prefix), or one of {names}."
