"""A Qwen model's reasoning apart from its answer: what it writes inside <think>...</think>.

Qwen's chat templates open the block in the prompt when thinking is on (the generation prompt ends with
`<think>\\n`), so the answer starts inside it and only `</think>` is generated; a template that leaves it to the
model lets the answer begin with `<think>`. Both are read here: `thinking` says whether the prompt left a block
open. Whitespace around the reasoning and between `</think>` and the answer is the template's layout, not text:
it is dropped. While streaming, a piece that could be the start of a tag, or whitespace that could precede
`</think>`, is held back until the next piece says what it is.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its end suffices) leaves a <think> block open in the assistant's turn."""
    turn = prompt_tail.rsplit("<|im_start|>", 1)[-1]
    return turn.rfind(OPEN) > turn.rfind(CLOSE)


def _tag_start(text: str, tag: str) -> int:
    """Where a suffix of `text` that could begin `tag` starts (len(text) when none does)."""
    for start in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[start:]):
            return start
    return len(text)


class ReasoningSplit:
    """Feed the generated text piece by piece; get (REASONING | CONTENT, text) pieces back in order."""

    def __init__(self, thinking: bool):
        self.reasoned = thinking           # a reasoning block was opened (then `reasoning` is reported, maybe "")
        self._inside = thinking
        self._may_open = not thinking      # an answer that has not begun may still open a block
        self._started = False              # some text of the current part was given out
        self._held = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            if self._inside:
                end = self._held.find(CLOSE)
                if end >= 0:
                    self._give(out, REASONING, self._held[:end].rstrip())
                    self._held, self._inside, self._started = self._held[end + len(CLOSE):], False, False
                    continue
                if final:
                    self._give(out, REASONING, self._held.rstrip())
                    self._held = ""
                    return out
                # Hold back what could begin </think>, and the whitespace before it (dropped if the tag follows).
                keep = len(self._held[:_tag_start(self._held, CLOSE)].rstrip())
                self._give(out, REASONING, self._held[:keep])
                self._held = self._held[keep:]
                return out
            if self._may_open:
                text = self._held.lstrip()
                if text.startswith(OPEN):
                    self._held, self._inside, self._may_open, self.reasoned = text[len(OPEN):], True, False, True
                    continue
                if not final and OPEN.startswith(text):        # empty, or a tag still arriving
                    return out
                self._may_open = False
            self._give(out, CONTENT, self._held)
            self._held = ""
            return out

    def _give(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not self._started:
            text = text.lstrip()
        if text:
            self._started = True
            out.append((kind, text))


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole generated text; reasoning is None when no block was opened."""
    split = ReasoningSplit(thinking)
    pieces = split.push(text) + split.finish()
    reasoning = "".join(t for kind, t in pieces if kind == REASONING)
    return (reasoning if split.reasoned else None), "".join(t for kind, t in pieces if kind == CONTENT)
