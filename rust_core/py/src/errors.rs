//! Rust errors as Python exceptions, with the core's messages (they carry the numbers).

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use qwen4exp_core::{PlanError, StoreError};
use std::sync::{Mutex, MutexGuard};

create_exception!(
    qwen4exp._core,
    PlannerError,
    PyValueError,
    "The planner refused an input or found no context that fits; the message has the numbers."
);
create_exception!(
    qwen4exp._core,
    PrefixStoreError,
    PyValueError,
    "The prefix store refused an operation; the store is unchanged."
);
create_exception!(
    qwen4exp._core,
    PrefixStoreFull,
    PrefixStoreError,
    "An insert did not fit without evicting pinned entries (or exceeds the tier's limit); not stored."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PlannerError", py.get_type::<PlannerError>())?;
    m.add("PrefixStoreError", py.get_type::<PrefixStoreError>())?;
    m.add("PrefixStoreFull", py.get_type::<PrefixStoreFull>())?;
    Ok(())
}

pub fn plan_err(e: PlanError) -> PyErr {
    PlannerError::new_err(e.to_string())
}

pub fn store_err(e: StoreError) -> PyErr {
    match e {
        StoreError::Full { .. } | StoreError::TooLarge { .. } => {
            PrefixStoreFull::new_err(e.to_string())
        }
        _ => PrefixStoreError::new_err(e.to_string()),
    }
}

/// Locks a mutex; a mutex poisoned by an earlier panic is reported, not silently reused.
pub fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>, String> {
    m.lock()
        .map_err(|_| format!("the {what} is unusable: an earlier call panicked while holding it"))
}
