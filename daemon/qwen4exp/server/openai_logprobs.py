"""Output tokens' log-probabilities in OpenAI's two shapes: chat's `logprobs.content` entries and the legacy
completions' parallel lists.

A token is given as its text (U+FFFD where it holds part of a character) and, in chat, its bytes, from which a
client rebuilds the characters. JSON has no -Infinity: a token the model rules out reads -9999.0, as vLLM
reports it.
"""

from __future__ import annotations

import codecs

from .messages import TokenLogprobs

FLOOR = -9999.0


def _number(logprob: float) -> float:
    return max(logprob, FLOOR)


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def chat_entries(positions: list[TokenLogprobs]) -> list[dict]:
    """`choices[].logprobs.content` of a chat answer (or of one streamed chunk)."""
    return [{"token": _text(p.token), "logprob": _number(p.logprob), "bytes": list(p.token),
             "top_logprobs": [{"token": _text(t), "logprob": _number(lp), "bytes": list(t)} for t, lp in p.top]}
            for p in positions]


class CompletionLogprobs:
    """`choices[].logprobs` of /v1/completions: tokens, token_logprobs, top_logprobs (a {token: logprob} map per
    position; tokens with the same text share a key, as the format allows) and text_offset, each token's offset in
    characters from the start of the completion. Fed position by position, so a stream's offsets continue from
    one chunk to the next."""

    def __init__(self):
        self._characters = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def render(self, positions: list[TokenLogprobs]) -> dict:
        offsets = []
        for p in positions:
            offsets.append(self._characters)
            self._characters += len(self._utf8.decode(p.token))
        return {"tokens": [_text(p.token) for p in positions],
                "token_logprobs": [_number(p.logprob) for p in positions],
                "top_logprobs": [{_text(t): _number(lp) for t, lp in p.top} for p in positions],
                "text_offset": offsets}
