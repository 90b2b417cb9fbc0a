"""The serving engine on CPU with the tiny model: exactness under load, cancellation, refusals, errors."""

from __future__ import annotations

import random

import pytest
import torch

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.request import FinishReason, QueueFull, Request, RequestRejected
from qwen4exp.engine.sampling import SamplingParams
from qwen4exp.tokenizer import Tokenizer
from logits_record import assert_same_logits, record_logits
from staggered import run_staggered

SLOTS, CONTEXT, CHUNK = 4, 512, 32


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


def _engine(model, **kw) -> Engine:
    return Engine(model, slots=kw.pop("slots", SLOTS), context=CONTEXT, chunk=CHUNK, **kw)


def _spec(rng: random.Random):
    length = rng.choice([rng.randint(1, 40), rng.randint(60, 300)])   # both sides of the QSA dense limit
    sampled = rng.random() < 0.5
    return {
        "prompt_ids": [rng.randrange(1000) for _ in range(length)],
        "max_tokens": rng.randint(1, 20),
        "sampling": SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(10**6)) if sampled
        else SamplingParams(),
    }


def _alone(model, spec, slots: int = SLOTS) -> Request:
    engine = _engine(model, slots=slots)
    request = engine.submit(Request(**spec))
    engine.run_until_idle()
    assert request.finish_reason is FinishReason.LENGTH
    return request


@pytest.mark.parametrize("beside, batch", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["decode-after-chunks", "decode-between-layers", "prompts-batched", "batched-between"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alone_equals_together_bit_for_bit(model, seed, beside, batch, monkeypatch):
    """Requests that start at other times, with other prompt lengths, greedy and seeded sampling, queueing
    behind full slots, prefilling beside neighbours that decode (their steps between the prompt chunks, or also
    between a chunk's layers, as on a GPU), their prompt chunks alone or in one forward with other slots' (with
    `batch_prompts`): every logits row each one's tokens come from is, bit for bit, the row it gets alone."""
    record_logits(monkeypatch)
    rng = random.Random(seed)
    specs = [_spec(rng) for _ in range(7)]
    starts = sorted(rng.randint(0, 25) for _ in specs)
    engine = _engine(model, decode_beside_prompts=beside, batch_prompts=batch)
    requests = run_staggered(engine, specs, starts)
    for spec, request in zip(specs, requests):
        assert_same_logits(request, _alone(model, spec), f"request with a {len(spec['prompt_ids'])}-token prompt")


def test_sixteen_slots_alone_equals_together(model, monkeypatch):
    """The most slots a profile may ask for (engine_config.MAX_SLOTS), prompts batched and decode steps between
    their layers, as a chat profile serves: more requests than slots, more than 8 of them busy at once, each one's
    logits rows are those it gets alone in an engine of as many slots."""
    record_logits(monkeypatch)
    rng = random.Random(16)
    specs = [_spec(rng) for _ in range(20)]
    starts = sorted(rng.randint(0, 12) for _ in specs)
    engine = _engine(model, slots=16, decode_beside_prompts=True, batch_prompts=True)
    busy = []
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (busy.append(len(engine.pool.busy())), real_step())[1])
    requests = run_staggered(engine, specs, starts)
    assert max(busy) > 8
    for spec, request in zip(specs, requests):
        assert_same_logits(request, _alone(model, spec, slots=16), f"{len(spec['prompt_ids'])}-token prompt")
    with pytest.raises(ValueError, match="between 1 and 16"):
        _engine(model, slots=17)


def test_batched_prompts_share_one_forward_and_give_their_rows_alone(model, monkeypatch):
    """With `batch_prompts`, the waiting slots' prompt chunks go through one forward while their rows fit one chunk
    (here four short prompts, then the long one's chunks alone), and every logits row is the row alone."""
    record_logits(monkeypatch)
    rng = random.Random(8)
    specs = [{"prompt_ids": [rng.randrange(1000) for _ in range(n)], "max_tokens": 4} for n in (3, 5, 8, 11, 70)]
    engine = _engine(model, batch_prompts=True, slots=4)
    batches = []
    real = type(model).forward_chunks

    def spy(self, chunks, *args, **kw):
        batches.append([token_ids.numel() for token_ids, _ in chunks])
        return real(self, chunks, *args, **kw)
    monkeypatch.setattr(type(model), "forward_chunks", spy)
    requests = [engine.submit(Request(**spec)) for spec in specs]
    engine.run_until_idle()
    assert batches[0] == [3, 5, 8, 11]          # 27 rows: one chunk's 32
    assert all(sum(batch) <= CHUNK for batch in batches)
    # The counts /metrics shows: the 70-token prompt's 3 chunks each in a forward of their own or in a batch.
    counters = engine.counters
    assert counters.prompt_chunks == 4 + 3 and counters.prompt_forwards == 7 - sum(len(b) - 1 for b in batches)
    for spec, request in zip(specs, requests):
        assert_same_logits(request, _alone(model, spec), f"a {len(spec['prompt_ids'])}-token prompt")


def test_decode_steps_beside_a_batch_write_past_every_chunk(model, monkeypatch):
    """A request decoding while three short prompts prefill in one forward with decode steps between its layers:
    each step's idle rows (the three prompt slots) write their scratch past their own chunk, so all four requests
    give the logits rows they give alone."""
    record_logits(monkeypatch)
    specs = [{"prompt_ids": [(i * 37 + 11) % 1000 for i in range(5)], "max_tokens": 30}] + \
        [{"prompt_ids": [(i * 53 + n) % 1000 for i in range(n)], "max_tokens": 6} for n in (8, 10, 12)]
    engine = _engine(model, decode_beside_prompts=True, batch_prompts=True)
    launched = []
    real_launch = Engine._launch_decode

    def spy(self, idle_positions=None, host_sampling=False):
        if idle_positions and any(slot.decoding for slot in self.pool.slots):
            launched.append(dict(idle_positions))
        return real_launch(self, idle_positions, host_sampling)
    monkeypatch.setattr(Engine, "_launch_decode", spy)
    requests = [engine.submit(Request(**specs[0]))]
    engine.step()
    engine.step()
    requests += [engine.submit(Request(**spec)) for spec in specs[1:]]
    engine.run_until_idle()
    assert any(len(ends) == 3 for ends in launched), launched
    for spec, request in zip(specs, requests):
        assert_same_logits(request, _alone(model, spec), f"a {len(spec['prompt_ids'])}-token prompt")


def test_a_failing_chunk_in_a_batch_fails_only_its_request(model, monkeypatch):
    """A batch that raises runs again chunk by chunk: the chunk that fails alone fails its request, the others
    answer as they do alone."""
    engine = _engine(model, batch_prompts=True)
    specs = [{"prompt_ids": [7] * n, "max_tokens": 3} for n in (4, 6, 9)]
    requests = [engine.submit(Request(**spec)) for spec in specs]
    doomed = requests[1]
    real_forward, real_chunks = type(model).forward, type(model).forward_chunks

    batches = []

    def failing(self, chunks, *args, **kw):
        batches.append(len(chunks))
        if any(state is engine.pool.slots[doomed.slot].state for _, state in chunks):
            raise RuntimeError("a kernel fault (simulated)")
        return real_chunks(self, chunks, *args, **kw)

    def failing_alone(self, token_ids, state, *args, **kw):
        if state is engine.pool.slots[doomed.slot].state:
            raise RuntimeError("a kernel fault (simulated)")
        return real_forward(self, token_ids, state, *args, **kw)
    monkeypatch.setattr(type(model), "forward_chunks", failing)
    monkeypatch.setattr(type(model), "forward", failing_alone)
    engine.run_until_idle()
    assert batches and batches[0] == 3               # the three prompts were one batch, which failed
    assert doomed.finish_reason is FinishReason.ERROR and "simulated" in doomed.error
    for spec, request in zip(specs, requests):
        if request is not doomed:
            assert request.output_ids == _alone(model, spec).output_ids


def test_decode_steps_between_a_chunks_layers_emit_tokens_and_the_same_greedy_answers(model):
    """With decode steps between a prompt chunk's layers, requests that decode get tokens while a long prompt
    prefills (several per chunk, not one), and every greedy answer (the batch argmax path) is the one alone."""
    engine = _engine(model, decode_beside_prompts=True)
    rng = random.Random(5)
    short = [Request(prompt_ids=[rng.randrange(1000) for _ in range(8)], max_tokens=40) for _ in range(3)]
    for request in short:
        engine.submit(request)
    while any(not r.output_ids for r in short):
        engine.step()
    long = engine.submit(Request(prompt_ids=[rng.randrange(1000) for _ in range(4 * CHUNK)], max_tokens=2))
    before = sum(len(r.output_ids) for r in short)
    for _ in range(2):              # one chunk of the long prompt each, and the decode steps around it
        engine.step()
    assert long.output_ids == [] and sum(len(r.output_ids) for r in short) - before > 2 * len(short) * 2
    engine.run_until_idle()
    for request in [*short, long]:
        alone = _engine(model)
        twin = alone.submit(Request(prompt_ids=request.prompt_ids, max_tokens=request.max_tokens))
        alone.run_until_idle()
        assert request.output_ids == twin.output_ids


def test_the_warm_up_runs_each_kind_of_prompt_chunk_and_leaves_no_trace(model, monkeypatch):
    """engine.warm_up, which a GPU worker runs before serving so that no request waits on a kernel compile, runs
    one prompt chunk of each kind (one token and a whole chunk, from the start and past QSA's dense reach) on
    the first slot; that slot is empty after, and requests on the warmed engine get, bit for bit, the logits
    rows they get on one that was not warmed up. Once serving, it is refused."""
    from qwen4exp.engine.warm_up import warm_up_chunks

    record_logits(monkeypatch)
    rng = random.Random(5)
    specs = [_spec(rng) for _ in range(3)]
    engine = _engine(model)
    seen = []
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, state, **kw: (seen.append((state.length, len(ids))),
                                                                    real_forward(ids, state, **kw))[1])
    assert engine.warm_up() > 0
    monkeypatch.undo()
    dense_end = (model.config.dense_limit // CHUNK + 1) * CHUNK
    assert seen == warm_up_chunks(model.config, CHUNK, CONTEXT) == [(0, 1), (0, CHUNK), (dense_end, 1),
                                                                     (dense_end, CHUNK)]
    first = engine.pool.slots[0].state
    assert first.length == 0 and not any(layer.recurrent.any() for layer in first.layers if hasattr(layer, "recurrent"))
    record_logits(monkeypatch)
    requests = run_staggered(engine, specs, [0, 1, 3])
    for spec, request in zip(specs, requests):
        assert_same_logits(request, _alone(model, spec), f"after the warm-up, a {len(spec['prompt_ids'])}-token prompt")
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="before it serves"):
            engine.warm_up()
    finally:
        engine.stop()


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_are_those_of_the_logits_each_token_came_from(model, monkeypatch, sampled):
    """A request asking for log-probabilities gets, at each output position, the log-softmax of the raw logits
    row its token was chosen from (before temperature): its token's and the k most likely tokens', most likely
    first; asking for them changes no token, and a neighbour's request does not change them."""
    record_logits(monkeypatch)
    sampling = SamplingParams(temperature=1.3, top_k=50, seed=4) if sampled else SamplingParams()
    spec = {"prompt_ids": [11 + i % 50 for i in range(70)], "max_tokens": 9, "sampling": sampling}
    engine = _engine(model)
    engine.submit(Request(prompt_ids=[5] * 40, max_tokens=12))
    asked = engine.submit(Request(**spec, logprobs=5))
    plain = engine.submit(Request(**spec))
    engine.run_until_idle()
    assert asked.output_ids == plain.output_ids and plain.output_logprobs == []
    assert len(asked.output_logprobs) == len(asked.output_ids) == 9
    for token, row, position in zip(asked.output_ids, asked.logits, asked.output_logprobs):
        want = torch.log_softmax(row.float(), -1)
        values, ids = torch.topk(want, 5)
        assert position.token == token and position.logprob == float(want[token])
        assert [i for i, _ in position.top] == ids.tolist()
        assert [lp for _, lp in position.top] == values.tolist()
        if not sampled:
            assert position.top[0] == (token, position.logprob)
    assert sampled == any(p.top[0][0] != p.token for p in asked.output_logprobs)
    with pytest.raises(RequestRejected, match="logprobs must be between 0 and 20, got 21"):
        engine.submit(Request(prompt_ids=[1], max_tokens=1, logprobs=21))


@pytest.mark.parametrize("neighbour", [{"logprobs": 2}, {"sampling": SamplingParams(repetition_penalty=1.3)}],
                         ids=["log-probabilities", "penalised-greedy"])
def test_a_neighbour_choosing_on_the_device_gets_no_steps_between_layers(model, neighbour):
    """A decoding row whose token or log-probabilities are computed on the device's logits would make the host
    wait at every layer: with one decoding, a chunk runs its layers alone and the step after it serves all."""
    engine = _engine(model, decode_beside_prompts=True)
    spec = {"prompt_ids": [3, 4, 5], "max_tokens": 30, **neighbour}
    decoding = engine.submit(Request(**spec))
    engine.step()
    long = engine.submit(Request(prompt_ids=[7] * (3 * CHUNK), max_tokens=1))
    before = len(decoding.output_ids)
    engine.step()                    # the long prompt's first chunk, then one decode step
    assert len(decoding.output_ids) - before == 1
    engine.run_until_idle()
    twin_engine = _engine(model)
    twin = twin_engine.submit(Request(**spec))
    twin_engine.run_until_idle()
    assert decoding.output_ids == twin.output_ids and long.finish_reason is FinishReason.LENGTH


def test_admission_is_first_in_first_out(model):
    engine = _engine(model, slots=1)
    requests = [engine.submit(Request(prompt_ids=[3 + i] * 5, max_tokens=2)) for i in range(4)]
    engine.run_until_idle()
    started = [r.started_at for r in requests]
    assert started == sorted(started) and len(set(started)) == 4


def test_prompts_prefill_in_turn_one_chunk_each(model):
    """Two long prompts in two slots take one chunk per step in turn, whichever arrived first."""
    engine = _engine(model, slots=2)
    engine.submit(Request(prompt_ids=[5] * (4 * CHUNK), max_tokens=1))
    engine.submit(Request(prompt_ids=[6] * (4 * CHUNK), max_tokens=1))
    progress = []
    for _ in range(4):
        engine.step()
        progress.append(tuple(s.prefilled for s in engine.pool.slots))
    assert progress == [(CHUNK, 0), (CHUNK, CHUNK), (2 * CHUNK, CHUNK), (2 * CHUNK, 2 * CHUNK)]


def test_a_request_does_not_depend_on_its_slot(model):
    spec = _spec(random.Random(5))
    engine = _engine(model)
    fillers = [engine.submit(Request(prompt_ids=[7] * 5, max_tokens=1)) for _ in range(SLOTS - 1)]
    target = engine.submit(Request(**spec))
    engine.run_until_idle()
    assert all(f.finished for f in fillers)
    assert target.output_ids == _alone(model, spec).output_ids


def test_cancel_queued_request(model):
    engine = _engine(model, slots=1)
    running = engine.submit(Request(prompt_ids=[1] * 10, max_tokens=5))
    queued = engine.submit(Request(prompt_ids=[2] * 10, max_tokens=5))
    engine.cancel(queued.id)
    engine.step()
    assert queued.finish_reason is FinishReason.CANCELLED and queued.output_ids == []
    engine.run_until_idle()
    assert running.finish_reason is FinishReason.LENGTH


def test_cancel_during_prefill_frees_the_slot_within_one_step(model):
    engine = _engine(model, slots=1)
    long = engine.submit(Request(prompt_ids=[3] * 200, max_tokens=5))   # seven chunks of 32
    engine.step()
    assert engine.pool.slots[0].prefilled == CHUNK
    waiting = engine.submit(Request(prompt_ids=[4] * 8, max_tokens=5))
    engine.cancel(long.id)
    engine.step()
    assert long.finish_reason is FinishReason.CANCELLED and long.output_ids == []
    assert engine.pool.slots[0].request is waiting      # the freed slot went to the next request
    assert waiting.output_ids                            # ... and served it in that same step
    engine.run_until_idle()
    assert waiting.finish_reason is FinishReason.LENGTH and len(waiting.output_ids) == 5


def test_cancel_during_decode(model):
    engine = _engine(model, slots=1)
    request = engine.submit(Request(prompt_ids=[5] * 10, max_tokens=100))
    for _ in range(4):
        engine.step()
    produced = len(request.output_ids)
    assert produced >= 2
    engine.cancel(request.id)
    engine.step()
    assert request.finish_reason is FinishReason.CANCELLED
    assert len(request.output_ids) == produced and not engine.pool.slots[0].busy


def test_too_long_request_is_refused_before_taking_a_slot(model):
    engine = _engine(model)
    with pytest.raises(RequestRejected, match=r"prompt of 500 tokens \+ max_tokens 13 = 513 exceeds the context of 512"):
        engine.submit(Request(prompt_ids=[1] * 500, max_tokens=13))
    with pytest.raises(RequestRejected, match="token ids must be integers"):
        engine.submit(Request(prompt_ids=[1, 5000], max_tokens=1))
    assert engine.idle


def test_queue_bound(model):
    engine = _engine(model, queue_limit=2)
    for _ in range(2):
        engine.submit(Request(prompt_ids=[1], max_tokens=1))
    with pytest.raises(QueueFull, match="2 requests waiting"):
        engine.submit(Request(prompt_ids=[1], max_tokens=1))


@pytest.mark.parametrize("sampled", [False, True])
def test_an_engine_error_fails_that_request_only(model, monkeypatch, sampled):
    spec = _spec(random.Random(9))
    engine = _engine(model)
    sampling = SamplingParams(temperature=0.9, seed=3) if sampled else SamplingParams()
    doomed = engine.submit(Request(prompt_ids=[9] * 20, max_tokens=8, sampling=sampling))
    healthy = engine.submit(Request(**spec))
    engine.step()
    slot = next(s for s in engine.pool.slots if s.request is doomed)

    def broken(*_):
        raise RuntimeError("sampler exploded")
    # A greedy sampler takes the batch's argmax; a sampled one draws from its own row of logits.
    assert slot.sampler.takes_argmax is not sampled
    monkeypatch.setattr(slot.sampler, "_sample" if sampled else "take", broken)
    engine.run_until_idle()
    assert doomed.finish_reason is FinishReason.ERROR and "sampler exploded" in doomed.error
    assert healthy.output_ids == _alone(model, spec).output_ids


def test_penalised_greedy_rows_choose_from_their_own_logits(model):
    """Beside plain greedy rows (which share one argmax), a greedy request with a repetition penalty picks from
    its penalised logits: at the largest penalty it repeats no token, its prompt's included."""
    plain_spec = {"prompt_ids": [11] * 30, "max_tokens": 24}
    engine = _engine(model)
    plain = engine.submit(Request(**plain_spec))
    penalised = engine.submit(Request(prompt_ids=[11] * 30, max_tokens=24,
                                      sampling=SamplingParams(repetition_penalty=100.0)))
    engine.run_until_idle()
    assert plain.output_ids == _alone(model, plain_spec).output_ids
    assert len(set(penalised.output_ids)) == 24 and 11 not in penalised.output_ids
    assert len(set(plain.output_ids)) < 24, "the plain request repeats itself, so the penalty has work to do"


def test_stop_token_and_streaming(model):
    engine = _engine(model)
    free_run = engine.submit(Request(prompt_ids=[11] * 30, max_tokens=12))
    engine.run_until_idle()
    stop_at = free_run.output_ids[5]
    streamed = []
    request = engine.submit(Request(prompt_ids=[11] * 30, max_tokens=12, stop_token_ids=(stop_at,),
                                    on_token=lambda r, t, d: streamed.append(t)))
    engine.run_until_idle()
    cut = free_run.output_ids.index(stop_at) + 1
    assert request.output_ids == free_run.output_ids[:cut] == streamed
    assert request.finish_reason is FinishReason.STOP


def test_stop_string_ends_the_text_before_it(model, tokenizer):
    engine = _engine(model, tokenizer=tokenizer)
    prompt = tokenizer.encode("The river ran past the old mill and")
    free_run = engine.submit(Request(prompt_ids=prompt, max_tokens=40))
    engine.run_until_idle()
    text = free_run.text
    assert len(text) > 12
    stop = text[8:12]
    request = engine.submit(Request(prompt_ids=prompt, max_tokens=40, stop=(stop,)))
    engine.run_until_idle()
    assert request.finish_reason is FinishReason.STOP
    assert request.text == text[:text.index(stop)]


def test_background_thread_serves_and_cancels(model):
    engine = _engine(model)
    engine.start()
    try:
        import threading
        done = threading.Event()
        request = engine.submit(Request(prompt_ids=[13] * 40, max_tokens=6, on_finish=lambda r: done.set()))
        assert done.wait(30)
        assert request.finish_reason is FinishReason.LENGTH and len(request.output_ids) == 6
        cancelled = threading.Event()
        slow = engine.submit(Request(prompt_ids=[14] * 10, max_tokens=400, on_finish=lambda r: cancelled.set()))
        engine.cancel(slow.id)
        assert cancelled.wait(30) and slow.finish_reason is FinishReason.CANCELLED
    finally:
        engine.stop()
    assert not engine._thread.is_alive()


def test_out_of_memory_in_a_chunk_is_retried_once_from_the_same_state(model, monkeypatch):
    """The failed try ran decode steps of a neighbour between its layers: they stand, the retry redoes the chunk."""
    spec = _spec(random.Random(21)) | {"prompt_ids": [rng for rng in range(100, 180)]}
    neighbour_spec = {"prompt_ids": [5, 6, 7], "max_tokens": 30}
    expected = _alone(model, spec).output_ids
    engine = _engine(model, decode_beside_prompts=True)
    neighbour = engine.submit(Request(**neighbour_spec))
    engine.step()
    real_forward = type(model).forward
    calls = {"n": 0}

    def flaky(self, token_ids, state, all_logits=False, **kw):
        calls["n"] += 1
        if calls["n"] == 2:           # fail the second chunk after it has updated some state
            real_forward(self, token_ids, state, all_logits, **kw)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(self, token_ids, state, all_logits, **kw)
    monkeypatch.setattr(type(model), "forward", flaky)
    request = engine.submit(Request(**spec))
    engine.run_until_idle()
    assert request.output_ids == expected
    assert neighbour.output_ids == _alone(model, neighbour_spec).output_ids


def test_out_of_memory_twice_fails_only_that_request(model, monkeypatch):
    engine = _engine(model)
    doomed = engine.submit(Request(prompt_ids=[1] * 300, max_tokens=3))
    healthy_spec = _spec(random.Random(22))
    engine.step()
    real_forward = type(model).forward

    def oom_for_long(self, token_ids, state, all_logits=False, **kw):
        if state is engine.pool.slots[doomed.slot].state:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(self, token_ids, state, all_logits, **kw)
    monkeypatch.setattr(type(model), "forward", oom_for_long)
    healthy = engine.submit(Request(**healthy_spec))
    engine.run_until_idle()
    assert doomed.finish_reason is FinishReason.ERROR and "out of memory" in doomed.error
    assert "again after releasing cached blocks" in doomed.error
    assert healthy.output_ids == _alone(model, healthy_spec).output_ids


def test_an_empty_stop_string_is_refused_at_submit_and_the_engine_keeps_running(model, tokenizer):
    engine = _engine(model, tokenizer=tokenizer)
    with pytest.raises(RequestRejected, match="stop"):
        engine.submit(Request(prompt_ids=[1, 2, 3], max_tokens=2, stop=("",)))
    request = engine.submit(Request(prompt_ids=[1, 2, 3], max_tokens=2))
    engine.run_until_idle()
    assert request.finish_reason is FinishReason.LENGTH
