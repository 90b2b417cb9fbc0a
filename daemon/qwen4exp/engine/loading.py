"""Build our model for a checkpoint directory or a GGUF file: config, tensors in place on the target device."""

from __future__ import annotations

import logging

import torch

from ..checkpoint.gguf_file import GGUFCheckpoint, is_gguf
from ..checkpoint.gguf_loader import load_gguf_weights, quantized_stacks
from ..checkpoint.fp8_stacks import fp8_stacks
from ..checkpoint.errors import CheckpointError
from ..checkpoint.loader import load_weights, read_config
from ..checkpoint.mtp_weights import head_source, load_head
from .model.causal_lm import Qwen4ExpForCausalLM
from .model.config import ModelConfig
from .model.ple import NGramEmbedding
from .model.quantized import QuantizedStack, keep_quantized, regroup_q8_0
from .placement import Placement

log = logging.getLogger("qwen4exp.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name.lower() if isinstance(name, str) else name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not one this engine runs on: cpu, cuda or cuda:N (ROCm GPUs are "
                         f"cuda too), or auto") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one this engine runs on: cpu, cuda or cuda:N (ROCm GPUs are "
                         f"cuda too), or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but torch sees no CUDA/ROCm device")
    return device


def quantized_ple_tables(model: torch.nn.Module) -> list[QuantizedStack]:
    """The PLE n-gram tables kept as blocks (a GGUF's, an FP8 checkpoint's): the ones that can live in host
    memory."""
    return [module.ngram_embedding for module in model.modules()
            if isinstance(module, NGramEmbedding) and isinstance(module.ngram_embedding, QuantizedStack)]


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                quantized: dict[str, tuple[str, tuple[int, int, int]]] | None = None,
                ple_on_host: bool = False, placement: Placement | None = None) -> Qwen4ExpForCausalLM:
    """Allocate the model on `device` without initialising weights (a load fills them); `quantized` names the
    expert stacks kept as GGML blocks ({runtime name: (block type, shape)}, model/quantized.py); `ple_on_host`
    allocates a quantized PLE table in (pinned) host memory instead (the load then writes it there); `placement`
    puts decoder layers on split devices (placement.py; its target is `device`)."""
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(cfg)
        keep_quantized(model, quantized or {}, dtype)
    hosted = quantized_ple_tables(model) if ple_on_host else []
    if ple_on_host and not hosted:
        raise ValueError("ple = 'host' keeps a quantized PLE table (a GGUF's, or an FP8 checkpoint's) in host memory; "
                         "this model's table is not quantized (a bfloat16 checkpoint, a GGUF whose table is a float "
                         "type, or rows no block type takes)")
    for table in hosted:
        table.host = True                             # moved with nothing, then allocated on the host below
    model = model.to(dtype=dtype)
    if placement is not None and placement.is_split:
        if torch.device(placement.target) != device:
            raise ValueError(f"the placement's target is {placement.target}, the model is built for {device}")
        model.place(placement, allocate=True)
    else:
        model = model.to_empty(device=device)
    for table in hosted:
        table.keep_on_host()
    # The hash constants are derived, not learned: recompute them (a checkpoint's copy must agree).
    for module in model.modules():
        if isinstance(module, NGramEmbedding):
            module.reset_constants()
    return model.eval()


def model_config(path: str) -> ModelConfig:
    """The model config of a checkpoint directory (its config.json) or of a GGUF file (its metadata)."""
    if is_gguf(path):
        return GGUFCheckpoint(path).model_config()
    return ModelConfig.from_dict(read_config(path), source=f"{path}/config.json")


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
               progress: bool = True, ple_on_host: bool = False, placement: Placement | None = None,
               mtp_weights: str | None = None) -> Qwen4ExpForCausalLM:
    """The model of `path` (a checkpoint directory or a GGUF) in `dtype` on `device`; `mtp_weights`: the directory
    of a safetensors checkpoint of the same model whose MTP head a GGUF's model takes (checkpoint/mtp_weights.py)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = device if isinstance(device, torch.device) else resolve_device(device)
    if is_gguf(path):
        checkpoint = GGUFCheckpoint(path)
        cfg = checkpoint.model_config()
        head = head_source(mtp_weights, cfg, str(path)) if mtp_weights else None
        cfg = head.cfg if head else cfg
        model = build_model(cfg, dtype, device, quantized_stacks(checkpoint, cfg) | (head.stacks if head else {}),
                            ple_on_host, placement)
        report = load_gguf_weights(checkpoint, model, cfg)
        regrouped = regroup_q8_0(model)
        log.info("loaded %s: %s (%d Q8_0 projections regrouped for the decode products)", path, report, regrouped)
        if head:
            log.info("loaded the MTP head from %s: %s", head.path, load_head(head, model, dtype, device, progress))
        return model
    if mtp_weights:
        raise CheckpointError(f"mtp_weights = {mtp_weights!r} gives a GGUF model its MTP head; {path} is a "
                              f"safetensors checkpoint, which brings its own (or has none)")
    cfg = model_config(path)
    # An FP8 checkpoint's float8 experts and PLE table stay float8 (checkpoint/fp8.py).
    model = build_model(cfg, dtype, device, fp8_stacks(path, read_config(path)), ple_on_host, placement)
    report = load_weights(path, model, dtype=dtype, device=device, progress=progress)
    log.info("loaded %s: %s", path, report)
    return model
