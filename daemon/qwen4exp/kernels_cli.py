"""`qwen4exp kernels`: compile every Triton kernel the engine launches for a model, for a GPU here or elsewhere.

On a machine without the GPU (CI, a laptop) it says whether the kernels build for gfx1201, gfx1151, sm_90 or
sm_80 and how much shared memory each asks for. On the GPU itself (`--target here`, the default there) the
binaries land in Triton's cache, where the engine's first prompt finds them instead of compiling.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _model(name: str, quant: str | None, mtp_weights: str | None = None):
    """(config, the weights kept quantized) of a preset at --quant, or of a checkpoint (a GGUF's own types, with the
    MTP head `mtp_weights` gives it)."""
    from .checkpoint.gguf_file import is_gguf
    from .checkpoint.gguf_writer import MIXES, ONE_TYPE
    from .checkpoint.presets import PRESET_NAMES, preset_config
    from .engine.loading import model_config
    from .engine.model.config import ModelConfig
    from .engine.model.kernel_launches import quantized_for
    from .model_dir import resolve_model

    if name in PRESET_NAMES and name != "tiny":
        if mtp_weights is not None:
            raise SystemExit("error: --mtp-weights gives a GGUF model its MTP head; a preset brings its own "
                             "(dense, or none at a --quant mix)")
        config = ModelConfig.from_dict(preset_config(name, dtype="bfloat16"), source=f"preset {name!r}")
        if quant is not None and quant not in MIXES + ONE_TYPE:
            raise SystemExit(f"error: --quant {quant!r}: choose one of {', '.join(MIXES + ONE_TYPE)}")
        return config, quantized_for(config, quant) if quant else {}
    if quant is not None:
        raise SystemExit("error: --quant goes with a preset (a checkpoint has its own types)")
    from .checkpoint.errors import CheckpointError
    try:
        path = str(resolve_model(name))
        config = model_config(path)
    except (CheckpointError, ValueError) as err:
        raise SystemExit(f"error: --model {name}: {err}") from None
    if mtp_weights is not None:
        from .checkpoint.mtp_weights import head_source
        if not is_gguf(path):
            raise SystemExit(f"error: --mtp-weights gives a GGUF model its MTP head; {path} is not a GGUF")
        try:
            head = head_source(mtp_weights, config, path)
        except CheckpointError as err:
            raise SystemExit(f"error: {err}") from None
        return head.cfg, quantized_for(config, path) | head.stacks
    return config, quantized_for(config, path) if is_gguf(path) else {}


def _targets(name: str | None):
    import torch

    from .kernels import guard

    if name is None:
        name = "here" if torch.cuda.is_available() else "all"
    if name == "all":
        return list(guard.CHECKED_TARGETS.values())
    if name == "here":
        if not torch.cuda.is_available():
            raise SystemExit("error: --target here: this machine has no CUDA or ROCm GPU; name a target "
                             f"({', '.join(guard.CHECKED_TARGETS)}) or 'all'")
        return [guard.target_of(torch.device("cuda", torch.cuda.current_device()))]
    if name not in guard.CHECKED_TARGETS:
        raise SystemExit(f"error: --target {name!r}: choose one of {', '.join(guard.CHECKED_TARGETS)}, all or here")
    return [guard.CHECKED_TARGETS[name]]


def cmd_kernels(args: argparse.Namespace) -> int:
    from .kernels import ahead_of_time, guard

    if guard.triton is None:
        raise SystemExit("error: Triton is not installed (it comes with torch's CUDA and ROCm wheels)")
    from .engine.model import kernel_launches

    config, quantized = _model(args.model, args.quant, args.mtp_weights)
    failures = 0
    rows = []
    for target in _targets(args.target):
        started = time.perf_counter()
        launches = kernel_launches.record(config, target, quantized=quantized)
        left_out = guard.NOT_BUILT.get(target.name, {})
        for launch in launches:
            build = ahead_of_time.build(launch, target)
            expected = launch.op in left_out
            failures += bool(build.error) and not expected
            rows.append({"target": target.name, "kernel": launch.describe(), "op": launch.op,
                         "shared_bytes": build.shared, "error": build.error, "left_out": expected})
            if not args.json:
                status = "ok" if not build.error else ("left out: " if expected else "FAILED: ") + build.error
                print(f"{target.name:8} {build.shared if build.shared is not None else '-':>6}  {status:4}  "
                      f"{launch.describe()}", flush=True)
        if not args.json:
            print(f"{target.name}: {len(launches)} kernel builds in {time.perf_counter() - started:.0f} s; "
                  f"torch forms there for: {', '.join(sorted(left_out)) or 'none'}")
    if args.json:
        json.dump({"model": args.model, "quant": args.quant, "builds": rows, "failed": failures}, sys.stdout, indent=1)
        print()
    return 1 if failures else 0


def add_parser(sub) -> None:
    kern = sub.add_parser("kernels", help="compile every Triton kernel the engine launches, for this GPU (warms "
                          "Triton's cache) or for the checked targets (no GPU needed)")
    kern.add_argument("--model", default="full", help="a checkpoint directory, a GGUF file, a Hugging Face id "
                      "(org/repo[:QUANT]) or a preset (bench, full; default: full): the shapes to compile for")
    kern.add_argument("--quant", default=None, help="with a preset: the GGUF mix (ud-q4_k_xl, q8_0, ...) or block "
                      "type (Q4_K, IQ4_NL, ...) whose quantized weights' kernels to compile")
    kern.add_argument("--mtp-weights", default=None, metavar="DIR", help="with a GGUF: the safetensors release whose "
                      "MTP head it serves (the profile key mtp_weights): the head's kernels too")
    kern.add_argument("--target", default=None, help="sm_90, sm_80, gfx1201, gfx1151, all, or here (default: here "
                      "on a GPU machine, else all)")
    kern.add_argument("--json", action="store_true", help="print one JSON document")
    kern.set_defaults(func=cmd_kernels)
