//! Properties of the searches: the answer fits, one step more does not, every probe is on grid.

mod common;
use common::drive;
use proptest::prelude::*;
use qwen4exp_core::fit_math::{interpolate, shrink_cut};
use qwen4exp_core::{
    ChunkConfig, ContextFit, DeviceBudget, FitConfig, PlanError, Planner, CHUNK_ROWS,
};

const GIB: u64 = 1 << 30;

fn device(i: usize) -> impl Strategy<Value = DeviceBudget> {
    (
        (1..256u64, 0.0..0.5f64, 0..64u64, 0..(1u64 << 20)),
        proptest::collection::vec((0..262_144u64, 0..(4 * GIB)), 0..4),
        (any::<bool>(), 0..GIB, 0..(64u64 << 10), 1..8u64),
    )
        .prop_map(
            move |((cap, headroom, weights, bpp), ws, (snap, base, per_pos, slots))| DeviceBudget {
                headroom,
                weights: weights * GIB / 4,
                graphs: GIB / 2,
                workspace_samples: ws,
                snapshot_base: if snap { base } else { 0 },
                snapshot_per_position: if snap { per_pos } else { 0 },
                slots,
                ..DeviceBudget::new(format!("dev{i}"), cap * GIB, bpp)
            },
        )
}

fn devices() -> impl Strategy<Value = Vec<DeviceBudget>> {
    (1..4usize).prop_flat_map(|n| (0..n).map(device).collect::<Vec<_>>())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn estimate_answers_the_largest_context_that_fits(devs in devices(), floor_chunk in 1..4u64) {
        let chunk = ChunkConfig { floor_chunk: floor_chunk * CHUNK_ROWS, max_chunk: 8192 };
        let fit = FitConfig::default();
        let p = Planner::new(devs, fit, chunk).unwrap();
        let all_fit = |ctx, rows| p.evaluate(ctx, rows).iter().all(|d| d.fits());
        match p.estimate() {
            Ok(plan) => {
                prop_assert!(all_fit(plan.context, chunk.floor_chunk), "the answer fits");
                if plan.context < fit.start() {
                    let above = p.evaluate(plan.context + fit.step, chunk.floor_chunk);
                    let binding = plan.binding.clone().unwrap();
                    prop_assert!(above.iter().any(|d| d.device == binding && !d.fits()), "the binding device refuses one step more");
                } else {
                    prop_assert_eq!(plan.binding, None);
                }
                for probe in &plan.probes {
                    prop_assert!(probe.candidate % fit.step == 0 && probe.candidate >= fit.floor && probe.candidate <= fit.start());
                }
                prop_assert!(plan.probes.len() <= 2 * (fit.start() / fit.step) as usize);
                prop_assert!(all_fit(plan.context, plan.chunk), "the chunk fits");
                prop_assert!(plan.chunk == chunk.max_chunk || !all_fit(plan.context, plan.chunk + CHUNK_ROWS));
                prop_assert!(plan.devices.iter().all(|d| d.free >= 0));
            }
            Err(PlanError::BelowFloor { floor, device, .. }) => {
                let at_floor = p.evaluate(floor, chunk.floor_chunk);
                prop_assert!(at_floor.iter().any(|d| d.device == device && !d.fits()));
            }
            Err(other) => prop_assert!(false, "unexpected {other}"),
        }
    }

    /// Any need that grows with context (not only straight lines) gives the same guarantee.
    #[test]
    fn any_monotone_need_gives_fit_and_next_step_miss(
        a in 0..(40 * GIB), b in 0..(1u64 << 20), c in 0..64u64, jump_at in 0..262_144u64,
        jump in 0..(8 * GIB), budget in 1..(200 * GIB), bpp in 0..(2u64 << 20),
        steps in 1..4u64, floor_steps in 1..4u64,
    ) {
        let step = steps * 1024;
        let cfg = FitConfig { trained: 262_144, step, floor: floor_steps * step };
        let need = move |_: usize, x: u64| a + b * x + c * x * x / 1024 + if x >= jump_at { jump } else { 0 };
        let mut f = ContextFit::new(cfg, vec![("d".into(), bpp)]).unwrap();
        match drive(&mut f, need, &[budget]) {
            Ok(ctx) => {
                prop_assert!(need(0, ctx) <= budget);
                prop_assert!(ctx == cfg.start() || need(0, ctx + step) > budget);
            }
            Err(_) => prop_assert!(need(0, cfg.floor) > budget),
        }
    }

    #[test]
    fn interpolation_stays_strictly_inside_on_grid(
        lo_steps in 1..64u64, gap in 2..64u64, spare in any::<u64>(), shortfall in 1..u64::MAX,
    ) {
        let step = 4096;
        let (lo, hi) = (lo_steps * step, (lo_steps + gap) * step);
        let x = interpolate(lo, hi, spare, shortfall, step);
        prop_assert!(x > lo && x < hi && x.is_multiple_of(step));
    }

    #[test]
    fn a_shrink_is_whole_steps_and_never_more_than_the_shortfall_needs(
        shortfall in 1..u64::MAX / 2, bpp in 1..(1u64 << 24),
    ) {
        let cut = shrink_cut(shortfall, bpp, 4096);
        prop_assert!(cut.is_multiple_of(4096) && cut >= 4096);
        prop_assert!(cut == 4096 || cut <= shortfall.div_ceil(bpp));
    }
}
