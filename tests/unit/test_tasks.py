"""Tasks: the synthetic world's types scored as before, custom tasks by their scorer, per-benchmark summaries."""

import pytest

from components._shared.data.metrics import cider_d, majority_answer
from components._shared.data.tasks import (
    BUILTIN_TASKS,
    SCORERS,
    SYNTHETIC_TASKS,
    majority_baseline,
    parses,
    resolve,
    reward,
    score,
    summarize,
)

CAPTIONS = {
    "a": 'An image of a blue cross on the left and a yellow circle on the right. The word "boat" is written.',
    "b": "An image of a red square on the top and a green triangle on the bottom.",
    "c": 'An image of a purple star in the center. The word "fish" is written in the image.',
}


def _rec(i, qtype, prediction, answer, **extra):
    return {"id": str(i), "type": qtype, "prediction": prediction, "answer": answer, **extra}


def test_the_synthetic_types_are_builtin_tasks_scored_as_before():
    assert SYNTHETIC_TASKS == ("caption", "color", "count", "shape", "position", "relation", "grounding", "ocr")
    assert score("Yellow.", {"type": "color", "answer": "yellow"}) == 1.0
    assert score("3", {"type": "count", "answer": "3"}) == 1.0
    assert score("(10,30),(50,70)", {"type": "grounding", "answer": "(9,29),(51,71)"}) == 1.0
    assert score("fsh", {"type": "ocr", "answer": "fish"}) == 0.0  # exact match; ANLS is reported separately
    assert score("An image.", {"type": "caption", "answer": "an image"}) == 1.0


def test_unknown_task_names_the_fix():
    with pytest.raises(ValueError, match=r"unknown task 'colour'.*dataset.yaml.*tasks: \{colour: SCORER\}"):
        score("red", {"id": "r1", "type": "colour", "answer": "red"})
    with pytest.raises(ValueError, match="unknown scorer 'bleu'"):
        resolve("captions", {"captions": "bleu"})


def test_a_custom_task_is_scored_by_its_declared_scorer():
    chart = {"id": "c1", "type": "chart_value", "scorer": "relaxed_accuracy", "answer": "40"}
    assert score("41.9", chart) == 1.0 and score("42.1", chart) == 0.0
    assert resolve("chart_value", {"chart_value": "relaxed_accuracy"}).scorer == "relaxed_accuracy"
    assert resolve("anls").scorer == "anls"  # a scorer's own name is a task
    assert not resolve("anls").builtin and BUILTIN_TASKS["ocr"].builtin


def test_reward_gives_partial_credit_where_the_scorer_has_one():
    box = {"id": "g", "type": "refcoco", "scorer": "grounding", "answer": "(0,0),(10,10)"}
    assert score("(0,0),(10,5)", box) == 1.0  # IoU 0.5 is a hit
    assert reward("(0,0),(10,5)", box) == pytest.approx(0.5)
    assert score("(0,0),(10,4)", box) == 0.0 and reward("(0,0),(10,4)", box) == pytest.approx(0.4)
    assert parses("(0,0),(10,4)", box) and not parses("top left", box)
    mc = {"id": "m", "type": "mmbench", "scorer": "multiple_choice", "answer": "B", "choices": {"A": "cat", "B": "dog"}}
    assert parses("(B)", mc) and not parses("maybe", mc)
    assert parses("anything", {"type": "docvqa", "scorer": "anls", "answer": "x"})


RECORDS = [
    _rec(1, "color", "Yellow.", "yellow"),
    _rec(2, "color", "blue", "yellow"),
    _rec(3, "count", "3", "3"),
    _rec(4, "grounding", "(9,29),(51,71)", "(9,29),(51,71)"),
    _rec(5, "grounding", "left", "(9,29),(51,71)"),
    _rec(6, "ocr", "fsh", "fish"),
    _rec(7, "ocr", "boat", "boat"),
    _rec(8, "caption", CAPTIONS["a"], CAPTIONS["a"]),
    _rec(9, "caption", "A dog.", CAPTIONS["b"]),
    _rec(10, "caption", CAPTIONS["c"], CAPTIONS["c"]),
]


def test_summarize_the_synthetic_world_keeps_its_metric_names_and_values():
    out = summarize(RECORDS)
    cider = cider_d({r["id"]: r["prediction"] for r in RECORDS[7:]}, {r["id"]: [r["answer"]] for r in RECORDS[7:]})[0]
    assert out == pytest.approx(
        {
            "exact_match/color": 0.5,
            "exact_match/count": 1.0,
            "exact_match/grounding": 0.5,
            "exact_match/ocr": 0.5,
            "exact_match/caption": 2 / 3,
            "count/color": 2.0,
            "count/count": 1.0,
            "count/grounding": 2.0,
            "count/ocr": 2.0,
            "count/caption": 3.0,
            "vqa_exact_match": 4 / 7,  # 1+0+1+1+0+0+1 over the 7 non-caption records
            "grounding_accuracy": 0.5,
            "anls": (0.75 + 1.0) / 2,
            "cider_d": cider,
        }
    )
    assert cider > 3.0


def test_summarize_per_task_and_per_benchmark():
    rows = [
        _rec(1, "docvqa", "Invoice", "invoice", scorer="anls", benchmark="docvqa"),  # ANLS 1
        _rec(2, "docvqa", "invoce", "invoice", scorer="anls", benchmark="docvqa"),  # 1 - 1/7
        _rec(3, "pope", "Yes, there is.", "yes", scorer="yes_no", benchmark="pope"),
        _rec(4, "pope", "No.", "yes", scorer="yes_no", benchmark="pope"),
        _rec(5, "pope", "No", "no", scorer="yes_no", benchmark="pope"),
        _rec(6, "color", "red", "red", benchmark="heldout"),
    ]
    out = summarize(rows)
    assert out["task/docvqa"] == pytest.approx((1 + 6 / 7) / 2)
    assert out["benchmark/docvqa"] == pytest.approx((1 + 6 / 7) / 2) and out["benchmark/docvqa/count"] == 2
    assert out["task/pope"] == pytest.approx(2 / 3)
    # POPE's table: 1 yes predicted, 2 yes references, 1 true positive -> precision 1, recall 1/2, F1 2/3
    assert out["benchmark/pope/precision"] == 1.0 and out["benchmark/pope/recall"] == 0.5
    assert out["benchmark/pope/f1"] == pytest.approx(2 / 3) and out["benchmark/pope/yes_ratio"] == pytest.approx(1 / 3)
    assert out["task/pope/f1"] == pytest.approx(2 / 3)
    assert out["exact_match/color"] == 1.0 and out["benchmark/heldout"] == 1.0
    assert out["vqa_exact_match"] == 1.0  # only the builtin rows: a benchmark's own scale is not mixed in
    assert "count/docvqa" in out and "grounding_accuracy" not in out
    assert out["anls"] == pytest.approx((1 + 6 / 7) / 2)  # the suite's ANLS covers DocVQA-style tasks too
    boxes = [
        _rec(7, "grounding", "(0,0),(10,10)", "(0,0),(10,10)"),  # the synthetic world's: a hit
        _rec(8, "refcoco", "[0, 0, 10, 4]", "(0,0),(10,10)", scorer="grounding", benchmark="refcoco"),  # IoU 0.4
        _rec(9, "ocr", "fsh", "fish"),  # ANLS 0.75
    ]
    out = summarize(rows + boxes)
    assert out["grounding_accuracy"] == 0.5 and out["exact_match/grounding"] == 1.0 and out["benchmark/refcoco"] == 0
    assert out["anls"] == pytest.approx((1 + 6 / 7 + 0.75) / 3)


def test_summarize_uses_a_rows_given_score():
    assert summarize([_rec(1, "color", "red", "blue", score=1.0)])["exact_match/color"] == 1.0


def test_summarize_omits_absent_types():
    out = summarize([_rec(1, "shape", "circle", "circle")])
    assert out == {"exact_match/shape": 1.0, "count/shape": 1.0, "vqa_exact_match": 1.0}


def test_summarize_errors():
    with pytest.raises(ValueError, match="'colour'"):
        summarize([_rec(1, "colour", "red", "red")])
    with pytest.raises(ValueError, match="prediction"):
        summarize([{"id": "1", "type": "color", "answer": "red"}])
    with pytest.raises(ValueError, match="none"):
        summarize([])
    with pytest.raises(ValueError, match="duplicate"):
        summarize([_rec(1, "caption", "a", "a"), _rec(1, "caption", "b", "b")])


def test_every_scorer_is_a_callable_scoring_in_the_unit_interval():
    record = {"id": "x", "answer": "B", "answers": ["B"], "choices": {"A": "no", "B": "yes"}}
    for name, scorer in SCORERS.items():
        if name == "grounding":
            value = scorer.score("(0,0),(1,1)", {"id": "x", "answer": "(0,0),(1,1)"})
        elif name == "yes_no":
            value = scorer.score("yes", {"id": "x", "answer": "yes"})
        else:
            value = scorer.score("B", record)
        assert value == 1.0, name


def test_majority_answer_ties_are_deterministic():
    assert majority_answer(["Red", "blue", "red.", "blue"]) == "blue"  # 2-2 tie -> lexicographic
    assert majority_answer(["3", "2", "3"]) == "3"
    assert majority_answer([]) == ""


def test_majority_baseline():
    train = {
        "color": ["yellow", "Yellow.", "blue"],
        "count": ["2", "3", "3"],
        "grounding": ["(9,29),(51,71)", "(9,29),(51,71)", "(0,0),(5,5)"],
        "ocr": ["fish"],
        "widgets": ["7", "7", "3"],
        # no "shape" answers: the baseline predicts "" and scores 0
    }
    evals = [
        _rec(1, "color", "", "yellow"),
        _rec(2, "color", "", "blue"),
        _rec(3, "count", "", "3"),
        _rec(4, "count", "", "2"),
        _rec(5, "grounding", "", "(10,30),(50,70)"),
        _rec(6, "ocr", "", "boat"),
        _rec(7, "shape", "", "circle"),
        _rec(8, "caption", "", "An image."),
        _rec(9, "widgets", "", "7", scorer="exact_match"),
        _rec(10, "refs", "", "(0,0),(1,1)", scorer="grounding"),  # no baseline for boxes of a custom task
    ]
    out = majority_baseline(train, evals)
    assert out == pytest.approx(
        {
            "majority/color": 0.5,
            "majority/count": 0.5,
            "majority/grounding": 1.0,
            "majority/ocr": 0.0,
            "majority/shape": 0.0,
            "majority/caption": 0.0,
            "majority/widgets": 1.0,
            "vqa_majority_baseline": 3 / 7,
        }
    )


def test_majority_baseline_errors():
    with pytest.raises(ValueError, match="'colour'"):
        majority_baseline({}, [_rec(1, "colour", "", "red")])
