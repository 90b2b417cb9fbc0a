"""Stop strings over streamed text (OpenAI semantics: the stop string itself is never emitted).

Text is held back only while it could still turn into a stop string, so a client sees every
character as soon as it is certain. Generation stops at the first character where any stop string
ends (if several end there, the longest wins), which is what a model watching its own output would
see; the result therefore depends only on the concatenated text, never on how it was cut into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class StopMatcher:
    def __init__(self, stop_strings: Sequence[str] = ()):
        # A bare string would iterate as single characters: a silent, wrong stop set.
        if isinstance(stop_strings, (str, bytes)) or not isinstance(stop_strings, Sequence):
            raise ValueError(f"stop must be a list of strings, got {type(stop_strings).__name__}")
        if len(stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop_strings)}")
        for i, stop in enumerate(stop_strings):
            if not isinstance(stop, str):
                raise ValueError(f"stop[{i}] must be a string, got {type(stop).__name__} {stop!r}")
            if not stop:
                raise ValueError(f"stop[{i}] is empty; an empty stop string would match before any text")
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"stop[{i}] has {len(stop)} characters; at most {MAX_STOP_CHARS} are allowed")
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(stop_strings))  # dedupe, keep order
        self.matched: str | None = None  # the stop string that ended the text, once one has
        self._held = ""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, delta: str) -> tuple[str, bool]:
        """Add newly decoded text; return (text safe to emit now, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        if not self.stop_strings:
            return delta, False
        # Emitted text never holds the start of a stop string (see _hold), so searching only the
        # held tail plus the new delta finds every match.
        text = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, -length, stop): earliest end, then longest
        for stop in self.stop_strings:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), -len(stop)) < best[:2]):
                best = (at + len(stop), -len(stop), stop)
        if best is not None:
            end, neg_len, self.matched = best
            self._held = ""
            return text[:end + neg_len], True
        hold = self._hold(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """Text held back so far; call when generation ends without a stop string."""
        text, self._held = self._held, ""
        return text

    def _hold(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            # Only tails starting with stop[0] can match; the earliest such start is the longest.
            start = max(len(text) - len(stop) + 1, 0)
            while True:
                start = text.find(stop[0], start)
                if start < 0 or len(text) - start <= longest:
                    break
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start += 1
        return longest
