//! DeviceBudget for Python: one device's measurements, validated on construction.

use crate::errors::plan_err;
use pyo3::prelude::*;
use qwen4exp_core::{DeviceBudget, DEFAULT_HEADROOM};

/// One device's measurements for the planner (see qwen4exp/_core.pyi).
#[pyclass(frozen, module = "qwen4exp._core", name = "DeviceBudget")]
pub struct PyDeviceBudget(pub DeviceBudget);

#[pymethods]
impl PyDeviceBudget {
    #[new]
    #[pyo3(signature = (name, capacity, *, bytes_per_position, weights=0, graphs=0, slot_state=0,
        workspace=Vec::new(), snapshot_base=0, snapshot_per_position=0, slots=1, headroom=DEFAULT_HEADROOM),
        text_signature = "(name, capacity, *, bytes_per_position, weights=0, graphs=0, slot_state=0, workspace=(), \
            snapshot_base=0, snapshot_per_position=0, slots=1, headroom=0.1)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        capacity: u64,
        bytes_per_position: u64,
        weights: u64,
        graphs: u64,
        slot_state: u64,
        workspace: Vec<(u64, u64)>,
        snapshot_base: u64,
        snapshot_per_position: u64,
        slots: u64,
        headroom: f64,
    ) -> PyResult<Self> {
        let d = DeviceBudget {
            headroom,
            weights,
            graphs,
            slot_state,
            workspace_samples: workspace,
            snapshot_base,
            snapshot_per_position,
            slots,
            ..DeviceBudget::new(name, capacity, bytes_per_position)
        };
        d.validate().map_err(plan_err)?;
        Ok(PyDeviceBudget(d))
    }

    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }
    #[getter]
    fn capacity(&self) -> u64 {
        self.0.capacity
    }
    #[getter]
    fn headroom(&self) -> f64 {
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
    fn slot_state(&self) -> u64 {
        self.0.slot_state
    }
    #[getter]
    fn bytes_per_position(&self) -> u64 {
        self.0.bytes_per_position
    }
    #[getter]
    fn workspace(&self) -> Vec<(u64, u64)> {
        self.0.workspace_samples.clone()
    }
    #[getter]
    fn snapshot_base(&self) -> u64 {
        self.0.snapshot_base
    }
    #[getter]
    fn snapshot_per_position(&self) -> u64 {
        self.0.snapshot_per_position
    }
    #[getter]
    fn slots(&self) -> u64 {
        self.0.slots
    }
    #[getter]
    fn headroom_bytes(&self) -> u64 {
        self.0.headroom_bytes()
    }
    #[getter]
    fn available(&self) -> u64 {
        self.0.available()
    }
    #[getter]
    fn fixed(&self) -> u64 {
        self.0.fixed()
    }
    #[getter]
    fn snapshots_on_device(&self) -> bool {
        self.0.snapshots_on_device()
    }
    #[getter]
    fn workspace_fit(&self) -> String {
        self.0.workspace_fit().note
    }

    fn workspace_at(&self, position: u64) -> u64 {
        self.0.workspace_fit().at(position)
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceBudget({:?}, capacity={}, bytes_per_position={}, headroom={})",
            self.0.name, self.0.capacity, self.0.bytes_per_position, self.0.headroom
        )
    }
}
