"""What one forward runs over: a step batch, handed down through every layer with its ops backend.

Two phases share every layer's one forward:
- a prompt chunk: n new tokens of one sequence at positions start..start+n-1, over its SequenceState;
- a decode step: one new token for each of the N rows of a StateBatch, at fixed shapes (a CUDA graph replays
  it); rows not `active` compute but keep their state.
- a verify step (speculative decoding, verify.py): `substeps` decode steps in one forward, rows position-major
  (rows [j*N, (j+1)*N) are sub-step j, one row per state row); row-wise ops take all rows at once, per-phase ops
  run sub-step by sub-step at the decode step's shape, so each row computes what a decode step computes.
Both states have the same layout (`layers[i]`, `ple[i]`, `extra`), the first with a leading row dimension in
decode, so a layer reads its state as `step.state.layers[i]` in either phase. What truly differs by phase (conv,
the delta rule, the n-gram context, QSA selection and attention, the experts) is an ops call that asks
`step.decode`; the only layer code that asks is where a step writes its keys into the state (by slice in a
chunk, by row and position in decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..state import SequenceState, StateBatch
from .verify import SubstepOps

if TYPE_CHECKING:
    from .ops import TorchOps


@dataclass
class Step:
    ops: TorchOps                        # the model's backend, chosen when it was built (backend.py)
    token_ids: torch.Tensor              # [T]
    positions: torch.Tensor              # [T], where each token goes
    state: SequenceState | StateBatch
    cos_table: torch.Tensor              # rope tables indexed by position (ahead of every position here)
    sin_table: torch.Tensor
    start: int = 0                       # a chunk's first position, on the host (slices need no device read)
    active: torch.Tensor | None = None   # decode: [N] bool, the rows whose state advances
    flags: torch.Tensor | None = None    # active as uint8, converted once per step for the kernels that read it
    substeps: int = 1                    # decode: how many sub-steps the rows hold (a verify step's positions)
    cos: torch.Tensor = field(init=False)   # the rows' own rope values [T, rotary_dim]
    sin: torch.Tensor = field(init=False)
    _views: list | None = field(default=None, init=False, repr=False)
    _shared: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if self.decode:
            self.cos, self.sin = self.cos_table[self.positions], self.sin_table[self.positions]
            if self.flags is None:
                self.flags = self.active.to(torch.uint8)
        else:
            self.cos, self.sin = self.cos_table[self.start:self.end], self.sin_table[self.start:self.end]

    @property
    def decode(self) -> bool:
        return self.active is not None

    def shared(self, key, make):
        """make()'s value, made once per step: what every layer of a kind derives alike from the step's positions
        (the QSA layers' block geometry in decode), so a step with many such layers launches it once."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    @property
    def state_rows(self) -> torch.Tensor:
        """decode: each row's row of the state batch (row r belongs to state row r mod N)."""
        def make():
            rows = torch.arange(self.token_ids.numel() // self.substeps, device=self.token_ids.device)
            return rows.repeat(self.substeps) if self.substeps > 1 else rows
        return self.shared("state rows", make)

    def substep_views(self) -> list["Step"]:
        """decode: each sub-step as a decode step of its own over the same state (one step: itself)."""
        if self.substeps == 1:
            return [self]
        if self._views is None:
            n = self.token_ids.numel() // self.substeps
            parts = [slice(j * n, (j + 1) * n) for j in range(self.substeps)]
            self._views = [Step(self.ops.base, self.token_ids[part], self.positions[part], self.state, self.cos_table,
                                self.sin_table, active=self.active[part], flags=self.flags[part]) for part in parts]
        return self._views

    def on(self, device: torch.device, ops, rope) -> "Step":
        """This step's inputs on another device, with that device's ops backend and rope tables (`rope(length,
        device)`): a split model's layers there (placement.py). The state is the same object: the layers' parts of
        it are on their devices already."""
        def moved(tensor):
            return None if tensor is None else tensor.to(device)

        table = rope(self.cos_table.shape[0], device)
        return Step(SubstepOps(ops) if self.substeps > 1 else ops, moved(self.token_ids), moved(self.positions),
                    self.state, table[0], table[1], start=self.start, active=moved(self.active),
                    flags=moved(self.flags), substeps=self.substeps)

    @property
    def end(self) -> int:
        """A chunk's position after its last token."""
        return self.start + self.token_ids.numel()

    @classmethod
    def chunk(cls, ops, token_ids: torch.Tensor, state: SequenceState, rope: tuple[torch.Tensor, torch.Tensor]
              ) -> "Step":
        start = state.length
        positions = torch.arange(start, start + token_ids.numel(), device=token_ids.device)
        return cls(ops, token_ids, positions, state, rope[0], rope[1], start=start)

    @classmethod
    def rows(cls, ops, token_ids: torch.Tensor, positions: torch.Tensor, active: torch.Tensor, states: StateBatch,
             rope: tuple[torch.Tensor, torch.Tensor], substeps: int = 1) -> "Step":
        if substeps > 1:
            ops = SubstepOps(ops)
        return cls(ops, token_ids, positions, states, rope[0], rope[1], active=active, substeps=substeps)
