"""One prompt's answer from a 1-slot engine of its own, for tests, benches and scripts that want a single answer:
the serving engine's chunked prefill and decode step, so the answer is the one a 1-slot server gives."""

from __future__ import annotations

from .engine import Engine
from .engine_config import EngineConfig
from .model.causal_lm import Qwen4ExpForCausalLM
from .request import Request
from .sampling import SamplingParams


def generate(model: Qwen4ExpForCausalLM, prompt_ids: list[int], max_tokens: int,
             sampling: SamplingParams | None = None, chunk: int | None = None,
             stop_ids: tuple[int, ...] = ()) -> Request:
    """The finished request for up to `max_tokens` after `prompt_ids` (its `output_ids`, `finish_reason`, timings).
    `chunk`: prompt tokens per prefill forward, a multiple of the QSA compress ratio (None: the whole prompt in one
    forward). Raises RequestRejected for a prompt the engine refuses, RuntimeError when the engine failed."""
    if chunk is None:
        ratio = model.config.indexer_compress_ratio
        chunk = max(-(-len(prompt_ids) // ratio) * ratio, ratio)
    context = max(len(prompt_ids) + max(max_tokens, 0), chunk)    # the state this request needs, no more
    engine = Engine.from_config(model, EngineConfig(slots=1, max_ctx=context, chunk=chunk))
    request = engine.submit(Request(prompt_ids=list(prompt_ids), max_tokens=max_tokens,
                                    sampling=sampling or SamplingParams(), stop_token_ids=tuple(stop_ids)))
    engine.run_until_idle()
    if request.error is not None:
        raise RuntimeError(f"generation failed: {request.error}")
    return request

