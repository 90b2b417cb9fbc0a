"""Per-sequence state of qwen4_exp: everything a sequence carries from one forward to the next.

Sized for a fixed capacity at creation so that later work can snapshot, restore and budget it:
- QSA layers: K/V [kv_heads, capacity, head_dim], raw indexer keys [capacity, index_dim] and the
  compressed (pooled, normalised, rotated) block keys [capacity / ratio, index_dim];
- Gated DeltaNet layers: the last kernel-1 conv inputs and the float32 recurrent state;
- PLE layers: the dilated conv's input history and the last ngram_size-1 token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model.config import ModelConfig


class CapacityError(ValueError):
    """A sequence would grow past the capacity its state was allocated for."""


@dataclass
class AttentionState:
    keys: torch.Tensor
    values: torch.Tensor
    index_keys: torch.Tensor
    block_keys: torch.Tensor


@dataclass
class DeltaNetState:
    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class PLEState:
    conv: torch.Tensor
    context_ids: torch.Tensor


def _allocate(cfg: ModelConfig, capacity: int, device, dtype: torch.dtype, extra_attention_layers: int,
              rows: tuple[int, ...], layer_devices: tuple | None = None):
    """Every state tensor of a sequence, with `rows` leading dimensions (() for one sequence, (N,) for a
    batch of N sequences stored side by side). `layer_devices`: each decoder layer's device, where its state
    goes (a split model, placement.py); else all on `device`, where the MTP head's cache goes either way."""
    ratio = cfg.indexer_compress_ratio
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim

    def zeros(on, *shape, dtype=dtype):
        return torch.zeros(*rows, *shape, device=on, dtype=dtype)

    def attention(on) -> AttentionState:
        return AttentionState(
            keys=zeros(on, cfg.num_key_value_heads, capacity, cfg.head_dim),
            values=zeros(on, cfg.num_key_value_heads, capacity, cfg.head_dim),
            index_keys=zeros(on, capacity, cfg.indexer_head_dim),
            block_keys=zeros(on, -(-capacity // ratio), cfg.indexer_head_dim),
        )

    layers: list[AttentionState | DeltaNetState] = []
    ple: dict[int, PLEState] = {}
    for i in range(cfg.num_hidden_layers):
        on = device if layer_devices is None else layer_devices[i]
        if cfg.is_qsa(i):
            layers.append(attention(on))
        else:
            layers.append(DeltaNetState(
                conv=zeros(on, conv_dim, cfg.linear_conv_kernel_dim - 1),
                recurrent=zeros(on, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                dtype=torch.float32),
            ))
        if i + 1 in cfg.ple_layer_ids:
            ple[i] = PLEState(
                conv=zeros(on, cfg.hc_count * cfg.hidden_size, cfg.ple_conv_state_len),
                context_ids=torch.full((*rows, cfg.ngram_size - 1), cfg.eos_token_id, device=on, dtype=torch.long),
            )
    # Attention layers outside the main stack (the MTP head, beside the LM head) keep their caches here.
    extra = [attention(device) for _ in range(extra_attention_layers)]
    return layers, ple, extra


def _carried(layers, ple: dict) -> list[torch.Tensor]:
    tensors = [t for layer in layers if isinstance(layer, DeltaNetState) for t in (layer.conv, layer.recurrent)]
    return tensors + [t for part in ple.values() for t in (part.conv, part.context_ids)]


def _row(part, index: int):
    """The same state dataclass over row `index` of a batched one (views: writes land in the batch)."""
    return type(part)(**{name: tensor[index] for name, tensor in vars(part).items()})


class SequenceState:
    def __init__(self, cfg: ModelConfig, capacity: int, device: torch.device | str, dtype: torch.dtype,
                 extra_attention_layers: int = 0, _parts=None, layer_devices: tuple | None = None):
        if capacity <= 0:
            raise CapacityError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.length = 0
        self.device = torch.device(device)       # the target's: a split model's layers may hold theirs elsewhere
        self._eos = cfg.eos_token_id
        self.layers, self.ple, self.extra = _parts or _allocate(cfg, capacity, device, dtype,
                                                                extra_attention_layers, (), layer_devices)

    def reset(self) -> None:
        """Empty the sequence for reuse. K/V and indexer keys past `length` are never read, so only the
        states that are read whole (conv, recurrent, PLE) are cleared."""
        self.length = 0
        for layer in self.layers:
            if isinstance(layer, DeltaNetState):
                layer.conv.zero_()
                layer.recurrent.zero_()
        for ple in self.ple.values():
            ple.conv.zero_()
            ple.context_ids.fill_(self._eos)

    def carried(self) -> list[torch.Tensor]:
        """The tensors a forward updates in place (not by position): saved before a prompt chunk so that a
        chunk retried after an out-of-memory error starts from the same state."""
        return _carried(self.layers, self.ple)

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise CapacityError(
                f"{self.length} cached + {new_tokens} new tokens exceed this sequence's capacity of "
                f"{self.capacity} tokens"
            )

    def tensors(self) -> list[torch.Tensor]:
        tensors = []
        for layer in self.layers + self.extra:
            tensors += list(vars(layer).values())
        for ple in self.ple.values():
            tensors += [ple.conv, ple.context_ids]
        return tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def carried_by_layer(self) -> list[int]:
        """Each decoder layer's bytes of `carried()` (its recurrent and conv state, its PLE state)."""
        sizes = [sum(t.numel() * t.element_size() for t in (layer.conv, layer.recurrent))
                 if isinstance(layer, DeltaNetState) else 0 for layer in self.layers]
        for index, ple in self.ple.items():
            sizes[index] += sum(t.numel() * t.element_size() for t in (ple.conv, ple.context_ids))
        return sizes

    def nbytes_by_layer(self) -> tuple[list[int], int]:
        """(each decoder layer's bytes, its PLE state's included; the MTP head's cache)."""
        layers = [sum(t.numel() * t.element_size() for t in vars(layer).values()) for layer in self.layers]
        for index, ple in self.ple.items():
            layers[index] += ple.conv.numel() * ple.conv.element_size() + \
                ple.context_ids.numel() * ple.context_ids.element_size()
        extra = sum(t.numel() * t.element_size() for layer in self.extra for t in vars(layer).values())
        return layers, extra


class StateBatch:
    """N sequences' states stored side by side (each tensor has a leading row dimension), so one decode
    step can read and write every row at fixed shapes (and be captured in a CUDA graph). `rows[i]` is row
    i as a SequenceState of views: prefill, snapshots and resets work on it as on a lone sequence."""

    def __init__(self, cfg: ModelConfig, count: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype, extra_attention_layers: int = 0, layer_devices: tuple | None = None):
        if count <= 0:
            raise ValueError(f"a state batch needs at least one row, got {count}")
        self.capacity = capacity
        self.layers, self.ple, self.extra = _allocate(cfg, capacity, device, dtype, extra_attention_layers,
                                                      (count,), layer_devices)
        self._history: dict[int, torch.Tensor] = {}
        self.rows = [
            SequenceState(cfg, capacity, device, dtype, _parts=(
                [_row(layer, i) for layer in self.layers],
                {index: _row(p, i) for index, p in self.ple.items()},
                [_row(layer, i) for layer in self.extra]))
            for i in range(count)
        ]

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows) + sum(t.numel() * t.element_size()
                                                            for t in self._history.values())

    def nbytes_by_layer(self) -> tuple[list[int], int]:
        """SequenceState.nbytes_by_layer over every row (the verify history not included)."""
        parts = [row.nbytes_by_layer() for row in self.rows]
        return [sum(layer) for layer in zip(*(layers for layers, _ in parts))], sum(extra for _, extra in parts)

    # ---- verify steps (speculative decoding: model/verify.py) ----------------------------------------------------
    def allocate_history(self, positions: int) -> None:
        """Room for the carried state after each of the first `positions` sub-steps of a verify step (one of
        `positions` + 1 sub-steps at most), where `keep` puts it and `commit` finds it."""
        self._history = {id(t): torch.empty((positions, *t.shape), dtype=t.dtype, device=t.device)
                         for t in _carried(self.layers, self.ple)} if positions else {}

    def carried(self) -> list[torch.Tensor]:
        """Every row's carried tensors, batched (SequenceState.carried)."""
        return _carried(self.layers, self.ple)

    def keep(self, tensor: torch.Tensor, substep: int) -> None:
        """Keep a carried tensor's value after sub-step `substep` of a verify step."""
        self._history[id(tensor)][substep].copy_(tensor)

    def history(self, tensor: torch.Tensor) -> torch.Tensor:
        """A carried tensor's history [positions, *tensor.shape], for an op that keeps the sub-steps' values itself
        (a kernel that runs every sub-step of a verify step in one launch)."""
        return self._history[id(tensor)]

    def commit(self, last: torch.Tensor, substeps: int) -> None:
        """After a verify step of `substeps` sub-steps: each row's carried state becomes the one it had after its
        sub-step last[row] (a device tensor [N]; substeps - 1: as the step left it). No host synchronisation."""
        if substeps == 1:
            return
        # A row whose last kept sub-step is the step's last keeps the tensor as it is; the others take their
        # sub-step's state from the history: one state read a row, and the choice made in place. A split model's
        # layer states sit on their layers' devices (placement.py): the indices go to each once.
        indices: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        for tensor in _carried(self.layers, self.ple):
            if tensor.device not in indices:
                at = last.to(tensor.device)
                indices[tensor.device] = (at.clamp(max=substeps - 2), torch.arange(len(self.rows), device=at.device),
                                          at == substeps - 1)
            pick, rows, final = indices[tensor.device]
            kept = self._history[id(tensor)][pick, rows]
            torch.where(final.view(-1, *[1] * (tensor.dim() - 1)), tensor, kept, out=tensor)
