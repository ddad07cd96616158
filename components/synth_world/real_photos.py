"""Small data sets of real photographs in every format the readers take, written from scikit-image's bundled photos
(astronaut, coffee, chelsea, rocket, camera; public domain or CC0, shipped by the registry package: no download).

Captions, questions, options and boxes are written by hand here (boxes in the photos' own pixels, checked by drawing
them). `write_images` saves the photos in the awkward encodings real data has (EXIF-rotated JPEG, CMYK JPEG, 16-bit
and palette PNG, WebP, grayscale); the `write_*` functions write one annotation file per format.
"""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# name: (size w x h, captions, [(VQA question, ten answers), (yes/no question, answer)], {object: box})
PHOTOS: dict[str, Any] = {
    "astronaut": (
        (512, 512),
        ["An astronaut in an orange suit smiles in front of an American flag and a space shuttle model.",
         "A smiling woman in an orange space suit holds a helmet."],
        [("What colour is the space suit?", ["orange"] * 9 + ["red"]),
         ("Is there a flag in the image?", ["yes"])],
        {"head": (170, 15, 300, 190), "space shuttle": (350, 0, 464, 280)},
    ),
    "coffee": (
        (600, 400),
        ["A cup of espresso on a red saucer with a spoon, on a wooden table.",
         "An espresso in a red cup on a wooden table."],
        [("What drink is in the cup?", ["coffee"] * 6 + ["espresso"] * 4),
         ("Is there a dog in the image?", ["no"])],
        {"cup": (170, 15, 400, 300), "saucer": (80, 55, 545, 395)},
    ),
    "chelsea": (
        (451, 300),
        ["A close-up of a tabby cat with green eyes.", "A tabby cat looks at the camera."],
        [("What animal is this?", ["cat"] * 10),
         ("Is there a cat in the image?", ["yes"])],
        {"left eye": (130, 100, 215, 175), "right eye": (290, 105, 345, 170)},
    ),
    "rocket": (
        (640, 427),
        ["A rocket stands on its launch pad at night between lightning towers.",
         "A white rocket on a launch pad under a dark blue sky."],
        [("What stands on the launch pad?", ["rocket"] * 8 + ["a rocket"] * 2),
         ("Is it daytime?", ["no"])],
        {"rocket": (290, 120, 345, 410)},
    ),
    "camera": (
        (512, 512),
        ["A black and white photo of a man with a film camera on a tripod in a field.",
         "A cameraman looks through a camera on a tripod."],
        [("What is the man looking through?", ["camera"] * 7 + ["a camera"] * 3),
         ("Is the photo in colour?", ["no"])],
        {"camera": (235, 125, 335, 185), "man": (0, 65, 300, 512)},
    ),
}  # fmt: skip
CHOICE_QUESTIONS = [  # (photo, question, options, answer letter)
    ("astronaut", "What is the person wearing?", ["a diving suit", "a space suit", "a raincoat", "a tuxedo"], "B"),
    ("coffee", "What is under the cup?", ["a saucer", "a book", "a plate of food", "nothing"], "A"),
    ("chelsea", "What colour are the cat's eyes?", ["blue", "brown", "green", "red"], "C"),
    ("rocket", "When was the photo taken?", ["at noon", "at night", "at dawn in fog", "in winter snow"], "B"),
    ("camera", "What holds the camera?", ["a tripod", "a table", "a crane", "the man's shoulder"], "A"),
]
NAMES = tuple(PHOTOS)


def photo(name: str) -> Image.Image:
    import skimage.data

    return Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB")


def write_images(root: Path) -> dict[str, str]:
    """The photos under root/images, each in another awkward encoding; {name: path relative to root}."""
    out = root / "images"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    # astronaut: stored rotated 90 degrees with EXIF orientation 6 (a phone photo); decoders must turn it back
    exif = Image.Exif()
    exif[0x0112] = 6
    photo("astronaut").transpose(Image.Transpose.ROTATE_90).save(out / "astronaut.jpg", exif=exif, quality=90)
    paths["astronaut"] = "images/astronaut.jpg"
    photo("coffee").convert("CMYK").save(out / "coffee_cmyk.jpg", quality=90)  # print-shop JPEG
    paths["coffee"] = "images/coffee_cmyk.jpg"
    photo("chelsea").save(out / "chelsea.webp", quality=85)
    paths["chelsea"] = "images/chelsea.webp"
    photo("rocket").quantize(colors=64).save(out / "rocket_palette.png")  # palette PNG
    paths["rocket"] = "images/rocket_palette.png"
    gray16 = (np.asarray(photo("camera").convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    Image.fromarray(gray16).save(out / "camera_16bit.png")  # 16-bit grayscale PNG (I;16)
    paths["camera"] = "images/camera_16bit.png"
    photo("camera").convert("L").save(out / "camera_gray.jpg")
    return paths


def _dump(path: Path, records: list[dict], *, jsonl: bool) -> Path:
    with path.open("w") as f:
        if jsonl:
            f.writelines(json.dumps(r) + "\n" for r in records)
        else:
            json.dump(records, f, indent=2)  # LLaVA's release form: one pretty-printed array
    return path


def llava_records(paths: dict[str, str], *, task: str = "photo_caption") -> list[dict]:
    """LLaVA conversations: a caption and a question per photo, one record with two photos."""
    records = []
    for name, (_, captions, questions, _) in PHOTOS.items():
        question, answers = questions[0]
        records.append(
            {
                "id": f"llava-{name}",
                "image": paths[name],
                "task": task,
                "conversations": [
                    {"from": "human", "value": "<image>\nDescribe the photo."},
                    {"from": "gpt", "value": captions[0]},
                    {"from": "human", "value": question},
                    {"from": "gpt", "value": answers[0]},
                ],
            }
        )
    records.append(
        {
            "id": "llava-pair",
            "images": [paths["chelsea"], paths["rocket"]],
            "task": task,
            "conversations": [
                {"from": "human", "value": "First: <image>\nSecond: <image>\nWhich photo shows an animal?"},
                {"from": "gpt", "value": "The first one, a tabby cat."},
            ],
        }
    )
    return records


def write_llava(root: Path, paths: dict[str, str], *, jsonl: bool = False, task: str = "photo_caption") -> Path:
    return _dump(root / ("llava.jsonl" if jsonl else "llava.json"), llava_records(paths, task=task), jsonl=jsonl)


def write_sharegpt(root: Path, paths: dict[str, str]) -> Path:
    """ShareGPT with system turns: one inside the conversation, one as a top-level field."""
    records = []
    for k, (name, (_, captions, _, _)) in enumerate(PHOTOS.items()):
        turns = [{"from": "human", "value": "<image>\nWhat is in this photo?"}, {"from": "gpt", "value": captions[1]}]
        record = {"id": f"sharegpt-{name}", "image": paths[name]}
        if k % 2:
            record["system"] = "You describe photos in one sentence."
        else:
            turns.insert(0, {"from": "system", "value": "You are a careful photo describer."})
        records.append({**record, "conversations": turns})
    return _dump(root / "sharegpt.jsonl", records, jsonl=True)


def write_messages(root: Path, paths: dict[str, str]) -> Path:
    """The chat "messages" format (TRL / HF datasets): content parts, images in the record's "images" list, one
    record whose image parts carry their own paths."""
    records = []
    for name, (_, _, questions, _) in PHOTOS.items():
        question, answers = questions[1]
        records.append(
            {
                "images": [paths[name]],
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answers[0].capitalize() + "."}]},
                ],
            }
        )
    records.append(
        {
            "messages": [
                {"role": "system", "content": "Compare the two photos."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": paths["coffee"]},
                        {"type": "image", "image": paths["camera"]},
                        {"type": "text", "text": "Which one is black and white?"},
                    ],
                },
                {"role": "assistant", "content": "The second one."},
            ]
        }
    )
    return _dump(root / "messages.jsonl", records, jsonl=True)


def _png_bytes(name: str) -> bytes:
    buffer = io.BytesIO()
    photo(name).save(buffer, format="PNG")
    return buffer.getvalue()


def write_parquet(root: Path, *, row_group_size: int = 2) -> Path:
    """The hub's Parquet layout: an "images" column of [{bytes, path}] structs and a "messages" column; small row
    groups so the lazy reader crosses groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for name, (_, captions, _, _) in PHOTOS.items():
        rows.append(
            {
                "images": [{"bytes": _png_bytes(name), "path": f"{name}.png"}],
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "text": None}, {"type": "text", "text": "Caption?"}],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": captions[0]}]},
                ],
            }
        )
    path = root / "photos.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def eval_records(paths: dict[str, str]) -> list[dict]:
    """Held-out questions in the flat form, several tasks and benchmarks: VQA accuracy over ten answers, POPE-style
    yes/no, multiple choice, grounding with pixel boxes, captions."""
    records = []
    for name, (_, captions, questions, boxes) in PHOTOS.items():
        (vqa_q, vqa_answers), (yn_q, yn_answers) = questions
        image = paths[name]
        records.append({"id": f"vqa-{name}", "image": image, "question": vqa_q, "answers": vqa_answers,
                        "task": "vqa_accuracy", "benchmark": "photo_vqa"})  # fmt: skip
        records.append({"id": f"pope-{name}", "image": image, "question": yn_q, "answer": yn_answers[0],
                        "task": "yes_no", "benchmark": "photo_pope"})  # fmt: skip
        obj, box = next(iter(boxes.items()))
        records.append({"id": f"ref-{name}", "image": image, "question": f"Locate the {obj}.", "answer": "",
                        "box": list(box), "task": "grounding", "benchmark": "photo_refs"})  # fmt: skip
        records.append({"id": f"cap-{name}", "image": image, "question": "Describe the photo.", "answers": captions,
                        "task": "cider_d", "benchmark": "photo_captions"})  # fmt: skip
    for name, question, options, letter in CHOICE_QUESTIONS:
        records.append({"id": f"mc-{name}", "image": paths[name], "question": question, "choices": options,
                        "answer": letter, "task": "multiple_choice", "benchmark": "photo_mc"})  # fmt: skip
    return records


def write_eval(root: Path, paths: dict[str, str]) -> Path:
    return _dump(root / "photo_eval.jsonl", eval_records(paths), jsonl=True)


def write_preferences(root: Path, paths: dict[str, str]) -> Path:
    """TRL's DPO layout: prompt as messages, chosen / rejected as one assistant message each; one pair with a
    data: URI image."""
    records = []
    for k, (name, (_, captions, _, _)) in enumerate(PHOTOS.items()):
        for shift in range(1, len(NAMES)):  # the right caption against each other photo's
            wrong = PHOTOS[NAMES[(k + shift) % len(NAMES)]][1][0]
            records.append(
                {
                    "id": f"pref-{name}-{shift}",
                    "images": [paths[name]],
                    "prompt": [
                        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}
                    ],
                    "chosen": [{"role": "assistant", "content": captions[0]}],
                    "rejected": [{"role": "assistant", "content": wrong}],
                }
            )
    uri = "data:image/png;base64," + base64.b64encode(_png_bytes("chelsea")).decode()
    records.append({"id": "pref-inline", "image": uri, "prompt": "What animal is this?", "chosen": "A cat.",
                    "rejected": "A dog."})  # fmt: skip
    return _dump(root / "preferences.jsonl", records, jsonl=True)


def write_all(root: Path) -> dict[str, str]:
    """Every fixture file and the images under `root`; returns the image paths."""
    root.mkdir(parents=True, exist_ok=True)
    paths = write_images(root)
    write_llava(root, paths)
    write_llava(root, paths, jsonl=True)
    write_sharegpt(root, paths)
    write_messages(root, paths)
    write_parquet(root)
    write_eval(root, paths)
    write_preferences(root, paths)
    return paths


def _save_photo(root: Path, name: str, photo_name: str) -> str:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    photo(photo_name).save(root / name)
    return name


def write_benchmarks(root: Path) -> Path:
    """A held-out set of the standard benchmarks in their release layouts (VQAv2 questions + annotations, TextVQA,
    DocVQA, ChartQA, RefCOCO, an MMBench TSV with base64 images, POPE lines, COCO Captions) on real photographs, with
    the dataset.yaml that names them; returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    # VQAv2: questions + annotations, COCO file names under val2014/
    _save_photo(root, "val2014/COCO_val2014_000000000042.jpg", "coffee")
    (root / "v2_questions.json").write_text(json.dumps({
        "data_subtype": "val2014",
        "questions": [{"image_id": 42, "question": "What is in the cup?", "question_id": 420}],
    }))  # fmt: skip
    (root / "v2_annotations.json").write_text(json.dumps({"annotations": [{
        "question_id": 420, "image_id": 42,
        "answers": [{"answer": a, "answer_id": i} for i, a in enumerate(["coffee"] * 7 + ["espresso"] * 3)],
    }]}))  # fmt: skip
    # TextVQA: {"data": [...]}, images <image_id>.jpg
    _save_photo(root, "train_images/ab12.jpg", "rocket")
    (root / "TextVQA_0.5.1_val.json").write_text(json.dumps({"dataset_name": "textvqa", "data": [
        {"question_id": 7, "image_id": "ab12", "question": "What is on the pad?", "answers": ["rocket"] * 10},
    ]}))  # fmt: skip
    # DocVQA: {"data": [...]} with image paths
    _save_photo(root, "documents/doc1.png", "camera")
    (root / "val_v1.0.json").write_text(json.dumps({"data": [
        {"questionId": 11, "question": "What is the title?", "image": "documents/doc1.png", "docId": 1,
         "answers": ["Cameraman", "the cameraman"]},
    ]}))  # fmt: skip
    # ChartQA: a list of {imgname, query, label}, images in png/
    _save_photo(root, "png/chart1.png", "chelsea")
    (root / "test_human.json").write_text(json.dumps([{"imgname": "chart1.png", "query": "Value?", "label": 40}]))
    # RefCOCO, MDETR's COCO-style final_refcoco_testA.json
    _save_photo(root, "coco/COCO_train2014_000000000007.jpg", "rocket")
    (root / "final_refcoco_testA.json").write_text(json.dumps({
        "images": [{"id": 3, "file_name": "COCO_train2014_000000000007.jpg", "caption": "the white rocket",
                    "height": 427, "width": 640}],
        "annotations": [{"id": 1, "image_id": 3, "bbox": [290, 120, 55, 290]}],
    }))  # fmt: skip
    # MMBench TSV: options in columns, the image base64 inline
    buffer = io.BytesIO()
    photo("chelsea").save(buffer, format="JPEG")
    with (root / "MMBench_DEV_EN.tsv").open("w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["index", "question", "hint", "A", "B", "C", "D", "answer", "category", "image"])
        writer.writerow([5, "What animal is it?", "A close-up photo.", "dog", "cat", "bird", "nan", "B", "animals",
                         base64.b64encode(buffer.getvalue()).decode()])  # fmt: skip
    # POPE: JSON lines in a .json file
    _save_photo(root, "val2014/COCO_val2014_000000000310.jpg", "astronaut")
    pope = [(1, "Is there a flag in the image?", "yes"), (2, "Is there a dog in the image?", "no")]
    (root / "coco_pope_random.json").write_text("".join(
        json.dumps({"question_id": i, "image": "COCO_val2014_000000000310.jpg", "text": text, "label": label}) + "\n"
        for i, text, label in pope
    ))  # fmt: skip
    # COCO Captions: images + annotations (five captions an image in the release; two here)
    _save_photo(root, "val2014/COCO_val2014_000000000073.jpg", "rocket")
    (root / "captions_val2014.json").write_text(json.dumps({
        "images": [{"id": 42, "file_name": "COCO_val2014_000000000042.jpg", "height": 400, "width": 600},
                   {"id": 73, "file_name": "COCO_val2014_000000000073.jpg", "height": 427, "width": 640}],
        "annotations": [{"id": 1, "image_id": 42, "caption": PHOTOS["coffee"][1][0]},
                        {"id": 2, "image_id": 42, "caption": PHOTOS["coffee"][1][1]},
                        {"id": 3, "image_id": 73, "caption": PHOTOS["rocket"][1][0]},
                        {"id": 4, "image_id": 73, "caption": PHOTOS["rocket"][1][1]}],
    }))  # fmt: skip
    (root / "dataset.yaml").write_text("""\
eval:
  - {path: v2_questions.json, format: vqav2, annotations: v2_annotations.json, images: val2014}
  - {path: TextVQA_0.5.1_val.json, format: textvqa, images: train_images}
  - {path: val_v1.0.json, format: docvqa}
  - {path: test_human.json, format: chartqa, images: png}
  - {path: final_refcoco_testA.json, format: refcoco, images: coco}
  - {path: MMBench_DEV_EN.tsv, format: mmbench}
  - {path: coco_pope_random.json, format: pope, images: val2014}
  - {path: captions_val2014.json, format: coco_captions, images: val2014}
""")
    return root


QA = {  # photo: (question, answer) of the custom task "photo_qa" (RL prompts and its held-out benchmark)
    "astronaut": ("What is the person wearing?", "a space suit"),
    "coffee": ("What drink is this?", "coffee"),
    "chelsea": ("What animal is this?", "a cat"),
    "rocket": ("What stands on the launch pad?", "a rocket"),
    "camera": ("What is on the tripod?", "a camera"),
}
DAG_MANIFEST = """\
# A small real-photo dataset for the local DAG: LLaVA-array SFT data, a custom task with its own scorer.
tasks: {photo_qa: exact_match, photo_caption: cider_d}
sft: [llava.json]
rl: [{path: photo_rl.json, task: photo_qa}]
eval:
  - photo_eval.jsonl
  - {path: photo_qa_eval.jsonl, task: photo_qa, benchmark: photo_qa}
preferences: [preferences.jsonl]
"""


def write_dag_dataset(root: Path) -> Path:
    """The data directory of a local DAG run on real photos: SFT conversations as one LLaVA JSON array, RL prompts
    and held-out questions of the custom task photo_qa (also a LLaVA array and flat JSON lines), the benchmarks of
    eval_records, TRL-layout preferences and the dataset.yaml that ties them together."""
    root.mkdir(parents=True, exist_ok=True)
    paths = write_images(root)
    records = llava_records(paths)
    for name, (question, answer) in QA.items():
        records.append({"id": f"qa-{name}", "image": paths[name], "task": "photo_qa", "conversations": [
            {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]})  # fmt: skip
    _dump(root / "llava.json", records, jsonl=False)
    rl = [
        {"id": f"rl-{name}", "image": paths[name], "conversations": [
            {"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]}
        for name, (q, a) in QA.items()
    ]  # fmt: skip
    _dump(root / "photo_rl.json", rl, jsonl=False)
    held = [{"id": f"qa-eval-{name}", "image": paths[name], "question": q, "answer": a} for name, (q, a) in QA.items()]
    _dump(root / "photo_qa_eval.jsonl", held, jsonl=True)
    write_eval(root, paths)
    write_preferences(root, paths)
    (root / "dataset.yaml").write_text(DAG_MANIFEST)
    return root


def write_photo_lake(lake: Path) -> dict[str, str | None]:
    """A one-shard WebDataset lake of the photos in their awkward encodings with hand-written captions, plus the
    defects real lakes have: the same photo re-encoded (a near duplicate), a truncated JPEG, an exact duplicate and an
    empty caption. Returns {key: the reason
    clean_data must reject it for, or None}."""
    import tarfile

    lake.mkdir(parents=True, exist_ok=True)
    root = lake.parent / "photo-images"
    paths = write_images(root)
    members: list[tuple[str, bytes, str]] = []  # (key, image bytes with extension, caption)
    expected: dict[str, str | None] = {}
    for k, (name, path) in enumerate(paths.items()):
        members.append((f"{k:04d}.{path.rsplit('.', 1)[1]}", (root / path).read_bytes(), PHOTOS[name][1][0]))
        expected[f"{k:04d}"] = None
    gray = (root / "images" / "camera_gray.jpg").read_bytes()
    members.append(("0005.jpg", gray, PHOTOS["camera"][1][0]))  # the 16-bit PNG's photo again, as 8-bit JPEG
    expected["0005"] = "near_duplicate"
    members.append(("0006.jpg", (root / paths["astronaut"]).read_bytes()[:4000], PHOTOS["astronaut"][1][1]))
    expected["0006"] = "truncated_image"
    members.append(("0007.webp", (root / paths["chelsea"]).read_bytes(), PHOTOS["chelsea"][1][1]))
    expected["0007"] = "exact_duplicate"
    members.append(("0008.png", _png_bytes("coffee"), "   "))
    expected["0008"] = "empty_caption"
    with tarfile.open(lake / "00000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data, caption in members:
            key = member.split(".")[0]
            for name, payload in ((member, data), (f"{key}.txt", caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return expected
