"""GGML's quantized blocks (and our FP8 ones, an FP8 checkpoint's: checkpoint/fp8.py) dequantized in registers,
inside the kernels that multiply by them.

A quantized weight is uint8 rows, each a run of blocks (LAYOUTS below; engine/model/quant_blocks.py has the torch
forms). Every type splits a row into groups of 32 values that share their scales, so the kernels walk a weight
in tiles of whole groups: `dequantize_groups` takes each row's first byte, the first column of each group and the
32 lanes of a group (any broadcastable shapes, so a kernel lays the tile out as its product wants it), loads a
group's scale fields once and each value's quant bits, and gives the values in float32.

Exactness: the values equal the torch form's (and so gguf.quants.dequantize's) bit for bit. The products are
formed in the reference's order (d times the sub-block scale first, then the quant, the min subtracted last), and
where an add follows a product that product is exact in float32 (an f16 scale has 11 significant bits, a quant
and a 6-bit sub-block scale at most 14 more), so whether the compiler fuses them into an FMA changes nothing.
The gathers here and the prefill GEMMs' tiles round them to the model's dtype, as the torch form's `.to(dtype)`
does; the decode kernels multiply by them in float32 (moe_blocks.py).
"""

from __future__ import annotations

import functools

import torch

from .guard import interpreted, tl, triton

# (values per block, bytes per block) of each block type. FP8_B32 and FP8_B128 are ours, for Qwen's FP8 checkpoint
# (checkpoint/fp8.py): a float32 scale (little-endian), then 32 or 128 float8 e4m3 values, each value = scale x it.
# Q8_0_R is ours too: a Q8_0 row regrouped as all its blocks' float16 scales, then all their int8 quants (the same
# bytes; engine/model/quantized.py's regroup_q8_0, for the projections whose rows are a multiple of 256 values, so the
# quants start 16-byte aligned and the decode products load them in vectors). Its sizes are Q8_0's, but its blocks
# are not contiguous: only whole rows are read (block_products' kernel, gather_rows, quant_blocks.dequantize).
LAYOUTS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
           "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
           "FP8_B32": (32, 36), "FP8_B128": (128, 132), "Q8_0_R": (32, 34)}
# The non-linear 4-bit grid of IQ4_NL and IQ4_XS.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
QTYPES = tuple(LAYOUTS)
GROUP = 32   # values that share their scale fields, in every type above
# The 32-value types the experts' down products read a block at a time, as two runs of 16 values (dequantize_halves;
# a prompt's grouped GEMM all but IQ4_NL: moe_blocks._grouped_down_form): their blocks have an even size, so every
# block's 16-bit fields are 2-byte aligned; Q8_0's quants pair up in 16-bit words.
HALVES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")


def row_form(qtype: str) -> str:
    """How the decode products over experts read a row of `qtype`: "halves" (dequantize_halves; the down product
    only), "words" (fp8_b128_words: FP8_B128, gate/up and down) or "groups" (a byte a value, dequantize_groups: the
    K-quants, IQ4_XS and FP8_B32, which have no wider form yet)."""
    return "halves" if qtype in HALVES else "words" if qtype == "FP8_B128" else "groups"


@functools.cache
def iq4_grid(device: torch.device) -> torch.Tensor:
    """IQ4_NL's and IQ4_XS's 16 levels as float32 on `device` (kept: a captured CUDA graph reads it)."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)


def grid_for(qtype: str, like: torch.Tensor) -> torch.Tensor:
    """The level table a kernel reads for `qtype` (IQ4 types), else any tensor: never read."""
    return iq4_grid(like.device) if qtype.startswith("IQ4") else like


if triton is not None:
    from .rounding import round_to

    LANES = tl.constexpr(GROUP)    # GROUP, as jitted code reads a global

    @triton.jit
    def _u8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _exact_float(q, offset: tl.constexpr):
        """float32(q - offset), exactly, for an int32 0 <= q < 2^22: q as the low mantissa bits of 2^23 (an integer
        OR), then 2^23 + offset subtracted (a float add of exact operands, so exact). The K-quants' values and scale
        fields take this instead of a conversion, which NVIDIA GPUs run on the slower multi-function unit for the
        16-bit words the compiler forms of them (I2F.U16 in sm_90's SASS of the decode gate/up product)."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)

    @triton.jit
    def _f16(ptr, mask):
        """The little-endian float16 at `ptr` (2 bytes, any alignment) as float32."""
        low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _f32_at(ptr, mask):
        """The float32 at the 4-byte aligned `ptr`, in one load (an FP8 block's scale: blocks of 36 and 132 bytes)."""
        return tl.load(ptr.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)

    @triton.jit
    def _e4m3_over_256(ptr, mask):
        """The float8 e4m3 byte at `ptr` as float32, divided by 256, exactly: its sign, exponent and mantissa bits
        moved into a float16's places (sign to bit 15, the rest up 7) spell value x 2^-8, subnormals included, for
        float16's exponent bias is 8 more than e4m3's; a bit move and one conversion, where rebuilding float32's
        fields took some twelve operations a value. The NaN bytes 0x7F and 0xFF read as +-1.875 here, +-480 once
        scaled (no checkpoint holds them, and fp8.fill_random_blocks draws none)."""
        return _e4m3_bits_over_256(_u8(ptr, mask))

    @triton.jit
    def _e4m3_bits_over_256(byte):
        """_e4m3_over_256's value of the e4m3 bits in the low byte of the integer `byte`."""
        half = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
        return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _nibble(ptr, lane, mask):
        """Lane 0..31 of a 32-value run stored as 16 bytes at `ptr`: low nibbles hold 0..15, high 16..31."""
        return (_u8(ptr + (lane & 15), mask) >> ((lane >> 4) * 4)) & 15

    @triton.jit
    def _bit(ptr, lane, mask):
        """Bit `lane` of the little-endian 32-bit field at `ptr` (the fifth bit of Q5_0/Q5_1 quants)."""
        return (_u8(ptr + (lane >> 3), mask) >> (lane & 7)) & 1

    @triton.jit
    def _k_scale_min(ptr, j, mask):
        """Sub-block j's 6-bit (scale, min) of a Q4_K/Q5_K block, from the 12 scale bytes at `ptr`, as float32."""
        low = _u8(ptr + (j & 3), mask)
        mid = _u8(ptr + 4 + (j & 3), mask)
        high = _u8(ptr + 8 + (j & 3), mask)
        first = j < 4
        scale = tl.where(first, low & 63, (high & 15) | ((low >> 6) << 4))
        minimum = tl.where(first, mid & 63, (high >> 4) | ((mid >> 6) << 4))
        return _exact_float(scale, 0), _exact_float(minimum, 0)

    @triton.jit
    def dequantize_groups(row, col, lane, mask, grid_ptr, QTYPE: tl.constexpr):
        """float32 values of 32-value groups: `row` points at each row's first byte, `col` is each group's first
        column (a multiple of 32), `lane` 0..31 the value in its group; `mask` says which (row, group) exist.
        grid_ptr: iq4_grid for the IQ4 types (unread otherwise)."""
        if QTYPE == "Q8_0":
            base = row + (col // 32) * 34
            q = tl.load(base + 2 + lane, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            return _f16(base, mask) * q
        elif QTYPE == "Q4_0":
            base = row + (col // 32) * 18
            return _f16(base, mask) * (_nibble(base + 2, lane, mask).to(tl.float32) - 8)
        elif QTYPE == "Q4_1":
            base = row + (col // 32) * 20
            return _f16(base, mask) * _nibble(base + 4, lane, mask).to(tl.float32) + _f16(base + 2, mask)
        elif QTYPE == "Q5_0":
            base = row + (col // 32) * 22
            q = _nibble(base + 6, lane, mask) | (_bit(base + 2, lane, mask) << 4)
            return _f16(base, mask) * (q.to(tl.float32) - 16)
        elif QTYPE == "Q5_1":
            base = row + (col // 32) * 24
            q = _nibble(base + 8, lane, mask) | (_bit(base + 4, lane, mask) << 4)
            return _f16(base, mask) * q.to(tl.float32) + _f16(base + 2, mask)
        elif QTYPE == "Q4_K":
            base = row + (col // 256) * 144
            j = (col % 256) // 32
            scale, minimum = _k_scale_min(base + 4, j, mask)
            q = (_u8(base + 16 + (j >> 1) * 32 + lane, mask) >> ((j & 1) * 4)) & 15
            return (_f16(base, mask) * scale) * _exact_float(q, 0) - _f16(base + 2, mask) * minimum
        elif QTYPE == "Q5_K":
            base = row + (col // 256) * 176
            j = (col % 256) // 32
            scale, minimum = _k_scale_min(base + 4, j, mask)
            low = (_u8(base + 48 + (j >> 1) * 32 + lane, mask) >> ((j & 1) * 4)) & 15
            q = low | (((_u8(base + 16 + lane, mask) >> j) & 1) << 4)
            return (_f16(base, mask) * scale) * _exact_float(q, 0) - _f16(base + 2, mask) * minimum
        elif QTYPE == "Q6_K":
            # 256 values in two halves of 128, each four quarters of 32 (j = half * 4 + quarter); 16-value scales
            base = row + (col // 256) * 210
            j = (col % 256) // 32
            half = j >> 2
            quarter = j & 3
            low = (_u8(base + half * 64 + (quarter & 1) * 32 + lane, mask) >> ((quarter >> 1) * 4)) & 15
            high = (_u8(base + 128 + half * 32 + lane, mask) >> (quarter * 2)) & 3
            q = _exact_float(low | (high << 4), 32)
            scale = tl.load(base + 192 + j * 2 + (lane >> 4), mask=mask, other=0).to(tl.int8, bitcast=True)
            return (_f16(base + 208, mask) * scale.to(tl.float32)) * q
        elif QTYPE == "IQ4_NL":
            base = row + (col // 32) * 18
            return _f16(base, mask) * tl.load(grid_ptr + _nibble(base + 2, lane, mask))
        elif QTYPE == "FP8_B32":
            # scale x 256 and value / 256 are exact (powers of two), so their product rounds as torch's scale x value
            base = row + (col // 32) * 36
            return (_f32_at(base, mask) * 256.0) * _e4m3_over_256(base + 4 + lane, mask)
        elif QTYPE == "FP8_B128":
            base = row + (col // 128) * 132
            return (_f32_at(base, mask) * 256.0) * _e4m3_over_256(base + 4 + (col % 128) + lane, mask)
        else:
            tl.static_assert(QTYPE == "IQ4_XS", "no in-register form for this block type")
            base = row + (col // 256) * 136
            j = (col % 256) // 32
            high = (_u8(base + 2, mask) | (_u8(base + 3, mask) << 8)) >> (j * 2) & 3
            low = (_u8(base + 4 + (j >> 1), mask) >> ((j & 1) * 4)) & 15
            scale = _f16(base, mask) * _exact_float(low | (high << 4), 32)
            return scale * tl.load(grid_ptr + _nibble(base + 8 + j * 16, lane, mask))

    @triton.jit
    def _f16_at(ptr, mask):
        """The float16 at the 2-byte aligned `ptr` as float32, in one load."""
        return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _nibbles(ptr, i, mask):
        """A 32-value run of 4-bit quants stored as 16 bytes at `ptr`: (values i, values i + 16) for `i` 0..15."""
        pairs = tl.load(ptr + i, mask=mask, other=0).to(tl.int32)
        return pairs & 15, pairs >> 4

    @triton.jit
    def _fifth_bits(ptr, i, mask):
        """The fifth bits of values i and i + 16 from the little-endian 32-bit field at the 2-byte aligned `ptr`."""
        words = ptr.to(tl.pointer_type(tl.uint16))
        low = tl.load(words, mask=mask, other=0).to(tl.int32)
        high = tl.load(words + 1, mask=mask, other=0).to(tl.int32)
        return ((low >> i) & 1) << 4, ((high >> i) & 1) << 4

    @triton.jit
    def dequantize_halves(row, block, i, mask, grid_ptr, QTYPE: tl.constexpr):
        """float32 values of whole 32-value blocks (QTYPE one of HALVES) read as two runs of 16: `row` points at each
        row's first byte, `block` is each block's index in its row, `i` 0..15 (any broadcastable shapes); `mask`
        says which (row, block) exist. Gives (the values at columns 32 block + i, those at 32 block + i + 16), for
        Q8_0 (32 block + 2i, 32 block + 2i + 1): a block's quant bytes load as one run its alignment lets Triton
        vectorize (the byte-wise reads of dequantize_groups do not), and each value is dequantize_groups' bit for
        bit, formed in the same order."""
        if QTYPE == "Q8_0":
            base = row + block * 34
            d = _f16_at(base, mask)
            words = tl.load((base + 2).to(tl.pointer_type(tl.int16)) + i, mask=mask, other=0).to(tl.int32)
            return d * ((words << 24) >> 24).to(tl.float32), d * (words >> 8).to(tl.float32)
        elif QTYPE == "Q4_0":
            base = row + block * 18
            d = _f16_at(base, mask)
            low, high = _nibbles(base + 2, i, mask)
            return d * (low.to(tl.float32) - 8), d * (high.to(tl.float32) - 8)
        elif QTYPE == "Q4_1":
            base = row + block * 20
            d, m = _f16_at(base, mask), _f16_at(base + 2, mask)
            low, high = _nibbles(base + 4, i, mask)
            return d * low.to(tl.float32) + m, d * high.to(tl.float32) + m
        elif QTYPE == "Q5_0":
            base = row + block * 22
            d = _f16_at(base, mask)
            low, high = _nibbles(base + 6, i, mask)
            fifth_low, fifth_high = _fifth_bits(base + 2, i, mask)
            return d * ((low | fifth_low).to(tl.float32) - 16), d * ((high | fifth_high).to(tl.float32) - 16)
        elif QTYPE == "Q5_1":
            base = row + block * 24
            d, m = _f16_at(base, mask), _f16_at(base + 2, mask)
            low, high = _nibbles(base + 8, i, mask)
            fifth_low, fifth_high = _fifth_bits(base + 4, i, mask)
            return d * (low | fifth_low).to(tl.float32) + m, d * (high | fifth_high).to(tl.float32) + m
        else:
            tl.static_assert(QTYPE == "IQ4_NL", "dequantize_halves reads the 32-value types of HALVES")
            base = row + block * 18
            d = _f16_at(base, mask)
            low, high = _nibbles(base + 2, i, mask)
            return d * tl.load(grid_ptr + low), d * tl.load(grid_ptr + high)

    @triton.jit
    def halves_columns(block, i, QTYPE: tl.constexpr):
        """The columns of dequantize_halves' two runs of values."""
        if QTYPE == "Q8_0":
            return block * 32 + 2 * i, block * 32 + 2 * i + 1
        else:
            return block * 32 + i, block * 32 + i + 16

    @triton.jit
    def halves_tile(rows, start, limit, feat_ok, grid_ptr, dtype: tl.constexpr, QTYPE: tl.constexpr,
                    INTERPRETED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """weight_tile's tile for a type of HALVES, each 32-value block read as dequantize_halves' two runs of 16 (whole
        runs of quant bytes a load) and the runs put back in column order: the same values in the same places."""
        block = start // 32 + tl.arange(0, BLOCK_K // 32)[:, None, None]
        i = tl.arange(0, 16)[None, :, None]
        low, high = dequantize_halves(rows, block, i, (block < limit // 32) & feat_ok, grid_ptr, QTYPE)
        if QTYPE == "Q8_0":
            values = tl.permute(tl.join(low, high), (0, 1, 3, 2))    # [blocks, 16, 2, N]: column 2i + which
        else:
            values = tl.permute(tl.join(low, high), (0, 3, 1, 2))    # [blocks, 2, 16, N]: column 16 which + i
        return round_to(tl.reshape(values, [BLOCK_K, BLOCK_N]), dtype, INTERPRETED)

    @triton.jit
    def _half_of(bits):
        """float32 of the float16 in the low 16 bits of the uint32 `bits`."""
        return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _q4k_head(base, mask):
        """(d, dmin, the three little-endian words of the 12 scale bytes) of the Q4_K blocks at the 4-byte aligned
        byte pointers `base`."""
        head = base.to(tl.pointer_type(tl.uint32))
        ends = tl.load(head, mask=mask, other=0)
        return (_half_of(ends), _half_of(ends >> 16), tl.load(head + 1, mask=mask, other=0),
                tl.load(head + 2, mask=mask, other=0), tl.load(head + 3, mask=mask, other=0))

    @triton.jit
    def _k_scale_min_words(low, mid, high, j):
        """_k_scale_min's (scale, min) of sub-block j (an int32 tensor) from the scale bytes as three 32-bit words. The
        words' fields convert in one ALU instruction each (sm_90: I2FP), not through 16-bit values as the bytes'
        do, so the plain conversion stays (as in the forms bench/moe_rows_variants.py timed)."""
        shift = ((j & 3) * 8).to(tl.uint32)
        lo, mi, hi = (low >> shift) & 255, (mid >> shift) & 255, (high >> shift) & 255
        first = j < 4
        scale = tl.where(first, lo & 63, (hi & 15) | ((lo >> 6) << 4))
        minimum = tl.where(first, mi & 63, (hi >> 4) | ((mi >> 6) << 4))
        return scale.to(tl.float32), minimum.to(tl.float32)

    @triton.jit
    def q4k_quarter_tile(rows, block, c: tl.constexpr, feat_ok, dtype: tl.constexpr, INTERPRETED: tl.constexpr,
                         BLOCK_N: tl.constexpr):
        """weight_tile's [64, BLOCK_N] tile of Q4_K rows (`rows` [1, BLOCK_N] byte pointers, 4-byte aligned) at values
        256 block + 64c ..: its 32 quant bytes at the block's start plus constants (low nibbles its first 32 values,
        high the next), the block's scale fields as 32-bit words; each value dequantize_groups' bit for bit."""
        base = rows + block * 144
        d, dmin, low, mid, high = _q4k_head(base, feat_ok)
        j = tl.full([1, 1], 2 * c, tl.int32)                     # sub-blocks 2c and 2c + 1
        scale_lo, min_lo = _k_scale_min_words(low, mid, high, j)
        scale_hi, min_hi = _k_scale_min_words(low, mid, high, j + 1)
        quants = tl.load(base + 16 + c * 32 + tl.arange(0, 32)[:, None], mask=feat_ok, other=0).to(tl.int32)
        w_lo = (d * scale_lo) * (quants & 15).to(tl.float32) - dmin * min_lo
        w_hi = (d * scale_hi) * (quants >> 4).to(tl.float32) - dmin * min_hi
        values = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (2, 0, 1)), [64, BLOCK_N])
        return round_to(values, dtype, INTERPRETED)

    @triton.jit
    def q4k_block_halves(rows, at, lane, ok):
        """The float32 values of one Q4_K block of each of the rows `rows` [N] (byte pointers, 4-byte aligned; the
        block `at` bytes in), as two halves [N, 4, 32]: sub-blocks 0, 2, 4, 6 (each quant byte's low nibble) and 1, 3,
        5, 7 (its high one), the quant bytes as [4, 32] runs; `lane` is [1, 1, 32] 0..31. Each value
        dequantize_groups' bit for bit."""
        d, dmin, low, mid, high = _q4k_head(rows + at, ok)
        j = tl.arange(0, 4)[None, :] * 2
        scale_lo, min_lo = _k_scale_min_words(low[:, None], mid[:, None], high[:, None], j)
        scale_hi, min_hi = _k_scale_min_words(low[:, None], mid[:, None], high[:, None], j + 1)
        quants = tl.load(rows[:, None, None] + at + 16 + tl.arange(0, 4)[None, :, None] * 32 + lane,
                         mask=ok[:, None, None], other=0).to(tl.int32)
        d, dmin = d[:, None, None], dmin[:, None, None]
        w_lo = (d * scale_lo[:, :, None]) * (quants & 15).to(tl.float32) - dmin * min_lo[:, :, None]
        w_hi = (d * scale_hi[:, :, None]) * (quants >> 4).to(tl.float32) - dmin * min_hi[:, :, None]
        return w_lo, w_hi

    @triton.jit
    def split_q8_0_groups(row, quants_at, col, lane, mask):
        """Q8_0_R's float32 values of 32-value groups (dequantize_groups' arguments; `quants_at`: where a row's quants
        start, its values / 16): d x q, as Q8_0's."""
        scale = tl.load(row.to(tl.pointer_type(tl.float16)) + col // 32, mask=mask, other=0.0).to(tl.float32)
        quant = tl.load(row + quants_at + col + lane, mask=mask, other=0).to(tl.int8, bitcast=True)
        return scale * quant.to(tl.float32)

    @triton.jit
    def weight_tile(rows, start, limit, feat_ok, grid_ptr, dtype: tl.constexpr, QTYPE: tl.constexpr,
                    INTERPRETED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """The [BLOCK_K, BLOCK_N] tile of columns start..limit of BLOCK_N weight rows (`rows` [1, 1, BLOCK_N] byte
        pointers, `feat_ok` which exist), dequantized and rounded to `dtype`, laid out as tl.dot's right operand
        (the tensor-core products over blocks: moe_blocks.py, block_products.py)."""
        if QTYPE == "FP8_B128" and 128 % BLOCK_K == 0:
            return fp8_b128_words_tile(rows, start, feat_ok, dtype, INTERPRETED, BLOCK_K, BLOCK_N)
        col = start + (tl.arange(0, BLOCK_K // LANES) * LANES)[:, None, None]
        lane = tl.arange(0, LANES)[None, :, None]
        values = dequantize_groups(rows, col, lane, (col < limit) & feat_ok, grid_ptr, QTYPE)
        return round_to(tl.reshape(values, [BLOCK_K, BLOCK_N]), dtype, INTERPRETED)

    @triton.jit
    def fp8_b128_words(row, col, word, mask):
        """float32 values of FP8_B128 rows read as 32-bit words of four values: `row` each row's first byte (4-byte
        aligned, as _f32_at needs), `col` a group's first column (a multiple of 32: a group lies in one 128-value
        block), `word` 0..7 the word of the group, `mask` which (row, group) exist (all broadcastable: the scale is
        loaded once per row and group). Gives the broadcast shape plus a last axis of 4: columns col + 4 word + 0..3
        (a word's bytes, little-endian). A 132-byte block keeps its values 4-byte aligned, no wider. Each value is
        dequantize_groups', formed the same way."""
        base = row + (col // 128) * 132
        scale = tl.expand_dims(_f32_at(base, mask) * 256.0, -1)
        words = tl.load((base + 4 + col % 128).to(tl.pointer_type(tl.uint32)) + word, mask=mask, other=0)
        byte = (tl.expand_dims(words, -1) >> (tl.arange(0, 4) * 8).to(tl.uint32)) & 0xFF
        return scale * _e4m3_bits_over_256(byte)

    @triton.jit
    def fp8_b128_words_tile(rows, start, feat_ok, dtype: tl.constexpr, INTERPRETED: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """weight_tile's tile of FP8_B128 rows (`rows` [1, 1, BLOCK_N]; `start` a multiple of BLOCK_K, which divides
        128, below the rows' length, a multiple of 128: the tile lies whole in one block of each row, so only
        `feat_ok` masks it) as fp8_b128_words gives it, a load per four values, its words' bytes put back in column
        order."""
        word = tl.arange(0, BLOCK_K // 4)[:, None]
        values = fp8_b128_words(tl.reshape(rows, [1, BLOCK_N]), start, word, tl.reshape(feat_ok, [1, BLOCK_N]))
        values = tl.permute(values, (0, 2, 1))                      # [words, 4, BLOCK_N]: column 4 word + byte
        return round_to(tl.reshape(values, [BLOCK_K, BLOCK_N]), dtype, INTERPRETED)

    # Not specialized on the count of ids (one binary a type and row length); the row length and bytes are, as
    # their divisibility lets loads vectorize.
    @triton.jit(do_not_specialize=["n_ids"])
    def _gather_rows_kernel(blocks_ptr, ids_ptr, grid_ptr, out_ptr, n_ids, cols, row_bytes, quants_at,
                            INTERPRETED: tl.constexpr, QTYPE: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
        """out[i, cols of this program] = row ids[i] of the blocks, dequantized and rounded to out's dtype, for ROWS
        ids."""
        i = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None, None]
        row = tl.load(ids_ptr + i, mask=i < n_ids, other=0).to(tl.int64)
        col = tl.program_id(1) * GROUPS * LANES + (tl.arange(0, GROUPS) * LANES)[None, :, None]
        lane = tl.arange(0, LANES)[None, None, :]
        ok = (i < n_ids) & (col < cols)
        if QTYPE == "Q8_0_R":
            values = split_q8_0_groups(blocks_ptr + row * row_bytes, quants_at, col, lane, ok)
        elif QTYPE == "FP8_B128":
            word = tl.arange(0, LANES // 4)[None, None, :]
            values = tl.reshape(fp8_b128_words(blocks_ptr + row * row_bytes, col, word, ok), [ROWS, GROUPS, LANES])
        else:
            values = dequantize_groups(blocks_ptr + row * row_bytes, col, lane, ok, grid_ptr, QTYPE)
        tl.store(out_ptr + i * cols + col + lane, round_to(values, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)


# A gather program's tile: ROWS rows of GROUPS groups (1024 values; 128 columns divide the model's row lengths)
GATHER = dict(ROWS=8, GROUPS=4, num_warps=4)


def gather_rows(blocks: torch.Tensor, qtype: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape) of a [rows, row bytes] table of `qtype` blocks -> [*ids.shape, values] in `dtype` on
    ids' device: the torch form's `dequantize(blocks[ids]).to(dtype)`, bit for bit, in one launch. The blocks may be
    in pinned host memory, which the GPU reads in place (only the rows looked up cross the bus)."""
    per_block, size = LAYOUTS[qtype]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[-1] % size or not blocks.is_contiguous():
        raise ValueError(f"a {qtype} table is contiguous uint8 [rows, whole {size}-byte blocks], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    cols = blocks.shape[1] // size * per_block
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), cols, dtype=dtype, device=ids.device)
    if flat.numel():
        grid = (triton.cdiv(flat.numel(), GATHER["ROWS"]), triton.cdiv(cols, GATHER["GROUPS"] * GROUP))
        # Q8_0_R's quants start at cols / 16 bytes: an argument, so Triton sees its alignment (block_products).
        _gather_rows_kernel[grid](blocks, flat, grid_for(qtype, out), out, flat.numel(), cols, blocks.shape[1],
                                  cols // 16, INTERPRETED=interpreted(out), QTYPE=qtype, **GATHER)
    return out.reshape(*ids.shape, cols)


def dequantize_stack(stack) -> torch.Tensor:
    """A QuantizedStack's whole tensor in its dtype (as `stack.dequantize()` gives it, bit for bit), in one launch."""
    blocks = stack.blocks.reshape(-1, stack.blocks.shape[-1])
    every_row = _every_row(blocks.shape[0], blocks.device)
    return gather_rows(blocks, stack.qtype, every_row, stack.dtype).reshape(stack.shape)


_ROWS: dict[torch.device, torch.Tensor] = {}


def _every_row(rows: int, device: torch.device) -> torch.Tensor:
    """0..rows-1 on `device`: a view of one index tensor kept per device (grown when a longer one is asked), since
    a prompt chunk dequantizes every quantized projection it multiplies and a new index tensor each time was a
    launch of its own. Not kept when made under a CUDA graph capture, which records it but does not run it."""
    device = torch.device(device)
    have = _ROWS.get(device)
    if have is None or have.numel() < rows:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(rows, device=device)
        have = _ROWS[device] = torch.arange(rows, device=device)
    return have[:rows]


def dequantize_rows(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 rows [..., row bytes] of `qtype` -> float32 [..., values], in the kernels' in-register form (the tests
    hold it to the torch form bit for bit)."""
    flat = blocks.reshape(-1, blocks.shape[-1]).contiguous()
    out = gather_rows(flat, qtype, _every_row(flat.shape[0], blocks.device), torch.float32)
    return out.reshape(*blocks.shape[:-1], out.shape[-1])
