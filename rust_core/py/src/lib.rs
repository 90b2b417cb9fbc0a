//! `qwen4exp._core`: the Python face of qwen4exp-core. Thin on purpose: conversions, the GIL
//! released around the work, errors mapped to Python exceptions; every rule lives in the core.

use pyo3::prelude::*;

mod device;
mod errors;
mod plan;
mod planner;
mod search;
mod store;
mod store_types;
mod tokens;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<device::PyDeviceBudget>()?;
    m.add_class::<planner::PyDeviceProbe>()?;
    m.add_class::<planner::PyProbe>()?;
    m.add_class::<planner::PyPlanner>()?;
    m.add_class::<search::PyContextFit>()?;
    m.add_class::<search::PyChunkFit>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_class::<plan::PyDeviceReport>()?;
    m.add_class::<store::PyPrefixStore>()?;
    m.add_class::<store_types::PyPrefixEntry>()?;
    m.add_class::<store_types::PyInsertResult>()?;
    m.add_class::<store_types::PyPrefixStoreStats>()?;
    m.add("TRAINED_CONTEXT", qwen4exp_core::TRAINED_CONTEXT)?;
    m.add("CONTEXT_STEP", qwen4exp_core::CONTEXT_STEP)?;
    m.add("FLOOR_CONTEXT", qwen4exp_core::FLOOR_CONTEXT)?;
    m.add("CHUNK_ROWS", qwen4exp_core::CHUNK_ROWS)?;
    m.add("DEFAULT_HEADROOM", qwen4exp_core::DEFAULT_HEADROOM)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
