//! PrefixStore: one rule per test.

use qwen4exp_core::{PrefixStore, StoreError, Tier};

const H: Tier = Tier::Host;
const D: Tier = Tier::Device;

fn toks(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

fn store(limit: u64) -> PrefixStore {
    PrefixStore::new(4, limit, limit).unwrap()
}

#[test]
fn match_gives_the_longest_entry_that_is_a_prefix() {
    let mut s = store(1000);
    let t = toks(16, 0);
    s.insert(&t[..4], 1, H, 10, false).unwrap();
    s.insert(&t[..12], 2, H, 10, false).unwrap();
    s.insert(&t[..16], 3, H, 10, false).unwrap();
    assert_eq!(
        s.match_prefix(&t, false).map(|e| (e.handle, e.len)),
        Some((3, 16))
    );
    assert_eq!(s.match_prefix(&t[..15], false).map(|e| e.handle), Some(2));
    assert_eq!(s.match_prefix(&t[..11], false).map(|e| e.handle), Some(1));
    // A prompt that parts inside an edge matches only the entries before the parting.
    let mut other = t.clone();
    other[9] ^= 1;
    assert_eq!(s.match_prefix(&other, false).map(|e| e.handle), Some(1));
    assert_eq!(s.match_prefix(&toks(16, 7), false), None);
    assert_eq!(s.match_prefix(&[], false), None);
    let st = s.stats();
    assert_eq!((st.hits, st.misses), (4, 2));
    s.check_integrity().unwrap();
}

#[test]
fn entries_live_only_at_restore_points() {
    let mut s = store(1000);
    let e = s.insert(&toks(6, 0), 1, H, 1, false).unwrap_err();
    assert_eq!(e, StoreError::NotRestorePoint { len: 6, spacing: 4 });
    let msg = e.to_string();
    assert!(
        msg.contains("6 tokens") && msg.contains("restore spacing 4"),
        "{msg}"
    );
    assert!(s.insert(&[], 1, H, 1, false).is_err());
    assert!(s.is_empty());
    assert!(PrefixStore::new(0, 1, 1).is_err());
}

#[test]
fn handles_and_token_runs_are_unique() {
    let mut s = store(1000);
    s.insert(&toks(8, 0), 1, H, 1, false).unwrap();
    assert_eq!(
        s.insert(&toks(8, 1), 1, H, 1, false),
        Err(StoreError::DuplicateHandle(1))
    );
    assert_eq!(
        s.insert(&toks(8, 0), 2, H, 1, false),
        Err(StoreError::AlreadyStored { len: 8, handle: 1 })
    );
}

#[test]
fn eviction_is_least_recently_used_and_returns_the_handles() {
    let mut s = store(30);
    for h in 0..3 {
        s.insert(&toks(4, h as u32), h, H, 10, false).unwrap();
    }
    // Using 0 makes 1 the oldest.
    s.match_prefix(&toks(4, 0), false).unwrap();
    let out = s.insert(&toks(4, 9), 9, H, 15, false).unwrap();
    assert_eq!(out.evicted, vec![1, 2]);
    assert_eq!(out.replaced, None);
    assert_eq!(s.stats().evictions, 2);
    assert_eq!(s.stats().host_bytes, 25);
    assert!(s.get(1).is_none() && s.get(0).is_some());
    s.check_integrity().unwrap();
}

#[test]
fn a_pinned_entry_is_never_evicted() {
    let mut s = store(30);
    s.insert(&toks(4, 0), 0, H, 10, false).unwrap();
    s.insert(&toks(4, 1), 1, H, 10, false).unwrap();
    s.pin(0).unwrap();
    let out = s.insert(&toks(4, 2), 2, H, 20, false).unwrap();
    assert_eq!(out.evicted, vec![1]);
    assert_eq!(s.get(0).unwrap().pins, 1);
}

#[test]
fn an_insert_that_fits_only_by_evicting_pinned_entries_is_refused_and_changes_nothing() {
    let mut s = store(30);
    s.insert(&toks(4, 0), 0, H, 10, false).unwrap();
    s.insert(&toks(4, 1), 1, H, 10, false).unwrap();
    s.match_prefix(&toks(4, 0), true).unwrap();
    let before = s.stats();
    let e = s.insert(&toks(4, 2), 2, H, 25, false).unwrap_err();
    assert!(matches!(
        e,
        StoreError::Full {
            used: 20,
            pinned: 10,
            limit: 30,
            bytes: 25,
            ..
        }
    ));
    assert!(e.to_string().contains("not stored"), "{e}");
    assert_eq!(s.stats(), before);
    assert!(s.get(1).is_some());
    let e = s.insert(&toks(4, 2), 2, H, 31, false).unwrap_err();
    assert!(matches!(
        e,
        StoreError::TooLarge {
            limit: 30,
            bytes: 31,
            ..
        }
    ));
}

#[test]
fn pins_are_counted() {
    let mut s = store(100);
    s.insert(&toks(4, 0), 0, H, 10, false).unwrap();
    s.pin(0).unwrap();
    s.match_prefix(&toks(8, 0)[..4], true).unwrap();
    assert_eq!(s.get(0).unwrap().pins, 2);
    assert!(matches!(
        s.remove(0),
        Err(StoreError::Pinned { handle: 0, pins: 2 })
    ));
    s.unpin(0).unwrap();
    s.unpin(0).unwrap();
    assert_eq!(s.unpin(0), Err(StoreError::NotPinned(0)));
    assert_eq!(s.pin(5), Err(StoreError::UnknownHandle(5)));
    assert_eq!(s.remove(0).unwrap().handle, 0);
    assert_eq!(s.stats().nodes, 1, "the tree shrinks back to its root");
    s.check_integrity().unwrap();
}

#[test]
fn replacing_a_strict_ancestor() {
    let mut s = store(100);
    let t = toks(12, 0);
    s.insert(&t[..4], 1, H, 10, false).unwrap();
    s.insert(&t[..8], 2, H, 10, false).unwrap();
    let out = s.insert(&t, 3, H, 10, true).unwrap();
    assert_eq!(out.replaced, Some(2), "the nearest ancestor is replaced");
    assert!(s.get(1).is_some() && s.get(2).is_none());
    // A pinned ancestor stays.
    s.pin(3).unwrap();
    let mut longer = t.clone();
    longer.extend(toks(4, 5));
    assert_eq!(s.insert(&longer, 4, H, 10, true).unwrap().replaced, None);
    assert!(s.get(3).is_some());
    // Without asking, nothing is replaced.
    let mut longest = longer.clone();
    longest.extend(toks(4, 6));
    assert_eq!(s.insert(&longest, 5, H, 10, false).unwrap().replaced, None);
    s.check_integrity().unwrap();
}

#[test]
fn each_tier_has_its_own_limit() {
    let mut s = PrefixStore::new(4, 100, 10).unwrap();
    s.insert(&toks(4, 0), 0, H, 90, false).unwrap();
    s.insert(&toks(4, 1), 1, D, 10, false).unwrap();
    let out = s.insert(&toks(4, 2), 2, D, 5, false).unwrap();
    assert_eq!(out.evicted, vec![1], "only the device tier makes room");
    let st = s.stats();
    assert_eq!((st.host_bytes, st.device_bytes, st.bytes), (90, 5, 95));
}

#[test]
fn lowering_a_limit_evicts_or_is_refused() {
    let mut s = store(100);
    s.insert(&toks(4, 0), 0, H, 40, false).unwrap();
    s.insert(&toks(4, 1), 1, H, 40, false).unwrap();
    s.pin(1).unwrap();
    assert!(s.set_limit(H, 30).is_err());
    assert_eq!(s.limit(H), 100);
    assert_eq!(s.set_limit(H, 50).unwrap(), vec![0]);
    assert_eq!(s.limit(H), 50);
    s.check_integrity().unwrap();
}

#[test]
fn the_tree_branches_and_merges_back() {
    let mut s = store(1000);
    let t = toks(16, 0);
    let mut u = t.clone();
    u[5] ^= 1;
    s.insert(&t, 1, H, 1, false).unwrap();
    s.insert(&u, 2, H, 1, false).unwrap();
    assert_eq!(
        s.stats().nodes,
        4,
        "root, the branch at 4 (the restore point before they part), two leaves"
    );
    s.insert(&t[..8], 3, H, 1, false).unwrap();
    assert_eq!(s.stats().nodes, 5);
    s.check_integrity().unwrap();
    s.remove(2).unwrap();
    assert_eq!(s.stats().nodes, 3, "the branch merges away");
    s.check_integrity().unwrap();
    assert_eq!(s.match_prefix(&u, false).map(|e| e.handle), None);
    assert_eq!(s.match_prefix(&t, false).map(|e| e.handle), Some(1));
}
