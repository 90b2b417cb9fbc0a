"""qwen4_exp checkpoints: named shapes, the on-disk layouts (safetensors, GGUF), a random-weight writer, and the
weight loaders.

The names below are imported on first use: the daemon's processes read a GGUF's tokenizer (gguf_file.py) without
importing torch, which the loaders and the writer need.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "errors", "LoadReport": "loader", "checkpoint_files": "loader", "load_weights": "loader",
    "read_config": "loader", "PRESET_NAMES": "presets", "preset_config": "presets",
    "write_random_checkpoint": "writer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
