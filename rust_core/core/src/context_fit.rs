//! ContextFit: the largest context that fits on every device, as a state machine.
//!
//! The engine tries each candidate for real (or the planner evaluates its model) and reports one
//! outcome per device; the search answers with the next candidate or the context. It starts at
//! the trained context, shrinks each miss by its shortfall over bytes per position, and once a
//! context fits it interpolates between the largest fit and the smallest miss.

use crate::error::PlanError;
use crate::fit_math::{after_miss, converged, interpolate, round_down, shrink_cut};
use crate::probe::{DeviceProbe, Probe};
use crate::units::fmt_bytes;
use crate::{CONTEXT_STEP, FLOOR_CONTEXT, TRAINED_CONTEXT};

/// Where the search starts, its grid and its floor, all in positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FitConfig {
    pub trained: u64,
    pub step: u64,
    pub floor: u64,
}

impl Default for FitConfig {
    fn default() -> Self {
        FitConfig {
            trained: TRAINED_CONTEXT,
            step: CONTEXT_STEP,
            floor: FLOOR_CONTEXT,
        }
    }
}

impl FitConfig {
    /// The first candidate: the trained context rounded down to the step.
    pub fn start(&self) -> u64 {
        round_down(self.trained, self.step)
    }

    pub fn validate(&self) -> Result<(), PlanError> {
        let FitConfig {
            trained,
            step,
            floor,
        } = *self;
        if step == 0 {
            return Err(PlanError::Config("the context step is 0 positions".into()));
        }
        if floor == 0 || floor % step != 0 {
            return Err(PlanError::Config(format!(
                "the floor context {floor} is not a positive multiple of the step {step}"
            )));
        }
        if self.start() < floor {
            return Err(PlanError::Config(format!(
                "the trained context {trained} (rounded down to steps of {step}: {}) is below the floor {floor}",
                self.start()
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Phase {
    Trying(u64),
    Done(u64),
    Failed(PlanError),
}

/// The context search. Feed it with [`ContextFit::report`] until [`ContextFit::candidate`] is None.
#[derive(Debug, Clone)]
pub struct ContextFit {
    cfg: FitConfig,
    names: Vec<String>,
    bytes_per_position: Vec<u64>,
    probes: Vec<Probe>,
    /// Indexes into `probes`: the largest fit and the smallest miss so far.
    lo: Option<usize>,
    hi: Option<usize>,
    phase: Phase,
}

impl ContextFit {
    /// `devices`: each device's name and bytes per context position (used to shrink a miss).
    pub fn new(cfg: FitConfig, devices: Vec<(String, u64)>) -> Result<Self, PlanError> {
        cfg.validate()?;
        if devices.is_empty() {
            return Err(PlanError::Config(
                "a context search needs at least one device".into(),
            ));
        }
        let (names, bytes_per_position): (Vec<String>, Vec<u64>) = devices.into_iter().unzip();
        for (i, n) in names.iter().enumerate() {
            if n.is_empty() || names[..i].contains(n) {
                return Err(PlanError::Config(format!(
                    "device name '{n}' is empty or repeated"
                )));
            }
        }
        let phase = Phase::Trying(cfg.start());
        Ok(ContextFit {
            cfg,
            names,
            bytes_per_position,
            probes: Vec::new(),
            lo: None,
            hi: None,
            phase,
        })
    }

    pub fn config(&self) -> FitConfig {
        self.cfg
    }

    pub fn devices(&self) -> &[String] {
        &self.names
    }

    /// The context to try next, or None once the search has answered or failed.
    pub fn candidate(&self) -> Option<u64> {
        match self.phase {
            Phase::Trying(c) => Some(c),
            _ => None,
        }
    }

    /// The fitted context, once found.
    pub fn answer(&self) -> Option<u64> {
        match self.phase {
            Phase::Done(c) => Some(c),
            _ => None,
        }
    }

    /// The error that ended the search, if the floor did not fit.
    pub fn failure(&self) -> Option<&PlanError> {
        match &self.phase {
            Phase::Failed(e) => Some(e),
            _ => None,
        }
    }

    /// The device that refused one step more than the answer; None while searching and when the
    /// trained context itself fits (then the model's training binds, not a device).
    pub fn binding(&self) -> Option<&str> {
        self.answer()?;
        self.hi.and_then(|i| self.probes[i].binding.as_deref())
    }

    /// Every probe so far, in the order tried.
    pub fn probes(&self) -> &[Probe] {
        &self.probes
    }

    /// Records the outcome of the current candidate on every device; returns the next candidate
    /// (None when done). A miss at the floor ends the search with [`PlanError::BelowFloor`].
    pub fn report(&mut self, outcomes: Vec<DeviceProbe>) -> Result<Option<u64>, PlanError> {
        let context = match &self.phase {
            Phase::Trying(c) => *c,
            Phase::Done(c) => {
                return Err(PlanError::Protocol(format!(
                    "the context search already answered {c}; nothing more to report"
                )))
            }
            Phase::Failed(e) => return Err(e.clone()),
        };
        let bpp = &self.bytes_per_position;
        // Rank devices by their margin in positions, so devices of different sizes compare.
        let probe = Probe::collect(context, &self.names, outcomes, |i, p| {
            p.spare().max(p.shortfall()) / bpp[i].max(1)
        })?;
        let fits = probe.fits;
        self.probes.push(probe);
        let index = self.probes.len() - 1;
        if fits {
            self.lo = Some(index);
        } else {
            self.hi = Some(index);
        }
        self.phase = self.next_phase(context);
        match &self.phase {
            Phase::Failed(e) => Err(e.clone()),
            _ => Ok(self.candidate()),
        }
    }

    fn next_phase(&self, context: u64) -> Phase {
        let step = self.cfg.step;
        match (self.lo, self.hi) {
            // Fits with no miss above it: only the trained context gets here.
            (Some(_), None) => Phase::Done(context),
            // Still shrinking: no context has fit yet.
            (None, Some(hi)) => {
                if context <= self.cfg.floor {
                    return Phase::Failed(self.floor_error(hi));
                }
                let miss = &self.probes[hi];
                let cut = miss
                    .devices
                    .iter()
                    .zip(&self.bytes_per_position)
                    .filter(|(p, _)| !p.fits())
                    .map(|(p, bpp)| shrink_cut(p.shortfall(), *bpp, step))
                    .max()
                    .unwrap_or(step);
                Phase::Trying(after_miss(context, cut, self.cfg.floor))
            }
            (Some(lo), Some(hi)) => {
                let (lo_p, hi_p) = (&self.probes[lo], &self.probes[hi]);
                let (lo_c, hi_c) = (lo_p.candidate, hi_p.candidate);
                if converged(lo_c, hi_c, step) {
                    return Phase::Done(lo_c);
                }
                // Each device that misses at hi crosses its budget somewhere; the first crossing binds.
                let next = lo_p
                    .devices
                    .iter()
                    .zip(&hi_p.devices)
                    .filter(|(_, h)| !h.fits())
                    .map(|(l, h)| interpolate(lo_c, hi_c, l.spare(), h.shortfall(), step))
                    .min()
                    .unwrap_or(lo_c + step);
                Phase::Trying(next)
            }
            // `report` has just set one of the two; kept total rather than panicking.
            (None, None) => Phase::Trying(context),
        }
    }

    fn floor_error(&self, hi: usize) -> PlanError {
        let miss = &self.probes[hi];
        let worst = miss
            .devices
            .iter()
            .find(|p| Some(&p.device) == miss.binding.as_ref())
            .or_else(|| miss.devices.iter().find(|p| !p.fits()));
        let (device, shortfall, detail) = match worst {
            Some(p) => {
                let detail = match (p.needed, p.available) {
                    (Some(n), Some(a)) => {
                        format!(" (needed {}, available {})", fmt_bytes(n), fmt_bytes(a))
                    }
                    _ => String::new(),
                };
                (p.device.clone(), p.shortfall(), detail)
            }
            None => (String::new(), 0, String::new()),
        };
        PlanError::BelowFloor {
            floor: self.cfg.floor,
            device,
            shortfall,
            detail,
        }
    }
}
