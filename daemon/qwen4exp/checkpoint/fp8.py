"""Qwen's FP8 checkpoint layout: block-scaled float8 e4m3 weights, as its config's `quantization_config` says.

`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
"modules_to_not_convert": [...]}`: each weight stored in float8 e4m3 has beside it `<module>.weight_scale_inv`, one
scale per [128, 128] block of the weight ([ceil(out/128), ceil(in/128)], float32 or bfloat16), and its values are
W = W_fp8 x scale_inv, block by block. The PLE table is float8 shards with one global scale (one element, value =
fp8 x scale), published as `<table>.weight_scale`, the parameter of the FP8 embedding that transformers swaps in for
the modules the config's `"modules_to_convert": ["ple.ple_embedding.ngram_embedding"]` names. A one-element
`weight_scale_inv` beside the table's name or beside each shard reads as that scale too.

The loader (loader.py) pairs each float8 weight with its scale. The routed experts and the PLE table, most of the
model's bytes, stay float8 where their widths allow (`kept_type`): as our block types FP8_B128 / FP8_B32
(kernels/quant_tiles.LAYOUTS: each run of 128 or 32 values of a row after its block's scale), which the torch
forms and the kernels dequantize as they read them (`to_blocks` repacks a weight). The other weights are
dequantized as they are read. Either way a value is formed in float32 (the float8 value times its block's scale,
one rounding) and cast once to the model's dtype, so a checkpoint gives exactly the weights of its dequantized
float32 twin. `quantize` makes a (values, scales) pair, for the random writer and the tests.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"          # "<name>.weight" -> "<name>.weight_scale_inv"
TABLE_SCALE_SUFFIX = "_scale"        # the PLE table's one scale: "<table>.weight" -> "<table>.weight_scale"
FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = 448.0                   # the largest finite e4m3 value


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def is_scale(name: str) -> bool:
    """Whether a tensor's name is a scale's (of any weight: which one it scales is the loader's to find)."""
    return name.endswith((".weight" + SCALE_SUFFIX, ".weight" + TABLE_SCALE_SUFFIX))


def _ple_table(shard: str) -> str:
    return shard.rsplit(".shard_", 1)[0] + ".weight"


def ple_scale_name(shard: str) -> str:
    """The published name of the PLE table's one scale, from any of its shards' names: `<table>.weight_scale`."""
    return _ple_table(shard) + TABLE_SCALE_SUFFIX


def ple_scale_names(shard: str) -> tuple[str, ...]:
    """Where a PLE shard's one scale may sit, in the order looked for: as published, or as a `weight_scale_inv`
    beside the table's name or beside the shard."""
    return ple_scale_name(shard), scale_name(_ple_table(shard)), scale_name(shard)


def block_size(config: dict[str, Any], where: str) -> tuple[int, int] | None:
    """The [rows, cols] weight block of an FP8 checkpoint's config (read_config's dict), or None for a checkpoint
    that is not FP8; a quantization it does not read is refused with the key that says so."""
    quant = (config.get("top_level") or {}).get("quantization_config") or config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{where}: quantization_config.quant_method is {method!r}; this engine reads Qwen's "
                              f"block-scaled 'fp8' (or an unquantized checkpoint, or a GGUF)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: quantization_config.fmt is {quant.get('fmt')!r}; this engine reads e4m3")
    block = quant.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size must be [rows, cols] of positive "
                              f"whole numbers, got {block!r}")
    return block[0], block[1]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float8 [out, in] and its scales [ceil(out/rows), ceil(in/cols)] (as check_scale accepts them) -> float32;
    block None: one global scale (the PLE table's)."""
    return weight.to(torch.float32) * value_scales(scale, tuple(weight.shape), block)


def check_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None, weight: str,
                where: str) -> None:
    """Refuse scales that do not fit `weight` of `shape` (`where`: the scale tensor, as file and name)."""
    if block is None:
        if scale.numel() != 1:
            raise CheckpointError(f"{where} has shape {list(scale.shape)}; the PLE table's float8 shards take one "
                                  f"global scale (one element)")
        return
    expected = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    if tuple(scale.shape) != expected:
        raise CheckpointError(f"{where} has shape {list(scale.shape)}; {weight} {list(shape)} in blocks of "
                              f"{list(block)} needs {list(expected)}")


def value_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """Each value's float32 scale for a weight of `shape`: its block's ([ceil(out/rows), ceil(in/cols)] scales), or
    the one global scale (block None), broadcastable to the weight."""
    if block is None:
        return scale.to(torch.float32).reshape(())
    rows, cols = shape
    return scale.to(torch.float32).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def quantize(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as (float8 e4m3 values, float32 scales per block), each block's largest magnitude mapped
    to e4m3's largest value."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FLOAT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    values = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols].to(FLOAT8)
    return values, scale


KEPT_TYPES = {"FP8_B128": 128, "FP8_B32": 32}     # block type -> values a scale covers in a row


def kept_type(widths: list[int], block: tuple[int, int] | None) -> str | None:
    """The block type a float8 stack stays in, given the row widths of its pieces and the checkpoint's block (None:
    one global scale, the PLE table's): the widest whose runs divide every width and never straddle two scale
    blocks; None where none does (the stack is dequantized at load)."""
    for qtype, run in KEPT_TYPES.items():
        if all(width % run == 0 for width in widths) and (block is None or block[1] % run == 0):
            return qtype
    return None


def to_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, qtype: str) -> torch.Tensor:
    """A float8 weight [rows, cols] and its scales (block None: one global scale) as `qtype` blocks: uint8
    [rows, cols / run * (4 + run)], each run of a row after the float32 scale of the checkpoint block it lies in."""
    run = KEPT_TYPES[qtype]
    rows, cols = weight.shape
    runs = cols // run
    if block is None:
        per_run = scale.to(torch.float32).reshape(1, 1).expand(rows, runs)
    else:
        by_row = scale.to(torch.float32).repeat_interleave(block[0], 0)[:rows]
        per_run = by_row[:, torch.arange(runs, device=scale.device) * run // block[1]]
    out = torch.empty(rows, runs, 4 + run, dtype=torch.uint8, device=weight.device)
    out[:, :, :4] = per_run.contiguous().view(torch.uint8).reshape(rows, runs, 4)
    out[:, :, 4:] = weight.contiguous().view(torch.uint8).reshape(rows, runs, run)
    return out.reshape(rows, runs * (4 + run))


def random_blocks(qtype: str, shape: tuple[int, ...], std: float, seed: int):
    """numpy uint8 `qtype` blocks of a random tensor of `shape` (torch order) with values near N(0, std): drawn,
    quantized one run a scale, packed (the kernel tests' inputs, as gguf_blocks.random_blocks for GGML's types)."""
    run = KEPT_TYPES[qtype]
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(*shape, generator=generator) * std
    flat = values.reshape(-1, shape[-1])
    weight, scale = quantize(flat, (1, run))
    return to_blocks(weight, scale, (1, run), qtype).reshape(*shape[:-1], -1).numpy()


def _unit_spread() -> float:
    """The standard deviation of float8 e4m3's finite values, each byte equally likely."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FLOAT8).to(torch.float32)
    return float(values[~values.isnan()].std())


# The bytes of blocks whose NaN mask is made at once: the mask's two temporaries over the whole FP8 PLE table (a
# 54 GiB pinned table in host memory) would need twice the table again, more than a 128 GiB host has.
FILL_BYTES_AT_ONCE = 1 << 28


def fill_random_blocks(blocks: torch.Tensor, qtype: str, std: float, seed: int) -> None:
    """Random `qtype` blocks in place (uint8 [..., row bytes], on any device): every float8 byte but NaN's, under one
    scale that gives the values a spread of `std` (a random-weight model too large for a checkpoint on disk)."""
    run = KEPT_TYPES[qtype]
    blocks.random_(0, 256, generator=torch.Generator(device=blocks.device).manual_seed(seed))
    view = blocks.view(-1, 4 + run)
    for values in view[:, 4:].split(max(1, FILL_BYTES_AT_ONCE // view.shape[1])):
        values.masked_fill_((values & 0x7F) == 0x7F, 0x7E)             # 0x7F and 0xFF are NaN in e4m3fn
    scale = torch.tensor([std / _unit_spread()], dtype=torch.float32).view(torch.uint8)
    view[:, :4] = scale.to(blocks.device)
