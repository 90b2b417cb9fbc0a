"""Choosing the next token from logits: greedy, or seeded sampling with temperature, top-k and top-p.

Sampling runs in float32 on the CPU with the request's own generator, so a seed gives the same tokens
on any device and whatever else is running.
"""

from __future__ import annotations

from dataclasses import dataclass

import secrets

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.detach().float().cpu()
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True, stable=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs, 1, generator=self.generator))
