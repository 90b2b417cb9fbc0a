"""A speculative step's two halves at fixed shapes, replayed from CUDA graphs on a GPU (speculative.py decides what
goes in and what is kept).

Drafting: the MTP head over every slot's unseen positions (`most + 1` rows a slot, position-major; the rows a slot
has not got are idle), then its chained passes, each draft taken on the device (argmax) and fed to the next pass;
the drafts stay on the device, where the verify step reads them. Verifying: the main model over 1 + k positions a
slot (model/verify.py). The host's inputs travel through pinned buffers without waiting for the device, so the host
waits once a step: for the verify step's results (and the drafts behind them). One graph per draft count (0..most)
and one per verify length (1..most + 1), captured when the engine is made, while every slot is empty: idle rows keep
their state, and their position-indexed writes land where nothing is read (as DecodeRunner's). A graph keeps the ops
backend's form of the verify step at its capture (ops.rows_independent then). Off a GPU, or for a model whose layers
span devices, the same functions run eagerly. Eager, a step launches hundreds of kernels a pass, which is what
bounds it on a GPU (docs/PERFORMANCE.md, the MTP section).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from .cuda_graph import capture_graph
from .draft_length import StepCosts
from .model.causal_lm import Qwen4ExpForCausalLM
from .staged_inputs import StagedInputs
from .state import StateBatch

log = logging.getLogger("qwen4exp.engine")


class SpeculativeRunner:
    def __init__(self, model: Qwen4ExpForCausalLM, states: StateBatch, rope: tuple[torch.Tensor, torch.Tensor],
                 device: torch.device, most: int, graph: bool):
        self.model, self.states, self.rope, self.device, self.most = model, states, rope, device, most
        self.count = count = len(states.rows)
        self.head_rows = most + 1
        width = model.config.hc_count * model.config.hidden_size
        rows = self.head_rows * count          # the head's first pass and the longest verify step alike

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Inputs: written before each replay (the graphs read them in place).
        self._streams = zeros(rows, width, dtype=model.lm_head.weight.dtype)
        self._head = StagedInputs({"tokens": zeros(rows), "positions": zeros(rows),
                                   "active": zeros(rows, dtype=torch.bool), "last": zeros(count),
                                   "lengths": zeros(count), "going": zeros(max(most - 1, 1), count, dtype=torch.bool)})
        self._verify = StagedInputs({"tokens": zeros(rows), "positions": zeros(rows),
                                     "active": zeros(rows, dtype=torch.bool)})
        self._last = StagedInputs({"last": zeros(count)})   # each slot's last kept position, for `commit`
        self._drafts: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self._verifies: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._commits: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        if graph and device.type == "cuda" and not model.spans_devices:
            with torch.cuda.device(device):
                self._capture()

    # ---- what runs -------------------------------------------------------------------------------------------
    def _draft_pass(self, k: int) -> torch.Tensor | None:
        """The head over the unseen rows, then k - 1 chained passes -> drafts [k, N] (None for k = 0: the pass
        only writes the head's cache)."""
        head, model = self._head.inputs, self.model
        with torch.inference_mode():
            logits, carry = model.draft_rows(self._streams, head["tokens"], head["positions"], head["active"],
                                             self.states, self.rope, substeps=self.head_rows, logits=k > 0,
                                             pick=head["last"])
            if k == 0:
                return None
            token = logits.argmax(-1)
            drafts = [token]
            for depth in range(2, k + 1):
                logits, carry = model.draft_rows(carry, token, head["lengths"] + (depth - 2), head["going"][depth - 2],
                                                 self.states, self.rope)
                token = logits.argmax(-1)
                drafts.append(token)
            return torch.stack(drafts)

    def _verify_pass(self, substeps: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = substeps * self.count
        v = self._verify.inputs
        with torch.inference_mode():
            return self.model.verify_rows(v["tokens"][:n], v["positions"][:n], v["active"][:n], self.states,
                                          self.rope, substeps)

    def _commit_pass(self, substeps: int) -> None:
        self.states.commit(self._last.inputs["last"], substeps)

    # ---- graphs ----------------------------------------------------------------------------------------------
    def _capture(self) -> None:
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()       # the graphs replay one at a time: their temporaries can share
        for k in range(self.most + 1):
            self._drafts[k] = capture_graph(lambda k=k: self._draft_pass(k), self.device, pool)
        for substeps in range(1, self.most + 2):
            self._verifies[substeps] = capture_graph(lambda s=substeps: self._verify_pass(s), self.device, pool)
        # A commit is two kernels a carried tensor of every layer: replayed, the host does not launch them one by
        # one while the device waits. Captured keeping every row's state as it is (each row's last position the
        # step's last), so the capture's own runs change nothing.
        for substeps in range(2, self.most + 2):
            self._last.inputs["last"].fill_(substeps - 1)
            self._commits[substeps] = capture_graph(lambda s=substeps: self._commit_pass(s), self.device, pool)[0]
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        log.info("speculative steps captured as CUDA graphs (drafts 0..%d, verify and commit 1..%d positions) in "
                 "%.2f s",
                 self.most, self.most + 1, self.capture_seconds)

    @property
    def graphed(self) -> bool:
        return bool(self._verifies)

    def measure(self, repeats: int = 3) -> StepCosts:
        """Each step length's cost as the engine's steps run it (draft, verify, commit; inputs written, graphs
        replayed, the host waiting for the end), median of `repeats`, with 1, 2, 4, ... and every slot busy.
        Made while every slot is empty: the busy rows' state is cleared afterwards, and their position-indexed
        writes fall where a prompt writes before anything reads them."""
        busy_counts = sorted({min(2 ** i, self.count) for i in range(self.count.bit_length() + 1)})
        seconds: dict[int, list[float]] = {}
        for substeps in range(1, self.most + 2):
            seconds[substeps] = []
            for busy in busy_counts:
                if substeps == 1:
                    # Steps without drafts run the head's pass once every head_rows steps (Drafter.draft).
                    alone = self._median(lambda: self._synthetic_step(1, busy, head=False), repeats)
                    headed = self._median(lambda: self._synthetic_step(1, busy, head=True), repeats)
                    seconds[1].append(alone + (headed - alone) / self.head_rows)
                else:
                    seconds[substeps].append(self._median(lambda: self._synthetic_step(substeps, busy), repeats))
        for row in self.states.rows:
            row.reset()
        return StepCosts(busy_counts, seconds)

    def _median(self, step, repeats: int) -> float:
        times = []
        for _ in range(repeats + 1):         # the first replay of a shape is not timed
            self._wait()
            started = time.perf_counter()
            step()
            self._wait()
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _synthetic_step(self, substeps: int, busy: int, head: bool = True) -> None:
        """A step in which the first `busy` slots each draft substeps - 1 tokens and verify them all (with
        `head` False, no drafts and no pass of the head)."""
        count, k = self.count, substeps - 1
        width = self._streams.shape[1]
        on = [i < busy for i in range(count)]
        rows = [[0] * count for _ in range(self.head_rows)]
        head_active = [on] + [[False] * count for _ in range(self.head_rows - 1)]
        drafts = None
        if head:
            drafts = self.draft(k, {i: self._streams.new_zeros(1, width) for i in range(busy)}, rows, rows,
                                head_active, list(range(count)), [1] * count, [on] * (k - 1))
        positions = [[j if on[i] else 0 for i in range(count)] for j in range(substeps)]
        self.verify([[0] * count for _ in range(substeps)], positions, [on] * substeps, drafts)
        self.commit([substeps - 1] * count, substeps)

    # ---- the engine's calls ----------------------------------------------------------------------------------
    def draft(self, k: int, streams: dict[int, torch.Tensor], tokens: list[list[int]], positions: list[list[int]],
              active: list[list[bool]], last: list[int], lengths: list[int], going: list[list[bool]]
              ) -> torch.Tensor | None:
        """Drafts [k, N] on the device (None for k = 0), queued: nothing waits for them. `streams`: slot index ->
        its unseen positions' main streams [m, hc*H]; tokens/positions/active [most + 1][N] (row j of slot i: its
        j-th unseen position); `last`: each slot's row giving draft 1 (index into the flattened rows); `lengths`
        [N]; `going` [k - 1][N]: the slots that draft at depth 2..k. Valid until the next draft."""
        view = self._streams.view(self.head_rows, self.count, -1)
        view.zero_()
        for index, seen in streams.items():
            view[:seen.shape[0], index].copy_(seen)
        self._head.write(tokens=tokens, positions=positions, active=active, last=last, lengths=lengths,
                         **({"going": going} if going else {}))
        if k in self._drafts:
            graph, out = self._drafts[k]
            graph.replay()
            return out
        return self._draft_pass(k)

    def verify(self, tokens: list[list[int]], positions: list[list[int]], active: list[list[bool]],
               drafts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify step over len(tokens) positions a slot ([S][N], position-major) -> (logits [S*N, V], streams
        [S*N, hc*H]), valid until the next verify step of that length. Rows 1.. take their tokens from `drafts`
        [S - 1, N] on the device (the host's values there are placeholders), so the step queues behind the
        drafting without the host waiting for it."""
        substeps = len(tokens)
        n = substeps * self.count
        self._verify.write(tokens=tokens, positions=positions, active=active)
        if drafts is not None and substeps > 1:
            self._verify.inputs["tokens"][self.count:n].copy_(drafts[:substeps - 1].reshape(-1))
        if substeps in self._verifies:
            graph, out = self._verifies[substeps]
            graph.replay()
            return out
        return self._verify_pass(substeps)

    def commit(self, last: list[int], substeps: int) -> None:
        """After a verify step of `substeps` positions a slot: each slot's carried state as after its position
        last[i] (StateBatch.commit)."""
        self._last.write(last=last)
        if substeps in self._commits:
            self._commits[substeps].replay()
        else:
            self._commit_pass(substeps)
