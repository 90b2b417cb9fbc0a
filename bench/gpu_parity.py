"""Greedy parity of our model against transformers on a GPU, on a bench-shaped checkpoint.

    python bench/gpu_parity.py --checkpoint DIR [--write --layers 8] --prompt-tokens 2300 --new-tokens 32 \
        --out results.json

With --write, a random bench checkpoint is first written to DIR (tensors generated on the GPU).
Runs transformers (with flash-linear-attention when installed) and ours in bfloat16, compares the
greedy ids and, at the first difference, both models' logits for the two candidate tokens. With
--fp32-check, a mismatch is re-run in float32 on the GPU, where the ids must be identical.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def exact_reference_kernels() -> None:
    """In float32, make transformers run its own torch Gated DeltaNet functions, not the fla kernels it
    picked at import (those round through TF32); our float32 path is exact too."""
    import inspect

    from transformers.models.qwen4_exp import modeling_qwen4_exp as module
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(module, name, inspect.unwrap(getattr(module, name)))


def reference_greedy(ckpt: str, prompt: torch.Tensor, new_tokens: int, dtype: torch.dtype):
    import transformers
    if dtype == torch.float32:
        exact_reference_kernels()
    started = time.perf_counter()
    model = transformers.Qwen4ExpForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map="cuda").eval()
    load_s = time.perf_counter() - started
    with torch.no_grad():
        started = time.perf_counter()
        out = model.generate(prompt[None].cuda(), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        torch.cuda.synchronize()
        gen_s = time.perf_counter() - started
    ids = out.sequences[0, prompt.numel():].tolist()
    logits = [step[0].float().cpu() for step in out.logits]
    del model, out
    gc.collect()
    torch.cuda.empty_cache()
    return ids, logits, load_s, gen_s


def our_greedy(ckpt: str, prompt: torch.Tensor, new_tokens: int, dtype: torch.dtype):
    from qwen4exp.engine.loading import load_model
    started = time.perf_counter()
    model = load_model(ckpt, dtype=dtype, device="cuda", progress=False)
    load_s = time.perf_counter() - started
    state = model.new_state(prompt.numel() + new_tokens)
    ids, logits = [], []
    torch.cuda.synchronize()
    started = time.perf_counter()
    step = model(prompt.cuda(), state)
    for _ in range(new_tokens):
        logits.append(step.float().cpu())
        ids.append(int(torch.argmax(step)))
        if len(ids) < new_tokens:
            step = model(torch.tensor(ids[-1:], device="cuda"), state)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - started
    del model, state
    gc.collect()
    torch.cuda.empty_cache()
    return ids, logits, load_s, gen_s


def compare(dtype: torch.dtype, ckpt: str, prompt: torch.Tensor, new_tokens: int) -> dict:
    ref_ids, ref_logits, ref_load, ref_gen = reference_greedy(ckpt, prompt, new_tokens, dtype)
    our_ids, our_logits, our_load, our_gen = our_greedy(ckpt, prompt, new_tokens, dtype)
    steps = min(len(ref_logits), len(our_logits))
    first_diff = next((i for i in range(steps) if ref_ids[i] != our_ids[i]), None)
    # Logit agreement while the two runs still see the same tokens.
    agree_until = first_diff + 1 if first_diff is not None else steps
    max_diff = max((ref_logits[i] - our_logits[i]).abs().max().item() for i in range(agree_until))
    row = {
        "dtype": str(dtype).removeprefix("torch."),
        "ids_identical": first_diff is None,
        "first_difference": first_diff,
        "max_abs_logit_diff_while_aligned": max_diff,
        "logit_std": ref_logits[0].std().item(),
        "reference_ids": ref_ids,
        "our_ids": our_ids,
        "reference": {"load_s": ref_load, "generate_s": ref_gen},
        "ours": {"load_s": our_load, "generate_s": our_gen},
    }
    if first_diff is not None:
        a, b = ref_ids[first_diff], our_ids[first_diff]
        row["at_first_difference"] = {
            "reference_logits": {str(a): ref_logits[first_diff][a].item(), str(b): ref_logits[first_diff][b].item()},
            "our_logits": {str(a): our_logits[first_diff][a].item(), str(b): our_logits[first_diff][b].item()},
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2300)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--fp32-check", action="store_true", help="also compare in float32 after a bf16 mismatch")
    parser.add_argument("--only-fp32", action="store_true", help="skip bfloat16; compare in float32 only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.write:
        from qwen4exp.checkpoint.writer import write_random_checkpoint
        started = time.perf_counter()
        write_random_checkpoint(args.checkpoint, preset="bench", layers=args.layers, seed=0,
                                dtype=torch.bfloat16, device="cuda", progress=False)
        result["write_s"] = time.perf_counter() - started
    import transformers
    result["transformers"] = transformers.__version__
    try:
        import fla
        result["fla"] = fla.__version__
    except ImportError:
        result["fla"] = None
    # Ordinary tokens only: ids below the first special token.
    id_limit = json.load(open(f"{args.checkpoint}/config.json"))["text_config"]["eos_token_id"]
    prompt = torch.randint(0, id_limit, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    result["prompt_tokens"] = args.prompt_tokens
    if not args.only_fp32:
        result["bfloat16"] = compare(torch.bfloat16, args.checkpoint, prompt, args.new_tokens)
        json.dump(result, open(args.out, "w"), indent=1)
    if args.only_fp32 or (args.fp32_check and not result["bfloat16"]["ids_identical"]):
        result["float32"] = compare(torch.float32, args.checkpoint, prompt, args.new_tokens)
    json.dump(result, open(args.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in result.items()}, default=str)[:3000])


if __name__ == "__main__":
    main()
