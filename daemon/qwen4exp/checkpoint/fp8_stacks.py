"""Which weights of an FP8 checkpoint stay float8 on the device (fp8.py's block types, in QuantizedStacks): read from
a checkpoint's headers, or planned from a model config for an estimate."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ..engine.model.quantized import kept_name
from . import fp8, layout
from .loader import checkpoint_files, headers


def fp8_stacks(path: str | Path, config: dict[str, Any], only: str | None = None
               ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{stack name: (block type, dense shape)} of the tensors of an FP8 checkpoint that stay float8 on the device
    (model/quantized.py's QuantizedStack, where the model takes one: `kept_name`): those whose every piece is float8
    and whose widths a block type takes. Empty for another checkpoint. `only`: of the tensors named so
    (checkpoint_files')."""
    block = fp8.block_size(config, str(Path(path)))
    if block is None:
        return {}
    pieces: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for name, (_, shape, dtype) in headers(checkpoint_files(path, only)).items():
        target = layout.parse_disk_name(name).target
        if kept_name(target) is not None:
            pieces[target].append((dtype, shape))
    shapes = {spec.name: spec.shape for spec in layout.runtime_specs(config)}
    return _kept_fp8({target: ([shape[-1] for _, shape in found], all(d.startswith("F8") for d, _ in found))
                      for target, found in pieces.items() if target in shapes}, shapes, block)


def planned_fp8_stacks(cfg, block: tuple[int, int] = (128, 128)) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What an FP8 checkpoint of model config `cfg` in Qwen's layout keeps float8 (its float8 weights: the writer's
    FP8_WEIGHTS and the PLE table), as `fp8_stacks` decides it from a file: for an estimate of a checkpoint not at
    hand."""
    from ..engine.model.causal_lm import Qwen4ExpForCausalLM
    from .writer import FP8_WEIGHTS

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen4ExpForCausalLM(cfg).state_dict().items()}
    floats8 = {name for name in shapes if name.endswith(FP8_WEIGHTS + (".ngram_embedding.weight",))}
    return _kept_fp8({name: ([shapes[name][-1]], True) for name in floats8}, shapes, block)


def _kept_fp8(found: dict[str, tuple[list[int], bool]], shapes: dict, block: tuple[int, int]) -> dict:
    """{stack name: (block type, shape)} of the runtime tensors {name: (their pieces' widths, all float8)}."""
    stacks = {}
    for target, (widths, floats8) in found.items():
        table = target.endswith(".ngram_embedding.weight")
        qtype = fp8.kept_type(widths, None if table else block)
        if floats8 and qtype is not None and kept_name(target) is not None:
            stacks[kept_name(target)] = (qtype, tuple(shapes[target]))
    return stacks
