"""What the engine worker needs to start: resolved, plain values (no files, no environment)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineOptions:
    model: str                       # checkpoint directory (already resolved)
    device: str = "cpu"
    dtype: str = "float32"
    slots: int = 4
    max_ctx: int | str = 4096        # a number, or "auto" (fitted once, then kept)
    chunk: int = 256
    restore_spacing: int | None = None     # None: the chunk
    prefix_cache: bool = True
    prefix_cache_limit: int | str = 1 << 30  # bytes, or "auto" (decided at start from free memory)
    device_memory_limit: int | None = None
    queue_limit: int = 64
    cuda_graphs: bool = True
    compile_decode: bool = False

    def to_dict(self) -> dict:
        return asdict(self)
