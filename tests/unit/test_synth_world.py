"""The shapes world: determinism, exact ground truth, every injected defect with its claimed property."""

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import imagehash
import numpy as np
import pytest
from PIL import Image

from components.synth_world.lake import DEFECTS, EXTREME_MIN_RATIO, TINY_MAX_SIDE, write_lake, write_world
from components.synth_world.splits import ADVANCED_TYPES, BASIC_TYPES, PREFERENCE_KINDS
from components.synth_world.world import (
    COLORS,
    HACKING_SUFFIXES,
    QUESTION_TYPES,
    WORDS,
    Scene,
    altered_scene,
    ask,
    mentioned_objects,
    mentioned_words,
    random_scene,
    render,
    sample_clean_pairs,
    scene_for,
    text_corpus,
)

SIZES = dict(records_per_shard=100, eval_per_type=6, sft_records=40, preference_pairs=20)
MEMBER_RE = re.compile(r"^\d{9}\.(jpg|png|txt|json)$")
TOKEN_RE = re.compile(r"[^\W\d_]+|\d|[^\w\s]|_")  # words, single digits, punctuation
BOX_RE = re.compile(r"^\((\d+),(\d+)\),\((\d+),(\d+)\)$")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world")
    write_world(out, records=400, seed=7, **SIZES)
    return out


@pytest.fixture(scope="module")
def lake(world):
    """Ground-truth rows, each with its tar members added: image bytes, caption, metadata."""
    members = {}
    for shard in sorted((world / "lake").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                key, ext = info.name.split(".")
                members.setdefault(key, {"shard": shard.name})[ext] = tar.extractfile(info).read()
    rows = [json.loads(line) for line in (world / "ground_truth.jsonl").read_text().splitlines()]
    for row in rows:
        found = members[row["key"]]
        row["image"] = found[row["image_format"]]
        row["caption"] = found["txt"].decode("utf-8")
        row["meta"] = json.loads(found["json"])
        row["tar_shard"] = found["shard"]
    return {row["key"]: row for row in rows}


def _by_defect(lake, defect):
    return [row for row in lake.values() if row["defect"] == defect]


def _pairs(scene: dict) -> set[tuple[str, str]]:
    return {(o["color"], o["shape"]) for o in scene["objects"]}


def _decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_same_seed_gives_same_bytes_and_another_seed_differs(world, tmp_path):
    write_world(tmp_path / "again", records=400, seed=7, **SIZES)
    write_lake(tmp_path / "other" / "lake", records=400, seed=8, records_per_shard=100)
    files = sorted(p.relative_to(world) for p in world.rglob("*") if p.is_file())
    assert len(files) > 100
    assert files == sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*") if p.is_file())
    for rel in files:
        assert (world / rel).read_bytes() == (tmp_path / "again" / rel).read_bytes(), rel
    assert (world / "ground_truth.jsonl").read_bytes() != (tmp_path / "other" / "ground_truth.jsonl").read_bytes()


def test_ground_truth_covers_every_record_once_and_metadata_matches(world, lake):
    lines = (world / "ground_truth.jsonl").read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == len(lake) == 400
    assert keys == [f"{i:09d}" for i in range(400)]
    for row in lake.values():
        assert row["tar_shard"] == row["shard"] == f"{int(row['key']) // 100:05d}.tar"
        meta = row["meta"]
        assert meta["key"] == row["key"]
        assert meta["sha256"] == hashlib.sha256(row["image"]).hexdigest()
        assert (meta["width"], meta["height"]) == (row["scene"]["width"], row["scene"]["height"])
    assert sorted(p.name for p in (world / "lake").iterdir()) == [f"{i:05d}.tar" for i in range(4)]


def test_tar_members_are_safe_and_named_key_ext(world):
    for shard in (world / "lake").glob("*.tar"):
        with tarfile.open(shard) as tar:
            infos = tar.getmembers()
            assert len(infos) == 300
            for info in infos:
                assert info.isfile() and MEMBER_RE.match(info.name), info.name
                assert info.mtime == 0 and info.uid == 0 and info.mode == 0o644


def test_every_defect_class_has_a_handful_and_counts_agree(world, lake):
    counts = json.loads((world / "world.json").read_text())["lake"]["defects"]
    assert set(counts) == set(DEFECTS)
    for defect in DEFECTS:
        assert len(_by_defect(lake, defect)) == counts[defect] >= 6, defect
    assert len(_by_defect(lake, None)) == 400 - sum(counts.values())


def test_broken_files_are_broken_and_clean_files_decode(lake):
    assert all(row["image"] == b"" for row in _by_defect(lake, "zero_byte"))
    for defect in ("truncated", "corrupt"):
        for row in _by_defect(lake, defect):
            with pytest.raises((OSError, SyntaxError)):
                _decode(row["image"])
    for row in _by_defect(lake, "truncated"):  # a real image cut short, not noise
        assert row["image"][:2] == b"\xff\xd8" or row["image"][:8] == b"\x89PNG\r\n\x1a\n"
    formats = set()
    for row in _by_defect(lake, None):
        image = _decode(row["image"])
        formats.add(image.format)
        assert image.size == (row["scene"]["width"], row["scene"]["height"])
    assert formats == {"JPEG", "PNG"}


def test_sizes_of_tiny_extreme_and_clean_images(lake):
    for row in _by_defect(lake, "tiny"):
        width, height = _decode(row["image"]).size
        assert max(width, height) <= TINY_MAX_SIDE < 24
    for row in _by_defect(lake, "extreme_aspect"):
        width, height = _decode(row["image"]).size
        assert max(width, height) / min(width, height) >= EXTREME_MIN_RATIO and min(width, height) >= 24
    for row in _by_defect(lake, None):
        width, height = _decode(row["image"]).size
        assert 112 <= min(width, height) and max(width, height) <= 336 and max(width, height) <= 2 * min(width, height)


def test_duplicates_point_to_an_earlier_clean_original(lake):
    cross_shard = 0
    for defect in ("exact_duplicate", "near_duplicate"):
        for row in _by_defect(lake, defect):
            original = lake[row["duplicate_of"]]
            assert original["defect"] is None and original["key"] < row["key"]
            cross_shard += original["shard"] != row["shard"]
            same_bytes = row["meta"]["sha256"] == original["meta"]["sha256"]
            assert same_bytes == (defect == "exact_duplicate")
            distance = imagehash.phash(_decode(row["image"])) - imagehash.phash(_decode(original["image"]))
            assert distance <= 6, (row["key"], distance)
    assert cross_shard >= 1
    assert all(row["duplicate_of"] is None for row in lake.values() if "duplicate" not in str(row["defect"]))


def test_captions_match_scenes_exactly_where_clean_and_not_where_defective(lake):
    for row in _by_defect(lake, None) + _by_defect(lake, "exact_duplicate") + _by_defect(lake, "near_duplicate"):
        assert mentioned_objects(row["caption"]) == _pairs(row["scene"]), row["key"]
        assert mentioned_words(row["caption"]) == ({row["scene"]["word"]} if row["scene"]["word"] else set())
    for row in _by_defect(lake, "mismatched_caption"):
        # A mismatched caption names objects, none of which is really in the image.
        assert mentioned_objects(row["caption"]) and not (mentioned_objects(row["caption"]) & _pairs(row["scene"]))
    for row in _by_defect(lake, "unmentioned_text"):
        word = row["scene"]["word"]
        assert word in WORDS and word not in row["caption"]
        assert mentioned_objects(row["caption"]) == _pairs(row["scene"])
    assert all(row["caption"].strip() == "" for row in _by_defect(lake, "empty_caption"))
    for row in _by_defect(lake, "garbage_caption"):
        assert row["caption"].strip() and not mentioned_objects(row["caption"])
    with_words = [row for row in _by_defect(lake, None) if row["scene"]["word"]]
    assert 0.15 < len(with_words) / len(_by_defect(lake, None)) < 0.45


def test_answers_agree_with_rendered_scenes():
    rng = np.random.default_rng(3)
    for i in range(60):
        kind = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        scene = scene_for(rng, kind, 224, 160)
        image = np.asarray(render(scene))
        qa = ask(scene, kind, rng)
        assert qa is not None or kind == "color"  # colour needs a shape that occurs once
        if qa is None:
            continue
        question, answer = qa
        by_name = {o.name: o for o in scene.objects}
        if kind == "count":
            assert answer == str(len(scene.objects))
        elif kind == "color":
            (obj,) = [o for o in scene.objects if o.shape in question]
            assert answer == obj.color
        elif kind == "shape":
            (obj,) = [o for o in scene.objects if o.color in question]
            assert answer == obj.shape
        elif kind == "grounding":
            x1, y1, x2, y2 = map(int, BOX_RE.match(answer).groups())
            assert 0 <= x1 < x2 <= scene.width and 0 <= y1 < y2 <= scene.height
            (obj,) = [o for o in scene.objects if o.name in question]
            assert (x1, y1, x2, y2) == obj.box
            assert tuple(image[(y1 + y2) // 2, (x1 + x2) // 2]) == COLORS[obj.color]  # the box holds the shape
        elif kind == "relation":
            anchor = next(name for name in by_name if f"the {name}?" in question)
            axis = 0 if scene.arrangement == "row" else 1
            before = "left of" in question or "above" in question
            neighbours = [
                o for o in scene.ordered() if (o.box[axis] < by_name[anchor].box[axis]) == before and o.name != anchor
            ]
            assert answer == (neighbours[-1] if before else neighbours[0]).name
        elif kind == "position":
            obj = next(o for o in scene.objects if o.name in question)
            first = scene.ordered()[0] is obj
            assert (
                answer
                == {
                    ("row", True): "left",
                    ("row", False): "right",
                    ("column", True): "top",
                    ("column", False): "bottom",
                }[scene.arrangement, first]
            )
        elif kind == "ocr":
            assert answer == scene.word in WORDS
        elif kind == "caption":
            assert mentioned_objects(answer) == {(o.color, o.shape) for o in scene.objects}


def test_scene_round_trips_and_rejects_what_does_not_fit():
    rng = np.random.default_rng(0)
    scene = random_scene(rng, 200, 120, n_objects=3, word="cake")
    assert Scene.from_dict(json.loads(json.dumps(scene.to_dict()))) == scene
    for i in range(300):  # shapes and word boxes lie inside the picture, apart from each other
        width, height = int(rng.integers(56, 400)), int(rng.integers(56, 400))
        if max(width, height) > 2 * min(width, height):
            continue
        scene = random_scene(rng, width, height, word=WORDS[i % len(WORDS)] if i % 3 == 0 else None)
        boxes = [o.box for o in scene.objects] + ([scene.word_box] if scene.word else [])
        assert len({o.name for o in scene.objects}) == len(scene.objects)
        for j, a in enumerate(boxes):
            assert 0 <= a[0] < a[2] <= width and 0 <= a[1] < a[3] <= height
            for b in boxes[j + 1 :]:
                assert a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1], scene
    with pytest.raises(ValueError, match="does not fit"):
        random_scene(rng, 40, 40, word="lamp")
    with pytest.raises(ValueError, match="max_objects"):
        random_scene(rng, 112, 112, max_objects=5)


def test_heldout_splits(world):
    heldout = world / "heldout"
    evals = [json.loads(line) for line in (heldout / "eval.jsonl").read_text().splitlines()]
    assert {t: sum(r["type"] == t for r in evals) for t in QUESTION_TYPES} == dict.fromkeys(QUESTION_TYPES, 6)
    for row in evals:
        assert Image.open(heldout / row["image"]).size == (112, 112)
        if row["type"] == "grounding":
            x1, y1, x2, y2 = map(int, BOX_RE.match(row["answer"]).groups())
            assert 0 <= x1 < x2 <= 112 and 0 <= y1 < y2 <= 112
        if row["type"] == "count":
            assert row["answer"] in {"1", "2", "3"}
    sft = [json.loads(line) for line in (heldout / "sft.jsonl").read_text().splitlines()]
    assert len(sft) == 40 and {r["difficulty"] for r in sft} == {"basic", "advanced"}
    for row in sft:
        human, gpt = row["conversations"]
        assert human["from"] == "human" and human["value"].startswith("<image>\n") and gpt["from"] == "gpt"
        assert row["difficulty"] == ("basic" if row["type"] in BASIC_TYPES else "advanced")
        assert row["type"] in BASIC_TYPES + ADVANCED_TYPES and (heldout / row["image"]).is_file()
    rl = [json.loads(line) for line in (heldout / "rl.jsonl").read_text().splitlines()]
    assert len(rl) == 10 and {r["id"] for r in rl}.isdisjoint(r["id"] for r in sft)  # a quarter of sft's count
    assert {r["image"] for r in rl}.isdisjoint(r["image"] for r in sft)
    for row in rl:  # the sft format: the rl stage reads it with the same loader
        human, gpt = row["conversations"]
        assert human["value"].startswith("<image>\n") and gpt["from"] == "gpt" and (heldout / row["image"]).is_file()
    prefs = [json.loads(line) for line in (heldout / "preferences.jsonl").read_text().splitlines()]
    assert {p["kind"] for p in prefs} == set(PREFERENCE_KINDS) and len(prefs) == 20
    for p in prefs:
        assert p["chosen"] != p["rejected"] and (heldout / p["image"]).is_file()
        if p["kind"] == "hacking_bait":
            assert any(p["rejected"].endswith(f"{suffix}.") for suffix in HACKING_SUFFIXES)
            assert not p["rejected"].startswith(p["chosen"] + ",")
        if p["kind"] == "flowery_padding":
            assert p["chosen"] in p["rejected"] and len(p["rejected"]) > len(p["chosen"]) + 30
        if p["kind"] == "hallucinated_object":
            assert mentioned_objects(p["chosen"]) < mentioned_objects(p["rejected"])
    counts = json.loads((world / "world.json").read_text())["splits"]
    assert counts["images"] == len(list((heldout / "images").iterdir())) == 48 + 40 + 10 + 20


def test_text_corpus_covers_every_word_the_world_writes(world, lake):
    vocabulary = set(TOKEN_RE.findall(" ".join(text_corpus(50, seed=1)).lower()))
    heldout = world / "heldout"
    texts = [row["caption"] for row in _by_defect(lake, None)]
    for line in (heldout / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        texts += [row["question"], row["answer"]]
    for line in (heldout / "sft.jsonl").read_text().splitlines():
        texts += [turn["value"].removeprefix("<image>\n") for turn in json.loads(line)["conversations"]]
    for line in (heldout / "preferences.jsonl").read_text().splitlines():
        row = json.loads(line)
        texts += [row["prompt"], row["chosen"], row["rejected"]]
    used = set(TOKEN_RE.findall(" ".join(texts).lower()))
    assert used <= vocabulary, sorted(used - vocabulary)
    assert set(WORDS) | set(COLORS) | set("0123456789(),") <= vocabulary


def test_sample_clean_pairs_are_deterministic_and_captioned():
    first, again = sample_clean_pairs(4, seed=2), sample_clean_pairs(4, seed=2)
    assert [c for _, c in first] == [c for _, c in again]
    assert [np.asarray(i).tobytes() for i, _ in first] == [np.asarray(i).tobytes() for i, _ in again]
    for image, text in first:
        assert image.size == (112, 112) and 1 <= len(mentioned_objects(text)) <= 3


def test_bad_settings_are_rejected_with_the_field_named(tmp_path, world):
    with pytest.raises(ValueError, match="colour_count"):
        write_world(tmp_path / "w", records=10, colour_count=3)
    with pytest.raises(ValueError, match="image_size"):
        write_world(tmp_path / "w", records=10, image_size=(20, 20))
    with pytest.raises(ValueError, match="defect_rate"):
        write_lake(tmp_path / "l", records=10, seed=0, defect_rate=0.9)
    with pytest.raises(ValueError, match="already holds"):
        write_lake(world / "lake", records=10, seed=0)


def test_rapidocr_reads_the_drawn_words():
    from rapidocr import RapidOCR

    engine = RapidOCR()
    rng = np.random.default_rng(11)
    scenes = [scene_for(rng, "ocr", 112, 112) for _ in range(5)]
    # The text-direction classifier flips short words ("dog" -> "6op"); our words are always upright.
    read = [s.word in " ".join(engine(np.asarray(render(s)), use_cls=False).txts or ()).lower() for s in scenes]
    assert sum(read) >= 4, [s.word for s in scenes]


def test_altered_scenes_never_keep_a_real_object():
    """Every object changes and no altered (colour, shape) pair is one of the originals, for any scene."""
    rng = np.random.default_rng(11)
    for _ in range(3000):
        scene = random_scene(rng, 224, 224, max_objects=3)
        altered = altered_scene(scene, rng)
        original = {(o.color, o.shape) for o in scene.objects}
        changed = [(o.color, o.shape) for o in altered.objects]
        assert len(set(changed)) == len(changed) == len(scene.objects)
        assert not original & set(changed)


def test_lake_like_pairs_match_the_lake_distribution_and_mismatch_every_object():
    from components.synth_world.lake import NORMAL_SIDES, lake_like_pairs

    pairs = lake_like_pairs(40, seed=4, altered=3)
    low, high = NORMAL_SIDES
    for image, text, *mismatched in pairs:
        assert low <= min(image.size) and max(image.size) <= high and max(image.size) / min(image.size) <= 2
        assert len(mismatched) == 3
        for wrong in mismatched:
            assert mentioned_objects(wrong) and not mentioned_objects(wrong) & mentioned_objects(text)
    assert len({image.size for image, *_ in pairs}) > 10  # sizes vary like the lake's, not one square
