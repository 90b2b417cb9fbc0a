"""Put a GGUF's tensors into our model, after every name and shape was checked: each one dequantized, turned back
into our layout (gguf_layout.py) and copied in place in the model's dtype, but the quantized weights the model
keeps as blocks (the expert stacks, the PLE table, the embedding, the projections and the LM head), whose blocks
are copied as they are (reordered by whole blocks where our layout differs) into the model's QuantizedStacks
(engine/model/quantized.py)."""

from __future__ import annotations

import functools
import math
import time

import torch

from . import gguf_layout, gguf_metadata
from .errors import CheckpointError
from ..engine.model.causal_lm import Qwen4ExpForCausalLM
from ..engine.model.quant_blocks import LAYOUTS, join_q8_0, split_q8_0
from ..engine.model.quantized import QuantizedStack, kept_name
from .gguf_file import GGUFCheckpoint
from .loader import LoadReport

# What can stay quantized: the expert stacks (indexed by expert), the weights only ever multiplied through the ops
# backend's `linear` (a QuantizedStack in the weight's place), and the embedding tables (the module itself is
# replaced, so its name drops the ".weight" of the tensor the GGUF piece fills). The hyper-connections' up
# projection is read by the mixing kernel, and the indexer's rows come from two GGUF tensors: both stay dense.
def quantized_stacks(checkpoint, config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The weights to keep quantized: {runtime name: (block type, shape)}, for each weight `kept_name` names whose
    GGUF tensors (gate and up of an expert stack, or the one tensor) hold one block type with a torch form and
    whose reorder into our layout moves whole blocks. `checkpoint`: a GGUFCheckpoint, or a file planned but not
    written (gguf_writer.PlannedFile)."""
    check_shapes(checkpoint, config)             # a kept stack takes its shape from the file below
    parts: dict[str, list[gguf_layout.Piece]] = {}
    for piece in gguf_layout.pieces(config):
        name = kept_name(piece.target)
        if name is not None:
            parts.setdefault(name, []).append(piece)
    stacks = {}
    for name, pieces in parts.items():
        if not all(piece.gguf in checkpoint.tensors for piece in pieces):
            continue                                 # named as missing by the load
        types = {checkpoint.type_name(piece.gguf) for piece in pieces}
        if len(types) == 1 and next(iter(types)) in LAYOUTS and all(_whole_blocks(checkpoint, p) for p in pieces):
            shape = checkpoint.shape(pieces[0].gguf)
            if len(pieces) > 1:                      # gate and up: one stack of both halves' rows
                shape = (shape[0], shape[1] * len(pieces), shape[2])
            stacks[name] = (types.pop(), shape)
    return stacks


@functools.lru_cache(maxsize=4)       # a load asks twice (its stacks, then its copies), for one config
def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Each GGUF tensor's shape (torch's axis order) as the model of `config` needs it: from the dense model on the
    meta device, so that no shape is taken from the file it is checked against. Read-only (cached)."""
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    targets = model.state_dict(keep_vars=True)
    return {piece.gguf: tuple(piece.to_gguf(torch.empty(piece.part_of(targets[piece.target]).shape,
                                                        device="meta")).shape)
            for piece in gguf_layout.pieces(config)}


def check_shapes(checkpoint, config) -> None:
    """Every tensor of `checkpoint` the model needs, of the shape it needs (those missing are named by the load)."""
    for name, expected in expected_shapes(config).items():
        if name in checkpoint.tensors and checkpoint.shape(name) != expected:
            raise CheckpointError(f"{checkpoint.path}: tensor {name} has shape {list(checkpoint.shape(name))} "
                                  f"(torch's axis order), the model expects {list(expected)}")


def _whole_blocks(checkpoint, piece: gguf_layout.Piece) -> bool:
    """Whether `piece`'s reorder into our layout moves the file's blocks whole (tried on the meta device)."""
    layout = LAYOUTS[checkpoint.type_name(piece.gguf)]
    shape = checkpoint.shape(piece.gguf)
    raw = torch.empty(math.prod(shape[:-1]), shape[-1] // layout[0] * layout[1], dtype=torch.uint8, device="meta")
    return piece.reorder_blocks(raw, layout) is not None


@torch.no_grad()
def load_gguf_weights(checkpoint: GGUFCheckpoint, module: torch.nn.Module, config) -> LoadReport:
    """Every tensor of `checkpoint` into `module` (built from `config`) in place, in the module's dtypes."""
    start = time.perf_counter()
    checkpoint.check_types()
    targets = module.state_dict(keep_vars=True)
    pieces = gguf_layout.pieces(config)
    expected = {piece.gguf for piece in pieces}
    unexpected = sorted(set(checkpoint.tensors) - expected)
    missing = sorted(expected - set(checkpoint.tensors))
    if unexpected or missing:
        raise CheckpointError(f"{checkpoint.path}: {len(missing)} tensors the model needs are missing "
                              f"({', '.join(missing[:5]) or 'none'}); {len(unexpected)} match nothing in the model "
                              f"({', '.join(unexpected[:5]) or 'none'})")
    check_shapes(checkpoint, config)             # every shape, from the headers, before the first copy
    stacks = {name: module for name, module in module.named_modules() if isinstance(module, QuantizedStack)}
    parts = [_part(stacks.get(kept_name(piece.target)) or targets[piece.target], piece) for piece in pieces]
    report = LoadReport(files=len(checkpoint.shards))
    for piece, part in zip(pieces, parts):
        if isinstance(part, StackPart):
            part.copy_blocks(torch.from_numpy(checkpoint.raw(piece.gguf)), piece)
        elif not piece.float32 and (stored := checkpoint.stored_floats(piece.gguf)) is not None:
            # Float values go to the device as stored and are rearranged there: a piece not kept in float32 has
            # a from_gguf that only moves values, so this gives what the float32 path below gives, bit for bit.
            part.copy_(piece.from_gguf(stored.to(part.device)).to(part.dtype))
        else:
            part.copy_(piece.from_gguf(torch.from_numpy(checkpoint.array(piece.gguf))).to(part.dtype))
        report.tensors += 1
        report.bytes += int(checkpoint.tensors[piece.gguf].n_bytes)
    _check_ple_constants(checkpoint, module)
    report.seconds = time.perf_counter() - start
    return report


class StackPart:
    """The part of a QuantizedStack one GGUF tensor fills (all of it, or gate's or up's rows of gate_up): the
    loader copies the tensor's blocks in, the writer writes them out."""

    def __init__(self, stack: QuantizedStack, piece: gguf_layout.Piece):
        self.stack, self.rows = stack, piece.rows
        self.shape = stack.shape if piece.rows is None else \
            (stack.shape[0], piece.rows.stop - piece.rows.start, *stack.shape[2:])

    def blocks(self) -> torch.Tensor:
        return self.stack.blocks if self.rows is None else self.stack.blocks[:, self.rows]

    @property
    def file_qtype(self) -> str:
        """The block type the file holds: a projection regrouped after its load (quantized.regroup_q8_0) was Q8_0."""
        return "Q8_0" if self.stack.qtype == "Q8_0_R" else self.stack.qtype

    def copy_blocks(self, raw: torch.Tensor, piece: gguf_layout.Piece) -> None:
        """The file's blocks of `piece`, in our layout."""
        blocks = self.blocks()
        rows = piece.reorder_blocks(raw.reshape(-1, blocks.shape[-1]), LAYOUTS[self.file_qtype])
        blocks.copy_((split_q8_0(rows) if self.file_qtype != self.stack.qtype else rows).reshape(blocks.shape))

    def file_blocks(self, piece: gguf_layout.Piece) -> torch.Tensor:
        """This part's blocks in the file's layout of `piece` (what the writer writes)."""
        blocks = self.blocks().contiguous()
        rows = blocks.reshape(-1, blocks.shape[-1])
        rows = join_q8_0(rows) if self.file_qtype != self.stack.qtype else rows
        return piece.reorder_blocks(rows, LAYOUTS[self.file_qtype], to_gguf=True).reshape(blocks.shape)


def _part(target, piece: gguf_layout.Piece):
    if isinstance(target, QuantizedStack):
        return StackPart(target, piece)
    return piece.part_of(target)


def _check_ple_constants(checkpoint: GGUFCheckpoint, module: torch.nn.Module) -> None:
    for key, values in gguf_layout.ple_constants_from(module).items():
        stored = [int(v) for v in checkpoint.value(gguf_metadata.key(key))]
        if stored != values:
            raise CheckpointError(f"{checkpoint.path}: {gguf_metadata.key(key)} is {stored[:4]}..., the model hashes "
                                  f"with {values[:4]}...")
