"""Where a cold prompt's time to first token goes, for bench/speed.py.

An engine serves a prompt no cache holds (a server's engine: the prefix cache on, one short request served
before), and the time from its submission to the moment the engine takes its first token is split into:

- forward: the model's prompt chunks (the device synchronised around each, so its kernels count here; a Triton
  compile on a new length counts here too, which is why each length is sent twice, with other tokens); apart,
  `forward_launch_s`: the part of it until the chunks' calls returned, before the wait for the device. Close to
  the forward, the host's launches set the pace (the device waits on them); far below it, the kernels do;
- sampling: the first token drawn from the last chunk's logits;
- capture / restore: prefix-cache snapshots taken at restore points before the token (the prompt's last one
  is taken after it, off its path), and the lookup of a cached prefix;
- release: the allocator's cached blocks given back to the device when the prompt ends;
- host: the rest (scheduling, the step's bookkeeping, copying the ids to the device, the state saved for an
  out-of-memory retry).

Each part is timed by wrapping the engine's own calls for the one request, so the split adds a synchronisation
per call; `plain_s` is the same length's time to first token without the wrappers. The device's new memory
segments (torch's count of cudaMalloc calls) during the prompt tell whether it waited on allocation.
`first_token` is the submit-and-step loop every time to first token of bench/speed.py is taken with.
"""

from __future__ import annotations

import contextlib
import time

import torch

from qwen4exp.engine import engine as engine_module
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.request import Request
from qwen4exp.engine.sampling import Sampler

PARTS = ("forward", "sampling", "capture", "restore", "release")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _segments(device: torch.device) -> int | None:
    return torch.cuda.memory_stats(device).get("segment.all.allocated") if device.type == "cuda" else None


@contextlib.contextmanager
def _patched(owner, name: str, wrap):
    """owner.name replaced by wrap(the original) while inside; an instance's method (found on its class) is
    shadowed by an attribute of the instance, removed again after."""
    own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def triton_compiles():
    """The names of the Triton kernels compiled while inside (each specialization Triton had not built in this
    process: what a request waits for when the warm-up missed a shape), by wrapping JITFunction._do_compile."""
    names: list[str] = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield names
        return
    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        names.append("(not counted: this Triton has no JITFunction._do_compile)")
        yield names
        return

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    JITFunction._do_compile = counted
    try:
        yield names
    finally:
        JITFunction._do_compile = original


def first_token_parts(engine: Engine, prompt: list[int], device: torch.device) -> dict:
    """Submit `prompt` (one new token) and step until its first token, timing each part; the request is run to
    its end before returning."""
    calls: list[tuple[str, float, float]] = []     # (part, when it began, seconds)
    launched: list[tuple[float, float]] = []         # the forward calls': (when each began, seconds until it returned)

    def timed(part: str):
        def wrap(fn):
            def call(*args, **kwargs):
                _sync(device)
                started = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if part == "forward":
                        launched.append((started, time.perf_counter() - started))
                    _sync(device)
                    calls.append((part, started, time.perf_counter() - started))
            return call
        return wrap

    with contextlib.ExitStack() as patches:
        patches.enter_context(_patched(engine.model, "forward", timed("forward")))   # the prompt chunks' call
        patches.enter_context(_patched(Sampler, "__call__", timed("sampling")))
        patches.enter_context(_patched(engine_module, "release_cached_blocks", timed("release")))
        if engine.prefix_cache is not None:
            patches.enter_context(_patched(engine.prefix_cache, "capture", timed("capture")))
            patches.enter_context(_patched(engine.prefix_cache, "restore_longest", timed("restore")))
        segments = _segments(device)
        request, took = first_token(engine, prompt, 1, device)
        new_segments = None if segments is None else _segments(device) - segments
    engine.run_until_idle()
    # What ran after the token was taken (the prompt's last snapshot) is not on its path.
    taken = request.first_token_at if request.first_token_at is not None else float("inf")
    parts = {part: sum(took for name, began, took in calls if name == part and began < taken) for part in PARTS}
    parts["host"] = max(0.0, took - sum(parts.values()))
    launch = sum(seconds for began, seconds in launched if began < taken)
    return {"tokens": len(prompt), "ttft_s": took, "parts_s": parts, "forward_launch_s": launch,
            "new_device_segments": new_segments,
            "finish_reason": request.finish_reason.value if request.finish_reason else None,
            "error": request.error}


def first_token(engine: Engine, prompt: list[int], max_tokens: int, device: torch.device) -> tuple[Request, float]:
    """Submit a request and step until its first token: (request, seconds from the submission to the moment
    the engine took the token, when a stream sends it; the step goes on to a decode step, which is not
    counted). The rest is left to run."""
    _sync(device)
    started = time.perf_counter()
    request = engine.submit(Request(prompt_ids=prompt, max_tokens=max_tokens))
    while not request.output_ids and not request.finished:
        engine.step()
    _sync(device)
    took = request.first_token_at if request.first_token_at is not None else time.perf_counter()
    return request, took - started


def plain_first_token(engine: Engine, prompt: list[int], device: torch.device) -> float:
    """The time to first token of `prompt` with nothing wrapped; the request is run to its end."""
    _, took = first_token(engine, prompt, 1, device)
    engine.run_until_idle()
    return took
