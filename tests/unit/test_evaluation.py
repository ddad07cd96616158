"""The eval suite's generation: batched, left-padded KV-cache generation equals teacher-forced greedy decoding."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from components._shared.data import datasets
from components._shared.eval import evaluation as E
from components._shared.model.encoder import ConversationEncoder
from components._shared.model.packing import forward_logits, pack
from components._shared.model.vlm import load_vlm


@pytest.fixture(scope="module")
def model_and_encoder():
    torch.manual_seed(0)
    model, processor, _ = load_vlm("builtin:tiny-qwen2_5-vl")
    model.eval()
    return model, ConversationEncoder(processor, model, min_pixels=3136, max_pixels=50176)


def _records():
    rng = np.random.default_rng(1)
    sizes = [(112, 112), (56, 168), (224, 112), (84, 84)]
    return [
        {
            "id": f"r{i}",
            "question": "What color is the shape?" + " Answer briefly." * (i % 2),
            "type": "color",
            "answer": "red",
            "pil": Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)),
        }
        for i, (h, w) in enumerate(sizes)
    ]


def test_batched_generation_equals_teacher_forced_greedy(model_and_encoder):
    """Guards the M-RoPE positions during generation (mm_token_type_ids): each generated token must be the argmax
    of the packed, teacher-forced forward over the prompt plus the tokens generated so far."""
    model, encoder = model_and_encoder
    records = _records()
    end = encoder.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        first_logits: list = []
        generated = E.generate_answers(
            model, encoder, records, batch_size=4, max_new_tokens=4, first_logits=first_logits
        )
        for record, answer, logits in zip(records, generated, first_logits, strict=True):
            sample = encoder.encode(
                datasets.prompt_turns(record["question"]), images=[record["pil"]], add_generation_prompt=True
            )
            ids = sample.input_ids
            expected = []
            for _ in range(4):
                sample.input_ids = ids
                sample.labels = torch.full_like(ids, -100)
                sample.position_ids = encoder.rope_positions(ids, sample.image_grid_thw)
                step_logits = forward_logits(model, pack([sample]))[0, -1]
                if len(expected) == 0:  # the generated step's logits, not only its argmax, match the packed forward
                    assert torch.allclose(logits, step_logits, atol=1e-4), float((logits - step_logits).abs().max())
                token = int(step_logits.argmax())
                if token == end:
                    break
                expected.append(token)
                ids = torch.cat([ids, torch.tensor([token])])
            assert answer == encoder.tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_ece_and_temperature_fit():
    conf = [0.9, 0.9, 0.9, 0.9, 0.1, 0.1]
    correct = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # bin (0.8, 0.9]: 4 answers, confidence 0.9, accuracy 0.5; bin (0.0, 0.1]: 2 answers, 0.1 vs 0
    assert E.expected_calibration_error(conf, correct) == pytest.approx(4 / 6 * 0.4 + 2 / 6 * 0.1)
    logits = [(torch.tensor([[4.0, 0.0]]), torch.tensor([0])) for _ in range(4)]
    correct = [1.0, 0.0, 1.0, 0.0]  # overconfident at T=1 (p=0.98 vs 50% correct): a higher T must win
    t, ece = E.fit_temperature(logits, correct)
    assert t > 1.0 and ece < E.expected_calibration_error(E.confidences(logits, 1.0), correct)


def test_eval_records_are_validated(tmp_path: Path):
    (tmp_path / "eval.jsonl").write_text(
        '{"id": "q1", "image": "../x.png", "question": "?", "answer": "a", "type": "color"}\n'
    )
    with pytest.raises(ValueError, match="leads outside the data directory"):
        datasets.load_eval_records(tmp_path)
    (tmp_path / "eval.jsonl").write_text('{"id": "q2", "image": "x.png", "question": "?"}\n')
    with pytest.raises(ValueError, match=r"eval.jsonl:1 \(id='q2'\): a flat record needs 'answer'"):
        datasets.load_eval_records(tmp_path)


def test_images_load_from_the_data_dir_or_s3_and_bad_ones_are_named(tmp_path: Path, s3_env):
    import io

    from components._shared.platform import storage

    buf = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), 128, dtype=np.uint8)).save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    storage.write_bytes(f"{s3_env.uri}/imgs/b.png", buf.getvalue())
    assert datasets.load_image(tmp_path, "a.png").size == (60, 40)
    assert datasets.load_image(tmp_path, f"{s3_env.uri}/imgs/b.png").size == (60, 40)
    (tmp_path / "broken.png").write_bytes(buf.getvalue()[:30])
    with pytest.raises(ValueError, match="image 'broken.png' cannot be used: undecodable"):
        datasets.load_image(tmp_path, "broken.png")
    with pytest.raises(ValueError, match="'missing.png' does not exist"):
        datasets.load_image(tmp_path, "missing.png")


def test_eval_records_join_files_of_both_formats(tmp_path: Path):
    Image.fromarray(np.zeros((28, 28, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    flat = {"image": "x.png", "question": "What colour?", "answer": "red", "type": "color"}
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"id": f"e{i}", **flat}) + "\n" for i in range(3)))
    conversation = {
        "image": "x.png",
        "type": "color",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is the shape?"},
            {"from": "gpt", "value": "blue"},
        ],
    }
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps({"id": f"r{i}", **conversation}) + "\n" for i in range(4)))
    records = datasets.load_eval_records(tmp_path, files=["eval.jsonl", "rl.jsonl"])
    assert [r["id"] for r in records] == ["e0", "e1", "e2", "r0", "r1", "r2", "r3"]
    assert records[3]["question"] == "What colour is the shape?" and records[3]["answer"] == "blue"
    assert records[3]["pil"].size == (28, 28)
    assert [r["id"] for r in datasets.load_eval_records(tmp_path, files=["eval.jsonl", "rl.jsonl"], per_type=5)] == [
        "e0",
        "e1",
        "e2",
        "r0",
        "r1",
    ]  # the cap counts across files, in file order
    (tmp_path / "dup.jsonl").write_text(json.dumps({"id": "e1", **flat}) + "\n")
    with pytest.raises(ValueError, match="'e1' is in both eval.jsonl and dup.jsonl"):
        datasets.load_eval_records(tmp_path, files=["eval.jsonl", "dup.jsonl"])
    two_images = {**flat, "images": ["x.png", "x.png"], "question": "<image> or <image>?"}
    (tmp_path / "multi.jsonl").write_text(json.dumps({"id": "m0", **two_images}) + "\n")
    with pytest.raises(
        ValueError, match=r"multi.jsonl:1 \(id='m0'\): 2 images; a held-out or RL question needs exactly one"
    ):
        datasets.load_eval_records(tmp_path, files=["multi.jsonl"])
