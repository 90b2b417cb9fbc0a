"""A GGUF model's MTP head, read from a safetensors checkpoint of the same model (a profile's `mtp_weights`).

llama.cpp's converter leaves the multi-token-prediction head (`mtp.*`) out of a GGUF, so a model served from one
cannot draft. Qwen's own releases carry the head: `mtp_weights` names such a checkpoint's directory (the bfloat16
or the FP8 release), of which only config.json, the index and the shards that hold the `mtp.*` tensors need to be
there. The head is built beside the GGUF's layers, shares its embedding and LM head, and is read from those shards
(an FP8 release's float8 experts stay float8, as when that checkpoint is served whole).

The head only fits the model it was trained with: the fields its layer, the shared embedding and the LM head are
built from must be the GGUF's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine.model.config import ConfigError, ModelConfig
from .errors import CheckpointError
from .layout import MTP_PREFIX

# What the head's layer (QSA attention, MoE, hyper-connections) and the shared embedding and LM head are built from,
# and the depth and kinds of the layers whose final streams it was trained on.
HEAD_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
               "partial_rotary_factor", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "norm_topk_prob", "hc_count", "hc_lowrank", "indexer_n_heads",
               "indexer_head_dim", "indexer_budget", "indexer_compress_ratio", "rms_norm_eps", "num_hidden_layers",
               "layer_types")
# Where config.json keeps the fields whose ModelConfig names differ.
CONFIG_KEYS = {"rope_theta": "rope_parameters.rope_theta",
               "partial_rotary_factor": "rope_parameters.partial_rotary_factor"}


@dataclass(frozen=True)
class HeadSource:
    path: str
    cfg: ModelConfig                              # the GGUF's config with the head's layers
    stacks: dict[str, tuple[str, tuple[int, ...]]]  # the head's float8 weights kept as blocks (fp8_stacks)


def _same(a, b) -> bool:
    # A GGUF stores float fields as float32: 1e-6 comes back as 9.99999997e-07.
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def head_source(path: str | Path, model_cfg: ModelConfig, model_label: str) -> HeadSource:
    """The head of the checkpoint at `path` for a model of `model_cfg` (read from `model_label`, a GGUF): the config
    checked, the files holding `mtp.*` found (their headers read for the float8 ones); no tensor data is read."""
    from .fp8_stacks import fp8_stacks
    from .loader import checkpoint_files, read_config

    path = Path(path).expanduser()
    if not path.is_dir():
        what = "no such directory" if not path.exists() else "not a directory"
        from ..hub import HubId
        hint = " (serve, generate and plan fetch a Hugging Face id; here, name the release's local directory)" \
            if HubId.parse(str(path)) is not None else ""
        raise CheckpointError(f"mtp_weights = {str(path)!r}: {what}{hint}; point it at the directory of a safetensors "
                              f"checkpoint of the model (config.json, the index, and the shards holding its mtp.* "
                              f"tensors)")
    config = read_config(path)
    source = f"{path}/config.json"
    try:
        theirs = ModelConfig.from_dict(config, source=source)
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
    if not theirs.mtp_num_hidden_layers:
        raise CheckpointError(f"{source}: text_config.mtp_num_hidden_layers is 0: this checkpoint has no MTP head")
    differ = [name for name in HEAD_FIELDS if not _same(getattr(theirs, name), getattr(model_cfg, name))]
    if differ:
        shown = "; ".join(f"text_config.{CONFIG_KEYS.get(name, name)} is {getattr(theirs, name)}, {model_label} has "
                          f"{getattr(model_cfg, name)}" for name in differ[:4])
        more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
        raise CheckpointError(f"{source}: not the model of {model_label}, so its MTP head does not fit: {shown}{more}")
    files = checkpoint_files(path, MTP_PREFIX)
    if not files:
        raise CheckpointError(f"{path}: no tensor is named {MTP_PREFIX}* (the checkpoint's MTP head)")
    return HeadSource(str(path), replace(model_cfg, mtp_num_hidden_layers=theirs.mtp_num_hidden_layers),
                      fp8_stacks(path, config, MTP_PREFIX))


def load_head(head: HeadSource, model, dtype, device, progress: bool = False):
    """The head's tensors into `model` (built from `head.cfg`, its other weights loaded from the GGUF): LoadReport."""
    from .loader import load_weights

    return load_weights(head.path, model, dtype=dtype, device=device, progress=progress, only=MTP_PREFIX)
