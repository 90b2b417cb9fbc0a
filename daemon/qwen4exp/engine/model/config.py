"""The text configuration of a qwen4_exp checkpoint, validated once at load."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

LINEAR = "linear_attention"
QSA = "indexed_attention"
# The shipped config.json names QSA layers "full_attention"; they are indexed (sparse) attention.
_LAYER_ALIASES = {"full_attention": QSA, QSA: QSA, LINEAR: LINEAR}


class ConfigError(ValueError):
    """A checkpoint config that this engine cannot serve; the message names the field."""


@dataclass(frozen=True)
class PLEHash:
    """PLE hash constants a checkpoint gives instead of the ones derived from the seed (a GGUF stores the
    constants, not the seed and vocabulary base they came from), and the table's row count."""
    layer_multipliers: tuple[int, ...]
    head_vocab_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    table_rows: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    split_ngram_parts: int
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    eos_token_id: int
    rms_norm_eps: float
    max_position_embeddings: int
    gdn_gate_activation: str
    mtp_num_hidden_layers: int
    layer_types: tuple[str, ...] = field(default=())
    ple_hash: PLEHash | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def dense_limit(self) -> int:
        """The longest visible context for which QSA still selects every token."""
        return self.indexer_budget + self.indexer_compress_ratio - 1

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_conv_state_len(self) -> int:
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    def is_qsa(self, layer: int) -> bool:
        return self.layer_types[layer] == QSA

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a text config dict (the `text_config` of config.json, or a text-only config)."""
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config must be an object, got {type(text).__name__}")

        def get(key: str, default: Any = ...) -> Any:
            if key in text and text[key] is not None:
                return text[key]
            if default is ...:
                raise ConfigError(f"{source}: text_config.{key} is required for qwen4_exp")
            return default

        rope = dict(get("rope_parameters", {}) or {})
        if "rope_theta" not in rope and "rope_theta" in text:
            rope["rope_theta"] = text["rope_theta"]
        layers = int(get("num_hidden_layers"))
        raw_types = get("layer_types", None)
        if raw_types is None:
            interval = int(text.get("full_attention_interval", 4))
            raw_types = [LINEAR if (i + 1) % interval else QSA for i in range(layers)]
        unknown = sorted({t for t in raw_types if t not in _LAYER_ALIASES})
        if unknown:
            raise ConfigError(f"{source}: text_config.layer_types has unsupported kinds {unknown}")
        if len(raw_types) != layers:
            raise ConfigError(
                f"{source}: text_config.layer_types has {len(raw_types)} entries for {layers} layers"
            )
        eos = get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        if text.get("indexer_kv_heads", 1) != 1:
            raise ConfigError(f"{source}: text_config.indexer_kv_heads must be 1, got {text['indexer_kv_heads']}")
        hidden = int(get("hidden_size"))
        cfg = cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(get("head_dim")),
            rope_theta=float(rope.get("rope_theta", 1e7)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            num_experts=int(get("num_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            hc_count=int(get("hc_count", 4)),
            hc_lowrank=int(get("hc_lowrank", 320)),
            ple_layer_ids=tuple(sorted(set(get("ple_layer_ids", [])))),
            ple_embed_dim=int(get("ple_embed_dim", hidden)),
            ple_conv_kernel_size=int(get("ple_conv_kernel_size", 4)),
            ngram_size=int(get("ngram_size", 3)),
            heads_per_ngram=int(get("heads_per_ngram", 8)),
            ngram_vocab_size_base=int(get("ngram_vocab_size_base", 20_000_000)),
            make_ngram_vocab_size_divisible_by=int(get("make_ngram_vocab_size_divisible_by", 128)),
            seed=int(get("seed", 1234)),
            split_ngram_parts=int(get("split_ngram_parts", 512)),
            indexer_n_heads=int(get("indexer_n_heads")),
            indexer_head_dim=int(get("indexer_head_dim")),
            indexer_budget=int(get("indexer_budget")),
            indexer_compress_ratio=int(get("indexer_compress_ratio")),
            eos_token_id=int(eos),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(get("max_position_embeddings", 262144)),
            gdn_gate_activation=str(text.get("output_gate_type") or text.get("hidden_act") or "silu"),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            layer_types=tuple(_LAYER_ALIASES[t] for t in raw_types),
            ple_hash=_ple_hash(text.get("ple_hash"), source),
        )
        cfg._validate(source)
        return cfg

    def _validate(self, source: str) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{source}: text_config.{key} {why}")

        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise bad(f.name, f"must not be negative, got {value}")
        if self.gdn_gate_activation not in ("silu", "sigmoid"):
            raise bad("output_gate_type", f"must be silu or sigmoid, got {self.gdn_gate_activation!r}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad("num_experts_per_tok", f"must be in [1, {self.num_experts}], got {self.num_experts_per_tok}")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise bad("indexer_budget", f"({self.indexer_budget}) must be a multiple of indexer_compress_ratio")
        if self.rotary_dim > self.indexer_head_dim or self.rotary_dim % 2:
            raise bad("partial_rotary_factor", f"gives rotary dim {self.rotary_dim}; it must be even and fit the "
                      f"indexer head ({self.indexer_head_dim})")
        if self.hc_count < 2:
            raise bad("hc_count", f"must be > 1, got {self.hc_count}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_value_heads", "must be a multiple of linear_num_key_heads")
        for layer_id in self.ple_layer_ids:
            if not 1 <= layer_id <= self.num_hidden_layers or self.layer_types[layer_id - 1] != LINEAR:
                raise bad("ple_layer_ids", f"entry {layer_id} must name a linear_attention layer (one-indexed)")
        if self.ple_layer_ids and self.ple_embed_dim % self.ngram_heads:
            raise bad("ple_embed_dim", f"({self.ple_embed_dim}) must divide by the n-gram heads ({self.ngram_heads})")


def _ple_hash(raw: dict | None, source: str) -> PLEHash | None:
    if raw is None:
        return None
    try:
        return PLEHash(tuple(int(v) for v in raw["layer_multipliers"]), tuple(int(v) for v in raw["head_vocab_sizes"]),
                       tuple(int(v) for v in raw["head_offsets"]), int(raw["table_rows"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{source}: ple_hash needs layer_multipliers, head_vocab_sizes, head_offsets and "
                          f"table_rows ({err})") from None
