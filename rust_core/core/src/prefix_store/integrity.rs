//! check_integrity: every invariant the store relies on, checked from scratch (run it when idle).

use super::radix::ROOT;
use super::{PrefixStore, Tier};
use crate::error::StoreError;
use std::collections::BTreeSet;

fn fail<T>(msg: String) -> Result<T, StoreError> {
    Err(StoreError::Integrity(msg))
}

impl PrefixStore {
    pub fn check_integrity(&self) -> Result<(), StoreError> {
        let mut used = [0u64; 2];
        let mut pinned = [0u64; 2];
        let mut lru = [BTreeSet::new(), BTreeSet::new()];
        let mut entries = 0usize;
        let mut reached = 0usize;
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            reached += 1;
            if reached > self.tree.live() {
                return fail(format!(
                    "more nodes reachable than the {} live ones: a cycle",
                    self.tree.live()
                ));
            }
            let Some(node) = self.tree.get(id) else {
                return fail(format!("node {id} is reachable but dead"));
            };
            if id != ROOT {
                let Some(parent) = self.tree.get(node.parent) else {
                    return fail(format!("node {id} has a dead parent {}", node.parent));
                };
                if node.edge.is_empty() || node.edge.len() % self.spacing != 0 {
                    return fail(format!(
                        "node {id} has an edge of {} tokens, not whole blocks",
                        node.edge.len()
                    ));
                }
                if !parent.child_ids().any(|c| c == id) {
                    return fail(format!("node {id} is not among its parent's children"));
                }
                if node.depth != parent.depth + node.edge.len() {
                    return fail(format!(
                        "node {id} has depth {} but its path is longer or shorter",
                        node.depth
                    ));
                }
                if node.entry.is_none() && node.child_count() < 2 {
                    return fail(format!(
                        "node {id} has no entry and {} children",
                        node.child_count()
                    ));
                }
            } else if !node.edge.is_empty() || node.entry.is_some() {
                return fail("the root holds tokens or an entry".into());
            }
            for child in node.child_ids() {
                let Some(c) = self.tree.get(child) else {
                    return fail(format!("node {id} has a dead child {child}"));
                };
                if c.parent != id || c.edge.is_empty() {
                    return fail(format!(
                        "child {child} of node {id} names another parent or has no tokens"
                    ));
                }
                stack.push(child);
            }
            for (&h, &child) in &node.children {
                if self.tree.get(child).is_some()
                    && self.tree.hash(self.tree.first_block(child)) != h
                {
                    return fail(format!(
                        "child {child} of node {id} is filed under the wrong hash"
                    ));
                }
            }
            let firsts: BTreeSet<&[u32]> = node
                .child_ids()
                .filter(|&c| self.tree.get(c).is_some())
                .map(|c| self.tree.first_block(c))
                .collect();
            if firsts.len() != node.child_count() {
                return fail(format!(
                    "two children of node {id} start with the same block"
                ));
            }
            for &child in &node.overflow {
                let h = self
                    .tree
                    .get(child)
                    .map(|_| self.tree.hash(self.tree.first_block(child)));
                if h.is_none_or(|h| !node.children.contains_key(&h)) {
                    return fail(format!(
                        "child {child} of node {id} waits in overflow though its hash is free"
                    ));
                }
            }
            let Some(e) = &node.entry else { continue };
            entries += 1;
            if node.depth % self.spacing != 0 {
                return fail(format!(
                    "entry {} sits at {} tokens, not a restore point",
                    e.handle, node.depth
                ));
            }
            if node.depth == 0 || self.handles.get(&e.handle) != Some(&id) {
                return fail(format!("handle {} does not lead to its node", e.handle));
            }
            let t = e.tier.index();
            used[t] += e.bytes;
            if e.pins > 0 {
                pinned[t] += e.bytes;
            } else {
                lru[t].insert((e.last_use, e.handle));
            }
            if e.last_use > self.clock {
                return fail(format!(
                    "entry {} was used after the store's clock",
                    e.handle
                ));
            }
        }
        if reached != self.tree.live() {
            return fail(format!(
                "{} live nodes but {reached} reachable from the root",
                self.tree.live()
            ));
        }
        if entries != self.handles.len() {
            return fail(format!(
                "{entries} entries in the tree but {} handles",
                self.handles.len()
            ));
        }
        for tier in [Tier::Device, Tier::Host] {
            let (i, t) = (tier.index(), &self.tiers[tier.index()]);
            if t.used != used[i] || t.pinned != pinned[i] {
                return fail(format!(
                    "{} tier counts {} bytes ({} pinned) but its entries hold {} ({} pinned)",
                    tier.name(),
                    t.used,
                    t.pinned,
                    used[i],
                    pinned[i]
                ));
            }
            if t.used > t.limit {
                return fail(format!(
                    "{} tier holds {} bytes over its limit {}",
                    tier.name(),
                    t.used,
                    t.limit
                ));
            }
            if t.lru != lru[i] {
                return fail(format!(
                    "{} tier's eviction order does not list exactly its unpinned entries",
                    tier.name()
                ));
            }
        }
        Ok(())
    }
}
