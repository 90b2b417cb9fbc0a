"""The qwen4_exp text model with its LM head over explicit state: a prompt chunk of one sequence, or a decode step
over the N rows of a state batch, through the same layers (step.py).

Tensor names match transformers' Qwen4ExpForCausalLM (plus `mtp.*`), so a checkpoint loads by name. The ops
backend (ops.py) is chosen from the weights' device and dtype when the model is built, and again whenever it is
moved or cast.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from ..memory import current_device
from ..placement import Placement
from ..state import SequenceState, StateBatch
from .config import ModelConfig
from .decoder import DecoderLayer, hyper_connection
from .mtp import HeadState, MTPHead
from .backend import ops_for
from .ops import TorchOps
from .rope import Rotary
from .step import Step


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        ple_index = {layer_id - 1: i for i, layer_id in enumerate(cfg.ple_layer_ids)}
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, cfg.is_qsa(i), ple_index.get(i)) for i in range(cfg.num_hidden_layers))
        self.hyper_connection_mixer = hyper_connection(cfg, inject=False)


def _one_by_one(run, substeps: int, rows: list[torch.Tensor], carried: list[torch.Tensor] = (), keep=None):
    """A verify step as `substeps` plain steps, for a backend whose rows are not independent of the row count:
    run(sub-step j's slice of each of `rows`) for each j, the carried tensors kept after each but the last; the
    outputs (tuples of tensors or None) concatenated."""
    n = rows[0].shape[0] // substeps
    outs = []
    for j in range(substeps):
        outs.append(run(*(r[j * n:(j + 1) * n] for r in rows)))
        if j < substeps - 1:
            for tensor in carried:
                keep(tensor, j)
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*outs))


def _hand_over(streams: list[torch.Tensor], pending: list, device: torch.device) -> tuple[list, list]:
    """The hyper-connection streams and the last layer's MoE output not yet injected, moved to the next layer's
    device (a split model's boundary, placement.py)."""
    return ([stream.to(device) for stream in streams],
            [None if part is None else tuple(t.to(device) for t in part) for part in pending])


def _on_target(method):
    """A split model's forward with its target as the current device throughout (the embedding, the LM head and
    the MTP head launch there too), whatever device the calling thread has."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.placement is None:
            return method(self, *args, **kwargs)
        with current_device(self.placement.target):
            return method(self, *args, **kwargs)
    return run


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg) if cfg.mtp_num_hidden_layers else None
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self._rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # Where each decoder layer lives (placement.py); None: every part on the LM head's device.
        self.placement: Placement | None = None
        self.ops: TorchOps = ops_for(self.lm_head.weight)
        self._layer_ops: dict[str, TorchOps] = {}

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .to_empty(), .bfloat16(): the weights may have moved to where other kernels serve them.
        super()._apply(fn, recurse)
        self.ops = ops_for(self.lm_head.weight)
        self._layer_ops = {}
        self._rope_tables = {}           # made again where the weights are now
        return self

    # ---- placement over several devices (placement.py) ---------------------------------------------------------
    def place(self, placement: Placement, allocate: bool = False) -> None:
        """Put each decoder layer on its device and the rest on the target: moved (`allocate`: allocated there
        without values, as a load fills them)."""
        if len(placement.layers) != len(self.model.layers):
            raise ValueError(f"the placement names {len(placement.layers)} layers; the model has "
                             f"{len(self.model.layers)}")
        move = (lambda module, device: module.to_empty(device=device)) if allocate else \
            (lambda module, device: module.to(device))
        for name, module in self.named_children():
            if name != "model":
                move(module, placement.target)
        for name, module in self.model.named_children():
            if name != "layers":
                move(module, placement.target)
        for layer, device in zip(self.model.layers, placement.layers):
            move(layer, device)
        self.placement = placement if placement.is_split else None
        self.ops = ops_for(self.lm_head.weight)
        self._layer_ops = {}
        self._rope_tables = {}

    def layer_devices(self) -> tuple[torch.device, ...] | None:
        """Each decoder layer's device in a split model (where its state goes), else None."""
        if self.placement is None:
            return None
        return tuple(torch.device(name) for name in self.placement.layers)

    def ops_on(self, index: int) -> TorchOps:
        """The ops backend of layer `index`'s device (the target's where it is there)."""
        name = self.placement.layers[index]
        if name == self.placement.target:
            return self.ops
        if name not in self._layer_ops:
            self._layer_ops[name] = ops_for(self.model.layers[index].mlp.gate.weight)
        return self._layer_ops[name]

    @property
    def spans_devices(self) -> bool:
        """Whether the layers run on more than one physical device (a split over "cpu" and "cpu:1" does not)."""
        if self.placement is None:
            return False
        return len({(d.type, d.index if d.type == "cuda" else None) for d in map(torch.device,
                                                                                 self.placement.devices)}) > 1

    @property
    def rows_independent(self) -> bool:
        """Whether every device's backend computes a row's numbers independent of the row count (verify.py)."""
        if self.placement is None:
            return self.ops.rows_independent
        return all(self.ops_on(i).rows_independent for i in range(len(self.model.layers))) and \
            self.ops.rows_independent

    def new_state(self, capacity: int, device: torch.device | str | None = None) -> SequenceState:
        param = self.lm_head.weight
        return SequenceState(self.config, capacity, device or param.device, param.dtype,
                             extra_attention_layers=1 if self.mtp is not None else 0,
                             layer_devices=self.layer_devices())

    def new_state_batch(self, count: int, capacity: int, device: torch.device | str | None = None) -> StateBatch:
        param = self.lm_head.weight
        return StateBatch(self.config, count, capacity, device or param.device, param.dtype,
                          extra_attention_layers=1 if self.mtp is not None else 0,
                          layer_devices=self.layer_devices())

    def rope(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables covering positions 0..length-1 at least, grown in powers of two (values do not depend
        on the table's size). A split device's is a copy of the target's: a layer reads the same values there."""
        dtype = self.lm_head.weight.dtype
        key = str(device)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < length or table[0].dtype != dtype:
            size = 1 << max(12, (length - 1).bit_length())
            target = self.lm_head.weight.device
            if self.placement is not None and key != str(target):
                table = tuple(t.to(device) for t in self.rope(size, target))
            else:
                table = self.rope_table(size, device)
            self._rope_tables[key] = table
        return table

    def release_rope_table(self) -> None:
        """Drop the grown tables (the context fit measures a chunk's peak with the table it needs)."""
        self._rope_tables = {}

    def rope_table(self, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..capacity-1 as a table of its own (a captured decode graph keeps it)."""
        return self.rotary.cos_sin(torch.arange(capacity, device=device), self.lm_head.weight.dtype)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, state: SequenceState, all_logits: bool = False,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """A prompt chunk: token_ids [n] at positions state.length.. of one sequence. Returns the logits of its
        last token [V] (of every token [n, V] with all_logits) and advances the state. `between_layers` is called
        after each layer but the last (the engine queues other sequences' decode steps there); it must leave this
        sequence's state as it found it."""
        return self.forward_chunks([(token_ids, state)], all_logits, between_layers)[0]

    @torch.inference_mode()
    def forward_chunks(self, chunks: list[tuple[torch.Tensor, SequenceState]], all_logits: bool = False,
                       between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Prompt chunks of several sequences (each as `forward` takes one, each sequence once) in one forward:
        each chunk's logits and state are the ones `forward` gives it alone (ops.chunks_experts: where the
        backend can, the chunks share the routed experts' launch and weight reads)."""
        return [logits for logits, _ in self.forward_chunks_with_streams(chunks, all_logits, between_layers)]

    @torch.inference_mode()
    @_on_target
    def forward_chunks_with_streams(self, chunks: list[tuple[torch.Tensor, SequenceState]], all_logits: bool = False,
                                    between_layers: Callable[[], None] | None = None
                                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`forward_chunks`, with each chunk's final streams [n, hc*H] (what the MTP head reads) beside its logits."""
        for token_ids, state in chunks:
            if token_ids.numel() == 0:
                raise ValueError("a chunk needs at least one token")
            state.check_room(token_ids.numel())
        end = max(state.length + token_ids.numel() for token_ids, state in chunks)
        rope = self.rope(end, chunks[0][0].device)
        steps = [Step.chunk(self.ops, token_ids, state, rope) for token_ids, state in chunks]
        outs = []
        for step, (hidden, streams) in zip(steps, self.run_steps(steps, between_layers)):
            step.state.length += step.token_ids.numel()
            logits = self.ops.linear(hidden if all_logits else hidden[-1:], self.lm_head.weight, step)
            outs.append((logits if all_logits else logits[0], streams))
        return outs

    @torch.inference_mode()
    def decode_rows(self, token_ids: torch.Tensor, positions: torch.Tensor, active: torch.Tensor,
                    states: StateBatch, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One decode step over every row of `states` at fixed shapes, with no host synchronisation: row i
        takes token_ids[i] at positions[i]; rows not `active` leave their state as it was (their K/V and
        indexer writes land at positions[i], which the caller points where nothing is read before it is written
        again: the row's length, or past a prompt chunk in flight).
        Returns logits [N, V]; a row's logits depend only on its own sequence. Lengths are the caller's
        to advance. Captured once per engine as a CUDA graph on GPUs."""
        return self.decode_rows_impl(token_ids, positions, active, states, rope)

    def decode_rows_impl(self, token_ids, positions, active, states: StateBatch, rope) -> torch.Tensor:
        """decode_rows without its inference-mode wrapper (what torch.compile traces)."""
        return self.verify_rows_impl(token_ids, positions, active, states, rope, 1)[0]

    @torch.inference_mode()
    def verify_rows(self, token_ids: torch.Tensor, positions: torch.Tensor, active: torch.Tensor,
                    states: StateBatch, rope: tuple[torch.Tensor, torch.Tensor], substeps: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`substeps` decode steps of every row of `states` in one forward (a verify step, model/verify.py): the
        inputs are [substeps * N], position-major (sub-step j's rows are [j*N, (j+1)*N)); each row's logits are the
        ones `decode_rows` gives it after the sub-steps before. The carried state is left as after the last
        sub-step, with the ones before in the history: `states.commit` keeps each row's accepted one.
        Returns (logits [R, V], the final streams [R, hc*H] the MTP head reads)."""
        return self.verify_rows_impl(token_ids, positions, active, states, rope, substeps)

    @_on_target
    def verify_rows_impl(self, token_ids, positions, active, states: StateBatch, rope, substeps: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        if substeps > 1 and not self.rows_independent:
            return _one_by_one(lambda *rows: self.verify_rows_impl(*rows, states, rope, 1), substeps,
                               [token_ids, positions, active], states.carried(), states.keep)
        step = Step.rows(self.ops, token_ids, positions.clamp(0, states.capacity - 1), active, states, rope,
                         substeps)
        hidden, streams = self.run(step)
        return self.ops.linear(hidden, self.lm_head.weight, step), streams

    # ---- the MTP head (speculative decoding's drafter) ---------------------------------------------------------
    @torch.inference_mode()
    @_on_target
    def draft_chunk(self, streams: torch.Tensor, token_ids: torch.Tensor, state: SequenceState, start: int) -> None:
        """The MTP head over a prompt's positions start..start+n-1 (streams [n, hc*H] of those positions, token_ids
        [n] the tokens after them): fills its attention cache (state.extra) there, as drafting will read it."""
        view = HeadState(state.extra, state.capacity, start)
        step = Step.chunk(self.ops, token_ids, view, self.rope(start + token_ids.numel(), token_ids.device))
        self.mtp(self.mtp.fuse(streams, self.ops.table_rows(self.model.embed_tokens, token_ids), step), step)

    @torch.inference_mode()
    @_on_target
    def draft_rows(self, streams: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                   active: torch.Tensor, states: StateBatch, rope: tuple[torch.Tensor, torch.Tensor],
                   substeps: int = 1, logits: bool = True, pick: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The MTP head over rows as a decode (or, with substeps, verify) step: row i fuses the main streams at
        positions[i] with token_ids[i], the token after that position; its attention cache is states.extra.
        Returns (the logits of the token after token_ids[i] [R, V], or None without `logits`; the head's own
        streams [R, hc*H], which the next draft position reads in place of the main model's). `pick` (row
        indices): both for those rows alone, the LM head run for them only."""
        if substeps > 1 and not self.rows_independent:
            rows, out = _one_by_one(lambda *part: self.draft_rows(*part, states, rope, 1, logits), substeps,
                                    [streams, token_ids, positions, active])
            return (rows, out) if pick is None else (None if rows is None else rows[pick], out[pick])
        view = HeadState(states.extra, states.capacity)
        step = Step.rows(self.ops, token_ids, positions.clamp(0, states.capacity - 1), active, view, rope, substeps)
        hidden, out = self.mtp(self.mtp.fuse(streams, self.ops.table_rows(self.model.embed_tokens, token_ids), step),
                               step)
        if pick is not None:
            hidden, out = hidden[pick], out[pick]
        return (self.ops.linear(hidden, self.lm_head.weight, step) if logits else None), out

    def run(self, step: Step, between_layers: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over a step -> (the mixed hidden rows [T, H] for the LM head, the streams [T, hc*H] they
        were mixed from). Lengths are the caller's to advance."""
        return self.run_steps([step], between_layers)[0]

    def run_steps(self, steps: list[Step], between_layers: Callable[[], None] | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`run` over several chunk steps of different sequences, layer by layer in step, so that each layer's
        MoE can take them all at once (ops.chunks_experts); one step runs its layers whole."""
        streams = [self.embed(step) for step in steps]
        pending: list = [None] * len(steps)
        last = len(self.model.layers) - 1
        on_target, here = steps, None if self.placement is None else self.placement.target
        # A split model's GPU layers run with their GPU as the current device (Triton launches there), the rest with
        # the target as the current device.
        with current_device(here), contextlib.ExitStack() as current:
            for index, layer in enumerate(self.model.layers):
                if here is not None and self.placement.layers[index] != here:      # a split model's boundary
                    here = self.placement.layers[index]
                    steps = on_target if here == self.placement.target else \
                        [step.on(torch.device(here), self.ops_on(index), self.rope) for step in on_target]
                    streams, pending = _hand_over(streams, pending, torch.device(here))
                    current.close()
                    current.enter_context(current_device(here))
                streams, pending = self._layer(layer, streams, steps, pending)
                if between_layers is not None and index < last:
                    with current_device(None if here is None else self.placement.target):
                        between_layers()
            if steps is not on_target:          # back to the target for the mixer and the LM head
                steps = on_target
                streams, pending = _hand_over(streams, pending, torch.device(self.placement.target))
                current.close()
            results = [self.mix_out(stream, step, inject) for stream, step, inject in zip(streams, steps, pending)]
        return results

    def embed(self, step: Step) -> torch.Tensor:
        """The hyper-connection streams [T, hc*H] a step's layers start from: its tokens' embeddings, repeated."""
        return self.ops.table_rows(self.model.embed_tokens, step.token_ids).repeat(1, self.config.hc_count)

    def run_layers(self, first: int, last: int, streams: torch.Tensor, step: Step, pending
                   ) -> tuple[torch.Tensor, tuple | None]:
        """Layers first..last over one step whose inputs are on their device (a run of a split model's layers:
        segmented_decode.py; that device current)."""
        for layer in self.model.layers[first:last + 1]:
            streams, pending = layer(streams, step, pending)
        return streams, pending

    def mix_out(self, streams: torch.Tensor, step: Step, pending) -> tuple[torch.Tensor, torch.Tensor]:
        """After the last layer, on the target: (the mixed hidden rows [T, H] for the LM head, the streams)."""
        streams, hidden, _ = self.model.hyper_connection_mixer(streams, step, inject=pending)
        return hidden, streams

    def _layer(self, layer, streams: list, steps: list[Step], pending: list) -> tuple[list, list]:
        """One decoder layer over each step's streams (several steps: their MoE at once, ops.chunks_experts)."""
        if len(steps) == 1:
            streams[0], pending[0] = layer(streams[0], steps[0], pending[0])
            return streams, pending
        parts = [layer.up_to_experts(*args) for args in zip(streams, steps, pending)]
        outs = steps[0].ops.chunks_experts(layer.mlp, [mixed for _, mixed, _ in parts], steps)
        return [part[0] for part in parts], [(out, gates) for out, (_, _, gates) in zip(outs, parts)]
