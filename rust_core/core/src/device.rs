//! One device's budget: what it holds, what grows with the context, and what it must keep free.

use crate::error::PlanError;
use crate::units::fmt_bytes;
use crate::workspace::WorkspaceFit;
use crate::DEFAULT_HEADROOM;

/// The engine's measurements of one device. Byte counts cover all slots unless named per slot.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceBudget {
    /// How the engine names the device (`"cuda:0"`); unique within a plan.
    pub name: String,
    /// Measured capacity in bytes.
    pub capacity: u64,
    /// Fraction of capacity kept free, in [0, 1).
    pub headroom: f64,
    /// Fixed bytes: weights on this device.
    pub weights: u64,
    /// Fixed bytes: resident CUDA graphs and their pool.
    pub graphs: u64,
    /// Fixed bytes: every slot's state that does not grow with context (recurrent, conv, n-gram).
    pub slot_state: u64,
    /// Bytes per context position for all slots: K/V, indexer keys, compressed keys.
    pub bytes_per_position: u64,
    /// The floor chunk's workspace measured at `(position, bytes)`; fitted as a line.
    pub workspace_samples: Vec<(u64, u64)>,
    /// One snapshot per slot when snapshots live on this device: base bytes (full recurrent state)...
    pub snapshot_base: u64,
    /// ...plus bytes per position (the prefix's K/V strips). Both 0: snapshots live elsewhere.
    pub snapshot_per_position: u64,
    /// Number of slots (snapshots are counted once per slot).
    pub slots: u64,
}

/// The budget model evaluated at one context and chunk; `needed` is the sum of the parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breakdown {
    pub capacity: u64,
    pub headroom: u64,
    pub available: u64,
    pub weights: u64,
    pub graphs: u64,
    /// Slot state plus the context-sized caches.
    pub caches: u64,
    pub workspace: u64,
    pub snapshots: u64,
    pub needed: u64,
}

impl DeviceBudget {
    /// A device with nothing but a capacity and a cache size; fill the rest with struct update.
    pub fn new(name: impl Into<String>, capacity: u64, bytes_per_position: u64) -> Self {
        DeviceBudget {
            name: name.into(),
            capacity,
            headroom: DEFAULT_HEADROOM,
            weights: 0,
            graphs: 0,
            slot_state: 0,
            bytes_per_position,
            workspace_samples: Vec::new(),
            snapshot_base: 0,
            snapshot_per_position: 0,
            slots: 1,
        }
    }

    /// Refuses inputs that cannot describe a device.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |what: String| Err(PlanError::Config(format!("device '{}': {what}", self.name)));
        if self.name.is_empty() {
            return Err(PlanError::Config("a device needs a name".into()));
        }
        if !(self.headroom.is_finite() && (0.0..1.0).contains(&self.headroom)) {
            return bad(format!(
                "headroom {} is not a fraction in [0, 1)",
                self.headroom
            ));
        }
        if self.capacity == 0 {
            return bad("capacity is 0 bytes".into());
        }
        if self.slots == 0 {
            return bad("the number of slots is 0".into());
        }
        Ok(())
    }

    /// Bytes kept free: capacity times the headroom fraction, rounded up.
    pub fn headroom_bytes(&self) -> u64 {
        ((self.capacity as f64) * self.headroom)
            .ceil()
            .min(self.capacity as f64) as u64
    }

    /// What the plan may use: capacity less headroom.
    pub fn available(&self) -> u64 {
        self.capacity - self.headroom_bytes()
    }

    pub fn fixed(&self) -> u64 {
        self.weights
            .saturating_add(self.graphs)
            .saturating_add(self.slot_state)
    }

    pub fn snapshots_on_device(&self) -> bool {
        self.snapshot_base > 0 || self.snapshot_per_position > 0
    }

    pub fn workspace_fit(&self) -> WorkspaceFit {
        WorkspaceFit::from_samples(&self.workspace_samples)
    }

    /// One full snapshot per slot at `context` when snapshots live here, else 0.
    pub fn snapshots_at(&self, context: u64) -> u64 {
        let per_slot = self
            .snapshot_base
            .saturating_add(self.snapshot_per_position.saturating_mul(context));
        per_slot.saturating_mul(self.slots)
    }

    /// The model at `context` with a prompt chunk of `rows` rows; the measured floor chunk of
    /// `floor_rows` rows is scaled linearly in rows (real mode measures larger chunks instead).
    pub fn breakdown(&self, context: u64, rows: u64, floor_rows: u64) -> Breakdown {
        let floor_ws = self.workspace_fit().at(context);
        let workspace = if rows == floor_rows || floor_rows == 0 {
            floor_ws
        } else {
            let scaled = floor_ws as u128 * rows as u128;
            scaled.div_ceil(floor_rows as u128).min(u64::MAX as u128) as u64
        };
        let caches = self
            .slot_state
            .saturating_add(self.bytes_per_position.saturating_mul(context));
        let snapshots = self.snapshots_at(context);
        let needed = [self.weights, self.graphs, caches, workspace, snapshots]
            .iter()
            .fold(0u64, |acc, b| acc.saturating_add(*b));
        Breakdown {
            capacity: self.capacity,
            headroom: self.headroom_bytes(),
            available: self.available(),
            weights: self.weights,
            graphs: self.graphs,
            caches,
            workspace,
            snapshots,
            needed,
        }
    }
}

impl Breakdown {
    /// `" (needed 30.10 GiB = weights .. + graphs .. + ...; available .. of .. after .. headroom)"`.
    pub fn describe(&self) -> String {
        format!(
            " (needed {} = weights {} + graphs {} + caches {} + chunk workspace {} + snapshots {}; \
             available {} of {} after {} headroom)",
            fmt_bytes(self.needed),
            fmt_bytes(self.weights),
            fmt_bytes(self.graphs),
            fmt_bytes(self.caches),
            fmt_bytes(self.workspace),
            fmt_bytes(self.snapshots),
            fmt_bytes(self.available),
            fmt_bytes(self.capacity),
            fmt_bytes(self.headroom)
        )
    }
}
