//! Unit tests that need the store's insides: children whose first-block hashes collide.

use super::radix::{Tree, COLLIDING_SEED};
use super::{PrefixStore, Tier};

/// A store whose block hash has two values, so almost every sibling waits in `overflow`.
fn colliding(spacing: usize) -> PrefixStore {
    let mut s = PrefixStore::new(spacing, u64::MAX, 0).unwrap();
    s.tree = Tree::with_seed(spacing, COLLIDING_SEED);
    s
}

/// xorshift so the test needs no dependency.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn colliding_hashes_still_match_exactly() {
    let mut s = colliding(2);
    let mut rng = 42u64;
    let mut live: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut overflowed = 0;
    for handle in 0..400u64 {
        let len = 2 * (1 + next(&mut rng) % 5) as usize;
        let tokens: Vec<u32> = (0..len).map(|_| (next(&mut rng) % 4) as u32).collect();
        if s.insert(&tokens, handle, Tier::Host, 1, false).is_ok() {
            live.push((handle, tokens));
        }
        if next(&mut rng).is_multiple_of(3) && !live.is_empty() {
            let i = (next(&mut rng) % live.len() as u64) as usize;
            let (h, _) = live.swap_remove(i);
            s.remove(h).unwrap();
        }
        s.check_integrity().unwrap();
        overflowed += (0..4096)
            .filter_map(|i| s.tree.get(i))
            .map(|n| n.overflow.len())
            .sum::<usize>();
        let query: Vec<u32> = (0..12).map(|_| (next(&mut rng) % 4) as u32).collect();
        let want = live
            .iter()
            .filter(|(_, t)| query.starts_with(t))
            .max_by_key(|(_, t)| t.len())
            .map(|(h, _)| *h);
        assert_eq!(s.match_prefix(&query, false).map(|e| e.handle), want);
    }
    assert!(s.tree.live() > 10);
    assert!(
        overflowed > 100,
        "the overflow path was exercised {overflowed} times"
    );
}
