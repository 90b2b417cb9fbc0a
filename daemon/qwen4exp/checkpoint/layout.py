"""Tensor names and shapes: the runtime state_dict of a config, and how each tensor is laid out on disk.

Runtime names are transformers' `Qwen4ExpForCausalLM` state_dict names plus the MTP head under `mtp.*`.
On disk (what `Qwen4ExpForConditionalGeneration.save_pretrained` writes) the text model sits under
`model.language_model.*`, every expert projection is its own tensor, and the PLE n-gram table is split on dim 0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..engine.model import ngram_hash

TEXT_PREFIX = "model."
DISK_TEXT_PREFIX = "model.language_model."
VISUAL_PREFIX = "model.visual."
MTP_PREFIX = "mtp."

_EXPERT_RE = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_PLE_SHARD_RE = re.compile(r"^(?P<base>.+\.ngram_embedding)\.shard_(?P<shard>\d+)\.weight$")


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


def _eos(text: dict[str, Any]) -> int:
    eos = text["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def _linear(name: str, out_features: int, in_features: int, init: str = "fan_in") -> TensorSpec:
    return TensorSpec(name + ".weight", (out_features, in_features), init)


def _hyper(prefix: str, t: dict[str, Any], with_inject: bool = True) -> list[TensorSpec]:
    wide = t["hc_count"] * t["hidden_size"]
    specs = [
        TensorSpec(f"{prefix}.hc_norm.weight", (wide,), "norm"),
        _linear(f"{prefix}.input_mix_weight_down", t["hc_lowrank"], wide),
        _linear(f"{prefix}.input_mix_weight_up", wide, t["hc_lowrank"]),
    ]
    if with_inject:
        specs.append(_linear(f"{prefix}.block_inject_weight", t["hc_count"], wide))
    return specs


def _gated_deltanet(prefix: str, t: dict[str, Any]) -> list[TensorSpec]:
    hidden, heads_v = t["hidden_size"], t["linear_num_value_heads"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim = heads_v * t["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    return [
        TensorSpec(f"{prefix}.dt_bias", (heads_v,), "dt_bias"),
        TensorSpec(f"{prefix}.A_log", (heads_v,), "a_log"),
        TensorSpec(f"{prefix}.conv1d.weight", (conv_dim, 1, t["linear_conv_kernel_dim"]), "conv"),
        TensorSpec(f"{prefix}.norm.weight", (t["linear_value_head_dim"],), "gated_norm"),
        _linear(f"{prefix}.out_proj", hidden, value_dim),
        _linear(f"{prefix}.in_proj_qkv", conv_dim, hidden),
        _linear(f"{prefix}.in_proj_z", value_dim, hidden),
        _linear(f"{prefix}.in_proj_b", heads_v, hidden),
        _linear(f"{prefix}.in_proj_a", heads_v, hidden),
    ]


def _qsa(prefix: str, t: dict[str, Any]) -> list[TensorSpec]:
    hidden, head_dim = t["hidden_size"], t["head_dim"]
    q_heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    index_dim = t["indexer_head_dim"]
    return [
        _linear(f"{prefix}.q_proj", q_heads * head_dim * 2, hidden),  # query and output gate, interleaved per head
        _linear(f"{prefix}.k_proj", kv_heads * head_dim, hidden),
        _linear(f"{prefix}.v_proj", kv_heads * head_dim, hidden),
        _linear(f"{prefix}.o_proj", hidden, q_heads * head_dim),
        TensorSpec(f"{prefix}.q_norm.weight", (head_dim,), "norm"),
        TensorSpec(f"{prefix}.k_norm.weight", (head_dim,), "norm"),
        _linear(f"{prefix}.indexer.index_qk_proj", (t["indexer_n_heads"] + t["indexer_kv_heads"]) * index_dim, hidden),
        TensorSpec(f"{prefix}.indexer.q_layernorm.weight", (index_dim,), "norm"),
        TensorSpec(f"{prefix}.indexer.k_layernorm.weight", (index_dim,), "norm"),
    ]


def _moe(prefix: str, t: dict[str, Any]) -> list[TensorSpec]:
    hidden, experts = t["hidden_size"], t["num_experts"]
    inter, shared = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    return [
        _linear(f"{prefix}.gate", experts, hidden, "router"),
        TensorSpec(f"{prefix}.experts.gate_up_proj", (experts, 2 * inter, hidden), "fan_in"),
        TensorSpec(f"{prefix}.experts.down_proj", (experts, hidden, inter), "fan_in"),
        _linear(f"{prefix}.shared_expert.gate_proj", shared, hidden),
        _linear(f"{prefix}.shared_expert.up_proj", shared, hidden),
        _linear(f"{prefix}.shared_expert.down_proj", hidden, shared),
        _linear(f"{prefix}.shared_expert_gate", 1, hidden),
    ]


def ple_table_rows(t: dict[str, Any], ple_layer_index: int) -> tuple[list[int], int]:
    """The prime head sizes of one PLE layer and the padded row count of its n-gram table."""
    heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
    sizes = ngram_hash.head_vocab_sizes(t["ngram_vocab_size_base"], heads, ple_layer_index)
    return sizes, ngram_hash.padded_table_rows(sizes, t["make_ngram_vocab_size_divisible_by"])


def _ple(prefix: str, t: dict[str, Any], ple_layer_index: int) -> list[TensorSpec]:
    wide = t["hc_count"] * t["hidden_size"]
    dim = t["ple_embed_dim"]
    heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
    sizes, rows = ple_table_rows(t, ple_layer_index)
    multipliers = ngram_hash.layer_multipliers(t["vocab_size"], t["ngram_size"], ple_layer_index, t["seed"])
    emb = f"{prefix}.ple_embedding"
    return [
        TensorSpec(f"{emb}.layer_multipliers", (len(multipliers),), "const", tuple(multipliers)),
        TensorSpec(f"{emb}.ngram_heads_vocab_sizes", (heads,), "const", tuple(sizes)),
        TensorSpec(f"{emb}.ngram_heads_offsets", (heads,), "const", tuple(ngram_hash.head_offsets(sizes))),
        TensorSpec(f"{emb}.ngram_embedding.weight", (rows, dim // heads), "embedding"),
        _linear(f"{prefix}.key_proj", wide, dim),
        _linear(f"{prefix}.value_proj", t["hidden_size"], dim),
        TensorSpec(f"{prefix}.norm_key.weight", (wide,), "norm"),
        TensorSpec(f"{prefix}.norm_query.weight", (wide,), "norm"),
        TensorSpec(f"{prefix}.norm_conv.weight", (wide,), "norm"),
        TensorSpec(f"{prefix}.conv1d.weight", (wide, 1, t["ple_conv_kernel_size"]), "conv"),
    ]


def _decoder_layer(prefix: str, t: dict[str, Any], layer: int, ple_index: int | None) -> list[TensorSpec]:
    linear = t["layer_types"][layer] == "linear_attention"
    specs = _gated_deltanet(f"{prefix}.linear_attn", t) if linear else _qsa(f"{prefix}.self_attn", t)
    specs += _moe(f"{prefix}.mlp", t)
    if ple_index is not None:
        specs += _ple(f"{prefix}.ple", t, ple_index)
    specs += _hyper(f"{prefix}.attn_hyper_connection", t) + _hyper(f"{prefix}.mlp_hyper_connection", t)
    return specs


def runtime_specs(t: dict[str, Any], with_mtp: bool = True) -> list[TensorSpec]:
    """Every runtime tensor of text config `t` (the `text_config` dict), in a stable order."""
    hidden, vocab = t["hidden_size"], t["vocab_size"]
    ple_ids = sorted(set(t.get("ple_layer_ids") or []))
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "embedding")]
    for layer in range(t["num_hidden_layers"]):
        ple_index = ple_ids.index(layer + 1) if layer + 1 in ple_ids else None
        specs += _decoder_layer(f"model.layers.{layer}", t, layer, ple_index)
    specs += _hyper("model.hyper_connection_mixer", t, with_inject=False)
    specs.append(_linear("lm_head", vocab, hidden, "lm_head"))
    if with_mtp:
        for layer in range(t.get("mtp_num_hidden_layers", 0) or 0):
            specs += _mtp(t, layer)
    return specs


def _mtp(t: dict[str, Any], layer: int) -> list[TensorSpec]:
    """The MTP head: embedding/hidden fusion, one QSA decoder layer without PLE, its own stream mixer."""
    hidden, wide = t["hidden_size"], t["hc_count"] * t["hidden_size"]
    specs = []
    if layer == 0:
        specs += [
            _linear("mtp.fc_embedding", hidden, hidden),
            _linear("mtp.fc_hidden", hidden, hidden),
            TensorSpec("mtp.pre_fc_norm_embedding.weight", (hidden,), "norm"),
            TensorSpec("mtp.pre_fc_norm_hidden.weight", (wide,), "norm"),
        ]
    qsa_layer = dict(t, layer_types=["full_attention"])
    specs += _decoder_layer(f"mtp.layers.{layer}", qsa_layer, 0, None)
    if layer == 0:
        specs += _hyper("mtp.hyper_connection_mixer", t, with_inject=False)
    return specs


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
