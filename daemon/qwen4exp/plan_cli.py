"""`qwen4exp plan`: fit the context on the real device and print the budget and every probe, without serving; with
`--estimate`, plan for a box that is not this one from the model's config alone (engine/fit_estimate.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _dtype_name(text: str) -> str:
    """A profile's dtype spellings: bf16 and fp32 are bfloat16 and float32."""
    return {"bf16": "bfloat16", "fp32": "float32"}.get(text.lower(), text.lower())


def _headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 0.5:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction from 0 to 0.5")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    plan = subparsers.add_parser(
        "plan", help="measure the model on the device and print the memory plan (fitted context, budget, "
                     "probes) without serving; --estimate plans for another box without weights or a device")
    plan.add_argument("--profile", default=None,
                      help="fit for the engine `serve` builds from a profile (model, device, dtype, slots, max_ctx, "
                           "chunk, memory limit); the flags below override it")
    plan.add_argument("--model", default=None, help="checkpoint directory, .gguf file, Hugging Face id "
                      "(org/repo, org/repo:QUANT), or 'tiny' (default)")
    plan.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default); with --estimate the "
                      "target's kind: cuda (the default; ROCm GPUs too) or cpu")
    plan.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None, type=_dtype_name,
                      help="weights and caches dtype, as a profile's `dtype` (bf16 and fp32 too; auto: bfloat16 on "
                           "cuda, float32 on cpu)")
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
    plan.add_argument("--headroom", type=_headroom, default=None,
                      help="fraction of each device's memory kept free (the profile's `headroom`, else 0.1)")
    plan.add_argument("--no-verify", action="store_true",
                      help="skip allocating every slot at the answer to check it for real")
    plan.add_argument("--ple", choices=["auto", "device", "host"], default=None,
                      help="where a GGUF's quantized PLE table lives (auto: host memory when that fits a longer "
                           "context on a GPU)")
    plan.add_argument("--mtp-weights", default=None, metavar="DIR",
                      help="a GGUF model's MTP head: the directory of a safetensors release of the same model "
                           "(default: the profile's mtp_weights)")
    plan.add_argument("--json", action="store_true", help="print one JSON document")
    estimate = plan.add_argument_group(
        "estimate", "plan for a box that is not this one: the model's config and quantization alone, no weights "
                    "loaded, no device touched, nothing verified (docs/MEMORY.md)")
    estimate.add_argument("--estimate", action="store_true",
                          help="estimate instead of measuring; --model may also be a preset, bench or full")
    estimate.add_argument("--devices", default=None, metavar="target=SIZE[,split=SIZE...]",
                          help="each device's total memory (as torch or nvidia-smi report it), e.g. "
                               "target=32GiB,split=128GiB; else the profile's per-device `memory`")
    estimate.add_argument("--quant", default=None, metavar="MIX",
                          help="a preset's or checkpoint directory's weights as a GGUF of this mix would load "
                               "(ud-q4_k_xl, q8_0, bf16, f32, or one block type such as Q4_K), or as Qwen's FP8 "
                               "checkpoint would (fp8); a .gguf file's types come from its header, an FP8 "
                               "checkpoint directory's from its config")
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
    if chunk % 4:
        raise ValueError(f"--chunk must be a multiple of 4 tokens (the QSA block), as serve takes it; got {chunk}")
    return chunk


def _config(args: argparse.Namespace):
    """The engine plan fits for: the one `serve` builds from --profile (EngineConfig.from_settings), else the
    defaults below; the flags given on the command line win. Returns (config, device)."""
    from dataclasses import replace

    from .engine.engine_config import EngineConfig
    from .model_dir import resolve_head, resolve_model

    if args.profile is not None:
        from .config import ConfigError, load_settings
        try:
            config = EngineConfig.from_settings(load_settings(args.profile))
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
    else:
        config = EngineConfig(model=str(resolve_model("tiny")), device="auto", dtype="auto", slots=4, max_ctx="auto")
    flags = {"model": None if args.model is None else str(resolve_model(args.model)), "device": args.device,
             "dtype": args.dtype, "slots": args.slots, "ple": args.ple,
             "max_ctx": None if args.max_ctx is None else _max_ctx(args.max_ctx),
             "device_memory_limit": parse_limit(args.device_memory_limit), "headroom": args.headroom}
    config = replace(config, **{key: value for key, value in flags.items() if value is not None})
    if args.mtp_weights is not None:
        config = replace(config, mtp_weights=str(resolve_head(args.mtp_weights)))
    device = config.torch_device()
    if args.chunk is not None or args.profile is None:
        config = replace(config, chunk=_chunk(args.chunk or "auto", device))
    return config, device


def cmd_plan(args: argparse.Namespace) -> int:
    if args.estimate:
        return cmd_estimate(args)
    for flag in ("devices", "quant"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"error: --{flag} is for --estimate; `plan` alone measures this box's device")
    from .engine.fit import FitError, fit_context

    try:
        config, device = _config(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        _, model = config.load_model(progress=not args.json)
    except ValueError as err:            # a checkpoint or head that does not load (CheckpointError), said plainly
        raise SystemExit(f"error: {err}") from None
    # What plan asks beyond the engine's own settings: whether to verify the answer, and
    # where snapshots would live (--snapshots; "auto" is where `serve` puts them).
    extra: dict[str, Any] = dict(verify=not args.no_verify)
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
              "headroom": config.headroom, "snapshots": "device" if settings["snapshots_on_device"] else "host",
              "hot_experts": config.hot_experts}
    if args.json:
        print(json.dumps(_as_json(header, result)))
    else:
        print(_as_text(header, result))
    return 0


def _measured_json(m) -> dict[str, Any]:
    return {"device": m.device, "capacity": m.capacity, "capacity_source": m.capacity_source, "weights": m.weights,
            "slot_bytes_per_position": m.slot_bytes_per_position, "slot_fixed": m.slot_fixed,
            "workspace": [list(s) for s in m.workspace]}


def _as_json(header: dict[str, Any], result) -> dict[str, Any]:
    return {**header, "context": result.context, "chunk": result.chunk, "seconds": round(result.seconds, 3),
            "measured": _measured_json(result.measured),
            "measured_split": [_measured_json(m) for m in result.split],
            "verifications": [{"device": v.device, "context": v.context, "rows": v.rows, "needed": v.needed,
                               "available": v.available, "fits": v.fits, "out_of_memory": v.out_of_memory}
                              for v in result.verifications],
            "notes": result.notes, "plan": result.plan.to_dict()}


def _as_text(header: dict[str, Any], result) -> str:
    from .engine.memory import human_size

    shown = dict(header, device_memory_limit=human_size(header["device_memory_limit"])
                 if header["device_memory_limit"] is not None else None)
    lines = [" ".join(f"{k}={v}" for k, v in shown.items() if v is not None), "",
             f"serving: context {result.context}, prompt chunk {result.chunk} rows "
             f"(fitted in {result.seconds:.1f} s)", "", result.plan.table().rstrip()]
    for m in (result.measured, *result.split):
        lines += ["", f"measured on {m.device}:",
                  f"- capacity {human_size(m.capacity)} ({m.capacity_source})",
                  f"- weights {human_size(m.weights)}",
                  f"- one slot: {m.slot_bytes_per_position} B/position + {human_size(m.slot_fixed)} fixed"
                  + (" (a snapshot of P positions is the same size as a slot of capacity P)" if not result.split
                     else "")]
        lines += [f"- floor chunk workspace at {pos}: {human_size(ws)}" for pos, ws in m.workspace]
    if result.split:
        lines.append("")
    for v in result.verifications:
        verdict = "out of memory" if v.out_of_memory else ("fits" if v.fits else "miss")
        where = f" on {v.device}" if result.split else ""
        lines.append(f"- verified {v.context}{where} with a {v.rows}-row chunk at the last position: needed "
                     f"{human_size(v.needed)} of {human_size(v.available)}: {verdict}")
    if not result.verifications:
        lines.append("- not verified (--no-verify)")
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines)


# ---- --estimate ----------------------------------------------------------------------------------------------------
def _estimate_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """--estimate's settings: the flags, else the profile's, else the defaults (4 slots, max_ctx auto, the chunk
    profiles take on the target's kind, ple auto)."""
    from .config.schema import AUTO_CHUNK
    from .engine.fit_estimate import EstimateError, parse_devices, profile_devices

    settings = None
    if args.profile is not None:
        from .config import ConfigError, load_settings
        try:
            settings = load_settings(args.profile)
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
    device = args.device if args.device is not None else (settings.target.kind if settings else "cuda")
    kind = device.split(":")[0].strip().lower()
    kind = "cuda" if kind == "auto" else kind             # another box: "the GPU when there is one"
    if kind not in ("cuda", "cpu"):
        raise EstimateError(f"--device {device!r}: with --estimate the target is cuda (ROCm GPUs too) or cpu")
    limit = parse_limit(args.device_memory_limit)
    if args.devices is not None:
        target, splits = parse_devices(args.devices, kind, limit)
    elif settings is not None:
        target, splits = profile_devices(settings)
        if limit is not None:
            from dataclasses import replace
            target = replace(target, limit=limit)
    else:
        raise EstimateError("--estimate needs each device's memory: --devices target=32GiB[,split=128GiB], or a "
                            "--profile whose devices say `memory`")
    dtype = args.dtype or (settings.dtype if settings else "auto")
    if dtype == "auto":
        dtype = "bfloat16" if kind == "cuda" else "float32"
    if args.chunk is not None:
        chunk = AUTO_CHUNK[kind] if args.chunk == "auto" else _chunk(args.chunk, None)
    else:
        chunk = settings.chunk_tokens if settings else AUTO_CHUNK[kind]
    snapshots = None if args.snapshots in (None, "auto") else args.snapshots == "device"
    if snapshots is None and settings is not None and settings.snapshot_device is not None:
        snapshots = settings.snapshot_device.name == settings.target.name
    return dict(model=args.model or (settings.model if settings else "tiny"), dtype=dtype, target=target,
                splits=splits, slots=args.slots if args.slots is not None else (settings.slots if settings else 4),
                max_ctx=_max_ctx(args.max_ctx) if args.max_ctx is not None else (settings.max_ctx if settings
                                                                                  else "auto"),
                chunk=chunk, ple=args.ple or (settings.ple if settings else "auto"), snapshots=snapshots,
                mtp=settings.mtp if settings else "auto", hot_experts=settings.hot_experts if settings else 0,
                mtp_weights=args.mtp_weights or (settings.mtp_weights if settings else None),
                headroom=args.headroom if args.headroom is not None else (settings.headroom if settings else 0.1))


def cmd_estimate(args: argparse.Namespace) -> int:
    """`plan --estimate`: the plan from the config alone; torch is used on its meta device only."""
    from .engine.fit_estimate import EstimateError, estimate_plan, model_facts

    try:
        inputs = _estimate_inputs(args)
        facts = model_facts(inputs["model"], args.quant, inputs["dtype"], mtp_weights=inputs["mtp_weights"])
        est = estimate_plan(facts, inputs["target"], inputs["splits"], slots=inputs["slots"], chunk=inputs["chunk"],
                            ple=inputs["ple"], headroom=inputs["headroom"], snapshots_on_device=inputs["snapshots"],
                            max_ctx=inputs["max_ctx"], mtp=inputs["mtp"], hot_experts=inputs["hot_experts"])
    except (EstimateError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print(json.dumps(estimate_json(est)) if args.json else estimate_text(est))
    return 0


def _fit_json(fit) -> dict[str, Any]:
    return {"ple": fit.ple, "weights_on_target": fit.weights, "context": fit.context, "chunk": fit.chunk,
            "error": fit.error, "workspace": [list(s) for s in fit.samples],
            "split_layers": {name: {"first": a, "last": b, "bytes": n} for name, (a, b, n) in fit.split_layers.items()},
            "plan": fit.plan.to_dict() if fit.plan is not None else None}


def estimate_json(est) -> dict[str, Any]:
    from .engine.fit_estimate import chunk_workspace

    # What `serve` gets: with split devices, the split (the target alone is beside it).
    f, fit = est.facts, est.split or est.fit
    at = fit.context if fit.context is not None else None
    return {"estimate": True, "model": f.label, "quant": f.quant, "dtype": f.dtype, "backend": est.backend,
            "slots": est.slots, "chunk_asked": est.chunk, "chunk_floor": est.chunk_floor, "headroom": est.headroom,
            "snapshots": "device" if est.snapshots_on_device else "host", "ple_setting": est.ple,
            "devices": [{"role": d.role, "name": d.name, "kind": d.kind, "total": d.total, "limit": d.limit,
                         "reserved": d.reserved, "capacity": d.capacity} for d in (est.target, *est.splits)],
            "components": {"weights": f.weights, "ple_table": f.ple_table, "slot_bytes_per_position": f.per_position,
                           "slot_fixed": f.fixed + est.drafts * f.carried, "dense_expert_stacks": f.dense_stacks,
                           "workspace_terms_at_answer": chunk_workspace(f, est.backend, at, est.chunk_floor)
                           if at is not None else None},
            "context": fit.context, "chunk": fit.chunk, "ple": fit.ple, "error": fit.error,
            "host_memory_for_ple": f.ple_table if fit.ple == "host" else 0,
            "tried": [_fit_json(t) for t in est.tried], "plan": fit.plan.to_dict() if fit.plan is not None else None,
            "target_alone": None if est.split is None else _fit_json(est.fit),
            "split": None if est.split is None else {**_fit_json(est.split), "served": True,
                                                      "tried": [_fit_json(t) for t in est.split_tried]},
            "notes": est.notes}


def estimate_text(est) -> str:
    from .engine.fit_estimate import chunk_workspace
    from .engine.memory import human_size

    f, fit = est.facts, est.fit
    where = {"device": "on the device", "host": "in host memory", "none": "not quantized: on the device"}
    lines = [f"model={f.label} quant={f.quant} dtype={f.dtype} backend={est.backend} slots={est.slots} "
             f"chunk={est.chunk} (floor {est.chunk_floor}) snapshots={'device' if est.snapshots_on_device else 'host'} "
             f"ple={est.ple} headroom={est.headroom:.0%}",
             "estimate: from the config alone; no weights loaded, no device touched, nothing verified", "",
             f"target: {est.target.describe()}: capacity {human_size(est.target.capacity)}"]
    alone = "serving" if est.split is None else "the target alone (no split)"
    if fit.context is not None:
        lines += [f"{alone}: context {fit.context} a slot, prompt chunk {fit.chunk} rows, PLE table {where[fit.ple]}"
                  + (f" ({human_size(f.ple_table)} of host memory)" if fit.ple == "host" else ""), "",
                  fit.plan.table().rstrip()]
    else:
        lines.append(f"{alone}: no context fits: {fit.error}")
    lines += ["", "estimated inputs:",
              f"- weights {human_size(f.weights)}" + (f", of which the PLE table {human_size(f.ple_table)}"
                                                       if f.ple_table else "")
              + f"; on the target {human_size(fit.weights)}",
              f"- one slot: {f.per_position} B/position + {human_size(f.fixed)} fixed"]
    for position, size in fit.samples:
        lines.append(f"- floor chunk workspace at {position}: {human_size(size)}")
    if fit.context is not None:
        terms = chunk_workspace(f, est.backend, fit.context, est.chunk_floor)
        lines.append(f"- at {fit.context}: " + ", ".join(f"{k} {human_size(v)}" for k, v in terms.items()))
    for tried in est.tried:
        answer = f"context {tried.context}, chunk {tried.chunk}" if tried.context is not None else tried.error
        lines.append(f"- tried: PLE table {where[tried.ple]}: {answer}")
    lines += [f"- {note}" for note in est.notes]
    if est.split is not None:
        s = est.split
        lines += ["", "split devices: served with the layers placed as the planner chose them (the most context; "
                      "the fewest layers off the target on a tie); each layer's caches sit with it, and the chunk "
                      "runs on every device. `serve` chooses again from the memory each device has free:"]
        for split in est.splits:
            held = s.split_layers.get(split.name)
            lines.append(f"- {split.describe()}: " + (f"layers {held[0]}..{held[1]} ({human_size(held[2])})" if held
                                                      else "no layers (the target holds them)"))
        lines.append(f"- the target keeps {human_size(s.weights)} of weights (the embedding, the LM head, the MTP "
                     f"head and the layers not split off), their caches and every slot's snapshots where they live")
        for tried in est.split_tried:
            answer = f"context {tried.context}, chunk {tried.chunk}" if tried.context is not None else tried.error
            lines.append(f"- tried: PLE table {where[tried.ple]}: {answer}")
        lines.append(f"serving: context {s.context} a slot, prompt chunk {s.chunk} rows, PLE table {where[s.ple]}"
                     if s.context is not None else f"serving: no context fits: {s.error}")
        if s.plan is not None:
            lines += ["", s.plan.table().rstrip()]
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
