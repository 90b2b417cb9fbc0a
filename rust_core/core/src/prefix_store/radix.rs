//! A compressed radix tree over whole blocks of tokens, in an arena.
//!
//! Entries live only at restore points (multiples of the spacing), so the tree only ever branches
//! there: every edge is a run of whole blocks, and a walk visits at most `len / spacing` nodes
//! however many entries part inside a block. A child is keyed by a seeded hash of its first block
//! and confirmed by comparing tokens; the rare child whose hash is taken waits in `overflow`.
//! A node with no entry and fewer than two children is removed or merged at once.

use super::block_hash::{hash_block, random_seed};
use super::Entry;
use std::collections::HashMap;

pub(crate) type NodeId = usize;
pub(crate) const ROOT: NodeId = 0;

#[derive(Debug)]
pub(crate) struct Node {
    /// Whole blocks from the parent to this node (empty only at the root).
    pub edge: Vec<u32>,
    pub parent: NodeId,
    /// Tokens from the root to the end of `edge`.
    pub depth: usize,
    /// Keyed by the hash of each child's first block.
    pub children: HashMap<u64, NodeId>,
    /// Children whose first-block hash is already taken in `children` by another block.
    pub overflow: Vec<NodeId>,
    pub entry: Option<Entry>,
}

impl Node {
    fn new(edge: Vec<u32>, parent: NodeId, depth: usize) -> Node {
        Node {
            edge,
            parent,
            depth,
            children: HashMap::new(),
            overflow: Vec::new(),
            entry: None,
        }
    }

    pub fn child_count(&self) -> usize {
        self.children.len() + self.overflow.len()
    }

    pub fn child_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.children.values().chain(self.overflow.iter()).copied()
    }
}

#[derive(Debug)]
pub(crate) struct Tree {
    spacing: usize,
    seed: u64,
    nodes: Vec<Option<Node>>,
    free: Vec<NodeId>,
}

/// Tokens the two runs share, in whole blocks of `block`.
fn common_blocks(a: &[u32], b: &[u32], block: usize) -> usize {
    let n = a.len().min(b.len()) / block * block;
    let mut i = 0;
    while i < n && a[i..i + block] == b[i..i + block] {
        i += block;
    }
    i
}

#[cfg(test)]
pub(crate) const COLLIDING_SEED: u64 = 0x0C01_11DE;

impl Tree {
    pub fn new(spacing: usize) -> Self {
        Tree::with_seed(spacing, random_seed())
    }

    pub fn with_seed(spacing: usize, seed: u64) -> Self {
        Tree {
            spacing,
            seed,
            nodes: vec![Some(Node::new(Vec::new(), ROOT, 0))],
            free: Vec::new(),
        }
    }

    pub fn hash(&self, block: &[u32]) -> u64 {
        // Tests force collisions (two buckets in all) to exercise `overflow`.
        #[cfg(test)]
        if self.seed == COLLIDING_SEED {
            return u64::from(block.first().copied().unwrap_or(0) & 1);
        }
        hash_block(self.seed, block)
    }

    /// The first block of a node's edge (the key it is filed under).
    pub fn first_block(&self, id: NodeId) -> &[u32] {
        let edge = &self.node(id).edge;
        &edge[..self.spacing.min(edge.len())]
    }

    /// A live node. Ids come only from this tree, so a dead id is a bug in the store.
    pub fn node(&self, id: NodeId) -> &Node {
        match self.nodes.get(id) {
            Some(Some(n)) => n,
            _ => panic!("prefix store: node {id} is not live"),
        }
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        match self.nodes.get_mut(id) {
            Some(Some(n)) => n,
            _ => panic!("prefix store: node {id} is not live"),
        }
    }

    /// A node if it is live (integrity checks report a dead id instead of panicking).
    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id).and_then(Option::as_ref)
    }

    /// Live nodes, the root included.
    pub fn live(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    fn release(&mut self, id: NodeId) {
        self.nodes[id] = None;
        self.free.push(id);
    }

    /// The deepest node with an entry whose path is a prefix of `tokens[..max_len]`.
    pub fn longest(&self, tokens: &[u32], max_len: usize) -> Option<NodeId> {
        let sp = self.spacing;
        let tokens = &tokens[..max_len.min(tokens.len())];
        let (mut id, mut pos, mut best) = (ROOT, 0, None);
        loop {
            if self.node(id).entry.is_some() {
                best = Some(id);
            }
            if pos + sp > tokens.len() {
                break;
            }
            let Some(child) = self.child(id, &tokens[pos..pos + sp]) else {
                break;
            };
            let edge = &self.node(child).edge;
            let end = pos + edge.len();
            // The first block is already confirmed; entries sit only at node ends.
            if end > tokens.len() || tokens[pos + sp..end] != edge[sp..] {
                break;
            }
            pos = end;
            id = child;
        }
        best
    }

    /// The node whose path is exactly `tokens`, if one exists.
    pub fn find(&self, tokens: &[u32]) -> Option<NodeId> {
        let found = self.longest_node(tokens);
        (self.node(found).depth == tokens.len()).then_some(found)
    }

    /// The deepest node, entry or not, whose path is a prefix of `tokens`.
    fn longest_node(&self, tokens: &[u32]) -> NodeId {
        let sp = self.spacing;
        let (mut id, mut pos) = (ROOT, 0);
        while pos + sp <= tokens.len() {
            let Some(child) = self.child(id, &tokens[pos..pos + sp]) else {
                break;
            };
            let end = pos + self.node(child).edge.len();
            if end > tokens.len() || tokens[pos..end] != self.node(child).edge[..] {
                break;
            }
            pos = end;
            id = child;
        }
        id
    }

    /// The node whose path is exactly `tokens` (whole blocks), splitting an edge or adding a leaf.
    pub fn ensure(&mut self, tokens: &[u32]) -> NodeId {
        let sp = self.spacing;
        let (mut id, mut pos) = (ROOT, 0);
        while pos < tokens.len() {
            let Some(child) = self.child(id, &tokens[pos..pos + sp]) else {
                let leaf = self.alloc(Node::new(tokens[pos..].to_vec(), id, tokens.len()));
                self.add_child(id, leaf);
                return leaf;
            };
            let k = common_blocks(&self.node(child).edge, &tokens[pos..], sp);
            id = if k < self.node(child).edge.len() {
                self.split(child, k)
            } else {
                child
            };
            pos += k;
        }
        id
    }

    /// Cuts `child`'s edge after `k` tokens (whole blocks, 0 < k < edge length); returns the
    /// new middle node, filed where `child` was.
    fn split(&mut self, child: NodeId, k: usize) -> NodeId {
        let parent = self.node(child).parent;
        let head = self.node(child).edge[..k].to_vec();
        let depth = self.node(parent).depth + k;
        let mid = self.alloc(Node::new(head, parent, depth));
        self.replace_child(parent, child, mid);
        let c = self.node_mut(child);
        c.edge.drain(..k);
        c.parent = mid;
        self.add_child(mid, child);
        mid
    }

    /// After `id` lost its entry: removes entry-less leaves upward and merges a lone child into
    /// an entry-less parent, so only branches and entries remain.
    pub fn prune(&mut self, mut id: NodeId) {
        while id != ROOT {
            let node = self.node(id);
            if node.entry.is_some() {
                return;
            }
            let parent = node.parent;
            match node.child_count() {
                0 => {
                    self.remove_child(parent, id);
                    self.release(id);
                    id = parent;
                }
                1 => {
                    let Some(only) = node.child_ids().next() else {
                        return;
                    };
                    let mut edge = std::mem::take(&mut self.node_mut(id).edge);
                    edge.extend_from_slice(&self.node(only).edge);
                    let c = self.node_mut(only);
                    c.edge = edge;
                    c.parent = parent;
                    self.replace_child(parent, id, only);
                    self.release(id);
                    return;
                }
                _ => return,
            }
        }
    }
}
