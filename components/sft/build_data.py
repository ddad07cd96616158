"""SFT data built by the pipeline from a cleaned lake (`sft.build_data`; templates and selection: data_builder.py).

    python -m components.sft.build_data --config pipelines/presets/demo.yaml --clean-data OUT/clean_data \
        --base-model OUT/pretrain/model --data WORLD/heldout --output-dir OUT/sft_data

The output is a data directory for the sft stage's `--data`: the given directory's files (hard links where the
file system allows), its `sft.jsonl` replaced by the built conversations (plus its own with
`build_data.include_given`), the lake images they ask about under `built_images/`, `build_accounting.json`
(candidates = kept + dropped by reason, per type; lake records used or not, region chunks used or not) and
`built_dropped.jsonl` (every dropped candidate with its reason). Candidates are scored by the base model's mean
log-likelihood of the answer given the image and the question.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from components._shared.data import datasets
from components._shared.data.kept_records import kept_count, load_kept
from components._shared.data.manifest import MANIFEST
from components._shared.data.regions import record_regions
from components._shared.data.text_checks import RecordError, check_text
from components._shared.launch.result import RESULT_FILE
from components._shared.model.families import VisualTokens, family_for
from components._shared.model.head_loss import per_sample_sequence_loss
from components._shared.model.packing import image_embeddings, pack, plan_micro_batches, to_device
from components._shared.model.sources import check_not_reward_model
from components._shared.model.stage_steps import SCRATCH
from components._shared.model.vlm import load_vlm, set_pixel_bounds
from components._shared.platform import bad_records
from components._shared.platform.image_decode import decode_image
from components._shared.platform.storage import COMMIT_MARKER
from components._shared.platform.tracking import Tracker
from components.sft import data_builder as B
from components.sft.config import SftConfig

BUILT_IMAGES = "built_images"
ACCOUNTING = "build_accounting.json"
DROPPED = "built_dropped.jsonl"
MAX_IMAGE_PIXELS = 89_478_485
# Not copied from the given directory: its SFT file (replaced), and an earlier build's or stage's own files.
NOT_COPIED = frozenset({"sft.jsonl", BUILT_IMAGES, ACCOUNTING, DROPPED, COMMIT_MARKER, RESULT_FILE})


def run(
    cfg: SftConfig, *, clean_data: str, base_model: str, data: str, output_dir: str | Path, tracker: Tracker
) -> dict[str, Any]:
    """Build SFT conversations from clean_data's kept records, score them with the base model, select, write."""
    check_not_reward_model(base_model, "--base-model", expected="the pretrain stage's model/")
    build, output_dir = cfg.build_data, Path(output_dir)
    data_dir = datasets.resolve_data_dir(data, scratch=output_dir / SCRATCH)  # s3:// data is fetched there
    if (data_dir / MANIFEST).exists():
        raise ValueError(
            f"--data {data}: a {MANIFEST} directory; the builder writes the plain layout (sft.jsonl, eval.jsonl) and "
            f"cannot yet rewrite a {MANIFEST}: give a directory with eval.jsonl (and sft.jsonl), or train on it as is."
        )
    if not (data_dir / "eval.jsonl").is_file():
        raise ValueError(f"--data {data}: no eval.jsonl; the built directory keeps the given held-out questions.")
    if build.include_given and (data_dir / ACCOUNTING).is_file():
        raise ValueError(
            f"--data {data} is an earlier build ({ACCOUNTING}); with build_data.include_given its built rows would "
            "come along without their images and under ids the new rows take again. Give the original data "
            "directory, or set build_data.include_given: false."
        )
    check_given(data, data_dir, include_given=build.include_given)
    records = load_kept(Path(clean_data), None, with_images=True, with_metadata=True)
    if not records:
        raise ValueError(
            f"--clean-data {clean_data}: its {kept_count(Path(clean_data))} kept records all have an empty caption; "
            "the builder's questions come from captions and their noun_chunks. Give the output of a lake with captions."
        )
    model, processor, _ = load_vlm(base_model)
    set_pixel_bounds(processor, cfg.min_pixels, cfg.max_pixels)
    from components._shared.model.encoder import ConversationEncoder

    encoder = ConversationEncoder(
        processor, model, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_length=cfg.max_length
    )
    images, candidates, lake = generate(cfg, records, encoder, family_for(model.config).grounding)
    check_regions_used(lake, build.templates)
    scores = score(model, encoder, candidates, images, cfg)
    answer_tokens = [len(encoder.tokenizer(c.answer, add_special_tokens=False)["input_ids"]) for c in candidates]
    kept, dropped = B.select(candidates, scores, answer_tokens, build)
    accounting = {"lake": lake, **B.accounting(candidates, kept, dropped)}
    write(output_dir, data_dir, records, images, candidates, kept, dropped, scores, include_given=build.include_given)
    (output_dir / ACCOUNTING).write_text(json.dumps(accounting, indent=2) + "\n")
    shutil.rmtree(output_dir / SCRATCH, ignore_errors=True)  # not part of the output
    per_type = {f"built/{k}": v["kept"] for k, v in accounting["per_type"].items()}
    metrics = {
        "lake_records": lake["records"],
        "candidates": accounting["candidates"],
        "kept": accounting["kept"],
        **{f"dropped/{reason}": n for reason, n in accounting["dropped"].items()},
        "counterfactual_share": accounting["counterfactual_share"],
        **per_type,
    }
    tracker.log_metrics({k: float(v) for k, v in metrics.items()}, step=0)
    return metrics


def check_given(data: str, data_dir: Path, *, include_given: bool) -> None:
    """Refuse given data the built directory would break: a folder of the user's own named `built_images/` (not
    copied, so its images would go missing), and with include_given no sft.jsonl, ids of the built rows' form, or a
    record sft would refuse (unless on_bad_record: skip)."""
    if (data_dir / BUILT_IMAGES).exists() and not (data_dir / ACCOUNTING).is_file():
        raise ValueError(
            f"--data {data} has a {BUILT_IMAGES}/ folder, the name the builder writes its images under (it is not "
            "copied, so what your files name there would go missing): rename that folder and the paths to it."
        )
    if not include_given:
        return
    given = data_dir / "sft.jsonl"
    if not given.is_file():
        raise ValueError(
            f"build_data.include_given: --data {data} has no sft.jsonl to train on beside the built conversations; "
            "give the directory that holds it, or set include_given: false."
        )
    with given.open(encoding="utf-8", errors="replace") as lines:  # streamed: LLaVA-scale files run to GBs
        for n, line in enumerate(lines, 1):
            if "built-" not in line:
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue  # sft's own reader names a broken line
            if isinstance(row, dict) and str(row.get("id", "")).startswith("built-"):
                raise ValueError(
                    f"{given}:{n}: id {str(row['id'])[:40]!r} has the form the built rows take (built-NNNNNN); with "
                    "build_data.include_given two rows could share an id. Rename the given ids, or set "
                    "include_given: false."
                )
    ledger = bad_records.current()
    if ledger is None or not ledger.skipping:  # under skip, sft drops and counts them as it does without the build
        try:  # copied as they are: a bad record is said here, naming --data's file, not after the GPU step
            datasets.load_conversations(data_dir, file_name="sft.jsonl")
        except ValueError as err:
            raise ValueError(
                f"build_data.include_given copies --data {data}'s sft.jsonl into the build as it is, and sft would "
                f"refuse it: {err}"
            ) from None


def check_regions_used(lake: dict, templates: list[str]) -> None:
    """Refuse a build whose region templates had no region to use, naming why the lake's chunks were not used (the
    quota errors that would follow speak of question types, not of the cause)."""
    needing = [t for t in templates if t != "caption"]
    if lake["region_chunks_used"] == 0 and needing:
        reasons = lake["region_chunks_not_used"] or {"no record has noun_chunks in its metadata": lake["records"]}
        raise ValueError(
            f"build_data: no region chunk of the {lake['records']} kept records could be used ({reasons}); the "
            f"templates {needing} ask about regions. Give the lake GRIT-style noun_chunks ([start, end, x1, y1, x2, "
            "y2, score], relative boxes) in each record's JSON, or set build_data.templates: [caption]."
        )


def generate(cfg: SftConfig, records: list[dict], encoder, convention: str):
    """(decoded images by hash, candidates, the lake's accounting): every record is used or counted with a reason."""
    build = cfg.build_data
    parsed: list[list] = []
    chunk_reasons: Counter[str] = Counter()
    images: dict[str, Any] = {}
    for r in records:
        regions, dropped = record_regions(r, build.min_score)
        chunk_reasons.update(dropped)
        parsed.append(regions)
    objects = [B.split_regions(r["caption"], regions)[0] for r, regions in zip(records, parsed, strict=True)]
    templates = B.Templates(B.colors_by_noun(objects), build.seed)
    candidates: list[B.Candidate] = []
    unused: Counter[str] = Counter()
    seen: set[str] = set()
    for r, regions in zip(records, parsed, strict=True):
        if r["image_hash"] in seen:
            unused["the same image as an earlier record"] += 1
            continue
        if "<image>" in r["caption"]:  # sft would take it for a second image placeholder
            unused["the caption holds '<image>', the image placeholder"] += 1
            continue
        try:
            check_text(r["caption"], "caption")
        except RecordError as err:  # sft would refuse every conversation built from it (the rest of the message)
            unused["the caption holds text sft refuses (control or direction characters, chat tokens)"] += 1
            print(f"warning: build_data: lake record {r['image_hash']} not used: {err}", flush=True)
            continue
        if len(encoder.tokenizer(r["caption"], add_special_tokens=False)["input_ids"]) > cfg.max_length // 2:
            unused[f"the caption is longer than half of max_length ({cfg.max_length // 2} tokens)"] += 1
            continue
        seen.add(r["image_hash"])
        image = decode_image(r["image"], max_image_pixels=MAX_IMAGE_PIXELS).image
        box_text = box_writer(convention, encoder.model_image_size(image))
        made = templates(r["image_hash"], r["caption"], regions, list(build.templates), box_text)
        if not made:
            unused["no template applies (no usable region, caption off)"] += 1
            continue
        images[r["image_hash"]] = image
        candidates += made
    lake = {
        "records": len(records),
        "used": len(images),
        "not_used": dict(sorted(unused.items())),
        "region_chunks_used": sum(len(p) for p in parsed),
        "region_chunks_not_used": dict(sorted(chunk_reasons.items())),
    }
    if not candidates:
        advice = "" if "caption" in build.templates else ", or add 'caption' to build_data.templates"
        raise ValueError(
            f"build_data: none of the {len(records)} kept records gave a candidate ({lake['not_used']}); give the "
            f"lake records captions sft can train on and GRIT-style noun_chunks{advice}."
        )
    return images, candidates, lake


def box_writer(convention: str, model_size: tuple[int, int]):
    """A relative box as the family answers it: `(x1,y1),(x2,y2)` in pixels of the image the model sees
    (`absolute`, Qwen2.5-VL) or in thousandths of each side (`relative_1000`)."""
    w, h = model_size if convention == "absolute" else (1000, 1000)

    def text(box: tuple[float, float, float, float]) -> str:
        x1, y1, x2, y2 = (round(v * s) for v, s in zip(box, (w, h, w, h), strict=True))
        return f"({x1},{y1}),({x2},{y2})"

    return text


def score(model, encoder, candidates: list[B.Candidate], images: dict, cfg: SftConfig) -> list[float]:
    """The base model's mean log-likelihood of each answer given its image and question (higher: more likely).
    Each image goes through the vision tower once (16 images a batch); its candidates reuse the visual tokens."""
    by_image: dict[str, list[int]] = {}
    for i, c in enumerate(candidates):
        by_image.setdefault(c.image, []).append(i)
    hashes, out = list(by_image), [0.0] * len(candidates)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(hashes), 16):
            group = hashes[start : start + 16]
            pictures = [encoder.encode(_turns(candidates[by_image[h][0]]), images=[images[h]]) for h in group]
            embeds = image_embeddings(model, to_device(pack(pictures), "cpu"))
            assert embeds is not None  # the samples carry pixels
            per_image = embeds.split([int(p.image_grid_thw.prod()) // encoder.merge_unit for p in pictures])
            members = [(g, i) for g, h in enumerate(group) for i in by_image[h]]
            samples = [encoder.encode(_turns(candidates[i]), grids=[pictures[g].image_grid_thw[0]]) for g, i in members]
            budget = max(cfg.train.max_tokens_per_micro_batch, max(x.num_tokens for x in samples))
            for micro in plan_micro_batches([x.num_tokens for x in samples], budget):
                losses = per_sample_sequence_loss(
                    model,
                    to_device(pack([samples[k] for k in micro]), "cpu"),
                    chunk_rows=cfg.train.loss_chunk_tokens,
                    image_embeds=VisualTokens.cat([per_image[members[k][0]] for k in micro]),
                )
                for k, loss in zip(micro, losses.tolist(), strict=True):
                    out[members[k][1]] = -loss
    return out


def _turns(c: B.Candidate) -> list[dict]:
    return [{"role": "user", "text": f"<image>\n{c.question}"}, {"role": "assistant", "text": c.answer}]


def write(
    output_dir: Path,
    data_dir: Path,
    records: list[dict],
    images: dict,
    candidates: list[B.Candidate],
    kept: list[int],
    dropped: dict[int, str],
    scores: list[float],
    *,
    include_given: bool,
) -> None:
    """The data directory: the given files but sft.jsonl, the built sft.jsonl, the lake images, the dropped list."""
    inside = data_dir.resolve()
    for path in sorted(data_dir.rglob("*")):
        relative = path.relative_to(data_dir)
        if not path.is_file() or relative.parts[0] in NOT_COPIED or SCRATCH in relative.parts:
            continue
        if not path.resolve().is_relative_to(inside):  # a link out of --data: its target is no part of the data
            print(f"warning: build_data: {path} leads outside --data ({path.resolve()}); not copied.", flush=True)
            continue
        _link(path, output_dir / relative)
    (output_dir / BUILT_IMAGES).mkdir(parents=True, exist_ok=True)
    raw = {r["image_hash"]: r["image"] for r in records}
    for image_hash in sorted({candidates[i].image for i in kept}):
        (output_dir / BUILT_IMAGES / f"{image_hash}.png").write_bytes(_png(images[image_hash], raw[image_hash]))
    given = (data_dir / "sft.jsonl").read_text() if include_given and (data_dir / "sft.jsonl").is_file() else ""
    with (output_dir / "sft.jsonl").open("w") as f:
        f.write(given if not given or given.endswith("\n") else given + "\n")
        for n, i in enumerate(kept):
            f.write(json.dumps(_row(candidates[i], n)) + "\n")
    with (output_dir / DROPPED).open("w") as f:
        for i in sorted(dropped):
            c = candidates[i]
            f.write(
                json.dumps(
                    {
                        "image": c.image,
                        "type": c.kind,
                        "question": c.question,
                        "answer": c.answer,
                        "score": round(scores[i], 6),
                        "reason": dropped[i],
                    }  # fmt: skip
                )
                + "\n"
            )


def _row(c: B.Candidate, n: int) -> dict:
    return {
        "id": f"built-{n:06d}",
        "image": f"{BUILT_IMAGES}/{c.image}.png",
        "type": c.kind,
        "difficulty": c.difficulty,
        "conversations": [{"from": "human", "value": _turns(c)[0]["text"]}, {"from": "gpt", "value": c.answer}],
    }


def _png(image, raw: bytes) -> bytes:
    """The record's bytes when they are a PNG already, else the decoded image as PNG (one format to read back)."""
    if raw[:8] == b"\x89PNG\r\n\x1a\n":
        return raw
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


class BuildDataSettings(SftConfig):
    """The sft section as the builder reads it: its `build_data` settings are the ones that act here."""

    def ignored_settings(self) -> list[str]:
        return [note for note in super().ignored_settings() if not note.startswith("build_data.")]


def main(argv: list[str] | None = None) -> None:
    from components._shared.launch.cli import stage_main

    stage_main(
        BuildDataSettings,
        run,
        section="sft",
        inputs=("clean_data", "base_model", "data"),
        argv=argv,
        record_as="sft_data",
    )


if __name__ == "__main__":
    main()
