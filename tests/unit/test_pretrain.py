"""The pretrain stage on the tiny model: cached features == pixels, caption loss falls, best-of-last-N, InfoNCE."""

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from components._shared.model.encoder import ConversationEncoder
from components._shared.model.packing import forward_logits, pack, per_sample_loss
from components._shared.model.vlm import load_vlm
from components._shared.platform.storage import commit_dir
from components._shared.platform.tracking import NullTracker
from components.extract_features.config import ExtractFeaturesConfig
from components.extract_features.stage import run as extract
from components.pretrain.config import InfoNceConfig, PretrainConfig
from components.pretrain.feature_store import FeatureStore
from components.pretrain.stage import infonce_loss, run
from components.synth_world.splits import write_splits
from components.synth_world.world import sample_clean_pairs
from tests.prefetch import assert_same_with_and_without_workers

BASE = "builtin:tiny-qwen2_5-vl"
PIXELS = {"min_pixels": 3136, "max_pixels": 50176}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """clean_data-style kept parquet (48 world pictures of mixed sizes), its features, and held-out data."""
    root = tmp_path_factory.mktemp("pretrain")
    rows = []
    for i, (image, caption) in enumerate(
        sample_clean_pairs(24, seed=2) + sample_clean_pairs(24, seed=3, size=(84, 140))
    ):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        data = buf.getvalue()
        rows.append(
            {
                "image_hash": hashlib.sha256(data).hexdigest(),
                "image": data,
                "caption": caption,
                "image_format": "PNG",
                "key": f"{i:09d}",
            }
        )
    (root / "clean/kept").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "clean/kept/part-00000.parquet")
    commit_dir(root / "clean")  # as clean_data leaves it: the stage command lines refuse it uncommitted
    extract(
        ExtractFeaturesConfig(**PIXELS, dtype="float32", decode_workers=0, batch_size=16),
        clean_data=root / "clean",
        base_model=BASE,
        output_dir=root / "features",
        tracker=NullTracker(),
    )
    commit_dir(root / "features")
    write_splits(root / "heldout", seed=4, eval_per_type=8, sft_records=8, preference_pairs=2)
    return root


def _cfg(**over):
    data = {
        **PIXELS,
        "stage1": {
            "train_lm": True,
            "train": {
                "steps": 8,
                "samples_per_step": 12,
                "max_tokens_per_micro_batch": 512,
                "eval_every": 2,
                "checkpoint_every": 2,
                "keep_checkpoints": 3,
                "threads": 1,
            },
            "optim": {"lr": 0.006},
        },
        "keep_best_of_last": 3,
        "eval": {"heldout_captions": 8, "retrieval_candidates": 4},
    }
    data.update(over)
    return PretrainConfig.model_validate(data)


def _run(cfg, inputs, out):
    return run(
        cfg,
        clean_data=str(inputs / "clean"),
        features=str(inputs / "features"),
        base_model=BASE,
        data=str(inputs / "heldout"),
        output_dir=out,
        tracker=NullTracker(),
    )


def test_cached_features_give_the_same_loss_as_pixels(inputs):
    """Stage 1 reads features instead of running the ViT; the LM must see exactly what pixels would give it."""
    model, processor, _ = load_vlm(BASE)
    model.eval()
    encoder = ConversationEncoder(processor, model, **PIXELS)
    store = FeatureStore(inputs / "features")
    kept = pq.read_table(inputs / "clean/kept/part-00000.parquet").to_pylist()[20:28]  # both sizes
    from PIL import Image

    turns = lambda c: [{"role": "user", "text": "<image>\nDescribe the image."}, {"role": "assistant", "text": c}]  # noqa: E731
    cached, pixels = [], []
    for row in kept:
        rows, grid = store.get(row["image_hash"])
        cached.append(encoder.encode(turns(row["caption"]), grids=[grid], features=[rows]))
        pixels.append(
            encoder.encode(turns(row["caption"]), images=[Image.open(io.BytesIO(row["image"])).convert("RGB")])
        )
    with torch.no_grad():
        a, b = pack(cached), pack(pixels)
        la, lb = per_sample_loss(forward_logits(model, a), a), per_sample_loss(forward_logits(model, b), b)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["position_ids"], b["position_ids"])
    assert float(((la - lb).abs() / lb).max()) < 1e-5


def test_stage1_lowers_heldout_caption_loss_and_exports_the_best_of_last_n(inputs, tmp_path):
    metrics = _run(_cfg(), inputs, tmp_path)
    assert metrics["heldout_caption_loss_final"] < 0.8 * metrics["heldout_caption_loss_initial"]
    assert 0.0 <= metrics["retrieval_r1"] <= 1.0 and metrics["retrieval_chance"] == 0.25
    report = (tmp_path / "report.md").read_text()
    evals = [line.split("|") for line in report.splitlines() if line.startswith("| stage1 |")]
    losses = {int(r[2]): float(r[3]) for r in evals}
    assert sorted(losses) == [0, 2, 4, 6, 8]
    assert metrics["selected_step"] == min((4, 6, 8), key=lambda s: (losses[s], -s))
    assert metrics["heldout_caption_loss_final"] == pytest.approx(losses[metrics["selected_step"]], abs=1e-4)
    # the ViT did not move in stage 1; the exported model loads as a plain HF checkpoint
    from safetensors.torch import load_file

    from components._shared.model.sources import resolve_model

    before, after = (
        load_file(str(resolve_model(BASE) / "model.safetensors")),
        load_file(str(tmp_path / "model/model.safetensors")),
    )
    assert set(before) == set(after)
    vision = [k for k in before if "visual.blocks." in k or "patch_embed" in k]
    assert len(vision) > 10 and all(torch.equal(before[k], after[k]) for k in vision)
    assert not all(torch.equal(before[k], after[k]) for k in before if "merger" in k)
    assert json.loads((tmp_path / "model/qvl_model.json").read_text())["selected_step"] == metrics["selected_step"]


@pytest.mark.parametrize("backends", [("torch", "torch"), pytest.param(("2", "3"), marks=pytest.mark.slow)])
def test_stage2_trains_the_vision_tower_from_pixels_with_infonce(inputs, tmp_path, backends):
    """Also with DeepSpeed: ZeRO-2 for stage 1, then a fresh ZeRO-3 engine for stage 2 in the same process."""
    engines = [
        {"backend": "torch"} if b == "torch" else {"backend": "deepspeed", "zero_stage": int(b)} for b in backends
    ]
    cfg = _cfg(
        stage1={
            "train_lm": True,
            "train": {"steps": 2, "samples_per_step": 8, "threads": 1, "max_tokens_per_micro_batch": 512, **engines[0]},
        },
        stage2={
            "enabled": True,
            "train": {"steps": 2, "samples_per_step": 8, "threads": 1, "max_tokens_per_micro_batch": 512, **engines[1]},
            "optim": {"lr": 0.001, "group_lr": {"vision_lower": 0.0001}},
        },
        infonce={"weight": 0.5, "hard_negatives": 2},
        keep_best_of_last=1,
    )
    metrics = _run(cfg, inputs, tmp_path)
    assert metrics["stage2_steps"] == 2
    from safetensors.torch import load_file

    from components._shared.model.sources import resolve_model

    before, after = (
        load_file(str(resolve_model(BASE) / "model.safetensors")),
        load_file(str(tmp_path / "model/model.safetensors")),
    )
    block0 = [k for k in before if "visual.blocks.0." in k]
    assert block0 and any(not torch.equal(before[k], after[k]) for k in block0)


def test_each_phase_evaluates_with_its_own_loss_chunk_tokens(inputs, tmp_path, monkeypatch):
    """The held-out eval runs inside a phase: stage 2's evals (and the final one) chunk the LM head by
    stage2.train.loss_chunk_tokens, not stage 1's (stage 2 from pixels may need a smaller logits budget)."""
    from components.pretrain import stage as pretrain_stage

    seen: list[tuple[str, int]] = []
    heldout_loss, pair_loss = pretrain_stage.E.heldout_loss, pretrain_stage.per_sample_sequence_loss

    def spy_heldout_loss(model, samples, *, chunk_rows, **kw):
        seen.append(("caption", chunk_rows))
        return heldout_loss(model, samples, chunk_rows=chunk_rows, **kw)

    def spy_pair_loss(model, batch, *, chunk_rows, **kw):
        seen.append(("retrieval", chunk_rows))
        return pair_loss(model, batch, chunk_rows=chunk_rows, **kw)

    monkeypatch.setattr(pretrain_stage.E, "heldout_loss", spy_heldout_loss)
    monkeypatch.setattr(pretrain_stage, "per_sample_sequence_loss", spy_pair_loss)
    train = {"steps": 1, "samples_per_step": 4, "threads": 1, "max_tokens_per_micro_batch": 512, "eval_every": 1}
    cfg = _cfg(
        stage1={"train": {**train, "loss_chunk_tokens": 64}},
        stage2={"enabled": True, "train": {**train, "loss_chunk_tokens": 96}},
        keep_best_of_last=1,
    )
    _run(cfg, inputs, tmp_path)
    captions = [chunk for kind, chunk in seen if kind == "caption"]
    assert captions[0] == 64 and captions[-1] == 96 and set(captions) == {64, 96}, captions
    assert {chunk for kind, chunk in seen if kind == "retrieval"} == {64, 96}


def test_infonce_prefers_aligned_pairs_and_hard_negatives_focus_the_loss():
    torch.manual_seed(0)
    n, d = 6, 16
    text = torch.randn(n, d)
    batch = {"seq_index": torch.arange(n).repeat_interleave(3)[None], "num_samples": n}
    image_mask = torch.tensor([True, False, False] * n)[None]
    targets = torch.tensor([-100, 1, -100] * n)[None]  # token 2 of each sample is a caption token
    batch.update(image_mask=image_mask, targets=targets)
    text_embeds = torch.zeros(1, 3 * n, d)
    text_embeds[0, 2::3] = text
    cfg = InfoNceConfig(weight=1.0, temperature=0.1)
    aligned = infonce_loss(cfg, text.clone(), batch, text_embeds)
    shuffled = infonce_loss(cfg, text[torch.randperm(n)], batch, text_embeds)
    assert aligned < 0.1 < shuffled
    images = text[torch.randperm(n)]
    hard = infonce_loss(InfoNceConfig(weight=1.0, temperature=0.1, hard_negatives=1), images, batch, text_embeds)
    # by hand: each row (and each column) keeps its positive and its single most similar negative
    sim = torch.nn.functional.normalize(images, dim=-1) @ torch.nn.functional.normalize(text, dim=-1).T / 0.1

    def two_way(scores):
        losses = []
        for i in range(n):
            negative = max(scores[i, j] for j in range(n) if j != i)
            losses.append(-scores[i, i] + torch.logsumexp(torch.stack([scores[i, i], negative]), 0))
        return torch.stack(losses).mean()

    assert float(hard) == pytest.approx(float(0.5 * (two_way(sim) + two_way(sim.T))), rel=1e-5)


def test_config_rejects_best_of_n_without_matching_checkpoints():
    with pytest.raises(ValueError, match="keep_checkpoints >= 4"):
        _cfg(keep_best_of_last=4)
    with pytest.raises(ValueError, match="eval_every == checkpoint_every"):
        PretrainConfig.model_validate(
            {
                "stage1": {"train": {"eval_every": 3, "checkpoint_every": 2, "keep_checkpoints": 2}},
                "keep_best_of_last": 2,
            }
        )


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("deepspeed-2", marks=pytest.mark.slow), pytest.param("deepspeed-3", marks=pytest.mark.slow)],
)
def test_pretrain_killed_mid_run_resumes_to_bit_identical_weights(inputs, tmp_path, backend):
    import signal

    from safetensors.torch import load_file

    from tests.stage_cli import run_stage_cli

    engine, _, zero = backend.partition("-")
    config = _cfg(keep_best_of_last=1).model_dump(mode="json", exclude_none=True)
    config["stage1"]["train"].update(
        steps=6, checkpoint_every=2, eval_every=3, backend=engine, zero_stage=int(zero or 2)
    )

    def stage(out, **env):
        return run_stage_cli(
            "pretrain",
            config,
            tmp_path / out,
            {
                "clean_data": inputs / "clean",
                "features": inputs / "features",
                "base_model": BASE,
                "data": inputs / "heldout",
            },
            **env,
        )

    straight = stage("straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert stage("killed", QVL_TEST_KILL_AT_STEP=3).returncode == -signal.SIGKILL
    assert stage("killed", QVL_TEST_KILL_IN_CHECKPOINT=4).returncode == -signal.SIGKILL
    resumed = stage("killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_file(str(tmp_path / "straight/model/model.safetensors"))
    b = load_file(str(tmp_path / "killed/model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = json.loads((tmp_path / "straight/_stage_result.json").read_text())["metrics"]
    second = json.loads((tmp_path / "killed/_stage_result.json").read_text())["metrics"]
    assert first["heldout_caption_loss_final"] == second["heldout_caption_loss_final"]
    print(
        f"pretrain {backend}: {len(a)} tensors bit-identical after SIGKILL at step 3 and during the step-4 checkpoint"
    )


def test_prefetching_data_workers_leave_the_model_bit_identical(inputs, tmp_path):
    def run_with(workers, out):
        cfg = _cfg()
        train = {**cfg.stage1.train.model_dump(), "steps": 4, "data_workers": workers}
        _run(_cfg(stage1={**cfg.stage1.model_dump(), "train": train}), inputs, out)

    assert_same_with_and_without_workers(run_with, tmp_path)
