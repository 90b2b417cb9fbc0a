"""The prefix store through the Python API: the rules, the errors, token inputs and threads."""

from __future__ import annotations

import random
import threading
from array import array

import pytest

from qwen4exp._core import PrefixStore, PrefixStoreError, PrefixStoreFull


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(151936) for _ in range(n)]


def test_match_gives_the_longest_stored_prefix() -> None:
    s = PrefixStore(4, host_limit=1000)
    t = toks(16)
    s.insert(t[:4], handle=1, bytes=10)
    s.insert(t[:12], handle=2, bytes=10)
    hit = s.match(t)
    assert hit is not None and (hit.handle, hit.length, hit.tier, hit.bytes, hit.pins) == (2, 12, "host", 10, 0)
    assert s.match(t[:11]).handle == 1  # type: ignore[union-attr]
    assert s.match(toks(16, seed=1)) is None
    st = s.stats()
    assert (st.hits, st.misses, st.entries, st.bytes, st.host_bytes) == (2, 1, 2, 20, 20)
    assert st.to_dict()["hits"] == 2
    assert len(s) == 2 and 1 in s and 3 not in s
    assert s.check_integrity() is None


def test_tokens_from_lists_tuples_and_buffers() -> None:
    np = pytest.importorskip("numpy")
    s = PrefixStore(8, host_limit=100)
    t = toks(64)
    s.insert(array("I", t[:32]), handle=1, bytes=1)
    for form in (t, tuple(t), array("I", t), np.array(t, dtype=np.uint32), np.array(t, dtype=np.int64), np.array(t, dtype=np.int32)):
        assert s.match(form).handle == 1  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="not text"):
        s.match("hello")
    with pytest.raises(ValueError, match="token 1 is -5"):
        s.match(np.array([1, -5], dtype=np.int64))
    with pytest.raises(TypeError, match="sequence of ints"):
        s.match([1, -5])
    with pytest.raises(TypeError):
        s.match([1.5])


def test_entries_only_at_restore_points() -> None:
    s = PrefixStore(4, host_limit=100)
    with pytest.raises(PrefixStoreError, match="6 tokens.*restore spacing 4"):
        s.insert(toks(6), handle=1, bytes=1)
    with pytest.raises(PrefixStoreError, match="0 tokens"):
        s.insert([], handle=1, bytes=1)
    with pytest.raises(PrefixStoreError, match="at least 1 token"):
        PrefixStore(0, host_limit=1)
    assert len(s) == 0


def test_duplicates_are_refused() -> None:
    s = PrefixStore(4, host_limit=100)
    s.insert(toks(8), handle=1, bytes=1)
    with pytest.raises(PrefixStoreError, match="handle 1 is already"):
        s.insert(toks(8, seed=2), handle=1, bytes=1)
    with pytest.raises(PrefixStoreError, match="already have an entry"):
        s.insert(toks(8), handle=2, bytes=1)


def test_lru_eviction_returns_the_handles_to_free() -> None:
    s = PrefixStore(4, host_limit=30)
    for h in range(3):
        s.insert(toks(4, seed=h), handle=h, bytes=10)
    s.match(toks(4, seed=0))  # 1 becomes the oldest
    out = s.insert(toks(4, seed=9), handle=9, bytes=15)
    assert out.evicted == [1, 2] and out.replaced is None and out.freed == [1, 2]
    assert s.stats().evictions == 2 and s.stats().bytes == 25


def test_pinned_entries_are_never_evicted_and_a_full_insert_changes_nothing() -> None:
    s = PrefixStore(4, host_limit=30)
    s.insert(toks(4, seed=0), handle=0, bytes=10)
    s.insert(toks(4, seed=1), handle=1, bytes=10)
    assert s.match(toks(4, seed=0), pin=True).pins == 1  # type: ignore[union-attr]
    before = s.stats().to_dict()
    with pytest.raises(PrefixStoreFull, match="pinned") as info:
        s.insert(toks(4, seed=2), handle=2, bytes=25)
    assert isinstance(info.value, PrefixStoreError) and isinstance(info.value, ValueError)
    assert "not stored" in str(info.value)
    assert s.stats().to_dict() == before
    with pytest.raises(PrefixStoreFull, match="limit is 30"):
        s.insert(toks(4, seed=2), handle=2, bytes=31)
    out = s.insert(toks(4, seed=2), handle=2, bytes=20)
    assert out.evicted == [1]
    assert s.get(0).pins == 1  # type: ignore[union-attr]


def test_pin_unpin_remove() -> None:
    s = PrefixStore(4, host_limit=100)
    s.insert(toks(4), handle=7, bytes=1)
    assert s.pin(7).pins == 1
    with pytest.raises(PrefixStoreError, match="pinned"):
        s.remove(7)
    assert s.unpin(7).pins == 0
    with pytest.raises(PrefixStoreError, match="not pinned"):
        s.unpin(7)
    with pytest.raises(PrefixStoreError, match="no entry has handle 8"):
        s.pin(8)
    assert s.remove(7).handle == 7 and s.get(7) is None
    assert s.stats().nodes == 1


def test_replace_a_strict_ancestor_when_asked() -> None:
    s = PrefixStore(4, host_limit=100)
    t = toks(12)
    s.insert(t[:4], handle=1, bytes=10)
    s.insert(t[:8], handle=2, bytes=10)
    out = s.insert(t, handle=3, bytes=10, replace_ancestor=True)
    assert out.replaced == 2 and out.freed == [2]
    assert s.get(1) is not None and s.get(2) is None
    assert s.insert(t + toks(4, 5), handle=4, bytes=1).replaced is None


def test_tiers_have_their_own_limits() -> None:
    s = PrefixStore(4, host_limit=100, device_limit=10)
    s.insert(toks(4, 0), handle=0, bytes=90)
    s.insert(toks(4, 1), handle=1, bytes=10, tier="device")
    assert s.insert(toks(4, 2), handle=2, bytes=5, tier="device").evicted == [1]
    st = s.stats()
    assert (st.host_bytes, st.device_bytes) == (90, 5)
    assert s.get(2).tier == "device"  # type: ignore[union-attr]
    with pytest.raises(PrefixStoreError, match="'device' or 'host'"):
        s.insert(toks(4, 3), handle=3, bytes=1, tier="gpu")  # type: ignore[arg-type]


def test_set_limit() -> None:
    s = PrefixStore(4, host_limit=100)
    s.insert(toks(4, 0), handle=0, bytes=40)
    s.insert(toks(4, 1), handle=1, bytes=40)
    s.pin(1)
    with pytest.raises(PrefixStoreFull):
        s.set_limit("host", 30)
    assert s.host_limit == 100
    assert s.set_limit("host", 50) == [0]
    assert s.host_limit == 50 and s.device_limit == 0


def test_random_operations_match_a_plain_model() -> None:
    rng = random.Random(3)
    s = PrefixStore(2, host_limit=60)
    model: dict[int, tuple[tuple[int, ...], int]] = {}  # handle -> (tokens, pins)
    fresh = stored = 0
    for step in range(600):
        t = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 6) * 2))
        op = rng.random()
        if op < 0.4:
            duplicate = any(m == t for m, _ in model.values())
            fresh += not duplicate
            try:
                out = s.insert(list(t), handle=step, bytes=rng.randrange(1, 20))
            except PrefixStoreFull:
                assert not duplicate
                continue
            except PrefixStoreError as err:          # the only other refusal: these tokens are stored already
                assert duplicate and "already have an entry" in str(err), err
                continue
            assert not duplicate, "stored the same tokens twice"
            for h in out.evicted:
                assert model.pop(h)[1] == 0, "evicted a pinned entry"
            model[step] = (t, 0)
            stored += 1
        elif op < 0.8:
            hit = s.match(list(t) + [9], pin=rng.random() < 0.2)
            want = max((k for k, (m, _) in model.items() if t[: len(m)] == m), key=lambda k: len(model[k][0]), default=None)
            assert (hit.handle if hit else None) == want
            if hit and hit.pins > model[hit.handle][1]:
                model[hit.handle] = (model[hit.handle][0], hit.pins)
        elif model:
            h = rng.choice(sorted(model))
            if model[h][1]:
                s.unpin(h)
                model[h] = (model[h][0], model[h][1] - 1)
        assert s.stats().host_bytes <= 60
        assert len(s) == len(model)
    s.check_integrity()
    # Full only while pinned entries hold the room: most inserts of new tokens are stored.
    assert stored > fresh / 2, (stored, fresh)


def test_many_threads_share_one_store() -> None:
    s = PrefixStore(4, host_limit=200)
    base = toks(64)
    errors: list[BaseException] = []
    matches = [0]
    count_lock = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(w)
        try:
            for i in range(200):
                n = rng.randrange(1, 16) * 4
                # Some inserts are prefixes of `base` (so matches hit), most part from it.
                t = base[:n] if i % 4 == 0 else base[: n - 4] + toks(4, seed=w * 1000 + i)
                try:
                    s.insert(t, handle=w * 100000 + i, bytes=rng.randrange(1, 10))
                except PrefixStoreError as e:  # full, or another thread stored these tokens first
                    assert isinstance(e, PrefixStoreFull) or "already have an entry" in str(e)
                if (hit := s.match(base + [w], pin=True)) is not None:
                    s.unpin(hit.handle)
                with count_lock:
                    matches[0] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s.check_integrity()
    st = s.stats()
    assert st.hits + st.misses == matches[0] == 1600
    assert st.bytes <= 200 and st.pinned_entries == 0
    assert st.hits > 0
