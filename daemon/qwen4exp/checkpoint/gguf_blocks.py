"""Random quantized blocks: random bytes (every bit pattern of the quants, sub-block scales and mins) with the
block's f16 scale fields set to finite values, so that the dequantized tensor is centred on zero with a chosen
spread. A random-weight GGUF at a K-quant or IQ4 mix is written this way (the `gguf` package quantizes only the
simple types), and the per-type tests reach every quant pattern with it.
"""

from __future__ import annotations

import numpy as np

# type -> (byte offset of the f16 scale d, of the f16 min field or None, min as a multiple of -d that centres
# the values: the mean of the quant times the mean sub-block scale, where the type adds a min)
_SCALES = {
    "Q8_0": (0, None, 0.0),
    "Q4_0": (0, None, 0.0),
    "Q4_1": (0, 2, 7.5),           # d * q + m, q in 0..15
    "Q5_0": (0, None, 0.0),
    "Q5_1": (0, 2, 15.5),          # q in 0..31
    "Q4_K": (0, 2, 7.5),           # d * sc * q - dmin * m, sc and m alike in 0..63: dmin = 7.5 d centres it
    "Q5_K": (0, 2, 15.5),
    "Q6_K": (208, None, 0.0),      # d is the block's last field; int8 sub-block scales, q - 32
    "IQ4_NL": (0, None, 0.0),
    "IQ4_XS": (0, None, 0.0),
}
QUANTIZED_TYPES = tuple(_SCALES)


def _blocks(qtype: str, rows: int, blocks: int, d: float, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    d_at, min_at, centre = _SCALES[qtype]
    raw[..., d_at:d_at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if min_at is not None:
        sign = 1.0 if qtype.endswith("_K") else -1.0      # K-quants subtract dmin * m; Q4_1/Q5_1 add m
        raw[..., min_at:min_at + 2] = np.frombuffer(np.float16(sign * centre * d).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, blocks * size)


def _unit_spread(qtype: str, seed: int) -> float:
    """The standard deviation of random blocks at d = 1, measured on a sample: the scale for a spread follows."""
    from gguf import GGMLQuantizationType, quants

    sample = _blocks(qtype, 64, 1, 1.0, np.random.default_rng(seed + 1))
    return float(np.std(quants.dequantize(sample, GGMLQuantizationType[qtype])))


def random_blocks(qtype: str, shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
    """uint8 blocks of `qtype` for a tensor of `shape` (torch order; the last axis a whole number of blocks),
    whose dequantized values have a standard deviation near `std` (our FP8 types: fp8.random_blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if qtype.startswith("FP8_"):
        from .fp8 import random_blocks as fp8_blocks
        return fp8_blocks(qtype, shape, std, seed)
    if qtype == "Q8_0_R":                  # ours: Q8_0 rows regrouped (quant_tiles.LAYOUTS)
        import torch

        from ..engine.model.quant_blocks import split_q8_0
        return split_q8_0(torch.from_numpy(random_blocks("Q8_0", shape, std, seed))).numpy()

    block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
    if shape[-1] % block:
        raise ValueError(f"{qtype} blocks hold {block} values; a row of {shape[-1]} is not a whole number of them")
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    out = _blocks(qtype, rows, shape[-1] // block, std / _unit_spread(qtype, seed), np.random.default_rng(seed))
    return out.reshape(*shape[:-1], out.shape[-1])


def fill_random_blocks(blocks, qtype: str, std: float, seed: int) -> None:
    """random_blocks drawn in place into `blocks` (a torch uint8 tensor [..., row bytes], on any device): how a
    random-weight model too large for the host's memory or disk gets its quantized weights."""
    import torch

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if qtype.startswith("FP8_"):
        from .fp8 import fill_random_blocks as fill_fp8
        return fill_fp8(blocks, qtype, std, seed)
    if qtype == "Q8_0_R":                  # drawn as Q8_0, then each row regrouped in place
        from ..engine.model.quant_blocks import split_q8_0
        fill_random_blocks(blocks, "Q8_0", std, seed)
        rows = blocks.view(-1, blocks.shape[-1])
        rows.copy_(split_q8_0(rows))
        return None
    size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    blocks.random_(0, 256, generator=torch.Generator(device=blocks.device).manual_seed(seed))
    view = blocks.view(-1, size)
    d = std / _unit_spread(qtype, seed)
    d_at, min_at, centre = _SCALES[qtype]
    fields = [(d_at, d)] + ([(min_at, (1.0 if qtype.endswith("_K") else -1.0) * centre * d)] if min_at is not None
                            else [])
    for at, value in fields:
        low, high = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
        view[:, at], view[:, at + 1] = int(low), int(high)
