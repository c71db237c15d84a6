//! Views: a `Reshape` of an ephemeral tensor is the same bytes under
//! another shape, so the planner puts its output at the same offset as its
//! input and the executors skip the copy (an *alias class*).
//!
//! A class is a tensor and every reshape of it, reshapes of reshapes
//! included: one block of the arena, as large as each member (members have
//! equal bytes and dtype), live from the first member's producer to the
//! last use of any member. A reshape of a variable or constant is not a
//! view: persistent tensors are updated in place by optimizers, so a copy
//! keeps the value the reshape read. Nothing writes a class's bytes while
//! it is live but its root's producer: every other member's producer is a
//! skipped reshape, and an op that updates an input in place may only
//! update a variable (`Op::mutated_inputs`, checked by validation).
//!
//! [`place`] lays a graph's ephemeral tensors out with or without classes;
//! the plan records each member's class by its root (`TensorSlot::view_of`),
//! which `verify` checks.

use std::collections::HashMap;

use lanes_adaptor::{Op, Outlet, ValidGraph};

use super::arena::{self, Block, Strategy};
use super::lifetime::Ephemeral;
use super::PlanError;

/// For each ephemeral tensor (an index into `ephemeral`), the index of its
/// class's root: itself unless it is the output of a reshape whose input
/// is ephemeral, of the same dtype and bytes, in which case its input's
/// root.
pub(crate) fn roots(g: &ValidGraph, ephemeral: &[Ephemeral]) -> Vec<usize> {
    let graph = g.graph();
    let index: HashMap<Outlet, usize> = ephemeral
        .iter()
        .enumerate()
        .map(|(i, e)| (e.outlet, i))
        .collect();
    let mut root: Vec<usize> = (0..ephemeral.len()).collect();
    // In execution order: an input's root is final before its reshape's.
    for &id in g.order() {
        let node = &graph.nodes[id.index()];
        if !matches!(node.op, Op::Reshape { .. }) {
            continue;
        }
        let Some(&input) = node.inputs.first() else {
            continue;
        };
        let (Some(&me), Some(&src)) = (index.get(&Outlet::new(id, 0)), index.get(&input)) else {
            // A variable's or constant's reshape: a copy.
            continue;
        };
        let in_ty = graph
            .nodes
            .get(input.node.index())
            .and_then(|n| n.outputs.get(input.slot as usize));
        let same_dtype = in_ty.map(|t| t.dtype) == node.outputs.first().map(|t| t.dtype);
        if same_dtype && ephemeral[src].bytes == ephemeral[me].bytes {
            root[me] = root[src];
        }
    }
    root
}

/// The ephemeral tensors laid out: per tensor its offset and its class's
/// root (an index into the tensors), and the arena's numbers, each class
/// counted once.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    pub offsets: Vec<u64>,
    pub roots: Vec<usize>,
    pub size: u64,
    pub strategy: Strategy,
    pub lower_bound: u64,
    pub no_reuse: u64,
}

/// Places `ephemeral` (aligned sizes in `sizes`) with the classes that
/// `roots` gives (`i → i` everywhere: no views): one block per class, its
/// lifetime the union of its members'. The chains' same-offset
/// preferences (`same_offset_pairs`) are taken over the classes'
/// lifetimes.
pub(crate) fn place(
    g: &ValidGraph,
    ephemeral: &[Ephemeral],
    sizes: &[u64],
    roots: Vec<usize>,
) -> Result<Placed, PlanError> {
    let mut class_of_root = vec![usize::MAX; ephemeral.len()];
    let mut blocks: Vec<Block> = Vec::new();
    for (i, e) in ephemeral.iter().enumerate() {
        if roots[i] == i {
            class_of_root[i] = blocks.len();
            blocks.push(Block {
                size: sizes[i],
                first: e.first,
                last: e.last,
            });
        }
    }
    let class: Vec<usize> = roots.iter().map(|&r| class_of_root[r]).collect();
    for (i, e) in ephemeral.iter().enumerate() {
        let b = &mut blocks[class[i]];
        b.first = b.first.min(e.first);
        b.last = b.last.max(e.last);
    }
    let mut no_reuse = 0u64;
    for b in &blocks {
        no_reuse = no_reuse
            .checked_add(b.size)
            .ok_or(PlanError::TotalOverflow)?;
    }
    // The chains' preferences see each tensor live as long as its class.
    let widened: Vec<Ephemeral> = ephemeral
        .iter()
        .zip(&class)
        .map(|(e, &c)| Ephemeral {
            first: blocks[c].first,
            last: blocks[c].last,
            ..*e
        })
        .collect();
    let mut pairs: Vec<(usize, usize)> = super::same_offset_pairs(g, &widened)
        .into_iter()
        .map(|(a, b)| (class[a], class[b]))
        .filter(|(a, b)| a != b)
        .collect();
    pairs.dedup();
    let assignment = arena::assign_preferring(&blocks, &pairs);
    Ok(Placed {
        offsets: class.iter().map(|&c| assignment.offsets[c]).collect(),
        roots,
        size: assignment.size,
        strategy: assignment.strategy,
        lower_bound: arena::lower_bound(&blocks),
        no_reuse,
    })
}

/// Places `ephemeral` with views when `views` is set, keeping the layout
/// without them when that one is smaller: T never grows. The layout
/// without views is computed only when the one with them exceeds the
/// lower bound without them (no arena without views can be smaller).
pub(crate) fn place_best(
    g: &ValidGraph,
    ephemeral: &[Ephemeral],
    sizes: &[u64],
    views: bool,
) -> Result<Placed, PlanError> {
    let identity: Vec<usize> = (0..ephemeral.len()).collect();
    if !views {
        return place(g, ephemeral, sizes, identity);
    }
    let roots = roots(g, ephemeral);
    if roots.iter().enumerate().all(|(i, &r)| r == i) {
        return place(g, ephemeral, sizes, identity);
    }
    let with = place(g, ephemeral, sizes, roots)?;
    let apart: Vec<Block> = ephemeral
        .iter()
        .zip(sizes)
        .map(|(e, &size)| Block {
            size,
            first: e.first,
            last: e.last,
        })
        .collect();
    if with.size <= arena::lower_bound(&apart) {
        return Ok(with);
    }
    let without = place(g, ephemeral, sizes, identity)?;
    Ok(if without.size < with.size {
        without
    } else {
        with
    })
}
