"""Where a `model` setting points: a checkpoint directory, a GGUF file, or `tiny`, the embedded default."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).parent / "assets" / "tiny_model"


def resolve_model(name: str) -> Path:
    """A checkpoint directory, a GGUF file (the first shard of a split set), or `tiny`: the embedded default, a
    small qwen4_exp trained on a public-domain text that ships inside the package (see assets/tiny_model/README.md)."""
    path = Path(name)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if name == "tiny" and (EMBEDDED_MODEL / "config.json").exists():
        return EMBEDDED_MODEL
    raise SystemExit(f"error: --model {name!r} is neither a checkpoint directory, a .gguf file nor 'tiny' "
                     f"(write random-weight checkpoints with `qwen4exp init-checkpoint --preset tiny|bench|full`)")
