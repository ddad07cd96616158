"""clean_data records per CPU-second against Data-Juicer's model-free ops, on the same synthetic lake.

    python bench/clean_throughput.py [--records 2000] [--repeats 1] [--dj-python /tmp/dj-venv/bin/python]

The lake comes from `components.synth_world.lake.write_world` (img2dataset tars with labelled defects).
Each side runs in its own child process on one thread (OMP/MKL/OpenBLAS = 1, torch.set_num_threads(1)
if torch is loaded): an untimed warm-up run on a small second lake (imports, lazy loads), then the timed
run(s). "CPU s" is user+system time (`getrusage` of the process and its children) of the fastest timed
run; the ratio is records per CPU-second against the faster Data-Juicer row. Whole-process CPU (start,
imports, warm-up) is printed below the table.

Ours: `components.clean_data.stage.run` with every model level off (CLIP, NSFW, OCR, outliers, judge).
It reads the tars itself and runs member safety/size checks, caption length and garbage checks (word
count, letter ratio, repeated characters), a safe full decode of every image, the size/aspect filter,
exact dedup (sha256) and near dedup (pHash Hamming <= 6 plus a colour-thumbnail check), per shard and
again across shards, then writes Parquet parts, manifest.json and report.md.

Data-Juicer (1.6.x in its own venv: `pip install py-data-juicer==1.6.1 imagededup`) gets the same lake
converted (untimed) to a jsonl of {key, text, images: [file]} plus extracted image files, and runs its
DefaultExecutor with np=1, the HF cache off, skip_op_error on and the ops of `dj_process`. Two rows:
  raw lake    every sample; image_shape_filter runs with batch_size 1 so an undecodable image drops only
              its own sample (its decode check; Data-Juicer sets LOAD_TRUNCATED_IMAGES, so truncated
              images pass).
  decodable   only samples whose image Pillow fully decodes (checked during conversion), default batch
              sizes: Data-Juicer's best case, with no decode check of its own.
image_deduplicator (imagededup pHash, equal hashes only) is its model-free image dedup; it has none by
Hamming distance outside Ray, and pHash ignores colour, so same-shape images of different colours count
as duplicates.

The Data-Juicer python comes from --dj-python or $QVL_DJ_PYTHON; without one the baseline is skipped
with a note. From the lake's ground truth the table also counts model-free defects left in each kept set
and clean records lost.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ONE_THREAD = {
    name: "1"
    for name in (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
        "RAYON_NUM_THREADS",
    )
}
MODEL_FREE_DEFECTS = {
    "corrupt",
    "truncated",
    "zero_byte",
    "exact_duplicate",
    "near_duplicate",
    "tiny",
    "extreme_aspect",
    "empty_caption",
    "garbage_caption",
}

# Our thresholds (CleanDataConfig defaults) mirrored in Data-Juicer's ops.
OURS_CONFIG = {
    "clip_enabled": False,
    "nsfw_enabled": False,
    "ocr_enabled": False,
    "outlier_enabled": False,
    "judge_model": None,
}


def dj_process(decode_check: bool) -> list[dict]:
    """Data-Juicer's model-free equivalents of our checks, one process each (no auto parallelism).

    With `decode_check`, image_shape_filter (the first op that opens images) runs one sample per batch: with
    skip_op_error a batched op that meets an undecodable image drops its whole batch, so batch 1 is what makes
    that op a per-image decode check. Without it every op keeps Data-Juicer's default batch size.
    """
    one = {"num_proc": 1, "auto_op_parallelism": False}
    shape = {"min_width": 32, "min_height": 32, "max_width": 12000, "max_height": 12000, **one}
    return [
        {"text_length_filter": {"min_len": 1, "max_len": 2000, **one}},
        {"words_num_filter": {"lang": "en", "tokenization": False, "min_num": 2, **one}},
        {"alphanumeric_filter": {"tokenization": False, "min_ratio": 0.5, **one}},
        {"character_repetition_filter": {"rep_len": 10, "max_ratio": 0.5, **one}},
        {"image_shape_filter": {**shape, "batch_size": 1} if decode_check else shape},
        {"image_aspect_ratio_filter": {"min_ratio": 0.25, "max_ratio": 4.0, **one}},
        {"image_deduplicator": {"method": "phash", **one}},
    ]


def _cpu_seconds() -> float:
    """User + system CPU of this process and its waited-for children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _one_thread() -> None:
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


# ---------------------------------------------------------------- children (one process per side)


def _timed(call, *args, **kwargs) -> tuple[object, float, float]:
    """(call's result, CPU seconds, wall seconds)."""
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    result = call(*args, **kwargs)
    return result, _cpu_seconds() - cpu0, time.perf_counter() - wall0


def child_ours(warm_lake: str, lake: str, out: str, repeats: int) -> list[dict]:
    """A warm-up run on a small lake (imports, lazy loads), then `repeats` timed runs; returns the fastest."""
    import pyarrow.parquet as pq

    from components._shared.platform.tracking import NullTracker
    from components.clean_data.config import CleanDataConfig
    from components.clean_data.stage import run

    cfg = CleanDataConfig(**OURS_CONFIG)
    _one_thread()
    run(cfg, lake_uri=warm_lake, output_dir=Path(out) / "warm", tracker=NullTracker())
    runs = []
    for number in range(repeats):
        output_dir = Path(out) / f"run{number}"
        metrics, cpu, wall = _timed(run, cfg, lake_uri=lake, output_dir=output_dir, tracker=NullTracker())
        kept = pq.read_table(output_dir / "kept", columns=["key"]).column("key").to_pylist()
        runs.append({"cpu_s": cpu, "wall_s": wall, "records": metrics["records_in"], "kept_keys": kept})
    return [min(runs, key=lambda r: r["cpu_s"])]


def child_dj(configs: list[str], repeats: int) -> list[dict]:
    """The first config is a warm-up run; each other one runs `repeats` times; returns the fastest of each."""
    from data_juicer.config import init_configs
    from data_juicer.core import DefaultExecutor

    def timed_run(config: str) -> dict:
        cfg = init_configs(args=["--config", config])
        _one_thread()
        _, cpu, wall = _timed(DefaultExecutor(cfg).run)
        with open(cfg.export_path, encoding="utf-8") as lines:
            kept = [json.loads(line)["key"] for line in lines if line.strip()]
        return {"cpu_s": cpu, "wall_s": wall, "kept_keys": kept}

    timed_run(configs[0])
    return [min((timed_run(config) for _ in range(repeats)), key=lambda r: r["cpu_s"]) for config in configs[1:]]


# ---------------------------------------------------------------- parent


def _decodes(data: bytes) -> bool:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.convert("RGB")
        return True
    except Exception:  # noqa: BLE001 - any failure means "not decodable", all this check reports
        return False


def lake_to_dj_jsonl(lake: Path, out: Path, *, decodable_only: bool) -> tuple[Path, int]:
    """Extract the lake's samples to out/images + one jsonl line {key, text, images}; return (jsonl, lines).

    `decodable_only` leaves out samples whose image Pillow cannot fully decode (the pre-cleaned input).
    """
    images = out / "images"
    images.mkdir(parents=True)
    path, count = out / "input.jsonl", 0
    with path.open("w", encoding="utf-8") as lines:
        for shard in sorted(lake.glob("*.tar")):
            samples: dict[str, dict[str, bytes]] = {}
            with tarfile.open(shard) as tar:
                for member in tar:
                    if member.isfile():
                        key, _, ext = member.name.rpartition(".")
                        samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
            for key, parts in samples.items():
                ext = next((e for e in ("jpg", "png", "webp") if e in parts), None)
                if ext is None or "txt" not in parts or (decodable_only and not _decodes(parts[ext])):
                    continue
                image = images / f"{shard.stem}_{key}.{ext}"
                image.write_bytes(parts[ext])
                text = parts["txt"].decode("utf-8", errors="replace")
                lines.write(json.dumps({"key": key, "text": text, "images": [str(image)]}) + "\n")
                count += 1
    return path, count


def dj_config(work: Path, name: str, dataset: Path, *, decode_check: bool) -> Path:
    out = work / f"dj_{name}"
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    config = {
        "project_name": f"clean_throughput_{name}",
        "dataset_path": str(dataset),
        "export_path": str(out / "kept.jsonl"),
        "work_dir": str(out),
        "temp_dir": str(out / "tmp"),
        "np": 1,
        "text_keys": "text",
        "image_key": "images",
        "use_cache": False,
        "skip_op_error": True,
        "open_tracer": False,
        "op_fusion": False,
        "process": dj_process(decode_check),
    }
    path = out / "config.json"  # JSON is YAML; jsonargparse reads it
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return path


def run_child(python: str, args: list[str], timeout: float) -> tuple[list[dict], float]:
    """Run this file as a child; return its results and the whole child's CPU s (with start, imports)."""
    env = {
        **os.environ,
        **ONE_THREAD,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PIP_NO_INDEX": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(
            [python, str(Path(__file__).resolve()), *args, "--result", str(result_path)],
            cwd=REPO,
            env=env,
            timeout=timeout,
            capture_output=True,
            text=True,
            check=False,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0 or not result_path.exists():
            raise RuntimeError(
                f"child {args[:2]} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
            )
        results = json.loads(result_path.read_text(encoding="utf-8"))
    return results, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def quality(kept: list[str], truth: dict[str, str | None]) -> tuple[int, int]:
    """(model-free defects left in the kept set, clean records lost)."""
    kept_set = set(kept)
    left = sum(1 for key in kept_set if truth.get(key) in MODEL_FREE_DEFECTS)
    lost = sum(1 for key, defect in truth.items() if defect is None and key not in kept_set)
    return left, lost


def print_table(results: dict[str, dict], truth: dict[str, str | None]) -> None:
    baselines = [r["records"] / r["cpu_s"] for side, r in results.items() if side.startswith("data_juicer")]
    base_rate = max(baselines, default=None)
    header = (
        f"{'side':<26}{'records':>8}{'kept':>6}{'defects left':>14}{'clean lost':>12}{'wall s':>8}"
        f"{'CPU s':>8}{'rec/CPU-s':>11}{'vs DJ':>8}"
    )
    print(header)
    print("-" * len(header))
    for side, r in results.items():
        rate = r["records"] / r["cpu_s"]
        left, lost = quality(r["kept_keys"], truth)
        ratio = f"{rate / base_rate:.2f}x" if base_rate else "n/a"
        print(
            f"{side:<26}{r['records']:>8}{len(r['kept_keys']):>6}{left:>14}{lost:>12}{r['wall_s']:>8.2f}"
            f"{r['cpu_s']:>8.2f}{rate:>11.1f}{ratio:>8}"
        )
    print(
        "CPU s: user+system seconds of the fastest timed run (after a warm-up run in the same process),"
        " children included."
        "\nvs DJ: records/CPU-s over the faster Data-Juicer row. defects left: kept records whose"
        " ground-truth defect\nis model-free; clean lost: clean records rejected (duplicates' originals"
        " count as clean)."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000, help="lake records (default 2000)")
    parser.add_argument("--warm-records", type=int, default=100, help="records of the untimed warm-up lake")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per side; the fastest counts (default 1)")
    parser.add_argument(
        "--dj-python",
        default=os.environ.get("QVL_DJ_PYTHON"),
        help="python of a venv with py-data-juicer (default: $QVL_DJ_PYTHON; none skips the baseline)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per side")
    parser.add_argument("--work", help="work directory, kept afterwards (default: a temp dir, removed)")
    parser.add_argument("--child", choices=["ours", "dj"], help=argparse.SUPPRESS)
    parser.add_argument("--lake", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--config", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:  # Data-Juicer sends stdout to its log, so results go through a file
        result = (
            child_ours(*args.lake, args.out, args.repeats)
            if args.child == "ours"
            else child_dj(args.config, args.repeats)
        )
        Path(args.result).write_text(json.dumps(result), encoding="utf-8")
        return

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="clean_bench_"))
    try:
        from components.synth_world.lake import write_world

        no_splits = {"eval_per_type": 0, "sft_records": 0, "preference_pairs": 0}
        counts = write_world(work / "world", records=args.records, seed=args.seed, **no_splits)["lake"]
        write_world(work / "warm", records=args.warm_records, seed=args.seed + 1, **no_splits)
        lake, warm_lake = work / "world" / "lake", work / "warm" / "lake"
        truth = {
            row["key"]: row["defect"]
            for row in map(json.loads, (work / "world" / "ground_truth.jsonl").read_text(encoding="utf-8").splitlines())
        }
        model_free = sum(v for k, v in counts["defects"].items() if k in MODEL_FREE_DEFECTS)
        print(
            f"lake: {counts['records']} records in {counts['shards']} shards, "
            f"{counts['records'] - counts['clean']} defective, {model_free} of them model-free "
            f"({', '.join(sorted(MODEL_FREE_DEFECTS))})"
        )

        results, process_cpu = {}, {}
        (ours,), process_cpu["clean_data"] = run_child(
            sys.executable,
            [
                "--child",
                "ours",
                "--lake",
                str(warm_lake),
                str(lake),
                "--out",
                str(work / "ours"),
                "--repeats",
                str(args.repeats),
            ],
            args.timeout,
        )
        results["clean_data (model-free)"] = ours
        dj_python = args.dj_python
        if not dj_python or not Path(dj_python).exists():
            print(
                "NOTE: Data-Juicer baseline skipped: no python at --dj-python / $QVL_DJ_PYTHON "
                f"({dj_python!r}).\n"
                "      Make one: python -m venv --system-site-packages /tmp/dj-venv && "
                "/tmp/dj-venv/bin/pip install py-data-juicer==1.6.1 imagededup"
            )
        else:
            warm, _ = lake_to_dj_jsonl(warm_lake, work / "dj_in_warm", decodable_only=False)
            raw, raw_count = lake_to_dj_jsonl(lake, work / "dj_in_raw", decodable_only=False)
            clean, clean_count = lake_to_dj_jsonl(lake, work / "dj_in_decodable", decodable_only=True)
            configs = [
                dj_config(work, "warm", warm, decode_check=True),
                dj_config(work, "raw", raw, decode_check=True),
                dj_config(work, "decodable", clean, decode_check=False),
            ]
            (dj_raw, dj_clean), process_cpu["data_juicer"] = run_child(
                dj_python,
                ["--child", "dj", "--repeats", str(args.repeats), "--config", *map(str, configs)],
                args.timeout,
            )
            results["data_juicer (raw lake)"] = {**dj_raw, "records": raw_count}
            results["data_juicer (decodable)"] = {**dj_clean, "records": clean_count}
        print_table(results, truth)
        print(
            "whole child processes (start, imports, warm-up, timed runs), CPU s: "
            + ", ".join(f"{side} {cpu:.1f}" for side, cpu in process_cpu.items())
        )
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
