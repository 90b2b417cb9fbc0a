"""Speculative decoding with the MTP head (engine/speculative.py, model/verify.py) on the CPU: a verify step is plain
decode steps, and an engine that drafts gives every request the tokens, and the logits rows, of one that does not."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen4exp.checkpoint.random_weights import random_model
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.engine_config import MAX_DRAFTS, EngineConfig, resolve_mtp
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.prefix_cache import PrefixCache
from qwen4exp.engine.request import FinishReason, Request
from qwen4exp.engine.sampling import SamplingParams
from qwen4exp.engine.snapshot import SnapshotBackend
from qwen4exp.engine.draft_length import DraftLength, StepCosts
from qwen4exp.engine.speculative import Drafter, Drafts
from qwen4exp.model_dir import EMBEDDED_MODEL
from qwen4exp.tokenizer import Tokenizer
from logits_record import assert_same_logits, record_logits
from staggered import run_staggered

CONTEXT, CHUNK = 512, 32


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", dtype=torch.float32, device="cpu", seed=3)


def _prefilled(model, lengths: list[int], capacity: int = 256):
    states = model.new_state_batch(len(lengths), capacity)
    generator = torch.Generator().manual_seed(1)
    for row, length in zip(states.rows, lengths):
        model(torch.randint(0, model.config.vocab_size, (length,), generator=generator), row)
    return states


@pytest.mark.parametrize("lengths, active", [([37], [True]), ([37, 70, 5], [True, True, False])],
                         ids=["one-slot", "three-slots-one-idle"])
def test_a_verify_step_is_plain_decode_steps_bit_for_bit(model, lengths, active):
    """Four positions per row in one verify step (sparse QSA past 35 tokens, a block completed inside the step, an
    idle row): each position's logits are the plain decode step's there, and the committed state of each row is
    the one plain decoding leaves after the positions it keeps."""
    substeps, count = 4, len(lengths)
    plain, verified = _prefilled(model, lengths), _prefilled(model, lengths)
    verified.allocate_history(substeps - 1)
    rope = model.rope_table(plain.capacity, "cpu")
    tokens = torch.randint(0, model.config.vocab_size, (substeps, count), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[length + j for length in lengths] for j in range(substeps)])
    on = torch.tensor(active)
    logits, _ = model.verify_rows(tokens.flatten(), positions.flatten(), on.repeat(substeps), verified, rope, substeps)
    keep = [1, 3, 3][:count]          # row 0 keeps two positions, the others all four (an idle row keeps its own)
    for j in range(substeps):
        want = model.decode_rows(tokens[j], positions[j], on, plain, rope)
        for i in range(count):
            if active[i]:
                assert torch.equal(logits[j * count + i], want[i]), f"position {j} of row {i}"
        if j == keep[0]:
            after_keep = [t.clone() for t in plain.rows[0].carried()]
    verified.commit(torch.tensor(keep), substeps)
    assert all(torch.equal(a, b) for a, b in zip(verified.rows[0].carried(), after_keep))
    for i in range(1, count):
        assert all(torch.equal(a, b) for a, b in zip(verified.rows[i].carried(), plain.rows[i].carried()))
    if os.environ.get("QWEN4EXP_EXPECT_ROWS_TOGETHER") == "1":
        assert model.ops.rows_independent        # this run took the batched path (no SIMD)


def test_the_batched_verify_step_without_simd():
    """With ATen's SIMD off (ATEN_CPU_CAPABILITY=default) the torch ops give an element the same bits wherever it
    sits, so the verify step runs its positions' row-wise ops together (the GPU's path): still plain decode steps."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "QWEN4EXP_EXPECT_ROWS_TOGETHER": "1"}
    test = f"{Path(__file__)}::test_a_verify_step_is_plain_decode_steps_bit_for_bit"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                         cwd=Path(__file__).parent, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def _spec(rng: random.Random) -> dict:
    length = rng.choice([rng.randint(1, 40), rng.randint(60, 300)])   # both sides of the QSA dense limit
    sampled = rng.random() < 0.5
    return {"prompt_ids": [rng.randrange(1000) for _ in range(length)], "max_tokens": rng.randint(1, 24),
            "sampling": SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(10**6)) if sampled
            else SamplingParams()}


def _oracle(monkeypatch, answers: dict[tuple, list[int]], rng: random.Random, wrong: float) -> None:
    """Drafts from plain decoding's answers (the head still runs; its proposals are replaced), each one wrong
    with probability `wrong`, so that steps accept some drafts and reject the rest at every depth."""
    real = Drafter.draft

    def draft(self, decoding):
        drafts = real(self, decoding)
        if drafts.tokens is None:
            return drafts
        tokens = drafts.tokens.tolist()
        for slot in decoding:
            answer, done = answers[tuple(slot.request.prompt_ids)], len(slot.request.output_ids)
            for i in range(drafts.counts[slot.index]):
                right = done + i < len(answer) and rng.random() >= wrong
                tokens[i][slot.index] = answer[done + i] if right else rng.randrange(1000)
        return Drafts(drafts.counts, torch.tensor(tokens, device=drafts.tokens.device))

    monkeypatch.setattr(Drafter, "draft", draft)


@pytest.mark.parametrize("drafts", [1, 3])
@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_mtp_on_equals_off_bit_for_bit(model, monkeypatch, seed, slots, drafts):
    """Requests arriving at random steps, greedy and seeded, a stop token hit inside a step's accepted drafts:
    with drafting (an oracle's drafts, partly wrong: random weights accept nothing of their own) every request
    gets the tokens and every logits row it gets without, bit for bit."""
    record_logits(monkeypatch)
    rng = random.Random(seed)
    specs = [_spec(rng) for _ in range(6)]
    starts = sorted(rng.randint(0, 20) for _ in specs)
    plain = run_staggered(Engine(model, slots=slots, context=CONTEXT, chunk=CHUNK), specs, starts)
    # A stop token that the longest answer reaches mid-way: it ends that request inside a verify step.
    longest = max(range(len(specs)), key=lambda i: len(plain[i].output_ids))
    specs[longest]["stop_token_ids"] = (plain[longest].output_ids[len(plain[longest].output_ids) // 2],)
    plain = run_staggered(Engine(model, slots=slots, context=CONTEXT, chunk=CHUNK), specs, starts)
    _oracle(monkeypatch, {tuple(s["prompt_ids"]): r.output_ids for s, r in zip(specs, plain)}, rng, wrong=0.3)
    engine = Engine(model, slots=slots, context=CONTEXT, chunk=CHUNK, mtp=drafts, mtp_adaptive=False)
    drafted = run_staggered(engine, specs, starts)
    assert drafted[longest].finish_reason is FinishReason.STOP
    for spec, got, want in zip(specs, drafted, plain):
        assert got.output_ids == want.output_ids and got.finish_reason == want.finish_reason
        assert_same_logits(got, want, f"{len(spec['prompt_ids'])}-token prompt")
    counters = engine.drafter.counters
    assert 0 < counters.accepted < counters.drafted
    assert counters.drafted == sum(r.mtp_drafted for r in drafted)
    assert counters.accepted == sum(r.mtp_accepted for r in drafted)
    assert sum(len(r.output_ids) for r in drafted) > engine.counters.decode_steps   # steps gave several tokens


def test_mtp_keeps_warm_equal_to_cold_and_log_probabilities(model, monkeypatch):
    """With the prefix cache, a resent prompt (restored, its head cache not) and a continued one give the
    answers and log-probabilities of plain decoding."""
    prompt = [random.Random(5).randrange(1000) for _ in range(100)]
    ask = dict(max_tokens=12, logprobs=3, sampling=SamplingParams(temperature=0.7, seed=9))

    def run(**kw):
        engine = Engine(model, slots=2, context=CONTEXT, chunk=CHUNK,
                        prefix_cache=PrefixCache(CHUNK, 64 << 20, SnapshotBackend.for_device(torch.device("cpu")),
                                                 model.config.indexer_compress_ratio), **kw)
        out = []
        for ids in (prompt, prompt, prompt + [7, 8, 9]):
            request = engine.submit(Request(prompt_ids=ids, **ask))
            engine.run_until_idle()
            out.append(request)
        return out

    plain = run()
    _oracle(monkeypatch, {tuple(r.prompt_ids): r.output_ids for r in plain}, random.Random(1), wrong=0.2)
    drafted = run(mtp=2, mtp_adaptive=False)
    assert drafted[1].cached_tokens > 0
    for got, want in zip(drafted, plain):
        assert got.output_ids == want.output_ids and got.output_logprobs == want.output_logprobs
        assert got.mtp_accepted > 0


def test_the_embedded_models_head_drafts_and_the_answers_do_not_change():
    """The trained head's own drafts (no oracle): greedy and seeded, 1 and 4 slots, adaptive and fixed depth, the
    answers of plain decoding; more than a third of the first drafts are taken (52% when measured), and of 3 drafts
    the second and third too."""
    model = load_model(str(EMBEDDED_MODEL), dtype="float32", device="cpu", progress=False)
    tokenizer = Tokenizer.from_path(EMBEDDED_MODEL)
    prompts = ["In the beginning God created", "And the LORD said unto Moses,", "The LORD is my shepherd;"]

    def run(slots: int, **kw):
        engine = Engine(model, slots=slots, context=256, chunk=64, **kw)
        requests = [engine.submit(Request(prompt_ids=tokenizer.encode(p), max_tokens=40, sampling=SamplingParams(
            temperature=0.8, seed=i) if i % 2 else SamplingParams())) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        return engine, requests

    for slots in (1, 4):
        _, plain = run(slots)
        for drafts, adaptive in ((1, False), (3, True), (3, False)):
            engine, drafted = run(slots, mtp=drafts, mtp_adaptive=adaptive)
            assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
            counters = engine.drafter.counters
            assert counters.accepted_at[0] * 3 > counters.verify_steps, counters
            if not adaptive and drafts == 3:
                # The chained drafts (the head on its own streams, fed its draft on the device) are taken too:
                # 16 of 30 at depth 2 and 11 at depth 3 when measured.
                assert counters.accepted_at[1] * 3 > counters.accepted_at[0] and counters.accepted_at[2], counters


def test_draft_length_follows_acceptance():
    length = DraftLength(most=3)
    assert length.choose(0.9) == 3 and length.choose(0.6) == 2 and length.choose(0.35) == 1
    assert length.choose(0.2) == 0 and DraftLength(most=3, adaptive=False).choose(0.0) == 3
    estimate = length.fresh()
    for _ in range(10):
        length.learn(estimate, drafted=2, accepted=0)
    assert length.choose(estimate.rate) == 0
    for _ in range(30):
        length.learn(estimate, drafted=2, accepted=2)
    assert length.choose(estimate.rate) == 3


def test_a_slot_that_stopped_drafting_tries_again():
    """Steps without drafts move the estimate back toward the prior: a slot whose drafts were all rejected drafts
    again after a dozen steps or more (and, rejected again, stops again), where it would otherwise never draft."""
    length, estimate = DraftLength(most=3), DraftLength(most=3).fresh()
    for _ in range(20):
        length.learn(estimate, drafted=1, accepted=0)
    waited = 0
    while length.choose(estimate.rate) == 0:
        length.learn(estimate, drafted=0, accepted=0)
        waited += 1
        assert waited < 200
    assert 10 < waited and length.choose(estimate.rate) == 1
    for _ in range(3):
        length.learn(estimate, drafted=1, accepted=0)
    assert length.choose(estimate.rate) == 0


def test_the_acceptance_estimate_reads_the_share_of_drafts_taken():
    """Drafts taken with probability 0.72 each, 3 a step (each step's tested drafts end at the first rejected):
    the estimate settles at 0.72, where an average of the tested drafts one by one settled near 0.6."""
    rng, length, seen = random.Random(0), DraftLength(most=3), []
    estimate = length.fresh()
    for _ in range(4000):
        accepted = 0
        while accepted < 3 and rng.random() < 0.72:
            accepted += 1
        length.learn(estimate, 3, accepted)
        seen.append(estimate.rate)
    assert abs(sum(seen[100:]) / len(seen[100:]) - 0.72) < 0.02


def _costs(step) -> StepCosts:
    """A cost table of step(substeps, rows) seconds, as SpeculativeRunner.measure lays it out for 4 slots."""
    busy = [1, 2, 4]
    return StepCosts(busy, {s: [step(s, b * s) for b in busy] for s in range(1, 5)})


def test_a_step_drafts_what_its_measured_costs_say_pays():
    """With the step's costs known, the drafts are those with the most expected tokens per second: all of them
    where verifying more costs nothing, none where each verified row costs as much as a plain step, and where a
    step's rows cost a little, the likely drafts of the slots that have them."""
    length = DraftLength(most=3, costs=_costs(lambda s, rows: 1.0))
    assert length.choose_step({0: (0.5, 10), 1: (0.1, 2), 2: (0.9, 0)}) == {0: 3, 1: 2, 2: 0}
    length.costs = _costs(lambda s, rows: float(rows))
    assert length.choose_step({0: (0.95, 10), 1: (0.9, 10)}) == {0: 0, 1: 0}
    # A step: 1 + 0.1 a verified row beyond a slot's first; 0.05 a position of its length (the head's passes).
    length.costs = _costs(lambda s, rows: 1.0 + 0.05 * (s - 1) + 0.1 * (rows - rows // s))
    chosen = length.choose_step({0: (0.9, 10), 1: (0.8, 10), 2: (0.1, 10), 3: (0.05, 10)})
    assert chosen[0] == 3 and chosen[1] >= 2 and chosen[2] == chosen[3] == 0, chosen
    # The rows priced between the measured slot counts: 3 busy slots' 6 rows of 2 positions, halfway from 2 to 4.
    costs = _costs(lambda s, rows: float(rows))
    assert costs.step(2, 6) == pytest.approx(6.0) and costs.step(1, 1) == 1.0
    # Not adaptive, or no costs: the acceptance rule, slot by slot, within each slot's room.
    assert DraftLength(most=3).choose_step({0: (0.9, 10), 1: (0.9, 1), 2: (0.2, 5)}) == {0: 3, 1: 1, 2: 0}
    assert DraftLength(most=3, adaptive=False, costs=costs).choose_step({0: (0.0, 10)}) == {0: 3}


def test_steps_are_priced_by_what_they_took_on_the_host_beyond_the_table():
    """The table prices the graphed steps; what the engine's steps took beyond it (on the host's clock) is added by
    step length, from nothing to twice the table's price, and prices the lengths not yet run from the nearest."""
    costs = _costs(lambda s, rows: 1.0)
    assert costs.step(3, 3) == 1.0
    costs.observe(3, 3, 1.5)
    assert costs.extra == {3: pytest.approx(0.05)} and costs.step(3, 3) == pytest.approx(1.05)
    assert costs.step(4, 4) == costs.step(2, 2) == pytest.approx(1.05)     # from 3, the nearest length run
    assert costs.step(1, 1) == 1.0                                          # but not a step without drafts
    costs.observe(1, 1, 0.2)                                                # faster than the table: nothing
    assert costs.extra[1] == 0.0 and costs.step(2, 2) == pytest.approx(1.05) and costs.measured(2, 2) == 1.0
    alone = _costs(lambda s, rows: 1.0)
    alone.observe(1, 1, 2.0)                    # with no drafting step run yet, those cost what plain steps do
    assert alone.step(3, 3) == pytest.approx(1.1)
    for _ in range(200):
        costs.observe(4, 4, 60.0)                                           # a stall counts as twice the price
    assert costs.step(4, 4) == pytest.approx(3.0)
    length = DraftLength(most=3, costs=_costs(lambda s, rows: 1.0))
    assert length.choose_step({0: (0.5, 10)}) == {0: 3}
    length.costs.weight = 1.0
    for s in (1, 2, 3, 4):
        length.costs.observe(s, s, 1.0 + (s - 1))                          # a second of host work a draft
    assert length.choose_step({0: (0.5, 10)}) == {0: 0}


def test_an_engine_stops_drafting_when_its_steps_show_drafts_cost_more_than_they_give(model, monkeypatch):
    """A table that says drafts cost nothing, but the host's clock shows a drafting step taking more than its drafts
    could give: after its first drafting step the engine drafts no more, where with steps as quick as the table says
    it drafts every step; the answer is plain decoding's either way. The drafter reads a clock that each verify step
    advances (10 ms, 200 ms more where it drafts), so the machine's own speed and load do not enter."""
    import qwen4exp.engine.speculative as speculative

    prompt = [random.Random(9).randrange(1000) for _ in range(20)]
    plain_engine = Engine(model, slots=1, context=CONTEXT, chunk=CHUNK)
    plain = plain_engine.submit(Request(prompt_ids=prompt, max_tokens=12))
    plain_engine.run_until_idle()
    clock, real, drafted = [0.0], Drafter.verify, {}
    monkeypatch.setattr(speculative, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    for host in ("quick", "slow"):
        def timed_verify(self, decoding, drafts, slow=host == "slow"):
            clock[0] += 0.01 + (0.2 if slow and any(drafts.counts.values()) else 0.0)
            return real(self, decoding, drafts)

        monkeypatch.setattr(Drafter, "verify", timed_verify)
        # 50 ms a step whatever it verifies; each step's excess counts in full (weight 1)
        costs = StepCosts([1], {s: [0.05] for s in range(1, 5)}, weight=1.0)
        engine = Engine(model, slots=1, context=CONTEXT, chunk=CHUNK, mtp=3, step_costs=costs)
        request = engine.submit(Request(prompt_ids=prompt, max_tokens=12))
        engine.run_until_idle()
        assert request.output_ids == plain.output_ids, host
        drafted[host] = engine.drafter.counters.drafted
    assert drafted["quick"] >= 20, drafted      # 3 a step, but as the request's last tokens leave room
    assert drafted["slow"] == 3, drafted


def test_drafting_by_measured_costs_keeps_the_answers_and_the_state(model, monkeypatch):
    """The runner's own measurement (busy rows through every step length, on empty slots) leaves the slots as
    they were, and an engine drafting by the table it gives, by one where drafts cost nothing, or by one that
    prices them out, gives plain decoding's answers; drafts that cost nothing are made and taken, priced out none."""
    rng = random.Random(4)
    specs = [_spec(rng) for _ in range(5)]
    starts = sorted(rng.randint(0, 12) for _ in specs)
    plain = run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK), specs, starts)
    _oracle(monkeypatch, {tuple(s["prompt_ids"]): r.output_ids for s, r in zip(specs, plain)}, rng, wrong=0.2)
    tables = {"free": _costs(lambda s, rows: 1.0), "priced out": _costs(lambda s, rows: float(rows)),
              # a row a tenth of a step: slots that draft beside slots that do not (their room or estimate)
              "between": _costs(lambda s, rows: 1.0 + 0.1 * (rows - rows // s))}
    for table in ("measured", *tables):
        if table == "measured":
            engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, mtp=3)
            before = [t.clone() for t in engine.pool.states.carried()]
            tables[table] = engine.drafter.runner.measure(repeats=1)
            assert all(torch.equal(a, b) for a, b in zip(before, engine.pool.states.carried()))
            assert tables[table].busy == [1, 2, 4] and sorted(tables[table].seconds) == [1, 2, 3, 4]
            assert all(t > 0 for times in tables[table].seconds.values() for t in times)
            engine.drafter.length.costs = tables[table]
        else:       # given, as an unparked worker's engine gets the costs its engine before measured
            engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, mtp=3, step_costs=tables[table])
        assert engine.step_costs is tables[table]
        drafted = run_staggered(engine, specs, starts)
        assert [r.output_ids for r in drafted] == [r.output_ids for r in plain], table
        counters = engine.drafter.counters
        if table == "priced out":
            assert counters.drafted == 0, counters
        elif table == "free":
            assert counters.accepted > 0, counters


def test_an_unparked_worker_drafts_by_the_step_costs_measured_before_its_park(monkeypatch):
    """A GPU engine measures its speculative steps when it starts (seconds of the full model's steps); the worker
    keeps the table over a park, and the engine it builds at the unpark prices its steps by it, unmeasured."""
    from qwen4exp.engine.speculative_runner import SpeculativeRunner
    from qwen4exp.server.messages import ParkLevel
    from qwen4exp.server.worker import Worker

    config = EngineConfig(model=str(EMBEDDED_MODEL), device="cpu", dtype="float32", slots=2, chunk=64, max_ctx=512,
                          prefix_cache=False, mtp=2)
    worker = Worker(config, conn=None)
    worker.load()
    measured = _costs(lambda s, rows: 1.0 + 0.1 * rows)       # what a GPU's runner would have measured
    worker.engine.drafter.length.costs = measured
    worker.park(ParkLevel.RELEASE)
    monkeypatch.setattr(SpeculativeRunner, "measure", lambda *a, **k: pytest.fail("the kept costs are measured again"))
    worker.load()
    assert worker.engine.step_costs is measured and worker.engine.drafter.length.costs is measured
    worker.park(ParkLevel.RELEASE)


def test_steps_without_drafts_run_the_head_once_a_pass_of_positions(model):
    """Priced out, a slot drafts nothing, and its steps leave the MTP head for later: it runs once its first
    pass's rows (most + 1) are waiting. Its cache then holds what a head run every step wrote there, and the answer
    is plain decoding's."""
    prompt = [random.Random(8).randrange(1000) for _ in range(40)]
    heads = {}
    for table in ("free", "priced out"):
        engine = Engine(model, slots=1, context=CONTEXT, chunk=CHUNK, mtp=3)
        engine.drafter.length.costs = _costs(lambda s, rows: 1.0 if table == "free" else float(rows))
        calls = []
        real = engine.drafter.runner.draft
        engine.drafter.runner.draft = lambda *a, **kw: calls.append(a[0]) or real(*a, **kw)
        request = engine.submit(Request(prompt_ids=prompt, max_tokens=70))
        engine.run_until_idle()
        # The head has seen the positions before its unseen ones, which end where the last step began.
        state, unseen = engine.pool.slots[0].state, engine.drafter._slots[0].streams
        seen = state.length - 1 - (0 if unseen is None else unseen.shape[0])
        heads[table] = (request.output_ids, seen, state.extra[0], len(calls), engine.counters.decode_steps)
    (free_ids, free_seen, free_head, _, _), (ids, seen, head, passes, steps) = heads["free"], heads["priced out"]
    assert ids == free_ids
    assert passes <= steps // 4 + 1 and seen > len(prompt) + 60, (passes, steps, seen)
    both = min(seen, free_seen)
    for name in ("keys", "values", "index_keys"):
        torch.testing.assert_close(getattr(head, name)[..., :both, :], getattr(free_head, name)[..., :both, :],
                                   rtol=1e-4, atol=1e-5, msg=f"the head's {name}")


def test_mtp_settings_are_checked_where_they_are_given(tmp_path):
    from qwen4exp.config import ConfigError, load_settings
    from qwen4exp.config.schema import MAX_DRAFTS as SCHEMA_MAX
    assert SCHEMA_MAX == MAX_DRAFTS
    profile = tmp_path / "p.toml"
    profile.write_text("mtp = 2\n")
    assert load_settings(profile).mtp == 2 and EngineConfig(mtp=2).mtp == 2
    assert load_settings(None).mtp == "auto"
    profile.write_text("mtp = 8\n")
    with pytest.raises(ConfigError, match=r"mtp.*0 to 7, got 8"):
        load_settings(profile)
    with pytest.raises(ValueError, match="mtp"):
        EngineConfig(mtp=-1)


def test_an_mtp_engine_needs_a_head_and_auto_drafts_only_where_it_pays(model):
    # On a CPU with SIMD, positions verify one by one: drafting costs more than it saves, so "auto" is off.
    assert resolve_mtp("auto", model) == 0
    assert Engine(model, slots=1, context=64, chunk=CHUNK, mtp="auto").drafter is None
    headless = random_model("tiny", dtype=torch.float32, device="cpu", seed=3)
    headless.mtp = None
    with pytest.raises(ValueError, match="no MTP head"):
        Engine(headless, slots=1, context=64, chunk=CHUNK, mtp=1)
    with pytest.raises(ValueError, match="from 0 to 7"):
        resolve_mtp(9, model)


def test_an_engine_that_drafts_warms_the_head_over_each_kind_of_prompt_chunk(monkeypatch):
    """With mtp the head takes every prompt chunk's positions into its cache (draft_chunk): the warm-up runs it over
    each kind of chunk the model's layers warm (warm_up.py), so a drafting engine's first prompt compiles nothing
    more on a GPU; without mtp it does not run."""
    from qwen4exp.engine.warm_up import warm_up_chunks

    model = load_model(str(EMBEDDED_MODEL), dtype="float32", device="cpu", progress=False)
    calls = []
    draft_chunk = type(model).draft_chunk

    def spy(self, streams, ids, state, start):
        calls.append((start, ids.numel()))
        return draft_chunk(self, streams, ids, state, start)

    monkeypatch.setattr(type(model), "draft_chunk", spy)
    Engine(model, slots=2, context=256, chunk=64).warm_up()
    assert calls == []
    Engine(model, slots=2, context=256, chunk=64, mtp=2).warm_up()
    assert calls == warm_up_chunks(model.config, 64, 256)
