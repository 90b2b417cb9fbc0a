//! ContextFit as a state machine: one rule per test.

mod common;
use common::drive;
use qwen4exp_core::{ContextFit, DeviceProbe, FitConfig, PlanError};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn one(bpp: u64) -> ContextFit {
    ContextFit::new(FitConfig::default(), vec![("cuda:0".into(), bpp)]).unwrap()
}

#[test]
fn starts_at_the_trained_context_and_stops_if_it_fits() {
    let mut f = one(MIB);
    assert_eq!(f.candidate(), Some(262_144));
    assert_eq!(
        f.report(vec![DeviceProbe::fit("cuda:0", GIB)]).unwrap(),
        None
    );
    assert_eq!(f.answer(), Some(262_144));
    assert_eq!(f.binding(), None);
    assert_eq!(f.probes().len(), 1);
}

#[test]
fn trained_context_is_rounded_down_to_the_step() {
    let cfg = FitConfig {
        trained: 100_000,
        ..FitConfig::default()
    };
    let f = ContextFit::new(cfg, vec![("d".into(), 1)]).unwrap();
    assert_eq!(f.candidate(), Some(98_304));
}

#[test]
fn shrink_then_interpolate_then_stop() {
    // need = 8 GiB + 1.25 MiB per position against 100 GiB, but the search only knows the caches'
    // 1 MiB per position, so the first shrink overshoots. The crossing is at 75366 positions.
    let mut f = one(MIB);
    let need = |_: usize, c: u64| 8 * GIB + c * (MIB + MIB / 4);
    let answer = drive(&mut f, need, &[100 * GIB]).unwrap();
    assert_eq!(answer, 73_728);
    let tried: Vec<u64> = f.probes().iter().map(|p| p.candidate).collect();
    // 262144 is 228 GiB short: cut 233472 positions -> 28672, which fits with 57 GiB spare;
    // 57 / (57 + 228) of the way up is 46694 positions, rounded down to 45056 -> 73728 (2 GiB
    // spare); the next point rounds down onto 73728 and is clamped to 77824, which misses; stop.
    assert_eq!(tried, vec![262_144, 28_672, 73_728, 77_824]);
    assert_eq!(f.binding(), Some("cuda:0"));
}

#[test]
fn a_shrink_that_lands_on_the_crossing_needs_one_more_probe() {
    // need = 8 GiB + 1 MiB per position: 164 GiB short cuts exactly to the crossing 94208,
    // which fits with no spare; the interpolation clamps to 98304, which misses.
    let mut f = one(MIB);
    let answer = drive(&mut f, |_, c| 8 * GIB + c * MIB, &[100 * GIB]).unwrap();
    assert_eq!(answer, 94_208);
    let tried: Vec<u64> = f.probes().iter().map(|p| p.candidate).collect();
    assert_eq!(tried, vec![262_144, 94_208, 98_304]);
}

#[test]
fn each_probe_keeps_needed_available_and_margin() {
    let mut f = one(MIB);
    drive(&mut f, |_, c| 8 * GIB + c * MIB, &[100 * GIB]).unwrap();
    let first = &f.probes()[0];
    assert!(!first.fits);
    assert_eq!(first.devices[0].needed, Some(8 * GIB + 262_144 * MIB));
    assert_eq!(first.devices[0].available, Some(100 * GIB));
    assert_eq!(first.devices[0].shortfall(), 164 * GIB);
    assert_eq!(first.binding.as_deref(), Some("cuda:0"));
}

#[test]
fn the_floor_miss_is_an_error_that_says_what_is_missing() {
    let mut f = one(MIB);
    let err = drive(&mut f, |_, c| 50 * GIB + c * MIB, &[40 * GIB]).unwrap_err();
    let PlanError::BelowFloor {
        floor,
        ref device,
        shortfall,
        ..
    } = err
    else {
        panic!("{err:?}")
    };
    assert_eq!(
        (floor, device.as_str(), shortfall),
        (4096, "cuda:0", 14 * GIB)
    );
    let msg = err.to_string();
    assert!(
        msg.contains("context 4096") && msg.contains("'cuda:0'") && msg.contains("14.00 GiB more"),
        "{msg}"
    );
    // The search stays failed.
    assert_eq!(f.candidate(), None);
    assert_eq!(f.answer(), None);
    assert!(f.report(vec![DeviceProbe::fit("cuda:0", 1)]).is_err());
    assert_eq!(f.probes().last().unwrap().candidate, 4096);
}

#[test]
fn a_huge_miss_goes_straight_to_the_floor() {
    let mut f = one(1);
    let next = f
        .report(vec![DeviceProbe::miss("cuda:0", 1 << 50).unwrap()])
        .unwrap();
    assert_eq!(next, Some(4096));
}

#[test]
fn reports_after_the_answer_are_refused() {
    let mut f = one(MIB);
    f.report(vec![DeviceProbe::fit("cuda:0", 0)]).unwrap();
    let err = f.report(vec![DeviceProbe::fit("cuda:0", 0)]).unwrap_err();
    assert!(err.to_string().contains("already answered 262144"), "{err}");
}

#[test]
fn every_device_must_report_exactly_once() {
    let mut f =
        ContextFit::new(FitConfig::default(), vec![("a".into(), 1), ("b".into(), 1)]).unwrap();
    let e = f.report(vec![DeviceProbe::fit("a", 1)]).unwrap_err();
    assert!(e.to_string().contains("no outcome for device 'b'"), "{e}");
    let e = f
        .report(vec![DeviceProbe::fit("a", 1), DeviceProbe::fit("a", 1)])
        .unwrap_err();
    assert!(e.to_string().contains("reported twice"), "{e}");
    let e = f
        .report(vec![DeviceProbe::fit("a", 1), DeviceProbe::fit("c", 1)])
        .unwrap_err();
    assert!(e.to_string().contains("unknown device 'c'"), "{e}");
    // A refused report changes nothing.
    assert!(f.probes().is_empty());
    assert_eq!(f.candidate(), Some(262_144));
}

#[test]
fn a_zero_shortfall_is_not_a_miss() {
    assert!(DeviceProbe::miss("a", 0)
        .unwrap_err()
        .to_string()
        .contains("positive shortfall"));
    assert!(DeviceProbe::measured("a", 5, 5).fits());
    assert!(!DeviceProbe::measured("a", 6, 5).fits());
}

#[test]
fn bad_configs_are_refused_with_their_numbers() {
    let bad = |cfg: FitConfig| {
        ContextFit::new(cfg, vec![("d".into(), 1)])
            .unwrap_err()
            .to_string()
    };
    let d = FitConfig::default();
    assert!(bad(FitConfig { step: 0, ..d }).contains("step is 0"));
    assert!(bad(FitConfig { floor: 5000, ..d }).contains("floor context 5000"));
    assert!(bad(FitConfig { trained: 2048, ..d }).contains("trained context 2048"));
    assert!(ContextFit::new(d, vec![]).is_err());
    assert!(ContextFit::new(d, vec![("x".into(), 1), ("x".into(), 2)]).is_err());
}

#[test]
fn split_serving_takes_the_largest_that_fits_on_all_and_names_the_binding_device() {
    let mut f = ContextFit::new(
        FitConfig::default(),
        vec![("r9700".into(), MIB), ("strix".into(), MIB / 2)],
    )
    .unwrap();
    // r9700 holds 60 GiB of caches worth (61440 positions); strix 160 GiB at half a MiB (327680).
    let need = |i: usize, c: u64| if i == 0 { c * MIB } else { c * MIB / 2 };
    let answer = drive(&mut f, need, &[60 * GIB, 160 * GIB]).unwrap();
    assert_eq!(answer, 61_440);
    assert_eq!(f.binding(), Some("r9700"));
    // Swap the budgets: now strix binds at 40 GiB / 0.5 MiB = 81920.
    let mut f = ContextFit::new(
        FitConfig::default(),
        vec![("r9700".into(), MIB), ("strix".into(), MIB / 2)],
    )
    .unwrap();
    let answer = drive(&mut f, need, &[200 * GIB, 40 * GIB]).unwrap();
    assert_eq!(answer, 81_920);
    assert_eq!(f.binding(), Some("strix"));
}
