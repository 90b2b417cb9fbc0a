//! DeviceProbe, Probe and Planner for Python.

use crate::device::PyDeviceBudget;
use crate::errors::plan_err;
use crate::plan::PyPlan;
use crate::search::{PyChunkFit, PyContextFit};
use pyo3::prelude::*;
use qwen4exp_core::{
    ChunkConfig, DeviceProbe, FitConfig, Planner, Probe, CHUNK_ROWS, CONTEXT_STEP, FLOOR_CONTEXT,
    TRAINED_CONTEXT,
};

/// One device's outcome for one candidate: fit with spare bytes, or miss with a shortfall.
#[pyclass(frozen, module = "qwen4exp._core", name = "DeviceProbe")]
pub struct PyDeviceProbe(pub DeviceProbe);

#[pymethods]
impl PyDeviceProbe {
    #[new]
    fn new(device: String, needed: u64, available: u64) -> Self {
        PyDeviceProbe(DeviceProbe::measured(device, needed, available))
    }

    #[staticmethod]
    fn fit(device: String, spare: u64) -> Self {
        PyDeviceProbe(DeviceProbe::fit(device, spare))
    }

    #[staticmethod]
    fn miss(device: String, shortfall: u64) -> PyResult<Self> {
        DeviceProbe::miss(device, shortfall)
            .map(PyDeviceProbe)
            .map_err(plan_err)
    }

    #[getter]
    fn device(&self) -> &str {
        &self.0.device
    }
    #[getter]
    fn needed(&self) -> Option<u64> {
        self.0.needed
    }
    #[getter]
    fn available(&self) -> Option<u64> {
        self.0.available
    }
    #[getter]
    fn fits(&self) -> bool {
        self.0.fits()
    }
    #[getter]
    fn spare(&self) -> u64 {
        self.0.spare()
    }
    #[getter]
    fn shortfall(&self) -> u64 {
        self.0.shortfall()
    }

    fn __repr__(&self) -> String {
        let margin = match self.0.fits() {
            true => format!("spare={}", self.0.spare()),
            false => format!("shortfall={}", self.0.shortfall()),
        };
        format!(
            "DeviceProbe({:?}, {}, {margin})",
            self.0.device,
            if self.0.fits() { "fit" } else { "miss" }
        )
    }
}

/// One candidate tried on every device, kept for the report.
#[pyclass(frozen, module = "qwen4exp._core", name = "Probe")]
pub struct PyProbe(pub Probe);

#[pymethods]
impl PyProbe {
    #[getter]
    fn candidate(&self) -> u64 {
        self.0.candidate
    }
    #[getter]
    fn devices(&self) -> Vec<PyDeviceProbe> {
        self.0.devices.iter().cloned().map(PyDeviceProbe).collect()
    }
    #[getter]
    fn fits(&self) -> bool {
        self.0.fits
    }
    #[getter]
    fn binding(&self) -> Option<String> {
        self.0.binding.clone()
    }

    fn __repr__(&self) -> String {
        let verdict = if self.0.fits { "fit" } else { "miss" };
        format!(
            "Probe({}, {verdict}, binding={:?})",
            self.0.candidate, self.0.binding
        )
    }
}

pub fn probes(list: &[Probe]) -> Vec<PyProbe> {
    list.iter().cloned().map(PyProbe).collect()
}

/// Every device's budget plus the search settings: estimate, or drive the searches for real.
#[pyclass(frozen, module = "qwen4exp._core", name = "Planner")]
pub struct PyPlanner(Planner);

#[pymethods]
impl PyPlanner {
    #[new]
    #[pyo3(signature = (devices, *, trained=TRAINED_CONTEXT, step=CONTEXT_STEP, floor=FLOOR_CONTEXT,
        floor_chunk=CHUNK_ROWS, max_chunk=8192),
        text_signature = "(devices, *, trained=262144, step=4096, floor=4096, floor_chunk=256, max_chunk=8192)")]
    fn new(
        devices: Vec<Bound<'_, PyDeviceBudget>>,
        trained: u64,
        step: u64,
        floor: u64,
        floor_chunk: u64,
        max_chunk: u64,
    ) -> PyResult<Self> {
        let devices = devices.iter().map(|d| d.get().0.clone()).collect();
        let fit = FitConfig {
            trained,
            step,
            floor,
        };
        let chunk = ChunkConfig {
            floor_chunk,
            max_chunk,
        };
        Planner::new(devices, fit, chunk)
            .map(PyPlanner)
            .map_err(plan_err)
    }

    #[getter]
    fn devices(&self) -> Vec<PyDeviceBudget> {
        self.0
            .devices()
            .iter()
            .cloned()
            .map(PyDeviceBudget)
            .collect()
    }
    #[getter]
    fn trained(&self) -> u64 {
        self.0.fit_config().trained
    }
    #[getter]
    fn step(&self) -> u64 {
        self.0.fit_config().step
    }
    #[getter]
    fn floor(&self) -> u64 {
        self.0.fit_config().floor
    }
    #[getter]
    fn floor_chunk(&self) -> u64 {
        self.0.chunk_config().floor_chunk
    }
    #[getter]
    fn max_chunk(&self) -> u64 {
        self.0.chunk_config().max_chunk
    }

    #[pyo3(signature = (context, chunk=None))]
    fn evaluate(&self, context: u64, chunk: Option<u64>) -> Vec<PyDeviceProbe> {
        let rows = chunk.unwrap_or(self.0.chunk_config().floor_chunk);
        self.0
            .evaluate(context, rows)
            .into_iter()
            .map(PyDeviceProbe)
            .collect()
    }

    fn context_fit(&self) -> PyResult<PyContextFit> {
        self.0
            .context_fit()
            .map(PyContextFit::wrap)
            .map_err(plan_err)
    }

    fn chunk_fit(&self) -> PyResult<PyChunkFit> {
        self.0.chunk_fit().map(PyChunkFit::wrap).map_err(plan_err)
    }

    fn estimate(&self, py: Python<'_>) -> PyResult<PyPlan> {
        py.detach(|| self.0.estimate())
            .map(PyPlan)
            .map_err(plan_err)
    }

    fn report(
        &self,
        context_fit: &Bound<'_, PyContextFit>,
        chunk_fit: &Bound<'_, PyChunkFit>,
    ) -> PyResult<PyPlan> {
        let cf = context_fit.get().snapshot()?;
        let ch = chunk_fit.get().snapshot()?;
        self.0.report(&cf, &ch).map(PyPlan).map_err(plan_err)
    }

    fn __repr__(&self) -> String {
        let names: Vec<&str> = self.0.devices().iter().map(|d| d.name.as_str()).collect();
        format!("Planner(devices={names:?})")
    }
}
