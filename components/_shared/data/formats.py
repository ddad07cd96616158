"""The data formats people have, read once into the stages' records.

Containers (read by data/containers.py): JSON Lines (`.jsonl`, `.ndjson`), a JSON array (`.json`, LLaVA's own release
form, pretty-printed or on one line) and Parquet (`.parquet`, the hub's layout: an image column of {"bytes", "path"}
structs or raw bytes, read lazily row group by row group). Record shapes, detected per record or fixed by a file's
`format`:

- `llava` / `sharegpt`: {"id", "image" | "images", "conversations": [{"from": "system"|"human"|"gpt", "value"}]}
  (or role/content turns; a top-level "system" string is a system turn); `<image>` marks each image's place.
- `messages`: {"messages": [{"role", "content": str | [{"type": "image"}, {"type": "text", "text"}]}], "images"}
  as TRL and Hugging Face datasets use it; an image part may carry its own "image" / "url" / "path"
  (or OpenAI's {"type": "image_url", "image_url": {"url"}}, data: URIs included).
- `flat`: {"id", "image", "question", "answer" | "answers", "type"|"task", optional "choices", "box"} (held-out).
- `preference`: {"prompt", "chosen", "rejected", "image" | "images"} (TRL's DPO layout; RLHF-V / VLFeedback
  style), the prompt a string or messages, chosen / rejected strings or one assistant message.

Images are referenced by path (inside the data directory), s3:// URI, a data: URI, or Parquet bytes. Every record
keeps `source` ("file:line", "file:line [index in the array]", "file row N") and every bad record is reported with it,
all at once. Texts are checked here, before any training, for what the tokenizer would stop on later: the chat
template's control tokens (CONTROL_TOKENS) and lone surrogates (a broken \\u escape).
Video is not read (a video part is refused with its source): decoding and sampling video is its own input path.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import re
import unicodedata
from typing import Any

from components._shared.data.choices import choices_of, with_options
from components._shared.data.containers import (  # noqa: F401 - the containers are read through this module
    ParquetImage,
    Unparsable,
    iter_file,
    read_parquet_image,
)
from components._shared.data.text_checks import CONTROL_TOKENS, RecordError, check_text  # noqa: F401 - F.RecordError
from components._shared.platform.names import draws_nothing

ImageRef = str | bytes | ParquetImage

RECORD_FORMATS = ("auto", "llava", "sharegpt", "messages", "flat", "preference")
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
IMAGE_MARKER = "<image>"
_DATA_URI = re.compile(r"^data:image/[\w.+-]+;base64,", re.I)
_MARKER_LOOKALIKE = re.compile(r"<\s*image\s*>", re.IGNORECASE)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")


# ---------------------------------------------------------------------------------------------- fields ---


def image_ref(value: Any, image_root: str = "") -> ImageRef:
    """One image reference of a record: a path (under `image_root`), s3:// URI, data: URI, {"path"} / {"bytes"}
    struct (HF datasets' Image feature), or a Parquet cell."""
    if isinstance(value, ParquetImage):
        return dataclasses.replace(value, root=image_root) if image_root else value
    if isinstance(value, bytes):
        return value
    if isinstance(value, dict):
        if not {"bytes", "path", "url"} & value.keys():
            raise RecordError(
                f"an image object has 'bytes' and/or 'path' (the hub's Image feature), this one has keys "
                f"{sorted(value)[:8]}: a nested struct? give the image itself, not an object around it"
            )
        data = value.get("bytes")
        if data is not None and data not in ("", b""):
            if isinstance(data, bytes):
                return data
            if isinstance(data, str):
                return _data_bytes(data)
            raise RecordError(
                f"'bytes' is a {type(data).__name__} ({str(data)[:40]}), not the image file's bytes; give them as "
                "base64 text in JSON (bytes in Parquet), or give the image's 'path' instead"
            )
        value = value.get("path") or value.get("url")
    if not isinstance(value, str) or not value.strip():
        raise RecordError(f"an image must be a path, s3:// URI or data: URI, got {value!r}")
    if _DATA_URI.match(value):
        return _data_bytes(value)
    if value.startswith(("http://", "https://")):
        raise RecordError(
            f"image {value[:80]!r} is a web URL; download it into the data directory (nothing is fetched)."
        )
    _check_reference_form(value)
    if value.startswith("s3://") or not image_root:
        return value
    return f"{image_root.rstrip('/')}/{value}"


def _check_reference_form(value: str) -> None:
    """A reference in a form this reader does not take is named as that form (it would be "does not exist")."""
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", value)
    if value[:5].lower() == "data:":
        raise RecordError(f"image {value[:40]!r}...: a data: URI is read only as data:image/<type>;base64,<bytes>")
    if scheme and not value.startswith("s3://"):
        fix = (
            "write s3:// in lower case" if scheme.group(1).lower() == "s3" else "copy the image into the data directory"
        )
        raise RecordError(f"image {value[:80]!r}: {scheme.group(0)} is not read (local paths and s3:// are); {fix}")
    if "\\" in value:
        raise RecordError(
            f"image {value[:80]!r} has backslashes (a Windows path?); write it with / under the data directory"
        )
    if len(value) > 200 and re.fullmatch(r"[A-Za-z0-9+/=\s]+", value):
        raise RecordError(
            f"image {value[:40]!r}... looks like base64 bytes; write it as data:image/<type>;base64,<bytes>"
        )


def _data_bytes(text: str) -> bytes:
    try:
        return base64.b64decode(_DATA_URI.sub("", text), validate=True)
    except ValueError as error:
        raise RecordError(f"image data is not valid base64 ({error})") from error


def record_images(raw: dict, image_root: str) -> list[ImageRef]:
    """The images of a record's 'images' (else 'image'); an unusable one is an error naming the field (and index)."""
    key = "images" if raw.get("images") is not None else "image"
    value = raw.get(key)
    single = raw.get("image")
    if key == "images" and single not in (None, "", []) and not (isinstance(value, list) and single in value):
        raise RecordError("'image' is given beside 'images' and is not among them; put every image in 'images'")
    values = [] if value is None else value if isinstance(value, list) else [value]
    out = []
    for k, item in enumerate(values):
        try:
            out.append(image_ref(item, image_root))
        except RecordError as error:
            raise RecordError(f"'{key}'{f'[{k}]' if isinstance(value, list) else ''}: {error}") from None
    return out


def _text_of(content: Any, where: str, images: list, image_root: str) -> str:
    """A message's content as text with <image> markers; image parts that carry their image append it to `images`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecordError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    pieces = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RecordError(f"{where} part {k}: a text part needs a 'text' string")
            pieces.append(part["text"])
        elif kind in ("image", "image_url"):
            carried = one_of(part, ("image", "url", "path"), f"{where} part {k}")
            if kind == "image_url":
                carried = (
                    (part.get("image_url") or {}).get("url")
                    if isinstance(part.get("image_url"), dict)
                    else part.get("image_url")
                )
            if carried is not None:
                images.append(image_ref(carried, image_root))
            pieces.append(IMAGE_MARKER)
        elif kind == "video":
            raise RecordError(f"{where} part {k}: video is not supported; drop the record or extract frames as images")
        else:
            raise RecordError(f"{where} part {k}: unknown part {part!r}; use {{'type': 'text'|'image', ...}}")
    return "\n".join(p for p in pieces if p) if any(p == IMAGE_MARKER for p in pieces) else "".join(pieces)


def conversation(raw: dict, image_root: str = "") -> tuple[list[ImageRef], list[dict]]:
    """(images, turns [{"role": system|user|assistant, "text"}]) of a conversation record in any chat shape."""
    images = record_images(raw, image_root)
    if "conversations" in raw:
        messages, key = raw["conversations"], "conversations"
    elif "messages" in raw:
        messages, key = raw["messages"], "messages"
    else:
        raise RecordError("no 'conversations' or 'messages' list")
    if not isinstance(messages, list):
        raise RecordError(f"'{key}' must be a list of turns, got {type(messages).__name__}")
    if not messages:
        raise RecordError(f"'{key}' is empty; give the turns or drop the record")
    carried: list[ImageRef] = []
    turns = []
    system = raw.get("system")
    if system is not None and not isinstance(system, str):
        raise RecordError(f"'system' must be a string (the system prompt), got {type(system).__name__}")
    if system is not None and system.strip():  # a blank top-level 'system' (a table's unset column) is no system
        turns.append({"role": "system", "text": check_text(system, "'system'")})
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise RecordError(f"{key}[{i}] is {type(turn).__name__}, not a turn object")
        named = one_of(turn, ("from", "role"), f"{key}[{i}]")
        role = ROLES.get(str(named))
        if role is None:
            raise RecordError(f"{key}[{i}]: role {named!r}; use from=system|human|gpt or role=system|user|assistant")
        text = _text_of(one_of(turn, ("value", "content"), f"{key}[{i}]"), f"{key}[{i}]", carried, image_root)
        if turn.get("weight", 1) != 1:  # axolotl's "do not train on this turn": not read here, so it would train
            raise RecordError(
                f"{key}[{i}]: 'weight' {turn['weight']!r} is not read (every assistant turn trains); drop the turns "
                "not to learn, or split the conversation"
            )
        if role == "system" and turns:
            raise RecordError(
                f"{key}[{i}]: a system turn is only allowed first, and once (a top-level 'system' counts)"
            )
        if role != "user" and IMAGE_MARKER in text:
            raise RecordError(f"{key}[{i}]: an image marker in a {role} turn; images go in user turns")
        lookalike = next((m for m in _MARKER_LOOKALIKE.findall(text) if m != IMAGE_MARKER), None)
        if lookalike:
            raise RecordError(f"{key}[{i}]: {lookalike!r} looks like the image marker but is not; write {IMAGE_MARKER}")
        turns.append({"role": role, "text": check_text(text, f"{key}[{i}]")})
    if carried and images:
        raise RecordError("images both in the record's 'images' and inside message parts; give them one way")
    images = images or carried
    markers = sum(t["text"].count(IMAGE_MARKER) for t in turns)
    if markers and markers != len(images):
        raise RecordError(f"{len(images)} image(s) but {markers} {IMAGE_MARKER} marker(s); give one marker per image")
    if not any(t["role"] == "assistant" for t in turns):
        raise RecordError("no gpt/assistant turn to learn from")
    empty = next((i for i, t in enumerate(turns) if not visible_text(t["text"])), None)
    if empty is not None:
        system = turns[empty]["role"] == "system"
        fix = "drop the turn to keep the model's default system prompt" if system else "drop the turn"
        first = len(turns) - len(messages)  # 1 when a top-level 'system' came first
        where = "'system'" if empty < first else f"{key}[{empty - first}]"
        raise RecordError(f"{where} ({turns[empty]['role']}) is empty (nothing visible); {fix}, or write it")
    _check_turn_order(turns, key, first=len(turns) - len(messages))
    return images, turns


def _check_turn_order(turns: list[dict], key: str, first: int) -> None:
    """The user and the assistant take turns, the user first and the assistant last (after any system turn): a
    leading assistant turn answers nothing and a trailing user turn is never answered, so either would be dropped
    from what the model learns. `first`: the position of `key`[0] in `turns` (1 after a top-level system)."""
    dialogue = [(i - first, t["role"]) for i, t in enumerate(turns) if t["role"] != "system"]
    if dialogue[0][1] != "user":
        raise RecordError(
            f"{key}[{dialogue[0][0]}]: the conversation starts with an assistant turn, which answers "
            "nothing; start with the user's turn (drop the leading assistant turn)"
        )
    if dialogue[-1][1] != "assistant":
        raise RecordError(
            f"{key}[{dialogue[-1][0]}]: the conversation ends on a user turn that nothing answers; add "
            "its answer or drop the turn"
        )
    for (_, before), (i, role) in itertools.pairwise(dialogue):
        if role == before:
            raise RecordError(
                f"{key}[{i}]: a second {role} turn in a row; merge it into the one before, or put the "
                f"{'assistant' if role == 'user' else 'user'}'s turn between them"
            )


def _is_number(value) -> bool:
    """A finite int or float, not a bool (JSON true / false are ints to Python)."""
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and value == value and abs(value) != float("inf")
    )


def _check_markers(text: str, images: list) -> None:
    markers = text.count(IMAGE_MARKER)
    if markers and markers != len(images):
        raise RecordError(f"{len(images)} image(s) but {markers} {IMAGE_MARKER} marker(s); give one marker per image")


def _strip_markers(text: str) -> str:
    return "\n".join(line for line in text.replace(IMAGE_MARKER, "").splitlines() if line.strip()).strip()


def _answers(value: Any, field: str = "answers") -> list[str]:
    """Reference answers: a string, a list of strings, or VQAv2's [{"answer": ...}, ...]."""
    if isinstance(value, str):
        return [check_text(value, "the answer")]
    if isinstance(value, list) and value:
        out = [v.get("answer") if isinstance(v, dict) else v for v in value]
        texts = [v for v in out if isinstance(v, str)]
        if len(texts) == len(out):
            return [check_text(v, f"answer {k}") for k, v in enumerate(texts)]
    if value == []:
        raise RecordError(f"'{field}' is an empty list; give the reference answer(s), or drop the record")
    number = ' (a number: write it as a string, e.g. "2")' if isinstance(value, int | float) else ""
    raise RecordError(f"'{field}' must be a string or a list of strings, got {value!r}{number}")


def question(raw: dict, image_root: str = "", *, first_exchange: bool = False) -> dict:
    """A held-out / RL question {"images", "question", "answers", "choices", "box"} of a flat or chat record.

    A chat record is one user turn and its answer; with `first_exchange` (RL prompts, which default to the SFT
    conversations) a longer conversation gives its first user turn and the answer to it, and the result carries
    "shortened": True so the reader can count it."""
    if "question" in raw:
        if not isinstance(raw["question"], str):
            raise RecordError(f"'question' must be a string, got {type(raw['question']).__name__}")
        if not visible_text(raw["question"]):
            raise RecordError("'question' is empty (nothing visible); write the question or drop the record")
        if "answers" not in raw and "answer" not in raw:
            raise RecordError("a flat record needs 'answer' (or 'answers')")
        images = record_images(raw, image_root)
        _check_markers(check_text(raw["question"], "'question'"), images)
        text = _strip_markers(raw["question"])
        hint = raw.get("hint")
        if isinstance(hint, str) and hint.strip() and hint.strip().lower() != "nan":  # MMBench's own prompt form
            text = check_text(hint.strip(), "'hint'") + "\n" + text
        answers = _answers(raw.get("answers", raw.get("answer")), "answers" if "answers" in raw else "answer")
        if "answers" in raw and "answer" in raw:
            _one_of_the_answers(_answers(raw["answer"])[0], answers, "'answer'")
    else:
        images, turns = conversation(raw, image_root)
        roles = [t["role"] for t in turns]
        shortened = first_exchange and roles != ["user", "assistant"]
        if shortened:
            start = roles.index("user")  # conversation() checked: user first after any system turn, assistant next
            if any(IMAGE_MARKER in t["text"] for t in turns):  # markers in order: the first turn's images first
                images = images[: turns[start]["text"].count(IMAGE_MARKER)]
            turns, roles = turns[start : start + 2], ["user", "assistant"]
            if len(images) != 1:
                raise RecordError(
                    f"{len(images)} images in the first exchange (or images in later turns only); an RL prompt is "
                    "the first user turn with exactly one image"
                )
        if roles != ["user", "assistant"]:
            raise RecordError(
                f"turns {roles}: a held-out or RL question is one user turn and its answer, nothing else (no system "
                "turn, no further exchanges: they would be dropped); split the conversation into one record per "
                "question, or write it as a flat record (question, answer)"
            )
        text = _strip_markers(turns[0]["text"])
        if not visible_text(text):
            raise RecordError(
                "the user turn is the image alone (nothing visible is asked); write the question or drop it"
            )
        answers = _answers(raw["answers"]) if "answers" in raw else [turns[1]["text"]]
        if "answers" in raw:
            _one_of_the_answers(turns[1]["text"], answers, "the assistant turn")
    if len(images) != 1:
        raise RecordError(f"{len(images)} images; a held-out or RL question needs exactly one")
    if any(IMAGE_MARKER in a for a in answers):
        raise RecordError(f"an answer holds {IMAGE_MARKER}; the image goes with the question, the answer is text")
    if "system" in raw:
        raise RecordError(
            "'system': a held-out or RL question is asked without a system prompt (it would be dropped); drop it"
        )
    if not any(visible_text(a) for a in answers) and raw.get("box") is None:
        raise RecordError("the answer is empty (nothing visible); give the reference answer")
    choices = choices_of(raw)
    out: dict[str, Any] = {
        "images": images,
        "question": with_options(text, choices) if choices else text,
        "answers": answers,
    }
    if choices:
        out["choices"] = choices
    if "question" not in raw and shortened:
        out["shortened"] = True
    box = raw.get("box")
    if box is not None:
        numbers = isinstance(box, list) and len(box) == 4 and all(_is_number(v) for v in box)
        if not numbers or not (box[0] < box[2] and box[1] < box[3]):
            why = "" if not numbers else " (x2 must exceed x1 and y2 exceed y1: a box with area)"
            raise RecordError(f"'box' must be [x1, y1, x2, y2] in image pixels{why}, got {box!r}")
        out["box"] = [float(v) for v in box]
    return out


def _one_of_the_answers(given: str, answers: list[str], what: str) -> None:
    """A record that gives an answer beside its 'answers' says two things unless the one is among the others."""
    if visible_text(given).casefold() not in {visible_text(a).casefold() for a in answers}:
        raise RecordError(
            f"{what} {given[:80]!r} is not among 'answers' {[a[:40] for a in answers[:5]]}: the record says two "
            "things; give one answer, or the answers list alone"
        )


def _message(message: Any, where: str, carried: list, image_root: str) -> tuple[str, str]:
    """(role, text) of one message object of a preference record, checked the way conversation() checks turns."""
    if not isinstance(message, dict):
        raise RecordError(f"{where} is {type(message).__name__}, not a message object {{role, content}}")
    named = one_of(message, ("role", "from"), where)
    role = ROLES.get(str(named))
    if role is None:
        raise RecordError(f"{where}: role {named!r}; use role=system|user|assistant (or from=system|human|gpt)")
    return role, _text_of(one_of(message, ("content", "value"), where), where, carried, image_root)


def _side(value: Any, name: str, image_root: str) -> str:
    """A preference pair's answer: a string or one assistant message (TRL's layout), text only."""
    if isinstance(value, list):
        if len(value) != 1:
            raise RecordError(
                f"'{name}' holds {len(value)} messages; an answer is one assistant message (or a string): a "
                "multi-turn answer is not supported"
            )
        carried: list[ImageRef] = []
        role, value = _message(value[0], f"'{name}'[0]", carried, image_root)
        if role != "assistant":
            raise RecordError(f"'{name}'[0]: a {role} message; the answer is one message with role=assistant")
        if carried or IMAGE_MARKER in value:
            raise RecordError(f"'{name}': an image part in the answer; images go in the prompt")
    if not isinstance(value, str):
        raise RecordError(f"'{name}' must be a string or one assistant message, got {type(value).__name__}")
    if IMAGE_MARKER in value:
        raise RecordError(f"'{name}': an image marker in the answer; images go in the prompt")
    if not visible_text(value):
        raise RecordError(f"'{name}' is empty (nothing visible); write the answer or drop the pair")
    return check_text(value, f"'{name}'")


def visible_text(text: str) -> str:
    """What a reader sees of `text`, for comparing: NFKC-normalised, characters that draw nothing (invisible format
    characters such as the zero-width space, joiners, byte-order mark and soft hyphen; variation selectors; Hangul
    fillers, the Braille blank: platform/names.draws_nothing) removed, case folded, whitespace collapsed."""
    folded = unicodedata.normalize("NFKC", text)
    return " ".join("".join(c for c in folded if not draws_nothing(c)).casefold().split())


_SECOND_IMAGE = re.compile(r"(?i)\w*_images?|images?_?\d+")  # rejected_image, chosen_images, image2 (not image_id)


def preference(raw: dict, image_root: str = "") -> dict:
    """A preference pair {"images", "prompt", "chosen", "rejected"} (TRL's DPO layout, prompt a string or messages)."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in raw]
    if missing:
        raise RecordError(f"a preference record needs prompt, chosen and rejected; missing {missing}")
    images, prompt = record_images(raw, image_root), raw["prompt"]
    if isinstance(prompt, list):
        carried: list[ImageRef] = []
        messages = [_message(m, f"'prompt'[{i}]", carried, image_root) for i, m in enumerate(prompt)]
        roles = [role for role, _ in messages]
        if roles != ["user"]:
            raise RecordError(
                f"'prompt' messages {roles}: a preference prompt is one user message, nothing else (no system "
                "message, no earlier exchanges: they would be dropped); keep the one question the pair answers"
            )
        if carried and images:
            raise RecordError("images both in the record's 'image(s)' and inside prompt parts; give them one way")
        prompt, images = messages[0][1], images or carried
    if not isinstance(prompt, str):
        raise RecordError(f"'prompt' must be a string or messages, got {type(prompt).__name__}")
    if not prompt.strip():
        raise RecordError("'prompt' is empty; write the question or drop the pair")
    _check_markers(check_text(prompt, "'prompt'"), images)
    if len(images) != 1:
        raise RecordError(f"{len(images)} images; a preference pair needs exactly one")
    per_side = [
        k for k in raw if k not in ("image", "images") and _SECOND_IMAGE.fullmatch(k) and raw[k] not in (None, "", [])
    ]
    if per_side or "system" in raw:
        what = f"{per_side[0]!r} names another image" if per_side else "'system' would be dropped"
        raise RecordError(
            f"{what}: a pair is both answers to one prompt on one image ('image'), without a system prompt; drop it, "
            "or write one pair per image"
        )
    kind = raw.get("kind")
    if kind is not None and not (isinstance(kind, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", kind)):
        raise RecordError(
            f"'kind' {kind!r}: a pair's rejection kind names its pair-accuracy metric (pair_accuracy/<kind>); use "
            "letters, digits, '_', '.', '-' (e.g. wrong_attribute), or leave 'kind' out"
        )
    chosen, rejected = _side(raw["chosen"], "chosen", image_root), _side(raw["rejected"], "rejected", image_root)
    if visible_text(chosen) == visible_text(rejected):
        raise RecordError(
            "chosen and rejected are the same text to a reader (up to case, whitespace, invisible characters such as "
            "U+200B and Unicode compatibility forms); a pair must prefer one answer over a different one"
        )
    return {"images": images, "prompt": _strip_markers(prompt), "chosen": chosen, "rejected": rejected}


def one_of(mapping: dict, keys: tuple[str, ...], where: str) -> Any:
    """The value under whichever of `keys` (synonyms) the mapping gives; two that differ are an error, since one
    reader takes the first and another the second (`from` human and `role` assistant in one turn)."""
    given = [k for k in keys if mapping.get(k) is not None]
    if len({repr(mapping[k]) for k in given}) > 1:
        raise RecordError(f"{where}: {' and '.join(repr(k) for k in given)} are both given and differ; keep one")
    return mapping[given[0]] if given else None


def detect(raw: dict) -> str:
    """The record shape of one raw record (for format: auto); two shapes in one record are an error (one would be
    read, the other dropped without a word)."""
    shapes = [k for k in ("conversations", "messages", "question") if k in raw]
    if len(shapes) > 1:
        raise RecordError(f"the record holds {' and '.join(map(repr, shapes))}: two record shapes; keep one")
    if "chosen" in raw and "rejected" in raw:
        return "preference"
    if "conversations" in raw:
        return "llava"
    if "messages" in raw:
        return "messages"
    if "question" in raw:
        return "flat"
    raise RecordError(
        f"unknown record shape (keys {sorted(raw)[:8]}); expected 'conversations' (LLaVA / ShareGPT), 'messages' "
        "(chat parts), 'question' + 'answer' (flat) or 'prompt' + 'chosen' + 'rejected' (preference)"
    )
