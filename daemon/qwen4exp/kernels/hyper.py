"""Fused hyper-connection and RMSNorm kernels in Triton (CUDA and ROCm) for bfloat16/float16 models.

The residual is hc streams wide (4 x 2560 on the shipped model), and every sublayer reads a learned mix of
the streams and writes back into each of them. In torch that is some twenty element-wise and reduction
kernels per sublayer, most of them float32 round trips over the whole [T, hc*H] residual; in a decode step
they were most of its ~850 kernels. Two kernels replace them:

* `norm_rows`: x -> RMSNorm(x) * (1 + w), one group of `group` channels at a time, optionally after adding
  a term to x (PLE's) or injecting a sublayer output into every stream with its gate; it writes the new x
  too. With one group per row it is every other zero-centred RMSNorm of the model (q/k norms).
* `mix_streams`: the low-rank mixing weights' up-projection on the tensor cores with the sigmoid, the
  weighting of the normed streams and their mean in its epilogue, so the [T, hc*H] weights never exist;
  and the injection gates. For a decode step's few rows, each stream's term is a program of its own and the
  last of a tile's programs takes the mean (rounding.finish_parts).

Numerics follow torch's bf16 ops: sums and products in float32, rounded to the model dtype wherever torch
would hand a bf16 tensor to the next op (the up-projection's output, the sigmoid, each weighted stream, the
injected product and sum). Only the order inside each float32 sum differs. Block shapes depend on the row
count alone, and no row reads another's values, so a row's result does not depend on its neighbours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .guard import interpreted, tl, triton
from .rounding import part_counts

# Decode steps have a few rows, so few programs that they left most SMs idle: each (feature block, stream)
# pair is a program of its own and the tile's last program adds the streams' rounded terms in order (the same
# float32 sum). bench/hyper_kernels_bench.py on an H200, 4 rows, weights not in L2: 10.4 us; 32-wide features 12.5 us
# (14.5 with 128-wide rank steps); one program per feature block for all streams (the former default) 16.7 us,
# pipelined 64-wide rank steps 22.8 us.
FEW_ROWS = 64
MIX_FEW = {"BLOCK_T": 16, "BLOCK_H": 64, "BLOCK_K": 64, "NUM_STAGES": 3, "ACT_READY": False, "SPLIT_STREAMS": True,
           "num_warps": 4}
# Many rows (bench/hyper_kernels_bench.py on an H200, 4096 rows): 195 us; 128-row tiles 206 us, unpipelined
# 243 us, silu recomputed per stream 418 us, 128-wide features 533 us.
MIX_MANY = {"BLOCK_T": 64, "BLOCK_H": 64, "BLOCK_K": 64, "NUM_STAGES": 3, "ACT_READY": True, "num_warps": 4}
# A short prompt chunk is bound by the host's launches, not by its kernels (docs/PERFORMANCE.md): up to SHORT_ROWS
# rows each program computes silu(down / hc) itself, which saves torch's two launches a mix.
SHORT_ROWS = 256
MIX_SHORT = dict(MIX_MANY, ACT_READY=False)


def mix_fits(hc: int, low_rank: int) -> bool:
    """Whether `mix_streams` takes these sizes: a power-of-two stream count and a rank of at least tl.dot's 16."""
    return hc & (hc - 1) == 0 and low_rank >= 16


if triton is not None:
    from .rounding import finish_parts, round_to, rounded

    @triton.jit
    def _norm_kernel(x_ptr, add_ptr, out_ptr, gates_ptr, weight_ptr, new_x_ptr, normed_ptr, eps: tl.constexpr,
                     GROUP: tl.constexpr, GROUPS: tl.constexpr, MODE: tl.constexpr, INTERPRETED: tl.constexpr,
                     BLOCK: tl.constexpr):
        """One (row, group): MODE 0 norms x; 1 adds add[row] first; 2 adds out[row] * gate[row, group]."""
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        ok = cols < GROUP
        offset = row * (GROUPS * GROUP) + group * GROUP + cols
        dtype = normed_ptr.dtype.element_ty
        x = tl.load(x_ptr + offset, mask=ok, other=0.0).to(tl.float32)
        if MODE == 1:
            x = rounded(x + tl.load(add_ptr + offset, mask=ok, other=0.0).to(tl.float32), dtype, INTERPRETED)
        if MODE == 2:
            out = tl.load(out_ptr + row * GROUP + cols, mask=ok, other=0.0).to(tl.float32)
            gate = tl.load(gates_ptr + row * GROUPS + group).to(tl.float32)
            x = rounded(x + rounded(out * gate, dtype, INTERPRETED), dtype, INTERPRETED)
        if MODE != 0:
            tl.store(new_x_ptr + offset, round_to(x, dtype, INTERPRETED), mask=ok)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / GROUP + eps)
        weight = tl.load(weight_ptr + group * GROUP + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(normed_ptr + offset, round_to(x * scale * (1.0 + weight), dtype, INTERPRETED), mask=ok)

    @triton.jit
    def _stream_product(low_ptr, low_stride, up_ptr, normed_ptr, j, t64, t_ok, h, h_ok, ks, dtype: tl.constexpr,
                        H: tl.constexpr, HC: tl.constexpr, R: tl.constexpr, ACT_READY: tl.constexpr,
                        INTERPRETED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
        """Stream j's term of a [BLOCK_T, BLOCK_H] tile: sigmoid(act . up[j*H + h]) * normed[t, j*H + h], rounded
        as torch rounds it (float32 values)."""
        logits = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for start in tl.range(0, R, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = ks < R - start
            act = tl.load(low_ptr + t64[:, None] * low_stride + start + ks[None, :],
                          mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            if not ACT_READY:
                low = rounded(act.to(tl.float32) / HC, dtype, INTERPRETED)
                act = round_to(low / (1.0 + tl.exp(-low)), dtype, INTERPRETED)
            w = tl.load(up_ptr + (j * H + h[None, :]).to(tl.int64) * R + start + ks[:, None],
                        mask=k_ok[:, None] & h_ok[None, :], other=0.0)
            if INTERPRETED:
                act, w = act.to(tl.float32), w.to(tl.float32)
            logits = tl.dot(act, w, logits)
        weight = rounded(tl.sigmoid(rounded(logits, dtype, INTERPRETED)), dtype, INTERPRETED)
        normed = tl.load(normed_ptr + t64[:, None] * (HC * H) + j * H + h[None, :],
                         mask=t_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        return rounded(weight * normed, dtype, INTERPRETED)

    # Not specialized on the row count: a prompt of any length runs the binary a start-up chunk built.
    @triton.jit(do_not_specialize=["rows"])
    def _mix_kernel(low_ptr, low_stride, up_ptr, normed_ptr, mixed_ptr, parts_ptr, counts_ptr, inject_ptr,
                    inject_stride, gates_ptr, rows, H: tl.constexpr, HC: tl.constexpr, R: tl.constexpr,
                    ACT_READY: tl.constexpr, HAS_GATES: tl.constexpr, SPLIT_STREAMS: tl.constexpr,
                    INTERPRETED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
        """mixed[t, h] = mean_j sigmoid(act[t] . up[j*H + h]) * normed[t, j*H + h] for a [BLOCK_T, BLOCK_H]
        tile, act = silu(down / HC) (given as low with ACT_READY, else computed here from the down projection
        in low). With SPLIT_STREAMS, program_id(2) is one stream j, whose rounded term goes to parts[j], and the
        tile's last program adds them (rounding.finish_parts: the same float32 sum in the same order). The first
        feature block also writes gates = 2 sigmoid(inject / HC)."""
        block_t = tl.program_id(0)
        block_h = tl.program_id(1)
        dtype = mixed_ptr.dtype.element_ty
        t = block_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < rows
        t64 = t.to(tl.int64)
        h = block_h * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < H
        ks = tl.arange(0, BLOCK_K)
        ok = t_ok[:, None] & h_ok[None, :]
        first = block_h == 0
        if SPLIT_STREAMS:
            j = tl.program_id(2)
            first = first & (j == 0)
            term = _stream_product(low_ptr, low_stride, up_ptr, normed_ptr, j, t64, t_ok, h, h_ok, ks, dtype, H, HC,
                                   R, ACT_READY, INTERPRETED, BLOCK_T, BLOCK_H, BLOCK_K, NUM_STAGES)
            finish_parts(round_to(term, dtype, INTERPRETED), mixed_ptr, parts_ptr, counts_ptr,
                         t64[:, None] * H + h[None, :], ok, block_t * tl.num_programs(1) + block_h, j, rows * H, HC,
                         HC, INTERPRETED)
        else:
            acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for j in tl.static_range(HC):
                acc += _stream_product(low_ptr, low_stride, up_ptr, normed_ptr, j, t64, t_ok, h, h_ok, ks, dtype, H,
                                       HC, R, ACT_READY, INTERPRETED, BLOCK_T, BLOCK_H, BLOCK_K, NUM_STAGES)
            tl.store(mixed_ptr + t64[:, None] * H + h[None, :], round_to(acc / HC, dtype, INTERPRETED), mask=ok)
        if HAS_GATES and first:
            js = tl.arange(0, HC)
            z = tl.load(inject_ptr + t64[:, None] * inject_stride + js[None, :], mask=t_ok[:, None], other=0.0)
            z = rounded(z.to(tl.float32) / HC, dtype, INTERPRETED)
            gates = 2.0 * rounded(tl.sigmoid(z), dtype, INTERPRETED)
            tl.store(gates_ptr + t64[:, None] * HC + js[None, :], round_to(gates, dtype, INTERPRETED),
                     mask=t_ok[:, None])


def norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int, add: torch.Tensor | None = None,
              inject: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., G*group] -> (new x, zero-centred RMSNorm of new x per group). New x is x + add, or x + out * gate
    per group for inject = (out [..., group], gates [..., G]), or x itself when neither is given."""
    width = x.shape[-1]
    if width % group or weight.numel() != width:
        raise ValueError(f"norm width {width} is not whole groups of {group} or does not match weight")
    flat = x.reshape(-1, width).contiguous()
    rows, groups = flat.shape[0], width // group
    normed = torch.empty_like(flat)
    mode, add_t, out_t, gates_t, new_x = 0, flat, flat, flat, flat
    if add is not None:
        mode, add_t, new_x = 1, add.reshape(-1, width).contiguous(), torch.empty_like(flat)
    elif inject is not None:
        out, gates = inject
        mode, new_x = 2, torch.empty_like(flat)
        out_t, gates_t = out.reshape(rows, group).contiguous(), gates.reshape(rows, groups).contiguous()
    if rows:
        block = triton.next_power_of_2(group)
        _norm_kernel[(rows, groups)](flat, add_t, out_t, gates_t, weight, new_x, normed, eps, GROUP=group,
                                     GROUPS=groups, MODE=mode, INTERPRETED=interpreted(x), BLOCK=block,
                                     num_warps=max(1, min(8, block // 256)))
    return new_x.view(x.shape), normed.view(x.shape)


def mix_streams(down: torch.Tensor, up_weight: torch.Tensor, normed: torch.Tensor, hc: int,
                inject: torch.Tensor | None, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """down [T, R] (the low-rank projection of the normed streams), up_weight [hc*H, R], normed [T, hc*H],
    inject [T, hc] or None -> (mixed [T, H], gates [T, hc] or None). `config` overrides the block shapes
    (bench/hyper_kernels_bench.py compares them)."""
    rows, low_rank = down.shape
    hidden = normed.shape[-1] // hc
    if up_weight.shape != (hc * hidden, low_rank) or normed.shape[0] != rows or low_rank < 16 or hc & (hc - 1):
        raise ValueError(f"hyper-connection shapes do not fit: down {tuple(down.shape)}, up "
                         f"{tuple(up_weight.shape)}, normed {tuple(normed.shape)}, {hc} streams")
    mixed = torch.empty(rows, hidden, device=normed.device, dtype=normed.dtype)
    gates = torch.empty(rows, hc, device=normed.device, dtype=normed.dtype) if inject is not None else None
    config = dict(config or (MIX_FEW if rows <= FEW_ROWS else MIX_SHORT if rows <= SHORT_ROWS else MIX_MANY))
    act_ready = config.pop("ACT_READY")
    split = config.pop("SPLIT_STREAMS", False)
    config["BLOCK_K"] = min(config["BLOCK_K"], max(16, triton.next_power_of_2(low_rank)))
    config["BLOCK_H"] = min(config["BLOCK_H"], max(16, triton.next_power_of_2(hidden)))
    # Many rows: silu(down / hc) once, in torch's own ops, instead of once per stream in every program.
    low = F.silu(down / hc) if act_ready else down
    low = low if low.stride(-1) == 1 else low.contiguous()
    inject = inject if inject is None or inject.stride(-1) == 1 else inject.contiguous()
    if rows:
        parts = torch.empty(hc, rows, hidden, device=normed.device, dtype=normed.dtype) if split else mixed
        grid = (triton.cdiv(rows, config["BLOCK_T"]), triton.cdiv(hidden, config["BLOCK_H"]), hc if split else 1)
        counts = part_counts(normed.device, (grid[0] * grid[1], grid[2]))
        _mix_kernel[grid](low, low.stride(0), up_weight, normed.contiguous(), mixed, parts, counts,
                          inject if inject is not None else mixed, inject.stride(0) if inject is not None else 0,
                          gates if gates is not None else mixed, rows, H=hidden, HC=hc, R=low_rank,
                          ACT_READY=act_ready, HAS_GATES=inject is not None, SPLIT_STREAMS=split,
                          INTERPRETED=interpreted(normed), **config)
    return mixed, gates
