"""The runtime tensors of a config, read from the model itself built on the meta device, and how each is laid out
on disk.

Runtime names are the model's state_dict names (transformers' `Qwen4ExpForCausalLM` plus the MTP head, `mtp.*`).
On disk (what `Qwen4ExpForConditionalGeneration.save_pretrained` writes) the text model sits under
`model.language_model.*`, every expert projection is its own tensor, and the PLE n-gram table is split on dim 0.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine.model.causal_lm import Qwen4ExpForCausalLM
from ..engine.model.config import ModelConfig
from ..engine.model.gated_deltanet import GatedDeltaNet
from ..engine.model.moe import Experts, Router
from ..engine.model.norms import GatedRMSNorm, RMSNorm
from ..engine.model.ple import NGramEmbedding
from ..engine.model.quantized import QuantizedStack

TEXT_PREFIX = "model."
DISK_TEXT_PREFIX = "model.language_model."
VISUAL_PREFIX = "model.visual."
MTP_PREFIX = "mtp."

_EXPERT_RE = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_PLE_SHARD_RE = re.compile(r"^(?P<base>.+\.ngram_embedding)\.shard_(?P<shard>\d+)\.weight$")

# The random writer's distribution (`TensorSpec.init`; writer._draw scales it) for the tensors of each module kind.
_INIT_BY_MODULE = {nn.Linear: "fan_in", Experts: "fan_in", Router: "router", nn.Embedding: "embedding",
                   nn.Conv1d: "conv", RMSNorm: "norm", GatedRMSNorm: "gated_norm"}
_DELTANET_INIT = {"dt_bias": "dt_bias", "A_log": "a_log"}


@dataclass(frozen=True)
class TensorSpec:
    """One runtime tensor. `init` names the distribution the random writer draws it from."""

    name: str
    shape: tuple[int, ...]
    init: str
    value: tuple[int, ...] | None = None  # the int64 PLE hash constants

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """One on-disk tensor: where it lands inside its runtime tensor (`index` into dims 0/1) and its disk shape."""

    disk: str
    index: tuple[Any, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DiskRef:
    """What an on-disk name refers to. kind: whole | expert | ple_shard | visual."""

    kind: str
    target: str
    number: int = -1  # expert id or PLE shard id
    proj: str = ""


def ple_row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges of torch.chunk(table, parts, dim=0): ceil-sized pieces, possibly fewer than `parts`."""
    step = math.ceil(rows / max(parts, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _spec(model: Qwen4ExpForCausalLM, name: str, tensor: torch.Tensor) -> TensorSpec:
    """Runtime tensor `name` with the distribution the random writer draws it from, chosen by its module's kind."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    shape = tuple(tensor.shape)
    if isinstance(owner, NGramEmbedding) and leaf in owner._constants:
        # The buffers may be on meta (no values): take the constants the module fills them from.
        return TensorSpec(name, shape, "const", tuple(owner._constants[leaf]))
    if owner is model.lm_head:
        init = "lm_head"
    elif isinstance(owner, GatedDeltaNet):
        init = _DELTANET_INIT.get(leaf)
    else:
        init = _INIT_BY_MODULE.get(type(owner))
    if init is None:
        raise ValueError(f"{name}: no random-weight distribution for tensor {leaf!r} of {type(owner).__name__}")
    return TensorSpec(name, shape, init)


def module_specs(model: Qwen4ExpForCausalLM) -> list[TensorSpec]:
    """Every tensor of `model`'s state_dict (what the loader fills: parameters and persistent buffers), but the
    blocks of weights kept quantized (a GGUF's: no safetensors layout holds them)."""
    kept = {f"{name}.blocks" for name, module in model.named_modules() if isinstance(module, QuantizedStack)}
    return [_spec(model, name, tensor) for name, tensor in model.state_dict(keep_vars=True).items()
            if name not in kept]


def runtime_specs(t: dict[str, Any], with_mtp: bool = True) -> list[TensorSpec]:
    """Every runtime tensor of text config `t` (the `text_config` dict), read from the model built on meta."""
    cfg = ModelConfig.from_dict(t)
    if not with_mtp:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    with torch.device("meta"):
        return module_specs(Qwen4ExpForCausalLM(cfg))


def to_disk_name(runtime_name: str) -> str:
    """The published on-disk name of a whole (unsplit) runtime tensor."""
    if runtime_name.startswith(TEXT_PREFIX):
        return DISK_TEXT_PREFIX + runtime_name[len(TEXT_PREFIX):]
    return runtime_name


def disk_pieces(spec: TensorSpec, t: dict[str, Any]) -> list[Piece]:
    """The on-disk tensors that together hold runtime tensor `spec` (fused experts and the PLE table split)."""
    disk = to_disk_name(spec.name)
    if spec.name.endswith(".experts.gate_up_proj"):
        experts, double, hidden = spec.shape
        inter = double // 2
        base = disk[: -len(".gate_up_proj")]
        return [
            Piece(f"{base}.{e}.{proj}_proj.weight", (e, slice(lo, lo + inter)), (inter, hidden))
            for e in range(experts)
            for proj, lo in (("gate", 0), ("up", inter))
        ]
    if spec.name.endswith(".experts.down_proj"):
        base = disk[: -len(".down_proj")]
        return [Piece(f"{base}.{e}.down_proj.weight", (e,), spec.shape[1:]) for e in range(spec.shape[0])]
    if spec.name.endswith(".ngram_embedding.weight"):
        base = disk[: -len(".weight")]
        rows, dim = spec.shape
        ranges = ple_row_ranges(rows, t["split_ngram_parts"])
        return [Piece(f"{base}.shard_{i}.weight", (slice(a, b),), (b - a, dim)) for i, (a, b) in enumerate(ranges)]
    return [Piece(disk, (), spec.shape)]


def parse_disk_name(name: str) -> DiskRef:
    """Map an on-disk name (multimodal or text-only layout) to the runtime tensor it feeds."""
    if name.startswith(VISUAL_PREFIX):
        return DiskRef("visual", name)
    if name.startswith(DISK_TEXT_PREFIX):
        name = TEXT_PREFIX + name[len(DISK_TEXT_PREFIX):]
    match = _EXPERT_RE.match(name)
    if match:
        proj = match["proj"]
        target = match["base"] + (".down_proj" if proj == "down" else ".gate_up_proj")
        return DiskRef("expert", target, int(match["expert"]), proj)
    match = _PLE_SHARD_RE.match(name)
    if match:
        return DiskRef("ple_shard", match["base"] + ".weight", int(match["shard"]))
    return DiskRef("whole", name)


def expert_slot(ref: DiskRef, fused_shape: tuple[int, ...]) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """Index into the fused expert tensor and the disk shape one expert projection must have."""
    if ref.proj == "down":
        return (ref.number,), tuple(fused_shape[1:])
    inter = fused_shape[1] // 2
    low = 0 if ref.proj == "gate" else inter
    return (ref.number, slice(low, low + inter)), (inter, fused_shape[2])
