"""RL reward callables: task efficacy per type, its cache, format, OCR consistency, and the bait caught by the RM."""

import pytest

from components._shared.data import datasets
from components.rl.rewards import (
    EfficacyCache,
    OcrConsistencyReward,
    build_rewards,
    format_reward,
    length_factor,
    ngram_overlap,
    repeated_ngram_ratio,
    task_efficacy,
    word_f1,
)
from components.synth_world.splits import write_splits

Q = "What color is the circle?"  # 5 words: answers up to 7.5 words are not penalised


def test_vqa_efficacy_is_accuracy_times_a_length_factor_that_only_bites_past_1_5x_the_question():
    assert task_efficacy("color", "red", "red", Q) == 1.0
    assert task_efficacy("color", "blue", "red", Q) == 0.0
    assert length_factor("the circle is red you see", Q) == 1.0  # 6 words <= 7.5
    assert length_factor(" ".join(["red"] * 10), Q) == pytest.approx(1 - 2.5 / 7.5)
    assert length_factor(" ".join(["red"] * 40), Q) == 0.0
    # padding a correct answer costs efficacy; a correct short answer keeps all of it
    assert task_efficacy("color", "red " + "indeed " * 9, "red", Q) < task_efficacy("color", "red", "red", Q)


def test_grounding_efficacy_is_the_box_iou_so_near_misses_earn_part_of_the_reward():
    gold = "(0,0),(10,10)"
    assert task_efficacy("grounding", gold, gold, "Where is the red circle? Answer with its box.") == 1.0
    assert task_efficacy("grounding", "(0,0),(10,5)", gold, "Where is it?") == pytest.approx(0.5)
    assert task_efficacy("grounding", "no idea", gold, "Where is it?") == 0.0


def test_caption_efficacy_rewards_overlap_and_punishes_repetition():
    ref = "A red circle on the left and a blue square at the right."
    assert ngram_overlap(ref, ref) == pytest.approx(1.0)
    assert 0 < ngram_overlap("A red circle.", ref) < ngram_overlap("A red circle on the left.", ref) < 1
    looping = "a red circle a red circle a red circle"
    assert repeated_ngram_ratio(looping) > 0.5 and repeated_ngram_ratio(ref) == 0.0
    assert task_efficacy("caption", looping, ref, "Describe the image.") < task_efficacy(
        "caption", "A red circle.", ref, "Describe the image."
    )


def test_text_reading_efficacy_is_word_f1():
    assert word_f1("milk", "milk") == 1.0 and word_f1("the word milk", "milk") == pytest.approx(0.5)
    assert task_efficacy("ocr", "tree", "milk", "What does the text say?") == 0.0


def test_efficacy_cache_scores_repeated_answers_once():
    cache = EfficacyCache()
    records = [{"id": "a", "type": "color", "answer": "red", "question": Q}] * 3
    assert cache(["q"] * 3, ["red", " red ", "blue"], records=records) == [1.0, 1.0, 0.0]
    assert (cache.hits, cache.misses) == (1, 2)


def test_format_reward_needs_a_finished_non_empty_answer_and_a_box_for_grounding():
    records = [{"type": "color"}, {"type": "color"}, {"type": "grounding"}, {"type": "grounding"}, {"type": "color"}]
    out = format_reward(
        [""] * 5,
        ["red", "red", "(1,2),(3,4)", "left side", ""],
        records=records,
        finished=[True, False, True, True, True],
    )
    assert out == [1.0, 0.0, 1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("rlworld")
    write_splits(out, seed=3, eval_per_type=3, sft_records=8, preference_pairs=80)
    return out


def test_ocr_consistency_checks_claimed_text_against_what_the_ocr_model_reads(world):
    records = [r for r in datasets.load_eval_records(world) if r["type"] in ("ocr", "color")]
    ocr = [r for r in records if r["type"] == "ocr"]
    color = [r for r in records if r["type"] == "color"]
    reward = OcrConsistencyReward()
    assert reward([""] * len(ocr), [r["answer"] for r in ocr], records=ocr) == [1.0] * len(ocr)
    assert reward([""] * len(ocr), ["zebra"] * len(ocr), records=ocr) == [-1.0] * len(ocr)
    # answers that claim no text are neutral; a quoted word is a claim
    assert reward([""], ["blue"], records=color[:1]) == [0.0]
    assert reward([""], ['blue, and the word "zebra" is written'], records=color[:1]) == [-1.0]


def test_build_rewards_rejects_unknown_names_and_a_missing_reward_model():
    import torch

    with pytest.raises(ValueError, match="unknown reward"):
        build_rewards(
            {"bleu": 1.0}, reward_model_uri=None, min_pixels=3136, max_pixels=3136, device=torch.device("cpu")
        )
    with pytest.raises(ValueError, match="no reward model"):
        build_rewards(
            {"reward_model": 1.0}, reward_model_uri=None, min_pixels=3136, max_pixels=3136, device=torch.device("cpu")
        )


def test_the_config_and_the_rewards_table_name_the_same_rewards():
    from components.rl.config import REWARD_NAMES
    from components.rl.rewards import REWARD_BUILDERS

    assert tuple(REWARD_BUILDERS) == REWARD_NAMES
