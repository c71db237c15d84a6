//! Epilogue fusion: chains of per-channel elementwise ops after a
//! convolution (its bias, inference batch norm, a residual Add, Relu) run
//! as one kernel at the position of the chain's last node instead of one
//! kernel each; so does a linear layer's bias Add followed by Gelu or Relu.
//!
//! [`find_chains`] is a pure function of the graph, the execution order,
//! the fetchable outputs and the arena layout, so that when a chain may
//! fuse is decided (and tested) without a GPU. A chain fuses only when:
//!
//! - its nodes run at consecutive positions of the order (nothing runs
//!   between them, so every tensor the kernel reads is still in its slot
//!   when it runs at the last node's position);
//! - every intermediate (the convolution's output when its bias moves into
//!   the kernel, a BatchNorm's or an Add's output) has exactly one use, the
//!   chain's next node, and is not fetchable (it is never written);
//! - all tensors are f32 of one shape (an Add's operands alike: no
//!   broadcasting), channels on axis 1; except a row bias, a vector along
//!   the last axis;
//! - the last node's output slot is disjoint from every ephemeral tensor
//!   the kernel reads, or starts at the same byte (each thread reads an
//!   element before writing the same element).
//!
//! The kernel's arithmetic is the unfused kernels', in the same order, so
//! fusing changes no result.

use std::collections::{HashMap, HashSet};

use lanes_adaptor::{DType, Graph, NodeId, Op, Outlet};

use crate::compile::chains::Matcher;
pub use crate::compile::chains::SoftmaxChain;

/// One fused chain: y = relu?(bn?(x + bias?) + residual?), channels on
/// axis 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    /// What the kernel reads first.
    pub x: Outlet,
    /// A biased convolution whose bias add moves into the kernel (the
    /// convolution itself still runs, without its bias), and the bias.
    pub bias: Option<(NodeId, Outlet)>,
    /// Inference batch norm: gamma, beta, mean, var, eps.
    pub bn: Option<([Outlet; 4], f32)>,
    /// The Add's other operand.
    pub residual: Option<Outlet>,
    pub relu: bool,
    /// Instead of the above: an Add of a vector along the last axis (a
    /// linear layer's bias) and then `act` (BERT's bias + GELU).
    pub row: Option<(Outlet, Act)>,
    /// The chain's nodes after the convolution, in order; the last one's
    /// output is the only tensor the kernel writes.
    pub nodes: Vec<NodeId>,
}

impl Chain {
    /// The node at whose position the kernel runs.
    pub fn last(&self) -> NodeId {
        // A chain has at least one node after the convolution.
        self.nodes[self.nodes.len() - 1]
    }

    /// A name for profiles: the fused ops.
    pub fn name(&self) -> &'static str {
        match self.row {
            Some((_, Act::Gelu)) => return "fused bias_row+gelu",
            Some((_, Act::Relu)) => return "fused bias_row+relu",
            None => {}
        }
        match (
            self.bias.is_some(),
            self.bn.is_some(),
            self.residual.is_some(),
            self.relu,
        ) {
            (true, true, true, true) => "fused bias+batch_norm+add+relu",
            (true, true, true, false) => "fused bias+batch_norm+add",
            (true, true, false, true) => "fused bias+batch_norm+relu",
            (true, true, false, false) => "fused bias+batch_norm",
            (true, false, true, true) => "fused bias+add+relu",
            (true, false, true, false) => "fused bias+add",
            (true, false, false, _) => "fused bias+relu",
            (false, true, true, true) => "fused batch_norm+add+relu",
            (false, true, true, false) => "fused batch_norm+add",
            (false, true, false, _) => "fused batch_norm+relu",
            (false, false, _, _) => "fused add+relu",
        }
    }

    /// How many ops the kernel does (at least 2 in a chain).
    fn stages(&self) -> usize {
        usize::from(self.bias.is_some())
            + usize::from(self.bn.is_some())
            + usize::from(self.residual.is_some())
            + usize::from(self.relu)
            + 2 * usize::from(self.row.is_some())
    }
}

/// The activation after a row bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    Relu,
    Gelu,
}

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

// The matcher (graph, order, uses, fetchable outputs) is the softmax
// chains' (`compile::chains`); the epilogues' rules are added here.
impl Matcher<'_> {
    /// `o` is f32 of `dims`.
    fn is_f32(&self, o: Outlet, dims: &[usize]) -> bool {
        self.ty(o)
            .is_some_and(|t| t.dtype == DType::F32 && t.shape.dims() == dims)
    }

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

    /// Every chain (at least two stages) starting at `pos`, shortest first.
    fn chains_at(&self, pos: usize) -> Vec<(Chain, usize)> {
        let g = self.graph;
        let id = self.order[pos];
        let node = &g.nodes[id.index()];
        let Some(out_ty) = node.outputs.first() else {
            return Vec::new();
        };
        let dims = out_ty.shape.dims();
        if node.outputs.len() != 1 || dims.len() < 2 || out_ty.dtype != DType::F32 {
            return Vec::new();
        }
        let out = Outlet::new(id, 0);
        // The head: a biased convolution, a batch norm or an Add.
        let mut chain = match (&node.op, node.inputs.as_slice()) {
            (Op::Conv2d(_), &[_, _, b]) if dims.len() == 4 && self.is_f32(b, &dims[1..2]) => {
                Chain {
                    x: out,
                    bias: Some((id, b)),
                    bn: None,
                    residual: None,
                    relu: false,
                    row: None,
                    nodes: Vec::new(),
                }
            }
            (Op::BatchNorm { eps }, &[x, ga, be, me, va])
                if self.bn_fits(x, [ga, be, me, va], dims) =>
            {
                Chain {
                    x,
                    bias: None,
                    bn: Some(([ga, be, me, va], *eps)),
                    residual: None,
                    relu: false,
                    row: None,
                    nodes: vec![id],
                }
            }
            (Op::Add, &[a, b]) if a != b && self.is_f32(a, dims) && self.is_f32(b, dims) => Chain {
                x: a,
                bias: None,
                bn: None,
                residual: Some(b),
                relu: false,
                row: None,
                nodes: vec![id],
            },
            (Op::Add, &[a, b]) if a != b => {
                let row = &dims[dims.len() - 1..];
                let (x, bias) = if self.is_f32(a, dims) && self.is_f32(b, row) {
                    (a, b)
                } else if self.is_f32(b, dims) && self.is_f32(a, row) {
                    (b, a)
                } else {
                    return Vec::new();
                };
                return self.row_chain_at(pos, x, bias, dims);
            }
            _ => return Vec::new(),
        };
        // The conv's output is read by the kernel (not an intermediate
        // that is skipped) but must still have the chain as its only user.
        let mut cur = out;
        let mut at = pos;
        let mut found = Vec::new();
        while let Some(&next_id) = self.order.get(at + 1) {
            if !self.private(cur) {
                break;
            }
            let next = &g.nodes[next_id.index()];
            if next.outputs.len() != 1 || !self.is_f32(Outlet::new(next_id, 0), dims) {
                break;
            }
            match (&next.op, next.inputs.as_slice()) {
                (Op::BatchNorm { eps }, &[x, ga, be, me, va])
                    if x == cur
                        && chain.bn.is_none()
                        && chain.residual.is_none()
                        && !chain.relu
                        && self.bn_fits(x, [ga, be, me, va], dims) =>
                {
                    chain.bn = Some(([ga, be, me, va], *eps));
                }
                (Op::Add, &[a, b])
                    if chain.residual.is_none()
                        && !chain.relu
                        && (a == cur) != (b == cur)
                        && self.is_f32(a, dims)
                        && self.is_f32(b, dims) =>
                {
                    chain.residual = Some(if a == cur { b } else { a });
                }
                (Op::Relu, &[x]) if x == cur && !chain.relu => chain.relu = true,
                _ => break,
            }
            chain.nodes.push(next_id);
            cur = Outlet::new(next_id, 0);
            at += 1;
            if chain.stages() >= 2 {
                found.push((chain.clone(), at));
            }
            if chain.relu {
                break;
            }
        }
        found
    }

    /// Add(x, bias along the last axis) at `pos`, then Relu or Gelu.
    fn row_chain_at(
        &self,
        pos: usize,
        x: Outlet,
        bias: Outlet,
        dims: &[usize],
    ) -> Vec<(Chain, usize)> {
        let g = self.graph;
        let id = self.order[pos];
        let cur = Outlet::new(id, 0);
        let Some(&next_id) = self.order.get(pos + 1) else {
            return Vec::new();
        };
        let next = &g.nodes[next_id.index()];
        if !self.private(cur)
            || next.inputs.as_slice() != [cur]
            || next.outputs.len() != 1
            || !self.is_f32(Outlet::new(next_id, 0), dims)
        {
            return Vec::new();
        }
        let act = match next.op {
            Op::Relu => Act::Relu,
            Op::Gelu => Act::Gelu,
            _ => return Vec::new(),
        };
        let chain = Chain {
            x,
            bias: None,
            bn: None,
            residual: None,
            relu: false,
            row: Some((bias, act)),
            nodes: vec![id, next_id],
        };
        vec![(chain, pos + 1)]
    }

    /// A batch norm over `x` ([N, C, …], f32) with per-channel vectors.
    fn bn_fits(&self, x: Outlet, params: [Outlet; 4], dims: &[usize]) -> bool {
        self.is_f32(x, dims) && params.iter().all(|&p| self.is_f32(p, &dims[1..2]))
    }
}

/// The last node's output slot is disjoint from every ephemeral tensor the
/// kernel reads, or starts where it starts (same shape: same bytes).
fn layout_allows(chain: &Chain, range: RangeOf<'_>) -> bool {
    let Some((lo, hi)) = range(Outlet::new(chain.last(), 0)) else {
        return false;
    };
    let mut reads = vec![chain.x];
    reads.extend(chain.residual);
    reads.extend(chain.bias.map(|(_, b)| b));
    reads.extend(chain.row.map(|(b, _)| b));
    if let Some((p, _)) = chain.bn {
        reads.extend(p);
    }
    reads.iter().all(|&o| match range(o) {
        None => true,
        Some((a, b)) => a == lo || b <= lo || a >= hi,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
