"""Hot experts: the most routed experts of a split model's layers, kept on the target as well (profile key
`hot_experts`, placement.py for the split).

A split device (an integrated GPU, the host) reads its memory more slowly than the target, and a decode step of a
split layer reads the weights of every expert its rows route to. Routing is skewed, so a copy of each split
layer's N most routed experts on the target lets the pairs routed to them run there, beside the others on the
layer's device; each pair's output goes back to the layer's device, where a row's k outputs are summed in slot
order as before. Prompt chunks run on the layer's device, which holds every expert (they read them all anyway).

Exactness: a pair's output comes from the same kernels (the torch forms' products, or kernels/moe.py's
`pair_outputs`) wherever it runs, so where both devices compute alike (two names of one device, two GPUs of one
kind) every number equals the one without hot experts (tests/test_hot_experts.py). On GPUs of different kinds a
pair may round otherwise on the target; the hot set is fixed while a model is loaded, so a row's numbers still
depend on that row alone (alone == together, warm == cold), and change only when a load picks other experts.

Which experts: every split layer counts the pairs its decode steps route to each expert while serving
(`count_while_serving`: a device tensor a layer, no host synchronisation; prompt chunks, which run on the layer's
device whatever is hot, are not counted). A load (start, unpark, restarted worker) keeps the N most counted of
each layer, from the counts kept so far (the worker keeps them across park/unpark) or, where there are none yet,
from a calibration prompt run when the model is loaded (its chunks counted): text of the embedded tokenizer corpus.

Which layers: those on a GPU. Layers in host memory beside a GPU target keep none: the torch forms they run
compute every pair on both devices at one shape (to keep their numbers), which would cost time and the target's
memory for nothing. (Two names of the CPU, as the tests place layers, keep them: the torch forms are what the tests
hold the kernels to.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import moe as kernels
from .memory import current_device
from .model.moe import Experts, pair_outputs, sum_slots
from .model.quantized import QuantizedStack

CALIBRATION_TOKENS = 2048


@dataclass
class HotExperts:
    """One split layer's hot experts: `ids` (ascending), their weights on `target`, and `slot_of` [E] (each
    expert's index among them, -1 for the others) on the layer's device."""
    ids: tuple[int, ...]
    target: torch.device
    gate_up: object              # [N, 2I, H] dense, or a QuantizedStack of the layer's type
    down: object
    slot_of: torch.Tensor
    chosen_from: str = "given"   # "serving" counts, a "calibration" prompt, or "given" (by the caller)

    @property
    def nbytes(self) -> int:
        return sum(_bytes(stack) for stack in (self.gate_up, self.down))


def _bytes(stack) -> int:
    tensor = stack.blocks if isinstance(stack, QuantizedStack) else stack
    return tensor.numel() * tensor.element_size()


def _copy(stack, ids: torch.Tensor, target: torch.device):
    """The entries `ids` of an expert stack, on `target`, in the stack's own form (blocks stay blocks)."""
    if isinstance(stack, QuantizedStack):
        with torch.device("meta"):            # its blocks are the copy below
            copy = QuantizedStack(stack.qtype, (len(ids), *stack.shape[1:]), stack.dtype)
        copy.blocks = stack.blocks.index_select(0, ids.to(stack.blocks.device)).to(target)
        return copy
    return stack.detach().index_select(0, ids.to(stack.device)).to(target)


def split_experts(model) -> dict[int, Experts]:
    """{layer index: its routed experts} of the decoder layers off the target (none for a model on one device)."""
    if model.placement is None:
        return {}
    return {i: layer.mlp.experts for i, (layer, name) in enumerate(zip(model.model.layers, model.placement.layers))
            if name != model.placement.target and hasattr(layer.mlp, "experts")}


def hot_layers(model) -> dict[int, Experts]:
    """The split layers that keep hot experts (the module's text says which)."""
    on_host_beside_gpu = model.placement is not None and torch.device(model.placement.target).type == "cuda"
    return {index: experts for index, experts in split_experts(model).items()
            if not (on_host_beside_gpu and experts.gate_up_proj.device.type == "cpu")}


def choose(counts: dict[int, list[int]], per_layer: int) -> dict[int, tuple[int, ...]]:
    """Each layer's `per_layer` most counted experts (the lower id first among equal counts), ascending."""
    chosen = {}
    for layer, row in counts.items():
        ranked = sorted(range(len(row)), key=lambda e: (-row[e], e))
        chosen[layer] = tuple(sorted(ranked[:per_layer]))
    return chosen


def keep_hot(model, chosen: dict[int, tuple[int, ...]], chosen_from: str = "given") -> int:
    """Copy each split layer's chosen experts to the target (replacing any kept before); their bytes."""
    drop_hot(model)
    target = torch.device(model.placement.target) if model.placement is not None else None
    layers = hot_layers(model)
    held = 0
    for index, ids in chosen.items():
        if not ids or index not in layers:
            continue
        experts = layers[index]
        device = experts.gate_up_proj.device
        wanted = torch.tensor(ids, dtype=torch.long)
        slot_of = torch.full((experts.gate_up_proj.shape[0],), -1, dtype=torch.long)
        slot_of[wanted] = torch.arange(len(ids))
        experts.hot = HotExperts(tuple(ids), target, _copy(experts.gate_up_proj, wanted, target),
                                 _copy(experts.down_proj, wanted, target), slot_of.to(device), chosen_from)
        held += experts.hot.nbytes
    return held


def drop_hot(model) -> None:
    for experts in split_experts(model).values():
        experts.hot = None


def hot_bytes(model) -> int:
    """Bytes of the hot experts' copies (all on the target)."""
    return sum(e.hot.nbytes for e in split_experts(model).values() if e.hot is not None)


def count_while_serving(model, prompts: bool = False) -> None:
    """Start counting the pairs each layer that keeps hot experts routes in decode steps (and prompt chunks with
    `prompts`), from zero."""
    for experts in hot_layers(model).values():
        experts.counts = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.long,
                                     device=experts.gate_up_proj.device)
        experts.count_prompts = prompts


def read_counts(model, stop: bool = False) -> dict[int, list[int]]:
    """{layer: pairs routed to each expert} counted since count_while_serving (on the host); `stop`: no longer
    count."""
    counts = {}
    for index, experts in split_experts(model).items():
        if experts.counts is not None:
            counts[index] = experts.counts.tolist()
            if stop:
                experts.counts, experts.count_prompts = None, False
    return counts


def add_counts(total: dict[int, list[int]] | None, more: dict[int, list[int]]) -> dict[int, list[int]]:
    total = {layer: list(row) for layer, row in (total or {}).items()}
    for layer, row in more.items():
        total[layer] = [a + b for a, b in zip(total[layer], row)] if layer in total else list(row)
    return total


def calibration_ids(tokenizer, vocab: int, tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """The calibration prompt: the embedded tokenizer corpus's text in the model's tokens (without a tokenizer, ids
    spread over the vocabulary)."""
    if tokenizer is not None:
        from ..model_dir import EMBEDDED_MODEL
        corpus = (EMBEDDED_MODEL.parent / "tokenizer_corpus.txt").read_text(encoding="utf-8")
        ids = [t for t in tokenizer.encode(corpus) if 0 <= t < vocab][:tokens]
        if ids:
            return torch.tensor(ids, dtype=torch.long)
    return torch.arange(tokens, dtype=torch.long) * 7919 % vocab


@torch.inference_mode()
def calibrate(model, ids: torch.Tensor, chunk: int) -> dict[int, list[int]]:
    """The split layers' routing counts over the prompt `ids`, run in chunks of `chunk` tokens on a state of its
    own (freed after)."""
    count_while_serving(model, prompts=True)
    try:
        device = torch.device(model.placement.target)
        state = model.new_state(ids.numel())
        for part in ids.to(device).split(chunk):
            model(part, state)
        return read_counts(model)
    finally:
        read_counts(model, stop=True)


# ---- the decode step's experts with hot copies ------------------------------------------------------------------
def _pairs(x: torch.Tensor, ids: torch.Tensor, hot: HotExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each pair's row of x, its expert's index among the hot ones (0 for the others), which pairs are hot) on the
    layer's device."""
    slot = hot.slot_of[ids.reshape(-1)]
    return x.repeat_interleave(ids.shape[1], dim=0), slot.clamp(min=0), slot >= 0


def experts_per_row(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
                    active: torch.Tensor | None) -> torch.Tensor:
    """The torch form (model/moe.experts_per_row) with the hot pairs' products taken from the target: every pair on
    both devices at the same shape, the hot ones' outputs kept from the target."""
    hot = experts.hot
    inputs, slot, is_hot = _pairs(x, ids, hot)
    here = pair_outputs(inputs, ids.reshape(-1), experts.gate_up_proj, experts.down_proj)
    there = pair_outputs(inputs.to(hot.target), slot.to(hot.target), hot.gate_up, hot.down).to(x.device)
    return sum_slots(torch.where(is_hot.unsqueeze(-1), there, here), weights, active)


def moe_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts, flags: torch.Tensor | None,
             shared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """kernels/moe.moe_rows with the hot pairs' products on the target: each pair a row of its own (one slot), the
    hot ones launched there first, the others here without waiting for them; their float32 outputs meet here for
    the slot sum."""
    hot, top_k = experts.hot, ids.shape[1]
    inputs, slot, is_hot = _pairs(x, ids, hot)
    pair_flags = torch.ones_like(is_hot) if flags is None else flags.bool().repeat_interleave(top_k)
    pair_weights = weights.reshape(-1, 1)
    with current_device(hot.target):
        there = kernels.pair_outputs(inputs.to(hot.target), slot.unsqueeze(-1).to(hot.target),
                                     pair_weights.to(hot.target), hot.gate_up, hot.down,
                                     (pair_flags & is_hot).to(torch.uint8).to(hot.target))
    here = kernels.pair_outputs(inputs, ids.reshape(-1, 1), pair_weights, experts.gate_up_proj, experts.down_proj,
                                (pair_flags & ~is_hot).to(torch.uint8))
    y = torch.where(is_hot.unsqueeze(-1), there.to(x.device), here)
    return kernels.combine_slots(y, flags, top_k, x.dtype, shared)



def describe(model) -> dict | None:
    """What /props shows: each split layer's hot experts and where they were chosen from (None: none kept)."""
    kept = [e.hot for e in split_experts(model).values() if e.hot is not None]
    if not kept:
        return None
    layers = {index: list(e.hot.ids) for index, e in split_experts(model).items() if e.hot is not None}
    return {"per_layer": max(len(ids) for ids in layers.values()), "chosen_from": kept[0].chosen_from,
            "bytes_on_target": hot_bytes(model), "layers": {str(index): ids for index, ids in layers.items()}}
