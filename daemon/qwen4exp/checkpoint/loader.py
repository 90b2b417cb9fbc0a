"""Read a qwen4_exp checkpoint directory: its config, and its weights into an already-built module.

Weights are copied in place (`copy_`) into the module's own parameters and buffers, so the module can be built
directly on the target device and no second copy of the model is ever materialised. Everything is checked from
the safetensors headers before the first byte of data is read: a bad checkpoint fails fast and leaves nothing
half loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from ..engine.model.quantized import QuantizedStack, kept_name
from . import fp8, layout
from .errors import CheckpointError

logger = logging.getLogger("qwen4exp.checkpoint")


@contextlib.contextmanager
def _opened(file: Path, device: str = "cpu"):
    """safe_open, with a file it cannot read (truncated, empty, not safetensors at all) a CheckpointError naming it."""
    try:
        with safe_open(str(file), framework="pt", device=device) as f:
            yield f
    except SafetensorError as err:
        raise CheckpointError(f"{file}: cannot be read as safetensors ({err}): a truncated download, or another "
                              "kind of file?") from None
    except OSError as err:          # safetensors says "no such file" for one this user may not read
        why = "this user may not read it" if file.exists() and not os.access(file, os.R_OK) else err.strerror
        raise CheckpointError(f"{file}: cannot be opened ({why})") from None


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SUPPORTED = {"Qwen4ExpForConditionalGeneration": "qwen4_exp", "Qwen4ExpForCausalLM": "qwen4_exp_text"}
_TOP_LEVEL_KEYS = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version")
_SHOW = 5  # how many names an error lists before "and N more"

_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _root(path: str | Path) -> Path:
    path = Path(path)
    return path.parent if path.is_file() else path


def _some(names: list[str]) -> str:
    more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def read_config(path: str | Path) -> dict[str, Any]:
    """The text config of a checkpoint (directory or config.json) as a plain dict.

    Accepts the published multimodal layout (model_type qwen4_exp, `text_config`) and a text-only
    Qwen4ExpForCausalLM config (model_type qwen4_exp_text). `architectures` and the other top-level fields stay
    reachable under "architectures" and "top_level".
    """
    file = Path(path) if Path(path).is_file() else Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in {_root(path)}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    model_type = raw.get("model_type")
    architectures = list(raw.get("architectures") or [])
    supported = ", ".join(f"{a} (model_type {m})" for a, m in SUPPORTED.items())
    unknown = [a for a in architectures if a not in SUPPORTED]
    if model_type not in SUPPORTED.values() or unknown:
        raise CheckpointError(
            f"{file}: unsupported model (architectures {architectures}, model_type {model_type!r}); "
            f"supported: {supported}"
        )
    text = raw.get("text_config") if model_type == "qwen4_exp" else raw
    if not isinstance(text, dict):
        raise CheckpointError(f"{file}: model_type qwen4_exp needs a text_config object")
    if text.get("model_type", "qwen4_exp_text") != "qwen4_exp_text":
        raise CheckpointError(
            f"{file}: text_config.model_type is {text.get('model_type')!r}, expected 'qwen4_exp_text'"
        )
    config = json.loads(json.dumps(text))  # a deep, plain copy
    config.pop("text_config", None)
    config["architectures"] = architectures
    if model_type == "qwen4_exp":
        config["top_level"] = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    else:
        config["top_level"] = {k: raw[k] for k in _TOP_LEVEL_KEYS if k in raw}
    return config


def checkpoint_files(path: str | Path, only: str | None = None) -> dict[str, Path]:
    """{tensor name: file} from the index, or from the single model.safetensors; missing files are an error.
    `only`: the tensors whose names start with it, so only the shards that hold them must be there (the MTP head
    taken from a checkpoint of which just those shards were downloaded)."""
    root = _root(path)
    index_file = root / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_file}: not a safetensors index ({exc})") from exc
        files = {name: root / file for name, file in weight_map.items() if only is None or name.startswith(only)}
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name, file in files.items():
            by_file[file].append(name)
        for file, names in sorted(by_file.items()):
            if not file.is_file():
                raise CheckpointError(f"{file} is listed in {index_file} (for {_some(sorted(names))}) but missing")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        with _opened(single) as f:
            return {name: single for name in f.keys() if only is None or name.startswith(only)}
    raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {root}")


@dataclass
class LoadReport:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    files: int = 0
    skipped_visual: int = 0
    skipped_mtp: int = 0

    @property
    def gb_per_second(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Copy:
    file: Path
    disk: str
    target: str
    index: tuple[Any, ...]
    nbytes: int
    scale: tuple[Path, str] | None = None      # a float8 weight's block scales (fp8.py)
    kept: str | None = None                    # the block type a float8 piece is repacked into (a kept stack)


@dataclass
class _Plan:
    copies: list[_Copy] = field(default_factory=list)
    report: LoadReport = field(default_factory=LoadReport)
    unexpected: list[str] = field(default_factory=list)
    covered: dict[str, set[Any]] = field(default_factory=lambda: defaultdict(set))
    ple: dict[str, dict[int, tuple[Path, str, tuple[int, ...], int]]] = field(default_factory=lambda: defaultdict(dict))


def headers(files: dict[str, Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """{name: (file, shape, dtype name)} read from the safetensors headers only."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    headers = {}
    for file, names in sorted(by_file.items()):
        with _opened(file) as f:
            present = set(f.keys())
            for name in sorted(names):
                if name not in present:
                    raise CheckpointError(f"{file} does not contain {name}, which the index places there")
                piece = f.get_slice(name)
                headers[name] = (file, tuple(piece.get_shape()), piece.get_dtype())
    return headers


def _shape_error(file: Path, name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> CheckpointError:
    return CheckpointError(f"{file}: tensor {name} has shape {list(got)}, the model expects {list(expected)}")


def _scales(headers: dict, block: tuple[int, int] | None) -> dict[str, Path]:
    """{scale name: file} of an FP8 checkpoint (the scales leave `headers`, so that one no weight takes is named as
    such); float8 tensors elsewhere are refused."""
    scales = {name: headers.pop(name)[0] for name in [n for n in headers if fp8.is_scale(n)]}
    if block is None:
        floats8 = [name for name, (_, _, dtype) in headers.items() if dtype.startswith("F8")]
        if floats8 or scales:
            raise CheckpointError(f"{_some(sorted(floats8 or scales))}: float8 weights or their scales, but the "
                                  f"config has no quantization_config (quant_method 'fp8')")
    return scales


def _scale_for(name: str, ref: layout.DiskRef, scales: dict, used: set) -> tuple[Path, str] | None:
    """A float8 weight's scales (file, name): its own block scales, or for a PLE shard the table's one global scale
    (fp8.ple_scale_names)."""
    names = fp8.ple_scale_names(name) if ref.kind == "ple_shard" else (fp8.scale_name(name),)
    found = next((scale for scale in names if scale in scales), None)
    if found is None:
        return None
    used.add(found)
    return scales[found], found


def _plan(files: dict[str, Path], targets: dict[str, torch.Tensor], block: tuple[int, int] | None = None,
          kept: dict[str, Any] | None = None) -> _Plan:
    """`kept`: {runtime name: QuantizedStack} of the float8 stacks the model keeps as blocks (their `.blocks` are
    the targets)."""
    plan = _Plan()
    kept = kept or {}
    has_mtp = any(name.startswith(layout.MTP_PREFIX) for name in targets)
    found = headers(files)
    scales, used = _scales(found, block), set()
    for name, (file, shape, dtype) in found.items():
        ref = layout.parse_disk_name(name)
        stack_name = kept_name(ref.target)
        stack = kept.get(stack_name) if stack_name is not None else None
        if stack is not None:       # the stack's dense shape for the checks, its blocks for the copy
            ref = layout.DiskRef(ref.kind, stack_name + ".blocks", ref.number, ref.proj)
        if ref.kind == "visual" or (ref.target.startswith(layout.MTP_PREFIX) and not has_mtp):
            if ref.kind == "visual":
                plan.report.skipped_visual += 1
            else:
                plan.report.skipped_mtp += 1
            used.add(fp8.scale_name(name))        # a skipped float8 weight's scales are skipped with it
            continue
        param = targets.get(ref.target)
        dense = tuple(stack.shape) if stack is not None else None if param is None else tuple(param.shape)
        nbytes = math.prod(shape) * _DTYPE_SIZES.get(dtype, 4)
        if param is None or (ref.kind == "expert" and (param.dim() != 3 or ref.number >= param.shape[0])):
            plan.unexpected.append(f"{name} ({file.name})")
            continue
        scale = _scale_for(name, ref, scales, used) if dtype.startswith("F8") else None
        if dtype.startswith("F8") and scale is None:
            wanted = fp8.ple_scale_name(name) if ref.kind == "ple_shard" else fp8.scale_name(name)
            raise CheckpointError(f"{file}: float8 tensor {name} has no {wanted}")
        qtype = stack.qtype if stack is not None else None
        if ref.kind == "ple_shard":
            plan.ple[ref.target][ref.number] = (file, name, shape, nbytes, scale, qtype)
            continue
        if ref.kind == "whole":
            index, expected = (), dense
        else:
            index, expected = layout.expert_slot(ref, dense)
        if shape != tuple(expected):
            raise _shape_error(file, name, tuple(expected), shape)
        if (ref.number, ref.proj) in plan.covered[ref.target]:
            raise CheckpointError(f"{file}: tensor {name} fills {ref.target}, which another tensor already fills")
        plan.copies.append(_Copy(file, name, ref.target, index, nbytes, scale, qtype))
        plan.covered[ref.target].add((ref.number, ref.proj))
    for target, shards in plan.ple.items():
        stack = kept.get(target.removesuffix(".blocks"))
        _plan_ple(plan, target, shards, tuple(stack.shape if stack is not None else targets[target].shape))
    plan.unexpected += [f"{scale} ({file.name}: scales no float8 weight)" for scale, file in scales.items()
                        if scale not in used]
    return plan


def _plan_ple(plan: _Plan, target: str, shards: dict, table_shape: tuple[int, ...]) -> None:
    """PLE shards fill consecutive row ranges of the table, in numeric order; a gap in the numbering is an error."""
    row = 0
    for number in range(max(shards) + 1):
        if number not in shards:
            file, name, *_ = shards[min(n for n in shards if n > number)]
            raise CheckpointError(
                f"{file}: PLE table {target} has no shard_{number} before {name} "
                f"(shards found: {sorted(shards)}; they must be numbered 0..n-1)"
            )
        file, name, shape, nbytes, scale, qtype = shards[number]
        if tuple(shape[1:]) != table_shape[1:] or row + shape[0] > table_shape[0]:
            raise _shape_error(file, name, (min(shape[0], table_shape[0] - row), *table_shape[1:]), shape)
        plan.copies.append(_Copy(file, name, target, (slice(row, row + shape[0]),), nbytes, scale, qtype))
        row += shape[0]
    if row != table_shape[0]:
        file, name, *_ = shards[max(shards)]
        raise CheckpointError(
            f"{file}: PLE table {target} shards end at {name} with {row} rows, the model expects {table_shape[0]}"
        )
    plan.covered[target].add((-1, ""))


def _missing(plan: _Plan, targets: dict[str, torch.Tensor]) -> list[str]:
    missing = []
    for name, param in targets.items():
        got = plan.covered.get(name, set())
        dense = name.removesuffix(".blocks")          # a kept stack's blocks stand for its tensor
        if dense.endswith(".experts.gate_up_proj") or dense.endswith(".experts.down_proj"):
            projs = ("down",) if dense.endswith("down_proj") else ("gate", "up")
            base = dense.rsplit(".", 1)[0]
            missing += [
                f"{base}.{e}.{p}_proj.weight" for e in range(param.shape[0]) for p in projs if (e, p) not in got
            ]
        elif not got:
            missing.append(name)
    return missing


def _scale(opened, file: Path, scale: tuple[Path, str], device: str) -> torch.Tensor:
    """A float8 weight's scales: from the open file `opened` (of `file`) where they sit beside the weight, as they
    usually do, else from their own file (opened for this one small tensor)."""
    scale_file, name = scale
    if scale_file == file:
        return opened.get_tensor(name)
    with _opened(scale_file, device) as f:
        return f.get_tensor(name)


@torch.no_grad()
def load_weights(
    path: str | Path,
    module: torch.nn.Module,
    *,
    dtype: torch.dtype,
    device: str | torch.device | None = None,
    progress: bool = True,
    only: str | None = None,
) -> LoadReport:
    """Copy every checkpoint tensor into `module`'s parameters and buffers (runtime names) in place; with `only`
    (a name prefix, "mtp."), just the tensors and parameters under it (checkpoint_files' `only`).

    Floating tensors are cast to `dtype` as they are read (a parameter the module keeps in another dtype, such as
    an fp32 A_log, then receives its own dtype), a float8 weight of an FP8 checkpoint first dequantized by its
    block scales (fp8.py); int64 tensors stay int64. `device` is where tensors are staged
    after reading (default: cpu). Visual tensors are skipped, and so are mtp.* when the module has no MTP head.
    """
    start = time.perf_counter()
    root = _root(path)
    targets = {name: t for name, t in module.state_dict(keep_vars=True).items()
               if only is None or name.startswith(only)}
    block = fp8.block_size(read_config(path), str(root))
    kept = {name: m for name, m in module.named_modules() if isinstance(m, QuantizedStack)
            and (only is None or name.startswith(only))}
    files = checkpoint_files(path, only)
    if only is not None and not files:
        raise CheckpointError(f"{root}: no tensor of the checkpoint is named {only}*")
    plan = _plan(files, targets, block, kept)
    if plan.unexpected:
        raise CheckpointError(
            f"{root}: {len(plan.unexpected)} checkpoint tensors match nothing in the model: {_some(plan.unexpected)}"
        )
    missing = _missing(plan, targets)
    if missing:
        raise CheckpointError(f"{root}: {len(missing)} tensors the model needs are in no file: {_some(missing)}")
    report = plan.report
    if report.skipped_visual:
        logger.info("skipped %d vision tensors (model.visual.*) in %s", report.skipped_visual, root)
    if report.skipped_mtp:
        logger.info("skipped %d MTP tensors (mtp.*) in %s: the model has no mtp module", report.skipped_mtp, root)

    staging = str(device) if device is not None else "cpu"
    by_file: dict[Path, list[_Copy]] = defaultdict(list)
    for copy in plan.copies:
        by_file[copy.file].append(copy)
    bar = tqdm(total=sum(c.nbytes for c in plan.copies), unit="B", unit_scale=True, desc="loading weights",
               file=sys.stderr, disable=not progress)
    for file, copies in sorted(by_file.items()):
        with _opened(file, staging) as f:
            for copy in copies:
                tensor = f.get_tensor(copy.disk)
                if copy.scale is not None:       # the PLE table's shards have one global scale
                    table = layout.parse_disk_name(copy.disk).kind == "ple_shard"
                    scale, per = _scale(f, file, copy.scale, staging), None if table else block
                    fp8.check_scale(scale, tuple(tensor.shape), per, copy.disk,
                                    f"{copy.scale[0]}: {copy.scale[1]}")
                    tensor = fp8.to_blocks(tensor, scale, per, copy.kept) if copy.kept else \
                        fp8.dequantize(tensor, scale, per)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                param = targets[copy.target]
                (param[copy.index] if copy.index else param).copy_(tensor)
                report.tensors += 1
                report.bytes += copy.nbytes
                bar.update(copy.nbytes)
    bar.close()
    report.files = len(by_file)
    report.seconds = time.perf_counter() - start
    return report
