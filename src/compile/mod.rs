//! The compile stage's memory planner: from a [`ValidGraph`] to a
//! [`MemoryPlan`] with the job's exact persistent bytes **P** and
//! ephemeral bytes **T**, and where every tensor lives.
//!
//! - **P**: variables (weights, optimizer state, running statistics) and
//!   constants, side by side, each aligned. They live across iterations.
//! - **T**: one arena for everything else an iteration touches — feeds,
//!   intermediate results, gradients, fetched results. Each tensor lives
//!   from its producer to its last consumer (see [`lifetime`] for the step
//!   model); offsets come from a best-fit assignment ([`arena`]). T is the
//!   arena's extent. A reshape of an ephemeral tensor is a *view*: it
//!   shares its input's bytes (one alias class, one block; see [`views`]),
//!   so executors copy nothing for it.
//!
//! The plan also reports the two numbers T is judged against:
//! `lower_bound` (the largest total of tensors live at one step; no arena
//! can be smaller) and `no_reuse` (every ephemeral tensor in its own
//! bytes), both counting an alias class once. [`verify`] re-checks a plan independently of how it was made.
//!
//! Which results a Run will fetch is not known when a graph is loaded;
//! [`plan`] assumes the graph's sinks (outputs nobody reads), and
//! [`plan_with_fetches`] takes an explicit set. Sizes are rounded up to
//! [`PlanOptions::alignment`] (256 bytes by default, the CUDA allocation
//! granule that keeps every tensor suitably aligned for vector loads).

pub mod arena;
pub mod cache;
pub mod chains;
mod lifetime;
mod views;

pub use arena::{ArenaViolation, Block, Strategy};

use lanes_adaptor::{NodeId, Outlet, ValidGraph};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::fmt;

/// Default alignment of every tensor in the plan, in bytes.
pub const DEFAULT_ALIGNMENT: u64 = 256;

/// Knobs of the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// Every offset and size is a multiple of this (a power of two).
    pub alignment: u64,
    /// A reshape of an ephemeral tensor shares its input's bytes (an alias
    /// class, see [`views`]) unless that would make T larger. Off: every
    /// reshape output has bytes of its own, as before views. Default: on,
    /// unless the environment variable `LANES_NO_VIEWS` is `1` (an A/B
    /// switch for measurements: the service's admission plan and both
    /// executors' plans come from the default, so they agree).
    pub views: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            alignment: DEFAULT_ALIGNMENT,
            views: std::env::var("LANES_NO_VIEWS").as_deref() != Ok("1"),
        }
    }
}

/// Why a graph could not be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("fetch `{key}` names no output of the graph")]
    UnknownFetch { key: String },
    #[error("node {node} `{name}`: an output's size in bytes does not fit in 64 bits")]
    TensorTooLarge { node: NodeId, name: String },
    #[error("the graph's total memory does not fit in 64 bits")]
    TotalOverflow,
    #[error("alignment {alignment} is not a power of two")]
    BadAlignment { alignment: u64 },
}

impl PlanError {
    /// Stable code for wire replies and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PlanError::UnknownFetch { .. } => "unknown_fetch",
            PlanError::TensorTooLarge { .. } => "tensor_too_large",
            PlanError::TotalOverflow => "plan_overflow",
            PlanError::BadAlignment { .. } => "bad_alignment",
        }
    }
}

/// Why a plan is unsound (see [`verify`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("ephemeral tensors {a:?} and {b:?} are live together at step {step} and share bytes")]
    Overlap { a: Outlet, b: Outlet, step: usize },
    #[error("ephemeral tensor {outlet:?} at offset {offset} ({size} bytes) ends past T = {arena}")]
    OutOfArena {
        outlet: Outlet,
        offset: u64,
        size: u64,
        arena: u64,
    },
    #[error("tensor at offset {offset} is not aligned to {alignment}")]
    Misaligned { offset: u64, alignment: u64 },
    #[error("persistent tensors of nodes {a} and {b} share bytes")]
    PersistentOverlap { a: NodeId, b: NodeId },
    #[error("persistent tensor of node {node} ends past P = {persistent}")]
    PersistentOutOfRange { node: NodeId, persistent: u64 },
    #[error("slot of {outlet:?} holds {bytes} bytes in {size}: too small, or not rounded to the alignment")]
    BadSize {
        outlet: Outlet,
        bytes: u64,
        size: u64,
    },
    #[error("{outlet:?} is recorded as a view of {root:?}, which is no root of the same offset and size")]
    BadView { outlet: Outlet, root: Outlet },
    #[error("recorded {what} is {recorded}, the tensors give {actual}")]
    Summary {
        what: &'static str,
        recorded: u64,
        actual: u64,
    },
}

/// Where one ephemeral tensor lives in the arena and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSlot {
    pub outlet: Outlet,
    /// Exact bytes of the tensor.
    pub bytes: u64,
    /// Bytes reserved: `bytes` rounded up to the alignment.
    pub size: u64,
    /// First step the tensor is live (see the module docs).
    pub first: usize,
    /// Last step the tensor is live, inclusive.
    pub last: usize,
    /// Offset from the start of the arena.
    pub offset: u64,
    /// For a reshape sharing its input's bytes (see [`views`]): the root
    /// of its alias class, whose offset, size and bytes it has. The class
    /// occupies its bytes from its first member's `first` to its last
    /// member's `last`.
    #[serde(default)]
    pub view_of: Option<Outlet>,
}

/// Where one persistent tensor (a variable or constant) lives in the
/// persistent region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistentSlot {
    pub node: NodeId,
    pub bytes: u64,
    pub size: u64,
    pub offset: u64,
}

/// A graph's memory: exact P and T, and every tensor's place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryPlan {
    pub alignment: u64,
    /// P: bytes of the persistent region.
    pub persistent: u64,
    /// T: bytes of the ephemeral arena (its peak extent).
    pub ephemeral: u64,
    /// Largest total of ephemeral slots live at one step.
    pub lower_bound: u64,
    /// Total of all ephemeral slots: the arena with no reuse at all.
    pub no_reuse: u64,
    /// Number of steps: nodes, plus one for handing back results.
    pub steps: usize,
    /// The assignment order that produced the offsets.
    pub strategy: Strategy,
    /// Outputs planned to live until the end of the iteration.
    pub fetched: Vec<Outlet>,
    pub tensors: Vec<TensorSlot>,
    pub persistent_slots: Vec<PersistentSlot>,
    #[serde(skip)]
    index: HashMap<Outlet, usize>,
}

impl MemoryPlan {
    /// The arena slot of an ephemeral output.
    pub fn slot(&self, outlet: Outlet) -> Option<&TensorSlot> {
        if self.index.is_empty() && !self.tensors.is_empty() {
            return self.tensors.iter().find(|t| t.outlet == outlet);
        }
        self.index.get(&outlet).map(|&i| &self.tensors[i])
    }
    /// The persistent slot of a variable or constant node.
    pub fn persistent_slot(&self, node: NodeId) -> Option<&PersistentSlot> {
        self.persistent_slots.iter().find(|s| s.node == node)
    }
    /// Number of ephemeral tensors that share their bytes with another
    /// (reshapes planned as views).
    pub fn views(&self) -> usize {
        self.tensors.iter().filter(|t| t.view_of.is_some()).count()
    }
    /// True when `outlet` is a view: its bytes are its class root's, and
    /// the reshape that produced it copies nothing.
    pub fn is_view(&self, outlet: Outlet) -> bool {
        self.slot(outlet).is_some_and(|t| t.view_of.is_some())
    }
    /// T over the lower bound (1.0 is optimal; 1.0 for an empty arena).
    pub fn ratio_to_lower_bound(&self) -> f64 {
        if self.lower_bound == 0 {
            1.0
        } else {
            self.ephemeral as f64 / self.lower_bound as f64
        }
    }
    /// True when a Run may fetch `outlet` without exceeding T: it is
    /// persistent, or planned to live until the end.
    pub fn covers_fetch(&self, outlet: Outlet) -> bool {
        self.persistent_slot(outlet.node).is_some() || self.fetched.contains(&outlet)
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "P = {} B, T = {} B (lower bound {} B, x{:.3}; no reuse {} B; {} tensors, {} views, {})",
            self.persistent,
            self.ephemeral,
            self.lower_bound,
            self.ratio_to_lower_bound(),
            self.no_reuse,
            self.tensors.len(),
            self.views(),
            self.strategy
        )
    }
}

/// The default fetch set: every ephemeral output that no node reads (the
/// graph's results: losses, predictions).
pub fn sinks(g: &ValidGraph) -> HashSet<Outlet> {
    lifetime::sinks(g)
}

/// Plans `g` with default options, fetching the graph's sinks.
pub fn plan(g: &ValidGraph) -> Result<MemoryPlan, PlanError> {
    let fetched = lifetime::sinks(g);
    plan_outlets(g, fetched, PlanOptions::default())
}

/// Plans `g` for Runs that fetch `fetches` (keys `name` or `name:slot`).
pub fn plan_with_fetches<S: AsRef<str>>(
    g: &ValidGraph,
    fetches: &[S],
    options: PlanOptions,
) -> Result<MemoryPlan, PlanError> {
    let mut set = HashSet::new();
    for key in fetches {
        let key = key.as_ref();
        let o = g
            .graph()
            .resolve(key)
            .ok_or_else(|| PlanError::UnknownFetch {
                key: key.to_string(),
            })?;
        set.insert(o);
    }
    plan_outlets(g, set, options)
}

fn align_up(bytes: u64, alignment: u64) -> Option<u64> {
    bytes
        .checked_add(alignment - 1)
        .map(|b| b & !(alignment - 1))
}

/// Plans `g` for Runs that fetch the outlets in `fetched`.
pub fn plan_outlets(
    g: &ValidGraph,
    fetched: HashSet<Outlet>,
    options: PlanOptions,
) -> Result<MemoryPlan, PlanError> {
    let alignment = options.alignment;
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(PlanError::BadAlignment { alignment });
    }
    let tensors = lifetime::collect(g, &fetched)?;

    let mut persistent = 0u64;
    let mut persistent_slots = Vec::with_capacity(tensors.persistent.len());
    for p in &tensors.persistent {
        let size = align_up(p.bytes, alignment).ok_or(PlanError::TotalOverflow)?;
        persistent_slots.push(PersistentSlot {
            node: p.node,
            bytes: p.bytes,
            size,
            offset: persistent,
        });
        persistent = persistent
            .checked_add(size)
            .ok_or(PlanError::TotalOverflow)?;
    }

    let mut sizes = Vec::with_capacity(tensors.ephemeral.len());
    for e in &tensors.ephemeral {
        sizes.push(align_up(e.bytes, alignment).ok_or(PlanError::TotalOverflow)?);
    }
    let placed = views::place_best(g, &tensors.ephemeral, &sizes, options.views)?;
    let slots: Vec<TensorSlot> = tensors
        .ephemeral
        .iter()
        .enumerate()
        .map(|(i, e)| TensorSlot {
            outlet: e.outlet,
            bytes: e.bytes,
            size: sizes[i],
            first: e.first,
            last: e.last,
            offset: placed.offsets[i],
            view_of: (placed.roots[i] != i).then(|| tensors.ephemeral[placed.roots[i]].outlet),
        })
        .collect();
    let index = slots
        .iter()
        .enumerate()
        .map(|(i, s)| (s.outlet, i))
        .collect();
    let index: HashMap<Outlet, usize> = index;
    let mut fetched: Vec<Outlet> = fetched
        .into_iter()
        .filter(|o| index.contains_key(o))
        .collect();
    fetched.sort();
    Ok(MemoryPlan {
        alignment,
        persistent,
        ephemeral: placed.size,
        lower_bound: placed.lower_bound,
        no_reuse: placed.no_reuse,
        steps: tensors.steps,
        strategy: placed.strategy,
        fetched,
        tensors: slots,
        persistent_slots,
        index,
    })
}

/// How many single-use elementwise producers [`same_offset_pairs`] walks
/// back through (a convolution, then batch norm, Add, Relu: three).
const CHAIN_DEPTH: usize = 3;

/// Pairs of ephemeral tensors (indices into `ephemeral`) that the arena
/// should start at one offset: the output of an elementwise op (Relu and
/// the other unary maps, Add/Sub/Mul/Div of same-shape operands, batch
/// norm) and an earlier tensor of its chain of single-use elementwise
/// producers, nearest first, of at least its size and dead before it is
/// written. So conv → batch norm → Relu leaves the Relu's output exactly
/// over the convolution's (the batch norm's output lies apart from both),
/// which is the layout under which the CUDA backend may fuse the chain
/// into one kernel (`exec::cuda::fuse`). The pairs are only a preference:
/// lifetimes, and so every guarantee of the plan, stay as they are.
pub(crate) fn same_offset_pairs(
    g: &ValidGraph,
    ephemeral: &[lifetime::Ephemeral],
) -> Vec<(usize, usize)> {
    use lanes_adaptor::Op;
    let graph = g.graph();
    let index: HashMap<Outlet, usize> = ephemeral
        .iter()
        .enumerate()
        .map(|(i, e)| (e.outlet, i))
        .collect();
    let mut uses: HashMap<Outlet, usize> = HashMap::new();
    for n in &graph.nodes {
        for &o in &n.inputs {
            *uses.entry(o).or_default() += 1;
        }
    }
    // The operands of `id` that its output is computed elementwise from.
    let operands = |id: NodeId| -> Vec<Outlet> {
        let node = &graph.nodes[id.index()];
        let Some(out) = node.outputs.first() else {
            return Vec::new();
        };
        if node.outputs.len() != 1 {
            return Vec::new();
        }
        let same = |o: &&Outlet| {
            graph
                .nodes
                .get(o.node.index())
                .and_then(|n| n.outputs.get(o.slot as usize))
                == Some(out)
        };
        match node.op {
            Op::Relu
            | Op::HardSigmoid
            | Op::HardSwish
            | Op::Gelu
            | Op::Sigmoid
            | Op::Tanh
            | Op::Exp
            | Op::Log
            | Op::Sqrt
            | Op::Scale(_)
            | Op::BatchNorm { .. } => node
                .inputs
                .first()
                .filter(same)
                .copied()
                .into_iter()
                .collect(),
            Op::Add | Op::Sub | Op::Mul | Op::Div => {
                node.inputs.iter().filter(same).copied().collect()
            }
            _ => Vec::new(),
        }
    };
    let mut pairs = Vec::new();
    for &id in g.order() {
        let Some(&me) = index.get(&Outlet::new(id, 0)) else {
            continue;
        };
        let mine = &ephemeral[me];
        let mut frontier = operands(id);
        for _ in 0..CHAIN_DEPTH {
            let mut next = Vec::new();
            for o in frontier {
                let Some(&k) = index.get(&o) else { continue };
                let e = &ephemeral[k];
                if e.last < mine.first && e.bytes >= mine.bytes {
                    pairs.push((me, k));
                }
                if uses.get(&o) == Some(&1) {
                    next.extend(operands(o.node));
                }
            }
            frontier = next;
        }
    }
    pairs
}

/// Checks a plan independently of how it was made: every ephemeral slot is
/// aligned, large enough, inside T, and shares no byte with another slot
/// live at the same step, except the members of one alias class (a view
/// has its root's offset, size and bytes; the class is live from its
/// first member's first step to its last member's last, and shares no
/// byte with any other tensor then); persistent slots are disjoint and
/// inside P; and the recorded lower bound and no-reuse totals match the
/// slots, each class counted once.
pub fn verify(plan: &MemoryPlan) -> Result<(), VerifyError> {
    let a = plan.alignment.max(1);
    for t in &plan.tensors {
        if t.size < t.bytes || t.size % a != 0 {
            return Err(VerifyError::BadSize {
                outlet: t.outlet,
                bytes: t.bytes,
                size: t.size,
            });
        }
    }
    // One block per alias class (a tensor alone is a class of one): its
    // root's offset and size, live over its members' lifetimes.
    let mut class = vec![usize::MAX; plan.tensors.len()];
    let mut blocks: Vec<Block> = Vec::new();
    let mut offsets: Vec<u64> = Vec::new();
    let mut root_of: Vec<usize> = Vec::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        if t.view_of.is_none() {
            class[i] = blocks.len();
            blocks.push(Block {
                size: t.size,
                first: t.first,
                last: t.last,
            });
            offsets.push(t.offset);
            root_of.push(i);
        }
    }
    let position: HashMap<Outlet, usize> = plan
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.outlet, i))
        .collect();
    for t in &plan.tensors {
        let Some(root) = t.view_of else { continue };
        let bad = || VerifyError::BadView {
            outlet: t.outlet,
            root,
        };
        let k = *position.get(&root).ok_or_else(bad)?;
        let r = &plan.tensors[k];
        if r.view_of.is_some() || (r.offset, r.size, r.bytes) != (t.offset, t.size, t.bytes) {
            return Err(bad());
        }
        let b = &mut blocks[class[k]];
        b.first = b.first.min(t.first);
        b.last = b.last.max(t.last);
    }
    let outlet = |block: usize| plan.tensors[root_of[block]].outlet;
    arena::check(&blocks, &offsets, plan.ephemeral, a).map_err(|v| match v {
        ArenaViolation::Overlap { a, b, step } => VerifyError::Overlap {
            a: outlet(a),
            b: outlet(b),
            step,
        },
        ArenaViolation::OutOfArena {
            block,
            offset,
            size,
            arena,
        } => VerifyError::OutOfArena {
            outlet: outlet(block),
            offset,
            size,
            arena,
        },
        ArenaViolation::Misaligned {
            offset, alignment, ..
        } => VerifyError::Misaligned { offset, alignment },
    })?;
    let mut ps: Vec<&PersistentSlot> = plan.persistent_slots.iter().collect();
    ps.sort_by_key(|s| s.offset);
    for s in &ps {
        if s.offset % a != 0 {
            return Err(VerifyError::Misaligned {
                offset: s.offset,
                alignment: a,
            });
        }
        if s.size < s.bytes || s.offset.saturating_add(s.size) > plan.persistent {
            return Err(VerifyError::PersistentOutOfRange {
                node: s.node,
                persistent: plan.persistent,
            });
        }
    }
    for w in ps.windows(2) {
        if w[0].offset + w[0].size > w[1].offset {
            return Err(VerifyError::PersistentOverlap {
                a: w[0].node,
                b: w[1].node,
            });
        }
    }
    let lb = arena::lower_bound(&blocks);
    if lb != plan.lower_bound {
        return Err(VerifyError::Summary {
            what: "lower bound",
            recorded: plan.lower_bound,
            actual: lb,
        });
    }
    let total: u64 = blocks.iter().map(|b| b.size).fold(0, u64::saturating_add);
    if total != plan.no_reuse {
        return Err(VerifyError::Summary {
            what: "no-reuse total",
            recorded: plan.no_reuse,
            actual: total,
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
