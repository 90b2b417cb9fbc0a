"""GPU time of a call replayed from a CUDA graph, for the kernel benches."""

from __future__ import annotations

import torch


def graph_us(fn, calls: int = 20, replays: int = 5) -> float:
    """GPU microseconds per call: fn(0) .. fn(calls - 1) captured in one CUDA graph (after a call outside it,
    which compiles and tunes), replayed `replays` times. Host overhead, which dominates a decode step's few-row
    calls when run eagerly, does not count, as it does not in the engine's decode graph. The call index lets a
    caller cycle through weight copies that outgrow L2, as a decode step reads each weight once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * calls) * 1000
