"""The gated delta rule in torch, in float32: a chunked form for prompts and a per-token recurrence for decode.

Per value head, with q and k L2-normalised and q scaled by 1/sqrt(d_k), each token t does
    S <- exp(g_t) * S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
The chunked form processes C tokens at once: inside a chunk the updates are folded into a unit lower
triangular system (the WY form), and the state is carried from chunk to chunk.
The reference for the kernels (kernels/delta_rule.py for decode and for bfloat16/float16 prompt chunks of up to
TOKEN_LOOP_MAX tokens; flash-linear-attention's chunk kernel, when installed, for longer ones). float32 models
keep these forms on GPUs too: fla's chunk kernel rounds its dot products through TF32 (about 1e-3 relative error
on H200), which would make float32 results depend on how a prompt is chunked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64

def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(q, k, v, g, beta):
    """[n, H, d] inputs -> float32 [H, n, d] with q/k normalised, q scaled, k heads expanded to v heads."""
    groups = v.shape[1] // k.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(0, 1).float(), beta.transpose(0, 1).float()


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Token by token. q,k [n, Hk, dk], v [n, Hv, dv], g/beta [n, Hv]; state [Hv, dk, dv] float32,
    updated in place. Returns o [n, Hv, dv] in v's dtype."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.clone()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[:, t], s)
        delta = (v[:, t] - predicted) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[:, t], s))
    state.copy_(s)
    return torch.stack(outs, dim=0).to(out_dtype)


def chunked_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Same contract as recurrent_gated_delta_rule, C tokens at a time."""
    out_dtype = v.dtype
    n = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, total, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.reshape(heads, total // chunk, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(heads, -1, chunk), beta.reshape(heads, -1, chunk)

    decay = g.cumsum(dim=-1)                                   # log decay from chunk start, inclusive
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    # Unit lower triangular system (I + A) with A[i, j] = beta_i k_i.k_j exp(decay_i - decay_j), j < i.
    system = (kb @ k.transpose(-1, -2)) * pair
    system = system.masked_fill(~causal.tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    corrected_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, kb * decay.exp()[..., None], upper=False,
                                               unitriangular=True)
    local_attn = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()

    s = state.clone()
    out = torch.empty(heads, total // chunk, chunk, dv, device=q.device, dtype=torch.float32)
    for c in range(total // chunk):
        new_v = corrected_v[:, c] - state_keys[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + local_attn[:, c] @ new_v
        s = s * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ new_v
    state.copy_(s)
    return out.reshape(heads, total, dv)[:, :n].transpose(0, 1).to(out_dtype)


def gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One sequence's new tokens: the recurrence for one token, the chunked form for more."""
    if q.shape[0] == 1:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state)
    return chunked_gated_delta_rule(q, k, v, g, beta, state)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay's log g (float32) and the write strength beta from the raw projections a and b [..., Hv]."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


def gated_delta_rule_rows(q, k, v, a, b, a_log, dt_bias, active: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token for each of N sequences at once: q,k [N, Hk, dk], v [N, Hv, dv], the raw gate projections
    a/b [N, Hv] (see `gates`), active [N] bool or uint8, state [N, Hv, dk, dv] float32, advanced in place for the
    active rows only. Returns o [N, Hv, dv]. Fixed shapes and no host synchronisation, so a decode step can be
    captured in a CUDA graph."""
    g, beta = gates(a, b, a_log, dt_bias)
    groups = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(groups, dim=1).float(), k.repeat_interleave(groups, dim=1).float()
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    s = state * g.float().exp()[..., None, None]
    predicted = torch.einsum("nhk,nhkv->nhv", k, s)
    delta = (v.float() - predicted) * beta.float()[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    state.copy_(torch.where(active.bool()[:, None, None, None], s, state))
    return torch.einsum("nhk,nhkv->nhv", q, s).to(v.dtype)
