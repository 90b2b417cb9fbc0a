"""Choosing the next token from logits: greedy, or seeded sampling, with penalties.

Sampling runs in float32 on the CPU with the request's own generator and draws exactly one uniform
number per step, so a seeded request gives the same tokens on any device and whatever else runs: the
choice depends only on (logits, params, history). Candidates are ordered by (logit desc, id asc), so
ties never depend on how a kernel happened to order them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from .sampling_params import GREEDY_BELOW, SamplingParams

__all__ = ["GREEDY_BELOW", "Sampler", "SamplingParams"]


class Sampler:
    """Chooses tokens for one request and remembers the ones it chose (the penalties need them)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] | torch.Tensor = ()):
        self.params = params
        self.history: list[int] = []
        self._prompt_ids = prompt_ids              # made a tensor only if the penalties need it
        self._seen: torch.Tensor | None = None    # bool [V]: in the prompt or generated
        self._counts: torch.Tensor | None = None  # float32 [V]: times generated
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.generator = torch.Generator().manual_seed(seed % 2**64)  # negative seeds wrap, as in torch

    def __call__(self, logits: torch.Tensor) -> int:
        if logits.dim() != 1 or logits.numel() == 0:
            raise ValueError(f"logits must be a non-empty 1-D tensor [V], got shape {tuple(logits.shape)}")
        if self.params.greedy:
            # Stay on the logits' device: only one int crosses to the host. Ties -> lowest id.
            scores = self.penalize(logits) if self.params.penalized else logits.detach()
            token = int(torch.argmax(scores))
        else:
            token = self._sample(self.penalize(logits.detach().to("cpu")))
        self._record(token)
        return token

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits with the penalties applied, on the logits' device; never modifies the input."""
        scores = logits.detach().float()
        p = self.params
        if not p.penalized:
            return scores
        seen, counts = self._state(scores)
        if p.repetition_penalty != 1.0:
            rp = p.repetition_penalty
            scores = torch.where(seen, torch.where(scores > 0, scores / rp, scores * rp), scores)
        if p.frequency_penalty != 0.0:
            scores = scores - counts * p.frequency_penalty
        if p.presence_penalty != 0.0:
            scores = scores - (counts > 0).float() * p.presence_penalty
        return scores

    def _state(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Dense per-token state, built once from the history with scatter ops and then updated one
        # token at a time; rebuilt if the logits move to another device.
        if self._seen is None or self._seen.device != scores.device or self._seen.numel() != scores.numel():
            vocab, device = scores.numel(), scores.device
            prompt = torch.as_tensor(self._prompt_ids, dtype=torch.long).detach().flatten().cpu()
            ids = torch.cat([prompt, torch.tensor(self.history, dtype=torch.long)])
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise ValueError(f"prompt token ids must be in [0, {vocab}) for the penalties, "
                                 f"got {int(ids.min())}..{int(ids.max())}")
            ids = ids.to(device)
            generated = ids[prompt.numel():]
            self._counts = torch.zeros(vocab, device=device).index_add_(
                0, generated, torch.ones(generated.numel(), device=device))
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)
        return self._seen, self._counts

    @property
    def takes_argmax(self) -> bool:
        """Greedy without penalties: the token is the logits' first maximum, which the engine computes for all
        rows of a decode step at once and hands to `take`."""
        return self.params.greedy and not self.params.penalized

    def take(self, token: int) -> int:
        """Record a token chosen outside (a batch's argmax, for a sampler that takes_argmax) and return it."""
        self._record(token)
        return token

    def _record(self, token: int) -> None:
        self.history.append(token)
        if self._seen is not None:
            self._counts[token] += 1
            self._seen[token] = True

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, probabilities) a sampled step would draw from, after penalties, temperature,
        top-k, top-p and min-p; float32 on the CPU, probabilities not renormalised. Records nothing."""
        return self._candidates(self.penalize(logits.detach().to("cpu")))

    def _sample(self, scores: torch.Tensor) -> int:
        ids, probs = self._candidates(scores)
        cum = probs.double().cumsum(0)
        u = torch.rand((), dtype=torch.float64, generator=self.generator)  # exactly one draw per step
        i = int(torch.searchsorted(cum, u * cum[-1], right=True))
        i = min(i, int(torch.searchsorted(cum, cum[-1])))  # u * total rounded up to total: last nonzero
        return int(ids[i])

    def _candidates(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        top = scores.max()
        if not torch.isfinite(top):
            raise ValueError(f"cannot sample: the largest logit is {float(top)}")
        # Shift before dividing so that a tiny temperature cannot turn logits into inf - inf.
        scores = (scores - top) / p.temperature
        if 0 < p.top_k < scores.numel():
            ids, vals = _top_k(scores, p.top_k)
            probs = torch.softmax(vals, 0)
        else:
            ids, probs = None, torch.softmax(scores, 0)
        if p.top_p < 1.0:
            keep = _nucleus(probs, p.top_p)
            ids, probs = (keep if ids is None else ids[keep]), probs[keep]
        if p.min_p > 0.0:
            keep = (probs >= p.min_p * probs.max()).nonzero().squeeze(1)
            ids, probs = (keep if ids is None else ids[keep]), probs[keep]
        return (torch.arange(probs.numel()) if ids is None else ids), probs


def _top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly k (ids, logits), highest first; ties at the k-th value go to the lowest ids."""
    kth = torch.topk(scores, k, sorted=False).values.min()
    ids = (scores >= kth).nonzero().squeeze(1)
    vals, order = torch.sort(scores[ids], descending=True, stable=True)
    return ids[order][:k], vals[:k]


_BUCKETS = 1 << 15


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Positions of the smallest prefix of probs, ordered (prob desc, position asc), whose mass reaches
    top_p. Sorting all 248k tokens costs ~25 ms, so bucket the probabilities by their top 16 bits
    (for floats >= 0 the bit pattern orders like the value), find the bucket where the mass crosses
    top_p, and sort only that bucket. Result: the bucket's prefix after every token above it."""
    key = probs.view(torch.int32) >> 16
    mass = torch.bincount(key, weights=probs.double(), minlength=_BUCKETS).flip(0).cumsum(0)
    b = min(int(torch.searchsorted(mass, top_p)), _BUCKETS - 1)
    before = float(mass[b - 1]) if b else 0.0
    edge = _BUCKETS - 1 - b
    ids = (key >= edge).nonzero().squeeze(1)
    in_edge = key[ids] == edge
    above, edge_ids = ids[~in_edge], ids[in_edge]
    vals, order = torch.sort(probs[edge_ids], descending=True, stable=True)
    n = int(torch.searchsorted(vals.double().cumsum(0), top_p - before)) + 1
    return torch.cat([above, edge_ids[order][:n]])
