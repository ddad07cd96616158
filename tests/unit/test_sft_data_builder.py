"""sft's data builder: the templates give exact answers, selection drops by its rules, and every candidate and lake
record is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from components._shared.data.datasets import load_conversations
from components._shared.data.regions import Region
from components.sft import data_builder as B
from components.sft.config import BuildDataConfig, SftConfig
from tests.codebase import ROOT

CAPTION = 'A red circle, a blue square and a red triangle, with the word "cat".'
REGIONS = [
    Region("red circle", (0.05, 0.4, 0.25, 0.6)),
    Region("blue square", (0.4, 0.4, 0.6, 0.6)),
    Region("red triangle", (0.7, 0.4, 0.9, 0.6)),
    Region("cat", (0.4, 0.8, 0.6, 0.9)),
]


def _box(box):
    return "(" + ",".join(str(round(v * 100)) for v in box) + ")"


def _made(kinds, regions=REGIONS, caption=CAPTION, colors=None):
    templates = B.Templates(colors or {"circle": {"red", "green"}, "square": {"blue"}, "triangle": {"red"}}, seed=0)
    return [(c.kind, c.question, c.answer) for c in templates("ab12", caption, regions, kinds, _box)]


def test_templates_answer_exactly_from_the_regions():
    made = _made(["color", "shape", "count", "grounding", "position", "relation", "ocr"])
    answers = {(k, q): a for k, q, a in made}
    # colour: only nouns named once (circle, square, triangle: each once)
    assert sorted(a for (k, _), a in answers.items() if k == "color") == ["blue", "red", "red"]
    # shape: only colours named once (blue); red names two objects
    assert [(q, a) for (k, q), a in answers.items() if k == "shape"] in (
        [("What shape is the blue object?", "square")],
        [("Which shape is blue?", "square")],
    )
    assert answers[next(key for key in answers if key[0] == "count")] == "3"  # the word is not an object
    grounding = {
        q.rsplit("the ", 1)[1].split("?")[0].rstrip("."): a for (k, q), a in answers.items() if k == "grounding"
    }
    assert grounding == {"red circle": "(5,40,25,60)", "blue square": "(40,40,60,60)", "red triangle": "(70,40,90,60)"}
    assert answers[("position", "Is the red circle on the left or on the right?")] == "left"
    assert answers[("position", "Is the red triangle on the left or on the right?")] == "right"
    relations = [(q, a) for (k, q), a in answers.items() if k == "relation"]
    assert len(relations) == 2
    for q, a in relations:
        assert (q, a) in {
            ("What is to the left of the blue square?", "red circle"),
            ("What is to the right of the red circle?", "blue square"),
            ("What is to the left of the red triangle?", "blue square"),
            ("What is to the right of the blue square?", "red triangle"),
        }
    assert [a for (k, _), a in answers.items() if k == "ocr"] == ["cat"]


def test_overlapping_boxes_get_no_left_right_question_and_repeated_phrases_no_box():
    overlapping = [Region("red circle", (0.1, 0.1, 0.5, 0.5)), Region("blue square", (0.4, 0.2, 0.8, 0.6))]
    assert _made(["position", "relation"], overlapping, "A red circle and a blue square.") == []
    twice = [Region("red circle", (0.1, 0.1, 0.3, 0.3)), Region("red circle", (0.6, 0.1, 0.8, 0.3))]
    assert _made(["grounding", "color"], twice, "A red circle and a red circle.") == []


def test_counterfactuals_ask_for_an_absent_colour_and_a_removed_object():
    one = [Region("red circle", (0.1, 0.1, 0.3, 0.3)), Region("cat", (0.5, 0.5, 0.7, 0.6))]
    made = _made(["counterfactual"], one, 'A red circle, with the word "cat".', {"circle": {"red", "green"}})
    assert made == [
        ("counterfactual", "Is there a green circle in the image?", "no"),
        ("counterfactual", "If the red circle were removed, how many objects would be left?", "0"),
    ]
    # no colour the lake gives the noun is absent here: only the removal question
    assert [q for _, q, _ in _made(["counterfactual"], one, CAPTION, {"circle": {"red"}})] == [
        "If the red circle were removed, how many objects would be left?"
    ]


def _candidates(spec):
    """spec: [(image, kind, question)] -> candidates with answer 'a'."""
    return [B.Candidate(image, kind, question, "a") for image, kind, question in spec]


def _cfg(**over):
    base = {"min_counterfactual": 0.0, "max_type_share": 1.0, "dedup_similarity": 0.85}
    return BuildDataConfig(**{**base, **over})


def test_selection_keeps_each_types_top_share_and_the_harder_near_duplicate():
    cands = _candidates(
        [
            ("i1", "color", "What color is the circle?"),
            ("i2", "color", "What color is the square?"),
            ("i3", "color", "What color is the cross?"),
            ("i4", "color", "What color is the star?"),
            ("i1", "grounding", "Where is the red circle? Answer with its box."),
            ("i1", "grounding", "Where is the red circle? Answer with its box!"),
            ("i2", "grounding", "Where is the blue square? Answer with its box."),
            ("i3", "grounding", "Where is the green cross? Answer with its box."),
        ]  # fmt: skip
    )
    scores = [-1.0, -2.0, -3.0, -4.0, -0.5, -0.9, -3.0, -4.0]
    kept, dropped = B.select(cands, scores, [1] * 8, _cfg(keep_fraction=0.5))
    assert kept == [0, 1, 5]  # each type's top half; of the two near twins of image i1 the harder (-0.9) stays
    assert dropped == {2: B.LOW_SCORE, 3: B.LOW_SCORE, 4: B.NEAR_DUPLICATE, 6: B.LOW_SCORE, 7: B.LOW_SCORE}
    acc = B.accounting(cands, kept, dropped)
    assert acc["candidates"] == acc["kept"] + sum(acc["dropped"].values()) == 8
    assert acc["per_type"]["color"] == {"candidates": 4, "kept": 2, "dropped": {B.LOW_SCORE: 2}}
    with pytest.raises(AssertionError, match="8 candidates, 3 kept"):
        B.accounting(cands, kept, {**dropped, 0: B.LOW_SCORE})


def test_long_answers_type_quota_counterfactual_quota_and_the_record_cap():
    spec = [(f"i{k}", "caption", f"caption {k}") for k in range(6)]
    spec += [(f"i{k}", "color", f"color {k}") for k in range(2)]
    spec += [(f"i{k}", "counterfactual", f"cf {k}") for k in range(1)]
    cands = _candidates(spec)
    scores = [-float(k) for k in range(len(cands))]
    tokens = [1] * len(cands)
    tokens[0] = 500
    kept, dropped = B.select(cands, scores, tokens, _cfg(max_answer_tokens=120, max_type_share=0.5))
    assert dropped[0] == B.TOO_LONG
    # 5 captions, 2 colours, 1 counterfactual -> every type to m with m <= 0.5 x total: m = 3 (3 + 2 + 1 = 6)
    assert [cands[i].kind for i in kept].count("caption") == 3
    assert sorted(i for i, why in dropped.items() if why == B.TYPE_QUOTA) == [4, 5]  # the least likely captions
    kept, dropped = B.select(cands, scores, [1] * len(cands), _cfg(min_counterfactual=0.25))
    # 1 counterfactual may be at most 1/0.25 = 4 kept: 5 others dropped, the least likely of the largest types first
    assert len(kept) == 4 and 8 in kept
    assert list(dropped.values()).count(B.COUNTERFACTUAL_QUOTA) == 5
    kept, dropped = B.select(cands, scores, [1] * len(cands), _cfg(max_records=3))
    assert len(kept) == 3 and list(dropped.values()) == [B.RECORD_CAP] * 6
    assert B.accounting(cands, kept, dropped)["kept"] == 3


def test_impossible_quotas_are_refused_naming_the_setting():
    cands = _candidates([("i1", "caption", "c"), ("i2", "color", "d")])
    with pytest.raises(ValueError, match=r"max_type_share=0.3.*only 2 question type"):
        B.select(cands, [0.0, 0.0], [1, 1], _cfg(max_type_share=0.3))
    with pytest.raises(ValueError, match="min_counterfactual=0.1.*no counterfactual"):
        B.select(cands, [0.0, 0.0], [1, 1], _cfg(min_counterfactual=0.1))
    with pytest.raises(ValueError, match="'counterfactual' is not in build_data.templates"):
        BuildDataConfig(templates=["caption", "color", "shape", "count"], min_counterfactual=0.1)
    with pytest.raises(ValueError, match="quotas cannot add up"):
        BuildDataConfig(templates=["caption", "counterfactual"], max_type_share=0.3)
    assert SftConfig(build_data={"keep_fraction": 0.3}).ignored_settings() == [
        "build_data.keep_fraction: read by the sft_data step (build_data.enabled in a DAG) or `python -m "
        "components.sft.build_data`; the sft stage trains on --data"
    ]
    assert SftConfig(build_data={"keep_fraction": 0.3, "enabled": True}).ignored_settings() == []  # the step reads it


def test_build_data_writes_a_data_directory_and_accounts_for_every_candidate(tmp_path, tracking_env):
    env_cmd = [sys.executable, "-m"]
    world, clean, out = tmp_path / "world", tmp_path / "clean", tmp_path / "built"
    run = lambda *args: subprocess.run([*env_cmd, *args], capture_output=True, text=True, cwd=ROOT)  # noqa: E731
    done = run("pipelines.qvl.app", "lake", "synth", "--records", "30", "--sft-records", "10", "--out", str(world))
    assert done.returncode == 0, done.stderr
    done = run("components.clean_data", "--config", "pipelines/presets/tiny.yaml", "--lake-uri", str(world / "lake"),
               "--output-dir", str(clean))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (tmp_path / "secret.txt").write_text("not data")
    (world / "heldout" / "notes.txt").symlink_to(tmp_path / "secret.txt")  # a link out of --data: never carried
    done = run("components.sft.build_data", "--config", "pipelines/presets/tiny.yaml", "--clean-data", str(clean),
               "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(world / "heldout"), "--output-dir", str(out),
               "build_data.keep_fraction=0.5", "build_data.include_given=true")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not (out / "notes.txt").exists() and "notes.txt leads outside --data" in done.stdout
    assert "setting without effect" not in done.stderr and "mlflow-unsent" not in done.stderr  # every metric logged
    acc = json.loads((out / "build_accounting.json").read_text())
    assert acc["candidates"] == acc["kept"] + sum(acc["dropped"].values())
    assert acc["dropped"][B.LOW_SCORE] >= acc["candidates"] // 3
    assert acc["lake"]["records"] == acc["lake"]["used"] + sum(acc["lake"]["not_used"].values())
    dropped = [json.loads(line) for line in (out / "built_dropped.jsonl").read_text().splitlines()]
    assert len(dropped) == sum(acc["dropped"].values()) and {d["reason"] for d in dropped} == set(acc["dropped"])
    records = load_conversations(out)
    built = [r for r in records if r["id"].startswith("built-")]
    assert len(built) == acc["kept"] and len(records) == acc["kept"] + 10  # the given ten beside them
    assert all((out / r["images"][0]).is_file() for r in built)
    assert {r["type"] for r in built} >= {"caption", "grounding", "counterfactual"}
    assert (out / "eval.jsonl").read_bytes() == (world / "heldout" / "eval.jsonl").read_bytes()
    again = tmp_path / "again"  # an earlier build as --data: its own files are not carried over
    done = run("components.sft.build_data", "--config", "pipelines/presets/tiny.yaml", "--clean-data", str(clean),
               "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(out), "--output-dir", str(again),
               "build_data.max_records=5")  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (again / "sft.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and len(list((again / "built_images").iterdir())) == len({r["image"] for r in rows})
    refused = run("components.sft.build_data", "--config", "pipelines/presets/tiny.yaml", "--clean-data", str(clean),
                  "--base-model", "builtin:tiny-qwen2_5-vl", "--data", str(out), "--output-dir", str(tmp_path / "b3"),
                  "build_data.include_given=true")  # fmt: skip
    assert refused.returncode == 2 and "is an earlier build (build_accounting.json)" in refused.stderr
