"""A helper the exactness tests share: record every logits row each request's tokens are chosen from.

Comparing token ids alone misses a change of the numbers that does not flip an argmax (a load-dependent chunk
grid moved first-token logits by 3e-5 and kept every token); comparing these rows bit for bit does not."""

from __future__ import annotations

import torch

from qwen4exp.engine import engine as engine_module
from qwen4exp.engine.sampling import Sampler


class RecordingSampler(Sampler):
    """Keeps a CPU copy of every logits row it is asked to choose from. It never takes a batch argmax, so the
    engine hands greedy rows to it one by one too (the same first maximum: the same tokens)."""

    created: list["RecordingSampler"] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: list[torch.Tensor] = []
        RecordingSampler.created.append(self)

    @property
    def takes_argmax(self) -> bool:
        return False

    def __call__(self, logits: torch.Tensor) -> int:
        self.rows.append(logits.detach().to("cpu", copy=True))
        return super().__call__(logits)


def record_logits(monkeypatch) -> None:
    """From now on each request the engine starts gets `request.logits`: the rows its tokens came from."""
    monkeypatch.setattr(engine_module, "Sampler", RecordingSampler)
    real_start = engine_module.Engine._start

    def start(self, slot, request):
        RecordingSampler.created.clear()
        # The sampler this start makes; a request whose whole prompt was cached may be finished (and its slot
        # released) before start returns.
        real_start(self, slot, request)
        request.logits = RecordingSampler.created[-1].rows

    monkeypatch.setattr(engine_module.Engine, "_start", start)


def assert_same_logits(got, want, what: str) -> None:
    assert len(got.logits) == len(want.logits) == len(want.output_ids), what
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert torch.equal(a, b), f"{what}: logits differ at token {step} (max {float((a - b).abs().max()):.3g})"
    assert got.output_ids == want.output_ids, what
