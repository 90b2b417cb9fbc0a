"""Put a GGUF's tensors into our model, after every name and shape was checked: each one dequantized, turned back
into our layout (gguf_layout.py) and copied in place in the model's dtype, but the quantized expert stacks,
whose blocks are copied as they are into the model's QuantizedStacks (engine/model/quantized.py)."""

from __future__ import annotations

import time

import torch

from . import gguf_layout, gguf_metadata
from .errors import CheckpointError
from ..engine.model.quant_blocks import LAYOUTS
from ..engine.model.quantized import QuantizedStack
from .gguf_file import GGUFCheckpoint
from .loader import LoadReport

# What stays quantized: the expert stacks (indexed by expert) and the PLE table (an embedding: the module itself
# is replaced, so its name drops the ".weight" of the tensor the GGUF piece fills).
_STACKS = (".experts.gate_up_proj", ".experts.down_proj")
_TABLE = ".ple_embedding.ngram_embedding.weight"


def kept_name(target: str) -> str | None:
    """The QuantizedStack a piece's runtime tensor is part of, if it is kept quantized."""
    if target.endswith(_STACKS):
        return target
    return target.removesuffix(".weight") if target.endswith(_TABLE) else None


def quantized_stacks(checkpoint, config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The weights to keep quantized: {runtime name: (block type, shape)}, for each expert stack and PLE table
    whose GGUF tensors (gate and up, down, the table) hold one block type with a torch form. `checkpoint`: a
    GGUFCheckpoint, or a file planned but not written (gguf_writer.PlannedFile)."""
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
        if len(types) == 1 and next(iter(types)) in LAYOUTS:
            shape = checkpoint.shape(pieces[0].gguf)
            if len(pieces) > 1:                      # gate and up: one stack of both halves' rows
                shape = (shape[0], shape[1] * len(pieces), shape[2])
            stacks[name] = (types.pop(), shape)
    return stacks


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
    stacks = {name: module for name, module in module.named_modules() if isinstance(module, QuantizedStack)}
    parts = [_part(stacks.get(kept_name(piece.target)) or targets[piece.target], piece) for piece in pieces]
    for piece, part in zip(pieces, parts):      # every shape, from the headers, before the first copy
        expected = tuple(piece.to_gguf(torch.empty(part.shape, device="meta")).shape)
        if checkpoint.shape(piece.gguf) != expected:
            raise CheckpointError(f"{checkpoint.path}: tensor {piece.gguf} has shape "
                                  f"{list(checkpoint.shape(piece.gguf))} (torch's axis order), the model expects "
                                  f"{list(expected)} (for its {piece.target})")
    report = LoadReport(files=len(checkpoint.shards))
    for piece, part in zip(pieces, parts):
        if isinstance(part, StackPart):
            part.copy_blocks(torch.from_numpy(checkpoint.raw(piece.gguf)))
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

    def copy_blocks(self, raw: torch.Tensor) -> None:
        blocks = self.blocks()
        blocks.copy_(raw.reshape(blocks.shape))


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
