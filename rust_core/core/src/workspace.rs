//! The floor chunk's workspace as a straight line in position.
//!
//! QSA scores grow with position, so the engine measures the floor chunk at a few positions and the
//! planner extends those measurements to any context. Memory is a worst-case contract, so the line
//! is raised until it covers every sample and never slopes down.

use crate::units::fmt_bytes;

/// `workspace(position) = intercept + slope * position`, in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkspaceFit {
    pub intercept: f64,
    pub slope: f64,
    /// How the line was obtained, for the report (the planner says it fitted a line).
    pub note: String,
}

impl WorkspaceFit {
    /// Fits `(position, bytes)` samples; no sample means the device needs no chunk workspace.
    pub fn from_samples(samples: &[(u64, u64)]) -> Self {
        let Some(&(first_pos, _)) = samples.first() else {
            return WorkspaceFit {
                intercept: 0.0,
                slope: 0.0,
                note: "no workspace measured: counted as 0".to_string(),
            };
        };
        let n = samples.len() as f64;
        let mean_x = samples.iter().map(|s| s.0 as f64).sum::<f64>() / n;
        let mean_y = samples.iter().map(|s| s.1 as f64).sum::<f64>() / n;
        let sxx: f64 = samples.iter().map(|s| (s.0 as f64 - mean_x).powi(2)).sum();
        let sxy: f64 = samples
            .iter()
            .map(|s| (s.0 as f64 - mean_x) * (s.1 as f64 - mean_y))
            .sum();
        let distinct = samples.iter().any(|s| s.0 != first_pos);
        let raw_slope = if distinct && sxx > 0.0 {
            sxy / sxx
        } else {
            0.0
        };
        // A workspace that seems to shrink with position is noise: never extrapolate it down.
        let slope = raw_slope.max(0.0);
        let intercept = samples
            .iter()
            .map(|s| s.1 as f64 - slope * s.0 as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        let lo = samples.iter().map(|s| s.0).min().unwrap_or(0);
        let hi = samples.iter().map(|s| s.0).max().unwrap_or(0);
        let line = format!(
            "{} + {}/position",
            fmt_bytes(intercept.max(0.0) as u64),
            fmt_bytes(slope.round() as u64)
        );
        let note = if !distinct {
            format!(
                "workspace fitted as a constant {line} from {} sample(s) at position {first_pos}: \
                 one position cannot show growth, measure at two",
                samples.len()
            )
        } else if raw_slope < 0.0 {
            format!(
                "workspace fitted linearly in position: {line} ({} samples at positions {lo}..{hi} \
                 fell with position, so the largest is used flat)",
                samples.len()
            )
        } else {
            format!(
                "workspace fitted linearly in position: {line} (least squares over {} samples at \
                 positions {lo}..{hi}, raised to cover every sample)",
                samples.len()
            )
        };
        WorkspaceFit {
            intercept,
            slope,
            note,
        }
    }

    /// Bytes at `position`, rounded up.
    pub fn at(&self, position: u64) -> u64 {
        let bytes = self.intercept + self.slope * position as f64;
        // `as` saturates, so a huge value stays huge (and never fits) instead of wrapping.
        bytes.max(0.0).ceil() as u64
    }
}
