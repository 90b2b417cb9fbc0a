//! What one try of a candidate found, per device and as a whole.

use crate::error::PlanError;

/// A device's answer for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It fits with `spare` bytes left over.
    Fit { spare: u64 },
    /// It does not fit; `shortfall` bytes (> 0) are missing.
    Miss { shortfall: u64 },
}

/// One device's outcome for one candidate. `needed` and `available` are known when the engine
/// measured them (or the estimate computed them); a bare fit or miss carries only the margin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProbe {
    pub device: String,
    pub needed: Option<u64>,
    pub available: Option<u64>,
    pub verdict: Verdict,
}

impl DeviceProbe {
    /// Fits iff `needed <= available`.
    pub fn measured(device: impl Into<String>, needed: u64, available: u64) -> Self {
        let verdict = if needed <= available {
            Verdict::Fit {
                spare: available - needed,
            }
        } else {
            Verdict::Miss {
                shortfall: needed - available,
            }
        };
        DeviceProbe {
            device: device.into(),
            needed: Some(needed),
            available: Some(available),
            verdict,
        }
    }

    pub fn fit(device: impl Into<String>, spare: u64) -> Self {
        DeviceProbe {
            device: device.into(),
            needed: None,
            available: None,
            verdict: Verdict::Fit { spare },
        }
    }

    /// A miss must miss something: a zero shortfall is refused.
    pub fn miss(device: impl Into<String>, shortfall: u64) -> Result<Self, PlanError> {
        let device = device.into();
        if shortfall == 0 {
            return Err(PlanError::Config(format!(
                "device '{device}': a miss needs a positive shortfall (a shortfall of 0 bytes is a fit)"
            )));
        }
        Ok(DeviceProbe {
            device,
            needed: None,
            available: None,
            verdict: Verdict::Miss { shortfall },
        })
    }

    pub fn fits(&self) -> bool {
        matches!(self.verdict, Verdict::Fit { .. })
    }

    pub fn spare(&self) -> u64 {
        match self.verdict {
            Verdict::Fit { spare } => spare,
            Verdict::Miss { .. } => 0,
        }
    }

    pub fn shortfall(&self) -> u64 {
        match self.verdict {
            Verdict::Fit { .. } => 0,
            Verdict::Miss { shortfall } => shortfall,
        }
    }
}

/// One candidate tried on every device, kept for the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// A context (positions) for the context search, a chunk (rows) for the chunk search.
    pub candidate: u64,
    /// One outcome per device, in the planner's device order.
    pub devices: Vec<DeviceProbe>,
    /// Fits iff it fits on every device.
    pub fits: bool,
    /// On a miss, the device furthest over; on a fit, the device closest to its limit.
    pub binding: Option<String>,
}

impl Probe {
    /// Puts `probes` in the order of `names`, refusing unknown, missing or repeated devices;
    /// `weight(index, probe)` ranks devices (largest margin in positions or bytes) for `binding`.
    pub fn collect(
        candidate: u64,
        names: &[String],
        probes: Vec<DeviceProbe>,
        weight: impl Fn(usize, &DeviceProbe) -> u64,
    ) -> Result<Probe, PlanError> {
        let mut slots: Vec<Option<DeviceProbe>> = vec![None; names.len()];
        for p in probes {
            let Some(i) = names.iter().position(|n| *n == p.device) else {
                return Err(PlanError::Protocol(format!(
                    "probe for unknown device '{}' at candidate {candidate} (devices: {})",
                    p.device,
                    names.join(", ")
                )));
            };
            if slots[i].is_some() {
                return Err(PlanError::Protocol(format!(
                    "device '{}' reported twice for candidate {candidate}",
                    p.device
                )));
            }
            slots[i] = Some(p);
        }
        let mut devices = Vec::with_capacity(names.len());
        for (name, slot) in names.iter().zip(slots) {
            match slot {
                Some(p) => devices.push(p),
                None => {
                    return Err(PlanError::Protocol(format!(
                    "no outcome for device '{name}' at candidate {candidate}: report every device"
                )))
                }
            }
        }
        let fits = devices.iter().all(DeviceProbe::fits);
        let ranked = devices.iter().enumerate().filter(|(_, p)| p.fits() == fits);
        let binding = if fits {
            // First device with the smallest spare.
            ranked
                .min_by_key(|(i, p)| (weight(*i, p), *i))
                .map(|(_, p)| p.device.clone())
        } else {
            // First device with the largest shortfall.
            ranked
                .max_by_key(|(i, p)| (weight(*i, p), std::cmp::Reverse(*i)))
                .map(|(_, p)| p.device.clone())
        };
        Ok(Probe {
            candidate,
            devices,
            fits,
            binding,
        })
    }
}
