//! ContextFit and ChunkFit for Python: the core state machines behind a mutex, so an engine
//! thread and a status thread can share one.

use crate::errors::{lock, plan_err, PlannerError};
use crate::planner::{probes, PyDeviceProbe, PyProbe};
use pyo3::prelude::*;
use qwen4exp_core::{
    ChunkConfig, ChunkFit, ContextFit, DeviceProbe, FitConfig, CHUNK_ROWS, CONTEXT_STEP,
    FLOOR_CONTEXT, TRAINED_CONTEXT,
};
use std::sync::Mutex;

fn outcomes(list: &[Bound<'_, PyDeviceProbe>]) -> Vec<DeviceProbe> {
    list.iter().map(|p| p.get().0.clone()).collect()
}

/// The context search as a state machine: report each candidate's outcome until answered.
#[pyclass(frozen, module = "qwen4exp._core", name = "ContextFit")]
pub struct PyContextFit(Mutex<ContextFit>);

impl PyContextFit {
    pub fn wrap(f: ContextFit) -> Self {
        PyContextFit(Mutex::new(f))
    }

    /// A copy of the search's current state.
    pub fn snapshot(&self) -> PyResult<ContextFit> {
        self.with(|f| f.clone())
    }

    /// Reads the search under its lock.
    fn with<R>(&self, read: impl FnOnce(&ContextFit) -> R) -> PyResult<R> {
        Ok(read(
            &*lock(&self.0, "context search").map_err(PlannerError::new_err)?,
        ))
    }
}

#[pymethods]
impl PyContextFit {
    #[new]
    #[pyo3(signature = (devices, *, trained=TRAINED_CONTEXT, step=CONTEXT_STEP, floor=FLOOR_CONTEXT),
        text_signature = "(devices, *, trained=262144, step=4096, floor=4096)")]
    fn new(devices: Vec<(String, u64)>, trained: u64, step: u64, floor: u64) -> PyResult<Self> {
        ContextFit::new(
            FitConfig {
                trained,
                step,
                floor,
            },
            devices,
        )
        .map(Self::wrap)
        .map_err(plan_err)
    }

    #[getter]
    fn candidate(&self) -> PyResult<Option<u64>> {
        self.with(|f| f.candidate())
    }
    #[getter]
    fn done(&self) -> PyResult<bool> {
        self.with(|f| f.candidate().is_none())
    }
    #[getter]
    fn answer(&self) -> PyResult<Option<u64>> {
        self.with(|f| f.answer())
    }
    #[getter]
    fn binding(&self) -> PyResult<Option<String>> {
        self.with(|f| f.binding().map(str::to_string))
    }
    #[getter]
    fn failure(&self) -> PyResult<Option<String>> {
        self.with(|f| f.failure().map(|e| e.to_string()))
    }
    #[getter]
    fn probes(&self) -> PyResult<Vec<PyProbe>> {
        self.with(|f| probes(f.probes()))
    }
    #[getter]
    fn devices(&self) -> PyResult<Vec<String>> {
        self.with(|f| f.devices().to_vec())
    }

    fn report(
        &self,
        py: Python<'_>,
        probes: Vec<Bound<'_, PyDeviceProbe>>,
    ) -> PyResult<Option<u64>> {
        let outcomes = outcomes(&probes);
        py.detach(|| {
            let mut f = lock(&self.0, "context search").map_err(|e| e.to_string())?;
            f.report(outcomes).map_err(|e| e.to_string())
        })
        .map_err(PlannerError::new_err)
    }

    fn __repr__(&self) -> PyResult<String> {
        self.with(|f| {
            format!(
                "ContextFit(candidate={:?}, answer={:?}, probes={})",
                f.candidate(),
                f.answer(),
                f.probes().len()
            )
        })
    }
}

/// The chunk search: the largest multiple of 256 rows whose workspace fits.
#[pyclass(frozen, module = "qwen4exp._core", name = "ChunkFit")]
pub struct PyChunkFit(Mutex<ChunkFit>);

impl PyChunkFit {
    pub fn wrap(f: ChunkFit) -> Self {
        PyChunkFit(Mutex::new(f))
    }

    pub fn snapshot(&self) -> PyResult<ChunkFit> {
        self.with(|f| f.clone())
    }

    /// Reads the search under its lock.
    fn with<R>(&self, read: impl FnOnce(&ChunkFit) -> R) -> PyResult<R> {
        Ok(read(
            &*lock(&self.0, "chunk search").map_err(PlannerError::new_err)?,
        ))
    }
}

#[pymethods]
impl PyChunkFit {
    #[new]
    #[pyo3(signature = (devices, *, floor_chunk=CHUNK_ROWS, max_chunk=8192),
        text_signature = "(devices, *, floor_chunk=256, max_chunk=8192)")]
    fn new(devices: Vec<String>, floor_chunk: u64, max_chunk: u64) -> PyResult<Self> {
        ChunkFit::new(
            ChunkConfig {
                floor_chunk,
                max_chunk,
            },
            devices,
        )
        .map(Self::wrap)
        .map_err(plan_err)
    }

    #[getter]
    fn candidate(&self) -> PyResult<Option<u64>> {
        self.with(|f| f.candidate())
    }
    #[getter]
    fn done(&self) -> PyResult<bool> {
        self.with(|f| f.candidate().is_none())
    }
    #[getter]
    fn answer(&self) -> PyResult<Option<u64>> {
        self.with(|f| f.answer())
    }
    #[getter]
    fn binding(&self) -> PyResult<Option<String>> {
        self.with(|f| f.binding().map(str::to_string))
    }
    #[getter]
    fn probes(&self) -> PyResult<Vec<PyProbe>> {
        self.with(|f| probes(f.probes()))
    }
    #[getter]
    fn devices(&self) -> PyResult<Vec<String>> {
        self.with(|f| f.devices().to_vec())
    }

    fn report(
        &self,
        py: Python<'_>,
        probes: Vec<Bound<'_, PyDeviceProbe>>,
    ) -> PyResult<Option<u64>> {
        let outcomes = outcomes(&probes);
        py.detach(|| {
            let mut f = lock(&self.0, "chunk search").map_err(|e| e.to_string())?;
            f.report(outcomes).map_err(|e| e.to_string())
        })
        .map_err(PlannerError::new_err)
    }

    fn __repr__(&self) -> PyResult<String> {
        self.with(|f| {
            format!(
                "ChunkFit(candidate={:?}, answer={:?}, probes={})",
                f.candidate(),
                f.answer(),
                f.probes().len()
            )
        })
    }
}
