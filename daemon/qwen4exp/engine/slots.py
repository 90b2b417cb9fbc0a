"""The engine's N slots: one full-context sequence each, allocated once as the rows of one StateBatch
(so the decode step reads every slot at fixed shapes) and reused."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model.causal_lm import Qwen4ExpForCausalLM
from .request import Request
from .sampling import Sampler
from .state import SequenceState, StateBatch


@dataclass
class Slot:
    index: int
    state: SequenceState
    request: Request | None = None
    sampler: Sampler | None = None
    prefilled: int = 0                 # prompt tokens already run
    next_token: int | None = None      # chosen, not yet fed back (decode phase)
    detokenizer: object | None = None
    stops: object | None = None

    @property
    def busy(self) -> bool:
        return self.request is not None

    @property
    def decoding(self) -> bool:
        return self.request is not None and self.next_token is not None

    def release(self) -> None:
        self.request = self.sampler = self.detokenizer = self.stops = None
        self.prefilled = 0
        self.next_token = None


@dataclass
class SlotPool:
    states: StateBatch
    slots: list[Slot] = field(default_factory=list)

    @classmethod
    def allocate(cls, model: Qwen4ExpForCausalLM, count: int, context: int,
                 device: torch.device | None = None) -> "SlotPool":
        states = model.new_state_batch(count, context, device)
        return cls(states, [Slot(i, row) for i, row in enumerate(states.rows)])

    def free(self) -> list[Slot]:
        return [s for s in self.slots if not s.busy]

    def busy(self) -> list[Slot]:
        return [s for s in self.slots if s.busy]
