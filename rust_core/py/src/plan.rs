//! Plan and DeviceReport for Python: read-only views of the core's report.

use crate::planner::{probes, PyProbe};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use qwen4exp_core::{DeviceReport, Plan, Probe};

/// One device's budget at the plan's context and chunk.
#[pyclass(frozen, module = "qwen4exp._core", name = "DeviceReport")]
pub struct PyDeviceReport(DeviceReport);

#[pymethods]
impl PyDeviceReport {
    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }
    #[getter]
    fn capacity(&self) -> u64 {
        self.0.capacity
    }
    #[getter]
    fn headroom(&self) -> u64 {
        self.0.headroom
    }
    #[getter]
    fn weights(&self) -> u64 {
        self.0.weights
    }
    #[getter]
    fn graphs(&self) -> u64 {
        self.0.graphs
    }
    #[getter]
    fn caches(&self) -> u64 {
        self.0.caches
    }
    #[getter]
    fn workspace(&self) -> u64 {
        self.0.workspace
    }
    #[getter]
    fn snapshots(&self) -> u64 {
        self.0.snapshots
    }
    #[getter]
    fn free(&self) -> i64 {
        self.0.free
    }
    #[getter]
    fn snapshots_on_device(&self) -> bool {
        self.0.snapshots_on_device
    }
    #[getter]
    fn workspace_fit(&self) -> &str {
        &self.0.workspace_fit
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceReport({:?}, capacity={}, free={})",
            self.0.name, self.0.capacity, self.0.free
        )
    }
}

/// The planner's answer, the budget per device at that answer, and every probe.
#[pyclass(frozen, module = "qwen4exp._core", name = "Plan")]
pub struct PyPlan(pub Plan);

fn device_dict<'py>(py: Python<'py>, d: &DeviceReport) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("name", &d.name)?;
    for (k, v) in [
        ("capacity", d.capacity),
        ("headroom", d.headroom),
        ("weights", d.weights),
        ("graphs", d.graphs),
        ("caches", d.caches),
        ("workspace", d.workspace),
        ("snapshots", d.snapshots),
    ] {
        out.set_item(k, v)?;
    }
    out.set_item("free", d.free)?;
    out.set_item("snapshots_on_device", d.snapshots_on_device)?;
    out.set_item("workspace_fit", &d.workspace_fit)?;
    Ok(out)
}

fn probe_list<'py>(py: Python<'py>, list: &[Probe]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for p in list {
        let devices = PyList::empty(py);
        for d in &p.devices {
            let dd = PyDict::new(py);
            dd.set_item("device", &d.device)?;
            dd.set_item("needed", d.needed)?;
            dd.set_item("available", d.available)?;
            dd.set_item("fits", d.fits())?;
            dd.set_item("spare", d.spare())?;
            dd.set_item("shortfall", d.shortfall())?;
            devices.append(dd)?;
        }
        let pd = PyDict::new(py);
        pd.set_item("candidate", p.candidate)?;
        pd.set_item("fits", p.fits)?;
        pd.set_item("binding", &p.binding)?;
        pd.set_item("devices", devices)?;
        out.append(pd)?;
    }
    Ok(out)
}

#[pymethods]
impl PyPlan {
    #[getter]
    fn context(&self) -> u64 {
        self.0.context
    }
    #[getter]
    fn chunk(&self) -> u64 {
        self.0.chunk
    }
    #[getter]
    fn binding(&self) -> Option<String> {
        self.0.binding.clone()
    }
    #[getter]
    fn chunk_binding(&self) -> Option<String> {
        self.0.chunk_binding.clone()
    }
    #[getter]
    fn probes(&self) -> Vec<PyProbe> {
        probes(&self.0.probes)
    }
    #[getter]
    fn chunk_probes(&self) -> Vec<PyProbe> {
        probes(&self.0.chunk_probes)
    }
    #[getter]
    fn devices(&self) -> Vec<PyDeviceReport> {
        self.0.devices.iter().cloned().map(PyDeviceReport).collect()
    }
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.0.notes.clone()
    }

    fn table(&self) -> String {
        self.0.table()
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        out.set_item("context", self.0.context)?;
        out.set_item("chunk", self.0.chunk)?;
        out.set_item("binding", &self.0.binding)?;
        out.set_item("chunk_binding", &self.0.chunk_binding)?;
        let devices = PyList::empty(py);
        for d in &self.0.devices {
            devices.append(device_dict(py, d)?)?;
        }
        out.set_item("devices", devices)?;
        out.set_item("probes", probe_list(py, &self.0.probes)?)?;
        out.set_item("chunk_probes", probe_list(py, &self.0.chunk_probes)?)?;
        out.set_item("notes", &self.0.notes)?;
        Ok(out)
    }

    fn __str__(&self) -> String {
        self.0.table()
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(context={}, chunk={}, binding={:?})",
            self.0.context, self.0.chunk, self.0.binding
        )
    }
}
