"""Training records that ask a held-out question of its image are found, said with examples and counted."""

import json

from components._shared.data import datasets
from components._shared.data.overlap import held_out_overlap
from components.synth_world.splits import write_splits


def test_held_out_questions_copied_into_the_training_data_are_said_and_counted(tmp_path, caplog):
    data = tmp_path / "data"
    write_splits(data, seed=3, eval_per_type=2, sft_records=20, preference_pairs=2)
    held_out = datasets.load_eval_records(data, per_type=2)
    assert held_out_overlap(datasets.load_conversations(data), held_out, what="sft") == 0  # the world keeps them apart
    copied = [r for r in (json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines())][:3]
    with (data / "sft.jsonl").open("a") as f:
        for i, r in enumerate(copied):  # the question re-typed as a conversation, its case and spacing changed
            turns = [{"from": "human", "value": f"<image>\n  {r['question'].upper()} "}, {"from": "gpt", "value": "x"}]
            f.write(json.dumps({"id": f"copy-{i}", "image": r["image"], "conversations": turns}) + "\n")
    caplog.set_level("WARNING", logger="components._shared.data.overlap")
    assert held_out_overlap(datasets.load_conversations(data), held_out, what="sft") == 3
    assert "3 sft record(s) ask a held-out question of the same image (e.g. sft.jsonl:21 = eval.jsonl:1" in caplog.text
    prompts = datasets.load_questions(data, ["rl.jsonl"], role="rl") if (data / "rl.jsonl").exists() else []
    assert held_out_overlap(prompts, held_out, what="rl prompt") == 0
