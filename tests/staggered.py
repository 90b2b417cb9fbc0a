"""A helper the engine tests share: submit requests at given engine steps and run until every one is done."""

from __future__ import annotations

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.request import Request


def run_staggered(engine: Engine, specs: list[dict], starts: list[int]) -> list[Request]:
    """Submit Request(**specs[i]) when the engine has taken starts[i] steps (starts ascending)."""
    requests, step = [], 0
    while len(requests) < len(specs) or not engine.idle:
        while len(requests) < len(specs) and starts[len(requests)] <= step:
            requests.append(engine.submit(Request(**specs[len(requests)])))
        engine.step()
        step += 1
    return requests
