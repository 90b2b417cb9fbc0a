"""A generation request as the engine sees it, and what it reports back while it runs."""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from .sampling_params import SamplingParams

_ids = itertools.count(1)


class FinishReason(str, Enum):
    STOP = "stop"            # a stop token or stop string
    LENGTH = "length"        # max_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class PositionLogprobs:
    """An output position's log-probabilities under the model's own distribution (the raw logits' log-softmax,
    before temperature and penalties, as OpenAI and vLLM report them): the chosen token's, and the `top` most
    likely tokens' as (id, logprob), most likely first (ties: lower id first)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class RequestRejected(ValueError):
    """The request cannot be served as asked (too long, bad ids, queue full); nothing was started."""


class QueueFull(RequestRejected):
    pass


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()                       # stop strings (need the engine's tokenizer)
    logprobs: int | None = None                      # None: none; k: the chosen token's and the k most likely
    # Called on the engine's thread: on_token(request, token_id, text_delta), on_finish(request).
    on_token: Callable[["Request", int, str], None] | None = None
    on_finish: Callable[["Request"], None] | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")

    # Filled in by the engine.
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)   # one per output id, when asked
    cached_tokens: int = 0                           # prompt tokens restored from the prefix cache
    mtp_drafted: int = 0                             # tokens the MTP head drafted for it (speculative.py)
    mtp_accepted: int = 0                            # ... that the model then produced
    slot: int | None = None                          # the slot that served it
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None                  # took a slot
    first_token_at: float | None = None
    finished_at: float | None = None

    @functools.cached_property
    def stop_id_set(self) -> frozenset[int]:
        """stop_token_ids for the check at every generated token, which a scan of a long list would slow."""
        return frozenset(self.stop_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def timings(self) -> dict[str, float | None]:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000, 3)
        decode_s = None
        if self.first_token_at is not None and self.finished_at is not None and len(self.output_ids) > 1:
            decode_s = self.finished_at - self.first_token_at
        return {
            "cached_tokens": self.cached_tokens,
            "queued_ms": ms(self.submitted_at, self.started_at),
            "prefill_ms": ms(self.started_at, self.first_token_at),
            "decode_ms": None if decode_s is None else round(decode_s * 1000, 3),
            "decode_tokens_per_s": None if not decode_s else round((len(self.output_ids) - 1) / decode_s, 2),
        }
