"""Qwen's FP8 layout on the bench shape: our engine beside transformers' FineGrainedFP8 path, on one checkpoint.

    python bench/fp8_peer.py --checkpoint /tmp/bench8_fp8 --write --layers 8 --kernels .peer/finegrained_fp8 \
        --prompt-tokens 2048 --out fp8_peer.json

transformers serves an FP8 checkpoint through the Triton kernels of the hub package
`kernels-community/finegrained-fp8` (activations quantized per 128-value group on the fly, FP8 tensor cores). The
lent GPU machine has no network, so --kernels names a local copy of that package's source (the GitHub repository
huggingface/kernels-community, `finegrained-fp8/torch-ext/finegrained_fp8`; not part of this repository: carry it
to the machine); it imports a module its build generates (`_ops`:
the torch.library namespace), which `peer_kernels` provides. transformers' FP8 loading needs `accelerate`.

One model at a time on the device, each on the same prompt:
1. the reference: the checkpoint's weights dequantized to bfloat16 (the PLE table's rows as they are gathered),
   run by transformers' own torch code (FineGrainedFP8Config(dequantize=True));
2. transformers' FP8 path: the logits, its prompt forward and its decode step (bench/speed.py's measure);
3. ours: the logits from the FP8 checkpoint as we load it (float8 experts and attention projections kept as
   blocks), then bench/speed.py's engine measures at one slot (prompt forward, decode step from a CUDA graph).
The error of each against the reference, over the logits of the prompt's last --compare positions: the largest
|difference|, the RMS of the difference over the reference's RMS, and how many argmaxes agree.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import sys
import time
import types
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402  (bench/speed.py: the shared measures)

PEER_NAMESPACE = "qwen4exp_peer_fp8"


def peer_kernels(path: Path):
    """The finegrained-fp8 package from its source at `path`, with the `_ops` module its build would generate, and
    transformers' FP8 integration pointed at it (instead of fetching it from the hub)."""
    ops = types.ModuleType("finegrained_fp8._ops")
    ops.ops = getattr(torch.ops, PEER_NAMESPACE)
    ops.add_op_namespace_prefix = lambda name: f"{PEER_NAMESPACE}::{name}"
    sys.modules["finegrained_fp8._ops"] = ops
    spec = importlib.util.spec_from_file_location("finegrained_fp8", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["finegrained_fp8"] = package
    spec.loader.exec_module(package)
    from transformers.integrations import finegrained_fp8 as integration
    integration._FINEGRAINED_FP8 = integration.FineGrainedFP8(
        matmul=package.matmul_2d, batched_matmul=package.matmul_batched, grouped_matmul=package.matmul_grouped)
    return package


def source_hash(path: Path) -> str:
    """Which copy of the kernels' source ran: a hash over its Python files."""
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*.py")):
        digest.update(file.relative_to(path).as_posix().encode() + file.read_bytes())
    return digest.hexdigest()[:16]


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def transformers_model(checkpoint: str, dequantize: bool):
    import transformers
    config = json.loads((Path(checkpoint) / "config.json").read_text())["quantization_config"]
    quant = transformers.FineGrainedFP8Config(dequantize=dequantize,
                                              modules_to_not_convert=config.get("modules_to_not_convert"))
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda",
                                                              quantization_config=quant).eval()
    return model, time.perf_counter() - started


def transformers_logits(model, prompt: list[int], compare: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], device="cuda"), logits_to_keep=compare)
        return out.logits[0].float().cpu()


def our_logits(checkpoint: str, prompt: list[int], compare: int) -> tuple[torch.Tensor, float]:
    from qwen4exp.engine.loading import load_model
    started = time.perf_counter()
    model = load_model(checkpoint, dtype="bfloat16", device="cuda", progress=False)
    load_s = time.perf_counter() - started
    with torch.inference_mode():
        state = model.new_state(len(prompt))
        logits = model(torch.tensor(prompt, device="cuda"), state, all_logits=True)[-compare:].float().cpu()
    del model, state
    release()
    return logits, load_s


def error(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = logits - reference
    return {"max_abs": float(diff.abs().max()),
            "rms_over_reference_rms": float(diff.pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()),
            "argmax_agree": int((logits.argmax(-1) == reference.argmax(-1)).sum()),
            "positions": int(reference.shape[0])}


def transformers_speed(model, args, limit: int) -> dict:
    """speed.measure_transformers: its decode step after a short prompt (median) and a --prompt-tokens forward,
    timed after one untimed pass of each (the kernels autotune on first use)."""
    measure = argparse.Namespace(hf_decode_steps=args.decode_steps, decode_prompt=64, decode_warmup=4,
                                 ttft_tokens=args.prompt_tokens)
    speed.measure_transformers(model, measure, limit, torch.device("cuda"), None)
    return speed.measure_transformers(model, measure, limit, torch.device("cuda"), None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="an FP8 checkpoint directory (written there with --write)")
    p.add_argument("--write", action="store_true", help="first write a random FP8 checkpoint of --preset there")
    p.add_argument("--preset", default="bench")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kernels", required=True, help="the finegrained-fp8 package's source directory")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--compare", type=int, default=64, help="the prompt's last positions whose logits are compared")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("this bench runs on a GPU (transformers' FP8 kernels are Triton kernels for CUDA)")

    chunk = -(-max(2048, args.prompt_tokens) // 1024) * 1024       # whole restore spacings (speed.py's default)
    results: dict = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "command": " ".join(sys.argv), "commit": speed.commit(), "versions": speed.versions(),
                     "device": speed.device_name(torch.device("cuda")), "args": vars(args),
                     "kernels_source": source_hash(Path(args.kernels))}
    out = Path(args.out)

    def save() -> None:          # after each part: a later failure keeps what ran
        out.write_text(json.dumps(results, indent=2))

    if args.write:
        from qwen4exp.checkpoint.writer import write_random_checkpoint
        started = time.perf_counter()
        write_random_checkpoint(args.checkpoint, preset=args.preset, layers=args.layers, dtype=torch.bfloat16,
                                device="cuda", progress=False, fp8_block=(128, 128))
        results["write_s"] = time.perf_counter() - started
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    limit = int(config.get("text_config", config)["eos_token_id"])       # prompts of ordinary tokens, as speed.py's
    prompt = speed.prompt_ids(args.prompt_tokens, limit, 7)

    reference_model, load_s = transformers_model(args.checkpoint, dequantize=True)
    reference = transformers_logits(reference_model, prompt, args.compare)
    results["reference"] = {"what": "transformers, the weights dequantized to bfloat16", "load_s": load_s}
    del reference_model
    release()
    save()

    peer_kernels(Path(args.kernels))
    peer, load_s = transformers_model(args.checkpoint, dequantize=False)
    results["transformers_fp8"] = {"load_s": load_s,
                                   "error": error(transformers_logits(peer, prompt, args.compare), reference),
                                   **transformers_speed(peer, args, limit)}
    del peer
    release()
    save()

    logits, load_s = our_logits(args.checkpoint, prompt, args.compare)
    results["ours"] = {"load_s": load_s, "error": error(logits, reference)}
    save()
    results["ours"]["speed"] = speed.main([
        "--checkpoint", args.checkpoint, "--dtype", "bfloat16", "--device", "cuda", "--slots", "1", "--busy", "1",
        "--decode-steps", str(args.decode_steps), "--prefill", str(args.prompt_tokens), "--chunk", str(chunk),
        "--ttft-tokens", str(args.prompt_tokens), "--ttft-prompts", str(args.prompt_tokens),
        "--out", args.out + ".ours.json"])
    save()
    for name in ("transformers_fp8", "ours"):
        print(name, json.dumps(results[name]["error"]))
    print("transformers decode ms", results["transformers_fp8"].get("decode_ms_per_step"),
          "prefill s", results["transformers_fp8"].get("prefill_s"))
    return results


if __name__ == "__main__":
    main()
