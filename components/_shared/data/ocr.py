"""Reading words in images with rapidocr (offline ONNX models from the rapidocr wheel), and matching them.

clean_data rejects captions that ignore the text in their image; rl's OCR-consistency reward checks that text an
answer claims is written is really there. Both use the same reader and the same tolerant matching.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

_OCR_TOKEN = re.compile(r"[^\W_]+", re.UNICODE)


def _within_one_edit(a: str, b: str) -> bool:
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) <= 1
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def unmentioned_words(ocr_words: Sequence[str], caption: str) -> list[str]:
    """OCR words the caption does not mention (case-insensitive; one OCR slip allowed on 4+ letter words)."""
    caption_lower = caption.lower()
    caption_tokens = set(_OCR_TOKEN.findall(caption_lower))
    missing = []
    for word in ocr_words:
        w = word.lower()
        if w in caption_lower:
            continue
        if len(w) >= 4 and any(_within_one_edit(w, t) for t in caption_tokens if abs(len(t) - len(w)) <= 1):
            continue
        missing.append(word)
    return missing


class OcrReader:
    """rapidocr: text detection on every image; recognition only on boxes shaped like words.

    A box narrower than `min_box_aspect` (width / height) cannot hold a horizontal word of 3+ characters; on
    simple pictures the detector also boxes shapes and symbols (aspect ~1), and skipping those saves most of
    the recognition cost. Vertical text is not read.
    """

    def __init__(self, detect_side: int, threads: int = 0) -> None:
        from rapidocr import RapidOCR

        params = {
            "Global.use_cls": False,
            "Global.log_level": "error",
            "Det.limit_side_len": detect_side,
            "Det.limit_type": "max",
        }
        if threads:
            params["EngineConfig.onnxruntime.intra_op_num_threads"] = threads
        self.ocr = RapidOCR(params=params)

    def words(self, image, *, min_confidence: float, min_chars: int, min_box_aspect: float) -> list[str]:
        """Confident words (letters/digits, at least `min_chars` long) read in the image."""
        pixels = np.asarray(image)
        detected = self.ocr(pixels, use_det=True, use_cls=False, use_rec=False)
        boxes = getattr(detected, "boxes", None)
        if boxes is None:
            return []
        words = []
        for box in np.asarray(boxes):
            x1, y1 = np.floor(box.min(axis=0)).astype(int).clip(min=0)
            x2, y2 = np.ceil(box.max(axis=0)).astype(int)
            if y2 - y1 < 4 or (x2 - x1) / (y2 - y1) < min_box_aspect:
                continue
            read = self.ocr(pixels[y1:y2, x1:x2], use_det=False, use_cls=False, use_rec=True)
            for text, score in zip(getattr(read, "txts", None) or (), getattr(read, "scores", None) or (), strict=True):
                if score >= min_confidence:
                    words += [w for w in _OCR_TOKEN.findall(text) if len(w) >= min_chars]
        return words


@lru_cache(maxsize=2)
def load_ocr(detect_side: int, threads: int = 0) -> OcrReader:
    return OcrReader(detect_side, threads)
