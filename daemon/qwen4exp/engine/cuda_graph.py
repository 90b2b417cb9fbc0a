"""A CUDA graph of a step: the one capture the decode step (decode_runner.py), the speculative steps
(speculative_runner.py), a split model's segments (segmented_decode.py) and bench/mtp_speed.py share."""

from __future__ import annotations

import torch

from .snapshot import quiesce_snapshot_copies


def capture_graph(run, device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(a CUDA graph of run(), what the captured run returned): run twice on a side stream first, so that every
    kernel is compiled and tuned outside the capture, and no snapshot copier allocating pinned memory during it.
    `pool`: a memory pool shared with other graphs that never replay at the same time."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    quiesce_snapshot_copies()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out
