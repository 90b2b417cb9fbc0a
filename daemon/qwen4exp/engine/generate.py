"""Offline generation for one prompt: chunked prefill, then incremental decode over the sequence state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .model.causal_lm import Qwen4ExpForCausalLM, Segment
from .sampling import Sampler, SamplingParams


@dataclass
class Generation:
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(len(self.token_ids) - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model: Qwen4ExpForCausalLM, prompt_ids: list[int], max_tokens: int,
             sampling: SamplingParams = SamplingParams(), chunk: int | None = None,
             stop_ids: tuple[int, ...] = (), on_token=None) -> Generation:
    """Generate up to max_tokens after prompt_ids. `chunk` cuts the prompt into pieces of that many
    tokens (None: one piece). `on_token(id)` is called as each token is chosen."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
    device = model.lm_head.weight.device
    state = model.new_state(len(prompt_ids) + max_tokens)
    sampler = Sampler(sampling, prompt_ids)
    result = Generation(prompt_tokens=len(prompt_ids))
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    step = chunk or len(prompt_ids)

    started = time.perf_counter()
    for begin in range(0, len(prompt_ids), step):
        logits = model([Segment(ids[begin:begin + step], state)])[0]
    token = sampler(logits)
    _sync(device)
    result.prefill_s = time.perf_counter() - started

    started = time.perf_counter()
    while True:
        result.token_ids.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop_ids:
            result.finish_reason = "stop"
            break
        if len(result.token_ids) >= max_tokens:
            break
        logits = model([Segment(torch.tensor([token], device=device), state)])[0]
        token = sampler(logits)
    _sync(device)
    result.decode_s = time.perf_counter() - started
    return result
