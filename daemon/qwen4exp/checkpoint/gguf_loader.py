"""Put a GGUF's tensors into our model: each one dequantized, turned back into our layout (gguf_layout.py) and
copied in place in the model's dtype, after every name and shape was checked."""

from __future__ import annotations

import time

import torch

from . import gguf_layout, gguf_metadata
from .errors import CheckpointError
from .gguf_file import GGUFCheckpoint
from .loader import LoadReport


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
    parts = [_part(targets[piece.target], piece) for piece in pieces]
    for piece, part in zip(pieces, parts):      # every shape, from the headers, before the first copy
        expected = tuple(piece.to_gguf(torch.empty(part.shape, device="meta")).shape)
        if checkpoint.shape(piece.gguf) != expected:
            raise CheckpointError(f"{checkpoint.path}: tensor {piece.gguf} has shape "
                                  f"{list(checkpoint.shape(piece.gguf))} (torch's axis order), the model expects "
                                  f"{list(expected)} (for its {piece.target})")
    report = LoadReport(files=len(checkpoint.shards))
    for piece, part in zip(pieces, parts):
        part.copy_(piece.from_gguf(torch.from_numpy(checkpoint.array(piece.gguf))).to(part.dtype))
        report.tensors += 1
        report.bytes += int(checkpoint.tensors[piece.gguf].n_bytes)
    _check_ple_constants(checkpoint, module)
    report.seconds = time.perf_counter() - start
    return report


def _part(target: torch.Tensor, piece: gguf_layout.Piece) -> torch.Tensor:
    return target if piece.rows is None else target.narrow(piece.axis, piece.rows.start,
                                                           piece.rows.stop - piece.rows.start)


def _check_ple_constants(checkpoint: GGUFCheckpoint, module: torch.nn.Module) -> None:
    for key, values in gguf_layout.ple_constants_from(module).items():
        stored = [int(v) for v in checkpoint.value(gguf_metadata.key(key))]
        if stored != values:
            raise CheckpointError(f"{checkpoint.path}: {gguf_metadata.key(key)} is {stored[:4]}..., the model hashes "
                                  f"with {values[:4]}...")
