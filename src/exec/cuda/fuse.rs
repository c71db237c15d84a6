//! Epilogue fusion: chains of per-channel elementwise ops after a
//! convolution (its bias, inference batch norm, a residual Add, Relu) run
//! as one kernel at the position of the chain's last node instead of one
//! kernel each; so does a linear layer's bias Add followed by Gelu or Relu.
//!
//! [`find_chains`] is a pure function of the graph, the execution order,
//! the fetchable outputs and the arena layout, so that when a chain may
//! fuse is decided (and tested) without a GPU. A chain fuses only when:
//!
//! - its nodes run at consecutive positions of the order, variables,
//!   constants and placeholders aside (nothing runs between them, so every
//!   tensor the kernel reads is still in its slot when it runs at the last
//!   node's position);
//! - every intermediate (the convolution's output when its bias moves into
//!   the kernel, a BatchNorm's or an Add's output) has exactly one use, the
//!   chain's next node, and is not fetchable (it is never written);
//! - all tensors have one shape (an Add's operands alike: no
//!   broadcasting), channels on axis 1, and are f32 or one half dtype
//!   (with casts between them, `compile::chains::epilogue`); except a row
//!   bias, a vector along the last axis (f32 only);
//! - the last node's output slot is disjoint from every ephemeral tensor
//!   the kernel reads, or is exactly its bytes (each thread reads an
//!   element before writing the same element). The plan keeps what a
//!   chain spanning a cast reads alive until its last node
//!   (`compile::chains::keep_alive`), so such a chain always fuses.
//!
//! The kernel's arithmetic is the unfused kernels', in the same order,
//! with each stage rounded to the dtype its result has unfused, so fusing
//! changes no result.

use std::collections::{HashMap, HashSet};

use lanes_adaptor::{Graph, NodeId, Outlet};

use crate::compile::chains::Matcher;
pub use crate::compile::chains::{Act, Chain, SoftmaxChain, Stage};

/// What one node does under fusion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Its own kernels, as without fusion.
    Plain,
    /// A convolution whose bias add moved into a chain: cuDNN only.
    ConvWithoutBias,
    /// Inside a chain before its last node: launches nothing.
    Skip,
    /// The last node of chain `k`: launches the fused kernel.
    Last(usize),
    /// The last node of softmax chain `k` (`softmax.rs`).
    Softmax(usize),
}

/// The chains of a program and each node's role.
#[derive(Debug, Clone, Default)]
pub struct Fusion {
    pub chains: Vec<Chain>,
    /// Softmax chains (`softmax.rs`), matched after the chains above on the
    /// nodes they left.
    pub softmax: Vec<SoftmaxChain>,
    roles: HashMap<NodeId, Role>,
}

impl Fusion {
    pub fn role(&self, id: NodeId) -> Role {
        self.roles.get(&id).copied().unwrap_or(Role::Plain)
    }

    /// Nodes that launch nothing of their own.
    pub fn skipped(&self) -> usize {
        self.roles.values().filter(|r| **r == Role::Skip).count()
    }
}

/// Byte range `[start, end)` of a tensor in the arena; `None` for tensors
/// the iteration never writes (variables, constants).
pub type RangeOf<'a> = &'a dyn Fn(Outlet) -> Option<(usize, usize)>;

/// Finds the chains of `graph` run in `order` that may fuse (see the
/// module docs), given the outputs a Run may fetch and where each tensor
/// lives.
pub fn find_chains(
    graph: &Graph,
    order: &[NodeId],
    fetchable: &HashSet<Outlet>,
    range: RangeOf<'_>,
) -> Fusion {
    let m = Matcher::new(graph, order, fetchable);
    let mut fusion = Fusion::default();
    let mut pos = 0;
    while pos < order.len() {
        match m.longest_at(pos, range) {
            Some((chain, end)) => {
                if let Some((conv, _)) = chain.bias {
                    fusion.roles.insert(conv, Role::ConvWithoutBias);
                }
                for &id in &chain.nodes[..chain.nodes.len() - 1] {
                    fusion.roles.insert(id, Role::Skip);
                }
                fusion
                    .roles
                    .insert(chain.last(), Role::Last(fusion.chains.len()));
                fusion.chains.push(chain);
                pos = end + 1;
            }
            None => pos += 1,
        }
    }
    // Softmax chains (`compile::chains`) on the nodes left, where the
    // layout keeps what they read apart from what they write (the plan's
    // lifetimes make it so).
    for c in m.softmax_chains() {
        let free = c.nodes.iter().all(|n| !fusion.roles.contains_key(n));
        if !free || !disjoint(&c, range) {
            continue;
        }
        for &n in &c.nodes[..c.nodes.len() - 1] {
            fusion.roles.insert(n, Role::Skip);
        }
        fusion
            .roles
            .insert(c.last(), Role::Softmax(fusion.softmax.len()));
        fusion.softmax.push(c);
    }
    fusion
}

/// Every tensor `c` writes is disjoint from every ephemeral tensor it
/// reads.
fn disjoint(c: &SoftmaxChain, range: RangeOf<'_>) -> bool {
    let reads: Vec<(usize, usize)> = c.reads().into_iter().filter_map(range).collect();
    c.writes().into_iter().all(|w| match range(w) {
        Some((lo, hi)) => reads.iter().all(|&(a, b)| b <= lo || a >= hi),
        None => false,
    })
}

// The longest chain the layout allows at a position: the structural
// matcher is `compile::chains`'.
impl Matcher<'_> {
    /// The longest chain starting at position `pos` whose layout allows
    /// fusing, and the position of its last node.
    fn longest_at(&self, pos: usize, range: RangeOf<'_>) -> Option<(Chain, usize)> {
        let mut candidates = self.chains_at(pos);
        while let Some((chain, end)) = candidates.pop() {
            if layout_allows(&chain, range) {
                return Some((chain, end));
            }
        }
        None
    }
}

/// Each tensor the kernel writes is disjoint from every ephemeral tensor
/// it reads, or is exactly its bytes (same start, same length: the same
/// element type, so each thread reads an element before writing it).
fn layout_allows(chain: &Chain, range: RangeOf<'_>) -> bool {
    let reads: Vec<Option<(usize, usize)>> = chain.reads().into_iter().map(range).collect();
    chain.writes().into_iter().all(|w| {
        let Some((lo, hi)) = range(w) else {
            return false;
        };
        reads.iter().all(|r| match *r {
            None => true,
            Some((a, b)) => (a == lo && b == hi) || b <= lo || a >= hi,
        })
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod half_tests;
