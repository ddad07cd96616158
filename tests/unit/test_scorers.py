"""Each benchmark scorer against values worked out by hand from the benchmark's own definition."""

import pytest

from components._shared.data import scorers as S


def rec(answer=None, **fields):
    return {"id": "r", **({"answer": answer} if answer is not None else {}), **fields}


# --- VQAv2 / TextVQA: min(#humans/3, 1) averaged over the 10 leave-one-out subsets ----------------------------


@pytest.mark.parametrize(("matches", "expected"), [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_accuracy_over_ten_human_answers(matches, expected):
    # k matches among 10: the 10-k subsets leaving out a non-match see k (min(k/3,1)); the k others see k-1
    answers = ["two"] * matches + ["three"] * (10 - matches)
    assert S.vqa_accuracy("2", rec(answers=answers)) == pytest.approx(expected)


def test_vqa_normalisation_follows_the_official_script():
    assert S.vqa_normalize("The Dog!") == "dog"
    assert S.vqa_normalize("dont") == "don't"
    assert S.vqa_normalize("two") == "2"
    assert S.vqa_normalize("1,000") == "1000"  # a comma between digits: punctuation is dropped, not spaced
    assert S.vqa_normalize("red/white") == "red white"
    assert S.vqa_normalize("3.5") == "3.5" and S.vqa_normalize("yes.") == "yes"
    assert S.vqa_accuracy("A dog.", rec(answers=["dog"] * 3 + ["cat"] * 7)) == pytest.approx(0.9)
    assert S.vqa_accuracy("dog", rec("dog")) == 1.0  # one reference: exact match after normalisation


# --- DocVQA: ANLS, threshold 0.5 ---------------------------------------------------------------------------


def test_anls_by_hand():
    # "invoce" vs "invoice": distance 1 over length 7 -> 1 - 1/7; the best of several references counts
    assert S.anls("invoce", rec(answers=["invoice", "bill"])) == pytest.approx(6 / 7)
    assert S.anls("INVOICE ", rec("invoice")) == 1.0
    assert S.anls("inv", rec("invoice")) == 0.0  # distance 4/7 >= 0.5 -> 0


# --- ChartQA: relaxed accuracy, 5% -------------------------------------------------------------------------


def test_relaxed_accuracy_by_hand():
    assert S.relaxed_accuracy("41.9", rec("40")) == 1.0  # |41.9 - 40| / 40 = 4.75%
    assert S.relaxed_accuracy("42.1", rec("40")) == 0.0  # 5.25%
    assert S.relaxed_accuracy("39%", rec("0.4")) == 1.0  # a trailing % divides by 100: 0.39 vs 0.4 is 2.5%
    assert S.relaxed_accuracy("37%", rec("0.4")) == 0.0  # 7.5%
    assert S.relaxed_accuracy("0", rec("0")) == 1.0 and S.relaxed_accuracy("0.01", rec("0")) == 0.0
    assert S.relaxed_accuracy("Yes", rec("yes")) == 1.0 and S.relaxed_accuracy("no", rec("yes")) == 0.0


# --- MMBench / MMMU: the option a free-form answer picks ---------------------------------------------------

CHOICES = {"A": "a cat", "B": "a dog", "C": "a red bicycle", "D": "nothing"}


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("The answer is (C).", "C"),
        ("Answer: D", "D"),
        ("I think it is C because of the wheels.", "C"),
        ("(A) is wrong, so the answer is (B)", "B"),  # several bracketed letters: the last one
        ("The picture clearly shows a red bicycle leaning on a wall", "C"),  # > 5 words: the option's text
        ("a red bicycle", None),  # 3 words: too short to match by text (MMMU's rule)
        ("no idea", None),
    ],
)
def test_parse_choice(response, letter):
    assert S.parse_choice(response, CHOICES) == letter


def test_multiple_choice_scores_the_parsed_letter():
    record = rec("C", choices=CHOICES)
    assert S.multiple_choice("The answer is (C).", record) == 1.0
    assert S.multiple_choice("no idea", record) == 0.0
    with pytest.raises(ValueError, match="needs 'choices'"):
        S.multiple_choice("A", rec("A"))
    with pytest.raises(ValueError, match="not one of the options"):
        S.multiple_choice("A", rec("E", choices=CHOICES))


# --- POPE: yes/no ------------------------------------------------------------------------------------------


def test_pope_parse():
    assert S.yes_no("Yes, there is a dog.") == "yes"
    assert S.yes_no("There is no dog in the image.") == "no"
    assert S.yes_no("No") == "no"
    assert S.yes_no("I do not see one. But yes") == "no"  # only the first sentence counts
    assert S.yes_no_accuracy("No, there is not.", rec("no")) == 1.0
    with pytest.raises(ValueError, match="yes/no answers"):
        S.yes_no_accuracy("yes", rec("maybe"))


# --- RefCOCO: grounding at IoU 0.5, the family's box format ----------------------------------------------


def test_predicted_boxes_in_every_qwen_form():
    assert S.parse_predicted_box('```json\n[{"bbox_2d": [10, 20, 110, 220], "label": "dog"}]\n```') == (
        10,
        20,
        110,
        220,
    )
    assert S.parse_predicted_box("<|box_start|>(500,250),(100,50)<|box_end|>") == (100, 50, 500, 250)
    assert S.parse_predicted_box("the box is [1, 2, 3, 4]") == (1, 2, 3, 4)
    assert S.parse_predicted_box("somewhere left") is None


def test_grounding_reads_the_prediction_in_the_family_convention():
    # a 1000 x 500 photo seen by the model at 812 x 406; the dog is at (100, 50)-(500, 250) in photo pixels
    frame = {"image_size": (1000, 500), "model_size": (812, 406), "box": [100, 50, 500, 250]}
    qwen25 = {**frame, "box_convention": "absolute"}  # pixels of the 812 x 406 image: x 81.2..406, y 40.6..203
    assert S.grounding('[{"bbox_2d": [81.2, 40.6, 406, 203]}]', rec(**qwen25)) == 1.0
    assert S.grounding_iou('[{"bbox_2d": [81.2, 40.6, 406, 203]}]', rec(**qwen25)) == pytest.approx(1.0)
    qwen3 = {**frame, "box_convention": "relative_1000"}  # thousandths: x 100..500, y 100..500
    assert S.grounding_iou('[{"bbox_2d": [100, 100, 500, 500]}]', rec(**qwen3)) == pytest.approx(1.0)
    # the same numbers read as absolute pixels would be another box: IoU of (123,123)-(616,616)*... by hand
    shifted = S.grounding_iou('[{"bbox_2d": [100, 100, 500, 500]}]', rec(**qwen25))
    # (123.15, 123.15)-(615.76, 615.76) in photo pixels vs (100,50)-(500,250): overlap (123.15..500) x (123.15..250)
    inter = (500 - 100 * 1000 / 812) * (250 - 100 * 500 / 406)
    union = 400 * 200 + (400 * 1000 / 812) * (400 * 500 / 406) - inter
    assert shifted == pytest.approx(inter / union)
    assert S.grounding("no box", rec(**qwen3)) == 0.0
    with pytest.raises(ValueError, match="box_convention"):
        S.grounding("[1, 2, 3, 4]", rec(box=[1, 2, 3, 4]))


def test_grounding_without_a_pixel_box_compares_text_boxes():
    assert S.grounding("(0,0),(10,5)", rec("(0,0),(10,10)")) == 1.0  # IoU exactly 0.5
    assert S.grounding("(0,0),(10,4)", rec("(0,0),(10,10)")) == 0.0


# --- captions ----------------------------------------------------------------------------------------------


def test_caption_overlap_is_the_best_reference():
    refs = rec(answers=["a dog on grass", "a brown dog running"])
    assert S.caption_overlap("a brown dog running", refs) == pytest.approx(1.0)
    assert 0 < S.caption_overlap("a dog", refs) < 1


def test_exact_match_over_several_references():
    assert S.exact_match("Dog.", rec(answers=["cat", "dog"])) == 1.0
    with pytest.raises(ValueError, match="no reference answer"):
        S.exact_match("dog", rec())
