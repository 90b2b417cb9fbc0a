//! The context search's arithmetic, one rule per test.

use qwen4exp_core::fit_math::{after_miss, converged, interpolate, round_down, shrink_cut};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const STEP: u64 = 4096;

#[test]
fn round_down_to_the_step() {
    assert_eq!(round_down(262_144, STEP), 262_144);
    assert_eq!(round_down(262_143, STEP), 258_048);
    assert_eq!(round_down(4095, STEP), 0);
}

#[test]
fn shrinking_262144_by_a_shortfall() {
    // 10 GiB short at 1 MiB per position: 10240 positions, rounded down to 8192.
    let cut = shrink_cut(10 * GIB, MIB, STEP);
    assert_eq!(cut, 8192);
    assert_eq!(after_miss(262_144, cut, 4096), 253_952);
    // Exactly 16 steps short cuts exactly 16 steps.
    assert_eq!(shrink_cut(16 * STEP * MIB, MIB, STEP), 16 * STEP);
    // One byte over 16 steps needs one more position, which rounds down to 16 steps again.
    assert_eq!(shrink_cut(16 * STEP * MIB + 1, MIB, STEP), 16 * STEP);
}

#[test]
fn a_miss_shrinks_at_least_one_step() {
    assert_eq!(shrink_cut(1, MIB, STEP), STEP);
    assert_eq!(shrink_cut(100 * MIB, MIB, STEP), STEP);
    // Caches that do not grow with context: still one step.
    assert_eq!(shrink_cut(5 * GIB, 0, STEP), STEP);
}

#[test]
fn a_miss_never_goes_below_the_floor() {
    assert_eq!(after_miss(16_384, 1 << 40, 4096), 4096);
    assert_eq!(after_miss(8192, 8192, 4096), 4096);
}

#[test]
fn interpolation_follows_spare_over_spare_plus_shortfall() {
    // Spare 1, shortfall 3: a quarter of the way from 65536 to 131072 is 81920.
    assert_eq!(interpolate(65_536, 131_072, GIB, 3 * GIB, STEP), 81_920);
    // Half way.
    assert_eq!(interpolate(65_536, 131_072, GIB, GIB, STEP), 98_304);
    // The point is rounded down to the step: 3/7 of 65536 is 28086.9, so 24576.
    assert_eq!(interpolate(65_536, 131_072, 3, 4, STEP), 65_536 + 24_576);
}

#[test]
fn interpolation_is_clamped_strictly_inside() {
    // No spare: the line crosses at lo itself, clamped up to lo + step.
    assert_eq!(interpolate(65_536, 131_072, 0, GIB, STEP), 65_536 + STEP);
    // A tiny shortfall: the line crosses just below hi, clamped down to hi - step.
    assert_eq!(interpolate(65_536, 131_072, GIB, 1, STEP), 131_072 - STEP);
    // Two steps apart: the only inside point.
    assert_eq!(interpolate(8192, 16_384, 7, 1, STEP), 12_288);
}

#[test]
fn the_search_stops_one_step_apart() {
    assert!(converged(126_976, 131_072, STEP));
    assert!(!converged(122_880, 131_072, STEP));
}
