//! Random operation sequences against a plain model: the store never passes a limit, never
//! evicts a pinned entry, evicts least recently used first, and always matches the longest.

use proptest::prelude::*;
use qwen4exp_core::{PrefixStore, StoreError, Tier};
use std::collections::HashMap;

const SPACING: usize = 2;

#[derive(Debug, Clone)]
enum Op {
    Insert {
        tokens: Vec<u32>,
        handle: u64,
        device: bool,
        bytes: u64,
        replace: bool,
    },
    Match {
        tokens: Vec<u32>,
        pin: bool,
    },
    Pin(u64),
    Unpin(u64),
    Remove(u64),
    SetLimit {
        device: bool,
        limit: u64,
    },
}

/// Three token values and short runs, so prefixes are shared and edges split often.
fn tokens() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0..3u32, 0..11)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (tokens(), 0..24u64, any::<bool>(), 0..40u64, any::<bool>())
            .prop_map(|(tokens, handle, device, bytes, replace)| Op::Insert { tokens, handle, device, bytes, replace }),
        3 => (tokens(), any::<bool>()).prop_map(|(tokens, pin)| Op::Match { tokens, pin }),
        1 => (0..24u64).prop_map(Op::Pin),
        2 => (0..24u64).prop_map(Op::Unpin),
        1 => (0..24u64).prop_map(Op::Remove),
        1 => (any::<bool>(), 20..120u64).prop_map(|(device, limit)| Op::SetLimit { device, limit }),
    ]
}

#[derive(Debug, Clone)]
struct Model {
    tokens: Vec<u32>,
    tier: Tier,
    bytes: u64,
    pins: u64,
}

fn tier(device: bool) -> Tier {
    if device {
        Tier::Device
    } else {
        Tier::Host
    }
}

/// The longest model entry that is a prefix of `tokens` and at most `max` long.
fn longest(model: &HashMap<u64, Model>, tokens: &[u32], max: usize) -> Option<u64> {
    model
        .iter()
        .filter(|(_, m)| m.tokens.len() <= max && tokens.starts_with(&m.tokens))
        .max_by_key(|(_, m)| m.tokens.len())
        .map(|(h, _)| *h)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn the_store_keeps_its_promises(ops in proptest::collection::vec(op(), 1..60)) {
        let mut s = PrefixStore::new(SPACING, 80, 40).unwrap();
        let mut model: HashMap<u64, Model> = HashMap::new();
        for op in ops {
            let last_use: HashMap<u64, u64> = model.keys().map(|&h| (h, s.get(h).unwrap().last_use)).collect();
            match op {
                Op::Insert { tokens, handle, device, bytes, replace } => {
                    let t = tier(device);
                    let result = s.insert(&tokens, handle, t, bytes, replace);
                    let limit = s.limit(t);
                    let pinned: u64 = model.values().filter(|m| m.tier == t && m.pins > 0).map(|m| m.bytes).sum();
                    // The model's verdict, in the store's order of checks.
                    let want = if tokens.is_empty() || tokens.len() % SPACING != 0 {
                        Some("restore point")
                    } else if model.contains_key(&handle) {
                        Some("duplicate handle")
                    } else if model.values().any(|m| m.tokens == tokens) {
                        Some("already stored")
                    } else if bytes > limit {
                        Some("too large")
                    } else if pinned + bytes > limit {
                        Some("full")
                    } else {
                        None
                    };
                    let got = match &result {
                        Ok(_) => None,
                        Err(StoreError::NotRestorePoint { .. }) => Some("restore point"),
                        Err(StoreError::DuplicateHandle(_)) => Some("duplicate handle"),
                        Err(StoreError::AlreadyStored { .. }) => Some("already stored"),
                        Err(StoreError::TooLarge { .. }) => Some("too large"),
                        Err(StoreError::Full { .. }) => Some("full"),
                        Err(e) => return Err(TestCaseError::fail(format!("unexpected refusal {e}"))),
                    };
                    prop_assert_eq!(got, want);
                    let Ok(out) = result else { continue };
                    if let Some(r) = out.replaced {
                        prop_assert!(replace);
                        prop_assert_eq!(Some(r), longest(&model, &tokens, tokens.len() - 1));
                        prop_assert_eq!(model.remove(&r).unwrap().pins, 0);
                    }
                    for &h in &out.evicted {
                        let m = model.remove(&h).unwrap();
                        prop_assert_eq!(m.pins, 0, "evicted a pinned entry");
                        prop_assert_eq!(m.tier, t);
                    }
                    // Least recently used first: every survivor that could have gone is newer.
                    if let Some(newest_evicted) = out.evicted.iter().map(|h| last_use[h]).max() {
                        for (h, m) in &model {
                            if m.tier == t && m.pins == 0 {
                                prop_assert!(last_use[h] > newest_evicted, "kept {h} older than an evicted entry");
                            }
                        }
                    }
                    model.insert(handle, Model { tokens, tier: t, bytes, pins: 0 });
                }
                Op::Match { tokens, pin } => {
                    let got = s.match_prefix(&tokens, pin);
                    let want = longest(&model, &tokens, tokens.len());
                    // Equal lengths would mean equal tokens, which the store refuses, so the handle is unique.
                    prop_assert_eq!(got.as_ref().map(|e| e.handle), want);
                    if let (Some(e), true) = (got, pin) {
                        model.get_mut(&e.handle).unwrap().pins += 1;
                    }
                }
                Op::Pin(h) => {
                    prop_assert_eq!(s.pin(h).is_ok(), model.contains_key(&h));
                    if let Some(m) = model.get_mut(&h) { m.pins += 1; }
                }
                Op::Unpin(h) => {
                    let ok = model.get(&h).is_some_and(|m| m.pins > 0);
                    prop_assert_eq!(s.unpin(h).is_ok(), ok);
                    if ok { model.get_mut(&h).unwrap().pins -= 1; }
                }
                Op::Remove(h) => {
                    let ok = model.get(&h).is_some_and(|m| m.pins == 0);
                    prop_assert_eq!(s.remove(h).is_ok(), ok);
                    if ok { model.remove(&h); }
                }
                Op::SetLimit { device, limit } => {
                    let t = tier(device);
                    let pinned: u64 = model.values().filter(|m| m.tier == t && m.pins > 0).map(|m| m.bytes).sum();
                    match s.set_limit(t, limit) {
                        Ok(evicted) => {
                            prop_assert!(pinned <= limit);
                            for h in evicted {
                                prop_assert_eq!(model.remove(&h).unwrap().pins, 0);
                            }
                        }
                        Err(_) => prop_assert!(pinned > limit),
                    }
                }
            }
            s.check_integrity().map_err(|e| TestCaseError::fail(e.to_string()))?;
            let st = s.stats();
            prop_assert!(st.host_bytes <= s.limit(Tier::Host) && st.device_bytes <= s.limit(Tier::Device));
            prop_assert_eq!(st.entries, model.len());
            for (h, m) in &model {
                let e = s.get(*h).unwrap();
                prop_assert_eq!((e.len, e.pins, e.bytes, e.tier), (m.tokens.len(), m.pins, m.bytes, m.tier));
            }
        }
    }
}
