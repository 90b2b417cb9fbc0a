"""Prefix snapshots on CPU: a warm run gives the cold answer bit for bit, in any slot, under a resident limit."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.prefix_cache import PrefixCache
from qwen4exp.engine.request import Request
from qwen4exp.engine.sampling import SamplingParams
from qwen4exp.engine.snapshot import Snapshot, SnapshotBackend
from logits_record import assert_same_logits, record_logits

CHUNK = 16          # restore points every 16 tokens: on both sides of the tiny model's QSA dense limit (35)
CONTEXT = 512


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)


def _cache(model, limit: int = 64 << 20) -> PrefixCache:
    return PrefixCache(CHUNK, limit, SnapshotBackend.for_device(torch.device("cpu")),
                       model.config.indexer_compress_ratio)


def _engine(model, cache=None, slots=4) -> Engine:
    return Engine(model, slots=slots, context=CONTEXT, chunk=CHUNK, prefix_cache=cache)


def _run(engine: Engine, *requests: Request) -> list[Request]:
    for r in requests:
        engine.submit(r)
    engine.run_until_idle()
    return list(requests)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=11)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("length, cached", [(150, 144), (160, 160)], ids=["off-grid", "on-grid"])
def test_resent_prompt_is_warm_and_equals_cold(model, sampling, length, cached, monkeypatch):
    """Off the restore grid the warm run restores the last restore point (144) and runs the rest; a prompt
    ending on a restore point comes back whole, with its last logits: no token runs again. Every logits row
    the warm run chooses from is the cold run's, bit for bit."""
    record_logits(monkeypatch)
    prompt = _prompt(length, seed=length)
    cold_reference, = _run(_engine(model), Request(prompt_ids=prompt, max_tokens=12, sampling=sampling))
    cache = _cache(model)
    engine = _engine(model, cache)
    cold, = _run(engine, Request(prompt_ids=prompt, max_tokens=12, sampling=sampling))
    warm, = _run(engine, Request(prompt_ids=prompt, max_tokens=12, sampling=sampling))
    assert cold.cached_tokens == 0 and warm.cached_tokens == cached
    assert_same_logits(warm, cold_reference, "warm against a cold engine")
    assert_same_logits(cold, cold_reference, "cold with a cache against a cold engine")
    assert cache.counters.restores == 1 and cache.counters.refused == 0
    one_token, = _run(engine, Request(prompt_ids=prompt, max_tokens=1, sampling=sampling))
    assert one_token.output_ids == cold.output_ids[:1] and one_token.finish_reason.value == "length"


def test_extended_prompt_restores_the_shared_prefix_and_equals_cold(model):
    """A multi-turn conversation: the next prompt extends the last one."""
    first = _prompt(70, seed=2)
    second = first + _prompt(90, seed=3)
    cache = _cache(model)
    engine = _engine(model, cache)
    _run(engine, Request(prompt_ids=first, max_tokens=4))
    warm, = _run(engine, Request(prompt_ids=second, max_tokens=10))
    cold, = _run(_engine(model), Request(prompt_ids=second, max_tokens=10))
    assert warm.cached_tokens == 64
    assert warm.output_ids == cold.output_ids


@pytest.mark.parametrize("first_length, kept, continued_from", [(48, [32, 48], 32), (80, [32, 64, 80], 64),
                                                                (112, [32, 64, 96, 112], 96)])
def test_restore_spacing_below_the_chunk_keeps_warm_equal_to_cold(model, monkeypatch, first_length, kept,
                                                                  continued_from):
    """Restore points every 16 tokens, chunks of 32: a prompt ending off the chunk grid is snapshotted at its end
    (for itself, resent whole) and at its last point on the grid; a longer prompt continues from the latter, since
    its cold run cuts no chunk at the former. Every logits row, resent and continued, is the cold run's."""
    record_logits(monkeypatch)
    rng = random.Random(first_length)
    first = [rng.randrange(1000) for _ in range(first_length)]
    longer = first + [rng.randrange(1000) for _ in range(40)]
    cache = _cache(model)
    engine = Engine(model, slots=1, context=CONTEXT, chunk=2 * CHUNK, restore_spacing=CHUNK, prefix_cache=cache)
    _run(engine, Request(prompt_ids=first, max_tokens=6))
    assert sorted(_stored_lengths(cache)) == kept
    resent, continued = (_run(engine, Request(prompt_ids=ids, max_tokens=6))[0] for ids in (first, longer))
    cold = Engine(model, slots=1, context=CONTEXT, chunk=2 * CHUNK)
    for warm, ids in ((resent, first), (continued, longer)):
        reference, = _run(cold, Request(prompt_ids=ids, max_tokens=6))
        assert_same_logits(warm, reference, f"{len(ids)} tokens after {warm.cached_tokens} restored")
    assert (resent.cached_tokens, continued.cached_tokens) == (first_length, continued_from)


def test_restore_into_another_slot_beside_other_requests(model, monkeypatch):
    record_logits(monkeypatch)
    prompt = _prompt(120, seed=4)
    cache = _cache(model)
    engine = _engine(model, cache)
    first, = _run(engine, Request(prompt_ids=prompt, max_tokens=8))
    # Slot 0 is busy with a long request: the warm one lands in another slot, next to neighbours.
    busy = engine.submit(Request(prompt_ids=_prompt(200, seed=5), max_tokens=30))
    engine.step()
    warm = Request(prompt_ids=prompt, max_tokens=8)
    neighbour = Request(prompt_ids=_prompt(40, seed=6), max_tokens=8, sampling=SAMPLINGS[1])
    _run(engine, warm, neighbour)
    assert busy.finished and warm.cached_tokens == 112
    assert first.slot == busy.slot == 0 and warm.slot != first.slot
    assert_same_logits(warm, first, "warm in another slot beside neighbours")


def test_a_slot_reused_before_its_snapshots_are_copied_keeps_them_exact(model, monkeypatch):
    """A snapshot is filled on a background thread, reading the slot's K/V in place. Hold that thread back until
    the slot's next request has its first token (a timer, started once the first request is done, lets it go if
    that request rightly waits): the next request must not overwrite the prefix first, so the first prompt resent
    comes back with its cold logits."""
    record_logits(monkeypatch)
    first = _prompt(96, seed=21)
    cold_reference, = _run(_engine(model, slots=1), Request(prompt_ids=first, max_tokens=6))
    cache = _cache(model)
    engine = _engine(model, cache, slots=1)
    held = threading.Event()
    cache._copier._thread.submit(held.wait)
    _run(engine, Request(prompt_ids=first, max_tokens=6))        # its snapshots' copies wait behind `held`
    timer = threading.Timer(2.0, held.set)
    timer.start()
    try:
        _run(engine, Request(prompt_ids=_prompt(128, seed=22), max_tokens=2, on_token=lambda *_: held.set()))
    finally:
        timer.cancel()
        held.set()          # never leave the copier's thread waiting (the interpreter joins it at exit)
    warm, = _run(engine, Request(prompt_ids=first, max_tokens=6))
    assert warm.cached_tokens == 96
    assert_same_logits(warm, cold_reference, "restored after the slot was reused")


def test_a_snapshot_the_store_refuses_is_never_copied(model, monkeypatch):
    """Under a resident limit smaller than one snapshot every capture is refused, before any buffer is made (a
    copy made anyway would take host memory past the limit), and the request is answered as without a cache."""
    cache = _cache(model, limit=1024)
    allocations = []
    real = type(cache.backend).allocate
    monkeypatch.setattr(type(cache.backend), "allocate", lambda self, n: allocations.append(n) or real(self, n))
    prompt = _prompt(70, seed=31)
    cached, = _run(_engine(model, cache), Request(prompt_ids=prompt, max_tokens=4))
    plain, = _run(_engine(model), Request(prompt_ids=prompt, max_tokens=4))
    cache.finish_captures()             # any copy queued has made its buffer by now
    assert cache.counters.captures > 0 and cache.counters.refused == cache.counters.captures
    assert allocations == [] and cached.output_ids == plain.output_ids


def _failing_allocations(cache, monkeypatch) -> list[bool]:
    """The cache's snapshot buffers fail to allocate while the returned flag's one item is true."""
    real = type(cache.backend).allocate
    failing = [True]

    def allocate(self, nbytes):
        if failing[0]:
            raise RuntimeError("no host memory (planted)")
        return real(self, nbytes)
    monkeypatch.setattr(type(cache.backend), "allocate", allocate)
    return failing


def test_a_snapshot_whose_copy_fails_is_dropped_and_its_prompt_still_served(model, monkeypatch, caplog):
    """The copier's allocations fail (host memory short, say) while a prompt's snapshots are taken: the request is
    answered as without a cache, each failure is logged once, the store gives the failed snapshots' place back, and
    the same prompt sent again is served cold and leaves snapshots that work."""
    cache = _cache(model)
    failing = _failing_allocations(cache, monkeypatch)
    engine = _engine(model, cache, slots=1)
    prompt = _prompt(70, seed=41)
    plain, = _run(_engine(model, slots=1), Request(prompt_ids=prompt, max_tokens=4))
    first, = _run(engine, Request(prompt_ids=prompt, max_tokens=4))
    cache._copier.quiesce()             # every fill queued so far has run (and failed)
    failed = cache.counters.saved
    failing[0] = False
    _run(engine, Request(prompt_ids=_prompt(40, seed=42), max_tokens=2))   # the slot's next request finds them
    assert caplog.text.count("could not be filled") == failed > 0
    assert cache.stats()["store"]["entries"] == cache.counters.saved - failed
    again, = _run(engine, Request(prompt_ids=prompt, max_tokens=4))
    third, = _run(engine, Request(prompt_ids=prompt, max_tokens=4))
    assert first.output_ids == again.output_ids == third.output_ids == plain.output_ids
    assert (first.cached_tokens, again.cached_tokens, third.cached_tokens) == (0, 0, 64)


def test_a_failed_copy_leaves_the_store_at_the_next_capture_from_any_state(model, monkeypatch):
    """No request need come back to the failed snapshot's slot: the next capture, from another state, finds the
    failure and gives its bytes back."""
    cache = _cache(model)
    failing = _failing_allocations(cache, monkeypatch)
    one, other = _filled(model, 32), _filled(model, 48)
    cache.capture(_prompt(32, seed=32), one, torch.zeros(4))
    cache._copier.quiesce()
    failing[0] = False
    cache.capture(_prompt(48, seed=48), other, torch.zeros(4))
    assert _stored_lengths(cache) == [48] and cache.stats()["store"]["entries"] == 1


def test_snapshot_restores_the_state_exactly(model):
    state = model.new_state(256)
    model(torch.tensor(_prompt(96, seed=7)), state)
    snap = Snapshot.capture(state, 4, SnapshotBackend.for_device(torch.device("cpu")))
    other = model.new_state(256)
    model(torch.tensor(_prompt(50, seed=8)), other)   # dirty it first
    snap.restore(other, 4)
    assert other.length == 96
    for a, b in zip(state.layers, other.layers):
        for name, tensor in vars(a).items():
            restored = getattr(b, name)
            if name in ("keys", "values"):
                tensor, restored = tensor[:, :96], restored[:, :96]
            elif name == "index_keys":
                tensor, restored = tensor[:96], restored[:96]
            elif name == "block_keys":
                tensor, restored = tensor[:24], restored[:24]
            assert torch.equal(tensor, restored), name
    # Snapshots are prefix-sized: much smaller than the slot's full-context state.
    assert snap.nbytes < state.nbytes() / 2


def test_resident_limit_evicts_oldest_and_counts(model):
    one = Snapshot.capture(_filled(model, 32), 4, SnapshotBackend.for_device(torch.device("cpu"))).nbytes
    cache = _cache(model, limit=3 * one)
    engine = _engine(model, cache)
    for seed in range(6):      # six 40-token prompts: captures at 16 and 32 each
        _run(engine, Request(prompt_ids=_prompt(40, seed=100 + seed), max_tokens=2))
    stats = cache.stats()
    assert stats["store"]["bytes"] <= 3 * one
    assert cache.counters.evictions > 0 and cache.counters.saved == cache.counters.captures
    # The newest prompt is still warm.
    warm, = _run(engine, Request(prompt_ids=_prompt(40, seed=105), max_tokens=2))
    assert warm.cached_tokens == 32


@pytest.mark.parametrize("length, kept", [(260, [16, 32, 64, 128, 256]), (250, [16, 32, 64, 128, 240]),
                                          (240, [16, 32, 64, 128, 240])])
def test_long_prompt_takes_log_many_snapshots(model, length, kept):
    """At 1, 2, 4, 8... chunks and the prompt's last restore point; none between (each copies the whole prefix)."""
    cache = _cache(model)
    _run(_engine(model, cache), Request(prompt_ids=_prompt(length, seed=9), max_tokens=1))
    assert sorted(_stored_lengths(cache)) == kept
    assert cache.counters.captures == len(kept)
    # The resent prompt restores the last point.
    warm, = _run(_engine(model, cache), Request(prompt_ids=_prompt(length, seed=9), max_tokens=1))
    assert warm.cached_tokens == kept[-1]


def test_the_first_token_goes_out_before_the_prompts_last_snapshot(model):
    """The last restore point's capture waits until the first token is handed out; the snapshot is the same
    (a resend restores it and answers as cold)."""
    cache = _cache(model)
    seen = []
    prompt = _prompt(48, seed=12)        # restore points 16 and 32 (1 and 2 chunks), then 48, the last
    cold, = _run(_engine(model, cache), Request(prompt_ids=prompt, max_tokens=3,
                                                on_token=lambda r, t, text: seen.append(cache.counters.captures)))
    assert seen[0] == 2 and cache.counters.captures == 3
    warm, = _run(_engine(model, cache), Request(prompt_ids=prompt, max_tokens=3))
    assert warm.cached_tokens == 48 and warm.output_ids == cold.output_ids


def test_a_last_snapshot_that_fails_costs_only_the_snapshot(model, monkeypatch):
    """The request already has its token (here it is even finished): it ends once, as it would have."""
    cache = _cache(model)
    real_capture = cache.capture

    def capture(prefix, state, logits):
        if len(prefix) == 48:
            raise RuntimeError("pinned memory exhausted (simulated)")
        return real_capture(prefix, state, logits)
    monkeypatch.setattr(cache, "capture", capture)
    finished = []
    request, = _run(_engine(model, cache), Request(prompt_ids=_prompt(48, seed=13), max_tokens=1,
                                                   on_finish=finished.append))
    assert finished == [request] and request.finish_reason.value == "length" and request.error is None
    assert sorted(_stored_lengths(cache)) == [16, 32]


def test_engine_refuses_a_cache_cut_on_another_grid(model):
    cache = _cache(model)
    _engine(model, cache)
    with pytest.raises(ValueError, match="cut at chunk 16; this engine cuts at 32"):
        Engine(model, slots=2, context=CONTEXT, chunk=32, restore_spacing=16, prefix_cache=cache)


def _filled(model, n):
    state = model.new_state(64)
    model(torch.tensor(_prompt(n, seed=n)), state)
    return state


def _stored_lengths(cache):
    return [snap.length for snap in cache._snapshots.values()]


@pytest.mark.parametrize("environment, expected", [
    ({}, "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:4"}, None),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
     "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"),
])
def test_pinned_snapshot_buffers_are_registered_in_threads_unless_the_operator_says(monkeypatch, environment,
                                                                                     expected):
    from qwen4exp.engine import snapshot

    for name in snapshot._ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.version, "hip", None)
    seen = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", seen.append, raising=False)
    snapshot.pin_in_threads()
    assert seen == ([expected] if expected else [])
