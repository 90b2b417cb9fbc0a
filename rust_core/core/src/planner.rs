//! The planner: every device's budget, the two searches, and the pure estimate.

use crate::chunk_fit::{ChunkConfig, ChunkFit};
use crate::context_fit::{ContextFit, FitConfig};
use crate::device::{Breakdown, DeviceBudget};
use crate::error::PlanError;
use crate::probe::DeviceProbe;
use crate::report::Plan;

/// Devices plus the search settings. Build once; every method takes `&self`.
#[derive(Debug, Clone)]
pub struct Planner {
    devices: Vec<DeviceBudget>,
    fit: FitConfig,
    chunk: ChunkConfig,
}

impl Planner {
    pub fn new(
        devices: Vec<DeviceBudget>,
        fit: FitConfig,
        chunk: ChunkConfig,
    ) -> Result<Self, PlanError> {
        fit.validate()?;
        chunk.validate()?;
        if devices.is_empty() {
            return Err(PlanError::Config("a plan needs at least one device".into()));
        }
        for (i, d) in devices.iter().enumerate() {
            d.validate()?;
            if devices[..i].iter().any(|o| o.name == d.name) {
                return Err(PlanError::Config(format!(
                    "device '{}' is listed twice",
                    d.name
                )));
            }
        }
        Ok(Planner {
            devices,
            fit,
            chunk,
        })
    }

    pub fn devices(&self) -> &[DeviceBudget] {
        &self.devices
    }

    pub fn fit_config(&self) -> FitConfig {
        self.fit
    }

    pub fn chunk_config(&self) -> ChunkConfig {
        self.chunk
    }

    /// A fresh context search over these devices, for the engine to drive with real tries.
    pub fn context_fit(&self) -> Result<ContextFit, PlanError> {
        let devices = self
            .devices
            .iter()
            .map(|d| (d.name.clone(), d.bytes_per_position))
            .collect();
        ContextFit::new(self.fit, devices)
    }

    /// A fresh chunk search over these devices.
    pub fn chunk_fit(&self) -> Result<ChunkFit, PlanError> {
        ChunkFit::new(
            self.chunk,
            self.devices.iter().map(|d| d.name.clone()).collect(),
        )
    }

    /// The budget model per device at `context` with a chunk of `rows` rows.
    pub fn breakdown(&self, context: u64, rows: u64) -> Vec<Breakdown> {
        self.devices
            .iter()
            .map(|d| d.breakdown(context, rows, self.chunk.floor_chunk))
            .collect()
    }

    /// The model's outcome per device: fits iff fixed + caches + workspace + snapshots fit in
    /// capacity less headroom.
    pub fn evaluate(&self, context: u64, rows: u64) -> Vec<DeviceProbe> {
        self.devices
            .iter()
            .zip(self.breakdown(context, rows))
            .map(|(d, b)| DeviceProbe::measured(d.name.clone(), b.needed, b.available))
            .collect()
    }

    /// Pure estimate: both searches driven by the model, for when nothing can be tried for real.
    pub fn estimate(&self) -> Result<Plan, PlanError> {
        let floor_chunk = self.chunk.floor_chunk;
        let mut cf = self.context_fit()?;
        while let Some(context) = cf.candidate() {
            if let Err(e) = cf.report(self.evaluate(context, floor_chunk)) {
                return Err(self.explain(e, false));
            }
        }
        let context = cf
            .answer()
            .ok_or_else(|| PlanError::Protocol("context search ended without an answer".into()))?;
        let mut ch = self.chunk_fit()?;
        while let Some(rows) = ch.candidate() {
            ch.report(self.evaluate(context, rows))?;
        }
        let mut plan = self.report(&cf, &ch)?;
        plan.notes.insert(
            0,
            "estimate: every probe is the budget model, nothing was tried on a device".into(),
        );
        Ok(plan)
    }

    /// The report for finished searches (driven for real or by [`Planner::estimate`]).
    pub fn report(&self, cf: &ContextFit, ch: &ChunkFit) -> Result<Plan, PlanError> {
        if cf.devices().iter().ne(self.devices.iter().map(|d| &d.name))
            || ch.devices().iter().ne(self.devices.iter().map(|d| &d.name))
        {
            return Err(PlanError::Protocol(
                "the searches do not cover this planner's devices".into(),
            ));
        }
        let Some(context) = cf.answer() else {
            return Err(match cf.failure() {
                Some(e) => self.explain(e.clone(), true),
                None => PlanError::Protocol("the context search has not answered yet".into()),
            });
        };
        let Some(chunk) = ch.answer() else {
            return Err(PlanError::Protocol(
                "the chunk search has not answered yet".into(),
            ));
        };
        Ok(Plan::build(self, cf, ch, context, chunk))
    }

    /// Adds the model's breakdown at the floor to a floor miss, so the error says what is missing;
    /// a `measured` miss keeps what the engine measured and adds the model after it.
    pub fn explain(&self, err: PlanError, measured: bool) -> PlanError {
        match err {
            PlanError::BelowFloor {
                floor,
                device,
                shortfall,
                detail,
            } => {
                let model = self
                    .devices
                    .iter()
                    .position(|d| d.name == device)
                    .and_then(|i| {
                        self.breakdown(floor, self.chunk.floor_chunk)
                            .get(i)
                            .map(Breakdown::describe)
                    })
                    .unwrap_or_default();
                let detail = match (measured, model.is_empty()) {
                    (true, false) => format!("{detail}; the budget model at the floor:{model}"),
                    (false, false) => model,
                    _ => detail,
                };
                PlanError::BelowFloor {
                    floor,
                    device,
                    shortfall,
                    detail,
                }
            }
            other => other,
        }
    }
}
