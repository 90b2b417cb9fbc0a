//! How a node files its children: by the hash of each child's first block, the rare child whose
//! hash is taken waiting in `overflow`. Every lookup is confirmed token by token.

use super::radix::{NodeId, Tree};
use std::collections::hash_map::Entry;

impl Tree {
    /// The child of `id` whose edge starts with `block`, confirmed token by token.
    pub(super) fn child(&self, id: NodeId, block: &[u32]) -> Option<NodeId> {
        let node = self.node(id);
        let hit = node.children.get(&self.hash(block)).copied();
        hit.into_iter()
            .chain(node.overflow.iter().copied())
            .find(|&c| self.first_block(c) == block)
    }

    pub(super) fn add_child(&mut self, parent: NodeId, child: NodeId) {
        let h = self.hash(self.first_block(child));
        let p = self.node_mut(parent);
        match p.children.entry(h) {
            Entry::Vacant(v) => {
                v.insert(child);
            }
            Entry::Occupied(_) => p.overflow.push(child),
        }
    }

    /// Puts `new` where `old` was filed under `parent`; both start with the same block.
    pub(super) fn replace_child(&mut self, parent: NodeId, old: NodeId, new: NodeId) {
        let h = self.hash(self.first_block(new));
        let p = self.node_mut(parent);
        if p.children.get(&h) == Some(&old) {
            p.children.insert(h, new);
        } else if let Some(slot) = p.overflow.iter_mut().find(|c| **c == old) {
            *slot = new;
        }
    }

    /// Unfiles `child`; an overflow child with the freed hash moves into the map.
    pub(super) fn remove_child(&mut self, parent: NodeId, child: NodeId) {
        let h = self.hash(self.first_block(child));
        let waiting = self
            .node(parent)
            .overflow
            .iter()
            .position(|&c| c != child && self.hash(self.first_block(c)) == h);
        let p = self.node_mut(parent);
        if p.children.get(&h) == Some(&child) {
            p.children.remove(&h);
            if let Some(i) = waiting {
                let moved = p.overflow.swap_remove(i);
                p.children.insert(h, moved);
            }
        } else {
            p.overflow.retain(|&c| c != child);
        }
    }
}
