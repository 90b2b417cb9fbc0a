//! Times PrefixStore::match_prefix on a 262144-token prompt against 10000 entries; prints JSON.
//!
//! The tree is made hard on purpose: 64 entries lie along the query's own path, and every other
//! entry shares a random-length prefix of the query before it parts, so every restore point on
//! the path branches (tens of siblings each) and a full hit hashes and compares every token.
//!
//!     cargo run --release -p qwen4exp-core --example prefix_store_bench [entries] [spacing] [iters]

use qwen4exp_core::{PrefixStore, Tier};
use std::time::Instant;

const PROMPT: usize = 262_144;

/// xorshift64*: deterministic tokens without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn token(&mut self) -> u32 {
        (self.next() % 151_936) as u32
    }
}

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Nanoseconds per call: (min, median, p99, max).
fn time(iters: usize, mut f: impl FnMut()) -> (u128, u128, u128, u128) {
    for _ in 0..iters.min(20) {
        f();
    }
    let mut ns: Vec<u128> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos()
        })
        .collect();
    ns.sort_unstable();
    (
        ns[0],
        ns[ns.len() / 2],
        ns[(ns.len() * 99 / 100).min(ns.len() - 1)],
        ns[ns.len() - 1],
    )
}

fn main() {
    let (entries, spacing, iters) = (arg(1, 10_000), arg(2, 1024), arg(3, 500));
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let prompt: Vec<u32> = (0..PROMPT).map(|_| rng.token()).collect();
    let mut store = PrefixStore::new(spacing, u64::MAX, 0).expect("spacing > 0");

    let build = Instant::now();
    let mut handle = 0u64;
    let on_path = (PROMPT / 4096).min(entries);
    for k in 1..=on_path {
        store
            .insert(&prompt[..k * 4096], handle, Tier::Host, 1 << 20, false)
            .expect("insert");
        handle += 1;
    }
    let mut tokens = Vec::with_capacity(PROMPT + 2 * spacing);
    while (handle as usize) < entries {
        // Share a random prefix of the prompt, then part with fresh tokens up to a restore point.
        let split = (rng.next() as usize) % PROMPT;
        let len = (split / spacing + 1 + (rng.next() % 2) as usize) * spacing;
        tokens.clear();
        tokens.extend_from_slice(&prompt[..split]);
        tokens.extend((split..len).map(|_| rng.token() ^ 0x8000_0000));
        store
            .insert(&tokens, handle, Tier::Host, 1 << 20, false)
            .expect("insert");
        handle += 1;
    }
    let build_s = build.elapsed().as_secs_f64();
    store.check_integrity().expect("integrity");

    let cold: Vec<u32> = (0..PROMPT).map(|_| rng.token() ^ 0x4000_0000).collect();
    let mut half = prompt.clone();
    half[PROMPT / 2 + 17] ^= 0x2000_0000;
    let full = time(iters, || {
        assert_eq!(
            store.match_prefix(&prompt, false).map(|e| e.len),
            Some(PROMPT)
        )
    });
    let mid = time(iters, || {
        assert_eq!(
            store.match_prefix(&half, false).map(|e| e.len),
            Some(PROMPT / 2)
        )
    });
    let miss = time(iters, || {
        assert!(store.match_prefix(&cold, false).is_none())
    });
    let stats = store.stats();

    let row = |name: &str, t: (u128, u128, u128, u128)| {
        format!(
            "    \"{name}\": {{\"min_us\": {:.1}, \"median_us\": {:.1}, \"p99_us\": {:.1}, \"max_us\": {:.1}}}",
            t.0 as f64 / 1e3,
            t.1 as f64 / 1e3,
            t.2 as f64 / 1e3,
            t.3 as f64 / 1e3
        )
    };
    println!("{{");
    println!("  \"prompt_tokens\": {PROMPT}, \"entries\": {}, \"tree_nodes\": {}, \"spacing\": {spacing}, \"iters\": {iters},", stats.entries, stats.nodes);
    println!("  \"build_s\": {build_s:.2},");
    println!("  \"match\": {{");
    println!("{},", row("hit_full_262144", full));
    println!("{},", row("hit_half_131072", mid));
    println!("{}", row("miss", miss));
    println!("  }}");
    println!("}}");
}
