//! PrefixStore for Python: the core store behind a mutex; the GIL is released around every
//! operation, so a long match does not stall other Python threads.

use crate::errors::{lock, store_err, PrefixStoreError};
use crate::store_types::{PyInsertResult, PyPrefixEntry, PyPrefixStoreStats};
use crate::tokens::extract_tokens;
use pyo3::prelude::*;
use qwen4exp_core::{PrefixStore, StoreError, Tier};
use std::sync::Mutex;

fn tier(name: &str) -> PyResult<Tier> {
    Tier::parse(name).ok_or_else(|| {
        PrefixStoreError::new_err(format!("tier must be 'device' or 'host', not {name:?}"))
    })
}

/// A failure inside the released-GIL section, turned into a Python exception afterwards.
enum Failed {
    Store(StoreError),
    Poisoned(String),
}

impl From<Failed> for PyErr {
    fn from(f: Failed) -> PyErr {
        match f {
            Failed::Store(e) => store_err(e),
            Failed::Poisoned(msg) => PrefixStoreError::new_err(msg),
        }
    }
}

/// Prefix snapshots at restore points: longest-prefix match, pins, LRU eviction per tier.
#[pyclass(frozen, module = "qwen4exp._core", name = "PrefixStore")]
pub struct PyPrefixStore {
    inner: Mutex<PrefixStore>,
    spacing: usize,
}

impl PyPrefixStore {
    /// Runs `op` on the store with the GIL released.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&mut PrefixStore) -> Result<R, StoreError> + Send,
    ) -> PyResult<R> {
        let result = py.detach(|| {
            let mut store = lock(&self.inner, "prefix store").map_err(Failed::Poisoned)?;
            op(&mut store).map_err(Failed::Store)
        });
        Ok(result?)
    }
}

#[pymethods]
impl PyPrefixStore {
    #[new]
    #[pyo3(signature = (spacing, host_limit, device_limit=0))]
    fn new(spacing: usize, host_limit: u64, device_limit: u64) -> PyResult<Self> {
        let store = PrefixStore::new(spacing, host_limit, device_limit).map_err(store_err)?;
        Ok(PyPrefixStore {
            inner: Mutex::new(store),
            spacing,
        })
    }

    #[getter]
    fn spacing(&self) -> usize {
        self.spacing
    }
    #[getter]
    fn host_limit(&self, py: Python<'_>) -> PyResult<u64> {
        self.run(py, |s| Ok(s.limit(Tier::Host)))
    }
    #[getter]
    fn device_limit(&self, py: Python<'_>) -> PyResult<u64> {
        self.run(py, |s| Ok(s.limit(Tier::Device)))
    }

    #[pyo3(signature = (tokens, handle, bytes, tier="host", replace_ancestor=false))]
    fn insert(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        handle: u64,
        bytes: u64,
        tier: &str,
        replace_ancestor: bool,
    ) -> PyResult<PyInsertResult> {
        let (tokens, tier) = (extract_tokens(tokens)?, self::tier(tier)?);
        self.run(py, |s| {
            s.insert(&tokens, handle, tier, bytes, replace_ancestor)
        })
        .map(PyInsertResult)
    }

    #[pyo3(name = "match", signature = (tokens, pin=false))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        pin: bool,
    ) -> PyResult<Option<PyPrefixEntry>> {
        let tokens = extract_tokens(tokens)?;
        Ok(self
            .run(py, |s| Ok(s.match_prefix(&tokens, pin)))?
            .map(PyPrefixEntry))
    }

    fn pin(&self, py: Python<'_>, handle: u64) -> PyResult<PyPrefixEntry> {
        self.run(py, |s| s.pin(handle)).map(PyPrefixEntry)
    }

    fn unpin(&self, py: Python<'_>, handle: u64) -> PyResult<PyPrefixEntry> {
        self.run(py, |s| s.unpin(handle)).map(PyPrefixEntry)
    }

    fn remove(&self, py: Python<'_>, handle: u64) -> PyResult<PyPrefixEntry> {
        self.run(py, |s| s.remove(handle)).map(PyPrefixEntry)
    }

    fn get(&self, py: Python<'_>, handle: u64) -> PyResult<Option<PyPrefixEntry>> {
        Ok(self.run(py, |s| Ok(s.get(handle)))?.map(PyPrefixEntry))
    }

    fn set_limit(&self, py: Python<'_>, tier: &str, limit: u64) -> PyResult<Vec<u64>> {
        let tier = self::tier(tier)?;
        self.run(py, |s| s.set_limit(tier, limit))
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |s| s.check_integrity())
    }

    fn stats(&self, py: Python<'_>) -> PyResult<PyPrefixStoreStats> {
        self.run(py, |s| Ok(s.stats())).map(PyPrefixStoreStats)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, |s| Ok(s.len()))
    }

    fn __contains__(&self, py: Python<'_>, handle: u64) -> PyResult<bool> {
        self.run(py, |s| Ok(s.get(handle).is_some()))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let st = self.run(py, |s| Ok(s.stats()))?;
        Ok(format!(
            "PrefixStore(spacing={}, entries={}, bytes={})",
            self.spacing, st.entries, st.bytes
        ))
    }
}
