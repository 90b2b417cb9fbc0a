"""Speculative decoding with the model's MTP head: drafts, one verify step, the tokens plain decoding would give.

An engine step with drafting, for every decoding slot at once:
1. draft: the MTP head runs over each slot's positions whose main-model streams came since its last draft (the
   positions the last step kept, or a prompt's last one), each with the token after it: that writes the head's
   attention cache there from true inputs, and the last row's logits give draft 1. Drafts 2..k chain the head on
   its own streams and the draft before (their cache positions are rewritten from true inputs once verified).
   A step in which no slot drafts skips the head: the positions wait for the next step that drafts, or for a
   slot to have as many waiting as the head's first pass takes (most + 1).
2. verify: the main model runs the slot's next token and its k drafts in one verify step (model/verify.py), which
   gives each position the logits a plain decode step gives it there. It reads the drafts where the head left them,
   on the device: the host first waits for the step when it takes the tokens.
3. accept (engine.py): each slot's positions are sampled in order by its own sampler, which holds the history and
   random state plain decoding would have there; a draft is accepted when it equals the sample before it. The
   first mismatch ends the slot's tokens for the step, and the carried state is committed to the last position
   kept (StateBatch.commit). So the output is plain decoding's, bit for bit, greedy or seeded.

Drafts only cost time, so how many a slot gets is a matter of speed: with `adaptive`, from each slot's recent
acceptance and, where the runner measured its steps (a GPU), what each step length costs (draft_length.py),
with what the steps took beyond that on the host's clock, from `draft` to the end of `commit`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .draft_length import Acceptance, DraftLength, StepCosts
from .model.causal_lm import Qwen4ExpForCausalLM
from .slots import Slot, SlotPool
from .speculative_runner import SpeculativeRunner

log = logging.getLogger("qwen4exp.engine")


@dataclass
class _SlotDrafting:
    acceptance: Acceptance
    # The main streams [m, hc*H] of the slot's positions length-m..length-1 the head has not seen, and the
    # tokens after all but the last (the last one's is the slot's next token).
    streams: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    chunk_end_streams: torch.Tensor | None = None   # the last prompt chunk's last position's, for the next chunk


@dataclass
class Drafts:
    """A step's drafts: how many each decoding slot proposes (slot index -> k) and the tokens, [most, N] on the
    device (row d: every slot's draft d + 1; None when no slot drafts), where the verify step reads them."""
    counts: dict[int, int]
    tokens: torch.Tensor | None = None

    def lists(self) -> dict[int, list[int]]:
        """Each slot's drafts on the host (waits for the device to have made them)."""
        made = self.tokens.tolist() if self.tokens is not None else []
        return {index: [made[d][index] for d in range(k)] for index, k in self.counts.items()}


@dataclass
class DraftCounters:
    """What drafting did since the engine was made (/metrics)."""
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)    # [i]: steps whose draft i+1 was accepted


class Drafter:
    def __init__(self, model: Qwen4ExpForCausalLM, pool: SlotPool, rope: tuple[torch.Tensor, torch.Tensor],
                 most: int, adaptive: bool = True, graphs: bool = False, costs: StepCosts | None = None):
        if model.mtp is None:
            raise ValueError("mtp: this checkpoint has no MTP head (mtp_num_hidden_layers = 0; a GGUF converted by "
                             "llama.cpp drops it): set mtp = 0, or for a GGUF mtp_weights to a safetensors release of "
                             "the same model, whose head it then takes")
        self.model, self.pool, self.rope = model, pool, rope
        self.length = DraftLength(most, adaptive)
        self.device = model.lm_head.weight.device
        self.counters = DraftCounters(accepted_at=[0] * most)
        pool.states.allocate_history(most)
        self.runner = SpeculativeRunner(model, pool.states, rope, self.device, most, graphs)
        # A graph's cost is fixed: measured once, it prices every step (DraftLength); `costs`, where an engine of
        # the same model and shape measured them on this device before (a worker's, before its park), are taken
        # as they are. Eager steps' costs vary with the host's load, so off graphs the slots draft by acceptance.
        if adaptive and costs is not None:
            self.length.costs = costs
        elif adaptive and self.runner.graphed:
            self.length.costs = self.runner.measure()
            log.info("speculative step costs, ms by positions verified a slot, then busy slots: %s",
                     self.length.costs.table())
        self._slots = [_SlotDrafting(self.length.fresh()) for _ in pool.slots]
        self._step_began = 0.0

    @property
    def most(self) -> int:
        return self.length.most

    def start(self, slot: Slot) -> None:
        self._slots[slot.index] = _SlotDrafting(self.length.fresh())

    # ---- prompts ----------------------------------------------------------------------------------------------
    def after_prompt_chunk(self, slot: Slot, ids: torch.Tensor, streams: torch.Tensor, begin: int) -> None:
        """A prompt chunk (ids at begin.., its streams) ran: the head's cache takes its positions but the last,
        from the one before the chunk when that is known; the last waits for the token after it."""
        drafting = self._slots[slot.index]
        before = drafting.chunk_end_streams if begin > 0 else None
        if before is not None:
            head_streams, head_ids, start = torch.cat((before, streams[:-1])), ids, begin - 1
        else:
            head_streams, head_ids, start = streams[:-1], ids[1:], begin
        if head_ids.numel():
            self.model.draft_chunk(head_streams, head_ids, slot.state, start)
        last = streams[-1:].clone()           # not a view: the chunk's streams are freed
        drafting.chunk_end_streams = drafting.streams = last
        drafting.tokens = []

    # ---- decode -----------------------------------------------------------------------------------------------
    def _room(self, slot: Slot) -> int:
        """The most drafts the slot can take: its request's tokens left after the next, and context room for its
        idle rows' writes past them."""
        request = slot.request
        left = request.max_tokens - len(request.output_ids) - 1
        return max(0, min(left, slot.state.capacity - 2 - slot.state.length))

    def draft(self, decoding: list[Slot]) -> Drafts:
        """Each decoding slot's drafts, queued on the device (possibly none)."""
        self._step_began = time.perf_counter()
        count = len(self.pool.slots)
        seeing = [s for s in decoding if self._slots[s.index].streams is not None]
        wanted = dict.fromkeys((s.index for s in decoding), 0)
        wanted.update(self.length.choose_step({s.index: (self._slots[s.index].acceptance.rate, self._room(s))
                                               for s in seeing}))
        most = max(wanted.values(), default=0)
        rows = self.runner.head_rows
        if not most and all(self._slots[s.index].streams.shape[0] < rows for s in seeing):
            # No slot drafts, and the head waits until a slot drafts or has a pass's worth of unseen positions:
            # each slot's grow by this step's. Copied: they may be a verify step's outputs, which this one rewrites.
            for slot in seeing:
                drafting = self._slots[slot.index]
                if drafting.streams._base is not None:
                    drafting.streams = drafting.streams.clone()
                drafting.tokens.append(slot.next_token)
            return Drafts(wanted)
        # The head over every slot's unseen positions (rows position-major, as a verify step's), padded to the
        # runner's fixed most + 1 rows a slot; then drafts 2..k, the head on its own streams a position further.
        tokens = [[0] * count for _ in range(rows)]
        positions = [[s.state.length for s in self.pool.slots] for _ in range(rows)]
        active = [[False] * count for _ in range(rows)]
        last, streams = [0] * count, {}
        for slot in seeing:
            drafting, i = self._slots[slot.index], slot.index
            seen = drafting.streams.shape[0]
            last[i], streams[i] = (seen - 1) * count + i, drafting.streams
            for j, token in enumerate(drafting.tokens + [slot.next_token]):
                tokens[j][i], positions[j][i], active[j][i] = token, slot.state.length - seen + j, True
            drafting.streams, drafting.tokens = None, []
        going = [[wanted.get(s.index, 0) >= depth for s in self.pool.slots] for depth in range(2, most + 1)]
        made = self.runner.draft(most, streams, tokens, positions, active, last,
                                 [s.state.length for s in self.pool.slots], going)
        return Drafts(wanted, made)

    def verify(self, decoding: list[Slot], drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify step over each decoding slot's next token and drafts -> (logits [S, N, V], streams
        [S, N, hc*H]), S = 1 + the most drafts, valid until the next verify step. Rows past a slot's drafts are
        idle; their position-indexed writes land just past its last draft (which `_room` keeps inside the
        context); other slots' at their length."""
        count = len(self.pool.slots)
        substeps = 1 + max(drafts.counts.values(), default=0)
        tokens = [[0] * count for _ in range(substeps)]     # rows 1..: the drafts, on the device
        positions = [[s.state.length for s in self.pool.slots] for _ in range(substeps)]
        active = [[False] * count for _ in range(substeps)]
        for slot in decoding:
            fed, length, i = 1 + drafts.counts[slot.index], slot.state.length, slot.index
            tokens[0][i] = slot.next_token
            for j in range(substeps):
                if j < fed:
                    positions[j][i], active[j][i] = length + j, True
                else:
                    positions[j][i] = length + fed
        for slot in decoding:
            slot.state.check_room(1 + drafts.counts[slot.index])
        logits, streams = self.runner.verify(tokens, positions, active, drafts.tokens)
        self.counters.verify_steps += 1
        return logits.view(substeps, count, -1), streams.view(substeps, count, -1)

    def commit(self, kept: dict[int, int], streams: torch.Tensor, drafts: dict[int, list[int]]) -> None:
        """After the tokens are taken: slot index -> how many of its verified positions it keeps (1 + accepted
        drafts; finished requests are left out). The carried state goes back to the last kept position, and
        those positions wait for the head."""
        substeps = streams.shape[0]
        last = [substeps - 1] * len(self.pool.slots)
        for index, count in kept.items():
            last[index] = count - 1
        self.runner.commit(last, substeps)
        for index, count in kept.items():
            drafting, tried = self._slots[index], len(drafts[index])
            kept_streams, kept_tokens = streams[:count, index], drafts[index][:count - 1]
            if drafting.streams is None:            # the head saw the slot's positions before the step's
                drafting.streams, drafting.tokens = kept_streams, kept_tokens
            else:                                   # it did not run (`draft`): the unseen positions grow
                drafting.streams = torch.cat((drafting.streams, kept_streams))
                drafting.tokens += kept_tokens
            self.length.learn(drafting.acceptance, tried, count - 1)
        if self.length.costs is not None and drafts:
            self.length.costs.observe(1 + max(map(len, drafts.values())), sum(1 + len(d) for d in drafts.values()),
                                      time.perf_counter() - self._step_began)

    def count(self, drafted: int, accepted: int) -> None:
        """A slot's share of a step, finished or not (/metrics)."""
        self.counters.drafted += drafted
        self.counters.accepted += accepted
        for i in range(accepted):
            self.counters.accepted_at[i] += 1
