//! The store's public value types: tiers, entry copies, insert outcomes and stats.

/// Where a snapshot lives; each tier has its own byte limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Device,
    Host,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
        }
    }

    pub fn parse(name: &str) -> Option<Tier> {
        match name {
            "device" => Some(Tier::Device),
            "host" => Some(Tier::Host),
            _ => None,
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub handle: u64,
    pub tier: Tier,
    pub bytes: u64,
    pub last_use: u64,
    pub pins: u64,
}

/// A copy of one entry's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryInfo {
    pub handle: u64,
    /// Prefix length in tokens (a restore point).
    pub len: usize,
    pub tier: Tier,
    pub bytes: u64,
    /// The store's clock at the entry's last insert, match or pin (larger is more recent).
    pub last_use: u64,
    pub pins: u64,
}

/// Handles the caller must now free.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InsertOutcome {
    /// Least recently used entries dropped to make room, oldest first.
    pub evicted: Vec<u64>,
    /// The strict ancestor dropped because the insert asked to replace it.
    pub replaced: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub entries: usize,
    pub bytes: u64,
    pub device_bytes: u64,
    pub host_bytes: u64,
    pub pinned_entries: usize,
    pub pinned_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Tree nodes, the root included (entries plus branch points).
    pub nodes: usize,
}
