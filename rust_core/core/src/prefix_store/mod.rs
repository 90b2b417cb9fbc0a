//! PrefixStore: prefix snapshots at restore points, matched by longest prefix, evicted LRU.
//!
//! The caller owns the snapshots; the store owns the index. It hands back the handles it drops
//! (evicted or replaced) so the caller can free them, it never evicts a pinned entry, and it never
//! lets a tier pass its byte limit: an insert that cannot fit is refused and changes nothing.

mod block_hash;
mod children;
mod entries;
mod integrity;
mod radix;
#[cfg(test)]
mod tests;
mod types;

use crate::error::StoreError;
use radix::{NodeId, Tree};
use std::collections::{BTreeSet, HashMap};
pub(crate) use types::Entry;
pub use types::{EntryInfo, InsertOutcome, StoreStats, Tier};

#[derive(Debug, Default)]
struct TierState {
    limit: u64,
    used: u64,
    pinned: u64,
    /// Unpinned entries as (last_use, handle): the first is the next to evict.
    lru: BTreeSet<(u64, u64)>,
}

#[derive(Debug)]
pub struct PrefixStore {
    spacing: usize,
    tree: Tree,
    handles: HashMap<u64, NodeId>,
    tiers: [TierState; 2],
    clock: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl PrefixStore {
    /// `spacing`: tokens between restore points; limits in bytes per tier.
    pub fn new(spacing: usize, host_limit: u64, device_limit: u64) -> Result<Self, StoreError> {
        if spacing == 0 {
            return Err(StoreError::Config(
                "the restore spacing must be at least 1 token".into(),
            ));
        }
        let mut tiers = [TierState::default(), TierState::default()];
        tiers[Tier::Host.index()].limit = host_limit;
        tiers[Tier::Device.index()].limit = device_limit;
        Ok(PrefixStore {
            spacing,
            tree: Tree::new(spacing),
            handles: HashMap::new(),
            tiers,
            clock: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        })
    }

    pub fn spacing(&self) -> usize {
        self.spacing
    }

    pub fn limit(&self, tier: Tier) -> u64 {
        self.tiers[tier.index()].limit
    }

    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Stores `handle` for `tokens` (a restore point) in `tier`, evicting least recently used
    /// unpinned entries of that tier as needed. With `replace_ancestor`, the longest entry that is
    /// a strict prefix of `tokens` is dropped too, unless it is pinned (then it stays).
    pub fn insert(
        &mut self,
        tokens: &[u32],
        handle: u64,
        tier: Tier,
        bytes: u64,
        replace_ancestor: bool,
    ) -> Result<InsertOutcome, StoreError> {
        let len = tokens.len();
        if len == 0 || !len.is_multiple_of(self.spacing) {
            return Err(StoreError::NotRestorePoint {
                len,
                spacing: self.spacing,
            });
        }
        if self.handles.contains_key(&handle) {
            return Err(StoreError::DuplicateHandle(handle));
        }
        if let Some(e) = self
            .tree
            .find(tokens)
            .and_then(|id| self.tree.node(id).entry.as_ref())
        {
            return Err(StoreError::AlreadyStored {
                len,
                handle: e.handle,
            });
        }
        let t = &self.tiers[tier.index()];
        if bytes > t.limit {
            return Err(StoreError::TooLarge {
                tier: tier.name(),
                bytes,
                limit: t.limit,
            });
        }
        let ancestor = match replace_ancestor {
            true => self
                .tree
                .longest(tokens, len - 1)
                .filter(|&id| self.entry(id).pins == 0),
            false => None,
        };
        // Decide before changing anything: can unpinned entries of this tier make room?
        let freed = ancestor
            .map(|id| self.entry(id))
            .filter(|e| e.tier == tier)
            .map_or(0, |e| e.bytes);
        let must_free = (t.used - freed)
            .saturating_add(bytes)
            .saturating_sub(t.limit);
        if must_free > t.used - freed - t.pinned {
            return Err(StoreError::Full {
                tier: tier.name(),
                bytes,
                limit: t.limit,
                used: t.used,
                pinned: t.pinned,
            });
        }
        let mut outcome = InsertOutcome::default();
        if let Some(id) = ancestor {
            outcome.replaced = Some(self.detach(id).handle);
        }
        while self.tiers[tier.index()].used.saturating_add(bytes) > self.tiers[tier.index()].limit {
            let Some(&(_, victim)) = self.tiers[tier.index()].lru.first() else {
                break;
            };
            self.detach(self.handles[&victim]);
            self.evictions += 1;
            outcome.evicted.push(victim);
        }
        let id = self.tree.ensure(tokens);
        self.clock += 1;
        self.tree.node_mut(id).entry = Some(Entry {
            handle,
            tier,
            bytes,
            last_use: self.clock,
            pins: 0,
        });
        self.handles.insert(handle, id);
        let t = &mut self.tiers[tier.index()];
        t.used += bytes;
        t.lru.insert((self.clock, handle));
        Ok(outcome)
    }

    /// The longest entry that is a prefix of `tokens` (a hit refreshes its last use); `pin` pins it
    /// in the same step, so no other thread can evict it before the restore starts.
    pub fn match_prefix(&mut self, tokens: &[u32], pin: bool) -> Option<EntryInfo> {
        let Some(id) = self.tree.longest(tokens, tokens.len()) else {
            self.misses += 1;
            return None;
        };
        self.hits += 1;
        if pin {
            self.pin_node(id);
        } else {
            self.touch(id);
        }
        Some(self.info(id))
    }

    /// Pins an entry (counted: every pin needs an unpin); a pinned entry is never evicted.
    pub fn pin(&mut self, handle: u64) -> Result<EntryInfo, StoreError> {
        let id = self.lookup(handle)?;
        self.pin_node(id);
        Ok(self.info(id))
    }

    pub fn unpin(&mut self, handle: u64) -> Result<EntryInfo, StoreError> {
        let id = self.lookup(handle)?;
        let e = self.entry(id);
        if e.pins == 0 {
            return Err(StoreError::NotPinned(handle));
        }
        let (tier, bytes, last_use) = (e.tier, e.bytes, e.last_use);
        let pins = self.entry_mut(id).map_or(0, |e| {
            e.pins -= 1;
            e.pins
        });
        if pins == 0 {
            let t = &mut self.tiers[tier.index()];
            t.pinned -= bytes;
            t.lru.insert((last_use, handle));
        }
        Ok(self.info(id))
    }

    /// Drops an unpinned entry; the caller frees its snapshot.
    pub fn remove(&mut self, handle: u64) -> Result<EntryInfo, StoreError> {
        let id = self.lookup(handle)?;
        let pins = self.entry(id).pins;
        if pins > 0 {
            return Err(StoreError::Pinned { handle, pins });
        }
        let info = self.info(id);
        self.detach(id);
        Ok(info)
    }

    pub fn get(&self, handle: u64) -> Option<EntryInfo> {
        self.handles.get(&handle).map(|&id| self.info(id))
    }

    /// Changes a tier's limit, evicting least recently used unpinned entries down to it; refused
    /// (nothing changes) if pinned entries alone exceed it. Returns the evicted handles.
    pub fn set_limit(&mut self, tier: Tier, limit: u64) -> Result<Vec<u64>, StoreError> {
        let t = &self.tiers[tier.index()];
        if t.pinned > limit {
            return Err(StoreError::Full {
                tier: tier.name(),
                bytes: 0,
                limit,
                used: t.used,
                pinned: t.pinned,
            });
        }
        self.tiers[tier.index()].limit = limit;
        let mut evicted = Vec::new();
        while self.tiers[tier.index()].used > limit {
            let Some(&(_, victim)) = self.tiers[tier.index()].lru.first() else {
                break;
            };
            self.detach(self.handles[&victim]);
            self.evictions += 1;
            evicted.push(victim);
        }
        Ok(evicted)
    }

    pub fn stats(&self) -> StoreStats {
        let (dev, host) = (
            &self.tiers[Tier::Device.index()],
            &self.tiers[Tier::Host.index()],
        );
        let pinned_entries = self
            .handles
            .values()
            .filter(|&&id| self.entry(id).pins > 0)
            .count();
        StoreStats {
            entries: self.handles.len(),
            bytes: dev.used + host.used,
            device_bytes: dev.used,
            host_bytes: host.used,
            pinned_entries,
            pinned_bytes: dev.pinned + host.pinned,
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            nodes: self.tree.live(),
        }
    }
}
