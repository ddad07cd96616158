"""Decoded images are kept within a byte budget (a count of 4,096 held 147 GB of 12-megapixel photographs)."""

from PIL import Image

from components._shared.data.image_cache import DecodedImages


def test_decoded_images_stay_within_their_byte_budget_and_a_huge_one_is_named(tmp_path, capsys):
    for name, size in {"a.png": (100, 100), "b.png": (100, 100), "c.png": (100, 100), "big.png": (200, 150)}.items():
        Image.new("RGB", size, "red").save(tmp_path / name)
    images = DecodedImages(tmp_path, max_bytes=60_000, warn_bytes=40_000)  # room for two 100x100 RGB images
    assert images("a.png").size == (100, 100) and images("b.png") is images("b.png")
    images("a.png")  # used last: b is now the oldest
    images("c.png")
    assert images.bytes == 60_000 and list(images._kept) == ["a.png", "c.png"]
    assert images.decoded == 3
    images("b.png")
    assert images.decoded == 4  # b was dropped and is decoded again
    assert "warning" not in capsys.readouterr().err
    assert images("big.png").size == (200, 150) and images.decoded == 5
    assert "big.png" not in images._kept and images.bytes <= 60_000  # larger than the budget: used, not kept
    err = capsys.readouterr().err
    assert "warning: image 'big.png' is 200x150 (0 MB decoded)" in err and "max_pixels" in err
    images("big.png")
    assert "warning" not in capsys.readouterr().err  # said once
