//! The context search's arithmetic, kept pure so each rule has its own test.

/// Rounds `value` down to a multiple of `step` (`step > 0`).
pub fn round_down(value: u64, step: u64) -> u64 {
    value - value % step
}

/// Positions to cut after a miss: the shortfall over bytes per position, rounded down to the step,
/// at least one step. A device whose caches do not grow with context (0 bytes per position)
/// cuts one step.
pub fn shrink_cut(shortfall: u64, bytes_per_position: u64, step: u64) -> u64 {
    let positions = if bytes_per_position == 0 {
        0
    } else {
        shortfall.div_ceil(bytes_per_position)
    };
    round_down(positions, step).max(step)
}

/// The candidate after a miss at `context`: `context - cut`, never below `floor`.
pub fn after_miss(context: u64, cut: u64, floor: u64) -> u64 {
    context.saturating_sub(cut).max(floor)
}

/// Between the largest fit `lo` (with `spare` bytes left) and the smallest miss `hi` (short by
/// `shortfall`), the need is taken as a straight line; it crosses the budget at
/// `lo + (hi - lo) * spare / (spare + shortfall)`. That point is rounded down to the step and
/// clamped strictly inside, `[lo + step, hi - step]`, so every probe narrows the gap.
/// Callers stop once `hi - lo <= step`; this needs `hi - lo >= 2 * step`.
pub fn interpolate(lo: u64, hi: u64, spare: u64, shortfall: u64, step: u64) -> u64 {
    let span = (hi - lo) as u128;
    let total = spare as u128 + shortfall as u128;
    let offset = (span * spare as u128).checked_div(total).unwrap_or(0) as u64;
    let inside = lo + round_down(offset, step);
    inside.clamp(lo + step, hi - step)
}

/// The search is over once the largest fit and the smallest miss are one step apart.
pub fn converged(lo: u64, hi: u64, step: u64) -> bool {
    hi <= lo + step
}
