"""The metadata of llama.cpp's qwen4exp GGUFs, read into our model config (no torch: the daemon reads it too).

The keys are the ones llama.cpp's converter (conversion/qwen4exp.py) writes; what GGUF does not carry (the Gated
DeltaNet output gate's activation, norm_topk_prob, the MTP head) takes the published config's value, and the notes
say so. The PLE hash constants come from the file (ModelConfig.ple_hash), not from a seed.
"""

from __future__ import annotations

from collections.abc import Callable

from ..engine.model.config import LINEAR, QSA
from .errors import CheckpointError

ARCH = "qwen4exp"


def key(name: str) -> str:
    return f"{ARCH}.{name}"


def config_from_metadata(value: Callable[[str], object], tensor_shape: Callable[[str], tuple[int, ...] | None],
                         where: str) -> tuple[dict, list[str]]:
    """A text config (what ModelConfig.from_dict reads) from a GGUF's metadata; `value(key)` gives a key's value
    (KeyError when absent), `tensor_shape(name)` a tensor's shape in torch order (None when absent). Returns the
    config and the notes to tell the operator (what GGUF does not say and what was assumed)."""
    def get(name: str, default=...):
        try:
            return value(key(name))
        except KeyError:
            if default is ...:
                raise CheckpointError(f"{where}: metadata key {key(name)} is missing") from None
            return default

    def number(name: str, kind=int, default=..., low=1):
        """A count or size the model's shapes are built from: a number, at least `low`."""
        raw = get(name, default)
        try:
            got = kind(raw)
        except (TypeError, ValueError, OverflowError):
            raise CheckpointError(f"{where}: metadata key {key(name)} is {raw!r}, not a number") from None
        if not got >= low:
            raise CheckpointError(f"{where}: metadata key {key(name)} is {got}; it must be at least {low}")
        return got

    def per_layer(name: str, default) -> list:
        values = get(name, default)
        if not isinstance(values, list):
            raise CheckpointError(f"{where}: metadata key {key(name)} is {values!r}, not a list of one entry a "
                                  f"layer")
        if len(values) != layers:
            raise CheckpointError(f"{where}: metadata key {key(name)} has {len(values)} entries for the {layers} "
                                  f"layers of {key('block_count')}")
        return values

    try:
        arch = value("general.architecture")
    except KeyError:
        arch = None
    if arch != ARCH:
        raise CheckpointError(f"{where}: general.architecture is {arch!r}; this engine serves {ARCH!r} "
                              f"(Qwen3.8-Flash-Next) only")
    layers = number("block_count")
    recurrent = list(get("attention.recurrent_layers", []))
    if recurrent:
        recurrent = per_layer("attention.recurrent_layers", None)
    else:
        interval = number("full_attention_interval", default=4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    ratios = [int(r) for r in per_layer("attention.compress_ratios", [0] * layers)]
    notes = []
    qsa_layers = [i for i in range(layers) if not recurrent[i]]
    used = sorted({ratios[i] for i in qsa_layers})
    if 0 in used:
        raise CheckpointError(
            f"{where}: {key('attention.compress_ratios')} is 0 on the QSA layers {qsa_layers[:4]}"
            f"{'...' if len(qsa_layers) > 4 else ''}, which carry the indexer's tensors: llama.cpp's converter "
            f"writes 0 there when the transformers it runs with knows qwen4_exp (it renames full_attention to "
            f"indexed_attention), so the file does not say the ratio. Convert again with a converter that writes "
            f"it, or without transformers' qwen4_exp (the published config.json has indexer_compress_ratio 4)")
    if len(used) > 1:
        raise CheckpointError(f"{where}: QSA layers with different compress ratios {used}; qwen4_exp has one")
    embed = tensor_shape("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{where}: tensor token_embd.weight is missing")
    hidden = number("embedding_length")
    key_dim = number("attention.key_length")
    ple_layers = [int(p) + 1 for p in get("ple.layers", [])]
    if any(not 1 <= p <= layers for p in ple_layers):
        raise CheckpointError(f"{where}: metadata key {key('ple.layers')} names layers outside the "
                              f"{layers} of {key('block_count')}: {[p - 1 for p in ple_layers]}")
    value_heads = number("ssm.time_step_rank")
    inner = number("ssm.inner_size")
    if inner % value_heads:
        raise CheckpointError(f"{where}: {key('ssm.inner_size')} ({inner}) is not a multiple of "
                              f"{key('ssm.time_step_rank')} ({value_heads}), the value heads")
    experts, used_experts = number("expert_count"), number("expert_used_count")
    if used_experts > experts:
        raise CheckpointError(f"{where}: {key('expert_used_count')} ({used_experts}) is more than "
                              f"{key('expert_count')} ({experts})")
    try:
        eos = int(value("tokenizer.ggml.eos_token_id"))
    except KeyError:
        raise CheckpointError(f"{where}: metadata key tokenizer.ggml.eos_token_id is missing") from None
    if not 0 <= eos < embed[0]:
        raise CheckpointError(f"{where}: tokenizer.ggml.eos_token_id is {eos}, outside the {embed[0]} tokens of "
                              f"token_embd.weight")
    config = {
        "vocab_size": embed[0], "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": number("attention.head_count"),
        "num_key_value_heads": number("attention.head_count_kv"),
        "head_dim": key_dim,
        "rope_parameters": {"rope_theta": number("rope.freq_base", float, low=0.0),
                            "partial_rotary_factor": number("rope.dimension_count", low=0) / key_dim},
        "linear_conv_kernel_dim": number("ssm.conv_kernel"),
        "linear_key_head_dim": number("ssm.state_size"),
        "linear_value_head_dim": inner // value_heads,
        "linear_num_key_heads": number("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "num_experts": experts, "num_experts_per_tok": used_experts,
        "moe_intermediate_size": number("expert_feed_forward_length"),
        "shared_expert_intermediate_size": number("expert_shared_feed_forward_length"),
        "norm_topk_prob": True,
        "hc_count": number("hyper_connection.count"), "hc_lowrank": number("hyper_connection.low_rank"),
        "indexer_n_heads": number("attention.indexer.head_count"),
        "indexer_head_dim": number("attention.indexer.key_length"),
        "indexer_budget": number("attention.indexer.top_k"),
        "indexer_compress_ratio": used[0] if used else 4,
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", float, low=0.0),
        "max_position_embeddings": number("context_length"),
        "eos_token_id": eos,
        "hidden_act": "silu",
        "mtp_num_hidden_layers": 0,
        "layer_types": [LINEAR if r else QSA for r in recurrent],
    }
    notes.append("the GGUF does not record the Gated DeltaNet output gate's activation: silu, as the published "
                 "config (llama.cpp uses sigmoid)")
    if ple_layers:
        ngram_heads = (number("ple.ngram_size", low=2) - 1) * number("ple.heads_per_ngram")
        table = tensor_shape("per_layer_token_embd.weight")
        if table is None:
            raise CheckpointError(f"{where}: tensor per_layer_token_embd.weight is missing (ple.layers is set)")
        config.update({
            "ple_layer_ids": ple_layers, "ngram_size": number("ple.ngram_size", low=2),
            "heads_per_ngram": number("ple.heads_per_ngram"),
            "ple_conv_kernel_size": number("ple.conv_kernel"),
            "ple_embed_dim": number("embedding_length_per_layer_input") * ngram_heads,
            "ple_hash": _ple_hash(get, number("ple.ngram_size", low=2), ngram_heads, table[0], where),
        })
        ple_eos = number("ple.eos_token_id", default=config["eos_token_id"], low=0)
        if ple_eos != config["eos_token_id"]:
            notes.append(f"PLE resets at token {ple_eos} ({key('ple.eos_token_id')}), not at the tokenizer's "
                         f"end of text {config['eos_token_id']}: the PLE's is used")
            config["eos_token_id"] = ple_eos
    return config, notes


def _ple_hash(get, ngram_size: int, heads: int, rows: int, where: str) -> dict:
    """The PLE hash constants, of the lengths the hash reads (a multiplier an n-gram position, a size and an offset
    a head) and inside the table: a wrong one would index past the table at the first forward."""
    lists = {}
    for name, length in (("layer_multipliers", ngram_size), ("head_vocab_sizes", heads), ("head_offsets", heads)):
        values = get(f"ple.{name}")
        if not isinstance(values, list) or len(values) != length or not all(isinstance(v, int) for v in values):
            raise CheckpointError(f"{where}: metadata key {key('ple.' + name)} must be a list of {length} integers, "
                                  f"got {values if not isinstance(values, list) else f'{len(values)} entries'}")
        lists[name] = values
    for head, (size, offset) in enumerate(zip(lists["head_vocab_sizes"], lists["head_offsets"])):
        if size < 1 or offset < 0 or offset + size > rows:
            raise CheckpointError(f"{where}: PLE head {head} takes rows {offset}..{offset + size - 1} of "
                                  f"per_layer_token_embd.weight, which has {rows}")
    return lists | {"table_rows": rows}


def metadata_for(cfg, rope_sections: list[int], ple_constants: dict[str, list[int]], file_type: int,
                 name: str) -> list[tuple[str, object, str]]:
    """The model's metadata as llama.cpp's converter writes it, in its order: (key, value, GGUF value type name;
    arrays as "ARRAY:<element type>"). `rope_sections`: the config's rope_parameters.mrope_section (text uses
    one position stream, so they do not change the numbers, but llama.cpp requires the key)."""
    interval = next((i + 1 for i, kind in enumerate(cfg.layer_types) if kind == QSA), 4)
    rows = [
        ("general.architecture", ARCH, "STRING"), ("general.type", "model", "STRING"),
        ("general.name", name, "STRING"),
        (key("block_count"), cfg.num_hidden_layers, "UINT32"),
        (key("context_length"), cfg.max_position_embeddings, "UINT32"),
        (key("embedding_length"), cfg.hidden_size, "UINT32"),
        (key("attention.head_count"), cfg.num_attention_heads, "UINT32"),
        (key("attention.head_count_kv"), cfg.num_key_value_heads, "UINT32"),
        (key("rope.dimension_sections"), list(rope_sections) + [0] * (4 - len(rope_sections)), "ARRAY:INT32"),
        (key("rope.freq_base"), cfg.rope_theta, "FLOAT32"),
        (key("attention.layer_norm_rms_epsilon"), cfg.rms_norm_eps, "FLOAT32"),
        (key("expert_count"), cfg.num_experts, "UINT32"),
        (key("expert_used_count"), cfg.num_experts_per_tok, "UINT32"),
        (key("attention.key_length"), cfg.head_dim, "UINT32"),
        (key("attention.value_length"), cfg.head_dim, "UINT32"),
        ("general.file_type", file_type, "UINT32"),
        (key("expert_feed_forward_length"), cfg.moe_intermediate_size, "UINT32"),
        (key("expert_shared_feed_forward_length"), cfg.shared_expert_intermediate_size, "UINT32"),
        (key("ssm.conv_kernel"), cfg.linear_conv_kernel_dim, "UINT32"),
        (key("ssm.state_size"), cfg.linear_key_head_dim, "UINT32"),
        (key("ssm.group_count"), cfg.linear_num_key_heads, "UINT32"),
        (key("ssm.time_step_rank"), cfg.linear_num_value_heads, "UINT32"),
        (key("ssm.inner_size"), cfg.linear_value_head_dim * cfg.linear_num_value_heads, "UINT32"),
        (key("attention.recurrent_layers"), [kind == LINEAR for kind in cfg.layer_types], "ARRAY:BOOL"),
        (key("full_attention_interval"), interval, "UINT32"),
        (key("rope.dimension_count"), cfg.rotary_dim, "UINT32"),
        (key("hyper_connection.count"), cfg.hc_count, "UINT32"),
        (key("hyper_connection.low_rank"), cfg.hc_lowrank, "UINT32"),
        (key("attention.indexer.head_count"), cfg.indexer_n_heads, "UINT32"),
        (key("attention.indexer.key_length"), cfg.indexer_head_dim, "UINT32"),
        (key("attention.indexer.top_k"), cfg.indexer_budget, "UINT32"),
        (key("attention.compress_ratios"),
         [cfg.indexer_compress_ratio if kind == QSA else 0 for kind in cfg.layer_types], "ARRAY:INT32"),
    ]
    if cfg.ple_layer_ids:
        rows += [
            (key("ple.layers"), [i - 1 for i in cfg.ple_layer_ids], "ARRAY:INT32"),
            (key("ple.ngram_size"), cfg.ngram_size, "UINT32"),
            (key("ple.heads_per_ngram"), cfg.heads_per_ngram, "UINT32"),
            (key("ple.conv_kernel"), cfg.ple_conv_kernel_size, "UINT32"),
            (key("ple.eos_token_id"), cfg.eos_token_id, "UINT32"),
            (key("embedding_length_per_layer_input"), cfg.ple_embed_dim // cfg.ngram_heads, "UINT32"),
        ] + [(key(name), ple_constants[name], "ARRAY:UINT64")
             for name in ("ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes")]
    rows.append(("general.quantization_version", 2, "UINT32"))
    return rows
