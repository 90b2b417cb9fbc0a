"""A chat's generated text as the client reads it: reasoning apart (`reasoning_content`, and `reasoning`, vLLM's
current name for it), the answer's text, and its tool calls, in OpenAI's message and streamed-delta shapes.

The text goes through the reasoning split first, then the answer part through the tool-call reader; a streamed
answer's deltas join to the message a whole answer gets.
"""

from __future__ import annotations

import os

from .chat_prompt import ChatReading
from .reasoning import REASONING, ReasoningSplit
from .tool_calls import ToolCallStream


class ChatAnswer:
    def __init__(self, reading: ChatReading):
        self.reading = reading
        self._split = ReasoningSplit(reading.thinking)
        self._calls = ToolCallStream(reading.tools) if reading.tools is not None else None
        self._held: list[dict] = []
        # The call's start the server wrote (tool_choice "required" or named) is read as the answer's head; where the
        # model does not complete the call, that start comes back as content, and is cut from it: the client sees
        # only what the model wrote.
        self._forced_left = reading.forced if self._calls is not None else ""
        if self._forced_left:
            self._held = self._calls.push(reading.forced)

    def push(self, text: str) -> list[dict]:
        """The deltas the next piece of generated text makes certain."""
        return self._deltas(self._split.push(text), final=False)

    def finish(self) -> list[dict]:
        """The deltas left when generation ends."""
        return self._deltas(self._split.finish(), final=True)

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's "tool_calls" when the model stopped after calling; the engine's reason otherwise."""
        return "tool_calls" if engine_reason == "stop" and self._calls is not None and self._calls.calls \
            else engine_reason

    def message(self, text: str) -> dict:
        """The whole answer as a chat message (`content` null when the answer is calls only)."""
        deltas = self.push(text) + self.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas) if self._split.reasoned else None
        content = "".join(d.get("content", "") for d in deltas)
        calls = [call for d in deltas for call in d.get("tool_calls", ())]
        message = {"role": "assistant", "content": None if calls and not content else content,
                   "reasoning_content": reasoning, "reasoning": reasoning}
        if calls:
            message["tool_calls"] = [{key: value for key, value in call.items() if key != "index"} for call in calls]
        return message

    def _deltas(self, pieces: list[tuple[str, str]], final: bool) -> list[dict]:
        out, self._held = self._held, []
        for kind, text in pieces:
            if kind == REASONING:
                out.append({"reasoning_content": text, "reasoning": text})
            elif self._calls is None:
                out.append({"content": text})
            else:
                out += self._calls.push(text)
        if final and self._calls is not None:
            out += self._calls.finish()
        if self._forced_left:
            out = self._without_forced(out)
        if not self.reading.parallel_calls:       # the first call only
            out = [d for d in out if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        return out

    def _without_forced(self, deltas: list[dict]) -> list[dict]:
        """`deltas` with the server-written call start taken from the head of their content (a call sent means
        the start was the model's call's)."""
        out = []
        for delta in deltas:
            if "tool_calls" in delta:
                self._forced_left = ""
            if not self._forced_left or "content" not in delta:
                out.append(delta)
                continue
            text = delta["content"]
            same = len(os.path.commonprefix([text, self._forced_left]))
            self._forced_left = self._forced_left[same:] if same == len(text) else ""
            if text[same:]:
                out.append({"content": text[same:]})
        return out
