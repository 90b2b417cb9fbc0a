//! PrefixEntry, InsertResult and PrefixStoreStats for Python: plain read-only values.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use qwen4exp_core::{EntryInfo, InsertOutcome, StoreStats};

/// A copy of one stored entry's state.
#[pyclass(frozen, module = "qwen4exp._core", name = "PrefixEntry")]
pub struct PyPrefixEntry(pub EntryInfo);

#[pymethods]
impl PyPrefixEntry {
    #[getter]
    fn handle(&self) -> u64 {
        self.0.handle
    }
    #[getter]
    fn length(&self) -> usize {
        self.0.len
    }
    #[getter]
    fn tier(&self) -> &'static str {
        self.0.tier.name()
    }
    #[getter]
    fn bytes(&self) -> u64 {
        self.0.bytes
    }
    #[getter]
    fn last_use(&self) -> u64 {
        self.0.last_use
    }
    #[getter]
    fn pins(&self) -> u64 {
        self.0.pins
    }

    fn __repr__(&self) -> String {
        let e = &self.0;
        format!(
            "PrefixEntry(handle={}, length={}, tier={:?}, bytes={}, pins={})",
            e.handle,
            e.len,
            e.tier.name(),
            e.bytes,
            e.pins
        )
    }
}

/// Handles dropped by an insert, for the caller to free.
#[pyclass(frozen, module = "qwen4exp._core", name = "InsertResult")]
pub struct PyInsertResult(pub InsertOutcome);

#[pymethods]
impl PyInsertResult {
    #[getter]
    fn evicted(&self) -> Vec<u64> {
        self.0.evicted.clone()
    }
    #[getter]
    fn replaced(&self) -> Option<u64> {
        self.0.replaced
    }
    #[getter]
    fn freed(&self) -> Vec<u64> {
        self.0
            .replaced
            .into_iter()
            .chain(self.0.evicted.iter().copied())
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "InsertResult(evicted={:?}, replaced={:?})",
            self.0.evicted, self.0.replaced
        )
    }
}

/// The store's counters at one moment.
#[pyclass(frozen, module = "qwen4exp._core", name = "PrefixStoreStats")]
pub struct PyPrefixStoreStats(pub StoreStats);

#[pymethods]
impl PyPrefixStoreStats {
    #[getter]
    fn entries(&self) -> usize {
        self.0.entries
    }
    #[getter]
    fn bytes(&self) -> u64 {
        self.0.bytes
    }
    #[getter]
    fn device_bytes(&self) -> u64 {
        self.0.device_bytes
    }
    #[getter]
    fn host_bytes(&self) -> u64 {
        self.0.host_bytes
    }
    #[getter]
    fn pinned_entries(&self) -> usize {
        self.0.pinned_entries
    }
    #[getter]
    fn pinned_bytes(&self) -> u64 {
        self.0.pinned_bytes
    }
    #[getter]
    fn hits(&self) -> u64 {
        self.0.hits
    }
    #[getter]
    fn misses(&self) -> u64 {
        self.0.misses
    }
    #[getter]
    fn evictions(&self) -> u64 {
        self.0.evictions
    }
    #[getter]
    fn nodes(&self) -> usize {
        self.0.nodes
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.0;
        let out = PyDict::new(py);
        for (k, v) in [
            ("entries", s.entries as u64),
            ("bytes", s.bytes),
            ("device_bytes", s.device_bytes),
            ("host_bytes", s.host_bytes),
            ("pinned_entries", s.pinned_entries as u64),
            ("pinned_bytes", s.pinned_bytes),
            ("hits", s.hits),
            ("misses", s.misses),
            ("evictions", s.evictions),
            ("nodes", s.nodes as u64),
        ] {
            out.set_item(k, v)?;
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        let s = &self.0;
        format!(
            "PrefixStoreStats(entries={}, bytes={}, hits={}, misses={}, evictions={})",
            s.entries, s.bytes, s.hits, s.misses, s.evictions
        )
    }
}
