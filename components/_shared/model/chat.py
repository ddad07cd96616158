"""A checkpoint's own chat template, rendered into (text, trained) segments: which characters are assistant text.

Written by hand because `apply_chat_template(return_assistant_tokens_mask=True)` needs `{% generation %}` markers
that no Qwen template has. The template is rendered twice: once with the conversation, once with each assistant
message replaced by a unique marker. The marker render cuts the text into the template's own pieces; the real
render must equal those pieces with each assistant text (as the template wrote it: verbatim, or trimmed as
Qwen3.5's does) between them, or the encoder refuses the template instead of guessing. The trained span of a turn
is its text plus the end-of-turn token that follows it; everything the template adds around it (role headers,
Qwen3.5's empty `<think>` block after the last user turn) is context, as it is in the generation prompt.

    template = ChatTemplate(tokenizer, processor.chat_template, end_of_turn="<|im_end|>", extra={...})
    template.segments(messages)                      # [(text, trained), ...]
    template.segments(messages, add_generation_prompt=True)
"""

from __future__ import annotations

_MARKER = "\u2063qvl-assistant-{}\u2063"  # invisible separator: never in data, never trimmed by a template


class ChatTemplate:
    def __init__(self, tokenizer, template: str | None, *, end_of_turn: str, extra: dict | None = None) -> None:
        if not template:
            raise ValueError(
                "the checkpoint has no chat template (chat_template.json / chat_template.jinja / tokenizer_config's "
                "chat_template); save the model's processor with its template."
            )
        self.tokenizer, self.template, self.end_of_turn = tokenizer, template, end_of_turn
        self.extra = dict(extra or {})

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.extra,
        )

    def segments(self, messages: list[dict], *, add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
        """The rendered conversation as consecutive (text, trained) pieces; trained = assistant text + end token."""
        texts = [m["content"] for m in messages if m["role"] == "assistant"]
        marked, k = [], 0
        for message in messages:
            if message["role"] == "assistant":
                message = {**message, "content": _MARKER.format(k)}
                k += 1
            marked.append(message)
        pieces = self._split(self.render(marked, add_generation_prompt=add_generation_prompt), len(texts))
        real = self.render(messages, add_generation_prompt=add_generation_prompt)
        for written in (texts, [t.strip() for t in texts]):
            if real == pieces[0] + "".join(w + p for w, p in zip(written, pieces[1:], strict=True)):
                return self._label(pieces, written)
        raise ValueError(
            "the chat template changes assistant text in a way the encoder cannot follow (it neither keeps nor "
            "trims it); train with a template that writes assistant messages as given."
        )

    def shown_answer(self, text: str) -> str:
        """A generated answer as the template shows it in a conversation. Qwen3's and Qwen3.5's templates move what
        comes before a `</think>` into the reasoning block and keep what follows (left-trimmed of newlines); a
        sampled answer may hold a stray `</think>`, and scoring it verbatim would refuse the template."""
        if "</think>" in text and "</think>" in self.template:
            return text.split("</think>")[-1].lstrip("\n")
        return text

    @staticmethod
    def _split(text: str, n: int) -> list[str]:
        pieces = []
        for k in range(n):
            marker = _MARKER.format(k)
            if text.count(marker) != 1:
                raise ValueError("the chat template drops or repeats assistant messages; cannot find their text.")
            head, text = text.split(marker)
            pieces.append(head)
        return [*pieces, text]

    def _label(self, pieces: list[str], written: list[str]) -> list[tuple[str, bool]]:
        out = [(pieces[0], False)]
        for text, after in zip(written, pieces[1:], strict=True):
            end = self.end_of_turn if after.startswith(self.end_of_turn) else ""
            out += [(text + end, True), (after[len(end) :], False)]
        return [(text, trained) for text, trained in out if text]
