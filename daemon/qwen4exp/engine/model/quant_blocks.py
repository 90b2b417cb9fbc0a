"""GGML's quantized blocks (and our FP8 ones) dequantized in torch: the reference forms of the quantized weights'
kernels.

A weight kept quantized is a uint8 tensor [..., row bytes]: each row a run of blocks of `block` values. These
functions give float32 values bit for bit equal to `gguf.quants.dequantize` (tests/test_quant_blocks.py): every
scale product is formed in float32 in the order llama.cpp's reference code forms it (d * sub-block scale first,
then times the quant; the K-quants' min likewise), so a kernel that dequantizes in registers can be held to it.
Runs on any device torch does (uint8 shifts and masks, float32 products).
"""

from __future__ import annotations

import torch

from ...kernels.quant_tiles import IQ4_VALUES, LAYOUTS   # the formats, as the kernels read them too


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian float16 at byte `at` of each block, as float32 [N, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, k] bytes -> [N, 2k] 4-bit values: the low nibbles first, then the high ones (GGML's 32-value order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[N, count / 8] little-endian bytes -> [N, count] bits (bit i of the packed integer at position i)."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], count)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block, packed in 12 bytes, as float32 [N, 8] each."""
    low, mid, high = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((low & 63, (high & 0x0F) | ((low >> 6) << 4)), dim=-1)
    mn = torch.cat((mid & 63, (high >> 4) | ((mid >> 6) << 4)), dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q8_0(b):
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).to(torch.float32)


def split_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """Q8_0 rows [..., row bytes] -> the same bytes as Q8_0_R rows (quant_tiles.LAYOUTS): the row's scales, then its
    quants."""
    blocks = rows.reshape(*rows.shape[:-1], -1, 34)
    return torch.cat((blocks[..., :2].flatten(-2), blocks[..., 2:].flatten(-2)), dim=-1)


def join_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """split_q8_0's inverse: Q8_0_R rows -> Q8_0 rows (what a GGUF holds)."""
    count = rows.shape[-1] // 34
    scales = rows[..., :2 * count].unflatten(-1, (count, 2))
    quants = rows[..., 2 * count:].unflatten(-1, (count, 32))
    return torch.cat((scales, quants), dim=-1).flatten(-2)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).to(torch.float32) - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:20]).to(torch.float32) + _f16(b, 2)


def _q5(b, qh_at: int) -> torch.Tensor:
    high = _bits(b[:, qh_at:qh_at + 4], 32)
    return (_nibbles(b[:, qh_at + 4:qh_at + 20]) | (high << 4)).to(torch.float32)


def _q5_0(b):
    return _f16(b, 0) * (_q5(b, 2) - 16)


def _q5_1(b):
    return _f16(b, 0) * _q5(b, 4) + _f16(b, 2)


def _k_chunks(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low bits: 4 chunks of 32 bytes, each giving 32 low-nibble then 32 high-nibble values -> [N, 8, 32]."""
    chunks = qs.reshape(qs.shape[0], 4, 32)
    return torch.stack((chunks & 0x0F, chunks >> 4), dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    q = _k_chunks(b[:, 16:144]).to(torch.float32)
    return ((_f16(b, 0) * sc).unsqueeze(-1) * q - (_f16(b, 2) * mn).unsqueeze(-1)).reshape(b.shape[0], 256)


def _q5_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, device=b.device, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    q = (_k_chunks(b[:, 48:176]) | (high << 4)).to(torch.float32)
    return ((_f16(b, 0) * sc).unsqueeze(-1) * q - (_f16(b, 2) * mn).unsqueeze(-1)).reshape(b.shape[0], 256)


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)                 # [half, 32-byte group, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.stack((ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4), dim=2)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).to(torch.float32) - 32          # [N, half, 4 quarters, 32]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)   # 16 scales, one per 16 values
    d = (_f16(b, 208) * scales).reshape(n, 2, 4, 2, 1)
    return (d * q.reshape(n, 2, 4, 2, 16)).reshape(n, 256)


def _iq4_nl(b):
    grid = torch.tensor(IQ4_VALUES, device=b.device, dtype=torch.float32)
    return _f16(b, 0) * grid[_nibbles(b[:, 2:18]).long()]


def _iq4_xs(b):
    n = b.shape[0]
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    low = _nibbles(b[:, 4:8]).reshape(n, 2, 4).transpose(1, 2).reshape(n, 8).to(torch.int32)  # sub-block order
    shifts = 2 * torch.arange(8, device=b.device, dtype=torch.int32)
    ls = low | (((high >> shifts) & 3) << 4)
    dl = (_f16(b, 0) * (ls - 32).to(torch.float32)).unsqueeze(-1)              # [N, 8, 1]
    qs = b[:, 8:136].reshape(n, 8, 16)
    grid = torch.tensor(IQ4_VALUES, device=b.device, dtype=torch.float32)
    q = grid[torch.cat((qs & 0x0F, qs >> 4), dim=-1).long()]                   # [N, 8, 32]
    return (dl * q).reshape(n, 256)


def _fp8(b):
    """Ours (quant_tiles.LAYOUTS): a float32 scale, then float8 e4m3 values."""
    scale = b[:, 0:4].contiguous().view(torch.float32)
    return scale * b[:, 4:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)


_FORMS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
          "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "FP8_B32": _fp8, "FP8_B128": _fp8,
          "Q8_0_R": None}


def dequantize(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 [..., row bytes] of `qtype` blocks -> float32 [..., row values]."""
    if qtype not in _FORMS:
        raise ValueError(f"no torch form for {qtype}; these are: {', '.join(_FORMS)}")
    values, size = LAYOUTS[qtype]
    if raw.dtype != torch.uint8 or raw.shape[-1] % size:
        raise ValueError(f"{qtype} rows are whole {size}-byte blocks of uint8, got {raw.dtype} rows of "
                         f"{raw.shape[-1]} bytes")
    if qtype == "Q8_0_R":                      # its blocks are whole only in a whole row
        return dequantize(join_q8_0(raw), "Q8_0")
    blocks = raw.reshape(-1, size)
    return _FORMS[qtype](blocks).reshape(*raw.shape[:-1], raw.shape[-1] // size * values)
