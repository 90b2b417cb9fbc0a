"""What speculative decoding with the MTP head costs and gives on one device (issue 20, item 5).

    python bench/mtp_speed.py (--checkpoint DIR | --preset bench --layers 8 [--quant ud-q4_k_xl --ple host]) \
        --dtype bfloat16 --device cuda --out results.json [--slots 1,4] [--drafts 1,2,3,4] [--tokens 64]

Measured, for each slot count:
1. the verify step against a plain decode step: every slot busy at a short prompt's length, median of --repeats
   runs, eager (`_ms`) and replayed from a CUDA graph (`_graph_ms`, as the engine runs its steps on a GPU), for
   1 + k positions per slot (k = each of --drafts), in both of the model's forms: "one by one"
   (each position a plain step: what the engine runs where the backend's row-wise ops are not independent of the
   row count, the CPU's with SIMD) and "together" (the positions' row-wise ops in one pass, each product's rows as
   a plain step computes them: the Triton backend's form; its logits are compared bit for bit with the plain
   steps', `together_exact`, which is what a backend must show before it may verify that way:
   ops.rows_independent), and one pass of the MTP head (`head_step_graph_ms`);
2. plain decoding against an engine drafting 3 tokens a step whose drafts come from an oracle (the tokens plain
   decoding produced, labelled as such: random weights accept nothing of their own): generated tok/s of each, the
   accepted drafts, and where the drafting engine's time went (the head's drafting, the verify step, the rest; on a
   GPU as spans of the device's timeline), whether every answer was plain decoding's (and, per request, the first
   token where it was not: `first_difference`); "oracle" with the verify
   step's positions one by one, "oracle_together" with them together (the engine's form on a GPU). With
   --accuracies below 1 the oracle's drafts are each wrong with the rest's chance (`_accuracy_P`), and with
   --choices adaptive the drafting engine chooses its drafts itself (`_adaptive`: from each slot's acceptance and,
   on a GPU, its step costs measured at start, `step_costs_ms`, and what its steps took beyond them on the host's
   clock, `step_extra_ms`): measured tok/s at a given acceptance, where section 3 computes it;
3. tok/s at a mean acceptance length of 2.6 tokens per step (vLLM's figure for 3 drafts on the FP8 model), from
   the measured times: 2.6 tokens a slot / the oracle run's whole time per step (drafting, verifying and the
   engine's own work around them: a step of 3 drafts costs that whether 1 or all 3 are taken).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from pathlib import Path

import torch

from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.engine.cuda_graph import capture_graph
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.request import Request
from qwen4exp.engine.speculative import Drafter, Drafts
from speed import commit, sync, timed        # bench/speed.py: this directory is on the path when run as a script

ACCEPTANCE_LENGTH = 2.6


def _timed(run, device: torch.device, repeats: int) -> float:
    """Median seconds of run() over `repeats` (after one untimed run)."""
    return statistics.median(timed(run, device, repeats))


def _graphed_ms(run, device: torch.device, repeats: int) -> float | str:
    """Median milliseconds of run() replayed from a CUDA graph, as the engine replays its decode step (the host's
    launches out of the time); the error's text where the capture fails; "eager only" off a GPU."""
    if device.type != "cuda":
        return "eager only"
    try:
        graph, _ = capture_graph(run, device)
    except Exception as err:  # noqa: BLE001 - a form that cannot be captured is a finding, not the bench's end
        torch.cuda.synchronize(device)
        return f"capture failed: {type(err).__name__}: {err}"[:300]
    return 1e3 * _timed(graph.replay, device, repeats)


class _Form:
    """ops.rows_independent set for a block: off, a verify step's positions run one plain step after another;
    on, together (a plain step runs alike either way)."""

    def __init__(self, ops, together: bool):
        self.ops, self.together = type(ops), together

    def __enter__(self):
        self.was, self.ops.rows_independent = self.ops.rows_independent, self.together

    def __exit__(self, *exc):
        self.ops.rows_independent = self.was


def verify_costs(model, slots: int, drafts: list[int], device: torch.device, repeats: int) -> dict:
    """Plain step and verify steps of 1 + k positions per slot, one by one and together (section 1)."""
    prompt = 64
    states = model.new_state_batch(slots, 1024, device)
    states.allocate_history(max(drafts))
    for row in states.rows:
        model(torch.arange(1, prompt + 1, device=device), row)
    rope = model.rope_table(states.capacity, device)
    active = torch.ones(slots, dtype=torch.bool, device=device)

    def rows(substeps: int):
        tokens = torch.randint(1, 1000, (substeps * slots,), device=device)
        positions = torch.tensor([prompt + j for j in range(substeps) for _ in range(slots)], device=device)
        return tokens, positions, active.repeat(substeps)

    plain_tokens, plain_positions, _ = rows(1)
    ops = model.ops
    out = {}

    def plain():
        model.decode_rows(plain_tokens, plain_positions, active, states, rope)
    out["plain_step_ms"] = 1e3 * _timed(plain, device, repeats)
    out["plain_step_graph_ms"] = _graphed_ms(plain, device, repeats)
    # One pass of the MTP head over every slot's row (a draft 2..k; draft 1 runs over the unseen positions).
    streams = model.verify_rows(plain_tokens, plain_positions, active, states, rope, 1)[1].clone()
    with _Form(ops, True):
        def head():
            model.draft_rows(streams, plain_tokens, plain_positions, active, states, rope)
        out["head_step_graph_ms"] = _graphed_ms(head, device, repeats)
    for k in drafts:
        tokens, positions, on = rows(1 + k)
        entry = {}
        for form, together in (("one_by_one", False), ("together", True)):
            with _Form(ops, together):
                def verify():
                    model.verify_rows(tokens, positions, on, states, rope, 1 + k)
                entry[f"{form}_ms"] = 1e3 * _timed(verify, device, repeats)
                entry[f"{form}_graph_ms"] = _graphed_ms(verify, device, repeats)
        # Exactness of the together form: the same rows from fresh states, against plain steps.
        check, reference = model.new_state_batch(slots, 1024, device), model.new_state_batch(slots, 1024, device)
        check.allocate_history(k)
        for a, b in zip(check.rows, reference.rows):
            model(torch.arange(1, prompt + 1, device=device), a)
            model(torch.arange(1, prompt + 1, device=device), b)
        with _Form(ops, True):
            together, _ = model.verify_rows(tokens, positions, on, check, rope, 1 + k)
            plain_rows = torch.cat([model.decode_rows(tokens[j * slots:(j + 1) * slots],
                                                      positions[j * slots:(j + 1) * slots], active, reference, rope)
                                    for j in range(1 + k)])
        entry["together_exact"] = bool(torch.equal(together, plain_rows))
        graphs = (entry["together_graph_ms"], out["plain_step_graph_ms"])
        if all(isinstance(t, float) for t in graphs):
            entry["together_over_plain_graph"] = round(graphs[0] / graphs[1], 3)
        out[f"k{k}"] = entry
    return out


def _first_difference(got: list[int], want: list[int]) -> int | None:
    """The index of the first token where `got` leaves plain decoding's `want` (None where they are equal): where
    a run that differs went wrong, a slot at a time."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return None if got == want else at


def oracle_run(model, slots: int, tokens: int, device: torch.device, context: int, together: bool,
               accuracy: float = 1.0, adaptive: bool = False) -> dict:
    """Plain decoding, then 3 drafts a step from an oracle (section 2); `together`: the verify step's positions in
    one pass (ops.rows_independent), else one by one."""
    with _Form(model.ops, together):
        return _oracle_run(model, slots, tokens, device, context, accuracy, adaptive)


def _oracle_run(model, slots: int, tokens: int, device: torch.device, context: int, accuracy: float,
                adaptive: bool) -> dict:
    prompts = [[(7 * i + j) % 900 + 1 for j in range(32 + 8 * i)] for i in range(slots)]

    timing = {"draft": 0.0, "verify": 0.0}
    spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def run(**kw) -> tuple[list[Request], float, Engine, int]:
        """The requests, the seconds and decode steps after every prompt is done, the engine."""
        engine = Engine(model, slots=slots, context=context, chunk=256, cuda_graphs=device.type == "cuda", **kw)
        warm = engine.submit(Request(prompt_ids=prompts[0], max_tokens=8))
        engine.run_until_idle()
        assert warm.error is None
        requests = [engine.submit(Request(prompt_ids=p, max_tokens=tokens)) for p in prompts]
        while any(r.first_token_at is None for r in requests):     # prompts first: time decoding only
            engine.step()
        sync(device)
        timing.update(draft=0.0, verify=0.0)
        spans.clear()
        steps, started = engine.counters.decode_steps, time.perf_counter()
        engine.run_until_idle()
        sync(device)
        for name, begin, end in spans:
            timing[name] += begin.elapsed_time(end) / 1e3
        return requests, time.perf_counter() - started, engine, engine.counters.decode_steps - steps

    def phase(name: str, call):
        """call() as the engine makes it, its span timed on the device's timeline by events (a host wait here
        would idle the device where the engine does not), or by the host's clock off a GPU."""
        if device.type != "cuda":
            started = time.perf_counter()
            out = call()
            timing[name] += time.perf_counter() - started
            return out
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = call()
        end.record()
        spans.append((name, begin, end))
        return out

    luck = random.Random(0)         # which of the oracle's drafts are wrong, at an accuracy below 1
    plain, plain_s, _, plain_steps = run()
    answers = {tuple(r.prompt_ids): r.output_ids for r in plain}
    real_draft, real_verify = Drafter.draft, Drafter.verify

    def oracle_draft(self, decoding):
        drafts = phase("draft", lambda: real_draft(self, decoding))   # the head runs; its proposals are replaced
        if drafts.tokens is None:
            return drafts
        tokens = [[0] * drafts.tokens.shape[1] for _ in range(drafts.tokens.shape[0])]
        for slot in decoding:
            answer, done = answers[tuple(slot.request.prompt_ids)], len(slot.request.output_ids)
            for i, token in enumerate(answer[done:done + drafts.counts[slot.index]]):
                right = accuracy >= 1 or luck.random() < accuracy
                tokens[i][slot.index] = token if right else (token + 1) % model.config.vocab_size
        host = torch.tensor(tokens)
        if device.type == "cuda":
            host = host.pin_memory()
        return Drafts(drafts.counts, host.to(device, non_blocking=True))

    def timed_verify(self, decoding, drafts):
        return phase("verify", lambda: real_verify(self, decoding, drafts))

    Drafter.draft, Drafter.verify = oracle_draft, timed_verify
    try:
        drafted, drafted_s, engine, steps = run(mtp=3, mtp_adaptive=adaptive)
    finally:
        Drafter.draft, Drafter.verify = real_draft, real_verify
    same = [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    first_difference = [_first_difference(d.output_ids, p.output_ids) for d, p in zip(drafted, plain)]
    generated = sum(len(r.output_ids) - 1 for r in plain)
    accepted = sum(r.mtp_accepted for r in drafted)      # the timed requests' (not the warm-up's)
    per_step = drafted_s / max(steps, 1)
    return {"same_answers": same, "first_difference": first_difference, "generated": generated,
            "plain_tok_s": round(generated / plain_s, 1),
            "oracle_tok_s": round(generated / drafted_s, 1), "oracle_speedup": round(plain_s / drafted_s, 3),
            "accepted": accepted, "drafted": sum(r.mtp_drafted for r in drafted),
            "verify_steps": steps, "plain_steps": plain_steps,
            "draft_ms_per_step": round(1e3 * timing["draft"] / max(steps, 1), 3),
            "verify_ms_per_step": round(1e3 * timing["verify"] / max(steps, 1), 3),
            "other_ms_per_step": round(1e3 * (drafted_s - timing["draft"] - timing["verify"]) / max(steps, 1), 3),
            f"tok_s_at_acceptance_length_{ACCEPTANCE_LENGTH}": round(slots * ACCEPTANCE_LENGTH / per_step, 1),
            "plain_ms_per_step": round(1e3 * plain_s / max(plain_steps, 1), 3),
            "accuracy": accuracy, "adaptive": adaptive,
            "tokens_per_slot_step": round(generated / max(generated - accepted, 1), 3),
            "step_costs_ms": engine.step_costs.table() if engine.step_costs else None,
            # what the engine's steps took beyond the table, by positions verified a slot (StepCosts.observe)
            "step_extra_ms": {str(s): round(1e3 * t, 3) for s, t in sorted(engine.step_costs.extra.items())}
            if engine.step_costs else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="a checkpoint with an MTP head (else random weights)")
    parser.add_argument("--mtp-weights", default=None, help="with a GGUF --checkpoint: the safetensors release whose "
                        "MTP head it takes (the profile key mtp_weights)")
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--slots", default="1,4")
    parser.add_argument("--drafts", default="1,2,3,4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quant", default=None, help="random weights: a GGUF mix's quantized weights as random "
                        "blocks (ud-q4_k_xl), the MTP head kept dense as `mtp_weights` gives a GGUF one")
    parser.add_argument("--ple", choices=("device", "host"), default="device",
                        help="with --quant: the quantized PLE table on the device or in host memory")
    parser.add_argument("--oracle-only", action="store_true", help="skip section 1 (the steps' own timings)")
    parser.add_argument("--oracle-forms", default="one_by_one,together",
                        help="section 2's forms, comma-separated, or none (each form runs two engines)")
    parser.add_argument("--accuracies", default="1",
                        help="section 2: the share of the oracle's drafts that are right, comma-separated (1: all; "
                        "below 1 each draft is wrong with the rest's chance, seeded), each run as --choices says")
    parser.add_argument("--choices", default="fixed",
                        help="section 2: fixed (3 drafts a step), adaptive (the engine's choice from each slot's "
                        "acceptance and, on a GPU, its measured step costs), or both, comma-separated")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.ple == "host" and not args.quant:
        parser.error("--ple host keeps a quantized PLE table in host memory: it goes with --quant")
    forms = {"one_by_one": ("oracle", False), "together": ("oracle_together", True)}
    oracle_forms = [] if args.oracle_forms == "none" else args.oracle_forms.split(",")
    if unknown := set(oracle_forms) - set(forms):
        parser.error(f"--oracle-forms: unknown form {sorted(unknown)[0]!r}; the forms are {', '.join(forms)} or none")
    accuracies = [float(a) for a in args.accuracies.split(",")]
    choices = args.choices.split(",")
    if bad := [a for a in accuracies if not 0 <= a <= 1] + sorted(set(choices) - {"fixed", "adaptive"}):
        parser.error(f"--accuracies are shares from 0 to 1 and --choices fixed or adaptive; got {bad[0]!r}")
    device = torch.device(args.device)
    started = time.perf_counter()
    if args.checkpoint:
        model = load_model(args.checkpoint, dtype=args.dtype, device=device, progress=False,
                           mtp_weights=args.mtp_weights)
    else:
        model = random_model(args.preset, layers=args.layers, dtype=args.dtype, device=device, quant=args.quant,
                             mtp_head=True, ple_on_host=args.ple == "host")
    if model.mtp is None:
        raise SystemExit("error: the model has no MTP head")
    result = {"date": datetime.date.today().isoformat(), "commit": commit(), "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "model": args.checkpoint or f"random {args.preset}, {args.layers} layers"
                       + (f", {args.quant} (the MTP head dense), PLE on the {args.ple}" if args.quant else ""),
              "dtype": args.dtype,
              "load_s": round(time.perf_counter() - started, 1), "slots": {}}
    drafts = [int(k) for k in args.drafts.split(",")]
    for slots in (int(n) for n in args.slots.split(",")):
        entry = result["slots"][slots] = {"verify": None if args.oracle_only else verify_costs(model, slots, drafts,
                                                                                              device, args.repeats)}
        Path(args.out).write_text(json.dumps(result, indent=1))
        for form in oracle_forms:
            key, together = forms[form]
            for accuracy in accuracies:
                for choice in choices:
                    name = key + ("" if accuracy == 1 else f"_accuracy_{accuracy}") + (
                        "_adaptive" if choice == "adaptive" else "")
                    entry[name] = oracle_run(model, slots, args.tokens, device, 1024, together, accuracy,
                                             choice == "adaptive")
                    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
