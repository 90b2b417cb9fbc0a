//! qwen4exp's pure core: no Python, no device.
//!
//! Memory questions flow one way: the engine measures, this crate decides, the engine allocates.
//! - [`planner::Planner`] holds each device's budget and drives the searches, for real
//!   ([`context_fit::ContextFit`], [`chunk_fit::ChunkFit`] as state machines the engine feeds) or as a
//!   pure estimate from the budget model, and writes the [`report::Plan`].
//! - [`prefix_store::PrefixStore`] indexes prefix snapshots taken at restore points.

pub mod chunk_fit;
pub mod context_fit;
pub mod device;
pub mod error;
pub mod fit_math;
pub mod planner;
pub mod prefix_store;
pub mod probe;
pub mod report;
pub mod units;
pub mod workspace;

pub use chunk_fit::{ChunkConfig, ChunkFit, CHUNK_ROWS};
pub use context_fit::{ContextFit, FitConfig};
pub use device::{Breakdown, DeviceBudget};
pub use error::{PlanError, StoreError};
pub use planner::Planner;
pub use prefix_store::{EntryInfo, InsertOutcome, PrefixStore, StoreStats, Tier};
pub use probe::{DeviceProbe, Probe, Verdict};
pub use report::{DeviceReport, Plan};
pub use workspace::WorkspaceFit;

/// The context the model was trained for, where every search starts.
pub const TRAINED_CONTEXT: u64 = 262_144;
/// Contexts are multiples of this many positions.
pub const CONTEXT_STEP: u64 = 4096;
/// The smallest context the planner will answer with.
pub const FLOOR_CONTEXT: u64 = 4096;
/// Fraction of each device's capacity kept free by default.
pub const DEFAULT_HEADROOM: f64 = 0.10;
