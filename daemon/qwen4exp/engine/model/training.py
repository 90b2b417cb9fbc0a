"""A differentiable full-sequence forward of qwen4_exp, for training small models on a CPU.

`Qwen4ExpForCausalLM.forward` runs under `torch.inference_mode` and caches its RoPE table there, so neither can
carry gradients. Here every row of a batch gets a fresh `SequenceState`, fresh cos/sin tables and a prompt-chunk
step on the torch ops (the kernels have no backward), and the model's own `run` and layer modules run with autograd
on: the training forward is the serving forward, nothing is re-implemented. What the serving forward does not
compute is added beside it, through forward hooks:

- the MTP head (`mtp_logits`): at position t it fuses the main model's pre-mixer streams at t with the embedding
  of token t+1, runs its QSA + MoE layer and its own stream mixer, and predicts token t+2 with the shared LM head;
- the QSA indexer's loss (`indexer_loss`): token selection is a hard top-k, so the main loss never reaches the
  indexer. As in DeepSeek's sparse attention, the indexer learns to match, per query, the main attention's mass
  over the visible key blocks (a KL divergence; the indexer's input is detached, so this loss trains only the
  indexer);
- the MoE load-balancing loss (`balance_loss`, Switch Transformer style: E * sum_e f_e * P_e).

The MTP head's forward is the serving one (mtp.py: `MTPHead.fuse` and its layer), over a fresh attention cache per
sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..state import AttentionState, SequenceState
from .causal_lm import Qwen4ExpForCausalLM
from .moe import Router
from .mtp import HeadState
from .ops import TORCH_OPS
from .qsa import QSAAttention
from .rope import apply_rotary
from .step import Step


@dataclass
class TrainingOutput:
    logits: torch.Tensor                       # [B, T, V]: token t+1 from tokens <= t
    mtp_logits: torch.Tensor | None = None     # [B, T-1, V]: token t+2 from streams at t and token t+1
    indexer_loss: torch.Tensor | None = None   # mean KL over QSA layers (0 when no query is sparse)
    balance_loss: torch.Tensor | None = None   # mean over MoE layers, 1.0 when perfectly balanced
    extras: dict[str, float] = field(default_factory=dict)


def _rope(model: Qwen4ExpForCausalLM, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh cos/sin for positions 0..length-1 (the model's cached table is an inference tensor)."""
    return model.rotary.cos_sin(torch.arange(length, device=device), model.lm_head.weight.dtype)


def _steps(model: Qwen4ExpForCausalLM, ids: torch.Tensor, states) -> list[Step]:
    """One prompt-chunk step per sequence of ids [B, T], from position 0 of its state, on the torch ops."""
    rope = _rope(model, ids.shape[1], ids.device)
    return [Step.chunk(TORCH_OPS, ids[b], states[b], rope) for b in range(ids.shape[0])]


def training_logits(model: Qwen4ExpForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of every position of B sequences of T tokens, each starting from an empty state,
    differentiable (under the caller's grad mode; no inference tensors are involved). Equal to the serving
    forward's logits for the same tokens."""
    return training_forward(model, input_ids, mtp=False, aux=False).logits


def training_forward(model: Qwen4ExpForCausalLM, input_ids: torch.Tensor, mtp: bool = True,
                     aux: bool = True) -> TrainingOutput:
    """The main logits, plus (mtp) the MTP head's logits and (aux) the indexer and load-balancing losses."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
    batch, length = input_ids.shape
    device = model.lm_head.weight.device
    ids = input_ids.to(device)
    states = [SequenceState(model.config, length, device, model.lm_head.weight.dtype) for _ in range(batch)]
    steps = _steps(model, ids, states)

    qsa_calls: list[tuple[QSAAttention, torch.Tensor, Step, AttentionState]] = []
    router_calls: list[tuple[Router, torch.Tensor, torch.Tensor]] = []
    hooks = []
    if aux:
        for module in model.modules():
            if isinstance(module, QSAAttention):
                hooks.append(module.register_forward_hook(
                    lambda m, a, out: qsa_calls.append((m, a[0], a[1], a[2]))))
            elif isinstance(module, Router):
                hooks.append(module.register_forward_hook(
                    lambda m, a, out: router_calls.append((m, a[0], out[0]))))
    try:
        hidden, streams = zip(*[model.run(step) for step in steps])
        out = TrainingOutput(logits=model.lm_head(torch.stack(hidden)))
        if mtp and model.mtp is not None and length > 1:
            out.mtp_logits = mtp_logits(model, torch.cat(streams), ids)
    finally:
        for hook in hooks:
            hook.remove()
    if aux:
        out.indexer_loss = _mean([indexer_loss(m, x, step.start, step.cos_table, step.sin_table, state)
                                  for m, x, step, state in qsa_calls], device)
        # One loss per MoE layer over the whole batch (each sequence runs its own step, so a router is called
        # once per sequence): the routed shares and mean probabilities are the batch's, not a mean of each row's.
        batch_calls: dict[Router, tuple[list, list]] = {}
        for m, x, chosen in router_calls:
            inputs, choices = batch_calls.setdefault(m, ([], []))
            inputs.append(x)
            choices.append(chosen)
        out.balance_loss = _mean([balance_loss(m, torch.cat(xs), torch.cat(chosen))
                                  for m, (xs, chosen) in batch_calls.items()], device)
    return out


def _mean(values: list[torch.Tensor], device) -> torch.Tensor:
    return torch.stack(values).mean() if values else torch.zeros((), device=device)


def mtp_logits(model: Qwen4ExpForCausalLM, streams: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MTP logits [B, T-1, V]: row t predicts token t+2 from the main streams at t [B*T, hc*H] and token t+1."""
    head, cfg = model.mtp, model.config
    batch, length = ids.shape
    streams = streams.view(batch, length, -1)[:, :-1]
    embedded = model.model.embed_tokens(ids[:, 1:])
    n = length - 1
    outs = []
    for b in range(batch):
        view = HeadState([_attention_state(cfg, n, ids.device, model.lm_head.weight.dtype)], n)
        step = _steps(model, ids[b:b + 1, 1:], [view])[0]
        outs.append(head(head.fuse(streams[b], embedded[b], step), step)[0])
    return model.lm_head(torch.stack(outs))


def _attention_state(cfg, capacity: int, device, dtype) -> AttentionState:
    """An empty QSA cache, as SequenceState allocates for its attention layers."""
    return AttentionState(
        keys=torch.zeros(cfg.num_key_value_heads, capacity, cfg.head_dim, device=device, dtype=dtype),
        values=torch.zeros(cfg.num_key_value_heads, capacity, cfg.head_dim, device=device, dtype=dtype),
        index_keys=torch.zeros(capacity, cfg.indexer_head_dim, device=device, dtype=dtype),
        block_keys=torch.zeros(-(-capacity // cfg.indexer_compress_ratio), cfg.indexer_head_dim, device=device,
                               dtype=dtype),
    )


def indexer_loss(attn: QSAAttention, x: torch.Tensor, start: int, cos_all: torch.Tensor, sin_all: torch.Tensor,
                 state: AttentionState) -> torch.Tensor:
    """KL(main attention's block mass || indexer's block distribution), over the queries that choose blocks.

    The target comes from the layer's own q/k (detached, dense causal attention, averaged over heads), summed
    over each complete key block that the query sees; the indexer's scores are recomputed from the detached
    input the way `Indexer.select_mask` does, so gradients reach only the indexer."""
    idx = attn.indexer
    n, end = x.shape[0], start + x.shape[0]
    ratio, topk = idx.ratio, idx.block_topk
    positions = torch.arange(start, end, device=x.device)
    complete = (positions + 1) // ratio
    rows = complete > topk                       # queries with more visible blocks than they keep
    n_blocks = end // ratio
    if not bool(rows.any()):
        return x.new_zeros(())
    x = x.detach()
    cos, sin = cos_all[start:end], sin_all[start:end]
    with torch.no_grad():
        q, _ = attn.q_proj(x).view(n, attn.heads, 2 * attn.head_dim).chunk(2, dim=-1)
        q = apply_rotary(attn.q_norm(q), cos, sin)
        groups = attn.heads // attn.kv_heads
        keys = state.keys[:, :end].detach().repeat_interleave(groups, dim=0)
        scores = torch.einsum("nhd,htd->hnt", q, keys) * attn.head_dim ** -0.5
        causal = torch.arange(end, device=x.device)[None, :] <= positions[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).mean(0)   # [n, end]
        mass = probs[:, :n_blocks * ratio].reshape(n, n_blocks, ratio).sum(-1)
        visible = torch.arange(n_blocks, device=x.device)[None, :] < complete[:, None]
        mass = mass.masked_fill(~visible, 0.0)
        target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-9)
    iq, raw_keys = idx.index_qk_proj(x).split([idx.heads * idx.dim, idx.dim], dim=-1)
    iq = apply_rotary(idx.q_layernorm(iq.reshape(n, idx.heads, idx.dim)), cos, sin)
    # Block keys from this chunk's raw keys (training chunks start at 0, so they are all the blocks).
    pooled = idx.k_layernorm(raw_keys[:n_blocks * ratio].reshape(n_blocks, ratio, idx.dim).mean(1))
    block_starts = torch.arange(n_blocks, device=x.device) * ratio
    blocks = apply_rotary(pooled, cos_all[block_starts], sin_all[block_starts])
    logits = torch.relu(torch.einsum("nhd,bd->nbh", iq, blocks)).sum(-1) / math.sqrt(idx.dim)
    log_p = torch.log_softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-9)) - log_p.masked_fill(~visible, 0.0))).sum(-1)
    return kl[rows].mean()


def balance_loss(router: Router, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch-style auxiliary loss: num_experts * sum_e (share of routed slots to e) * (mean router prob of e)."""
    experts = router.weight.shape[0]
    probs = torch.softmax(F.linear(x, router.weight), dim=-1, dtype=torch.float32)
    share = torch.bincount(chosen.reshape(-1), minlength=experts).float() / chosen.numel()
    return experts * (share * probs.mean(0)).sum()
