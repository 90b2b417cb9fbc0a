"""Random-weight checkpoints in the published layout, generated from the config alone.

Every on-disk tensor is drawn from its own generator (seeded by the run seed and the tensor's name), so the
output depends only on (seed, device) and not on how tensors are packed into shards. Shards are written one
tensor at a time, so peak memory stays near the largest single tensor whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import layout
from .presets import IM_END_OFFSET, preset_config
from .safetensors_stream import SafetensorsStream
from .tokenizer_builder import write_tokenizer

DEFAULT_SHARD_BYTES = 2 * 1024**3
INDEX_FILE = "model.safetensors.index.json"

# Gains chosen so each component does visible work: logits with std ~3 (no greedy near-ties) and router
# logits spread enough that the top-k experts change from token to token.
LM_HEAD_GAIN = 8.0
ROUTER_GAIN = 4.0
NORM_STD = 0.1


def _dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _piece_seed(seed: int, disk_name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{disk_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw(spec: layout.TensorSpec, piece: layout.Piece, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """One on-disk tensor drawn from the distribution of its runtime tensor."""
    if spec.init == "const":
        return torch.tensor(spec.value, dtype=torch.int64)
    gen = torch.Generator(device=device).manual_seed(_piece_seed(seed, piece.disk))
    shape = piece.shape
    if spec.init == "a_log":  # decay rates A ~ U(1, 16), stored as log(A)
        out = torch.rand(shape, generator=gen, device=device).mul_(15.0).add_(1.0).log_()
        return out.to(dtype)
    out = torch.randn(shape, generator=gen, device=device)
    hidden = spec.shape[-1]
    if spec.init == "fan_in":
        out.mul_(shape[-1] ** -0.5)
    elif spec.init == "lm_head":
        out.mul_(LM_HEAD_GAIN * hidden**-0.5)
    elif spec.init == "router":
        out.mul_(ROUTER_GAIN * hidden**-0.5)
    elif spec.init == "norm":  # the model multiplies by (1 + w)
        out.mul_(NORM_STD)
    elif spec.init == "gated_norm":  # the gated norm multiplies by w itself
        out.mul_(NORM_STD).add_(1.0)
    elif spec.init == "dt_bias":
        out.mul_(0.5).add_(1.0)
    elif spec.init == "conv":
        out.mul_(shape[-1] ** -0.5)
    elif spec.init != "embedding":
        raise ValueError(f"no distribution for init kind {spec.init!r} of {spec.name}")
    return out.to(dtype)


def _plan(text: dict[str, Any]) -> list[tuple[layout.TensorSpec, layout.Piece]]:
    return [(spec, piece) for spec in layout.runtime_specs(text) for piece in layout.disk_pieces(spec, text)]


def _pack(plan, dtype: torch.dtype, shard_bytes: int) -> list[list[tuple[layout.TensorSpec, layout.Piece, int]]]:
    """Greedy packing in plan order: a new shard starts when the next tensor would pass shard_bytes."""
    shards: list[list[tuple[layout.TensorSpec, layout.Piece, int]]] = [[]]
    used = 0
    for spec, piece in plan:
        size = math.prod(piece.shape) * (8 if spec.init == "const" else dtype.itemsize)
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((spec, piece, size))
        used += size
    return shards


def generation_config(text: dict[str, Any]) -> dict[str, Any]:
    eos = text["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    return {"eos_token_id": [eos, eos + IM_END_OFFSET], "pad_token_id": eos, "do_sample": False}


def write_random_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write a random-weight checkpoint of `preset` to out_dir and return the directory."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    device = str(torch.device(device))
    config = preset_config(preset, layers, dtype=_dtype_label(dtype))
    text = config["text_config"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    shards = _pack(_plan(text), dtype, shard_bytes)
    total = sum(size for shard in shards for *_, size in shard)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {preset}", disable=not progress)
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        entries = {
            piece.disk: (torch.int64 if spec.init == "const" else dtype, tuple(piece.shape)) for spec, piece, _ in shard
        }
        with SafetensorsStream(out / name, entries) as stream:
            for spec, piece, size in shard:
                stream.write(piece.disk, _draw(spec, piece, seed, dtype, device))
                weight_map[piece.disk] = name
                bar.update(size)
    bar.close()

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / INDEX_FILE, index)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(text))
    write_tokenizer(out, text)
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
