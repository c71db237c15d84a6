//! Which tensors of a graph are persistent and which are ephemeral, and the
//! lifetime of each ephemeral one in the execution order.
//!
//! Steps: the node at position `k` of [`ValidGraph::order`] runs at step
//! `k`; step `n` (one past the last node) is the hand-back of the Run's
//! results. An ephemeral tensor is live from the step of its producer (a
//! placeholder's from step 0: the feed is in memory before the iteration
//! starts) to the step of its last consumer, or to step `n` when the Run
//! fetches it. An output nobody reads still occupies its bytes at its
//! producer's step, since the kernel writes it. What a softmax chain or an
//! epilogue chain spanning a cast (`chains.rs`) reads lives to the chain's
//! last node, where a backend may run the chain as one kernel.
//!
//! Variables and constants are persistent: they live across iterations,
//! outside the arena.

use lanes_adaptor::{NodeId, Op, Outlet, ValidGraph};
use std::collections::HashSet;

use super::PlanError;

/// An ephemeral tensor before placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ephemeral {
    pub outlet: Outlet,
    pub bytes: u64,
    pub first: usize,
    pub last: usize,
}

/// A persistent tensor before placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Persistent {
    pub node: NodeId,
    pub bytes: u64,
}

/// Tensors of a graph, split by kind, with lifetimes for the ephemeral ones.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tensors {
    pub ephemeral: Vec<Ephemeral>,
    pub persistent: Vec<Persistent>,
    pub steps: usize,
}

/// Collects every output of `g`; `fetched` outlets live to the end.
pub(crate) fn collect(g: &ValidGraph, fetched: &HashSet<Outlet>) -> Result<Tensors, PlanError> {
    let graph = g.graph();
    let n = g.order().len();
    let mut step = vec![0usize; graph.nodes.len()];
    for (k, id) in g.order().iter().enumerate() {
        step[id.index()] = k;
    }
    let mut out = Tensors {
        steps: n + 1,
        ..Tensors::default()
    };
    for (i, node) in graph.nodes.iter().enumerate() {
        let id = NodeId(i as u32);
        let size = |slot: usize| -> Result<u64, PlanError> {
            node.outputs[slot]
                .checked_bytes()
                .and_then(|b| u64::try_from(b).ok())
                .ok_or_else(|| PlanError::TensorTooLarge {
                    node: id,
                    name: node.name.clone(),
                })
        };
        match &node.op {
            Op::Variable(_) | Op::Constant(_) => {
                out.persistent.push(Persistent {
                    node: id,
                    bytes: size(0)?,
                });
                continue;
            }
            _ => {}
        }
        let first = if matches!(node.op, Op::Placeholder(_)) {
            0
        } else {
            step[i]
        };
        for slot in 0..node.outputs.len() {
            let outlet = Outlet::new(id, slot as u32);
            let mut last = step[i];
            for &(consumer, k) in g.consumers(id) {
                let c = &graph.nodes[consumer.index()];
                if c.inputs.get(k).is_some_and(|o| o.slot as usize == slot) {
                    last = last.max(step[consumer.index()]);
                }
            }
            if fetched.contains(&outlet) {
                last = n;
            }
            out.ephemeral.push(Ephemeral {
                outlet,
                bytes: size(slot)?,
                first,
                last,
            });
        }
    }
    // What a fused chain reads stays until the chain's kernel runs.
    let keep = super::chains::keep_alive(graph, g.order(), fetched);
    if !keep.is_empty() {
        let at: std::collections::HashMap<Outlet, usize> = out
            .ephemeral
            .iter()
            .enumerate()
            .map(|(k, e)| (e.outlet, k))
            .collect();
        for (o, until) in keep {
            if let Some(&k) = at.get(&o) {
                let e = &mut out.ephemeral[k];
                e.last = e.last.max(step[until.index()]);
            }
        }
    }
    Ok(out)
}

/// The default fetch set: every ephemeral output that no node reads (the
/// graph's results: losses, predictions).
pub(crate) fn sinks(g: &ValidGraph) -> HashSet<Outlet> {
    let graph = g.graph();
    let mut read: HashSet<Outlet> = HashSet::new();
    for node in &graph.nodes {
        read.extend(node.inputs.iter().copied());
    }
    let mut out = HashSet::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        if node.op.is_source() {
            continue;
        }
        for slot in 0..node.outputs.len() {
            let o = Outlet::new(NodeId(i as u32), slot as u32);
            if !read.contains(&o) {
                out.insert(o);
            }
        }
    }
    out
}
