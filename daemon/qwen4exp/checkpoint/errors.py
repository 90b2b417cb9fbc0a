"""The one error type of checkpoint reading and writing."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read into the model; the message names the file and the tensor."""
