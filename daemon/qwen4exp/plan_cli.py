"""`qwen4exp plan`: fit the context on the real device and print the budget and every probe, without serving."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers) -> argparse.ArgumentParser:
    plan = subparsers.add_parser(
        "plan", help="measure the model on the device and print the memory plan (fitted context, budget, "
                     "probes) without serving")
    plan.add_argument("--profile", default=None,
                      help="fit for the engine `serve` builds from a profile (model, device, dtype, slots, max_ctx, "
                           "chunk, memory limit); the flags below override it")
    plan.add_argument("--model", default=None, help="checkpoint directory, or 'tiny' (default)")
    plan.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default)")
    plan.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                      help="weights and caches dtype (auto: bfloat16 on cuda, float32 on cpu)")
    plan.add_argument("--slots", type=int, default=None, help="slots, each at the full context (default 4)")
    plan.add_argument("--max-ctx", default=None,
                      help="'auto' fits the context; a number is checked against the budget instead")
    plan.add_argument("--chunk", default=None,
                      help="the serving prompt chunk in tokens, or 'auto' (2048 on a GPU, 64 on the CPU): the fit "
                           "holds it, rounded up to the planner's 256-row granule, at the last position")
    plan.add_argument("--device-memory-limit", default=None, metavar="SIZE",
                      help="cap this process's memory on the device, e.g. 32GiB, 512MiB, 1.5GB or bytes")
    plan.add_argument("--snapshots", choices=["auto", "host", "device"], default=None,
                      help="where prefix snapshots live (auto: where serve puts them, on the device for cpu and "
                           "integrated GPUs, else in host memory); on the device one full snapshot per slot is "
                           "reserved")
    plan.add_argument("--headroom", type=float, default=0.1, help="fraction of capacity kept free (0.1)")
    plan.add_argument("--no-verify", action="store_true",
                      help="skip allocating every slot at the answer to check it for real")
    plan.add_argument("--json", action="store_true", help="print one JSON document")
    plan.set_defaults(func=cmd_plan)
    return plan


def parse_limit(text: str | None) -> int | None:
    """--device-memory-limit in bytes: read as profiles read sizes ("32GiB", "512MiB", "1.5GB", "32G", bytes)."""
    from .config.sizes import parse_size

    if text is None:
        return None
    try:
        limit = parse_size(text)
    except ValueError as err:
        raise ValueError(f"--device-memory-limit: {err}") from None
    if limit <= 0:
        raise ValueError(f"--device-memory-limit must be more than 0 bytes, got {text!r}")
    return limit


def _max_ctx(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--max-ctx must be 'auto' or a number of positions, got {text!r}") from None


def _chunk(choice: str, device) -> int:
    """--chunk, or for "auto" the rule profiles follow (config/schema.py's AUTO_CHUNK)."""
    from .config.schema import AUTO_CHUNK
    if choice == "auto":
        return AUTO_CHUNK[device.type]
    try:
        chunk = int(choice)
    except ValueError:
        raise ValueError(f"--chunk must be 'auto' or a number of tokens, got {choice!r}") from None
    if chunk <= 0:
        raise ValueError(f"--chunk must be more than 0 tokens, got {chunk}")
    return chunk


def _config(args: argparse.Namespace):
    """The engine plan fits for: the one `serve` builds from --profile (EngineConfig.from_settings), else the
    defaults below; the flags given on the command line win. Returns (config, device)."""
    from dataclasses import replace

    from .engine.engine_config import EngineConfig
    from .model_dir import resolve_model

    if args.profile is not None:
        from .config import ConfigError, load_settings
        try:
            config = EngineConfig.from_settings(load_settings(args.profile))
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
    else:
        config = EngineConfig(model=str(resolve_model("tiny")), device="auto", dtype="auto", slots=4, max_ctx="auto")
    flags = {"model": None if args.model is None else str(resolve_model(args.model)), "device": args.device,
             "dtype": args.dtype, "slots": args.slots,
             "max_ctx": None if args.max_ctx is None else _max_ctx(args.max_ctx),
             "device_memory_limit": parse_limit(args.device_memory_limit)}
    config = replace(config, **{key: value for key, value in flags.items() if value is not None})
    device = config.torch_device()
    if args.chunk is not None or args.profile is None:
        config = replace(config, chunk=_chunk(args.chunk or "auto", device))
    return config, device


def cmd_plan(args: argparse.Namespace) -> int:
    from .engine.fit import FitError, fit_context

    try:
        config, device = _config(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    _, model = config.load_model(progress=not args.json)
    # What plan asks beyond the engine's own settings: the margin kept free, whether to verify the answer, and
    # where snapshots would live (--snapshots; "auto" is where `serve` puts them).
    extra: dict[str, Any] = dict(headroom=args.headroom, verify=not args.no_verify)
    if args.snapshots not in (None, "auto"):
        extra["snapshots_on_device"] = args.snapshots == "device"
    settings = config.fit_settings(device) | extra
    try:
        choice = config.resolve_context(model, device, **extra)
        # A given number is checked, not searched: the search starts and ends there.
        result = choice.fit or fit_context(model, trained=choice.context, step=choice.context,
                                           floor=choice.context, **settings)
    except (FitError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    header = {"model": config.model, "device": str(device), "dtype": config.dtype_on(device), "slots": config.slots,
              "max_ctx": config.max_ctx, "chunk": config.chunk, "device_memory_limit": config.device_memory_limit,
              "snapshots": "device" if settings["snapshots_on_device"] else "host"}
    if args.json:
        print(json.dumps(_as_json(header, result)))
    else:
        print(_as_text(header, result))
    return 0


def _as_json(header: dict[str, Any], result) -> dict[str, Any]:
    m = result.measured
    return {**header, "context": result.context, "chunk": result.chunk, "seconds": round(result.seconds, 3),
            "measured": {"capacity": m.capacity, "capacity_source": m.capacity_source, "weights": m.weights,
                         "slot_bytes_per_position": m.slot_bytes_per_position, "slot_fixed": m.slot_fixed,
                         "workspace": [list(s) for s in m.workspace]},
            "verifications": [{"context": v.context, "rows": v.rows, "needed": v.needed,
                               "available": v.available, "fits": v.fits, "out_of_memory": v.out_of_memory}
                              for v in result.verifications],
            "notes": result.notes, "plan": result.plan.to_dict()}


def _as_text(header: dict[str, Any], result) -> str:
    from .engine.memory import human_size

    m = result.measured
    shown = dict(header, device_memory_limit=human_size(header["device_memory_limit"])
                 if header["device_memory_limit"] is not None else None)
    lines = [" ".join(f"{k}={v}" for k, v in shown.items() if v is not None), "",
             f"serving: context {result.context}, prompt chunk {result.chunk} rows "
             f"(fitted in {result.seconds:.1f} s)", "", result.plan.table().rstrip(), "",
             f"measured on {m.device}:",
             f"- capacity {human_size(m.capacity)} ({m.capacity_source})",
             f"- weights {human_size(m.weights)}",
             f"- one slot: {m.slot_bytes_per_position} B/position + {human_size(m.slot_fixed)} fixed "
             f"(a snapshot of P positions is the same size as a slot of capacity P)"]
    lines += [f"- floor chunk workspace at {pos}: {human_size(ws)}" for pos, ws in m.workspace]
    for v in result.verifications:
        verdict = "out of memory" if v.out_of_memory else ("fits" if v.fits else "miss")
        lines.append(f"- verified {v.context} with a {v.rows}-row chunk at the last position: needed "
                     f"{human_size(v.needed)} of {human_size(v.available)}: {verdict}")
    if not result.verifications:
        lines.append("- not verified (--no-verify)")
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run `plan` alone (until cli.py wires `add_parser` in): `python -m qwen4exp.plan_cli --model tiny`."""
    parser = argparse.ArgumentParser(prog="qwen4exp")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
