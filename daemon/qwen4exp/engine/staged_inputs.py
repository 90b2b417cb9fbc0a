"""Static device inputs of replayed steps (a CUDA graph reads them in place), written from the host before each
replay: the decode step's (decode_runner.py) and the speculative steps' (speculative_runner.py)."""

from __future__ import annotations

import torch


class StagedInputs:
    """Static device inputs written from the host without waiting for the device: the values go through pinned
    buffers, copied behind the work already queued (a plain copy from pageable memory would wait for all of it).
    A buffer is reused once the device has taken its last values."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        self.inputs = inputs
        self.device = next(iter(inputs.values())).device
        pinned = self.device.type == "cuda"
        self._host = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for name, t in inputs.items()}
        self._taken = torch.cuda.Event() if pinned else None

    def write(self, **values: list) -> None:
        """Each named input's leading values, nested lists flattened in order."""
        if self._taken is not None:
            self._taken.synchronize()
        for name, nested in values.items():
            flat = torch.tensor(nested, dtype=self._host[name].dtype).view(-1)
            host = self._host[name].view(-1)[:flat.numel()]
            host.copy_(flat)
            self.inputs[name].view(-1)[:flat.numel()].copy_(host, non_blocking=self._taken is not None)
        if self._taken is not None:
            self._taken.record(torch.cuda.current_stream(self.device))
