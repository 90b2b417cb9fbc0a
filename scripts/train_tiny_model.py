#!/usr/bin/env python3
"""Train the tiny qwen4_exp checkpoint that ships in qwen4exp/assets/tiny_model, on a CPU, from nothing.

The whole recipe, deterministic given --seed (and --steps) on a given machine:

1. corpus: the King James Version of the Bible (1611, public domain) from Debian's `bible-kjv-text` package, read
   with the `bible` program of Debian's `bible-kjv` package (both fetched with `apt-get download` and unpacked with
   `dpkg -x`; nothing is installed). The data file is the BRS compressed format, so the package's own reader dumps
   every verse (`Gen1:1-Rev22:21`); we keep the 31,102 verses and group them by chapter.
2. documents: each chapter's verses, one per line; and ChatML exchanges (user: a verse, assistant: the next one or
   two verses, then <|im_end|>) so that a chat prompt gets an answer that ends. Documents are separated by
   <|endoftext|>. Every 40th chapter is held out for validation.
3. tokenizer: the project's byte-level BPE builder (qwen4exp.checkpoint.tokenizer_builder) trained on this corpus,
   with <|endoftext|>, <|im_start|>, <|im_end|> at eos, eos+1, eos+2.
4. model: the tiny preset scaled up (see `model_config`), trained with the differentiable forward of
   qwen4exp.engine.model.training: next-token loss + 0.3 x the MTP head's loss (token t+2) + the QSA indexer's
   KL loss + a MoE load-balancing loss; AdamW, warmup and cosine decay, fixed-length windows of the token stream.
5. checkpoint: the published layout (model.language_model.*, one tensor per expert projection, the PLE table in
   shards, mtp.*), config.json, generation_config.json, tokenizer files, words.txt (every word of the corpus,
   lower-cased: the tests' readability check) and a README.md with the numbers of this run.

    python scripts/train_tiny_model.py --out daemon/qwen4exp/assets/tiny_model --minutes 20 --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "daemon"))

from qwen4exp.checkpoint import layout, tokenizer_builder  # noqa: E402
from qwen4exp.checkpoint.presets import preset_config  # noqa: E402
from qwen4exp.checkpoint.safetensors_stream import SafetensorsStream  # noqa: E402
from qwen4exp.checkpoint.writer import INDEX_FILE, generation_config  # noqa: E402
from qwen4exp.engine.generate import generate  # noqa: E402
from qwen4exp.engine.model.causal_lm import Qwen4ExpForCausalLM  # noqa: E402
from qwen4exp.engine.model.config import ModelConfig  # noqa: E402
from qwen4exp.engine.model.training import training_forward  # noqa: E402
from qwen4exp.tokenizer import Tokenizer  # noqa: E402

PACKAGES = ("bible-kjv-text", "bible-kjv")
VERSES = 31102
VERSE_LINE = re.compile(r"(?:^|> )((?:[1-3])?[A-Za-z]+)(\d+):(\d+) (.+)$")
VAL_EVERY = 40          # every 40th chapter is validation
CHAT_SHARE = 0.15       # chance that a verse starts a chat exchange (about a quarter of the tokens are chat)
SEQ_LEN = 256
BATCH = 8
LR, MIN_LR_RATIO, WARMUP, WEIGHT_DECAY = 3e-3, 0.1, 100, 0.1
MTP_WEIGHT, INDEXER_WEIGHT, BALANCE_WEIGHT = 0.3, 0.1, 0.01
# Optimiser steps per minute on the reference machine (2 cores, one torch thread, this config, with some slack):
# --minutes sets the step count from it, so the run is the same computation whatever the machine's speed.
STEPS_PER_MINUTE = 45.0
WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
PROMPTS = ("In the beginning", "And the LORD said unto Moses,", "Blessed are the")
CHAT_PROMPTS = ("Who made the heaven and the earth?", "Tell me about love.")


# --------------------------------------------------------------------------------------------------- corpus


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def fetch_corpus(work: Path) -> tuple[list[tuple[str, int, int, str]], dict[str, str]]:
    """Download and unpack the two Debian packages into `work`; return the verses (book, chapter, verse, text)
    and {package file: sha256}."""
    work.mkdir(parents=True, exist_ok=True)
    debs = sorted(work.glob("*.deb"))
    if len(debs) < len(PACKAGES):
        try:
            _run(["apt-get", "download", *PACKAGES], cwd=work)
        except subprocess.CalledProcessError:
            _run(["apt-get", "update"])   # a fresh machine has no package lists yet
            _run(["apt-get", "download", *PACKAGES], cwd=work)
        debs = sorted(work.glob("*.deb"))
    sums = {}
    root = work / "root"
    for deb in debs:
        sums[deb.name] = hashlib.sha256(deb.read_bytes()).hexdigest()
        _run(["dpkg", "-x", str(deb), str(root)])
    data_dir = root / "usr" / "lib"
    dump = _run([str(root / "usr" / "bin" / "bible"), "-f", "-p", str(data_dir)], input="Gen1:1-Rev22:21\n").stdout
    verses, seen = [], set()
    for line in dump.splitlines():
        m = VERSE_LINE.search(line)
        if not m:
            continue
        key = (m[1], int(m[2]), int(m[3]))
        if key in seen:  # the program prints Gen1:1 once on start-up
            continue
        seen.add(key)
        verses.append((*key, " ".join(m[4].split())))
    if len(verses) != VERSES:
        raise SystemExit(f"expected {VERSES} verses from the bible program, got {len(verses)}")
    (work / "copyright.txt").write_text((root / "usr/share/doc/bible-kjv-text/copyright").read_text())
    return verses, sums


def chapters(verses) -> list[list[str]]:
    out, last = [], None
    for book, chapter, _, text in verses:
        if (book, chapter) != last:
            out.append([])
            last = (book, chapter)
        out[-1].append(text)
    return out


def documents(chaps: list[list[str]], gen: torch.Generator) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, val) documents, each ("text", chapter) or ("chat", (user, assistant))."""
    train, val = [], []
    for i, verses in enumerate(chaps):
        bucket = val if i % VAL_EVERY == VAL_EVERY // 2 else train
        bucket.append(("text", "\n".join(verses)))
        for j in range(len(verses) - 1):
            if torch.rand((), generator=gen).item() >= CHAT_SHARE:
                continue
            span = 1 + int(torch.randint(0, 2, (), generator=gen).item())
            bucket.append(("chat", (verses[j], " ".join(verses[j + 1:j + 1 + span]))))
    order = torch.randperm(len(train), generator=gen).tolist()
    return [train[i] for i in order], val


# ------------------------------------------------------------------------------------------ tokenizer, config


@contextlib.contextmanager
def tokenizer_corpus(text: str):
    """Point the project's tokenizer builder at our corpus (it reads CORPUS_FILE, paragraphs split on blank
    lines) for the duration of the block."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.txt"
        path.write_text(text, encoding="utf-8")
        saved = tokenizer_builder.CORPUS_FILE
        tokenizer_builder.CORPUS_FILE = path
        tokenizer_builder._train.cache_clear()
        try:
            yield
        finally:
            tokenizer_builder.CORPUS_FILE = saved
            tokenizer_builder._train.cache_clear()


def model_config(args) -> dict:
    """The tiny preset, scaled: 4 layers (3 Gated DeltaNet, 1 QSA), hidden 128, PLE on layer 2, 8-expert top-2 MoE,
    4 streams, an MTP layer, a 2048-id vocabulary, QSA keeping 32 tokens (dense up to 35)."""
    config = preset_config("tiny", layers=args.layers, dtype="float32")
    text = config["text_config"]
    old_eos = text["eos_token_id"]
    hidden = args.hidden
    text.update(
        vocab_size=args.vocab,
        eos_token_id=args.vocab - 24,   # specials at eos..eos+2 (2024-2026); learned BPE ids below eos-10
        hidden_size=hidden,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=hidden // 64,
        linear_num_value_heads=hidden // 32,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=args.experts,
        num_experts_per_tok=2,
        moe_intermediate_size=args.moe_inter,
        shared_expert_intermediate_size=args.moe_inter,
        hc_count=4,
        hc_lowrank=32,
        ple_embed_dim=64,
        ngram_vocab_size_base=4000,
        indexer_budget=args.budget,
        max_position_embeddings=4096,
        mtp_num_hidden_layers=1,
    )
    for key in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"):
        config[key] += text["eos_token_id"] - old_eos
    config["vision_config"]["out_hidden_size"] = hidden
    return config


# ------------------------------------------------------------------------------------------------------ model


def init_weights(model: Qwen4ExpForCausalLM, cfg: ModelConfig, seed: int) -> None:
    """Fan-in normal init; output projections scaled by 1/sqrt(2 * layers); Gated DeltaNet decay as in Qwen3-Next."""
    gen = torch.Generator().manual_seed(seed)
    out_scale = (2 * (cfg.num_hidden_layers + cfg.mtp_num_hidden_layers)) ** -0.5
    out_names = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj", "value_proj.weight")
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))           # softplus^-1(dt)
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:                                        # zero-centred RMSNorm scales
                p.zero_()
            elif name.endswith("embed_tokens.weight") or name.endswith("ngram_embedding.weight"):
                p.normal_(0.0, 1.0, generator=gen)
            elif "conv1d" in name:
                p.normal_(0.0, p.shape[-1] ** -0.5 * (0.3 if ".ple." in name else 1.0), generator=gen)
            elif name.endswith("block_inject_weight"):
                p.zero_()                                             # injection gates start at 1
            elif name.endswith("input_mix_weight_up"):
                p.normal_(0.0, 0.02, generator=gen)                   # stream mix starts near uniform
            else:
                std = p.shape[-1] ** -0.5
                if any(name.endswith(o) for o in out_names):
                    std *= out_scale
                elif name.endswith("mlp.gate.weight"):
                    std *= 0.1
                elif name == "lm_head.weight":
                    std *= 0.5
                p.normal_(0.0, std, generator=gen)


def param_groups(model) -> list[dict]:
    decay = [p for n, p in sorted(model.named_parameters()) if p.dim() >= 2]
    keep = [p for n, p in sorted(model.named_parameters()) if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": keep, "weight_decay": 0.0}]


def count_params(model) -> tuple[int, int]:
    """(stored parameters, parameters a token uses in the main model: top-k of the routed experts)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    main = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and not n.startswith("mtp."))
    ple = sum(p.numel() for n, p in model.named_parameters() if "ngram_embedding" in n)
    active = main - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts) - ple
    return total, int(active)


def losses(model, batch: torch.Tensor, aux: bool = True) -> dict[str, torch.Tensor]:
    out = training_forward(model, batch, mtp=True, aux=aux)
    vocab = out.logits.shape[-1]
    main = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), batch[:, 1:].reshape(-1))
    mtp = F.cross_entropy(out.mtp_logits[:, :-1].reshape(-1, vocab), batch[:, 2:].reshape(-1))
    result = {"main": main, "mtp": mtp}
    if aux:
        result.update(indexer=out.indexer_loss, balance=out.balance_loss)
        result["total"] = main + MTP_WEIGHT * mtp + INDEXER_WEIGHT * out.indexer_loss + \
            BALANCE_WEIGHT * out.balance_loss
    return result


def windows(stream: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - SEQ_LEN, (count,), generator=gen)
    return torch.stack([stream[s:s + SEQ_LEN] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, val_batches: list[torch.Tensor]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for batch in val_batches:
        for k, v in losses(model, batch, aux=False).items():
            totals[k] = totals.get(k, 0.0) + v.item() / len(val_batches)
    return totals


def encode_docs(tok: Tokenizer, docs, eos: int) -> torch.Tensor:
    ids: list[int] = []
    for kind, body in docs:
        if kind == "text":
            ids += tok.encode(body)
        else:
            user, answer = body
            prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
            ids += tok.encode(prompt + answer + "<|im_end|>\n")
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------------- checkpoint


def write_checkpoint(out: Path, model: Qwen4ExpForCausalLM, config: dict, dtype: torch.dtype) -> int:
    """Weights in the published layout (one shard) plus index, config.json and generation_config.json."""
    text = config["text_config"]
    state = model.state_dict()
    entries, tensors = {}, []
    for spec in layout.runtime_specs(text):
        full = state[spec.name]
        if tuple(full.shape) != spec.shape:
            raise SystemExit(f"{spec.name}: model has {tuple(full.shape)}, the layout says {spec.shape}")
        for piece in layout.disk_pieces(spec, text):
            value = (full[piece.index] if piece.index else full).contiguous()
            value = value if spec.init == "const" else value.to(dtype)
            entries[piece.disk] = (value.dtype, tuple(value.shape))
            tensors.append((piece.disk, value))
    shard = "model-00001-of-00001.safetensors"
    with SafetensorsStream(out / shard, entries) as stream:
        for name, value in tensors:
            stream.write(name, value)
    total = sum(v.numel() * v.element_size() for _, v in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": {name: shard for name in sorted(entries)}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(text), indent=2) + "\n")
    return total


def samples(model, tok: Tokenizer, max_tokens: int = 40) -> list[tuple[str, str]]:
    out = []
    stops = tuple(tok.eos_token_ids)
    for prompt in PROMPTS:
        ids = generate(model, tok.encode(prompt), max_tokens, stop_ids=stops).output_ids
        out.append((prompt, tok.decode(ids, skip_special_tokens=True)))
    for prompt in CHAT_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = generate(model, tok.encode(text), max_tokens, stop_ids=stops).output_ids
        out.append((f"[chat] {prompt}", tok.decode(ids, skip_special_tokens=True)))
    return out


# ------------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "daemon/qwen4exp/assets/tiny_model")
    ap.add_argument("--minutes", type=float, default=20.0,
                    help=f"training budget; sets the step count at {STEPS_PER_MINUTE:g} steps per minute "
                         "(the reference machine's speed), and stops early past 1.5x the budget")
    ap.add_argument("--steps", type=int, default=None, help="optimiser steps (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="where to keep the downloaded packages (default: temp)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (results depend on it). One by default: on a shared 2-core machine, two "
                         "OpenMP threads stall at every barrier when another process takes a core (measured 10x)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="stored weight dtype")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-inter", type=int, default=128)
    ap.add_argument("--budget", type=int, default=32, help="QSA indexer budget in tokens (dense up to budget+3)")
    ap.add_argument("--bench", type=int, default=0, help="only time this many steps and exit")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()

    # 1-2. corpus and documents
    work_ctx = tempfile.TemporaryDirectory() if args.work is None else contextlib.nullcontext(str(args.work))
    with work_ctx as work:
        verses, sums = fetch_corpus(Path(work) / "kjv")
        license_text = (Path(work) / "kjv" / "copyright.txt").read_text()
    chaps = chapters(verses)
    gen = torch.Generator().manual_seed(args.seed)
    train_docs, val_docs = documents(chaps, gen)
    print(f"corpus: {len(verses)} verses, {len(chaps)} chapters; {len(train_docs)} train and {len(val_docs)} "
          f"validation documents", flush=True)

    # 3. tokenizer
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = model_config(args)
    text = config["text_config"]
    corpus_text = "\n\n".join(body for kind, body in train_docs if kind == "text")
    with tokenizer_corpus(corpus_text):
        tokenizer_builder.write_tokenizer(out, text)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(text), indent=2) + "\n")
    tok = Tokenizer.from_dir(out)
    eos = text["eos_token_id"]
    train_ids, val_ids = encode_docs(tok, train_docs, eos), encode_docs(tok, val_docs, eos)
    words = sorted({w for _, _, _, v in verses for w in WORD.findall(v.lower())})
    (out / "words.txt").write_text("\n".join(words) + "\n")
    print(f"tokens: {train_ids.numel()} train, {val_ids.numel()} validation "
          f"({len(corpus_text) / max(1, train_ids.numel()):.2f} chars/token); {len(words)} distinct words", flush=True)

    # 4. model and training
    cfg = ModelConfig.from_dict(config)
    model = Qwen4ExpForCausalLM(cfg)
    init_weights(model, cfg, args.seed)
    total_params, active = count_params(model)
    print(f"model: {total_params / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token, main model, "
          f"without the n-gram table)", flush=True)
    steps = args.steps or max(1, round(args.minutes * STEPS_PER_MINUTE))
    if args.bench:
        steps = args.bench
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8)
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [windows(val_ids, BATCH, torch.Generator().manual_seed(1000 + i)) for i in range(4)]
    log, t0, tokens = [], time.time(), 0
    deadline = t0 + 1.5 * args.minutes * 60
    stopped_early = False
    for step in range(steps):
        lr = LR * min(1.0, (step + 1) / WARMUP)
        if step >= WARMUP:
            progress = (step - WARMUP) / max(1, steps - WARMUP)
            lr = LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = windows(train_ids, BATCH, data_gen)
        parts = losses(model, batch)
        opt.zero_grad(set_to_none=True)
        parts["total"].backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch.numel()
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.time() - t0
            print(f"step {step:5d}/{steps} lr {lr:.2e} loss {parts['main'].item():.3f} mtp {parts['mtp'].item():.3f} "
                  f"idx {parts['indexer'].item():.3f} bal {parts['balance'].item():.3f} |g| {norm.item():.2f} "
                  f"{tokens / elapsed:.0f} tok/s {elapsed / 60:.1f} min", flush=True)
            log.append({"step": step, "loss": round(parts["main"].item(), 4), "mtp": round(parts["mtp"].item(), 4)})
        if args.bench == 0 and step % 200 == 199:
            print(f"  validation: {evaluate(model, val_batches)}", flush=True)
        if time.time() > deadline and step < steps - 1:
            print(f"stopping at step {step + 1}: past 1.5x the {args.minutes} minute budget", flush=True)
            stopped_early, steps = True, step + 1
            break
    train_s = time.time() - t0
    if args.bench:
        print(f"bench: {tokens / train_s:.0f} tokens/s, {60 * args.bench / train_s:.1f} steps/min")
        return 0
    model.eval()
    final_train = evaluate(model, [windows(train_ids, BATCH, torch.Generator().manual_seed(2000 + i))
                                   for i in range(4)])
    final_val = evaluate(model, val_batches)
    print(f"final: train {final_train}, validation {final_val}", flush=True)

    # 5. checkpoint
    dtype = getattr(torch, args.dtype)
    nbytes = write_checkpoint(out, model, config, dtype)
    from qwen4exp.engine.loading import load_model
    loaded = load_model(str(out), dtype="float32", device="cpu", progress=False)
    stored_val = evaluate(loaded, val_batches)
    shown = samples(loaded, tok)
    for prompt, reply in shown:
        print(f"--- {prompt!r}\n{reply}")
    write_readme(out, args, dict(
        sums=sums, license=license_text, verses=len(verses), chapters=len(chaps), words=len(words),
        train_tokens=train_ids.numel(), val_tokens=val_ids.numel(), params=total_params, active=active,
        steps=steps, stopped_early=stopped_early, train_s=train_s, total_s=time.time() - started,
        seen=tokens, final_train=final_train, final_val=final_val, stored_val=stored_val, nbytes=nbytes,
        samples=shown, cfg=text, log=log))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB) in {(time.time() - started) / 60:.1f} min")
    return 0


def write_readme(out: Path, args, r: dict) -> None:
    t = r["cfg"]
    copyright_lines = "\n".join("    " + line for line in r["license"].strip().splitlines())
    sample_text = "\n\n".join(f"    {p}\n" + "\n".join("    -> " + line for line in reply.splitlines())
                              for p, reply in r["samples"])
    cmd = (f"python scripts/train_tiny_model.py --out daemon/qwen4exp/assets/tiny_model --minutes {args.minutes:g} "
           f"--seed {args.seed}" + (f" --steps {args.steps}" if args.steps else "") +
           (f" --dtype {args.dtype}" if args.dtype != "float32" else "") +
           (f" --threads {args.threads}" if args.threads != 1 else ""))
    layers = ", ".join("QSA" if x == "full_attention" else "GDN" for x in t["layer_types"])
    dense = t["indexer_budget"] + t["indexer_compress_ratio"] - 1
    model_text = textwrap.fill(
        f"qwen4_exp (`config.json` here): {t['num_hidden_layers']} layers ({layers}), hidden {t['hidden_size']}, "
        f"PLE on layer {', '.join(map(str, t['ple_layer_ids']))}, MoE with {t['num_experts']} experts (top "
        f"{t['num_experts_per_tok']}, intermediate {t['moe_intermediate_size']}, plus a shared expert), "
        f"{t['hc_count']} hyper-connection streams, QSA indexer budget {t['indexer_budget']} tokens (dense up to "
        f"{dense} visible tokens, so training windows of {SEQ_LEN} tokens run sparse), one MTP layer, a "
        f"{t['vocab_size']}-id byte-level BPE vocabulary (the project's tokenizer builder trained on this corpus; "
        f"specials at {t['eos_token_id']}-{t['eos_token_id'] + 2}). {r['params']:,} parameters "
        f"({r['active']:,} used per token by the main model, without the n-gram table); weights stored as "
        f"{args.dtype} ({r['nbytes'] / 1e6:.1f} MB).", width=115)
    early = " It stopped early, at 1.5x the time budget." if r["stopped_early"] else ""
    training_text = textwrap.fill(
        f"{r['steps']} AdamW steps of {BATCH} x {SEQ_LEN} tokens ({r['seen']:,} tokens, "
        f"{r['seen'] / r['train_tokens']:.1f} passes), lr {LR:g} with {WARMUP} warmup steps and cosine decay to "
        f"{MIN_LR_RATIO:g}x, weight decay {WEIGHT_DECAY:g}, gradient clip 1.0, float32, {args.threads} torch "
        f"thread(s). Loss: next token, plus {MTP_WEIGHT:g} x MTP (token t+2), plus {INDEXER_WEIGHT:g} x the QSA "
        f"indexer's KL to the attention's block mass, plus {BALANCE_WEIGHT:g} x MoE load balance "
        f"(`qwen4exp.engine.model.training`). Training took {r['train_s'] / 60:.1f} minutes (the whole script "
        f"{r['total_s'] / 60:.1f}; {r['seen'] / r['train_s']:.0f} tokens/s on a 2-core machine shared with other "
        f"work).{early} The step count comes from --minutes ({STEPS_PER_MINUTE:g} steps a minute), not from the "
        f"clock, so a rerun with the same arguments and thread count writes the same weights.", width=115)
    body = f"""# The embedded default model

A tiny qwen4_exp checkpoint trained from scratch on a CPU: what `qwen4exp serve` and `qwen4exp generate` load when
no model is named. It writes English in the style of the King James Bible; it knows nothing else.

## Corpus

The King James Version of the Bible (1611), {r['verses']} verses in {r['chapters']} chapters, from Debian's
`bible-kjv-text` package, read with the `bible` program of Debian's `bible-kjv` package (both fetched with
`apt-get download` and unpacked with `dpkg -x` by the training script; the text is in the program's compressed
BRS format). Package files used (sha256):

{chr(10).join(f"    {v}  {k}" for k, v in sorted(r['sums'].items()))}

**License.** The King James Version text (1611) is in the public domain (its copyright has long expired, as the
Debian copyright file below says); in the United Kingdom alone, the Crown's letters patent still govern printing
the Authorized Version. Only the trained weights, the tokenizer and the word list derived from the text ship here;
the `bible` program (GPL-2+) is run by the training script to read the data and is not shipped. The Debian
copyright file of `bible-kjv-text`:

{copyright_lines}

Documents: each chapter (verses one per line), and ChatML exchanges made from it (user: a verse; assistant: the
next one or two verses, then `<|im_end|>`), separated by `<|endoftext|>`. Every {VAL_EVERY}th chapter is held out.
Tokens: {r['train_tokens']:,} train, {r['val_tokens']:,} validation. `words.txt` lists the corpus's
{r['words']:,} distinct words, lower-cased (the tests' readability check).

## Model

{model_text}

## Training

    {cmd}

{training_text}

| | next token | MTP (t+2) |
|---|---|---|
| final train loss | {r['final_train']['main']:.3f} | {r['final_train']['mtp']:.3f} |
| final validation loss | {r['final_val']['main']:.3f} | {r['final_val']['mtp']:.3f} |
| validation, stored {args.dtype} weights | {r['stored_val']['main']:.3f} | {r['stored_val']['mtp']:.3f} |

`training_log.json` has the training loss every 25 steps.

## Samples (greedy, 40 tokens, stored weights)

{sample_text}
"""
    (out / "README.md").write_text(body)
    (out / "training_log.json").write_text(json.dumps(r["log"]) + "\n")


if __name__ == "__main__":
    sys.exit(main())
