"""Speed of the engine on one device, each figure beside its roofline (issue 7, item 1).

    python bench/speed.py (--checkpoint DIR | --random-weights --preset bench --layers 8 [--quant ud-q4_k_xl]) \
        --dtype bfloat16 --device cuda --out results.json [--slots 4] [--prefill 4096,16384,65536] \
        [--decode-steps 64] [--fit] [--compare-transformers]

Measured, in this order (the JSON is rewritten after each part, so a crash keeps what was done):

1. machine ceilings, before the model: device-to-device copy bandwidth (bytes read + written over time, median)
   and the dense matmul rate in the model dtype (n^3 random data, median);
2. time from process start to ready: model built (random weights on the device, see
   qwen4exp.checkpoint.random_weights) or loaded, engine constructed, a first short request served (the
   ceilings' own seconds are taken out; with --fit, the fit of the largest context for --slots slots runs
   between the model and the engine, and its seconds are reported apart and taken out too); then one
   chunk-sized prompt so that every prefill kernel is compiled before anything is timed. With --quant, the
   weights a GGUF of that mix keeps quantized are random blocks, and the roofline counts their bytes;
3. decode ms per step with 1, 2, 4 busy slots of an engine with --slots slots (short prompts, timed after
   warm-up steps, synchronised around the block). Roofline per step = the bytes a step must move / the
   measured copy bandwidth: every dense weight once (all parameters but the routed experts, the token
   embedding and the n-gram tables, and the MTP head which decode does not run), the embedding and n-gram
   rows used, the distinct routed experts of b rows (expected count E * (1 - (1 - k/E)^b) per MoE layer), and
   per row its state traffic: Gated DeltaNet recurrent state (fp32) and conv states read and written, the PLE
   conv state read and written, and per QSA layer min(L, budget + ratio - 1) tokens of K/V plus all L/ratio
   block keys read and the new token's K/V/index key written;
4. prefill tok/s at each --prefill length (one request alone, time to first token, chunk --chunk). Roofline =
   FLOPs / measured matmul rate, with FLOPs (see `prefill_flops`) = 2 x active parameters per token x tokens
   (dense parameters but embeddings and MTP, plus k routed experts; the LM head once) + QSA attention
   4 x heads x head_dim x min(pos + 1, budget + ratio - 1) per query and layer + the indexer's block scores
   2 x index_heads x index_dim x (pos + 1) // ratio + the chunked Gated DeltaNet (see `gdn_flops_per_token`);
5. prefix cache, in an engine of its own that has served one short request: a resent --ttft-tokens prompt's
   time to first token (from submission to the moment the engine takes the token, as a stream sends it) cold
   (first send, snapshots captured) and warm (same prompt again), whether both answers are identical, and
   the restore time of a --restore-tokens snapshot (that prompt sent, then sent again) from the cache
   counters;
6. time to first token of cold prompts at each --ttft-prompts length (up to --max-ttft-prompt), in an engine of
   one slot served as a server's (on a GPU warmed up as the worker does, engine/warm_up.py, its seconds
   reported; prefix cache on; one short request served before): the first prompt of a
   length, a second one of the same length (other tokens: what a compile on a new length cost shows as the
   difference), and a third split into where its time went (bench/first_token_parts.py: forward, sampling,
   snapshot capture, restore lookup, the allocator's release, host work; new device memory segments);
7. peak device memory (until ready, and of the work after it);
8. with --compare-transformers: transformers' single-sequence decode step (one token with its cache after a
   short prompt, median) and its --ttft-tokens prefill, against our decode with one busy slot and our plain
   prefill of that length: our speedup on each. With --random-weights it runs over our own tensors (assigned
   by name to a model built on the meta device: no copy, nothing on disk); with --checkpoint it loads the
   checkpoint itself after ours is freed.

Every ratio is roofline time / measured time: 1.0 is the hardware limit by this model of the work.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from first_token_parts import _segments, first_token, first_token_parts, plain_first_token, triton_compiles

from qwen4exp.checkpoint.gguf_writer import MIXES, ONE_TYPE
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.engine.fit import FitError
from qwen4exp.engine.loading import DTYPES, load_model, resolve_device
from qwen4exp.engine.model.quantized import QuantizedStack
from qwen4exp.engine.request import FinishReason, Request

GiB = 1 << 30
GDN_CHUNK = 64  # the chunk size of the chunked Gated DeltaNet kernels (fla and ours)


# ---- small helpers ---------------------------------------------------------------------------------------

def process_start_time() -> float | None:
    """Wall-clock time this process started (Linux /proc), so that "ready" counts the interpreter and
    imports too; None where /proc is not there (then main counts from its own start)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of fn after `warmup` untimed ones, synchronised around each."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - started)
    return samples


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def commit() -> str | None:
    """$QWEN4EXP_COMMIT when set (a copied tree's .git may not be the tree's own), else `git rev-parse --short
    HEAD` of this repository (+ "-dirty" with local changes)."""
    root = Path(__file__).resolve().parent.parent
    if os.environ.get("QWEN4EXP_COMMIT"):
        return os.environ["QWEN4EXP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("QWEN4EXP_COMMIT")


def versions() -> dict[str, str | None]:
    """Versions of what the run used (read from package metadata: nothing is imported for it)."""
    from importlib import metadata
    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                    "cuda": torch.version.cuda}
    for key, dist in (("triton", "triton"), ("fla", "flash-linear-attention"), ("transformers", "transformers"),
                      ("causal_conv1d", "causal-conv1d")):
        try:
            found[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[key] = None
    return found


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def prompt_ids(n: int, limit: int, seed: int) -> list[int]:
    """n ordinary token ids (below the first special token), reproducible from the seed."""
    return torch.randint(0, limit, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check(requests: list[Request], what: str) -> None:
    failed = [r for r in requests if r.finish_reason is FinishReason.ERROR]
    if failed:
        raise RuntimeError(f"{what}: {failed[0].id} failed: {failed[0].error}")


# ---- machine ceilings ------------------------------------------------------------------------------------

def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict:
    """Device-to-device copy of an nbytes buffer: (bytes read + bytes written) / time, median of reps."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    samples = timed(lambda: dst.copy_(src), device, reps, warmup=2)
    median = statistics.median(samples)
    return {"buffer_bytes": nbytes, "reps": reps, "median_s": median, "samples_s": samples,
            "bytes_per_s": 2 * nbytes / median}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> dict:
    """FLOP/s of an n x n x n matrix product of random data in `dtype`, median of reps."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    samples = timed(lambda: torch.matmul(a, b, out=out), device, reps, warmup=2)
    median = statistics.median(samples)
    return {"size": n, "dtype": str(dtype).removeprefix("torch."), "reps": reps, "median_s": median,
            "samples_s": samples, "flops_per_s": 2 * n**3 / median}


# ---- the work a step must do -------------------------------------------------------------------------------

class Work:
    """Bytes a decode step must move and FLOPs a prefill must do, from the model's own parameters."""

    def __init__(self, model: torch.nn.Module):
        cfg = self.cfg = model.config
        self.param_bytes = next(model.parameters()).element_size()
        groups = {"routed": 0, "embed": 0, "ngram": 0, "lm_head": 0, "mtp": 0, "dense": 0}
        group_bytes = dict.fromkeys(groups, 0)
        for name, p in model.named_parameters():
            if name.startswith("mtp."):
                group = "mtp"
            elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                group = "routed"
            elif name == "model.embed_tokens.weight":
                group = "embed"
            elif name.endswith(".ngram_embedding.weight"):
                group = "ngram"
            elif name == "lm_head.weight":
                group = "lm_head"
            else:
                group = "dense"
            groups[group] += p.numel()
            group_bytes[group] += p.numel() * p.element_size()
        for name, module in model.named_modules():          # the weights a GGUF or an FP8 checkpoint keeps as blocks
            if isinstance(module, QuantizedStack):
                group = ("mtp" if name.startswith("mtp.") else
                         "routed" if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) else
                         "ngram" if name.endswith(".ngram_embedding") else "embed" if name == "model.embed_tokens"
                         else "lm_head" if name == "lm_head.weight" else "dense")
                groups[group] += math.prod(module.shape)
                group_bytes[group] += module.blocks.numel()
        self.moe_layers = cfg.num_hidden_layers
        self.expert_params = 3 * cfg.moe_intermediate_size * cfg.hidden_size
        expected = self.moe_layers * cfg.num_experts * self.expert_params
        if groups["routed"] != expected:
            raise RuntimeError(f"found {groups['routed']} routed-expert parameters, the config implies {expected}: "
                               "the parameter names changed; update Work in bench/speed.py")
        self.params, self.bytes = groups, group_bytes
        self.expert_bytes = group_bytes["routed"] / (self.moe_layers * cfg.num_experts)
        self.gdn_layers = sum(not cfg.is_qsa(i) for i in range(cfg.num_hidden_layers))
        self.qsa_layers = cfg.num_hidden_layers - self.gdn_layers
        self.ple_layers = len(cfg.ple_layer_ids)
        self.ngram_row_dim = cfg.ple_embed_dim // cfg.ngram_heads
        self.ngram_row_bytes = group_bytes["ngram"] * self.ngram_row_dim / max(groups["ngram"], 1)

    def summary(self) -> dict:
        return {"parameters": self.params, "parameter_bytes": self.bytes,
                "total_parameters": sum(self.params.values()), "total_bytes": sum(self.bytes.values()),
                "bytes_per_expert": self.expert_bytes, "moe_layers": self.moe_layers,
                "gdn_layers": self.gdn_layers, "qsa_layers": self.qsa_layers,
                "active_parameters_per_token": self.active_params_per_token()}

    # decode
    def distinct_experts(self, rows: int) -> float:
        e, k = self.cfg.num_experts, self.cfg.num_experts_per_tok
        return e * (1 - (1 - k / e) ** rows)

    def state_bytes(self, context: int) -> int:
        """State bytes one row's decode step reads and writes at `context` tokens."""
        c, s = self.cfg, self.param_bytes
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        gdn = 2 * (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
                   + conv_dim * (c.linear_conv_kernel_dim - 1) * s)
        ple = 2 * c.hc_count * c.hidden_size * c.ple_conv_state_len * s
        kv = min(context, c.dense_limit) * c.num_key_value_heads * c.head_dim * 2 * s
        blocks = context // c.indexer_compress_ratio * c.indexer_head_dim * s
        written = (2 * c.num_key_value_heads * c.head_dim + c.indexer_head_dim) * s
        return self.gdn_layers * gdn + self.ple_layers * ple + self.qsa_layers * (kv + blocks + written)

    def decode_bytes(self, contexts: list[int]) -> dict:
        """Bytes one decode step must move with one busy row per entry of `contexts` (its length)."""
        rows, c = len(contexts), self.cfg
        parts = {
            "dense_weights": self.bytes["dense"] + self.bytes["lm_head"],
            "embedding_rows": rows * c.hidden_size * self.param_bytes,
            "ngram_rows": rows * self.ple_layers * c.ngram_heads * self.ngram_row_bytes,
            "routed_experts": self.moe_layers * self.distinct_experts(rows) * self.expert_bytes,
            "state": sum(self.state_bytes(n) for n in contexts),
        }
        parts["total"] = sum(parts.values())
        return parts

    # prefill
    def active_params_per_token(self) -> int:
        return self.params["dense"] + self.cfg.num_experts_per_tok * self.moe_layers * self.expert_params

    def gdn_flops_per_token(self) -> float:
        """Chunked Gated DeltaNet FLOPs per token and layer, as chunked kernels run it (chunk C, full C x C
        tiles), per value head with key dim dk and value dim dv:
          state terms 6 dk dv: the output's q S, the delta rule's correction W S and the update K^T V_new
            (the "4 heads dk dv" estimate counts the first and the last only);
          intra-chunk 2 C (3 dk + 2 dv): K K^T, W = T (beta K), Q K^T (each 2 C dk per token) and
            U = T (beta V), (Q K^T) V_new (each 2 C dv per token);
          the triangular solve for T: 2 C^2 / 3 per token."""
        c, chunk = self.cfg, GDN_CHUNK
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        per_head = 6 * dk * dv + 2 * chunk * (3 * dk + 2 * dv) + 2 * chunk**2 / 3
        return c.linear_num_value_heads * per_head

    def prefill_flops(self, tokens: int) -> dict:
        """FLOPs of a `tokens`-token prefill from position 0 (see the module docstring)."""
        c = self.cfg
        limit, ratio = c.dense_limit, c.indexer_compress_ratio
        keys_seen = sum(min(p, limit) for p in range(1, tokens + 1))     # attended keys over all queries
        blocks_seen = sum(p // ratio for p in range(1, tokens + 1))      # indexer block scores over all queries
        parts = {
            "linear": 2 * self.active_params_per_token() * tokens + 2 * self.params["lm_head"],
            "attention": self.qsa_layers * 4 * c.num_attention_heads * c.head_dim * keys_seen,
            "indexer": self.qsa_layers * 2 * c.indexer_n_heads * c.indexer_head_dim * blocks_seen,
            "gated_deltanet": self.gdn_layers * self.gdn_flops_per_token() * tokens,
        }
        parts["total"] = sum(parts.values())
        return parts


# ---- measurements -----------------------------------------------------------------------------------------

class LogitsProbe:
    """Keeps the logits of the model's prompt chunks to check they are finite; skips CUDA graph captures, where
    reading them back is not allowed."""

    def __init__(self, model: torch.nn.Module):
        self.outputs: list[torch.Tensor] = []
        self._handle = model.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output) -> None:
        if not (output.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.outputs.append(output.detach())

    def close(self) -> dict:
        self._handle.remove()
        if not self.outputs:
            return {"checked": 0, "finite": None, "std": None}
        flat = torch.cat([o.float().reshape(-1) for o in self.outputs])
        self.outputs = []
        return {"checked": flat.numel(), "finite": bool(torch.isfinite(flat).all()), "std": flat.std().item()}


def measure_decode(engine: Engine, work: Work, busy: int, args, limit: int, device: torch.device,
                   bandwidth: float) -> dict:
    """ms per step and aggregate tok/s with `busy` rows decoding, timed over args.decode_steps steps after
    args.decode_warmup; roofline from the rows' mean lengths over the timed block."""
    steps, warmup = args.decode_steps, args.decode_warmup
    requests = [engine.submit(Request(prompt_ids=prompt_ids(args.decode_prompt, limit, 100 + i),
                                      max_tokens=warmup + steps + busy + 2)) for i in range(busy)]
    while any(not r.output_ids and not r.finished for r in requests):
        engine.step()
    for _ in range(warmup):
        engine.step()
    check(requests, f"decode with {busy} busy slots")
    before = [len(r.output_ids) for r in requests]
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    elapsed = time.perf_counter() - started
    after = [len(r.output_ids) for r in requests]
    for r in requests:
        engine.cancel(r.id)
    engine.run_until_idle()
    check(requests, f"decode with {busy} busy slots")
    produced = sum(after) - sum(before)
    if produced != busy * steps:
        raise RuntimeError(f"{busy} busy slots made {produced} tokens in {steps} steps, expected {busy * steps}")
    # A row at output length m holds prompt + m - 1 tokens in its state when it decodes the next one.
    contexts = [args.decode_prompt + (a + b) / 2 - 1 for a, b in zip(before, after)]
    moved = work.decode_bytes([round(n) for n in contexts])
    ms = elapsed / steps * 1000
    roofline_ms = moved["total"] / bandwidth * 1000
    return {"busy": busy, "steps": steps, "seconds": elapsed, "ms_per_step": ms,
            "tokens_per_s": produced / elapsed, "mean_context": statistics.mean(contexts),
            "roofline_bytes": moved, "roofline_ms_per_step": roofline_ms,
            "roofline_tokens_per_s": busy / roofline_ms * 1000, "ratio": roofline_ms / ms,
            "sample_ids": requests[0].output_ids[:after[0]]}


def measure_prefill(engine: Engine, work: Work, tokens: int, limit: int, device: torch.device,
                    flops_per_s: float) -> dict:
    request, seconds = first_token(engine, prompt_ids(tokens, limit, 200 + tokens), 1, device)
    engine.run_until_idle()
    if request.finish_reason is FinishReason.ERROR:
        if "memory" in (request.error or "").lower():
            return {"tokens": tokens, "skipped": f"out of memory: {request.error}"}
        check([request], f"prefill of {tokens} tokens")
    flops = work.prefill_flops(tokens)
    roofline_s = flops["total"] / flops_per_s
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "flops": flops,
            "roofline_s": roofline_s, "roofline_tokens_per_s": tokens / roofline_s, "ratio": roofline_s / seconds}


def measure_prefix_cache(model, args, limit: int, device: torch.device) -> dict:
    """Cold vs warm time to first token of a resent prompt, and one snapshot's restore time."""
    context = max(args.ttft_tokens, args.restore_tokens) + args.ttft_new_tokens + 1
    config = EngineConfig(slots=args.slots, max_ctx=context, chunk=args.chunk, restore_spacing=args.restore_spacing,
                          prefix_cache=True, prefix_cache_limit=int(args.cache_limit_gib * GiB),
                          compile_decode=args.compile_decode)
    cache = config.new_prefix_cache(model, device)
    engine = Engine.from_config(model, config, prefix_cache=cache)
    # As the daemon's worker does. This engine's context (the prompt's length and a few) is no multiple of 16, as
    # a fitted one is, so the kernels that take it build other binaries than the first engine's: without the
    # warm-up the cold figure held their compile (docs/PERFORMANCE.md).
    if device.type == "cuda":
        engine.warm_up()
    prompt = prompt_ids(args.ttft_tokens, limit, 300)
    served, _ = first_token(engine, prompt_ids(16, limit, 301), 2, device)   # a running engine, as a server's
    engine.run_until_idle()
    cold, cold_s = first_token(engine, prompt, args.ttft_new_tokens, device)
    engine.run_until_idle()
    warm, warm_s = first_token(engine, prompt, args.ttft_new_tokens, device)
    engine.run_until_idle()
    check([served, cold, warm], "the resent prompt")

    short = prompt_ids(args.restore_tokens, limit, 400)
    first, _ = first_token(engine, short, 1, device)
    engine.run_until_idle()
    restores, restored, restore_s = (cache.counters.restores, cache.counters.restored_tokens,
                                     cache.counters.restore_seconds)
    again, again_s = first_token(engine, short, 1, device)
    engine.run_until_idle()
    check([first, again], "the restore prompt")
    result = {
        "tier": cache.backend.tier, "chunk": args.chunk, "restore_spacing": args.restore_spacing,
        "prompt_tokens": len(prompt), "new_tokens": args.ttft_new_tokens,
        "cold_ttft_s": cold_s, "warm_ttft_s": warm_s, "speedup": cold_s / warm_s,
        "cold_cached_tokens": cold.cached_tokens, "warm_cached_tokens": warm.cached_tokens,
        "identical": cold.output_ids == warm.output_ids,
        "restore": {
            "prompt_tokens": len(short), "cached_tokens": again.cached_tokens,
            "restores": cache.counters.restores - restores,
            "restored_tokens": cache.counters.restored_tokens - restored,
            "restore_ms": (cache.counters.restore_seconds - restore_s) * 1000,
            "ttft_s": again_s, "identical": first.output_ids == again.output_ids,
        },
        "cache": cache.stats(),
    }
    del engine, cache
    release(device)
    return result


def measure_first_tokens(model, args, limit: int, device: torch.device) -> dict:
    """Cold time to first token at each --ttft-prompts length, and where the third prompt's time went, in an
    engine warmed up as the daemon's worker warms its own (engine/warm_up.py) on a GPU."""
    longest = args.max_ttft_prompt or (262144 if device.type == "cuda" else 2048)
    lengths = [n for n in args.ttft_prompts if n <= longest]
    if not lengths:
        return {"warm_up_s": None, "prompts": []}
    context = -(-(max(lengths) + 2) // args.chunk) * args.chunk
    config = EngineConfig(slots=1, max_ctx=context, chunk=args.chunk, restore_spacing=args.restore_spacing,
                          prefix_cache=True, prefix_cache_limit=int(args.cache_limit_gib * GiB),
                          compile_decode=args.compile_decode)
    cache = config.new_prefix_cache(model, device)
    engine = Engine.from_config(model, config, prefix_cache=cache)
    warm_up_s = engine.warm_up() if device.type == "cuda" else None
    plain_first_token(engine, prompt_ids(16, limit, 500), device)     # a running engine, as a server's
    results = []
    for n in lengths:
        segments = _segments(device)
        with triton_compiles() as compiled:
            first_s = plain_first_token(engine, prompt_ids(n, limit, 600 + n), device)
        first_segments = None if segments is None else _segments(device) - segments
        again_s = plain_first_token(engine, prompt_ids(n, limit, 700 + n), device)
        split = first_token_parts(engine, prompt_ids(n, limit, 800 + n), device)
        if split["error"]:
            raise RuntimeError(f"the {n}-token prompt failed: {split['error']}")
        results.append({"tokens": n, "first_s": first_s, "first_compiles": compiled,
                        "first_new_device_segments": first_segments, "plain_s": again_s,
                        "tokens_per_s": n / again_s, **split})
    del engine, cache
    release(device)
    return {"warm_up_s": warm_up_s, "prompts": results}


# ---- transformers ------------------------------------------------------------------------------------------

def transformers_from_ours(model, text_config: dict, dtype: torch.dtype, device: torch.device):
    """transformers' Qwen4ExpForCausalLM over our model's own tensors (same names; nothing copied, nothing on
    disk): built on the meta device, our state assigned by name, its rotary buffers computed on the device."""
    import transformers
    config = transformers.Qwen4ExpTextConfig(**text_config)
    with torch.device("meta"):
        reference = transformers.Qwen4ExpForCausalLM._from_config(config, dtype=dtype)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    result = reference.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"our state does not map onto transformers' by name: missing {result.missing_keys[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}; use --checkpoint to compare")
    reference.model.rotary_emb = type(reference.model.rotary_emb)(config=reference.config).to(device)
    left = [n for n, t in [*reference.named_parameters(), *reference.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers tensors with no value: {left[:5]}; use --checkpoint to compare")
    return reference.eval()


def measure_transformers(reference, args, limit: int, device: torch.device, our_ids: list[int] | None) -> dict:
    """Its decode step (one token with its cache after a short prompt; median) and its --ttft-tokens prefill."""
    steps = args.hf_decode_steps
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids(args.decode_prompt, limit, 100)], device=device)
        out = reference(input_ids=ids, use_cache=True, logits_to_keep=1)
        # transformers renamed forward's past_key_values to cache (5.2x); older releases (the H200 host's) know only
        # the old name
        renamed = "cache" in inspect.signature(reference.forward).parameters
        keyword = "cache" if renamed else "past_key_values"
        cache, greedy, samples = out[keyword], [int(out.logits[0, -1].argmax())], []
        for step in range(args.decode_warmup + steps):
            sync(device)
            started = time.perf_counter()
            out = reference(input_ids=torch.tensor([[greedy[-1]]], device=device), use_cache=True, logits_to_keep=1,
                            **{keyword: cache})
            token = int(out.logits[0, -1].argmax())
            sync(device)
            if step >= args.decode_warmup:
                samples.append(time.perf_counter() - started)
            cache = out[keyword]
            greedy.append(token)
        del out, cache
        release(device)
        result = {"decode_steps": steps, "decode_ms_per_step": statistics.median(samples) * 1000,
                  "decode_samples_s": samples}
        if our_ids:
            n = min(len(our_ids), len(greedy))
            result["greedy_ids_agree"] = our_ids[:n] == greedy[:n]
            result["greedy_ids_compared"] = n
        prompt = torch.tensor([prompt_ids(args.ttft_tokens, limit, 300)], device=device)
        try:
            sync(device)
            started = time.perf_counter()
            out = reference(input_ids=prompt, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            sync(device)
            result.update(prefill_tokens=prompt.shape[1], prefill_s=time.perf_counter() - started)
        except torch.cuda.OutOfMemoryError as err:
            result.update(prefill_tokens=prompt.shape[1], prefill_skipped=f"out of memory: {err}"[:300])
        out = None
        release(device)
    return result


# ---- the run ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def sizes(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x.strip()]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint directory")
    source.add_argument("--random-weights", action="store_true", help="random weights built on the device")
    p.add_argument("--preset", default="bench", choices=("tiny", "bench", "full"), help="with --random-weights")
    p.add_argument("--layers", type=int, default=None, help="with --random-weights: cut the preset to N layers")
    p.add_argument("--seed", type=int, default=0, help="with --random-weights")
    p.add_argument("--quant", default=None, choices=MIXES + ONE_TYPE + ("fp8",),
                   help="with --random-weights: the weights a GGUF of this mix keeps quantized are random blocks, "
                        "built in place (--preset full --quant ud-q4_k_xl: the full model as users run it); fp8: "
                        "the float8 weights of Qwen's FP8 checkpoint, as random FP8 blocks")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True, help="the results JSON")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk of every engine")
    p.add_argument("--compile-decode", action="store_true", help="engines torch.compile their decode step")
    p.add_argument("--context", type=int, default=0,
                   help="context of the decode/prefill engine (0: the longest prefill run + room, rounded to --chunk)")
    p.add_argument("--busy", type=sizes, default=[1, 2, 4], help="busy slot counts to time decode at")
    p.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of each decode request")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--decode-warmup", type=int, default=4)
    p.add_argument("--prefill", type=sizes, default=[4096, 16384, 65536], help="prefill lengths")
    p.add_argument("--max-prefill", type=int, default=65536, help="skip prefill lengths above this")
    p.add_argument("--ttft-tokens", type=int, default=16384, help="the resent prompt's length")
    p.add_argument("--ttft-new-tokens", type=int, default=8, help="tokens generated for the resent prompt")
    p.add_argument("--ttft-prompts", type=sizes, default=[128, 512, 2048, 16384, 65536, 262144],
                   help="cold prompt lengths whose time to first token is split into its parts")
    p.add_argument("--max-ttft-prompt", type=int, default=0,
                   help="skip --ttft-prompts lengths above this (0: 262144 on a GPU, 2048 on CPU)")
    p.add_argument("--restore-tokens", type=int, default=6144, help="the restored snapshot's length")
    p.add_argument("--restore-spacing", type=int, default=1024,
                   help="prefix cache restore spacing (divides --chunk and --restore-tokens)")
    p.add_argument("--cache-limit-gib", type=float, default=16.0, help="prefix cache resident limit")
    p.add_argument("--copy-mib", type=int, default=0, help="copy-bandwidth buffer (0: 4096 on a GPU, 256 on CPU)")
    p.add_argument("--matmul-size", type=int, default=0, help="n of the n^3 matmul (0: 8192 on a GPU, 1024 on CPU)")
    p.add_argument("--ceiling-reps", type=int, default=10)
    p.add_argument("--ple", choices=("device", "host"), default="device",
                   help="with --quant: keep the quantized PLE table in pinned host memory (as ple = 'host' does)")
    p.add_argument("--fit", action="store_true",
                   help="also fit the largest context for --slots slots and --chunk on the device, as the daemon "
                        "does for max_ctx = 'auto' (the PLE table stays where --ple put it)")
    p.add_argument("--headroom", type=float, default=0.1, help="with --fit: the fraction of the device kept free")
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--hf-decode-steps", type=int, default=16, help="transformers decode steps timed")
    args = p.parse_args(argv)
    if args.quant and not args.random_weights:
        p.error("--quant goes with --random-weights (a GGUF checkpoint has its own types)")
    if args.ple == "host" and not args.quant:
        p.error("--ple host keeps a quantized PLE table on the host: add --quant")
    if args.quant and args.compare_transformers:
        p.error("--compare-transformers runs on dense weights; drop --quant")
    if args.layers is not None and not args.random_weights:
        p.error("--layers goes with --random-weights (a checkpoint has its own layer count)")
    if args.chunk % args.restore_spacing:
        p.error(f"--restore-spacing ({args.restore_spacing}) must divide --chunk ({args.chunk})")
    if any(b < 1 for b in args.busy) or any(n < 1 for n in args.prefill + args.ttft_prompts):
        p.error("--busy, --prefill and --ttft-prompts take positive integers")
    return args


def main(argv: list[str] | None = None, started_at: float | None = None) -> dict:
    """Run every measurement, write args.out, print a table; returns the results. `started_at` (wall time)
    is when "ready" is counted from: the process start when run as a script."""
    started_at = time.time() if started_at is None else started_at
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    out = Path(args.out)
    result: dict = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": "python " + shlex.join(sys.argv if argv is None else ["bench/speed.py", *argv]),
        "device": str(device), "device_name": device_name(device), "versions": versions(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }

    def save(stage: str) -> None:
        """Writes what is measured so far and says so, so a run cut short by a time limit still tells how far it
        got (the table is printed at the end)."""
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"[{time.time() - started_at:6.1f} s] {stage}", flush=True)

    # 1. Ceilings, before the model is on the device (their buffers are freed again).
    ceilings_started = time.perf_counter()
    on_gpu = device.type == "cuda"
    copy_bytes = (args.copy_mib or (4096 if on_gpu else 256)) << 20
    copy = copy_bandwidth(device, copy_bytes, args.ceiling_reps)
    matmul = matmul_rate(device, dtype, args.matmul_size or (8192 if on_gpu else 1024), args.ceiling_reps)
    release(device)
    result["ceilings"] = {"copy": copy, "matmul": matmul, "seconds": time.perf_counter() - ceilings_started}
    ceilings_s = result["ceilings"]["seconds"]
    bandwidth, flops_per_s = copy["bytes_per_s"], matmul["flops_per_s"]
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    save("ceilings measured")

    # 2. Ready: the model, an engine, one short request served.
    t = time.perf_counter()
    if args.random_weights:
        from qwen4exp.checkpoint.presets import preset_config
        from qwen4exp.checkpoint.random_weights import random_model
        # The table is made in host memory: the full model in FP8 does not fit the H200 with it.
        model = random_model(args.preset, args.layers, dtype, device, seed=args.seed, quant=args.quant,
                             ple_on_host=args.ple == "host")
        text_config = preset_config(args.preset, args.layers, dtype=args.dtype)["text_config"]
    else:
        model = load_model(args.checkpoint, dtype=dtype, device=device, progress=False)
        text_config = None
    sync(device)
    model_s = time.perf_counter() - t
    cfg, work = model.config, Work(model)
    limit = cfg.eos_token_id
    result["model"] = {"source": args.checkpoint or f"random {args.preset}", "layers": cfg.num_hidden_layers,
                       "dtype": args.dtype, "quant": args.quant, "ple": args.ple, "seconds": model_s,
                       **work.summary()}
    save(f"model on the device in {model_s:.1f} s")

    fit_s, fitted = 0.0, None
    if args.fit:     # what `max_ctx = "auto"` serves with --slots slots and --chunk (the daemon's own fit)
        try:
            fitted = EngineConfig(slots=args.slots, chunk=args.chunk, ple="device").resolve_context(
                model, device, headroom=args.headroom).fit
        except FitError as err:      # the rest is still worth measuring at the context the bench asks for
            result["fit"] = {"slots": args.slots, "headroom": args.headroom, "error": str(err)}
            print(f"fit: {err}")
            fitted = None
    if fitted is not None:
        result["fit"] = {"headroom": args.headroom, "slots": args.slots, "context": fitted.context,
                         "chunk": fitted.chunk, "seconds": fitted.seconds, "notes": fitted.notes,
                         "weights_bytes": fitted.measured.weights if fitted.measured else None,
                         "capacity_bytes": fitted.measured.capacity if fitted.measured else None}
        release(device)
        fit_s = fitted.seconds
    if args.fit:
        save("fitted")

    runs = [n for n in args.prefill if n <= args.max_prefill]
    needed = max([*runs, args.decode_prompt + args.decode_warmup + args.decode_steps + max(args.busy) + 3,
                  args.chunk + 2, 64])
    context = args.context or -(-(needed + 1) // args.chunk) * args.chunk
    t = time.perf_counter()
    engine = Engine.from_config(model, EngineConfig(slots=args.slots, max_ctx=context, chunk=args.chunk,
                                                    compile_decode=args.compile_decode))
    sync(device)
    engine_s = time.perf_counter() - t
    # As the daemon's worker does: no figure below includes a kernel's compile.
    warm_up_s = engine.warm_up() if on_gpu else None
    t = time.perf_counter()
    probe = LogitsProbe(model)
    first, _ = first_token(engine, prompt_ids(16, limit, 1), 4, device)
    engine.run_until_idle()
    sync(device)
    check([first], "the warm-up request")
    warmup_s = time.perf_counter() - t
    ready = time.time()
    # A full chunk and a one-token chunk, so the prefill kernels are compiled and tuned before timing.
    t = time.perf_counter()
    shaped, _ = first_token(engine, prompt_ids(min(args.chunk + 1, context - 1), limit, 2), 1, device)
    engine.run_until_idle()
    check([shaped], "the prefill warm-up request")
    logits = probe.close()
    result["startup"] = {
        "compile_decode": args.compile_decode, "model_s": model_s, "engine_s": engine_s, "warm_up_s": warm_up_s,
        "first_request_s": warmup_s,
        "ready_s": ready - started_at - ceilings_s - fit_s, "ready_s_with_ceilings": ready - started_at - fit_s,
        "prefill_warmup_s": time.perf_counter() - t, "context": context, "logits": logits}
    if logits["finite"] is False:
        raise RuntimeError("the warm-up's logits are not all finite")
    if on_gpu:
        result["startup"]["memory_after_ready_bytes"] = torch.cuda.memory_allocated(device)
        result["startup"]["peak_until_ready_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)   # from here on: the serving work's own peak
    save(f"ready (engine {engine_s:.1f} s, warm-up {warm_up_s or 0:.1f} s)")

    # 3. Decode.
    result["decode"] = []
    for busy in args.busy:
        if busy > args.slots:
            continue
        result["decode"].append(measure_decode(engine, work, busy, args, limit, device, bandwidth))
        save(f"decode with {busy} busy")

    # 4. Prefill.
    result["prefill"] = []
    for n in args.prefill:
        if n > args.max_prefill:
            result["prefill"].append({"tokens": n, "skipped": f"over --max-prefill {args.max_prefill}"})
        else:
            result["prefill"].append(measure_prefill(engine, work, n, limit, device, flops_per_s))
        save(f"prefill of {n}")
    del engine
    release(device)

    # 5. Prefix cache.
    result["prefix_cache"] = measure_prefix_cache(model, args, limit, device)
    save("prefix cache")

    # 6. Time to first token by prompt length.
    result["first_tokens"] = measure_first_tokens(model, args, limit, device)
    save("first tokens")

    # 7. Memory.
    if on_gpu:
        serving = torch.cuda.max_memory_allocated(device)
        peak = max(serving, result["startup"]["peak_until_ready_bytes"])
        result["memory"] = {"peak_allocated_bytes": peak, "peak_allocated_gib": peak / GiB,
                            "peak_after_ready_bytes": serving, "weights_bytes": sum(work.bytes.values()),
                            "device_total_bytes": torch.cuda.get_device_properties(device).total_memory}
    else:
        result["memory"] = {"peak_allocated_bytes": None, "weights_bytes": sum(work.bytes.values())}
    save("memory")

    # 8. transformers.
    if args.compare_transformers:
        if text_config is None:     # it loads the checkpoint itself: give it our memory first
            del model
            model = None
            release(device)
        try:
            result["transformers"] = compare_transformers(model, text_config, args, limit, device, dtype, result)
        except Exception as err:  # noqa: BLE001 - our figures are complete and saved; record why this part failed
            result["transformers"] = {"error": f"{type(err).__name__}: {err}"[:1000]}
        save("transformers")
    del model
    release(device)
    print(table(result))
    return result


def compare_transformers(model, text_config, args, limit: int, device: torch.device, dtype: torch.dtype,
                         result: dict) -> dict:
    """transformers on the same weights: over our tensors (random weights), or loaded from --checkpoint after
    ours is freed. Our figures: decode with one busy slot; the plain prefill of --ttft-tokens when it ran,
    else the cold time to first token of the prefix-cache part."""
    import transformers
    ours_decode = next((d for d in result["decode"] if d["busy"] == 1), None)
    started = time.perf_counter()
    if model is not None:
        reference = transformers_from_ours(model, text_config, dtype, device)
    else:
        reference = transformers.Qwen4ExpForCausalLM.from_pretrained(args.checkpoint, dtype=dtype,
                                                                     device_map=str(device)).eval()
    found = {"version": transformers.__version__, "load_s": time.perf_counter() - started,
             "weights": "ours, shared" if model is not None else "from the checkpoint"}
    found.update(measure_transformers(reference, args, limit, device,
                                      ours_decode["sample_ids"] if ours_decode else None))
    del reference
    release(device)
    if ours_decode:
        found["our_decode_ms_per_step"] = ours_decode["ms_per_step"]
        found["decode_speedup"] = found["decode_ms_per_step"] / ours_decode["ms_per_step"]
    plain = next((p for p in result["prefill"] if p["tokens"] == args.ttft_tokens and "seconds" in p), None)
    ours_prefill = plain["seconds"] if plain else result["prefix_cache"]["cold_ttft_s"]
    found["our_prefill_s"] = ours_prefill
    found["our_prefill_source"] = "prefill" if plain else "prefix_cache cold (with snapshot captures)"
    if "prefill_s" in found:
        found["prefill_speedup"] = found["prefill_s"] / ours_prefill
    return found


def table(r: dict) -> str:
    """The compact summary printed at the end."""
    c = r["ceilings"]
    lines = [(f"{r['device_name']} ({r['device']}), {r['model']['source']}, {r['model']['layers']} layers, "
              f"{r['model']['dtype']}, commit {r['commit']}"),
             (f"ceilings: copy {c['copy']['bytes_per_s'] / 1e9:.0f} GB/s (read+write), "
              f"matmul {c['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s"),
             (f"ready in {r['startup']['ready_s']:.1f} s (model {r['startup']['model_s']:.1f} s, engine "
              f"{r['startup']['engine_s']:.1f} s, warm-up {r['startup'].get('warm_up_s') or 0:.1f} s, first request "
              f"{r['startup']['first_request_s']:.2f} s)"),
             "", f"{'decode':<12}{'ms/step':>10}{'tok/s':>10}{'roof ms':>10}{'ratio':>8}"]
    for d in r["decode"]:
        lines.append(f"{str(d['busy']) + ' busy':<12}{d['ms_per_step']:>10.2f}{d['tokens_per_s']:>10.1f}"
                     f"{d['roofline_ms_per_step']:>10.3f}{d['ratio']:>8.3f}")
    lines += ["", f"{'prefill':<12}{'s':>10}{'tok/s':>10}{'roof tok/s':>12}{'ratio':>8}"]
    for p in r["prefill"]:
        if "skipped" in p:
            lines.append(f"{p['tokens']:<12}  skipped: {p['skipped'][:60]}")
        else:
            lines.append(f"{p['tokens']:<12}{p['seconds']:>10.2f}{p['tokens_per_s']:>10.0f}"
                         f"{p['roofline_tokens_per_s']:>12.0f}{p['ratio']:>8.3f}")
    pc = r["prefix_cache"]
    lines += ["", (f"resent {pc['prompt_tokens']}-token prompt: cold {pc['cold_ttft_s']:.3f} s, warm "
                   f"{pc['warm_ttft_s']:.3f} s ({pc['warm_cached_tokens']} cached, x{pc['speedup']:.1f}), "
                   f"identical: {pc['identical']}"),
              (f"restore of {pc['restore']['restored_tokens']} tokens ({pc['restore']['cached_tokens']} cached): "
               f"{pc['restore']['restore_ms']:.1f} ms")]
    if r.get("first_tokens", {}).get("prompts"):
        lines += ["", f"{'cold prompt':<12}{'first s':>9}{'again s':>9}{'split s':>9}  where the split one's time went"]
        for f in r["first_tokens"]["prompts"]:
            parts = ", ".join(f"{k} {v * 1000:.1f}" for k, v in f["parts_s"].items() if v >= 0.0005)
            launch = f" (launched in {f['forward_launch_s'] * 1000:.1f})" if "forward_launch_s" in f else ""
            lines.append(f"{f['tokens']:<12}{f['first_s']:>9.3f}{f['plain_s']:>9.3f}{f['ttft_s']:>9.3f}  ms: {parts}"
                         f"{launch}")
            if f.get("first_compiles") or f.get("first_new_device_segments"):
                lines.append(f"{'':<12}the first: {f.get('first_new_device_segments')} new device segments, "
                             f"compiled {', '.join(f.get('first_compiles') or []) or 'nothing'}")
    m = r["memory"]
    if m.get("peak_allocated_bytes"):
        lines.append(f"peak device memory {m['peak_allocated_bytes'] / GiB:.1f} GiB "
                     f"(weights {m['weights_bytes'] / GiB:.1f} GiB)")
    h = r.get("transformers")
    if h and "error" in h:
        lines.append(f"transformers: {h['error'][:200]}")
    elif h:
        line = f"transformers {h['version']}: decode {h['decode_ms_per_step']:.1f} ms/step"
        if "decode_speedup" in h:
            line += f" (ours x{h['decode_speedup']:.1f})"
        if "prefill_s" in h:
            line += f", prefill {h['prefill_tokens']} tokens {h['prefill_s']:.2f} s (ours x{h['prefill_speedup']:.1f})"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main(started_at=process_start_time())
