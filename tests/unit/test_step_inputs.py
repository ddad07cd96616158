"""Step inputs prepared ahead by data workers: the same steps in the same order, errors as raised, ranks split."""

import os

import pytest
import torch

from components._shared.model.encoder import IGNORE_INDEX, Sample
from components._shared.model.step_inputs import prepare_step, step_inputs


def _sample(index: int, length: int) -> Sample:
    ids = torch.arange(length, dtype=torch.int64) + index
    labels = torch.cat([torch.full((length // 2,), IGNORE_INDEX), ids[length // 2 :]])
    return Sample(
        input_ids=ids,
        labels=labels,
        position_ids=torch.arange(length).expand(3, length).clone(),
        image_grid_thw=torch.zeros(0, 3, dtype=torch.int64),
        sample_id=f"s{index}",
        meta={"built_by": os.getpid()},
    )


def _build(indices: list[int]):
    if 13 in indices:
        raise ValueError("record 's13': its image is not a picture (field 'image'); fix or drop it")
    items = [_sample(i, 6 + i % 5) for i in indices]
    return prepare_step(indices, items, max_tokens=16, unit_weight=lambda u: float(sum(s.num_targets for s in u)),
                        rank=0, world=1)  # fmt: skip


PLAN = [[3 * k, 3 * k + 1, 3 * k + 2] for k in range(4)]


def test_workers_give_the_same_steps_in_order_built_elsewhere():
    in_process = list(step_inputs(PLAN, _build, workers=0, depth=2, pin=False))
    ahead = list(step_inputs(PLAN, _build, workers=2, depth=2, pin=False))
    assert [s.indices for s in ahead] == PLAN == [s.indices for s in in_process]
    for a, b in zip(ahead, in_process, strict=True):
        assert len(a.batches) == len(b.batches) and a.weights == b.weights and a.total_targets == b.total_targets
        for x, y in zip(a.batches, b.batches, strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor))
    assert {s.samples[0].meta["built_by"] for s in ahead} != {os.getpid()}  # really in the workers
    assert {s.samples[0].meta["built_by"] for s in in_process} == {os.getpid()}


def test_a_workers_error_reaches_the_training_process_as_raised():
    plan = [*PLAN, [12, 13, 14]]
    steps = step_inputs(plan, _build, workers=2, depth=2, pin=False)
    with pytest.raises(ValueError) as raised:
        list(steps)
    assert str(raised.value) == "record 's13': its image is not a picture (field 'image'); fix or drop it"


def test_ranks_split_the_micro_batches_and_the_short_rank_runs_a_zero_weighted_copy():
    items = [_sample(i, 10) for i in range(3)]  # 3 micro-batches of one sample (budget 12) over 2 ranks
    weight = lambda u: float(sum(s.num_targets for s in u))  # noqa: E731
    first = prepare_step([0, 1, 2], items, max_tokens=12, unit_weight=weight, rank=0, world=2)
    second = prepare_step([0, 1, 2], items, max_tokens=12, unit_weight=weight, rank=1, world=2)
    assert first.plan_size == second.plan_size == 3 and first.total_targets == second.total_targets == 15
    assert first.weights == [1.0, 1.0] and second.weights == [1.0, 0.0]
    assert second.micro[1] == first.micro[0]  # the copy of the plan's first micro-batch
    unlabelled = _sample(0, 4)
    unlabelled.labels[:] = IGNORE_INDEX
    with pytest.raises(ValueError, match="no target tokens"):
        prepare_step([0], [unlabelled], max_tokens=12, unit_weight=weight, rank=0, world=1)
