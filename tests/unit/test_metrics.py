"""Metric primitives: exact match, box IoU/grounding, ANLS, CIDEr-D, the majority answer, the paired bootstrap."""

import math

import pytest

from components._shared.data.metrics import (
    anls,
    box_iou,
    cider_d,
    cider_tokens,
    exact_match,
    grounding_correct,
    levenshtein,
    normalize_answer,
    paired_bootstrap,
    parse_box,
)

# --- exact match ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Yellow", "yellow"),
        ("  yellow.  ", "yellow"),
        ('"fish"', "fish"),
        ('"Fish".', "fish"),
        ("'fish.'", "fish"),
        ("yellow   \n triangle", "yellow triangle"),
        ("3!", "3"),
        ("(9,29),(51,71)", "(9,29),(51,71)"),
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match():
    assert exact_match("Yellow.", "yellow") == 1.0
    assert exact_match(" LEFT ", "left") == 1.0
    assert exact_match("yellow triangle", "yellow  Triangle.") == 1.0
    assert exact_match("3", "three") == 0.0
    assert exact_match("a yellow circle", "yellow circle") == 0.0


def test_normalize_rejects_non_string():
    with pytest.raises(TypeError, match="None"):
        normalize_answer(None)


# --- boxes and grounding ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("(9,29),(51,71)", (9.0, 29.0, 51.0, 71.0)),
        ("( 9 , 29 ) , ( 51 , 71 )", (9.0, 29.0, 51.0, 71.0)),
        ("<|box_start|>(9,29),(51,71)<|box_end|>", (9.0, 29.0, 51.0, 71.0)),
        ("[9, 29, 51, 71]", (9.0, 29.0, 51.0, 71.0)),
        ('{"bbox_2d": [9.5, 29, 51, 71.25]}', (9.5, 29.0, 51.0, 71.25)),
        ("(51,71),(9,29)", (9.0, 29.0, 51.0, 71.0)),  # reordered
        ("(51,29),(9,71)", (9.0, 29.0, 51.0, 71.0)),
        ("first (1,2),(3,4) then [5,6,7,8]", (1.0, 2.0, 3.0, 4.0)),
        ("first [5,6,7,8] then (1,2),(3,4)", (5.0, 6.0, 7.0, 8.0)),
    ],
)
def test_parse_box(text, expected):
    assert parse_box(text) == expected


@pytest.mark.parametrize("text", ["", "left", "(9,29)", "(9,29),(51)", "[1, 2, 3]", "(a,b),(c,d)"])
def test_parse_box_failures(text):
    assert parse_box(text) is None


def test_box_iou_known_values():
    assert box_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    # half overlap along x: intersection 5x10=50, union 100+100-50=150
    assert box_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    # quarter overlap: intersection 5x5=25, union 175
    assert box_iou((0, 0, 10, 10), (5, 5, 15, 15)) == pytest.approx(25 / 175)
    assert box_iou((0, 0, 10, 10), (20, 20, 30, 30)) == 0.0
    assert box_iou((0, 0, 10, 10), (10, 0, 20, 10)) == 0.0  # touching edges
    assert box_iou((0, 0, 10, 10), (2, 2, 4, 4)) == pytest.approx(4 / 100)  # contained
    assert box_iou((10, 10, 0, 0), (0, 0, 10, 10)) == 1.0  # unordered corners
    assert box_iou((1, 1, 1, 1), (1, 1, 1, 1)) == 0.0  # no area


def test_box_iou_rejects_bad_boxes():
    with pytest.raises(ValueError, match=r"\(1, 2, 3\)"):
        box_iou((1, 2, 3), (0, 0, 1, 1))
    with pytest.raises(ValueError, match="nan"):
        box_iou((0, 0, 1, 1), (0, 0, float("nan"), 1))


def test_grounding_threshold_edge():
    gold = "(0,0),(10,10)"
    assert box_iou((0, 0, 10, 10), (0, 0, 10, 5)) == 0.5
    assert grounding_correct("(0,0),(10,5)", gold) == 1.0  # IoU exactly 0.5 counts
    assert grounding_correct("(0,0),(10,4)", gold) == 0.0  # IoU 0.4
    assert grounding_correct("(0,0),(10,4)", gold, threshold=0.4) == 1.0
    assert grounding_correct("The box is [0, 0, 10, 10].", gold) == 1.0
    assert grounding_correct("(9,29),(51,71)", "(9,29),(51,71)") == 1.0
    assert grounding_correct("(60,60),(90,90)", "(9,29),(51,71)") == 0.0


def test_grounding_parse_failures():
    assert grounding_correct("on the left", "(9,29),(51,71)") == 0.0
    with pytest.raises(ValueError, match="'on the left'"):
        grounding_correct("(9,29),(51,71)", "on the left")
    with pytest.raises(ValueError, match="1.5"):
        grounding_correct("(0,0),(1,1)", "(0,0),(1,1)", threshold=1.5)


# --- ANLS -------------------------------------------------------------------------------------


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "") == 3
    assert levenshtein("fish", "fish") == 0
    assert levenshtein("fsh", "fish") == 1
    assert levenshtein("flaw", "lawn") == 2


def test_anls_known_values():
    assert anls("fish", "fish") == 1.0
    assert anls(" FISH ", "fish") == 1.0
    assert anls("fsh", "fish") == pytest.approx(0.75)
    assert anls("fis", "fish") == pytest.approx(0.75)
    assert anls("fosh", "fish") == pytest.approx(0.75)
    assert anls("fxxh", "fish") == 0.0  # NL = 0.5 = tau -> 0
    assert anls("boat", "fish") == 0.0
    assert anls("fxxh", "fish", tau=0.6) == pytest.approx(0.5)
    assert anls("", "") == 1.0
    assert anls("fsh", ["boat", "fish"]) == pytest.approx(0.75)  # max over golds
    assert anls("boats", ["boat", "fish"]) == pytest.approx(0.8)


def test_anls_bad_input():
    with pytest.raises(ValueError, match=r"\[\]"):
        anls("fish", [])
    with pytest.raises(ValueError, match="0.0"):
        anls("fish", "fish", tau=0.0)


# --- CIDEr-D ----------------------------------------------------------------------------------

CAPTIONS = {
    "a": 'An image of a blue cross on the left and a yellow circle on the right. The word "boat" is written.',
    "b": "An image of a red square on the top and a green triangle on the bottom.",
    "c": 'An image of a purple star in the center. The word "fish" is written in the image.',
    "d": "An image of two orange circles next to a blue square.",
}


def test_cider_tokens():
    assert cider_tokens('The word "Boat" is written.') == ["the", "word", "boat", "is", "written"]
    assert cider_tokens("left,right") == ["left", "right"]


def test_cider_d_identical_beats_wrong():
    refs = {k: [v] for k, v in CAPTIONS.items()}
    perfect, perfect_per = cider_d(dict(CAPTIONS), refs)
    wrong = dict(CAPTIONS, a="A photo of a dog running on the grass.")
    worse, worse_per = cider_d(wrong, refs)
    assert perfect_per["a"] > 5.0
    assert worse_per["a"] < 0.5
    assert worse_per["b"] == pytest.approx(perfect_per["b"])
    assert worse < perfect
    assert perfect == pytest.approx(sum(perfect_per.values()) / 4)


def test_cider_d_hand_checked_value():
    # Corpus of 2 images, so idf = log 2 - log df. df: a=2; b, d, "a b", "a d" = 1.
    # Image 1, cand "a b c" vs ref "a b": weights a=0, b=c=L, bigrams L (L = log 2).
    #   n=1: L^2 / (L*sqrt2 * L) = 1/sqrt2; n=2: the same; n=3,4: 0. Length (bigrams) 2 vs 1.
    #   score = 10 * (2/sqrt2)/4 * exp(-1/72).
    # Image 2, cand == ref "a d": n=1 and n=2 are 1, n=3,4 are 0 -> 10 * 2/4 = 5.
    score, per_id = cider_d({"1": "A b, c.", "2": "a d"}, {"1": ["a b"], "2": ["a d"]})
    expected_1 = 10 * (2 / math.sqrt(2)) / 4 * math.exp(-1 / 72)
    assert per_id["1"] == pytest.approx(expected_1)
    assert per_id["1"] == pytest.approx(3.48677, abs=1e-5)
    assert per_id["2"] == pytest.approx(5.0)
    assert score == pytest.approx((expected_1 + 5.0) / 2)


def test_cider_d_clipping_and_multiple_refs():
    # Repeating a reference word does not raise the numerator past the reference weight (clipping),
    # and a second reference that shares nothing halves the per-image score.
    base = cider_d({"1": "a b", "2": "c d"}, {"1": ["a b"], "2": ["c d"]})[1]["1"]
    two_refs = cider_d({"1": "a b", "2": "c d"}, {"1": ["a b", "x y"], "2": ["c d"]})[1]["1"]
    assert base == pytest.approx(5.0)
    assert two_refs == pytest.approx(2.5)
    repeated = cider_d({"1": "b b", "2": "c d"}, {"1": ["a b"], "2": ["c d"]})[1]["1"]
    # n=1: min(2L, L) * L / (2L * sqrt2 L) = 1/(2 sqrt2); n=2: "b b" not in ref -> 0.
    assert repeated == pytest.approx(10 * (1 / (2 * math.sqrt(2))) / 4)


def test_cider_d_single_image_corpus_scores_zero():
    assert cider_d({"1": "a b"}, {"1": ["a b"]}) == (0.0, {"1": 0.0})


def test_cider_d_errors():
    with pytest.raises(ValueError, match=r"only in candidates \['x'\]"):
        cider_d({"1": "a", "x": "b"}, {"1": ["a"], "2": ["b"]})
    with pytest.raises(ValueError, match="'2'"):
        cider_d({"1": "a", "2": "b"}, {"1": ["a"], "2": []})
    with pytest.raises(ValueError, match="none"):
        cider_d({}, {})


def test_cider_d_matches_pycocoevalcap():
    # pycocoevalcap's cider_scorer.py carries vrama91's clipping and Gaussian penalty: it is CIDEr-D.
    scorer_mod = pytest.importorskip("pycocoevalcap.cider.cider_scorer")
    cands = dict(CAPTIONS, a="An image of a blue cross and a yellow circle. The word boat is written.")
    cands["d"] = "two orange circles orange circles and a blue square"
    refs = {k: [v, "an image of shapes"] for k, v in CAPTIONS.items()}
    refs["b"].append("a red square above a green triangle")
    scorer = scorer_mod.CiderScorer(n=4, sigma=6.0)
    for key in CAPTIONS:
        scorer += (" ".join(cider_tokens(cands[key])), [" ".join(cider_tokens(r)) for r in refs[key]])
    ref_score, ref_scores = scorer.compute_score()
    score, per_id = cider_d(cands, refs)
    assert score == pytest.approx(float(ref_score), rel=1e-9)
    assert [per_id[k] for k in CAPTIONS] == pytest.approx([float(s) for s in ref_scores], rel=1e-9)


# --- paired before/after change ---------------------------------------------------------------


def test_paired_bootstrap_separates_a_consistent_gain_from_a_reshuffle():
    before = [0.0] * 780 + [1.0] * 20
    gain = paired_bootstrap(before, [1.0] * 20 + [0.0] * 760 + [1.0] * 20)  # 20 more right, none lost
    assert gain["gain"] == pytest.approx(0.025) and (gain["improved"], gain["worsened"]) == (20, 0)
    assert 0 < gain["ci_low"] < 0.025 < gain["ci_high"] < 0.05
    # the same +0.025 made of 120 gains and 100 losses is not a supported gain
    mixed = paired_bootstrap([0.0] * 120 + [1.0] * 100 + [0.0] * 580, [1.0] * 120 + [0.0] * 100 + [0.0] * 580)
    assert mixed["gain"] == pytest.approx(0.025) and mixed["ci_low"] < 0 < mixed["ci_high"]
    assert paired_bootstrap([0.5] * 10, [0.5] * 10) == {
        "gain": 0,
        "ci_low": 0,
        "ci_high": 0,
        "improved": 0,
        "worsened": 0,
    }


def test_paired_bootstrap_refuses_unpaired_input():
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap([1.0], [0.0], confidence=1.5)
