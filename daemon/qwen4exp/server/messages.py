"""What the daemon and its engine worker say to each other over their pipe: one dataclass per kind of message,
read with isinstance on both ends, so a field is named once and a typo is an error, not a silent miss.

daemon -> worker: Submit, Cancel, Park, Unpark, StatsQuery, Stop.
worker -> daemon: Ready, Failed (before Ready), Token, Finished, Rejected, Parked, Unparked, Stats.
Replies (Parked, Unparked, Stats) come in the order their questions were asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class EngineState(str, Enum):
    """The daemon's view of its engine (a str, so it reads as its value in JSON and logs)."""
    LOADING = "loading"
    READY = "ready"
    PARKING = "parking"
    PARKED = "parked"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


# ---- daemon -> worker -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    id: str
    fields: dict          # the engine's request fields (server/prepare.py)


@dataclass(frozen=True)
class Cancel:
    id: str


class ParkLevel(str, Enum):
    RELEASE = "release"      # the model is freed; unpark reads the checkpoint again
    OFFLOAD = "offload"      # the weights go to pinned host memory; unpark copies them back

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Park:
    level: ParkLevel = ParkLevel.RELEASE


@dataclass(frozen=True)
class Unpark:
    pass


@dataclass(frozen=True)
class StatsQuery:
    pass


@dataclass(frozen=True)
class Stop:
    pass


# ---- worker -> daemon -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    info: dict            # context, plan, context_fitted_now, load_seconds, warm_up_seconds, device, vocab_size,
                          # gpu_bytes


@dataclass(frozen=True)
class Failed:
    error: str
    trace: str


@dataclass(frozen=True)
class TokenLogprobs:
    """An output token's log-probability and the most likely tokens' at its position (most likely first), each
    token as its bytes: a token can hold part of a character."""
    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...]


@dataclass(frozen=True)
class Token:
    id: str
    token: int
    text: str             # the text this token completed (may be empty: a character split across tokens)
    logprobs: TokenLogprobs | None = None      # when the request asked for them


@dataclass(frozen=True)
class Result:
    """How a request ended in the engine."""
    finish_reason: str    # stop | length | cancelled | error
    error: str | None
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    timings: dict = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None   # one per output id, when the request asked for them
    mtp: dict = field(default_factory=dict)       # {"drafted": D, "accepted": A}: speculative decoding's share


@dataclass(frozen=True)
class Finished:
    id: str
    result: Result


class RejectReason(str, Enum):
    INVALID = "invalid"          # the engine cannot serve it as asked (too long, bad ids or stop strings)
    QUEUE_FULL = "queue_full"
    PARKED = "parked"


@dataclass(frozen=True)
class Rejected:
    """The engine refused a request before starting it."""
    id: str
    reason: RejectReason
    message: str


@dataclass(frozen=True)
class Parked:
    seconds: float
    bytes_freed: int | None
    context: int | None
    level: ParkLevel = ParkLevel.RELEASE
    host_bytes_kept: int = 0               # the weights kept in pinned host memory (level offload)
    device_bytes_in_use: int | None = None   # what the driver reports in use on the device after the park


@dataclass(frozen=True)
class Unparked:
    info: dict


@dataclass(frozen=True)
class Stats:
    info: dict
