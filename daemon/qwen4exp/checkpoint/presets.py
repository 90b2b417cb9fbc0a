"""Named model shapes: the full config.json dict that a checkpoint of that shape carries.

`full` is the shipped Qwen3.8-Flash-Next config; `bench` keeps every per-layer size but fewer layers and a smaller
n-gram table; `tiny` exercises every component on a CPU in seconds.
"""

from __future__ import annotations

import copy
from typing import Any

LINEAR = "linear_attention"
# The shipped config.json names the QSA layers "full_attention"; transformers renames them on load.
QSA_ON_DISK = "full_attention"
ATTENTION_INTERVAL = 4  # three Gated DeltaNet layers, then one QSA layer

# Special-token ids sit at fixed offsets from eos in the shipped vocabulary (248044 = <|endoftext|>).
IM_START_OFFSET, IM_END_OFFSET = 1, 2
_VISION_TOKEN_OFFSETS = {
    "vision_start_token_id": 9,
    "vision_end_token_id": 10,
    "image_token_id": 12,
    "video_token_id": 13,
}

_SHIPPED_TEXT: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 2560,
    "num_hidden_layers": 48,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_layer_ids": [2],
    "ple_embed_dim": 2560,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "split_ngram_parts": 512,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "eos_token_id": 248044,
    "mtp_num_hidden_layers": 1,
}

_SHIPPED_VISION: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
}

# A vision tower we never run: small, so that transformers can still build the multimodal class quickly.
_SMALL_VISION: dict[str, Any] = dict(
    _SHIPPED_VISION, depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=16
)

_TINY_TEXT_OVERRIDES: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "hc_lowrank": 16,
    "ple_embed_dim": 64,
    "ngram_vocab_size_base": 1000,
    "split_ngram_parts": 4,
    # Eight indexer heads: a block scores exactly 0 only when every head's relu is 0, so with 8 heads the
    # top-k boundary almost never falls on a tie (the reference breaks ties in an unspecified order).
    "indexer_n_heads": 8,
    "indexer_head_dim": 16,
    "indexer_budget": 32,  # dense up to 35 tokens, so a few-hundred-token prompt is truly sparse
    "eos_token_id": 1000,
}

_PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny": (_TINY_TEXT_OVERRIDES, _SMALL_VISION),
    "bench": ({"num_hidden_layers": 8, "ngram_vocab_size_base": 200_000, "split_ngram_parts": 8}, _SHIPPED_VISION),
    "full": ({}, _SHIPPED_VISION),
}

PRESET_NAMES = tuple(_PRESETS)


def layer_types(num_layers: int) -> list[str]:
    return [QSA_ON_DISK if (i + 1) % ATTENTION_INTERVAL == 0 else LINEAR for i in range(num_layers)]


def preset_config(name: str, layers: int | None = None, dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json dict (Qwen4ExpForConditionalGeneration layout) of preset `name`."""
    if name not in _PRESETS:
        raise ValueError(f"unknown checkpoint preset {name!r}; choose one of: {', '.join(PRESET_NAMES)}")
    overrides, vision = _PRESETS[name]
    text = copy.deepcopy(_SHIPPED_TEXT)
    text.update(copy.deepcopy(overrides))
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be a positive integer, got {layers!r}")
        text["num_hidden_layers"] = layers
    num_layers = text["num_hidden_layers"]
    text["layer_types"] = layer_types(num_layers)
    # PLE lives on (one-indexed) layer 2, a Gated DeltaNet layer; a one-layer model has no room for it.
    text["ple_layer_ids"] = [i for i in text["ple_layer_ids"] if i <= num_layers]
    text["model_type"] = "qwen4_exp_text"
    text["dtype"] = dtype

    eos = text["eos_token_id"]
    config: dict[str, Any] = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": text,
        "vision_config": dict(
            copy.deepcopy(vision), model_type="qwen4_exp_vision", out_hidden_size=text["hidden_size"]
        ),
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    config.update({key: eos + offset for key, offset in _VISION_TOKEN_OFFSETS.items()})
    return config


def special_token_ids(text_config: dict[str, Any]) -> dict[str, int]:
    """The ChatML special tokens at their fixed ids (relative to eos, as in the shipped vocabulary)."""
    eos = text_config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    return {"<|endoftext|>": eos, "<|im_start|>": eos + IM_START_OFFSET, "<|im_end|>": eos + IM_END_OFFSET}
