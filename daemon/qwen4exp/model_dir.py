"""What a `model` setting names: a checkpoint directory, a GGUF file, `tiny` (the embedded default), or a Hugging Face
id (`org/repo`, `org/repo:QUANT`, either with `@revision`), which hub.py turns into a path in huggingface_hub's cache.

A local path always wins: `org/repo` is an id only when nothing of that name exists, so a directory laid out like an
id is still read from disk, and `./org/repo` is a path whatever exists."""

from __future__ import annotations

from pathlib import Path

from .hub import HubError, HubId, resolve, resolve_tensors

EMBEDDED_MODEL = Path(__file__).parent / "assets" / "tiny_model"


def hub_id(name: str, base: Path | None = None) -> HubId | None:
    """The Hugging Face id `name` spells, or None: when it names something that exists (relative to `base`, else to
    the working directory), or when it is not shaped like an id (`tiny`, `/abs/path`, `./x`, `x.gguf`)."""
    path = Path(name).expanduser()
    if (path if base is None else base / path).exists():
        return None
    return HubId.parse(name)


def resolve_model(name: str) -> Path:
    """A checkpoint directory, a GGUF file (the first shard of a split set), `tiny`: the embedded default, a small
    qwen4_exp trained on a public-domain text that ships inside the package (see assets/tiny_model/README.md), or a
    Hugging Face id: its snapshot directory or GGUF file in the cache, downloaded first when the cache lacks it."""
    path = Path(name)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if name == "tiny" and (EMBEDDED_MODEL / "config.json").exists():
        return EMBEDDED_MODEL
    found = hub_id(name)
    if found is not None:
        try:
            return resolve(found)
        except HubError as err:
            # org/repo is also how a relative path is written: say that none is there either.
            local = "" if any(c in name for c in ":@") else f"; nor is there a file or directory {name} in {Path.cwd()}"
            raise SystemExit(f"error: model {name!r}: {err}{local}") from None
    raise SystemExit(f"error: model {name!r} is neither a checkpoint directory, a .gguf file, a Hugging Face id "
                     f"(org/repo, org/repo:QUANT) nor 'tiny' (write random-weight checkpoints with "
                     f"`qwen4exp init-checkpoint --preset tiny|bench|full`)")


def resolve_head(name: str) -> Path:
    """What `mtp_weights` names, as an absolute path: a safetensors checkpoint's directory, or the Hugging Face id of
    one, of which only the small files and the shards holding `mtp.*` are fetched (hub.resolve_tensors)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    found = hub_id(name)
    if found is not None:
        try:
            return resolve_tensors(found, "mtp.").resolve()
        except HubError as err:
            raise SystemExit(f"error: mtp_weights {name!r}: {err}") from None
    raise SystemExit(f"error: mtp_weights {name!r} is neither a directory nor a Hugging Face id (org/repo) of a "
                     f"safetensors release of the model")
