"""The `qwen4exp` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

PRESET_MODELS = ("tiny", "bench", "full")
MTP_WEIGHTS_HELP = ("a GGUF model's MTP head: the directory or Hugging Face id of a safetensors release of the same "
                    "model (of which config.json, the index and the shards holding mtp.* are read)")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise SystemExit(f"error: --prompt-ids must be comma-separated integers: {err}") from None


GENERATE_OVERRIDES = {"model": "model", "chunk": "chunk", "dtype": "dtype", "slots": "slots", "context": "max_ctx",
                      "mtp": "mtp", "mtp_weights": "mtp_weights"}


def cmd_generate(args: argparse.Namespace) -> int:
    """Run the prompt (or every request of --prompts-file) through an engine built from the profile as `serve`
    builds it: same chunk grid, same decode step, so an answer here is the answer the daemon serves."""
    import time
    from dataclasses import replace

    import torch

    from .engine.engine import Engine
    from .engine.engine_config import EngineConfig
    from .engine.request import RequestRejected
    from .tokenizer import Tokenizer

    if args.max_tokens < 1:
        raise SystemExit(f"error: --max-tokens must be at least 1, got {args.max_tokens}")
    if args.slots is None and args.prompts_file is None:
        args.slots = 1
    overrides = {}
    if args.device is not None:
        from .engine.loading import resolve_device
        try:
            device = str(resolve_device(args.device))
        except (RuntimeError, ValueError) as err:
            raise SystemExit(f"error: --device: {err}") from None
        overrides["devices"] = [{"name": device, "role": "target"}]
    config = EngineConfig.from_settings(_settings(args, GENERATE_OVERRIDES, overrides))
    try:
        tokenizer = Tokenizer.from_path(config.model)      # for a GGUF, the first read of the file
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    requests = _generate_requests(args, tokenizer)
    # A context the command line did not give is what the requests need, in whole chunks: the context only sizes
    # the slots (a request's numbers do not depend on it), and fitting one to the device would cost more than
    # the answers.
    context = config.max_ctx if args.context is not None else \
        -(-max(len(r.prompt_ids) + r.max_tokens for r in requests) // config.chunk) * config.chunk
    config = replace(config, queue_limit=max(config.queue_limit, len(requests)))
    if args.context is None:
        _check_trained_context(args, requests, config.model)
    try:
        _, model = config.load_model(progress=not args.json)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        engine = Engine.from_config(model, config, context=context, tokenizer=tokenizer)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    except (MemoryError, RuntimeError) as err:     # the slots' states allocated for the context
        # A GPU's refusal is torch.OutOfMemoryError; the CPU allocator's a plain RuntimeError saying so.
        if not isinstance(err, (torch.OutOfMemoryError, MemoryError)) and "can't allocate memory" not in str(err):
            raise
        raise SystemExit(f"error: {config.slots} slot(s) of {context} positions do not fit in memory "
                         f"({str(err).splitlines()[0]}); lower the max tokens or --slots") from None
    if args.prompts_file is None and not args.json:
        _stream_to_stdout(requests[0])
    started = time.perf_counter()
    for number, request in enumerate(requests, start=1):
        try:
            engine.submit(request)
        except RequestRejected as err:
            where = f"{args.prompts_file} request {number}: " if args.prompts_file is not None else ""
            raise SystemExit(f"error: {where}{err}") from None
    engine.run_until_idle()
    wall = time.perf_counter() - started
    if args.prompts_file is None:
        return _print_answer(args, requests[0])
    answers = [{"index": i, "prompt_tokens": len(r.prompt_ids), "token_ids": r.output_ids, "text": r.text,
                "finish_reason": r.finish_reason.value, "error": r.error, "timings": r.timings(),
                "mtp": {"drafted": r.mtp_drafted, "accepted": r.mtp_accepted}}
               for i, r in enumerate(requests)]
    if args.json:
        print(json.dumps({"slots": config.slots, "context": context, "chunk": config.chunk, "wall_s": round(wall, 3),
                          "generated_tokens": sum(len(r.output_ids) for r in requests), "answers": answers}))
        return 0
    for answer in answers:
        print(f"### {answer['index']}: {answer['prompt_tokens']} prompt tokens, {len(answer['token_ids'])} generated, "
              f"{answer['finish_reason']}{' (' + answer['error'] + ')' if answer['error'] else ''}")
        print(answer["text"])
        print(f"ids: {answer['token_ids']}")
        print(f"timings: {answer['timings']}\n")
    return 0


def _generate_requests(args: argparse.Namespace, tokenizer) -> list:
    """The requests of --prompts-file, or the one of --prompt / --prompt-ids as the daemon's /generate (or, with
    --chat, /v1/chat/completions) would make it."""
    from .engine.request import Request
    from .engine.sampling import SamplingParams
    from .prompts_file import PromptsFileError, read_requests

    eos = () if args.ignore_eos else tuple(tokenizer.eos_token_ids)
    if args.prompts_file is not None:
        try:
            return read_requests(args.prompts_file, tokenizer, args.max_tokens, eos)
        except PromptsFileError as err:
            raise SystemExit(f"error: {err}") from None
    if args.prompt_ids is not None:
        prompt_ids = _parse_ids(args.prompt_ids)
    elif args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    try:
        sampling = SamplingParams(temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    return [Request(prompt_ids=prompt_ids, max_tokens=args.max_tokens, sampling=sampling, stop_token_ids=eos)]


def _stream_to_stdout(request) -> None:
    """Print the answer's text as it is made; the detokenizer's last held-back bytes come with the finish."""
    printed = 0

    def write(text: str) -> None:
        nonlocal printed
        sys.stdout.write(text)
        sys.stdout.flush()
        printed += len(text)

    request.on_token = lambda r, token, delta: write(delta)
    request.on_finish = lambda r: write(r.text[printed:])


def _print_answer(args: argparse.Namespace, request) -> int:
    if request.error is not None:
        raise SystemExit(f"error: {request.error}")
    timings = request.timings()
    prefill_ms = timings["prefill_ms"]
    prefill_rate = round(len(request.prompt_ids) / prefill_ms * 1000, 2) if prefill_ms else None
    if args.json:
        print(json.dumps({
            "prompt_tokens": len(request.prompt_ids),
            "token_ids": request.output_ids,
            "text": request.text,
            "finish_reason": request.finish_reason.value,
            "mtp": {"drafted": request.mtp_drafted, "accepted": request.mtp_accepted},
            "timings": {"prefill_ms": prefill_ms, "prefill_tokens_per_s": prefill_rate,
                        "decode_ms": timings["decode_ms"], "decode_tokens_per_s": timings["decode_tokens_per_s"]},
        }))
    else:
        rate = timings["decode_tokens_per_s"]
        print(f"\n[{len(request.output_ids)} tokens, {request.finish_reason.value}; prefill {len(request.prompt_ids)} "
              f"tokens in {prefill_ms:.1f} ms, decode {f'{rate:.1f} tok/s' if rate else 'none'}]", file=sys.stderr)
    return 0


def _settings(args: argparse.Namespace, keys: dict[str, str], extra: dict | None = None):
    """The effective settings: command line (--set key=value, then the dedicated flags and `extra`) > environment >
    profile > defaults."""
    from .config import ConfigError, load_settings, parse_assignments
    try:
        overrides = parse_assignments(getattr(args, "set", None) or [])
        overrides |= {key: getattr(args, attr) for attr, key in keys.items() if getattr(args, attr, None) is not None}
        return load_settings(args.profile, overrides=overrides | (extra or {}))
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None


SERVE_OVERRIDES = {"model": "model", "host": "server.host", "port": "server.port", "max_ctx": "max_ctx",
                   "slots": "slots", "chunk": "chunk", "dtype": "dtype", "mtp": "mtp", "mtp_weights": "mtp_weights"}


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from .config import ConfigError, explain
    from .config.check import check_model_files
    from .engine.engine_config import EngineConfig
    from .server.sd_notify import Notifier
    from .server.serve import ListenError, serve
    from .server.shared import ServerOptions

    settings = _settings(args, SERVE_OVERRIDES)
    logging.getLogger().setLevel(settings.log_level.upper())
    # A model named by Hugging Face id may be downloaded here, before the engine loads: as long as that takes.
    with Notifier().extending_start(f"fetching the model {settings.model}"):
        engine = EngineConfig.from_settings(settings)
    options = ServerOptions.from_settings(settings)
    host, port = settings.server.host, settings.server.port
    # What would stop the daemon once the model is loaded, said before: the files' headers and tokenizer, and the
    # address (another server on the port).
    try:
        check_model_files(engine.model, dict((key, source) for key, _, source in explain(settings))["model"])
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    _check_address(host, port)
    print(f"qwen4exp: profile {settings.profile_path or 'defaults'}; loading {engine.model} ...", file=sys.stderr)
    try:
        asyncio.run(serve(engine, options, host, port,
                          on_ready=lambda app: print(f"qwen4exp: serving on http://{host}:{port}", file=sys.stderr)))
    except ListenError as err:        # the address taken meanwhile
        raise SystemExit(f"error: {err}") from None
    return 0


def _check_trained_context(args: argparse.Namespace, requests, model: str) -> None:
    """Refuse, before the load, a request longer than the model's trained context (read from the headers): the
    slots would be sized to it."""
    from .engine.loading import model_config

    try:
        trained = model_config(model).max_position_embeddings
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    for number, request in enumerate(requests, start=1):
        if len(request.prompt_ids) + request.max_tokens > trained:
            where = f"{args.prompts_file} request {number}: " if args.prompts_file is not None else ""
            raise SystemExit(f"error: {where}a prompt of {len(request.prompt_ids)} tokens + max tokens "
                             f"{request.max_tokens} is past the model's trained context of {trained} positions")


def _check_address(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (a name that does not resolve, a port another process
    listens on), as the server's own socket would be opened."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise SystemExit(f"error: server.host = {host!r} does not resolve: {err.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)       # as aiohttp's listener does
        try:
            probe.bind(address)
        except OSError as err:
            raise SystemExit(f"error: cannot listen on {host}:{port} (server.host, server.port): "
                             f"{err.strerror}") from None


def cmd_profiles(args: argparse.Namespace) -> int:
    from .config import explain, list_profiles
    if args.action == "list":
        for name, path, description in list_profiles():
            print(f"{name:24} {description}\n{'':24} {path}")
        return 0
    settings = _settings(args, {})
    width = max(len(key) for key, _, _ in explain(settings))
    for key, value, source in explain(settings):
        print(f"{key:{width}}  {json.dumps(value, default=str):40}  {source}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import warnings

    from .config import ConfigError, check_profile, parse_assignments
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            settings = check_profile(args.profile, overrides=parse_assignments(args.set or []))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    print(f"ok: {settings.profile_path or 'defaults'} is valid")
    return 0


def cmd_install_service(args: argparse.Namespace) -> int:
    import subprocess

    from .service_install import install
    try:
        done = install(user=args.user, profile=args.profile, root=args.root)
    except (ValueError, OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"error: install-service: {err}") from None
    for line in done:
        print(line)
    return 0


def cmd_init_checkpoint(args: argparse.Namespace) -> int:
    import torch

    _check_init_arguments(args)
    if args.format == "gguf":
        return _init_gguf(args)
    from .checkpoint.writer import write_random_checkpoint
    out = write_random_checkpoint(Path(args.out), preset=args.preset, layers=args.layers, seed=args.seed,
                                  dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype],
                                  device=args.device, progress=True,
                                  fp8_block=(128, 128) if args.format == "fp8" else None)
    print(out)
    return 0


def _check_init_arguments(args: argparse.Namespace) -> None:
    """What init-checkpoint would fail on, or silently do otherwise, refused before any weight is drawn."""
    from .checkpoint.gguf_writer import MIXES, ONE_TYPE
    from .engine.loading import resolve_device

    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"error: --layers {args.layers}: a model has at least 1 layer")
    if args.format != "gguf":
        if args.holes:
            raise SystemExit("error: --holes leaves a GGUF's expert data unwritten; add --format gguf")
        if args.quant is not None:
            raise SystemExit(f"error: --quant {args.quant!r} chooses a GGUF's mix; add --format gguf")
    else:
        given = args.quant or "bf16"
        args.quant = given.lower() if given.lower() in MIXES else given.upper()     # any case, as plan reads it
        if args.quant not in MIXES + ONE_TYPE:
            raise SystemExit(f"error: --quant {given!r}: choose one of {', '.join(MIXES + ONE_TYPE)}")
    out = Path(args.out)
    if out.is_dir() and (args.format == "gguf" or any(out.iterdir())):
        raise SystemExit(f"error: --out {args.out}: a directory{' holding files' if args.format != 'gguf' else ''} "
                         f"is there already; choose a new path (nothing is overwritten)")
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {args.out}: a file is there already; choose a new path (nothing is "
                         f"overwritten)")
    try:
        resolve_device(args.device)
    except (RuntimeError, ValueError) as err:
        raise SystemExit(f"error: --device {args.device!r}: {err}") from None


def _init_gguf(args: argparse.Namespace) -> int:
    """A random-weight GGUF in llama.cpp's layout at a quantization mix (checkpoint/gguf_writer.py)."""
    import json

    from .checkpoint.gguf_writer import write_gguf
    from .checkpoint.presets import preset_config
    from .checkpoint.random_weights import random_model
    from .checkpoint.tokenizer_builder import build_tokenizer, chat_template

    if not args.out.endswith(".gguf"):
        raise SystemExit(f"error: --out {args.out!r}: a GGUF is one file; name it *.gguf")
    # The weights the mix keeps quantized are drawn as random blocks and written as they are: no dense copy of
    # the experts is made (the bench preset's would be 45 GiB in bfloat16).
    mix = args.quant or "bf16"
    model = random_model(args.preset, args.layers, dtype=args.dtype, device=args.device, seed=args.seed,
                         progress=True, quant=mix)
    text = preset_config(args.preset, args.layers, dtype=args.dtype)["text_config"]
    tokenizer = json.loads(build_tokenizer(text).to_str())
    print(write_gguf(args.out, model, text, tokenizer, chat_template(), mix=mix, seed=args.seed,
                     holes=args.holes))
    return 0


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="set one key of the profile (e.g. server.port=9000, prefix_cache.resident_limit=8GiB); "
                             "repeatable; wins over the environment and the profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen4exp", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline, through the engine a profile serves")
    gen.add_argument("--profile", default=None, help="a profile name or path (default: QWEN4EXP_PROFILE, else tiny): "
                     "model, device, dtype, chunk and the decode settings; the flags below override it")
    gen.add_argument("--model", default=None, help="checkpoint directory, .gguf file, Hugging Face id "
                     "(org/repo, org/repo:QUANT), or 'tiny' (the embedded model)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    source.add_argument("--prompts-file", help="JSONL, one request per line, run together through the engine "
                        "(see qwen4exp/prompts_file.py for the fields)")
    gen.add_argument("--slots", type=int, default=None,
                     help="engine slots (1-16; default: 1 for --prompt, the profile's for --prompts-file). On a GPU, "
                          "decode at another slot count may round differently: give the server's count to "
                          "reproduce its answers bit for bit")
    gen.add_argument("--context", type=int, default=None,
                     help="per-slot context (default: the longest request, rounded up to whole chunks)")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn of the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--greedy", action="store_true", help="pick the most likely token (same as --temperature 0)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chunk", default=None, help="prompt tokens per prefill forward, or 'auto' (default: the "
                     "profile's, which a served answer is cut with)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: the profile's target)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON document with ids, text and timings")
    gen.add_argument("--mtp", default=None, help="drafted tokens per step with the MTP head (0 to 7), or 'auto' "
                     "(default: the profile's); the answer is the same")
    gen.add_argument("--mtp-weights", default=None, metavar="DIR", help=MTP_WEIGHTS_HELP)
    _add_set(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the HTTP API (native, OpenAI-compatible, admin) from a profile")
    srv.add_argument("--profile", default=None, help="a profile name or path (default: QWEN4EXP_PROFILE, else tiny)")
    srv.add_argument("--model", default=None, help="checkpoint directory, .gguf file, Hugging Face id "
                     "(org/repo, org/repo:QUANT), or 'tiny'")
    srv.add_argument("--host", default=None)
    srv.add_argument("--port", type=int, default=None)
    srv.add_argument("--max-ctx", default=None, help="tokens per slot, or 'auto' to fit the device")
    srv.add_argument("--slots", type=int, default=None)
    srv.add_argument("--chunk", default=None, help="prompt chunk in tokens, or 'auto'")
    srv.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    srv.add_argument("--mtp", default=None, help="drafted tokens per step with the MTP head (0 to 7), or 'auto'")
    srv.add_argument("--mtp-weights", default=None, metavar="DIR", help=MTP_WEIGHTS_HELP)
    _add_set(srv)
    srv.set_defaults(func=cmd_serve)

    prof = sub.add_parser("profiles", help="list the profiles, or show the effective settings and their sources")
    prof.add_argument("action", choices=["list", "show"], nargs="?", default="list")
    prof.add_argument("--profile", default=None)
    _add_set(prof)
    prof.set_defaults(func=cmd_profiles)

    chk = sub.add_parser("check", help="validate a profile without loading a model")
    chk.add_argument("--profile", default=None)
    _add_set(chk)
    chk.set_defaults(func=cmd_check)

    from .plan_cli import add_parser as add_plan_parser
    add_plan_parser(sub)
    from .kernels_cli import add_parser as add_kernels_parser
    add_kernels_parser(sub)

    svc = sub.add_parser("install-service", help="install the systemd unit (Type=notify) for this installation")
    svc.add_argument("--user", default="qwen4exp", help="the system user the service runs as (created if missing)")
    svc.add_argument("--profile", default="h200", help="the profile `qwen4exp serve` loads")
    svc.add_argument("--root", default=None, help="write under this directory and run nothing (packaging)")
    svc.set_defaults(func=cmd_install_service)

    init = sub.add_parser("init-checkpoint", help="write a random-weight checkpoint in the published layout")
    init.add_argument("--preset", choices=PRESET_MODELS, required=True)
    init.add_argument("--layers", type=int, default=None)
    init.add_argument("--out", required=True)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    init.add_argument("--device", default="cpu", help="where to generate the random tensors (cpu or cuda)")
    init.add_argument("--format", choices=["safetensors", "fp8", "gguf"], default="safetensors",
                      help="the published layout (a directory), Qwen's FP8 layout of it (float8 experts, attention "
                      "projections and PLE table with block scales) or llama.cpp's GGUF (one file, --out *.gguf)")
    init.add_argument("--quant", default=None, help="GGUF only: f32, bf16 (the default), q8_0 or ud-q4_k_xl "
                      "(unsloth's mix), or one type for every matrix (Q4_K, IQ4_NL, ...); K-quant and IQ4 weights "
                      "are random blocks")
    init.add_argument("--holes", action="store_true", help="GGUF only: leave the routed experts and the PLE table "
                      "unwritten, a sparse file whose holes read as zero weights (the full model at ud-q4_k_xl "
                      "on ~5 GiB of disk instead of 104): for speed and memory benchmarks, not for answers")
    init.set_defaults(func=cmd_init_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
