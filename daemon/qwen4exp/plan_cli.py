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
                      help="take model, device, dtype, slots, max_ctx, memory limit and snapshots from a profile; "
                           "the flags below override it")
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
                      help="where prefix snapshots live (auto: on the device for cpu and integrated GPUs, "
                           "else in host memory); on the device one full snapshot per slot is reserved")
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


def _snapshots_on_device(choice: str, device) -> bool:
    """--snapshots, or for "auto" the rule `serve` follows (engine/snapshot.py)."""
    if choice != "auto":
        return choice == "device"
    from .engine.snapshot import snapshots_share_device_memory
    return snapshots_share_device_memory(device)


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


def _fill_from_profile(args: argparse.Namespace) -> None:
    """Flags given on the command line win; the rest come from --profile, else the defaults."""
    values = {"model": "tiny", "device": "auto", "dtype": "auto", "slots": 4, "max_ctx": "auto", "chunk": "auto",
              "snapshots": "auto", "device_memory_limit": None}
    if args.profile is not None:
        from .config import ConfigError, load_settings
        try:
            settings = load_settings(args.profile)
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
        target, keeper = settings.target, settings.snapshot_device
        limit = settings.memory_limit_for(target)
        values.update(model=settings.model, device=target.name, dtype=settings.dtype, slots=settings.slots,
                      max_ctx=str(settings.max_ctx), chunk=str(settings.chunk_tokens),
                      device_memory_limit=None if limit is None else str(limit),
                      snapshots="auto" if keeper is None else ("host" if keeper.name == "cpu" and
                                                               target.name != "cpu" else "device"))
    for key, value in values.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def cmd_plan(args: argparse.Namespace) -> int:
    from .model_dir import resolve_model
    from .engine.fit import FitError, fit_context, floor_chunk, resolve_max_ctx
    from .engine.loading import load_model, resolve_device
    from .engine.memory import as_device, set_device_memory_limit

    _fill_from_profile(args)
    try:
        limit = parse_limit(args.device_memory_limit)
        device = as_device(resolve_device(args.device))
        chunk = _chunk(args.chunk, device)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    model_dir = resolve_model(args.model)
    model = load_model(str(model_dir), dtype=dtype, device=device, progress=not args.json)
    snapshots = _snapshots_on_device(args.snapshots, device)
    settings: dict[str, Any] = dict(slots=args.slots, device=device, snapshots_on_device=snapshots,
                                    chunk_floor=floor_chunk(chunk), memory_limit=limit, headroom=args.headroom,
                                    verify=not args.no_verify)
    try:
        if limit is not None:
            set_device_memory_limit(device, limit)
        choice = resolve_max_ctx(args.max_ctx, model, **settings)
        # A given number is checked, not searched: the search starts and ends there.
        result = choice.fit or fit_context(model, trained=choice.context, step=choice.context,
                                           floor=choice.context, **settings)
    except (FitError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    header = {"model": str(model_dir), "device": str(device), "dtype": dtype, "slots": args.slots,
              "max_ctx": args.max_ctx, "chunk": chunk, "device_memory_limit": limit,
              "snapshots": "device" if snapshots else "host"}
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
