//! The plan: the answer, the budget per device at that answer, and every probe that led there.

use crate::chunk_fit::ChunkFit;
use crate::context_fit::ContextFit;
use crate::planner::Planner;
use crate::probe::{Probe, Verdict};
use crate::units::{fmt_bytes, fmt_signed};

/// One device's budget at the plan's context and chunk, from the budget model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceReport {
    pub name: String,
    pub capacity: u64,
    pub headroom: u64,
    pub weights: u64,
    pub graphs: u64,
    /// Slot state plus every slot's context-sized caches.
    pub caches: u64,
    /// The chosen chunk's workspace at the last position.
    pub workspace: u64,
    /// One full snapshot per slot, when snapshots live on this device.
    pub snapshots: u64,
    /// Capacity less headroom less everything above; negative if the model disagrees with a fit.
    pub free: i64,
    pub snapshots_on_device: bool,
    /// How the floor chunk's workspace was fitted in position.
    pub workspace_fit: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub context: u64,
    /// Prompt chunk in rows.
    pub chunk: u64,
    /// The device that refused `context + step`; None when the trained context fits.
    pub binding: Option<String>,
    /// The device that refused one chunk step more; None when the maximum chunk fits.
    pub chunk_binding: Option<String>,
    pub probes: Vec<Probe>,
    pub chunk_probes: Vec<Probe>,
    pub devices: Vec<DeviceReport>,
    /// Plain sentences: how workspace was fitted, who binds, any disagreement.
    pub notes: Vec<String>,
}

impl Plan {
    pub(crate) fn build(
        planner: &Planner,
        cf: &ContextFit,
        ch: &ChunkFit,
        context: u64,
        chunk: u64,
    ) -> Plan {
        let mut notes = Vec::new();
        let devices: Vec<DeviceReport> = planner
            .devices()
            .iter()
            .zip(planner.breakdown(context, chunk))
            .map(|(d, b)| {
                let free = b.available as i128 - b.needed as i128;
                let fit = d.workspace_fit();
                notes.push(format!("{}: {}", d.name, fit.note));
                if free < 0 {
                    notes.push(format!(
                        "{}: the budget model is over by {} at this plan, though the probes fit: check its inputs",
                        d.name,
                        fmt_bytes(free.unsigned_abs().min(u64::MAX as u128) as u64)
                    ));
                }
                if d.snapshots_on_device() {
                    notes.push(format!(
                        "{}: snapshots live here; the floor chunk is reserved before them and a larger chunk \
                         only takes what they leave",
                        d.name
                    ));
                }
                DeviceReport {
                    name: d.name.clone(),
                    capacity: b.capacity,
                    headroom: b.headroom,
                    weights: b.weights,
                    graphs: b.graphs,
                    caches: b.caches,
                    workspace: b.workspace,
                    snapshots: b.snapshots,
                    free: free.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
                    snapshots_on_device: d.snapshots_on_device(),
                    workspace_fit: fit.note,
                }
            })
            .collect();
        let binding = cf.binding().map(str::to_string);
        notes.push(match &binding {
            Some(dev) => format!(
                "device '{dev}' binds: context {} does not fit there",
                context + cf.config().step
            ),
            None => format!("the trained context {context} fits on every device; no device binds"),
        });
        Plan {
            context,
            chunk,
            binding,
            chunk_binding: ch.binding().map(str::to_string),
            probes: cf.probes().to_vec(),
            chunk_probes: ch.probes().to_vec(),
            devices,
            notes,
        }
    }

    /// The whole budget as text tables, for `qwen4exp plan`.
    pub fn table(&self) -> String {
        let or_none = |b: &Option<String>| b.clone().unwrap_or_else(|| "none".into());
        let mut out = format!(
            "context {} (binding: {}), prompt chunk {} rows (binding: {})\n\n",
            self.context,
            or_none(&self.binding),
            self.chunk,
            or_none(&self.chunk_binding)
        );
        let mut rows = vec![[
            "device",
            "capacity",
            "headroom",
            "weights",
            "graphs",
            "caches",
            "chunk workspace",
            "snapshots",
            "free",
        ]
        .map(String::from)
        .to_vec()];
        for d in &self.devices {
            let mut row = vec![d.name.clone()];
            row.extend(
                [
                    d.capacity,
                    d.headroom,
                    d.weights,
                    d.graphs,
                    d.caches,
                    d.workspace,
                    d.snapshots,
                ]
                .map(fmt_bytes),
            );
            row.push(fmt_signed(d.free));
            rows.push(row);
        }
        out += &render(&rows);
        out += &format!("\nprobes, context search ({}):\n", self.probes.len());
        out += &render(&probe_rows("context", &self.probes));
        out += &format!("\nprobes, chunk search ({}):\n", self.chunk_probes.len());
        out += &render(&probe_rows("rows", &self.chunk_probes));
        out += "\nnotes:\n";
        for n in &self.notes {
            out += &format!("- {n}\n");
        }
        out
    }
}

/// One line per device per probe; the probe's binding device on its first line.
fn probe_rows(what: &str, probes: &[Probe]) -> Vec<Vec<String>> {
    let mut rows = vec![[
        what,
        "device",
        "needed",
        "available",
        "result",
        "spare/shortfall",
        "binding",
    ]
    .map(String::from)
    .to_vec()];
    let known = |b: Option<u64>| b.map(fmt_bytes).unwrap_or_else(|| "-".into());
    for p in probes {
        for (i, d) in p.devices.iter().enumerate() {
            let (result, margin) = match d.verdict {
                Verdict::Fit { spare } => ("fit", format!("spare {}", fmt_bytes(spare))),
                Verdict::Miss { shortfall } => ("miss", format!("short {}", fmt_bytes(shortfall))),
            };
            let first = i == 0;
            rows.push(vec![
                if first {
                    p.candidate.to_string()
                } else {
                    String::new()
                },
                d.device.clone(),
                known(d.needed),
                known(d.available),
                result.into(),
                margin,
                if first {
                    p.binding.clone().unwrap_or_default()
                } else {
                    String::new()
                },
            ]);
        }
    }
    rows
}

/// Left-aligned columns separated by two spaces.
fn render(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(s, w)| format!("{s:<w$}"))
            .collect();
        out += line.join("  ").trim_end();
        out.push('\n');
    }
    out
}
