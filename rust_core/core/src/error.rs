//! Errors say what was wrong and the numbers involved.

use crate::units::fmt_bytes;
use std::fmt;

/// Everything the planner can refuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// An input that cannot describe a device or a search (the text names it and its value).
    Config(String),
    /// Even the floor context does not fit; `detail` lists what the device needs, when known.
    BelowFloor {
        floor: u64,
        device: String,
        shortfall: u64,
        detail: String,
    },
    /// A report that does not belong to the search's current step.
    Protocol(String),
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::Config(msg) | PlanError::Protocol(msg) => f.write_str(msg),
            PlanError::BelowFloor { floor, device, shortfall, detail } => write!(
                f,
                "context {floor} is the floor and still does not fit: device '{device}' needs {} more{detail}",
                fmt_bytes(*shortfall)
            ),
        }
    }
}

impl std::error::Error for PlanError {}

/// Everything the prefix store can refuse; the store is unchanged after any of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// A store setting that cannot work.
    Config(String),
    /// Entries live only at restore points: positive multiples of the spacing.
    NotRestorePoint {
        len: usize,
        spacing: usize,
    },
    /// Handles are chosen by the caller and must be unique among live entries.
    DuplicateHandle(u64),
    /// These exact tokens already have an entry.
    AlreadyStored {
        len: usize,
        handle: u64,
    },
    /// The entry would not fit even in an empty tier.
    TooLarge {
        tier: &'static str,
        bytes: u64,
        limit: u64,
    },
    /// The entry would fit only by evicting pinned entries, which is never done.
    Full {
        tier: &'static str,
        bytes: u64,
        limit: u64,
        used: u64,
        pinned: u64,
    },
    UnknownHandle(u64),
    NotPinned(u64),
    /// A pinned entry is being restored and cannot be removed.
    Pinned {
        handle: u64,
        pins: u64,
    },
    /// check_integrity found a broken invariant (a bug in the store, never in the caller).
    Integrity(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Config(msg) => f.write_str(msg),
            StoreError::NotRestorePoint { len, spacing } => write!(
                f,
                "cannot store a prefix of {len} tokens: entries live only at restore points, \
                 positive multiples of the restore spacing {spacing}"
            ),
            StoreError::DuplicateHandle(h) => write!(f, "handle {h} is already in the store"),
            StoreError::AlreadyStored { len, handle } => {
                write!(
                    f,
                    "these {len} tokens already have an entry (handle {handle})"
                )
            }
            StoreError::TooLarge { tier, bytes, limit } => write!(
                f,
                "an entry of {} cannot be stored in the {tier} tier: its limit is {}",
                fmt_bytes(*bytes),
                fmt_bytes(*limit)
            ),
            StoreError::Full {
                tier,
                bytes,
                limit,
                used,
                pinned,
            } => write!(
                f,
                "an entry of {} does not fit in the {tier} tier: limit {}, used {}, of which {} \
                 is pinned and cannot be evicted; not stored",
                fmt_bytes(*bytes),
                fmt_bytes(*limit),
                fmt_bytes(*used),
                fmt_bytes(*pinned)
            ),
            StoreError::UnknownHandle(h) => write!(f, "no entry has handle {h}"),
            StoreError::NotPinned(h) => write!(f, "entry {h} is not pinned"),
            StoreError::Pinned { handle, pins } => {
                write!(
                    f,
                    "entry {handle} is pinned ({pins} pins) and cannot be removed"
                )
            }
            StoreError::Integrity(msg) => write!(f, "prefix store integrity: {msg}"),
        }
    }
}

impl std::error::Error for StoreError {}
