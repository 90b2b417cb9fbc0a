"""A random-weight model built straight on the device, with no checkpoint on disk.

Benchmarks on a GPU need the shipped per-layer sizes (the `bench` preset is ~47 GiB of bfloat16), and writing
that to disk only to read it back costs minutes and a disk the GPU host may not have. This builds the model
the way `load_model` does (`build_model`: allocated uninitialised on the device, PLE hash constants recomputed)
and then fills every tensor with the random writer's own draws: each on-disk piece from its own generator,
seeded by (seed, on-disk name), with the writer's distribution and scale, drawn on the device, rounded to the
checkpoint dtype and copied into its place in the runtime tensor the way the loader places it (each expert's
gate/up/down projection into the fused `gate_up_proj`/`down_proj`, PLE table shards into consecutive rows).
So `random_model(preset, layers, dtype, device, seed)` holds exactly the tensors that
`load_model(write_random_checkpoint(dir, preset, layers, seed, dtype, device))` would, in seconds.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..engine.loading import DTYPES, build_model, resolve_device
from ..engine.model.causal_lm import Qwen4ExpForCausalLM
from ..engine.model.config import ModelConfig
from ..engine.model.quantized import QuantizedStack, regroup_q8_0
from . import layout
from .fp8_stacks import planned_fp8_stacks
from .gguf_blocks import fill_random_blocks
from .gguf_loader import quantized_stacks
from .gguf_writer import PlannedFile
from .presets import preset_config
from .writer import _draw, _dtype_label


@torch.no_grad()
def fill_random(model: Qwen4ExpForCausalLM, text: dict, seed: int, dtype: torch.dtype, progress: bool = False) -> int:
    """Write every parameter and persistent buffer of `model` (what a checkpoint holds) from the random writer's
    draws; returns the number of elements written."""
    targets = model.state_dict(keep_vars=True)
    specs = layout.module_specs(model)
    device = str(next(iter(targets.values())).device)
    written = 0
    bar = tqdm(total=sum(spec.numel for spec in specs), unit="", unit_scale=True, desc="random weights",
               disable=not progress)
    for spec in specs:
        target = targets[spec.name]
        for piece in layout.disk_pieces(spec, text):
            tensor = _draw(spec, piece, seed, dtype, device)
            (target[piece.index] if piece.index else target).copy_(tensor)
            written += tensor.numel()
        bar.update(spec.numel)
    bar.close()
    return written


# Bytes of a table in host memory drawn at a time on the model's GPU (then copied to its place).
HOST_SLICE_BYTES = 1 << 30


@torch.no_grad()
def fill_random_stacks(model: Qwen4ExpForCausalLM, seed: int) -> int:
    """Random blocks (gguf_blocks.fill_random_blocks) in every QuantizedStack of `model`, with the spread of the
    dense draw they stand for (an expert's fan-in; the PLE table's unit normal); returns the bytes written. A
    stack kept in host memory beside a model on a GPU (the PLE table: 29-58 GB) is drawn on the GPU a slice at a
    time (fill_through): drawn by the host's CPU it took minutes of a benchmark's start."""
    written = 0
    device = model.lm_head.weight.device
    for index, (name, module) in enumerate(model.named_modules()):
        if isinstance(module, QuantizedStack):
            std = 1.0 if name.endswith("ngram_embedding") else module.shape[-1] ** -0.5
            if module.host and device.type != "cpu":
                fill_through(module.blocks, module.qtype, std, seed * 1000003 + index, device)
            else:
                fill_random_blocks(module.blocks, module.qtype, std, seed * 1000003 + index)
            written += module.blocks.numel()
    return written


def fill_through(blocks: torch.Tensor, qtype: str, std: float, seed: int, device: torch.device) -> None:
    """Random `qtype` blocks into `blocks` (rows of whole blocks, anywhere), drawn on `device` HOST_SLICE_BYTES at a
    time, slice i with seed (seed, i), and copied into place."""
    rows = blocks.view(-1, blocks.shape[-1])
    if not rows.numel():
        return
    slices = rows.split(max(1, HOST_SLICE_BYTES // rows.shape[1]))
    staging = torch.empty(slices[0].shape, dtype=torch.uint8, device=device)
    for i, target in enumerate(slices):
        part = staging[:target.shape[0]]
        fill_random_blocks(part, qtype, std, seed * 65537 + i)
        target.copy_(part)


def random_model(preset: str = "bench", layers: int | None = None, dtype: torch.dtype | str = torch.bfloat16,
                 device: str | torch.device | None = None, seed: int = 0, progress: bool = False,
                 quant: str | None = None, placement=None, ple_on_host: bool = False,
                 mtp_head: bool = False) -> Qwen4ExpForCausalLM:
    """The model of `preset` (optionally cut to `layers` layers) with random weights, built on `device`.

    Equal, tensor for tensor, to loading a checkpoint that `write_random_checkpoint` wrote with the same
    preset, layers, seed, dtype and device, so numerically sane in the same way (finite logits with a
    visible spread; routers that change experts from token to token). With `quant` (a GGUF mix or block type,
    gguf_writer), the weights a GGUF of that mix keeps quantized are random blocks instead, built in place (the
    full model at UD-Q4_K_XL without the 104 GiB file), and there is no MTP head, as in a GGUF. With quant "fp8",
    the weights Qwen's FP8 checkpoint keeps float8 are random FP8 blocks (the full model in FP8 without its 173 GiB;
    the MTP head kept). `placement` and `ple_on_host` are build_model's: layers built on split devices in place
    (the full model over two GPUs), a quantized PLE table in host memory. `mtp_head` True keeps the head with a GGUF
    mix too (a GGUF served with `mtp_weights`: the head dense, as Qwen's bfloat16 release gives it)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = device if isinstance(device, torch.device) else resolve_device(device)
    config = preset_config(preset, layers, dtype=_dtype_label(dtype))
    text = config["text_config"]
    if quant and quant != "fp8" and not mtp_head:
        text["mtp_num_hidden_layers"] = 0          # llama.cpp's converter drops the MTP head
    cfg = ModelConfig.from_dict(config, source=f"preset {preset!r}")
    if quant == "fp8":
        quantized = planned_fp8_stacks(cfg)
    else:
        quantized = quantized_stacks(PlannedFile(cfg, quant), cfg) if quant else None
    model = build_model(cfg, dtype, device, quantized, ple_on_host, placement)
    fill_random(model, text, seed, dtype, progress=progress)
    fill_random_stacks(model, seed)
    regroup_q8_0(model)                    # as a load does (engine/loading.py)
    return model
