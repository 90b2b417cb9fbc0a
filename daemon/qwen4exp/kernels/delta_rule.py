"""The gated delta rule in Triton: our decode step for N sequences at once, updating the state in place, the same
token arithmetic looped over a short prompt chunk, and flash-linear-attention's kernels (when installed) for a
longer prompt chunk.

flash-linear-attention's recurrent kernel returns a new final state, so a decode step that must leave idle
rows untouched would read and write every row's float32 state (3 MB per row and layer on the shipped model)
three more times to blend old and new. This kernel reads and writes each active row's state once, in place,
and skips idle rows altogether. Same arithmetic as fla's recurrent kernel: q and k L2-normalised in float32,
q scaled by 1/sqrt(d_k), then per value column S <- exp(g) S; S <- S + k (beta (v - k^T S))^T; o = q^T S.
It also computes the gates from the raw projections (g = -exp(A_log) softplus(a + dt_bias) in float32,
beta = sigmoid(b) rounded to the model dtype, as `delta_rule.gates` does) and reads q, k and v in place from
the conv output, saving a decode step some ten small kernels per layer.
"""

from __future__ import annotations

import torch

from .guard import interpreted, tl, triton

try:  # flash-linear-attention: optional, GPU only.
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _fla_chunk = None

BLOCK_V = 32
# A prompt chunk of at most this many tokens runs token by token (chunk_tokens); longer ones through fla's
# chunked form. The loop's device time grows with the length and fla's barely does, but fla's call costs the host
# about as long as the loop's device time at this length (bench/gdn_chunk_bench.py, docs/PERFORMANCE.md).
TOKEN_LOOP_MAX = 512


def runs_token_loop(tokens: int) -> bool:
    """Whether a prompt chunk of `tokens` tokens runs `chunk_tokens` (on the Triton backend, with fla or not)."""
    return tokens <= TOKEN_LOOP_MAX


if triton is not None:

    from .rounding import rounded

    @triton.jit
    def _advance(s, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, out_ptr, head, cols,
                 scale: tl.constexpr, DK: tl.constexpr, INTERPRETED: tl.constexpr):
        """One token of one value head: the state block s [DK, BLOCK_V] (float32) after the token, and the
        output block stored at out_ptr + cols. q_ptr/k_ptr point at the token's key head, v_ptr at its value
        head, a_ptr/b_ptr at its raw gate projections."""
        dk = tl.arange(0, DK)
        q = tl.load(q_ptr + dk).to(tl.float32)
        k = tl.load(k_ptr + dk).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(v_ptr + cols).to(tl.float32)
        decay = tl.load(a_ptr).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        decay = tl.where(decay > 20.0, decay, tl.log(1.0 + tl.exp(decay)))      # softplus, as torch's threshold
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * decay
        beta = tl.sigmoid(tl.load(b_ptr).to(tl.float32))
        beta = rounded(beta, out_ptr.dtype.element_ty, INTERPRETED)
        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * delta[None, :]
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty))
        return s

    @triton.jit
    def _step_kernel(q_ptr, k_ptr, v_ptr, qkv_row_stride, a_ptr, b_ptr, gate_row_stride, a_log_ptr, dt_bias_ptr,
                     active_ptr, state_ptr, out_ptr, scale: tl.constexpr, K_HEADS: tl.constexpr,
                     V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, INTERPRETED: tl.constexpr,
                     BLOCK_V: tl.constexpr):
        """Grid (rows, value heads, DV / BLOCK_V): one token for each row's sequence."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        block = tl.program_id(2)
        cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
        dk = tl.arange(0, DK)
        out_row = out_ptr + (row * V_HEADS + head) * DV
        if tl.load(active_ptr + row) == 0:             # an idle row: its state stays, its output is zeros
            tl.store(out_row + cols, tl.zeros([BLOCK_V], out_ptr.dtype.element_ty))
            return
        k_head = head // (V_HEADS // K_HEADS)
        qkv_row = row * qkv_row_stride
        s_ptrs = state_ptr + ((row * V_HEADS + head) * DK + dk[:, None]).to(tl.int64) * DV + cols[None, :]
        s = _advance(tl.load(s_ptrs), q_ptr + qkv_row + k_head * DK, k_ptr + qkv_row + k_head * DK,
                     v_ptr + qkv_row + head * DV, a_ptr + row * gate_row_stride + head,
                     b_ptr + row * gate_row_stride + head, a_log_ptr, dt_bias_ptr, out_row, head, cols,
                     scale, DK, INTERPRETED)
        tl.store(s_ptrs, s)

    @triton.jit(do_not_specialize=["rows", "substeps"])     # one binary for every verify step's shape
    def _substeps_kernel(q_ptr, k_ptr, v_ptr, qkv_row_stride, a_ptr, b_ptr, gate_row_stride, a_log_ptr, dt_bias_ptr,
                         active_ptr, state_ptr, history_ptr, out_ptr, rows, substeps, scale: tl.constexpr,
                         K_HEADS: tl.constexpr, V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         INTERPRETED: tl.constexpr, BLOCK_V: tl.constexpr):
        """Grid (state rows, value heads, DV / BLOCK_V): a verify step's `substeps` tokens of each state row in
        order (sub-step j's inputs at row j * rows + row), each as _step_kernel computes it, the state block held
        in registers in between (float32, as _step_kernel stores and reloads it) and kept in history[j] after
        every sub-step but the last."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        block = tl.program_id(2)
        cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
        dk = tl.arange(0, DK)
        k_head = head // (V_HEADS // K_HEADS)
        offsets = ((row * V_HEADS + head) * DK + dk[:, None]).to(tl.int64) * DV + cols[None, :]
        plane = rows.to(tl.int64) * (V_HEADS * DK * DV)
        s = tl.load(state_ptr + offsets)
        advanced = 0
        for j in range(substeps):
            r = j * rows + row
            out_row = out_ptr + (r * V_HEADS + head) * DV
            if tl.load(active_ptr + r) != 0:
                advanced += 1
                qkv_row = r * qkv_row_stride
                s = _advance(s, q_ptr + qkv_row + k_head * DK, k_ptr + qkv_row + k_head * DK,
                             v_ptr + qkv_row + head * DV, a_ptr + r * gate_row_stride + head,
                             b_ptr + r * gate_row_stride + head, a_log_ptr, dt_bias_ptr, out_row, head, cols,
                             scale, DK, INTERPRETED)
            else:                                      # idle in this sub-step: the state stays, the output is zeros
                tl.store(out_row + cols, tl.zeros([BLOCK_V], out_ptr.dtype.element_ty))
            if j < substeps - 1:
                tl.store(history_ptr + j * plane + offsets, s)
        # A row idle in every sub-step is not written, as _step_kernel leaves an idle row.
        if advanced > 0:
            tl.store(state_ptr + offsets, s)

    @triton.jit(do_not_specialize=["tokens"])   # one binary for every chunk length (engine/warm_up.py)
    def _tokens_kernel(q_ptr, k_ptr, v_ptr, qkv_row_stride, a_ptr, b_ptr, gate_row_stride, a_log_ptr,
                       dt_bias_ptr, state_ptr, out_ptr, tokens, scale: tl.constexpr, K_HEADS: tl.constexpr,
                       V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, INTERPRETED: tl.constexpr,
                       BLOCK_V: tl.constexpr):
        """Grid (value heads, DV / BLOCK_V): `tokens` tokens of one sequence in order, each as a decode step
        computes it, with the state block held in registers from the first token to the last."""
        head = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
        dk = tl.arange(0, DK)
        k_head = head // (V_HEADS // K_HEADS)
        s_ptrs = state_ptr + (head * DK + dk[:, None]).to(tl.int64) * DV + cols[None, :]
        s = tl.load(s_ptrs)
        for t in range(tokens):
            qkv_row = t * qkv_row_stride
            s = _advance(s, q_ptr + qkv_row + k_head * DK, k_ptr + qkv_row + k_head * DK,
                         v_ptr + qkv_row + head * DV, a_ptr + t * gate_row_stride + head,
                         b_ptr + t * gate_row_stride + head, a_log_ptr, dt_bias_ptr,
                         out_ptr + (t * V_HEADS + head) * DV, head, cols, scale, DK, INTERPRETED)
        tl.store(s_ptrs, s)


def _laid_out(x: torch.Tensor, row_stride: int, head_dim: int) -> bool:
    """Whether x [N, H, d] has strides (row_stride, d, 1); a dimension of size 1 may have any stride (a lone row's
    view often does), since only index 0 is read there."""
    wanted = (row_stride, head_dim, 1)
    return all(size == 1 or stride == want for size, stride, want in zip(x.shape, x.stride(), wanted))


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Checks the layouts both kernels read; returns a and b as they read them and the value block width."""
    dk, dv = q.shape[2], v.shape[2]
    block_v = min(BLOCK_V, dv)
    if dv % block_v or block_v & (block_v - 1) or dk & (dk - 1) or not state.is_contiguous():
        raise ValueError(f"unsupported shapes for the delta-rule kernels: dk {dk}, dv {dv}")
    row_stride = q.stride(0)
    if not (_laid_out(q, row_stride, dk) and _laid_out(k, row_stride, dk) and _laid_out(v, row_stride, dv)):
        raise ValueError("q, k and v must share one row stride, with heads contiguous inside a row")
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    return a, b, block_v


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                a_log: torch.Tensor, dt_bias: torch.Tensor, active: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """q,k [N, Hk, dk], v [N, Hv, dv] (views of one [N, C] conv output row are fine), the raw gate projections
    a/b [N, Hv] (views of one projection's rows are fine too), the per-head A_log and dt_bias [Hv], active [N]
    bool or uint8, state [N, Hv, dk, dv] float32
    (advanced in place for active rows). Returns o [N, Hv, dv] in v's dtype (zeros for idle rows)."""
    rows, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    a, b, block_v = _shapes(q, k, v, a, b, state)
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    _step_kernel[(rows, v_heads, dv // block_v)](
        q, k, v, q.stride(0), a, b, a.stride(0), a_log, dt_bias, active.to(torch.uint8), state, out,
        dk ** -0.5, K_HEADS=k_heads, V_HEADS=v_heads, DK=dk, DV=dv, INTERPRETED=interpreted(v), BLOCK_V=block_v,
        num_warps=4)
    return out


def verify_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 a_log: torch.Tensor, dt_bias: torch.Tensor, active: torch.Tensor, state: torch.Tensor,
                 history: torch.Tensor, substeps: int) -> torch.Tensor:
    """A verify step's `substeps` decode steps in one launch: inputs as `decode_step` takes them over substeps * N
    rows, position-major (sub-step j's rows [j*N, (j+1)*N), row j*N + i of state row i), active [substeps * N],
    state [N, Hv, dk, dv] float32 (advanced in place through every sub-step), history [>= substeps - 1, N, Hv, dk,
    dv] (the state after each sub-step but the last). Each row's output is what `decode_step` gives it, sub-step
    after sub-step; the state is read once and written once, where plain steps would read and write it per
    sub-step and copy it to the history."""
    total, k_heads, dk = q.shape
    rows = total // substeps
    v_heads, dv = v.shape[1], v.shape[2]
    a, b, block_v = _shapes(q, k, v, a, b, state)
    if rows * substeps != total or state.shape[0] != rows or history.shape[0] < substeps - 1 \
            or history.shape[1:] != state.shape or not history.is_contiguous():
        raise ValueError(f"a verify step of {substeps} sub-steps over {total} rows does not fit a state of "
                         f"{tuple(state.shape)} and a history of {tuple(history.shape)}")
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    _substeps_kernel[(rows, v_heads, dv // block_v)](
        q, k, v, q.stride(0), a, b, a.stride(0), a_log, dt_bias, active.to(torch.uint8), state, history, out, rows,
        substeps, dk ** -0.5, K_HEADS=k_heads, V_HEADS=v_heads, DK=dk, DV=dv, INTERPRETED=interpreted(v),
        BLOCK_V=block_v, num_warps=4)
    return out


def chunk_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A short prompt chunk of one sequence, token after token, each token's arithmetic the decode step's:
    q,k [n, Hk, dk], v [n, Hv, dv], a/b [n, Hv] laid out as `decode_step` takes them, state [Hv, dk, dv] float32
    (advanced in place). Returns o [n, Hv, dv] in v's dtype. One launch and no gate kernels: a short chunk's
    host time is what bounds it (fla's chunk function costs the host about what the loop costs the device at
    TOKEN_LOOP_MAX tokens, and more below), and the state is read and written once."""
    tokens, k_heads, dk = q.shape
    v_heads, dv = v.shape[1], v.shape[2]
    a, b, block_v = _shapes(q, k, v, a, b, state[None])
    if tokens * max(q.stride(0), v_heads * dv, a.stride(0)) >= 2 ** 31:
        raise ValueError(f"a chunk of {tokens} tokens is too long for the token loop (32-bit offsets)")
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    _tokens_kernel[(v_heads, dv // block_v)](
        q, k, v, q.stride(0), a, b, a.stride(0), a_log, dt_bias, state, out, tokens,
        dk ** -0.5, K_HEADS=k_heads, V_HEADS=v_heads, DK=dk, DV=dv, INTERPRETED=interpreted(v), BLOCK_V=block_v,
        num_warps=4)
    return out


def fla_available() -> bool:
    return _fla_chunk is not None


def fla_chunk(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One sequence's new tokens through fla's chunked form (same contract as
    engine/model/delta_rule.gated_delta_rule; fla maps value head h to key head h // (Hv / Hk) itself)."""
    out, final = _fla_chunk(q[None], k[None], v[None], g=g[None].float(), beta=beta[None],
                            initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.copy_(final[0])
    return out[0]
