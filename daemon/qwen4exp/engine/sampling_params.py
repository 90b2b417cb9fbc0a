"""A request's sampling parameters: validated once, from keyword arguments or a JSON object.

Kept apart from the sampler (which needs torch) so the daemon's request preparation reads them without torch.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

GREEDY_BELOW = 1e-5
# field -> (int or float, range check, allowed values as shown in errors)
_RULES = {
    "temperature": (float, lambda v: 0.0 <= v < math.inf, "a finite number >= 0 (0 = greedy)"),
    "top_k": (int, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    "min_p": (float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
    "repetition_penalty": (float, lambda v: 0.01 <= v <= 100.0, "a number in [0.01, 100] (1 = off)"),
    "presence_penalty": (float, lambda v: -2.0 <= v <= 2.0, "a number in [-2, 2]"),
    "frequency_penalty": (float, lambda v: -2.0 <= v <= 2.0, "a number in [-2, 2]"),
    "seed": (int, lambda v: True, "an integer or null"),
}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # CTRL/HF style, over prompt and generated tokens
    presence_penalty: float = 0.0     # OpenAI style, over generated tokens
    frequency_penalty: float = 0.0    # OpenAI style, over generated tokens
    seed: int | None = None           # None: a fresh random seed per Sampler

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind, ok, allowed = _RULES[f.name]
            if f.name == "seed" and value is None:
                continue
            # bool is an int in Python, but `"top_k": true` is a client bug, not 1.
            wanted = numbers.Integral if kind is int else numbers.Real
            if isinstance(value, bool) or not isinstance(value, wanted):
                raise ValueError(f"{f.name} must be {allowed}, got {type(value).__name__} {value!r}")
            try:
                value = kind(value)
            except OverflowError:       # an integer past float's range, as JSON can write one
                raise ValueError(f"{f.name} must be {allowed}, got an integer of {value.bit_length()} bits") from None
            if not ok(value):  # NaN fails every range check
                raise ValueError(f"{f.name} must be {allowed}, got {value!r}")
            object.__setattr__(self, f.name, value)

    @property
    def greedy(self) -> bool:
        # Below this, softmax(logits / temperature) is one-hot in float32 anyway: take the argmax directly.
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "request") -> SamplingParams:
        """Build from a JSON object (a --prompts-file line, an HTTP body). null means the default."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: sampling parameters must be an object, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"{where}: unknown sampling key {key!r}{hint}; known keys: {', '.join(names)}")
        try:
            return cls(**{k: v for k, v in d.items() if v is not None})
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
