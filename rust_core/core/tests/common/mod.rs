//! Shared by the planner tests: drive a context search with a need function.
#![allow(dead_code)]

use qwen4exp_core::{ContextFit, DeviceProbe, PlanError};

/// Drives `fit` to its end; `need(device, context)` gives bytes needed, `available[device]` the budget.
pub fn drive(
    fit: &mut ContextFit,
    need: impl Fn(usize, u64) -> u64,
    available: &[u64],
) -> Result<u64, PlanError> {
    let names: Vec<String> = fit.devices().to_vec();
    let mut guard = 0;
    while let Some(c) = fit.candidate() {
        guard += 1;
        assert!(guard < 1000, "the search does not end");
        let probes = names
            .iter()
            .enumerate()
            .map(|(i, n)| DeviceProbe::measured(n.clone(), need(i, c), available[i]))
            .collect();
        fit.report(probes)?;
    }
    Ok(fit.answer().expect("a finished search has an answer"))
}
