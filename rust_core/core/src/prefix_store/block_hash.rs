//! A fast seeded hash of one block of tokens, to key a node's children.
//!
//! Only a key: every hit is verified token by token, so a collision costs time, never a wrong
//! match. Four independent lanes keep the multiplier busy; the seed is random per store.

const K: u64 = 0x9E37_79B9_7F4A_7C15;
const LANES: [u64; 4] = [
    0x243F_6A88_85A3_08D3,
    0x1319_8A2E_0370_7344,
    0xA409_3822_299F_31D0,
    0x082E_FA98_EC4E_6C89,
];

#[inline]
fn mix(h: u64, w: u64) -> u64 {
    (h ^ w).wrapping_mul(K).rotate_left(29)
}

/// The final avalanche of MurmurHash3, so every input bit reaches every output bit.
#[inline]
fn finish(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}

pub(crate) fn hash_block(seed: u64, block: &[u32]) -> u64 {
    let mut h = LANES.map(|l| l ^ seed);
    let mut chunks = block.chunks_exact(8);
    for c in &mut chunks {
        for (lane, pair) in h.iter_mut().zip(c.chunks_exact(2)) {
            *lane = mix(*lane, pair[0] as u64 | (pair[1] as u64) << 32);
        }
    }
    for (i, &t) in chunks.remainder().iter().enumerate() {
        h[i % 4] = mix(h[i % 4], t as u64 | 1 << 40);
    }
    let folded = h.iter().fold(block.len() as u64, |acc, &x| mix(acc, x));
    finish(folded)
}

/// A per-store seed from the standard library's random hasher keys.
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x5EED);
    h.finish()
}
