//! The budget model, the workspace fit, the estimate and the report.

mod common;
use common::drive;
use qwen4exp_core::{ChunkConfig, DeviceBudget, FitConfig, PlanError, Planner, WorkspaceFit};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

/// 32 GiB with 4 GiB headroom, 18 GiB fixed, 64 KiB per position, workspace 256 MiB + 4 KiB/position.
fn gpu() -> DeviceBudget {
    DeviceBudget {
        headroom: 0.125,
        weights: 16 * GIB,
        graphs: GIB,
        slot_state: GIB,
        workspace_samples: vec![(0, 256 * MIB), (65_536, 512 * MIB)],
        slots: 4,
        ..DeviceBudget::new("cuda:0", 32 * GIB, 64 * KIB)
    }
}

fn planner(devices: Vec<DeviceBudget>) -> Planner {
    Planner::new(devices, FitConfig::default(), ChunkConfig::default()).unwrap()
}

#[test]
fn workspace_two_samples_give_the_exact_line() {
    let f = WorkspaceFit::from_samples(&[(0, 256 * MIB), (65_536, 512 * MIB)]);
    assert_eq!(f.at(0), 256 * MIB);
    assert_eq!(f.at(131_072), 768 * MIB);
    assert!(f.note.contains("fitted linearly in position"), "{}", f.note);
}

#[test]
fn workspace_line_is_raised_to_cover_every_sample() {
    let samples = [(4096, 100), (8192, 300), (16_384, 320), (32_768, 700)];
    let f = WorkspaceFit::from_samples(&samples);
    assert!(f.slope > 0.0);
    for (x, y) in samples {
        assert!(f.at(x) >= y, "at({x}) = {} < {y}", f.at(x));
    }
    // Touches at least one sample (it is raised no further than needed).
    assert!(samples.iter().any(|&(x, y)| f.at(x) == y));
}

#[test]
fn workspace_never_slopes_down_and_says_so() {
    let f = WorkspaceFit::from_samples(&[(4096, 900), (65_536, 500)]);
    assert_eq!(f.slope, 0.0);
    assert_eq!(f.at(262_144), 900);
    assert!(f.note.contains("fell with position"), "{}", f.note);
}

#[test]
fn workspace_from_one_position_is_a_constant_with_a_warning() {
    let f = WorkspaceFit::from_samples(&[(4096, 1000), (4096, 1200)]);
    assert_eq!(f.at(262_144), 1200);
    assert!(f.note.contains("measure at two"), "{}", f.note);
    let none = WorkspaceFit::from_samples(&[]);
    assert_eq!(none.at(262_144), 0);
    assert!(none.note.contains("no workspace measured"));
}

#[test]
fn the_budget_model_adds_every_part() {
    let mut d = gpu();
    d.snapshot_base = 100 * MIB;
    d.snapshot_per_position = 16 * KIB;
    let b = d.breakdown(65_536, 256, 256);
    assert_eq!(b.available, 28 * GIB);
    assert_eq!(b.headroom, 4 * GIB);
    assert_eq!(b.caches, GIB + 4 * GIB);
    assert_eq!(b.workspace, 512 * MIB);
    assert_eq!(b.snapshots, 4 * (100 * MIB + GIB));
    assert_eq!(
        b.needed,
        16 * GIB + GIB + 5 * GIB + 512 * MIB + 4 * (100 * MIB + GIB)
    );
    // A larger chunk scales the floor chunk's workspace by rows.
    assert_eq!(d.breakdown(65_536, 1024, 256).workspace, 4 * 512 * MIB);
}

#[test]
fn default_headroom_is_ten_percent_rounded_up() {
    let d = DeviceBudget::new("d", 1000, 1);
    assert_eq!(d.headroom_bytes(), 100);
    assert_eq!(DeviceBudget::new("d", 1001, 1).headroom_bytes(), 101);
}

#[test]
fn estimate_finds_the_hand_computed_context() {
    // 18.25 GiB + 68 KiB per position <= 28 GiB: 150347 positions, so 147456.
    let p = planner(vec![gpu()]);
    let plan = p.estimate().unwrap();
    assert_eq!(plan.context, 147_456);
    assert_eq!(plan.binding.as_deref(), Some("cuda:0"));
    // 1 GiB left for the chunk; the floor chunk at 147456 takes 832 MiB, so 256 rows.
    assert_eq!(plan.chunk, 256);
    let d = &plan.devices[0];
    assert_eq!(
        (d.capacity, d.headroom, d.weights, d.graphs),
        (32 * GIB, 4 * GIB, 16 * GIB, GIB)
    );
    assert_eq!(d.caches, GIB + 147_456 * 64 * KIB);
    assert_eq!(d.free, (GIB - 832 * MIB) as i64);
    let next = p.evaluate(plan.context + 4096, 256);
    assert!(!next[0].fits());
    assert!(plan.notes.iter().any(|n| n.contains("fitted linearly")));
    assert!(plan.notes[0].starts_with("estimate"));
}

#[test]
fn the_table_shows_budget_and_probes() {
    let t = planner(vec![gpu()]).estimate().unwrap().table();
    for want in [
        "context 147456 (binding: cuda:0)",
        "chunk workspace",
        "probes, context search",
        "spare",
        "short",
        "notes:",
    ] {
        assert!(t.contains(want), "missing {want:?} in\n{t}");
    }
}

#[test]
fn a_larger_chunk_takes_what_is_left() {
    let mut d = gpu();
    d.capacity = 40 * GIB;
    d.headroom = 0.1;
    let p = planner(vec![d]);
    let plan = p.estimate().unwrap();
    assert!(plan.chunk >= 256 && plan.chunk.is_multiple_of(256));
    let fits = |rows| p.evaluate(plan.context, rows).iter().all(|x| x.fits());
    assert!(fits(plan.chunk));
    assert!(plan.chunk == 8192 || !fits(plan.chunk + 256));
}

#[test]
fn snapshots_on_the_device_are_reserved_and_noted() {
    let with = DeviceBudget {
        snapshot_base: 100 * MIB,
        snapshot_per_position: 8 * KIB,
        ..gpu()
    };
    let without = planner(vec![gpu()]).estimate().unwrap();
    let plan = planner(vec![with]).estimate().unwrap();
    assert!(plan.context < without.context);
    assert!(plan.devices[0].snapshots_on_device);
    assert_eq!(
        plan.devices[0].snapshots,
        4 * (100 * MIB + 8 * KIB * plan.context)
    );
    assert!(plan
        .notes
        .iter()
        .any(|n| n.contains("floor chunk is reserved before them")));
}

#[test]
fn the_floor_miss_lists_what_the_device_needs() {
    let d = DeviceBudget {
        weights: 40 * GIB,
        ..gpu()
    };
    let err = planner(vec![d]).estimate().unwrap_err();
    assert!(matches!(err, PlanError::BelowFloor { floor: 4096, .. }));
    let msg = err.to_string();
    for want in [
        "context 4096 is the floor",
        "'cuda:0' needs",
        "weights 40.00 GiB",
        "available 28.00 GiB of 32.00 GiB",
    ] {
        assert!(msg.contains(want), "missing {want:?} in {msg}");
    }
}

#[test]
fn the_trained_context_fitting_binds_no_device() {
    let d = DeviceBudget::new("big", 1 << 50, 1);
    let plan = planner(vec![d]).estimate().unwrap();
    assert_eq!((plan.context, plan.binding.clone()), (262_144, None));
    assert_eq!(plan.probes.len(), 1);
    assert!(plan.notes.iter().any(|n| n.contains("no device binds")));
}

#[test]
fn split_serving_names_the_binding_device() {
    let small = DeviceBudget::new("r9700", 32 * GIB, 256 * KIB);
    let large = DeviceBudget::new("strix", 96 * GIB, 128 * KIB);
    let plan = planner(vec![small, large]).estimate().unwrap();
    // r9700: 28.8 GiB / 256 KiB = 117964 -> 114688; strix would allow far more.
    assert_eq!(plan.context, 114_688);
    assert_eq!(plan.binding.as_deref(), Some("r9700"));
}

#[test]
fn device_inputs_are_validated() {
    let bad = |d: DeviceBudget| {
        Planner::new(vec![d], FitConfig::default(), ChunkConfig::default())
            .unwrap_err()
            .to_string()
    };
    assert!(bad(DeviceBudget {
        headroom: 1.0,
        ..gpu()
    })
    .contains("headroom 1 is not a fraction"));
    assert!(bad(DeviceBudget {
        headroom: f64::NAN,
        ..gpu()
    })
    .contains("headroom NaN"));
    assert!(bad(DeviceBudget {
        capacity: 0,
        ..gpu()
    })
    .contains("capacity is 0"));
    assert!(bad(DeviceBudget { slots: 0, ..gpu() }).contains("slots is 0"));
    assert!(bad(DeviceBudget {
        name: String::new(),
        ..gpu()
    })
    .contains("needs a name"));
    let dup = Planner::new(
        vec![gpu(), gpu()],
        FitConfig::default(),
        ChunkConfig::default(),
    )
    .unwrap_err();
    assert!(dup.to_string().contains("listed twice"));
    assert!(Planner::new(vec![], FitConfig::default(), ChunkConfig::default()).is_err());
}

#[test]
fn report_after_a_real_search_keeps_the_measured_probes() {
    let p = planner(vec![gpu()]);
    let mut cf = p.context_fit().unwrap();
    // The engine measures 1 GiB more than the model everywhere.
    let model = |c: u64| p.evaluate(c, 256)[0].needed.unwrap();
    let ctx = drive(&mut cf, |_, c| model(c) + GIB, &[28 * GIB]).unwrap();
    assert!(ctx < 147_456);
    let mut ch = p.chunk_fit().unwrap();
    assert!(
        p.report(&cf, &ch).is_err(),
        "the chunk search has not answered"
    );
    while ch.candidate().is_some() {
        ch.report(p.evaluate(ctx, ch.candidate().unwrap())).unwrap();
    }
    let plan = p.report(&cf, &ch).unwrap();
    assert_eq!(plan.context, ctx);
    assert_eq!(plan.probes, cf.probes());
    assert_eq!(plan.probes[0].devices[0].needed, Some(model(262_144) + GIB));
}

#[test]
fn a_measured_floor_miss_keeps_the_measurement_and_adds_the_model() {
    let p = planner(vec![gpu()]);
    let mut cf = p.context_fit().unwrap();
    drive(&mut cf, |_, _| 30 * GIB, &[28 * GIB]).unwrap_err();
    let ch = p.chunk_fit().unwrap();
    let msg = p.report(&cf, &ch).unwrap_err().to_string();
    assert!(
        msg.contains("(needed 30.00 GiB, available 28.00 GiB)"),
        "{msg}"
    );
    assert!(msg.contains("the budget model at the floor"), "{msg}");
}
