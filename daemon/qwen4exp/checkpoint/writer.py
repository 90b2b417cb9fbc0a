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

from . import fp8, layout
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


# The weights Qwen's FP8 checkpoint stores in float8 (fp8.py), by their runtime names' ends: the routed experts (the
# MTP layer's too), the shared expert and the attention projections; the PLE table with one global scale, the module
# that modules_to_convert names (transformers keeps it an FP8 embedding that scales the rows it gathers). The rest
# stays in the checkpoint's dtype, as its modules_to_not_convert lists (`_not_converted`).
FP8_WEIGHTS = (".experts.gate_up_proj", ".experts.down_proj", ".shared_expert.gate_proj.weight",
               ".shared_expert.up_proj.weight", ".shared_expert.down_proj.weight", ".self_attn.q_proj.weight",
               ".self_attn.k_proj.weight", ".self_attn.v_proj.weight", ".self_attn.o_proj.weight")
FP8_CONVERTED_TABLES = ["ple.ple_embedding.ngram_embedding"]
# The PLE table's one scale: the writer's embeddings are N(0, 1), so |x| <= 8 covers every draw.
PLE_FP8_SCALE = 8.0 / fp8.FLOAT8_MAX


def _fp8(spec: layout.TensorSpec) -> str | None:
    """How an FP8 checkpoint stores this runtime tensor: "blocks", "global" (the PLE table) or None (as is)."""
    if spec.name.endswith(".ngram_embedding.weight"):
        return "global"
    return "blocks" if spec.name.endswith(FP8_WEIGHTS) else None


def _plan(text: dict[str, Any]) -> list[tuple[layout.TensorSpec, layout.Piece]]:
    return [(spec, piece) for spec in layout.runtime_specs(text) for piece in layout.disk_pieces(spec, text)]


def _not_converted(plan: list[tuple[layout.TensorSpec, layout.Piece]]) -> list[str]:
    """modules_to_not_convert: the on-disk name of every matrix an FP8 checkpoint keeps in its dtype, in full.
    transformers matches each entry against a module's name from its start or as its end, so a short one such as
    "linear_attn" would match no projection: its FP8 path would take them for float8 weights without scales."""
    return sorted({piece.disk.removesuffix(".weight") for spec, piece in plan
                   if spec.init != "const" and _fp8(spec) is None and len(piece.shape) == 2
                   and piece.disk.endswith(".weight")})


def _entries(spec: layout.TensorSpec, piece: layout.Piece, dtype: torch.dtype, fp8_block: tuple[int, int] | None,
             scale_dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The on-disk tensors of one piece: itself, and in an FP8 checkpoint its scales."""
    if spec.init == "const":
        return {piece.disk: (torch.int64, tuple(piece.shape))}
    kind = _fp8(spec) if fp8_block is not None else None
    if kind is None:
        return {piece.disk: (dtype, tuple(piece.shape))}
    out = {piece.disk: (fp8.FLOAT8, tuple(piece.shape))}
    if kind == "blocks":
        rows, cols = piece.shape
        out[fp8.scale_name(piece.disk)] = (scale_dtype, (-(-rows // fp8_block[0]), -(-cols // fp8_block[1])))
    elif piece.disk.endswith(".shard_0.weight"):        # the table's one scale, written once under its published name
        out[fp8.ple_scale_name(piece.disk)] = (scale_dtype, (1,))
    return out


def _pack(plan, sizes, shard_bytes: int) -> list[list[tuple[layout.TensorSpec, layout.Piece, int]]]:
    """Greedy packing in plan order: a new shard starts when the next tensor would pass shard_bytes."""
    shards: list[list[tuple[layout.TensorSpec, layout.Piece, int]]] = [[]]
    used = 0
    for spec, piece in plan:
        size = sizes(spec, piece)
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((spec, piece, size))
        used += size
    return shards


def _fp8_parts(spec, piece, seed: int, device: str, block: tuple[int, int], scale_dtype: torch.dtype, parts: dict):
    """An FP8 piece's tensors in `parts`' order: its float8 values, then its scales (when it has them here)."""
    drawn = _draw(spec, piece, seed, torch.float32, device)
    if _fp8(spec) == "global":
        scale = torch.tensor([PLE_FP8_SCALE], dtype=scale_dtype)
    else:
        scale = fp8.quantize(drawn, block)[1].to(scale_dtype)
    # The values are divided by the scale as stored (a bfloat16 one is rounded), within e4m3's range.
    per_value = fp8.value_scales(scale.to(drawn.device), tuple(drawn.shape), None if _fp8(spec) == "global" else block)
    values = (drawn / per_value).clamp(-fp8.FLOAT8_MAX, fp8.FLOAT8_MAX).to(fp8.FLOAT8)
    tensors = [values.cpu(), scale.cpu()]
    return zip(parts, tensors[:len(parts)])


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
    fp8_block: tuple[int, int] | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random-weight checkpoint of `preset` to out_dir and return the directory. With `fp8_block`, in Qwen's
    FP8 layout (fp8.py): FP8_WEIGHTS in float8 with scales (of `scale_dtype`) per block of that [rows, cols], the
    PLE table in float8 with one scale, the rest in `dtype`."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    device = str(torch.device(device))
    config = preset_config(preset, layers, dtype=_dtype_label(dtype))
    text = config["text_config"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    plan = _plan(text)
    if fp8_block is not None:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(fp8_block),
                                         "modules_to_not_convert": _not_converted(plan),
                                         "modules_to_convert": FP8_CONVERTED_TABLES}

    def entries(spec, piece):
        return _entries(spec, piece, dtype, fp8_block, scale_dtype)

    def size(spec, piece) -> int:
        return sum(math.prod(shape) * kind.itemsize for kind, shape in entries(spec, piece).values())

    shards = _pack(plan, size, shard_bytes)
    total = sum(size for shard in shards for *_, size in shard)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {preset}", disable=not progress)
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        declared = {disk: entry for spec, piece, _ in shard for disk, entry in entries(spec, piece).items()}
        with SafetensorsStream(out / name, declared) as stream:
            for spec, piece, size in shard:
                parts = entries(spec, piece)
                if len(parts) == 1 and next(iter(parts.values()))[0] != fp8.FLOAT8:
                    stream.write(piece.disk, _draw(spec, piece, seed, dtype, device))
                else:
                    for disk, tensor in _fp8_parts(spec, piece, seed, device, fp8_block, scale_dtype, parts):
                        stream.write(disk, tensor)
                for disk in parts:
                    weight_map[disk] = name
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
