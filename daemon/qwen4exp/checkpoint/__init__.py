"""qwen4_exp checkpoints: named shapes, the on-disk layout, a random-weight writer, and the weight loader."""

from .errors import CheckpointError
from .loader import LoadReport, checkpoint_files, load_weights, read_config
from .presets import PRESET_NAMES, preset_config
from .writer import write_random_checkpoint

__all__ = [
    "CheckpointError",
    "LoadReport",
    "PRESET_NAMES",
    "checkpoint_files",
    "load_weights",
    "preset_config",
    "read_config",
    "write_random_checkpoint",
]
