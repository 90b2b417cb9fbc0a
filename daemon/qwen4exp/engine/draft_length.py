"""How many tokens each decoding slot drafts in a speculative step (speculative.py).

Drafts only cost time: the output is plain decoding's whatever is drafted. Each slot keeps an estimate p of how
often its drafts are taken (Acceptance), so drafting k tokens is expected to give it 1 + p + ... + p^k tokens in the
step. What the drafts cost is a property of the device and the model: a verify step runs the longest slot's
positions for every slot (one graph per length), and each position a slot verifies adds its own rows' expert reads.
Where the engine measured its steps (StepCosts: on a GPU, where the steps are graphs with fixed costs), a step
drafts what gives the most expected tokens per second of step, which is no drafts at all where the measured verify
steps cost more than they give; elsewhere each slot drafts as far as p^k >= `useful`. The measure prices the graphs
and their inputs; what the engine's host does around a step (sampling each verified position, the drafts'
bookkeeping) it learns from the steps' own clock as they run (StepCosts.observe).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class StepCosts:
    """Seconds of a speculative step (drafting, verifying and committing, as the engine runs them) by the positions
    it verifies a slot (1 = no drafts) and its busy slots: `seconds[substeps][i]` with `busy[i]` slots verifying
    `substeps` positions each, measured (SpeculativeRunner.measure). A step whose slots verify different numbers
    of positions is priced by its verified rows, between the measured slot counts. `extra[substeps]`: the seconds
    the engine's steps of that length took beyond the table's price, a running average (`observe`). A drafting
    length not yet run takes the nearest shorter drafting one's, else the nearest longer one's, else that of steps
    without drafts (which do less around them); those count nothing until one has run."""
    busy: list[int]
    seconds: dict[int, list[float]]
    extra: dict[int, float] = field(default_factory=dict)
    weight: float = 0.1         # of one step in `extra`
    # A step's drafts are chosen by pricing some 25 candidate steps (DraftLength): the table's prices never
    # change, and what a length takes beyond them changes only through `observe` (which forgets these), so both
    # are kept.
    _measured: dict[tuple[int, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _extras: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def step(self, substeps: int, rows: int) -> float:
        """The seconds of a step verifying `substeps` positions for its longest slot and `rows` rows in all."""
        extra = self._extras.get(substeps)
        if extra is None:
            extra = self._extras[substeps] = self._extra(substeps)
        return self.measured(substeps, rows) + extra

    def observe(self, substeps: int, rows: int, seconds: float) -> None:
        """A step of the engine's took `seconds` by the host's clock, from its drafts to its commit. What it took
        beyond the table counts from 0 (the table prices part of the step's work) up to twice the table's price,
        so that one step stalled by something else (a collection, another thread) moves the estimate little."""
        price = self.measured(substeps, rows)
        over = min(max(seconds - price, 0.0), 2 * price)
        self.extra[substeps] = self.extra.get(substeps, 0.0) + self.weight * (over - self.extra.get(substeps, 0.0))
        self._extras.clear()

    def _extra(self, substeps: int) -> float:
        if substeps in self.extra or substeps == 1:
            return self.extra.get(substeps, 0.0)
        drafting = [s for s in self.extra if s > 1]
        shorter, longer = [s for s in drafting if s < substeps], [s for s in drafting if s > substeps]
        return self.extra[max(shorter) if shorter else min(longer)] if drafting else self.extra.get(1, 0.0)

    def measured(self, substeps: int, rows: int) -> float:
        """The table's price of a step, without what the engine's steps showed beyond it."""
        price = self._measured.get((substeps, rows))
        if price is None:
            price = self._measured[substeps, rows] = self._interpolated(substeps, rows)
        return price

    def _interpolated(self, substeps: int, rows: int) -> float:
        at = self.seconds[substeps]
        slots = max(rows / substeps, self.busy[0])
        i = min(max(bisect_left(self.busy, slots), 1), len(self.busy) - 1) if len(self.busy) > 1 else 0
        if i == 0:
            return at[0]
        low, high = self.busy[i - 1], self.busy[i]
        return at[i - 1] + (at[i] - at[i - 1]) * (slots - low) / (high - low)

    def table(self) -> dict[str, dict[str, float]]:
        """For logs and benchmarks: milliseconds by positions verified, then busy slots."""
        return {str(s): {str(b): round(1e3 * t, 3) for b, t in zip(self.busy, times)}
                for s, times in self.seconds.items()}

    @classmethod
    def from_table(cls, table: dict[str, dict[str, float]], extra_ms: dict[str, float] | None = None) -> StepCosts:
        """The costs that `table()` wrote (a benchmark's results read back), with what the steps took beyond it
        in milliseconds by length where given."""
        busy = sorted(int(b) for b in next(iter(table.values())))
        return cls(busy, {int(s): [table[s][str(b)] / 1e3 for b in busy] for s in table},
                   {int(s): ms / 1e3 for s, ms in (extra_ms or {}).items()})


@dataclass
class Acceptance:
    """A slot's share of its tested drafts that were taken, over its recent steps: running averages of the drafts a
    step took and of those it tested (the taken ones and the first rejected), p = their ratio. A running average of
    the drafts one by one would lean toward each step's last draft tested, its rejected one, and read p low.
    A step without drafts tests nothing, and moves the estimate back toward the prior: a slot that stopped drafting
    tries again once its estimate has come back to where drafting pays, rather than never."""
    prior: float
    taken: float = field(init=False)
    tested: float = field(init=False, default=1.0)

    def __post_init__(self):
        self.taken = self.prior

    @property
    def rate(self) -> float:
        return self.taken / self.tested

    def add(self, drafted: int, accepted: int, weight: float, recovery: float) -> None:
        """A step that drafted `drafted` and took the first `accepted` of them, weighing `weight` of the averages;
        one without drafts moves them `recovery` of the way back to the prior."""
        if drafted:
            self.taken += weight * (accepted - self.taken)
            self.tested += weight * (accepted + (accepted < drafted) - self.tested)
        else:
            self.taken += recovery * (self.prior - self.taken)
            self.tested += recovery * (1.0 - self.tested)


@dataclass
class DraftLength:
    """How many tokens the slots draft. Not adaptive: always `most` (as room allows). Adaptive with `costs`: the
    drafts that maximise the step's expected tokens per second; without: as many as a slot's estimate p gives a
    chance of at least `useful` of all being taken (p ** k >= useful)."""
    most: int
    adaptive: bool = True
    useful: float = 0.3
    # A new request's estimate: high, so that it drafts and measures from its first steps (below a step's break
    # even it would wait for its estimate to recover before it measured anything).
    initial: float = 0.8
    weight: float = 0.1                # of one step with drafts in a slot's Acceptance
    recovery: float = 0.02             # of the way back to `initial`, a step without
    costs: StepCosts | None = None

    def choose(self, acceptance: float) -> int:
        """One slot's drafts by the acceptance rule (no costs known)."""
        if not self.adaptive:
            return self.most
        k = 0
        while k < self.most and acceptance ** (k + 1) >= self.useful:
            k += 1
        return k

    def choose_step(self, slots: dict[int, tuple[float, int]]) -> dict[int, int]:
        """Every decoding slot's drafts for one step: slot index -> (acceptance, the most it has room for) ->
        drafts."""
        if not self.adaptive or self.costs is None:
            return {i: min(room, self.choose(p)) for i, (p, room) in slots.items()}
        return self._cheapest_per_token(slots)

    def _cheapest_per_token(self, slots: dict[int, tuple[float, int]]) -> dict[int, int]:
        """The drafts with the most expected tokens per second of step. A slot's d-th draft is expected to add
        p^d tokens and costs its row; the step's length is its longest slot's. For each longest length allowed,
        the drafts are taken best first (a slot's in order, since p^d falls with d), each set priced."""
        count = len(slots)
        candidates = sorted(((p ** d, d, i) for i, (p, room) in slots.items()
                             for d in range(1, min(room, self.most) + 1)), key=lambda c: (-c[0], c[1]))
        best_rate, best = count / self.costs.step(1, count), (0, 0)
        for cap in range(1, self.most + 1):
            tokens, depth = float(count), 0
            for taken, (gain, d, _) in enumerate((c for c in candidates if c[1] <= cap), start=1):
                tokens, depth = tokens + gain, max(depth, d)
                rate = tokens / self.costs.step(depth + 1, count + taken)
                if rate > best_rate:
                    best_rate, best = rate, (cap, taken)
        cap, taken = best
        drafts = dict.fromkeys(slots, 0)
        for _, _, i in [c for c in candidates if c[1] <= cap][:taken]:
            drafts[i] += 1
        return drafts

    def fresh(self) -> Acceptance:
        """A new request's estimate, before any of its drafts were tested."""
        return Acceptance(self.initial)

    def learn(self, acceptance: Acceptance, drafted: int, accepted: int) -> None:
        """A slot's step: `drafted` drafts, the first `accepted` of them taken."""
        acceptance.add(drafted, accepted, self.weight, self.recovery)
