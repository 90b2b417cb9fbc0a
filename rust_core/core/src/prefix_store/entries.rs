//! The store's bookkeeping around one entry: lookups, uses, pins and detaching.

use super::radix::NodeId;
use super::{Entry, EntryInfo, PrefixStore};
use crate::error::StoreError;

impl PrefixStore {
    pub(super) fn lookup(&self, handle: u64) -> Result<NodeId, StoreError> {
        self.handles
            .get(&handle)
            .copied()
            .ok_or(StoreError::UnknownHandle(handle))
    }

    /// The entry at a node known to hold one.
    pub(super) fn entry(&self, id: NodeId) -> &Entry {
        match &self.tree.node(id).entry {
            Some(e) => e,
            None => panic!("prefix store: node {id} has no entry"),
        }
    }

    pub(super) fn entry_mut(&mut self, id: NodeId) -> Option<&mut Entry> {
        self.tree.node_mut(id).entry.as_mut()
    }

    pub(super) fn info(&self, id: NodeId) -> EntryInfo {
        let e = self.entry(id);
        EntryInfo {
            handle: e.handle,
            len: self.tree.node(id).depth,
            tier: e.tier,
            bytes: e.bytes,
            last_use: e.last_use,
            pins: e.pins,
        }
    }

    /// Marks a use: the entry moves to the back of its tier's eviction order.
    pub(super) fn touch(&mut self, id: NodeId) {
        self.clock += 1;
        let clock = self.clock;
        let e = self.entry(id).clone();
        let t = &mut self.tiers[e.tier.index()];
        if e.pins == 0 && t.lru.remove(&(e.last_use, e.handle)) {
            t.lru.insert((clock, e.handle));
        }
        if let Some(e) = self.entry_mut(id) {
            e.last_use = clock;
        }
    }

    pub(super) fn pin_node(&mut self, id: NodeId) {
        self.touch(id);
        let e = self.entry(id).clone();
        if e.pins == 0 {
            let t = &mut self.tiers[e.tier.index()];
            t.lru.remove(&(e.last_use, e.handle));
            t.pinned += e.bytes;
        }
        if let Some(e) = self.entry_mut(id) {
            e.pins = e.pins.saturating_add(1);
        }
    }

    /// Takes an unpinned entry out of every index and prunes the tree behind it.
    pub(super) fn detach(&mut self, id: NodeId) -> Entry {
        let e = match self.tree.node_mut(id).entry.take() {
            Some(e) => e,
            None => panic!("prefix store: node {id} has no entry to detach"),
        };
        let t = &mut self.tiers[e.tier.index()];
        t.used -= e.bytes;
        t.lru.remove(&(e.last_use, e.handle));
        self.handles.remove(&e.handle);
        self.tree.prune(id);
        e
    }
}
