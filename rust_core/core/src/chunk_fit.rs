//! ChunkFit: the largest prompt chunk whose workspace fits once the context is fixed.
//!
//! Chunks are multiples of [`CHUNK_ROWS`] between the floor chunk and a maximum. The floor chunk is
//! part of the context's contract (the context search reserved it, before any snapshots on the
//! same device), so the search only looks above it: it tries the maximum first, then bisects.

use crate::error::PlanError;
use crate::probe::{DeviceProbe, Probe};

/// Prompt chunks are whole multiples of this many rows.
pub const CHUNK_ROWS: u64 = 256;

/// The chunk sizes the search may answer with, in rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkConfig {
    /// The chunk whose workspace the engine measured and the context fit reserved.
    pub floor_chunk: u64,
    /// The largest chunk worth having.
    pub max_chunk: u64,
}

impl Default for ChunkConfig {
    fn default() -> Self {
        ChunkConfig {
            floor_chunk: CHUNK_ROWS,
            max_chunk: 8192,
        }
    }
}

impl ChunkConfig {
    pub fn validate(&self) -> Result<(), PlanError> {
        let ChunkConfig {
            floor_chunk,
            max_chunk,
        } = *self;
        for (what, rows) in [("floor chunk", floor_chunk), ("maximum chunk", max_chunk)] {
            if rows == 0 || rows % CHUNK_ROWS != 0 {
                return Err(PlanError::Config(format!(
                    "the {what} of {rows} rows is not a positive multiple of {CHUNK_ROWS}"
                )));
            }
        }
        if floor_chunk > max_chunk {
            return Err(PlanError::Config(format!(
                "the floor chunk of {floor_chunk} rows is above the maximum chunk of {max_chunk}"
            )));
        }
        Ok(())
    }
}

/// The chunk search; feed it with [`ChunkFit::report`] until [`ChunkFit::candidate`] is None.
#[derive(Debug, Clone)]
pub struct ChunkFit {
    cfg: ChunkConfig,
    names: Vec<String>,
    probes: Vec<Probe>,
    /// Known to fit (starts at the floor chunk) and the largest not yet ruled out, in rows.
    lo: u64,
    hi: u64,
    /// Index of the smallest miss, for the binding device.
    smallest_miss: Option<usize>,
    candidate: Option<u64>,
}

impl ChunkFit {
    pub fn new(cfg: ChunkConfig, devices: Vec<String>) -> Result<Self, PlanError> {
        cfg.validate()?;
        if devices.is_empty() {
            return Err(PlanError::Config(
                "a chunk search needs at least one device".into(),
            ));
        }
        for (i, n) in devices.iter().enumerate() {
            if n.is_empty() || devices[..i].contains(n) {
                return Err(PlanError::Config(format!(
                    "device name '{n}' is empty or repeated"
                )));
            }
        }
        let (lo, hi) = (cfg.floor_chunk, cfg.max_chunk);
        let candidate = if lo == hi { None } else { Some(hi) };
        Ok(ChunkFit {
            cfg,
            names: devices,
            probes: Vec::new(),
            lo,
            hi,
            smallest_miss: None,
            candidate,
        })
    }

    pub fn config(&self) -> ChunkConfig {
        self.cfg
    }

    pub fn devices(&self) -> &[String] {
        &self.names
    }

    /// The chunk to try next (rows), or None once answered.
    pub fn candidate(&self) -> Option<u64> {
        self.candidate
    }

    /// The largest chunk that fits, once found.
    pub fn answer(&self) -> Option<u64> {
        match self.candidate {
            None => Some(self.lo),
            Some(_) => None,
        }
    }

    /// The device that refused one chunk step more than the answer; None if the maximum fits.
    pub fn binding(&self) -> Option<&str> {
        self.answer()?;
        self.smallest_miss
            .and_then(|i| self.probes[i].binding.as_deref())
    }

    pub fn probes(&self) -> &[Probe] {
        &self.probes
    }

    /// Records the outcome of the current candidate on every device; returns the next candidate.
    pub fn report(&mut self, outcomes: Vec<DeviceProbe>) -> Result<Option<u64>, PlanError> {
        let Some(rows) = self.candidate else {
            return Err(PlanError::Protocol(format!(
                "the chunk search already answered {} rows; nothing more to report",
                self.lo
            )));
        };
        let probe = Probe::collect(rows, &self.names, outcomes, |_, p| {
            p.spare().max(p.shortfall())
        })?;
        if probe.fits {
            self.lo = rows;
        } else {
            self.hi = rows - CHUNK_ROWS;
            self.smallest_miss = Some(self.probes.len());
        }
        self.probes.push(probe);
        self.candidate = if self.lo >= self.hi {
            None
        } else {
            // Upper middle in whole chunk steps, so a fit always moves `lo` up.
            let steps = (self.hi - self.lo) / CHUNK_ROWS;
            Some(self.lo + steps.div_ceil(2) * CHUNK_ROWS)
        };
        Ok(self.candidate)
    }
}
