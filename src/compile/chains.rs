//! Op chains a backend may run as one kernel, found from the graph's
//! structure: the epilogues after a convolution or a linear layer
//! (`epilogue.rs`: bias, batch norm, residual Add, Relu, with the casts
//! around a batch norm in half precision) and the softmax chains below.
//!
//! Softmax chains: a softmax over the last axis, or its gradient, with the
//! ops that mixed precision and attention put right around it, which the
//! CUDA backend runs as one kernel (`exec/cuda/fuse.rs`; `softmax_mixed`,
//! `softmax_grad_mixed` in `reduce.cu`). They are found here, from the
//! graph's structure alone, because the memory plan keeps what such a
//! kernel reads alive until it runs (at the chain's last node): a read
//! tensor's last use moves to that node ([`keep_alive`]), so no output of
//! the chain is placed over it.
//!
//! Forward, in execution order: `[Scale] [Add mask] [Cast f32] Softmax
//! [Cast half]` (attention scores: scaled, masked, widened for the softmax,
//! its probabilities narrowed again for the next product), or, in f32,
//! `… Softmax IsNan Where(isnan, 0, y)` (PyTorch's scaled-dot-product
//! attention as exported to ONNX: a row masked throughout gives zeros, not
//! NaNs; the kernel writes the Where's output, each NaN replaced by 0). Gradient:
//! `[Cast f32] SoftmaxGrad [Cast half] [Scale]`. The kernel reads the first
//! op's input in its own dtype and writes the last op's output (and the
//! softmax's f32 output when something else reads it); the ops between
//! launch nothing. Each op's arithmetic and rounding stay as the unfused
//! kernels do them, so fusing changes no result.
//!
//! A chain fuses only when its nodes run at consecutive positions (but for
//! constants between the NaN cleanup's nodes, which launch nothing), every
//! intermediate it no longer writes has exactly one use (the chain's next
//! node) and is not fetchable, the softmax is over the last axis of a
//! tensor of rank ≤ 4, the mask broadcasts over leading axes only, and
//! the executor checks on its layout that every tensor the kernel writes
//! is disjoint from every ephemeral tensor it reads (which the plan's
//! lifetimes make so).

use std::collections::{HashMap, HashSet};

use lanes_adaptor::{DType, Graph, NodeId, Op, Outlet, TensorType};

mod epilogue;
pub use epilogue::{Act, Chain, Stage};

/// One softmax chain (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct SoftmaxChain {
    /// The Softmax or SoftmaxGrad node.
    pub softmax: NodeId,
    pub grad: bool,
    /// Forward: what the kernel reads as the chain's input. Gradient: dy.
    pub x: Outlet,
    /// Gradient: the softmax's output y (f32).
    pub y: Option<Outlet>,
    /// Forward: the Scale before the mask.
    pub scale: Option<f32>,
    /// Forward: the Add's other operand (x's dtype), and its row strides
    /// over the three leading axes (in rows of the last axis; 0 where it
    /// broadcasts).
    pub mask: Option<(Outlet, [i32; 3])>,
    /// The softmax node's own (f32) output is written: no half output, or
    /// (forward) something besides the Cast after it reads it.
    pub own: bool,
    /// The output written after the softmax's: the Cast to a half dtype
    /// after it (forward); the gradient's Cast to a half dtype and/or the
    /// Scale after that (an f32 Scale without a Cast).
    pub half: Option<Outlet>,
    /// Gradient: the Scale after it (and its Cast).
    pub post_scale: Option<f32>,
    /// Forward, f32: the output of `Where(IsNan(y), 0, y)` after the
    /// softmax, which the kernel writes (NaNs as 0) instead of y.
    pub nan_zero: Option<Outlet>,
    /// Every node of the chain in order; the kernel runs at the last one's
    /// position.
    pub nodes: Vec<NodeId>,
}

impl SoftmaxChain {
    pub fn last(&self) -> NodeId {
        // A chain holds its softmax node at least.
        self.nodes[self.nodes.len() - 1]
    }

    /// A name for profiles.
    pub fn name(&self) -> &'static str {
        if self.grad {
            "fused softmax_grad"
        } else {
            "fused softmax"
        }
    }

    /// What the kernel reads: the input (or dy), y, the mask.
    pub fn reads(&self) -> Vec<Outlet> {
        let mut r = vec![self.x];
        r.extend(self.y);
        r.extend(self.mask.map(|(m, _)| m));
        r
    }

    /// What the kernel writes.
    pub fn writes(&self) -> Vec<Outlet> {
        let mut w = Vec::new();
        if self.own {
            w.push(Outlet::new(self.softmax, 0));
        }
        w.extend(self.half);
        w.extend(self.nan_zero);
        w
    }
}

/// For each chain, the ephemeral tensors it reads and the position of its
/// last node: a read tensor must stay in memory until then. The softmax
/// chains, and the epilogue chains that span a cast (their tensors differ
/// in size, so the last output must not land partly over what they read;
/// an f32 chain's output may take its input's exact bytes).
pub(crate) fn keep_alive(
    graph: &Graph,
    order: &[NodeId],
    fetchable: &HashSet<Outlet>,
) -> Vec<(Outlet, NodeId)> {
    let m = Matcher::new(graph, order, fetchable);
    let softmax = m
        .softmax_chains()
        .into_iter()
        .flat_map(|c| c.reads().into_iter().map(move |r| (r, c.last())));
    let epilogues = m
        .epilogues()
        .into_iter()
        .filter(|c| m.spans_cast(c))
        .flat_map(|c| c.reads().into_iter().map(move |r| (r, c.last())));
    softmax.chain(epilogues).collect()
}

/// A graph run in an order, the uses of each output and the outputs a Run
/// may fetch: what a matcher of op chains asks (the softmax chains here,
/// the epilogues in `epilogue.rs`; `exec/cuda/fuse.rs` picks those its
/// layout allows).
pub(crate) struct Matcher<'a> {
    pub(crate) graph: &'a Graph,
    pub(crate) order: &'a [NodeId],
    pub(crate) fetchable: &'a HashSet<Outlet>,
    pub(crate) uses: HashMap<Outlet, usize>,
}

impl<'a> Matcher<'a> {
    pub(crate) fn new(
        graph: &'a Graph,
        order: &'a [NodeId],
        fetchable: &'a HashSet<Outlet>,
    ) -> Self {
        let mut uses: HashMap<Outlet, usize> = HashMap::new();
        for n in &graph.nodes {
            for &o in &n.inputs {
                *uses.entry(o).or_default() += 1;
            }
        }
        Matcher {
            graph,
            order,
            fetchable,
            uses,
        }
    }

    /// The softmax chains of the graph in its order; no node is in two.
    pub(crate) fn softmax_chains(&self) -> Vec<SoftmaxChain> {
        let mut used: HashSet<NodeId> = HashSet::new();
        let mut chains = Vec::new();
        for pos in 0..self.order.len() {
            if let Some(c) = self.softmax_at(pos, &used) {
                used.extend(c.nodes.iter().copied());
                chains.push(c);
            }
        }
        chains
    }

    pub(crate) fn ty(&self, o: Outlet) -> Option<&TensorType> {
        self.graph
            .nodes
            .get(o.node.index())?
            .outputs
            .get(o.slot as usize)
    }

    /// `o` is read by one node only and not fetchable.
    pub(crate) fn private(&self, o: Outlet) -> bool {
        self.uses.get(&o).copied() == Some(1) && !self.fetchable.contains(&o)
    }

    fn node_at(&self, pos: usize) -> Option<NodeId> {
        self.order.get(pos).copied()
    }

    /// The Cast to f32 at `pos` producing `o` from a half tensor (private).
    fn widening_cast(&self, pos: usize, o: Outlet) -> Option<Outlet> {
        let id = self.node_at(pos)?;
        let n = &self.graph.nodes[id.index()];
        let (Op::Cast { to: DType::F32 }, &[src]) = (&n.op, n.inputs.as_slice()) else {
            return None;
        };
        (o == Outlet::new(id, 0) && self.private(o) && self.ty(src)?.dtype.is_half()).then_some(src)
    }

    /// The Cast to a half dtype at `pos` reading `o`: its output.
    fn narrowing_cast(&self, pos: usize, o: Outlet) -> Option<Outlet> {
        let id = self.node_at(pos)?;
        let n = &self.graph.nodes[id.index()];
        match (&n.op, n.inputs.as_slice()) {
            (Op::Cast { to }, &[src]) if to.is_half() && src == o => Some(Outlet::new(id, 0)),
            _ => None,
        }
    }

    /// The softmax chain whose softmax (or gradient) runs at `pos`, if it
    /// has at least one op besides it.
    fn softmax_at(&self, pos: usize, taken: &HashSet<NodeId>) -> Option<SoftmaxChain> {
        let id = self.node_at(pos)?;
        let node = &self.graph.nodes[id.index()];
        let (grad, axis) = match node.op {
            Op::Softmax { axis } => (false, axis),
            Op::SoftmaxGrad { axis } => (true, axis),
            _ => return None,
        };
        let out = Outlet::new(id, 0);
        let ty = self.ty(out)?;
        let dims = ty.shape.dims();
        if ty.dtype != DType::F32 || dims.is_empty() || dims.len() > 4 || axis + 1 != dims.len() {
            return None;
        }
        let mut before: Vec<NodeId> = Vec::new();
        let mut after: Vec<NodeId> = Vec::new();
        let mut chain = SoftmaxChain {
            softmax: id,
            grad,
            x: *node.inputs.first()?,
            y: None,
            scale: None,
            mask: None,
            own: true,
            half: None,
            post_scale: None,
            nan_zero: None,
            nodes: Vec::new(),
        };
        if grad {
            let (&y, &dy) = (node.inputs.first()?, node.inputs.get(1)?);
            chain.y = Some(y);
            chain.x = dy;
            if let Some(src) = pos.checked_sub(1).and_then(|p| self.widening_cast(p, dy)) {
                before.push(dy.node);
                chain.x = src;
            }
            if self.private(out) {
                // [Cast half] [Scale] after it.
                let mut last = out;
                if let Some(h) = self.narrowing_cast(pos + 1, out) {
                    after.push(h.node);
                    chain.half = Some(h);
                    chain.own = false;
                    last = h;
                }
                if let Some(next) = self.node_at(pos + 1 + after.len()) {
                    let n = &self.graph.nodes[next.index()];
                    if let (Op::Scale(c), true) = (&n.op, n.inputs.as_slice() == [last]) {
                        if self.private(last) {
                            after.push(next);
                            chain.half = Some(Outlet::new(next, 0));
                            chain.post_scale = Some(*c);
                            chain.own = false;
                        }
                    }
                }
            }
        } else {
            let mut at = pos;
            let mut x = chain.x;
            if let Some(src) = at.checked_sub(1).and_then(|p| self.widening_cast(p, x)) {
                before.push(x.node);
                x = src;
                at -= 1;
            }
            // The mask Add, then the Scale before it.
            if let Some(p) = at.checked_sub(1).filter(|_| self.private(x)) {
                if let Some((a, m)) = self.mask_add(p, x, dims) {
                    before.push(x.node);
                    chain.mask = Some(m);
                    x = a;
                    at = p;
                }
            }
            if let Some(p) = at.checked_sub(1).filter(|_| self.private(x)) {
                let sid = self.node_at(p)?;
                let n = &self.graph.nodes[sid.index()];
                if let (Op::Scale(c), &[src], true) =
                    (&n.op, n.inputs.as_slice(), x == Outlet::new(sid, 0))
                {
                    before.push(sid);
                    chain.scale = Some(*c);
                    x = src;
                }
            }
            chain.x = x;
            if let Some(h) = self.narrowing_cast(pos + 1, out) {
                after.push(h.node);
                chain.half = Some(h);
                chain.own = !self.private(out);
            } else if let Some((isnan, w)) = self.nan_cleanup(pos, out, dims) {
                after.extend([isnan, w.node]);
                chain.nan_zero = Some(w);
                chain.own = false;
            }
        }
        if before.is_empty() && after.is_empty() {
            return None;
        }
        before.reverse();
        chain.nodes = before;
        chain.nodes.push(id);
        chain.nodes.extend(after);
        if chain.nodes.iter().any(|n| taken.contains(n)) {
            return None;
        }
        Some(chain)
    }

    /// The first node after position `pos` that is not a constant (which
    /// launches nothing and lives outside the arena), and its position.
    fn next_op(&self, pos: usize) -> Option<(usize, NodeId)> {
        (pos + 1..self.order.len())
            .map(|p| (p, self.order[p]))
            .find(|(_, id)| !matches!(self.graph.nodes[id.index()].op, Op::Constant(_)))
    }

    /// `IsNan(y)` and `Where(it, 0, y)` right after the softmax at `pos`
    /// (constants aside), `y` its output (of `dims`) read by those two alone
    /// and not fetchable, the IsNan's output private, the 0 a one-element
    /// f32 constant (+0.0): the IsNan node and the Where's output.
    fn nan_cleanup(&self, pos: usize, y: Outlet, dims: &[usize]) -> Option<(NodeId, Outlet)> {
        if self.uses.get(&y).copied() != Some(2) || self.fetchable.contains(&y) {
            return None;
        }
        let (npos, nid) = self.next_op(pos)?;
        let n = &self.graph.nodes[nid.index()];
        if !matches!(n.op, Op::IsNan) || n.inputs.as_slice() != [y] {
            return None;
        }
        let isnan = Outlet::new(nid, 0);
        let (_, wid) = self.next_op(npos)?;
        let w = &self.graph.nodes[wid.index()];
        let (Op::Where, &[c, zero, v]) = (&w.op, w.inputs.as_slice()) else {
            return None;
        };
        if c != isnan || v != y || !self.private(isnan) {
            return None;
        }
        let is_zero = match &self.graph.nodes.get(zero.node.index())?.op {
            Op::Constant(t) if t.dtype() == DType::F32 && t.numel() == 1 => {
                t.f32s().ok()?.first().map(|v| v.to_bits()) == Some(0)
            }
            _ => false,
        };
        let out = Outlet::new(wid, 0);
        let ty = self.ty(out)?;
        (is_zero && ty.dtype == DType::F32 && ty.shape.dims() == dims).then_some((nid, out))
    }

    /// The Add at `pos` producing `sum` (of `dims`, f32 or half): the
    /// operand of `sum`'s shape and the other one as a mask over leading
    /// axes, with its row strides.
    fn mask_add(
        &self,
        pos: usize,
        sum: Outlet,
        dims: &[usize],
    ) -> Option<(Outlet, (Outlet, [i32; 3]))> {
        let id = self.node_at(pos)?;
        let n = &self.graph.nodes[id.index()];
        let (Op::Add, &[a, b]) = (&n.op, n.inputs.as_slice()) else {
            return None;
        };
        if sum != Outlet::new(id, 0) {
            return None;
        }
        let dt = self.ty(sum)?.dtype;
        let (x, m) = if self.ty(a)?.shape.dims() == dims {
            (a, b)
        } else {
            (b, a)
        };
        let (xt, mt) = (self.ty(x)?, self.ty(m)?);
        if xt.shape.dims() != dims || xt.dtype != dt || mt.dtype != dt {
            return None;
        }
        Some((x, (m, mask_strides(mt.shape.dims(), dims)?)))
    }
}

/// Row strides of a mask of `mask` dims added to a tensor of `dims`
/// (rank ≤ 4, softmax over the last axis), over the three leading axes
/// padded in front with ones: `None` unless the mask's last axis is the
/// tensor's and each leading axis is the tensor's or 1.
fn mask_strides(mask: &[usize], dims: &[usize]) -> Option<[i32; 3]> {
    let r = dims.len();
    if mask.len() > r || mask.last() != dims.last() || r == 0 {
        return None;
    }
    let pad = |v: &[usize], n: usize| -> Vec<usize> {
        let mut p = vec![1; n.saturating_sub(v.len())];
        p.extend_from_slice(v);
        p
    };
    let lead = pad(&dims[..r - 1], 3);
    let mlead = pad(&mask[..mask.len().saturating_sub(1)], 3);
    let mut strides = [0i32; 3];
    let mut s: usize = 1;
    for k in (0..3).rev() {
        if mlead[k] == lead[k] {
            strides[k] = if lead[k] == 1 {
                0
            } else {
                i32::try_from(s).ok()?
            };
        } else if mlead[k] != 1 {
            return None;
        }
        s = s.checked_mul(mlead[k])?;
    }
    Some(strides)
}

#[cfg(test)]
mod tests {
    use super::mask_strides;

    #[test]
    fn a_causal_mask_broadcasts_over_heads() {
        // [8, 1, 512, 512] onto [8, 12, 512, 512]: rows of 512.
        assert_eq!(
            mask_strides(&[8, 1, 512, 512], &[8, 12, 512, 512]),
            Some([512, 0, 1])
        );
        // [1, 1, 512, 512]: the same mask for every batch element.
        assert_eq!(
            mask_strides(&[1, 1, 512, 512], &[8, 12, 512, 512]),
            Some([0, 0, 1])
        );
        // Of the tensor's own shape: every row its own.
        assert_eq!(mask_strides(&[2, 3, 4, 5], &[2, 3, 4, 5]), Some([12, 4, 1]));
        // Lower rank: padded in front.
        assert_eq!(mask_strides(&[4, 5], &[2, 3, 4, 5]), Some([0, 0, 1]));
        assert_eq!(mask_strides(&[3, 5], &[3, 5]), Some([0, 0, 1]));
        // Broadcast along the softmax's axis, or a leading axis that is
        // neither the tensor's nor 1: not a mask this kernel reads.
        assert_eq!(mask_strides(&[8, 12, 512, 1], &[8, 12, 512, 512]), None);
        assert_eq!(mask_strides(&[8, 2, 512, 512], &[8, 12, 512, 512]), None);
    }
}
