//! ChunkFit: the largest chunk of whole 256-row steps that fits, one rule per test.

use qwen4exp_core::{ChunkConfig, ChunkFit, DeviceProbe, CHUNK_ROWS};

fn drive(fit: &mut ChunkFit, need: impl Fn(usize, u64) -> u64, available: &[u64]) -> u64 {
    let names = fit.devices().to_vec();
    while let Some(rows) = fit.candidate() {
        assert_eq!(
            rows % CHUNK_ROWS,
            0,
            "every candidate is a whole chunk step"
        );
        let probes = names
            .iter()
            .enumerate()
            .map(|(i, n)| DeviceProbe::measured(n.clone(), need(i, rows), available[i]))
            .collect();
        fit.report(probes).unwrap();
    }
    fit.answer().unwrap()
}

fn one() -> ChunkFit {
    ChunkFit::new(
        ChunkConfig {
            floor_chunk: 512,
            max_chunk: 8192,
        },
        vec!["cuda:0".into()],
    )
    .unwrap()
}

#[test]
fn the_maximum_is_tried_first_and_kept_if_it_fits() {
    let mut f = one();
    assert_eq!(f.candidate(), Some(8192));
    assert_eq!(drive(&mut f, |_, r| r, &[1 << 20]), 8192);
    assert_eq!(f.probes().len(), 1);
    assert_eq!(f.binding(), None);
}

#[test]
fn bisection_finds_the_largest_whole_step_that_fits() {
    // 1000 bytes per row against 3.3 MB: 3300 rows fit, so 3072 is the answer.
    let mut f = one();
    assert_eq!(drive(&mut f, |_, r| r * 1000, &[3_300_000]), 3072);
    assert_eq!(f.binding(), Some("cuda:0"));
    assert!(f.probes().len() <= 6, "{} probes", f.probes().len());
    // The smallest miss is exactly one step above.
    let smallest_miss = f
        .probes()
        .iter()
        .filter(|p| !p.fits)
        .map(|p| p.candidate)
        .min();
    assert_eq!(smallest_miss, Some(3072 + CHUNK_ROWS));
}

#[test]
fn the_floor_chunk_is_the_answer_when_nothing_larger_fits() {
    let mut f = one();
    assert_eq!(drive(&mut f, |_, r| r * 1000, &[600_000]), 512);
}

#[test]
fn floor_equal_to_maximum_needs_no_probe() {
    let f = ChunkFit::new(
        ChunkConfig {
            floor_chunk: 1024,
            max_chunk: 1024,
        },
        vec!["d".into()],
    )
    .unwrap();
    assert_eq!(f.candidate(), None);
    assert_eq!(f.answer(), Some(1024));
}

#[test]
fn chunk_sizes_must_be_whole_steps() {
    let bad = |floor_chunk, max_chunk| {
        ChunkFit::new(
            ChunkConfig {
                floor_chunk,
                max_chunk,
            },
            vec!["d".into()],
        )
        .unwrap_err()
        .to_string()
    };
    assert!(bad(300, 8192).contains("floor chunk of 300 rows"));
    assert!(bad(256, 1000).contains("maximum chunk of 1000 rows"));
    assert!(bad(0, 256).contains("floor chunk of 0 rows"));
    assert!(bad(1024, 512).contains("above the maximum"));
}

#[test]
fn the_chunk_must_fit_on_every_device() {
    let mut f = ChunkFit::new(ChunkConfig::default(), vec!["a".into(), "b".into()]).unwrap();
    // a fits 6000 rows, b fits 2000 rows: b binds at 1792.
    assert_eq!(
        drive(&mut f, |i, r| r * if i == 0 { 1 } else { 3 }, &[6000, 6000]),
        1792
    );
    assert_eq!(f.binding(), Some("b"));
}

#[test]
fn reports_after_the_answer_are_refused() {
    let mut f = one();
    drive(&mut f, |_, _| 0, &[1]);
    assert!(f
        .report(vec![DeviceProbe::fit("cuda:0", 1)])
        .unwrap_err()
        .to_string()
        .contains("already answered"));
}
