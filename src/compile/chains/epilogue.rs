//! Epilogue chains: per-channel elementwise ops after a convolution (its
//! bias, inference batch norm, a residual Add, Relu), or a linear layer's
//! bias Add followed by Gelu or Relu, which the CUDA backend runs as one
//! kernel (`exec/cuda/fuse.rs`, `exec/cuda/epilogue.rs`). Found here from
//! the graph's structure; the backend then keeps those whose layout allows.
//!
//! In half precision the same chains span casts: a half tensor widened for
//! a batch norm (which takes f32 only) and the batch norm's output narrowed
//! again (`Conv(half) → Cast f32 → BatchNorm → Cast half → [Add half] →
//! [Relu]`, as a model captured in half has it), or an f32 tail narrowed
//! at its end (`Cast f32 → BatchNorm → [Add] → [Relu] → Cast half`, as the
//! `amp` pass writes it). The kernel loads the first tensor in its dtype,
//! computes in f32 and rounds after each stage to the dtype that stage's
//! result has in the op-by-op graph ([`Chain::rounding`]): a widening cast
//! is exact, a narrowing one rounds to nearest even, a half Add rounds its
//! f32 sum, a half Relu is exact. So fusing changes no result.
//!
//! A chain's nodes run at consecutive positions (variables, constants and
//! placeholders between them aside: they launch nothing); every intermediate it no
//! longer writes has exactly one use (the chain's next node) and is not
//! fetchable; all its tensors have one shape (channels on axis 1; no
//! broadcasting) and are f32 or one half dtype; a widening cast is followed
//! by its batch norm, a narrowing one follows an f32 stage. An f32 result
//! that other nodes read too (a residual block's output: the next block's
//! Add and, through a Cast, its convolutions) ends the chain written in f32
//! and, when the next node is that Cast, in half as well ([`Chain::also`]).

use lanes_adaptor::{DType, NodeId, Op, Outlet};

use super::Matcher;

/// One fused chain: y = relu?(bn?(x + bias?) + residual?), channels on
/// axis 1, each stage rounded as [`Chain::rounding`] says.
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
    /// The dtype each stage's result has in the op-by-op graph, indexed by
    /// [`Stage`]: its node's output dtype, or that of the narrowing Cast
    /// right after it. F32 for absent stages; all F32 in an f32 chain.
    pub rounding: [DType; 4],
    /// A narrowing Cast of the last stage's f32 result, which other nodes
    /// read too: the kernel writes that result and this, its half copy
    /// (the Cast is the chain's last node).
    pub also: Option<Outlet>,
    /// The chain's nodes after the convolution, in order (casts included);
    /// the kernel writes the last one's output ([`Chain::output`]) and
    /// [`Chain::also`].
    pub nodes: Vec<NodeId>,
}

/// A stage of a chain's arithmetic, in the kernel's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Bias = 0,
    Bn = 1,
    Add = 2,
    Relu = 3,
}

/// The activation after a row bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    Relu,
    Gelu,
}

impl Chain {
    fn new(x: Outlet) -> Self {
        Chain {
            x,
            bias: None,
            bn: None,
            residual: None,
            relu: false,
            row: None,
            rounding: [DType::F32; 4],
            also: None,
            nodes: Vec::new(),
        }
    }

    /// The node at whose position the kernel runs.
    pub fn last(&self) -> NodeId {
        // A chain has at least one node after the convolution.
        self.nodes[self.nodes.len() - 1]
    }

    /// The tensor the kernel writes the chain's result to: the last node's
    /// output, or with [`Chain::also`] the output of the node before it.
    pub fn output(&self) -> Outlet {
        let k = self.nodes.len() - 1 - usize::from(self.also.is_some());
        Outlet::new(self.nodes[k], 0)
    }

    /// Every tensor the kernel writes.
    pub fn writes(&self) -> Vec<Outlet> {
        let mut w = vec![self.output()];
        w.extend(self.also);
        w
    }

    /// The dtype stage `s`'s result is rounded to.
    pub fn rounds(&self, s: Stage) -> DType {
        self.rounding[s as usize]
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
            (true, false, false, true) => "fused bias+relu",
            (true, false, false, false) => "fused bias",
            (false, true, true, true) => "fused batch_norm+add+relu",
            (false, true, true, false) => "fused batch_norm+add",
            (false, true, false, true) => "fused batch_norm+relu",
            (false, true, false, false) => "fused batch_norm",
            (false, false, true, true) => "fused add+relu",
            (false, false, true, false) => "fused add",
            (false, false, false, _) => "fused relu",
        }
    }

    /// How many kernels the chain replaces (at least 2 in a chain): the
    /// bias add, and one per node (casts included).
    pub(crate) fn stages(&self) -> usize {
        usize::from(self.bias.is_some()) + self.nodes.len()
    }

    /// The tensors the kernel reads.
    pub fn reads(&self) -> Vec<Outlet> {
        let mut reads = vec![self.x];
        reads.extend(self.residual);
        reads.extend(self.bias.map(|(_, b)| b));
        reads.extend(self.row.map(|(b, _)| b));
        if let Some((p, _)) = self.bn {
            reads.extend(p);
        }
        reads
    }
}

/// The one half dtype of a chain: `d` is f32, or the chain's half dtype
/// (which `d` sets when it is the first half one seen).
fn one_half(half: &mut Option<DType>, d: DType) -> bool {
    match d {
        DType::F32 => true,
        d if d.is_half() => *half.get_or_insert(d) == d,
        _ => false,
    }
}

impl Matcher<'_> {
    /// `o` is of dtype `dt` and of `dims`.
    fn is(&self, o: Outlet, dt: DType, dims: &[usize]) -> bool {
        self.ty(o)
            .is_some_and(|t| t.dtype == dt && t.shape.dims() == dims)
    }

    /// `o` is f32 of `dims`.
    fn is_f32(&self, o: Outlet, dims: &[usize]) -> bool {
        self.is(o, DType::F32, dims)
    }

    /// The epilogue chains of the graph in its order, the longest at each
    /// position, walked as the backend walks them (a chain's nodes are in
    /// no later chain).
    pub(crate) fn epilogues(&self) -> Vec<Chain> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < self.order.len() {
            match self.chains_at(pos).pop() {
                Some((chain, end)) => {
                    out.push(chain);
                    pos = end + 1;
                }
                None => pos += 1,
            }
        }
        out
    }

    /// Whether one of `c`'s nodes is a Cast: its tensors differ in size, so
    /// what it reads is kept apart from what it writes ([`super::keep_alive`]).
    pub(crate) fn spans_cast(&self, c: &Chain) -> bool {
        c.nodes
            .iter()
            .any(|n| matches!(self.graph.nodes[n.index()].op, Op::Cast { .. }))
    }

    /// Every chain (at least two stages) starting at `pos`, shortest first,
    /// with the position of its last node.
    pub(crate) fn chains_at(&self, pos: usize) -> Vec<(Chain, usize)> {
        let g = self.graph;
        let id = self.order[pos];
        let node = &g.nodes[id.index()];
        let Some(out_ty) = node.outputs.first() else {
            return Vec::new();
        };
        let dims = out_ty.shape.dims();
        let dt = out_ty.dtype;
        let mut half = None;
        if node.outputs.len() != 1 || dims.len() < 2 || !one_half(&mut half, dt) {
            return Vec::new();
        }
        let out = Outlet::new(id, 0);
        let mut chain = Chain::new(out);
        // A widening Cast taken, its batch norm not yet.
        let mut widened = false;
        // The stage a narrowing Cast after it rounds.
        let mut last: Option<Stage> = None;
        // The head: a biased convolution, a widening cast before a batch
        // norm, a batch norm or an Add.
        match (&node.op, node.inputs.as_slice()) {
            (Op::Conv2d(_), &[_, _, b]) if dims.len() == 4 && self.is(b, dt, &dims[1..2]) => {
                chain.bias = Some((id, b));
                chain.rounding[Stage::Bias as usize] = dt;
                last = Some(Stage::Bias);
            }
            (Op::Cast { to: DType::F32 }, &[src])
                if self.ty(src).is_some_and(|t| {
                    t.dtype.is_half() && t.shape.dims() == dims && one_half(&mut half, t.dtype)
                }) =>
            {
                chain.x = src;
                chain.nodes.push(id);
                widened = true;
            }
            (Op::BatchNorm { eps }, &[x, ga, be, me, va])
                if self.bn_fits(x, [ga, be, me, va], dims) =>
            {
                chain.x = x;
                chain.bn = Some(([ga, be, me, va], *eps));
                chain.nodes.push(id);
                last = Some(Stage::Bn);
            }
            (Op::Add, &[a, b]) if a != b && self.is(a, dt, dims) && self.is(b, dt, dims) => {
                chain.x = a;
                chain.residual = Some(b);
                chain.rounding[Stage::Add as usize] = dt;
                chain.nodes.push(id);
                last = Some(Stage::Add);
            }
            (Op::Add, &[a, b]) if a != b && dt == DType::F32 => {
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
        }
        // The conv's output is read by the kernel (not an intermediate
        // that is skipped) but must still have the chain as its only user.
        let mut cur = out;
        let mut cur_dt = if widened { DType::F32 } else { dt };
        let mut at = pos;
        let mut found = Vec::new();
        while let Some(next_at) = self.next_runs(at) {
            let next_id = self.order[next_at];
            if !self.private(cur) {
                // Read elsewhere too: written, with its half copy when the
                // next node makes one.
                // (After a node of the chain: a convolution's own output is
                // not the chain's to write.)
                if let Some(h) = self.half_copy(next_at, cur, cur_dt, widened, &mut half) {
                    if last.is_some() && !chain.nodes.is_empty() {
                        chain.also = Some(h);
                        chain.nodes.push(next_id);
                        found.push((chain.clone(), next_at));
                    }
                }
                break;
            }
            let next = &g.nodes[next_id.index()];
            let Some(nty) = next.outputs.first() else {
                break;
            };
            let ndt = nty.dtype;
            if next.outputs.len() != 1 || nty.shape.dims() != dims || !one_half(&mut half, ndt) {
                break;
            }
            // Nothing after the batch norm's place yet.
            let open = chain.residual.is_none() && !chain.relu;
            match (&next.op, next.inputs.as_slice()) {
                (Op::BatchNorm { eps }, &[x, ga, be, me, va])
                    if x == cur
                        && chain.bn.is_none()
                        && open
                        && self.bn_fits(x, [ga, be, me, va], dims) =>
                {
                    chain.bn = Some(([ga, be, me, va], *eps));
                    widened = false;
                    last = Some(Stage::Bn);
                }
                // A widening cast is followed by its batch norm.
                _ if widened => break,
                (Op::Cast { to: DType::F32 }, &[x])
                    if x == cur && cur_dt.is_half() && chain.bn.is_none() && open =>
                {
                    widened = true;
                }
                (Op::Cast { to }, &[x]) if x == cur && to.is_half() && cur_dt == DType::F32 => {
                    let Some(s) = last else {
                        break;
                    };
                    chain.rounding[s as usize] = *to;
                }
                (Op::Add, &[a, b])
                    if open
                        && (a == cur) != (b == cur)
                        && ndt == cur_dt
                        && self.is(a, ndt, dims)
                        && self.is(b, ndt, dims) =>
                {
                    chain.residual = Some(if a == cur { b } else { a });
                    chain.rounding[Stage::Add as usize] = ndt;
                    last = Some(Stage::Add);
                }
                (Op::Relu, &[x]) if x == cur && !chain.relu => {
                    chain.relu = true;
                    chain.rounding[Stage::Relu as usize] = ndt;
                    last = Some(Stage::Relu);
                }
                _ => break,
            }
            chain.nodes.push(next_id);
            cur = Outlet::new(next_id, 0);
            cur_dt = ndt;
            at = next_at;
            if !widened && chain.stages() >= 2 {
                found.push((chain.clone(), at));
            }
        }
        found
    }

    /// The Cast at `at` narrowing `cur` (f32, no widening cast pending) to
    /// the chain's half dtype: its output.
    fn half_copy(
        &self,
        at: usize,
        cur: Outlet,
        cur_dt: DType,
        widened: bool,
        half: &mut Option<DType>,
    ) -> Option<Outlet> {
        let id = self.order[at];
        let n = &self.graph.nodes[id.index()];
        match (&n.op, n.inputs.as_slice()) {
            (Op::Cast { to }, &[x])
                if x == cur
                    && to.is_half()
                    && cur_dt == DType::F32
                    && !widened
                    && n.outputs.len() == 1
                    && one_half(half, *to) =>
            {
                Some(Outlet::new(id, 0))
            }
            _ => None,
        }
    }

    /// The position of the first node after `at` that runs: variables,
    /// constants and placeholders between two nodes of a chain launch
    /// nothing and write nothing during an iteration.
    fn next_runs(&self, at: usize) -> Option<usize> {
        (at + 1..self.order.len())
            .find(|&p| !self.graph.nodes[self.order[p].index()].op.is_source())
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
        let mut chain = Chain::new(x);
        chain.row = Some((bias, act));
        chain.nodes = vec![id, next_id];
        vec![(chain, pos + 1)]
    }

    /// A batch norm over `x` ([N, C, …], f32) with per-channel vectors.
    fn bn_fits(&self, x: Outlet, params: [Outlet; 4], dims: &[usize]) -> bool {
        self.is_f32(x, dims) && params.iter().all(|&p| self.is_f32(p, &dims[1..2]))
    }
}
