"""Encoded samples kept for reuse (components/_shared/model/sample_cache.py): built once per record while they fit,
least recently used out, and a stage trained with the cache exports the same model bytes as one without it."""

import torch

from components._shared.model.encoder import Sample
from components._shared.model.sample_cache import SampleCache, item_bytes
from tests.prefetch import model_bytes
from tests.tiny_sft import train_tiny_sft


def _sample(i: int, pixels: int = 100) -> Sample:
    ids = torch.arange(10) + i
    return Sample(
        input_ids=ids,
        labels=ids.clone(),
        position_ids=torch.zeros(3, 10, dtype=torch.int64),
        image_grid_thw=torch.tensor([[1, 2, 2]]),
        pixel_values=torch.zeros(pixels, dtype=torch.uint8),
        sample_id=str(i),
    )


def test_items_are_built_once_while_they_fit_and_the_oldest_leave_first():
    built: list[int] = []

    def build(i: int) -> Sample:
        built.append(i)
        return _sample(i)

    size = item_bytes(_sample(0))
    assert size == 10 * 8 * 2 + 30 * 8 + 3 * 8 + 100  # ids, labels, positions, grid, uint8 pixels
    cache = SampleCache(build, max_bytes=2 * size)
    first = cache(0)
    assert cache(0) is first and built == [0]
    cache(1)
    cache(0)  # 0 is now the most recent: 1 leaves when 2 comes
    cache(2)
    assert cache.bytes == 2 * size and cache(0) is first and built == [0, 1, 2]
    cache(1)
    assert built == [0, 1, 2, 1] and (cache.hits, cache.built) == (3, 4)
    pair = SampleCache(lambda i: [_sample(i), _sample(i + 1)], max_bytes=10 * size)
    assert pair(3) is pair(3) and pair.bytes == 2 * size
    nothing = SampleCache(build, max_bytes=0)
    assert nothing(5) is not nothing(5) and nothing.bytes == 0


def test_sft_with_and_without_the_cache_exports_the_same_model(tmp_path):
    """8 records, 6 steps of 8 samples: every record is drawn six times, five of them from the cache."""
    from components.synth_world.splits import write_splits

    data = tmp_path / "data"
    write_splits(data, seed=3, eval_per_type=1, sft_records=8, preference_pairs=4)
    train_tiny_sft(data, tmp_path / "cached", steps=6)
    train_tiny_sft(data, tmp_path / "built", steps=6, sample_cache_mb=0)
    assert model_bytes(tmp_path / "cached") == model_bytes(tmp_path / "built")
