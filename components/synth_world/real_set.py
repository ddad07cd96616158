"""A real-format data set from photographs a registry package ships (scikit-image; no download):
`qvl lake synth --real --out DIR`, what `qvl rehearse --preset` runs the whole DAG on.

    DIR/lake/   an img2dataset lake: 00000.tar (KEY.jpg|png|webp, KEY.txt, KEY.json per sample) with 00000.parquet
                and 00000_stats.json beside it, as img2dataset writes them; 20 photographs with hand-written
                captions and the defects real lakes have (a re-encoded copy, a truncated file, an exact duplicate,
                an empty caption: `LAKE_DEFECTS`)
    DIR/data/   the layouts users download, tied together by dataset.yaml:
                sft/llava_instruct.json   LLaVA's JSON array, system turns and two-image records among them
                preferences/pairs.parquet TRL's preference layout in Parquet (images as {bytes, path} structs)
                rl/prompts.json           RL prompts of the custom task photo_qa (exact match)
                the held-out set: only standard benchmarks in their release layouts (VQAv2 questions + annotations,
                TextVQA, DocVQA, ChartQA, RefCOCO, MMBench TSV with base64 images, POPE lines; real_photos.py)
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from components.synth_world import real_photos as P

LAKE_PHOTOS = {  # scikit-image photographs beside real_photos.PHOTOS: name -> a caption written by looking at it
    "clock": "A black and white photo of a round wall clock, slightly blurred by motion.",
    "coins": "Ancient bronze coins laid out in rows on a dark background.",
    "moon": "A black and white close-up of the cratered surface of the moon.",
    "page": "A scanned page of printed text, slightly uneven in brightness.",
    "text": "Painted letters on a textured surface in a grayscale photo.",
    "hubble_deep_field": "Hundreds of distant galaxies on black sky in the Hubble deep field.",
    "immunohistochemistry": "A microscope image of stained tissue with brown and blue cells.",
    "retina": "A fundus photograph of a human retina with its blood vessels and optic disc.",
    "stereo_motorcycle": "A red motorcycle parked indoors among shelves and boxes.",
    "colorwheel": "A color wheel with every hue around the circle fading to white at the centre.",
    "logo": "The scikit-image logo: a snake drawn over a grid of coloured squares.",
    "brick": "A grayscale close-up of a brick wall with mortar lines.",
    "grass": "A grayscale close-up of blades of grass.",
    "gravel": "A grayscale close-up of small stones of gravel.",
    "horse": "A black silhouette of a horse on a white background.",
}
LAKE_DEFECTS = {"near_duplicate", "truncated_image", "exact_duplicate", "empty_caption"}
QA = {  # photo: (question, answer) of the custom task photo_qa: real_photos' five and three lake photographs
    **P.QA,
    "coins": ("What lies on the dark background?", "coins"),
    "moon": ("What is shown?", "the moon"),
    "stereo_motorcycle": ("What vehicle is this?", "a motorcycle"),
}
MANIFEST = """\
# The real-format set of `qvl lake synth --real` (components/synth_world/real_set.py).
tasks: {photo_qa: exact_match}
sft: [sft/llava_instruct.json]
preferences: [preferences/pairs.parquet]
rl: [{path: rl/prompts.json, task: photo_qa}]
"""


def lake_photo(name: str) -> Image.Image:
    """A lake photograph as RGB (scikit-image's grayscale, boolean and RGBA arrays converted)."""
    import numpy as np
    import skimage.data

    array = getattr(skimage.data, name)()
    if isinstance(array, tuple):  # stereo_motorcycle: (left, right, disparity)
        array = array[0]
    if array.dtype == bool:
        array = np.where(array, 255, 0).astype("uint8")
    return Image.fromarray(np.asarray(array)).convert("RGB")


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return buffer.getvalue()


def _captioned_photos() -> list[tuple[str, Image.Image, str]]:
    photos = [(name, P.photo(name), spec[1][0]) for name, spec in P.PHOTOS.items()]
    return photos + [(name, lake_photo(name), caption) for name, caption in LAKE_PHOTOS.items()]


def write_lake(lake: Path) -> dict[str, str | None]:
    """One img2dataset shard of the photographs and the defects; returns {key: the reason clean_data must reject
    it for, or None}."""
    lake.mkdir(parents=True, exist_ok=True)
    formats = [("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")]
    samples: list[tuple[str, bytes, str, Image.Image]] = []  # (member name, bytes, caption, image)
    expected: dict[str, str | None] = {}
    for k, (_, image, caption) in enumerate(_captioned_photos()):
        ext, fmt = formats[k % len(formats)]
        samples.append((f"{k:09d}.{ext}", _encoded(image, fmt), caption, image))
        expected[f"{k:09d}"] = None
    n = len(samples)
    astronaut, chelsea = P.photo("astronaut"), samples[2][1]
    defects = [
        ("jpg", _encoded(P.photo("coffee").resize((300, 200)), "JPEG"), P.PHOTOS["coffee"][1][1], "near_duplicate"),
        ("jpg", _encoded(astronaut, "JPEG")[:4000], P.PHOTOS["astronaut"][1][1], "truncated_image"),
        (samples[2][0].rsplit(".", 1)[1], chelsea, P.PHOTOS["chelsea"][1][1], "exact_duplicate"),
        ("png", _encoded(lake_photo("brick").rotate(90), "PNG"), "  ", "empty_caption"),
    ]
    for j, (ext, data, caption, reason) in enumerate(defects):
        samples.append((f"{n + j:09d}.{ext}", data, caption, astronaut))
        expected[f"{n + j:09d}"] = reason
    rows = []
    with tarfile.open(lake / "00000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data, caption, image in samples:
            key = member.split(".")[0]
            meta = {"url": f"https://example.org/photos/{key}.{member.rsplit('.', 1)[1]}", "key": key,
                    "status": "success", "error_message": None, "caption": caption, "width": image.width,
                    "height": image.height, "original_width": image.width, "original_height": image.height}  # fmt: skip
            rows.append(meta)
            for name, payload in (
                (member, data),
                (f"{key}.txt", caption.encode()),
                (f"{key}.json", json.dumps(meta).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    pq.write_table(pa.Table.from_pylist(rows), lake / "00000.parquet")
    stats = {"count": len(rows), "successes": len(rows), "failed_to_download": 0, "failed_to_resize": 0}
    (lake / "00000_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return expected


def _sft_records(paths: dict[str, str]) -> list[dict]:
    """LLaVA records: captions and questions per annotated photo (real_photos), a system turn on every other one,
    two-image records, and the custom task's questions; difficulty levels for a curriculum (one photo: basic, several
    photos or the custom task: advanced)."""
    records = P.llava_records(paths, task="photo_caption")
    for k, record in enumerate(records):
        record["difficulty"] = "advanced" if "images" in record else "basic"
        if k % 2 == 0:
            record["conversations"].insert(0, {"from": "system", "value": "You are a careful photo describer."})
    three = [paths["coffee"], paths["camera"], paths["astronaut"]]
    records.append({"id": "llava-three", "difficulty": "advanced", "images": three,
                    "conversations": [
                        {"from": "human", "value": "<image>\n<image>\n<image>\nWhich photo is in black and white?"},
                        {"from": "gpt", "value": "The second one, the cameraman."}]})  # fmt: skip
    for name, (question, answer) in QA.items():
        if name in paths:
            records.append({"id": f"qa-{name}", "image": paths[name], "task": "photo_qa", "difficulty": "advanced",
                            "conversations": [
                {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]})  # fmt: skip
    return records


def _preference_rows() -> list[dict]:
    """TRL's preference layout as a Parquet table: the right caption against every other photo's."""
    names = list(P.NAMES)
    rows = []
    for k, name in enumerate(names):
        for shift in (1, 2):
            wrong = P.PHOTOS[names[(k + shift) % len(names)]][1][0]
            rows.append({
                "id": f"pref-{name}-{shift}",
                "images": [{"bytes": _encoded(P.photo(name), "PNG"), "path": f"{name}.png"}],
                "prompt": [{"role": "user", "content": [{"type": "image", "text": None},
                                                        {"type": "text", "text": "Describe the photo."}]}],
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": P.PHOTOS[name][1][0]}]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}],
            })  # fmt: skip
    return rows


def write_data(root: Path) -> Path:
    """The data directory (SFT, preferences, RL prompts, benchmarks) with its dataset.yaml; returns `root`."""
    import yaml

    P.write_benchmarks(root)  # the held-out set at the root, with a dataset.yaml of its `eval` entries
    benchmarks = yaml.safe_load((root / "dataset.yaml").read_text())["eval"]
    paths = P.write_images(root)
    for name in ("coins", "moon", "stereo_motorcycle"):
        lake_photo(name).save(root / "images" / f"{name}.jpg", quality=90)
        paths[name] = f"images/{name}.jpg"
    for folder in ("sft", "preferences", "rl"):
        (root / folder).mkdir(exist_ok=True)
    (root / "sft" / "llava_instruct.json").write_text(json.dumps(_sft_records(paths), indent=2))
    pq.write_table(pa.Table.from_pylist(_preference_rows()), root / "preferences" / "pairs.parquet", row_group_size=4)
    prompts = [
        {"id": f"rl-{name}", "image": paths[name], "conversations": [
            {"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]}
        for name, (q, a) in QA.items()
    ]  # fmt: skip
    (root / "rl" / "prompts.json").write_text(json.dumps(prompts, indent=2))
    (root / "dataset.yaml").write_text(MANIFEST + yaml.safe_dump({"eval": benchmarks}, sort_keys=False))
    return root


def write_real_set(out: Path) -> dict:
    """DIR/lake and DIR/data; returns their counts."""
    expected = write_lake(out / "lake")
    write_data(out / "data")
    return {
        "lake": str(out / "lake"),
        "lake_records": len(expected),
        "lake_defects": sorted(reason for reason in expected.values() if reason),
        "data": str(out / "data"),
    }
