"""A split model's decode step (placement.py) as one CUDA graph per run of layers on a GPU.

One CUDA graph captures one device's stream, so a step whose layers span devices cannot be one graph, and run
eagerly it is bound by the host's launches (hundreds of kernels a step). Here the step is cut where the device
changes: a segment per run of layers (the first also embeds the tokens, on the target) and, on the target, the
final mixer and the LM head (with the last run when that is the target's). Each segment on a GPU is captured on
its device, reading static inputs there: the step's tokens, positions and active rows (copied from the target's
before each step), a copy of the rope table, and the streams and pending MoE output the segment before handed
over, which the host copies across between replays (device to device, ordered with both devices' streams). A
segment on the CPU runs as it is, and so does a run whose layers keep hot experts on the target
(hot_experts.py: their pairs cross devices inside every layer, which no one device's graph can hold).

Exactness: a segment runs the model's own layer code on the same inputs as the eager step does
(tests/test_split.py runs the segments eagerly against decode_rows bit for bit; tests/test_gpu_engine.py replays
them beside layers in host memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cuda_graph import capture_graph
from .memory import current_device
from .model.step import Step


@dataclass
class Segment:
    device: torch.device
    first: int                        # its layers, first..last (none where last < first)
    last: int
    embeds: bool                      # starts from the tokens' embeddings (else from the streams handed over)
    finishes: bool                    # ends with the mixer and the LM head (the step's logits)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)    # tokens, positions, active on the device
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    streams: torch.Tensor | None = None       # handed over by the segment before (static, on the device)
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    graph: torch.cuda.CUDAGraph | None = None
    out: object = None                        # the graph's outputs



def plan_segments(model) -> list[Segment]:
    """The segments of `model`'s decode step, in order (placement.runs, the target's work at both ends)."""
    placement = model.placement
    target = torch.device(placement.target)
    runs = [(torch.device(name), first, last) for name, first, last in placement.runs()]
    segments = []
    if runs[0][0] != target:                   # every layer off the target: the embedding alone first
        segments.append(Segment(target, 0, -1, embeds=True, finishes=False))
    for device, first, last in runs:
        segments.append(Segment(device, first, last, embeds=not segments, finishes=False))
    if segments[-1].device == target:
        segments[-1].finishes = True
    else:
        segments.append(Segment(target, 0, -1, embeds=False, finishes=True))
    return segments


class SegmentedDecode:
    """decode_runner.DecodeRunner's step for a model whose layers span devices: `run()` gives the logits [N, V] of
    the step its `inputs` (the target's tokens, positions and active rows) describe."""

    def __init__(self, model, states, inputs: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 graphs: bool):
        self.model, self.states, self.inputs = model, states, inputs
        self.target = torch.device(model.placement.target)
        self.segments = plan_segments(model)
        for segment in self.segments:
            if segment.device == self.target:
                segment.inputs, segment.rope = inputs, rope
            else:
                segment.inputs = {name: torch.zeros(t.shape, dtype=t.dtype, device=segment.device)
                                  for name, t in inputs.items()}
                segment.rope = tuple(t.to(segment.device) for t in rope)
        self.run()          # once eagerly: each hand-over's buffers take the shapes the segments give
        if graphs:
            # A device's segments replay one after another, each one's outputs copied out before the next on its
            # stream: their temporaries can share one pool, as the fit's one eager step does.
            pools: dict[torch.device, object] = {}
            for segment in self.segments:
                if segment.device.type == "cuda" and not self._keeps_hot_experts(segment):
                    pool = pools.setdefault(segment.device, torch.cuda.graph_pool_handle())
                    with torch.cuda.device(segment.device):
                        segment.graph, segment.out = capture_graph(lambda s=segment: self._run_segment(s),
                                                                   segment.device, pool)

    @property
    def graphs(self) -> int:
        return sum(segment.graph is not None for segment in self.segments)

    def _keeps_hot_experts(self, segment: Segment) -> bool:
        layers = self.model.model.layers[segment.first:segment.last + 1]
        return any(layer.mlp.experts.hot is not None for layer in layers)

    def run(self) -> torch.Tensor:
        carried = None
        for segment in self.segments:
            if segment.device != self.target:
                for name, tensor in segment.inputs.items():
                    tensor.copy_(self.inputs[name])
            if carried is not None:
                self._hand_over(segment, *carried)
            if segment.graph is not None:
                with torch.cuda.device(segment.device):
                    segment.graph.replay()
                carried = segment.out
            else:
                carried = self._run_segment(segment)
        return carried

    def _hand_over(self, segment: Segment, streams: torch.Tensor, pending) -> None:
        """The streams and pending MoE output into `segment`'s static buffers (made at the first step)."""
        if segment.streams is None:
            segment.streams = torch.empty(streams.shape, dtype=streams.dtype, device=segment.device)
            segment.pending = None if pending is None else tuple(
                torch.empty(t.shape, dtype=t.dtype, device=segment.device) for t in pending)
        segment.streams.copy_(streams)
        if pending is not None:
            for mine, theirs in zip(segment.pending, pending):
                mine.copy_(theirs)

    @torch.inference_mode()
    def _run_segment(self, segment: Segment):
        """The segment's work over its static inputs: (streams, pending) for the next, or the logits."""
        model = self.model
        with current_device(segment.device):
            ops = model.ops if segment.device == self.target else model.ops_on(segment.first)
            inputs = segment.inputs
            step = Step.rows(ops, inputs["tokens"], inputs["positions"].clamp(0, self.states.capacity - 1),
                             inputs["active"], self.states, segment.rope)
            if segment.embeds:
                streams, pending = model.embed(step), None
            else:
                streams, pending = segment.streams, segment.pending
            streams, pending = model.run_layers(segment.first, segment.last, streams, step, pending)
            if not segment.finishes:
                return streams, pending
            hidden, _ = model.mix_out(streams, step, pending)
            return ops.linear(hidden, model.lm_head.weight, step)
