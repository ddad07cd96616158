"""The per-record checks (caption, size, dedup) and the model-backed levels of the five-level cleaning
(docs/references.md).

Cheap checks are plain functions returning a (reason, detail) pair or None. Model-backed levels are
small classes loaded once per process (`load_*` are cached): CLIP image-text agreement, nudenet NSFW,
rapidocr text the caption never mentions, kNN outliers in CLIP image space, and the optional self-judge.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from components._shared.data.ocr import OcrReader, load_ocr, unmentioned_words  # noqa: F401 (used as filters.*)
from components._shared.data.text_checks import RecordError, check_text

Rejection = tuple[str, str]

# ---------------------------------------------------------------- captions

_CAMERA_NAME = re.compile(
    r"^(img|dsc|dscn|dscf|dcim|pxl|mvimg|vid|gopr|sam|wp|photo|image|screenshot|scan|p)[\s_-]*\d{2,}[\w-]*"
    r"(\.(jpe?g|png|gif|webp|bmp|tiff?|heic|raw|cr2|nef))?$",
    re.IGNORECASE,
)
_FILE_NAME = re.compile(r"^[\w\-. ]+\.(jpe?g|png|gif|webp|bmp|tiff?|heic|raw|cr2|nef)$", re.IGNORECASE)
_HEXISH = re.compile(r"^(0x)?[0-9a-f]{8,}$|^[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$", re.IGNORECASE)
_URL = re.compile(r"^(https?://|www\.)\S+$", re.IGNORECASE)
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


def real_word_count(text: str) -> int:
    """Words a person would read: 2+ letters with a vowel (Latin), any letters elsewhere, CJK counted per 2 chars."""
    count = 0
    for token in _WORD.findall(text):
        if _CJK.search(token):
            count += max(1, len(token) // 2)
        elif not token.isascii() or len(token) >= 2 and re.search(r"[aeiouy]", token, re.IGNORECASE):
            count += 1
    return count


def garbage_caption(text: str, *, min_words: int, min_letter_ratio: float, max_repeated_chars: int) -> str | None:
    """Why a caption is junk a crawler picked up (detail string), or None when it reads like text."""
    stripped = text.strip()
    if _URL.match(stripped):
        return "caption is only a URL"
    if _CAMERA_NAME.match(stripped) or _FILE_NAME.match(stripped):
        return f"caption looks like a camera/file name: {stripped[:40]!r}"
    tokens = stripped.split()
    if tokens and all(_HEXISH.match(t) for t in tokens):
        return "caption is a hex string / hash"
    run = re.search(rf"(.)\1{{{max_repeated_chars},}}", stripped)
    if run:
        return f"caption repeats {run.group(1)!r} {len(run.group(0))} times"
    if len(tokens) >= 4 and len({t.lower() for t in tokens}) == 1:
        return f"caption is one word repeated {len(tokens)} times"
    visible = [c for c in stripped if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    if visible and letters / len(visible) < min_letter_ratio:
        return f"only {letters}/{len(visible)} characters are letters (< min_letter_ratio={min_letter_ratio})"
    words = real_word_count(stripped)
    if words < min_words:
        return f"{words} real word(s) < min_caption_words={min_words}"
    return None


def check_caption(raw: bytes, cfg) -> tuple[str | None, Rejection | None]:
    """(caption text, None) or (None, (reason, detail)) for caption bytes."""
    if not isinstance(raw, (bytes, bytearray)):  # the readers turn other values into rejections; never crash here
        return None, ("missing_caption", f"caption is {type(raw).__name__}, not text (UTF-8 bytes)")
    if len(raw) > 4 * cfg.max_caption_chars + 4:  # cheap bound before decoding (UTF-8 is at most 4 bytes a char)
        return None, ("caption_too_long", f"{len(raw)} bytes > 4 x max_caption_chars={cfg.max_caption_chars}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, ("caption_not_utf8", f"invalid UTF-8 at byte {exc.start}")
    text = text.lstrip("\ufeff").strip()
    if "\x00" in text:
        return None, ("caption_not_utf8", "caption contains NUL characters")
    if "\ufeff" in text:  # invisible to a reader, a token to the model: two files joined after export
        at = text.index("\ufeff")
        return None, ("caption_not_utf8", f"a byte-order mark U+FEFF inside the caption at character {at}")
    try:
        check_text(text, "caption")
    except RecordError as error:  # control characters, bidi overrides, chat tokens: binary or a broken export
        return None, ("caption_not_utf8", str(error)[:300])
    if not text:
        return None, ("empty_caption", "caption is empty or whitespace")
    if len(text) > cfg.max_caption_chars:
        return None, ("caption_too_long", f"{len(text)} chars > max_caption_chars={cfg.max_caption_chars}")
    if cfg.garbage_caption_enabled:
        why = garbage_caption(
            text,
            min_words=cfg.min_caption_words,
            min_letter_ratio=cfg.min_letter_ratio,
            max_repeated_chars=cfg.max_repeated_chars,
        )
        if why:
            return None, ("garbage_caption", why)
    return text, None


# ---------------------------------------------------------------- size


def check_size(width: int, height: int, cfg) -> Rejection | None:
    """too_small / too_large / extreme_aspect, or None."""
    short, long = min(width, height), max(width, height)
    if short < cfg.min_side:
        return "too_small", f"{width}x{height}: shorter side {short} < min_side={cfg.min_side}"
    if long > cfg.max_side:
        return "too_large", f"{width}x{height}: longer side {long} > max_side={cfg.max_side}"
    if long / short > cfg.max_aspect_ratio:
        return (
            "extreme_aspect",
            f"{width}x{height}: aspect {long / short:.2f} > max_aspect_ratio={cfg.max_aspect_ratio}",
        )
    return None


# ---------------------------------------------------------------- near dedup


def phash64(image) -> int:
    """64-bit perceptual hash (imagehash pHash) of a PIL image, as an int."""
    import imagehash

    bits = imagehash.phash(image).hash.flatten()
    return int("".join("1" if b else "0" for b in bits), 2)


THUMB_SIDE = 16


def thumbnail(image) -> bytes:
    """16x16 RGB thumbnail bytes: the colour check behind a pHash match (pHash sees only luminance)."""
    from PIL import Image

    return image.resize((THUMB_SIDE, THUMB_SIDE), Image.Resampling.BILINEAR).tobytes()


def thumb_difference(a: bytes, b: bytes) -> float:
    """Mean absolute difference (0-255) of two thumbnails."""
    return float(np.abs(np.frombuffer(a, np.uint8).astype(np.int16) - np.frombuffer(b, np.uint8)).mean())


class PhashIndex:
    """Near-duplicate lookup by Hamming distance with multi-index hashing.

    The 64 bits are cut into `max_distance + 1` bands; two hashes within `max_distance` bits agree exactly
    on at least one band (pigeonhole), so only hashes sharing a band value are compared. Lookups cost
    the bucket sizes, not the index size.
    """

    def __init__(self, max_distance: int) -> None:
        self.max_distance = max_distance
        bands = max_distance + 1
        edges = np.linspace(0, 64, bands + 1).astype(int)
        self._bands = [(int(lo), int(hi - lo)) for lo, hi in itertools.pairwise(edges)]
        self._tables: list[dict[int, list[int]]] = [{} for _ in self._bands]
        self._hashes: list[int] = []
        self._ids: list[Any] = []

    def __len__(self) -> int:
        return len(self._hashes)

    def _keys(self, value: int) -> list[int]:
        return [(value >> shift) & ((1 << width) - 1) for shift, width in self._bands]

    def find(self, value: int, accept=None) -> tuple[Any, int] | None:
        """(id, distance) of the closest indexed hash within max_distance (and `accept(id)` if given), or None."""
        best: tuple[Any, int] | None = None
        seen: set[int] = set()
        for table, band_key in zip(self._tables, self._keys(value), strict=True):
            for slot in table.get(band_key, ()):
                if slot in seen:
                    continue
                seen.add(slot)
                distance = (self._hashes[slot] ^ value).bit_count()
                closer = distance <= self.max_distance and (best is None or distance < best[1])
                if closer and (accept is None or accept(self._ids[slot])):
                    best = (self._ids[slot], distance)
        return best

    def add(self, value: int, ident: Any) -> None:
        slot = len(self._hashes)
        self._hashes.append(value)
        self._ids.append(ident)
        for table, band_key in zip(self._tables, self._keys(value), strict=True):
            table.setdefault(band_key, []).append(slot)


# ---------------------------------------------------------------- level 1: CLIP


class ClipScorer:
    """Cosine similarity of CLIP image and text embeddings (safetensors weights only, no remote code)."""

    def __init__(self, model_dir) -> None:
        import torch
        from transformers import AutoModel, AutoProcessor

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = (
            AutoModel.from_pretrained(model_dir, use_safetensors=True, trust_remote_code=False).eval().to(self.device)
        )
        self.processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=False)
        self.max_text_tokens = int(getattr(self.model.config.text_config, "max_position_embeddings", 77))
        meta = Path(model_dir) / "builtin.json"
        self.recommended_threshold: float | None = (
            json.loads(meta.read_text()).get("recommended_threshold") if meta.is_file() else None
        )

    @staticmethod
    def _features(output):
        return output if hasattr(output, "norm") else output.pooler_output

    def score(self, images: Sequence, captions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(cosine per pair [n], L2-normalised image embeddings [n, d]) for one batch."""
        torch = self.torch
        inputs = self.processor(
            text=list(captions),
            images=list(images),
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_text_tokens,
        )
        inputs = inputs.to(self.device)
        with torch.inference_mode():
            image = self._features(self.model.get_image_features(pixel_values=inputs["pixel_values"]))
            text = self._features(
                self.model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"))
            )
        image = torch.nn.functional.normalize(image.float().cpu(), dim=-1)
        text = torch.nn.functional.normalize(text.float().cpu(), dim=-1)
        return (image * text).sum(-1).numpy(), image.numpy()


@lru_cache(maxsize=2)
def load_clip(model_uri: str) -> ClipScorer:
    from components._shared.model.sources import resolve_model

    return ClipScorer(resolve_model(model_uri))


# ---------------------------------------------------------------- level 2: NSFW

NSFW_CLASSES = frozenset(
    {"FEMALE_GENITALIA_EXPOSED", "MALE_GENITALIA_EXPOSED", "FEMALE_BREAST_EXPOSED", "BUTTOCKS_EXPOSED", "ANUS_EXPOSED"}
)


class NsfwScorer:
    """Max score of nudenet's exposed-body classes (0.0 when none is detected)."""

    def __init__(self, threads: int = 0) -> None:
        import onnxruntime
        from nudenet import NudeDetector

        self.detector = NudeDetector()
        if threads:  # nudenet builds its session without options; rebuild it with a thread cap
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            import nudenet

            model_path = str(Path(nudenet.__file__).parent / "320n.onnx")  # the detector NudeDetector() loads
            self.detector.onnx_session = onnxruntime.InferenceSession(
                model_path, options, providers=["CPUExecutionProvider"]
            )

    def score(self, image) -> float:
        bgr = np.ascontiguousarray(np.asarray(image)[:, :, ::-1])
        detections = self.detector.detect(bgr)
        return max((float(d["score"]) for d in detections if d["class"] in NSFW_CLASSES), default=0.0)


@lru_cache(maxsize=2)
def load_nsfw(threads: int = 0) -> NsfwScorer:
    return NsfwScorer(threads)


# ---------------------------------------------------------------- level 3: OCR vs caption

# level 3 (OCR vs caption): the reader and the word matching live in components/_shared/data/ocr.py (rl's
# OCR-consistency reward uses them too): OcrReader, load_ocr, unmentioned_words.


# ---------------------------------------------------------------- level 4: embedding outliers


def knn_outlier_scores(
    embeddings: np.ndarray, *, k: int, reference_size: int, seed: int, block: int = 4096
) -> np.ndarray:
    """Mean cosine distance of each row to its k nearest neighbours in a random reference sample.

    Cost is O(n * reference_size) instead of O(n^2); a row never counts itself as a neighbour.
    """
    n = len(embeddings)
    rng = np.random.default_rng(seed)
    ref_idx = np.sort(rng.choice(n, size=min(n, reference_size), replace=False))
    reference = embeddings[ref_idx].astype(np.float32)
    position_in_ref = np.full(n, -1)
    position_in_ref[ref_idx] = np.arange(len(ref_idx))
    k = min(k, len(ref_idx) - 1)
    scores: np.ndarray = np.empty(n, dtype=np.float32)
    for start in range(0, n, block):
        rows = np.arange(start, min(n, start + block))
        sims = embeddings[rows].astype(np.float32) @ reference.T
        own = position_in_ref[rows]
        has_own = own >= 0
        sims[np.nonzero(has_own)[0], own[has_own]] = -np.inf
        top = -np.partition(-sims, k - 1, axis=1)[:, :k]
        scores[rows] = (1.0 - top).mean(axis=1)
    return scores


def robust_threshold(scores: np.ndarray, z: float) -> float:
    """median + z * 1.4826 * MAD (a floor keeps identical-looking data from flagging tiny differences)."""
    median = float(np.median(scores))
    sigma = 1.4826 * float(np.median(np.abs(scores - median)))
    return median + z * max(sigma, 1e-3)


# ---------------------------------------------------------------- level 5: self-judge


class CaptionJudge:
    """Mean caption-token loss of an image-text-to-text VLM ("the model judges its own data"), with images resized
    within the stage's [min_pixels, max_pixels] (the budget every later stage uses, not the processor's own)."""

    def __init__(self, model_dir, prompt: str, *, min_pixels: int, max_pixels: int) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from components._shared.model.families import family_for

        self.torch = torch
        self.processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=False)
        self.processor.tokenizer.padding_side = "right"
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = (
            AutoModelForImageTextToText.from_pretrained(model_dir, use_safetensors=True, trust_remote_code=False)
            .eval()
            .to(self.device)
        )
        self.prompt = prompt
        self.template_kwargs = family_for(self.model).template_kwargs
        self.images_kwargs = {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}

    def _prompt_text(self) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.prompt}]}]
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )

    def losses(self, images: Sequence, captions: Sequence[str]) -> np.ndarray:
        """Per-pair mean negative log-likelihood of the caption given image and prompt."""
        torch = self.torch
        prompt = self._prompt_text()
        eos = self.processor.tokenizer.eos_token or ""

        def encode(texts: list[str]):
            return self.processor(
                text=texts, images=list(images), return_tensors="pt", padding=True, images_kwargs=self.images_kwargs
            )

        prompt_len = encode([prompt] * len(images))["attention_mask"].sum(1)
        full = encode([prompt + c + eos for c in captions])
        labels = full["input_ids"].clone()
        positions = torch.arange(labels.shape[1]).unsqueeze(0)
        labels[(positions < prompt_len.unsqueeze(1)) | (full["attention_mask"] == 0)] = -100
        targets = labels[:, 1:]
        valid = targets != -100
        with torch.inference_mode():
            logits = self.model(**full.to(self.device)).logits[:, :-1]
            rows = logits[valid.to(logits.device)].float().cpu()  # only the caption rows go to fp32, not B x L x V
        token_loss = torch.nn.functional.cross_entropy(rows, targets[valid], reduction="none")
        owner = valid.nonzero()[:, 0]
        sums = torch.zeros(len(captions)).index_add_(0, owner, token_loss)
        return (sums / valid.sum(1).clamp(min=1)).numpy()


@lru_cache(maxsize=1)
def load_judge(model_uri: str, prompt: str, min_pixels: int, max_pixels: int) -> CaptionJudge:
    from components._shared.model.sources import resolve_model

    return CaptionJudge(resolve_model(model_uri), prompt, min_pixels=min_pixels, max_pixels=max_pixels)
