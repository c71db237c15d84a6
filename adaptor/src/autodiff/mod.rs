//! Reverse-mode automatic differentiation on the graph IR.
//!
//! [`gradients`] appends to a [`GraphBuilder`] the nodes that compute the
//! gradient of a scalar loss with respect to chosen outlets (usually the
//! trainable variables). It walks the forward nodes that lie between those
//! outlets and the loss in reverse topological order, applies each op's
//! backward rule, undoes numpy broadcasting with `SumTo`, and sums the
//! contributions of outlets read by several consumers.
//!
//! Inputs that are never differentiated: integer tensors (labels, indices),
//! the running statistics of `BatchNorm`/`BatchNormTrain` (frozen or updated
//! in place, not trained), placeholders and constants (unless asked for).
//! An op with no backward rule (the `*Grad` ops, in-place updates) on the
//! path from a variable to the loss is a [`AutodiffError::NoGradient`] that
//! names the node and op.

use crate::graph::{GraphBuilder, GraphError, Node, NodeId, Op, Outlet};
use crate::tensor::{DType, Tensor, TensorType};
use std::collections::HashMap;

/// Why gradients could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AutodiffError {
    #[error("loss `{name}` must be a one-element f32 tensor, got {ty}")]
    LossNotScalar { name: String, ty: TensorType },
    #[error("outlet {node}:{slot} does not exist in the graph")]
    UnknownOutlet { node: NodeId, slot: u32 },
    #[error("node {node} `{name}` ({op}) has no gradient rule (for output {slot})")]
    NoGradient {
        node: NodeId,
        name: String,
        op: &'static str,
        slot: u32,
    },
    #[error("`{name}` ({op}) cannot be differentiated with respect to: {reason}")]
    NotDifferentiable {
        name: String,
        op: &'static str,
        reason: String,
    },
    #[error("building the backward graph failed: {0}")]
    Graph(#[from] GraphError),
}

/// Whether input `k` of `op` carries a gradient (before looking at dtypes).
fn differentiable_input(op: &Op, k: usize) -> bool {
    match op {
        // Running statistics are frozen (inference form) or updated in place.
        Op::BatchNorm { .. } | Op::BatchNormTrain { .. } => k < 3,
        Op::Embedding => k == 0,
        Op::CrossEntropy => k == 0,
        Op::DropoutMask { .. } => false,
        // The condition is a 0/1 mask.
        Op::Where => k > 0,
        _ => true,
    }
}

/// Forward nodes reachable backwards from `loss`, in topological order.
fn ancestors_in_order(nodes: &[Node], loss: NodeId) -> Vec<NodeId> {
    let n = nodes.len();
    let mut state = vec![0u8; n]; // 0 new, 1 on stack, 2 done
    let mut order = Vec::new();
    let mut stack: Vec<(NodeId, usize)> = vec![(loss, 0)];
    state[loss.index()] = 1;
    while let Some((id, k)) = stack.pop() {
        let node = &nodes[id.index()];
        if let Some(inp) = node.inputs.get(k) {
            stack.push((id, k + 1));
            let j = inp.node.index();
            if j < n && state[j] == 0 {
                state[j] = 1;
                stack.push((inp.node, 0));
            }
        } else {
            state[id.index()] = 2;
            order.push(id);
        }
    }
    order
}

/// Variables the loss depends on through differentiable inputs: the
/// trainable parameters of a model (running statistics are not among them).
pub fn trainable_variables(g: &GraphBuilder, loss: Outlet) -> Vec<Outlet> {
    let nodes = g.graph_nodes();
    if loss.node.index() >= nodes.len() {
        return Vec::new();
    }
    let order = ancestors_in_order(nodes, loss.node);
    // needed[i]: the loss reads node i through differentiable edges.
    let mut needed = vec![false; nodes.len()];
    needed[loss.node.index()] = true;
    for &id in order.iter().rev() {
        if !needed[id.index()] {
            continue;
        }
        let node = &nodes[id.index()];
        for (k, inp) in node.inputs.iter().enumerate() {
            let is_float = g.ty(*inp).is_some_and(|t| t.dtype.is_float());
            if is_float && differentiable_input(&node.op, k) && has_rule(&node.op) {
                needed[inp.node.index()] = true;
            }
        }
    }
    order
        .into_iter()
        .filter(|id| needed[id.index()] && matches!(nodes[id.index()].op, Op::Variable(_)))
        .map(|id| Outlet::new(id, 0))
        .collect()
}

fn has_rule(op: &Op) -> bool {
    !matches!(
        op,
        Op::ReluGrad
            | Op::HardSigmoidGrad
            | Op::HardSwishGrad
            | Op::GeluGrad
            | Op::SigmoidGrad
            | Op::TanhGrad
            | Op::SoftmaxGrad { .. }
            | Op::LogSoftmaxGrad { .. }
            | Op::ReduceMaxGrad { .. }
            | Op::SliceGrad { .. }
            | Op::Conv2dGradInput { .. }
            | Op::Conv2dGradFilter { .. }
            | Op::MaxPool2dGrad(_)
            | Op::AvgPool2dGrad { .. }
            | Op::BatchNormTrainGrad
            | Op::LayerNormGrad { .. }
            | Op::EmbeddingGrad { .. }
            | Op::CrossEntropyGrad
            | Op::SgdUpdate { .. }
            | Op::AdamUpdate { .. }
            | Op::Assign
            | Op::AmpUnscale
            | Op::AmpScaleUpdate { .. }
    )
}

/// Appends the gradient of `loss` with respect to each of `wrt` to `g`.
/// Returns one entry per `wrt`: `None` where the loss does not depend on it.
/// Gradient nodes are created under the name scope `grad`.
pub fn gradients(
    g: &mut GraphBuilder,
    loss: Outlet,
    wrt: &[Outlet],
) -> Result<Vec<Option<Outlet>>, AutodiffError> {
    if let Some(e) = g.error() {
        return Err(AutodiffError::Graph(e.clone()));
    }
    let loss_ty = g.ty(loss).cloned().ok_or(AutodiffError::UnknownOutlet {
        node: loss.node,
        slot: loss.slot,
    })?;
    if loss_ty.dtype != DType::F32 || loss_ty.shape.numel() != 1 {
        return Err(AutodiffError::LossNotScalar {
            name: g.name_of(loss).to_string(),
            ty: loss_ty,
        });
    }
    for w in wrt {
        let t = g.ty(*w).ok_or(AutodiffError::UnknownOutlet {
            node: w.node,
            slot: w.slot,
        })?;
        if !t.dtype.is_float() {
            return Err(AutodiffError::NotDifferentiable {
                name: g.name_of(*w).to_string(),
                op: g.graph_nodes()[w.node.index()].op.name(),
                reason: format!("its type {t} is not a float type"),
            });
        }
    }
    let nodes_len = g.len();
    let order = ancestors_in_order(g.graph_nodes(), loss.node);
    // depends[i]: node i's outputs depend (differentiably) on some wrt outlet.
    let mut depends = vec![false; nodes_len];
    for w in wrt {
        depends[w.node.index()] = true;
    }
    for &id in &order {
        let node = &g.graph_nodes()[id.index()];
        let d = node.inputs.iter().enumerate().any(|(k, inp)| {
            depends[inp.node.index()]
                && differentiable_input(&node.op, k)
                && g.ty(*inp).is_some_and(|t| t.dtype.is_float())
        });
        if d {
            depends[id.index()] = true;
        }
    }

    g.push_scope("grad");
    let mut grads = Grads::default();
    let seed = g.constant(Tensor::full(loss_ty.shape.clone(), 1.0));
    grads.add(loss, Part::Dense(seed));
    let result = (|| {
        for &id in order.iter().rev() {
            if !depends[id.index()] {
                continue;
            }
            let node = g.graph_nodes()[id.index()].clone();
            let dys: Vec<Option<Outlet>> = (0..node.outputs.len() as u32)
                .map(|s| grads.total(g, Outlet::new(id, s)))
                .collect();
            if dys.iter().all(Option::is_none) || node.inputs.is_empty() {
                continue;
            }
            // Differentiating *through* a wrt node that is not a source is
            // fine: its own gradient is complete at this point.
            let want: Vec<bool> = node
                .inputs
                .iter()
                .enumerate()
                .map(|(k, inp)| {
                    depends[inp.node.index()]
                        && differentiable_input(&node.op, k)
                        && g.ty(*inp).is_some_and(|t| t.dtype.is_float())
                })
                .collect();
            if !want.iter().any(|&w| w) {
                continue;
            }
            // A slice's gradient waits until its input's is summed: slices
            // that tile the input join as one Concat instead of each
            // padding with zeros (`SliceGrad`) and being added.
            if let (Op::Slice { axis, start, .. }, Some(Some(dy)), Some(true)) =
                (&node.op, dys.first(), want.first())
            {
                let input_dim = g.dims(node.inputs[0]).get(*axis).copied().unwrap_or(0);
                grads.add(
                    node.inputs[0],
                    Part::Slice {
                        dy: *dy,
                        axis: *axis,
                        start: *start,
                        input_dim,
                    },
                );
                continue;
            }
            let input_grads = backward(g, id, &node, &dys, &want)?;
            for (k, dx) in input_grads.into_iter().enumerate() {
                if let (Some(dx), true) = (dx, want[k]) {
                    grads.add(node.inputs[k], Part::Dense(dx));
                }
            }
            if let Some(e) = g.error() {
                return Err(AutodiffError::Graph(e.clone()));
            }
        }
        Ok(())
    })();
    let out = wrt.iter().map(|w| grads.total(g, *w)).collect();
    g.pop_scope();
    result?;
    if let Some(e) = g.error() {
        return Err(AutodiffError::Graph(e.clone()));
    }
    Ok(out)
}

/// One contribution to an outlet's gradient.
#[derive(Debug, Clone, Copy)]
enum Part {
    Dense(Outlet),
    /// The gradient `dy` of `x[start..start + len]` along `axis` (x's
    /// length there `input_dim`), not yet padded to x's shape.
    Slice {
        dy: Outlet,
        axis: usize,
        start: usize,
        input_dim: usize,
    },
}

/// The contributions to each outlet's gradient, in the order they came,
/// summed when the outlet's gradient is first asked for.
#[derive(Default)]
struct Grads {
    parts: HashMap<Outlet, Vec<Part>>,
}

impl Grads {
    fn add(&mut self, o: Outlet, p: Part) {
        self.parts.entry(o).or_default().push(p);
    }

    /// `o`'s gradient: slices that tile `o` along one axis concatenated,
    /// otherwise each part (a slice padded by `SliceGrad`) summed in
    /// arrival order. Kept as the one part from then on.
    fn total(&mut self, g: &mut GraphBuilder, o: Outlet) -> Option<Outlet> {
        let parts = self.parts.get(&o)?.clone();
        let sum = match tiles(g, &parts) {
            Some((_, dys)) if dys.len() == 1 => dys[0],
            Some((axis, dys)) => g.concat(&dys, axis),
            None => {
                let mut acc: Option<Outlet> = None;
                for p in parts {
                    let dx = match p {
                        Part::Dense(dx) => dx,
                        Part::Slice {
                            dy,
                            axis,
                            start,
                            input_dim,
                        } => g.op1(
                            Op::SliceGrad {
                                axis,
                                start,
                                input_dim,
                            },
                            &[dy],
                        ),
                    };
                    acc = Some(match acc {
                        Some(prev) => g.add(prev, dx),
                        None => dx,
                    });
                }
                acc?
            }
        };
        self.parts.insert(o, vec![Part::Dense(sum)]);
        Some(sum)
    }
}

/// When every part is a slice along one axis and together they cover the
/// input exactly once: that axis and the slices' gradients in order.
fn tiles(g: &GraphBuilder, parts: &[Part]) -> Option<(usize, Vec<Outlet>)> {
    let mut slices = Vec::with_capacity(parts.len());
    for p in parts {
        match *p {
            Part::Slice {
                dy,
                axis,
                start,
                input_dim,
            } => slices.push((axis, start, input_dim, dy)),
            Part::Dense(_) => return None,
        }
    }
    let &(axis, _, input_dim, _) = slices.first()?;
    slices.sort_by_key(|s| s.1);
    let mut next = 0;
    for &(a, start, dim, dy) in &slices {
        let len = g.dims(dy).get(axis).copied()?;
        if a != axis || dim != input_dim || start != next {
            return None;
        }
        next = start + len;
    }
    (next == input_dim).then(|| (axis, slices.iter().map(|s| s.3).collect()))
}

/// Sums `dy` down to `shape` where the forward op broadcast its input.
fn unbroadcast(g: &mut GraphBuilder, dy: Outlet, shape: &[usize]) -> Outlet {
    if g.dims(dy) == shape {
        dy
    } else {
        g.sum_to(dy, shape)
    }
}

/// Per-channel vector [C] reshaped to broadcast against [N, C, ...] of `rank`.
fn per_channel(g: &mut GraphBuilder, v: Outlet, c: usize, rank: usize) -> Outlet {
    let mut shape = vec![c];
    shape.extend(std::iter::repeat_n(1, rank.saturating_sub(2)));
    if shape.len() == 1 {
        v
    } else {
        g.reshape(v, &shape)
    }
}

fn no_grad(id: NodeId, node: &Node, slot: u32) -> AutodiffError {
    AutodiffError::NoGradient {
        node: id,
        name: node.name.clone(),
        op: node.op.name(),
        slot,
    }
}

/// Gradients of one node's inputs given its outputs' gradients.
fn backward(
    g: &mut GraphBuilder,
    id: NodeId,
    node: &Node,
    dys: &[Option<Outlet>],
    want: &[bool],
) -> Result<Vec<Option<Outlet>>, AutodiffError> {
    let x = |k: usize| node.inputs[k];
    let y = Outlet::new(id, 0);
    // Most ops have one output; multi-output ops check their extra slots.
    for (s, d) in dys.iter().enumerate().skip(1) {
        if d.is_some() {
            return Err(no_grad(id, node, s as u32));
        }
    }
    let Some(dy) = dys[0] else {
        return Ok(vec![None; node.inputs.len()]);
    };
    let dims = |g: &GraphBuilder, k: usize| g.dims(node.inputs[k]);
    let out = match &node.op {
        Op::Add => {
            let (sa, sb) = (dims(g, 0), dims(g, 1));
            vec![
                want[0].then(|| unbroadcast(g, dy, &sa)),
                want[1].then(|| unbroadcast(g, dy, &sb)),
            ]
        }
        Op::Sub => {
            let (sa, sb) = (dims(g, 0), dims(g, 1));
            let da = want[0].then(|| unbroadcast(g, dy, &sa));
            let db = want[1].then(|| {
                let n = g.scale(dy, -1.0);
                unbroadcast(g, n, &sb)
            });
            vec![da, db]
        }
        Op::Mul => {
            let (sa, sb) = (dims(g, 0), dims(g, 1));
            let da = want[0].then(|| {
                let t = g.mul(dy, x(1));
                unbroadcast(g, t, &sa)
            });
            let db = want[1].then(|| {
                let t = g.mul(dy, x(0));
                unbroadcast(g, t, &sb)
            });
            vec![da, db]
        }
        Op::Div => {
            let (sa, sb) = (dims(g, 0), dims(g, 1));
            let da = want[0].then(|| {
                let t = g.div(dy, x(1));
                unbroadcast(g, t, &sa)
            });
            let db = want[1].then(|| {
                // d(a/b)/db = -(a/b)/b = -y/b
                let t = g.mul(dy, y);
                let t = g.div(t, x(1));
                let t = g.scale(t, -1.0);
                unbroadcast(g, t, &sb)
            });
            vec![da, db]
        }
        Op::Relu => vec![Some(g.op1(Op::ReluGrad, &[x(0), dy]))],
        Op::HardSigmoid => vec![Some(g.op1(Op::HardSigmoidGrad, &[x(0), dy]))],
        Op::HardSwish => vec![Some(g.op1(Op::HardSwishGrad, &[x(0), dy]))],
        Op::Gelu => vec![Some(g.op1(Op::GeluGrad, &[x(0), dy]))],
        Op::Sigmoid => vec![Some(g.op1(Op::SigmoidGrad, &[y, dy]))],
        Op::Tanh => vec![Some(g.op1(Op::TanhGrad, &[y, dy]))],
        Op::Exp => vec![Some(g.mul(dy, y))],
        Op::Log => vec![Some(g.div(dy, x(0)))],
        Op::Sqrt => {
            let t = g.div(dy, y);
            vec![Some(g.scale(t, 0.5))]
        }
        Op::Scale(f) => vec![Some(g.scale(dy, *f))],
        Op::Softmax { axis } => vec![Some(g.op1(Op::SoftmaxGrad { axis: *axis }, &[y, dy]))],
        Op::LogSoftmax { axis } => {
            vec![Some(g.op1(Op::LogSoftmaxGrad { axis: *axis }, &[y, dy]))]
        }
        Op::Reshape { .. } => {
            let s = dims(g, 0);
            vec![Some(g.reshape(dy, &s))]
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(g.transpose(dy, &inv))]
        }
        Op::Concat { axis } => {
            let mut off = 0;
            let mut v = Vec::with_capacity(node.inputs.len());
            for (k, &wanted) in want.iter().enumerate() {
                let len = dims(g, k).get(*axis).copied().unwrap_or(0);
                v.push(wanted.then(|| g.slice(dy, *axis, off, off + len)));
                off += len;
            }
            v
        }
        Op::Slice { axis, start, .. } => {
            let input_dim = dims(g, 0).get(*axis).copied().unwrap_or(0);
            vec![Some(g.op1(
                Op::SliceGrad {
                    axis: *axis,
                    start: *start,
                    input_dim,
                },
                &[dy],
            ))]
        }
        Op::BroadcastTo { .. } => {
            let s = dims(g, 0);
            vec![Some(unbroadcast(g, dy, &s))]
        }
        Op::SumTo { .. } => {
            let s = dims(g, 0);
            vec![Some(g.broadcast_to(dy, &s))]
        }
        Op::ReduceSum { axes, keep_dims } | Op::ReduceMean { axes, keep_dims } => {
            let s = dims(g, 0);
            let mut kept = s.clone();
            for &a in axes {
                if let Some(d) = kept.get_mut(a) {
                    *d = 1;
                }
            }
            let d = if *keep_dims { dy } else { g.reshape(dy, &kept) };
            let mut b = g.broadcast_to(d, &s);
            if matches!(node.op, Op::ReduceMean { .. }) {
                let count: usize = axes.iter().filter_map(|&a| s.get(a)).product();
                b = g.scale(b, 1.0 / count.max(1) as f32);
            }
            vec![Some(b)]
        }
        Op::ReduceMax { axes, keep_dims } => vec![Some(g.op1(
            Op::ReduceMaxGrad {
                axes: axes.clone(),
                keep_dims: *keep_dims,
            },
            &[x(0), y, dy],
        ))],
        Op::MatMul {
            transpose_a: ta,
            transpose_b: tb,
        } => {
            let (a, b) = (x(0), x(1));
            let (sa, sb) = (dims(g, 0), dims(g, 1));
            let da = want[0].then(|| {
                let t = match (ta, tb) {
                    (false, false) => g.matmul_t(dy, b, false, true),
                    (false, true) => g.matmul_t(dy, b, false, false),
                    (true, false) => g.matmul_t(b, dy, false, true),
                    (true, true) => g.matmul_t(b, dy, true, true),
                };
                unbroadcast(g, t, &sa)
            });
            let db = want[1].then(|| {
                // A weight shared by a batch of rows (a linear layer on
                // [B, S, K]): one product over all B·S rows, instead of B
                // products summed afterwards.
                if sb.len() == 2 && sa.len() > 2 && !*ta {
                    let k = sa[sa.len() - 1];
                    let n = g.dims(dy).last().copied().unwrap_or(0);
                    let rows = sa[..sa.len() - 1].iter().product::<usize>();
                    let a2 = g.reshape(a, &[rows, k]);
                    let dy2 = g.reshape(dy, &[rows, n]);
                    return if *tb {
                        g.matmul_t(dy2, a2, true, false)
                    } else {
                        g.matmul_t(a2, dy2, true, false)
                    };
                }
                let t = match (ta, tb) {
                    (false, false) => g.matmul_t(a, dy, true, false),
                    (false, true) => g.matmul_t(dy, a, true, false),
                    (true, false) => g.matmul_t(a, dy, false, false),
                    (true, true) => g.matmul_t(dy, a, true, true),
                };
                unbroadcast(g, t, &sb)
            });
            vec![da, db]
        }
        Op::Conv2d(attrs) => {
            let sx = dims(g, 0);
            let sw = dims(g, 1);
            let (Ok(input_shape), Ok(filter_shape)) =
                (<[usize; 4]>::try_from(sx), <[usize; 4]>::try_from(sw))
            else {
                return Err(no_grad(id, node, 0));
            };
            let dx = want[0].then(|| {
                g.op1(
                    Op::Conv2dGradInput {
                        attrs: *attrs,
                        input_shape,
                    },
                    &[dy, x(1)],
                )
            });
            let dw = want[1].then(|| {
                g.op1(
                    Op::Conv2dGradFilter {
                        attrs: *attrs,
                        filter_shape,
                    },
                    &[x(0), dy],
                )
            });
            let mut v = vec![dx, dw];
            if node.inputs.len() == 3 {
                v.push(want[2].then(|| g.sum(dy, &[0, 2, 3], false)));
            }
            v
        }
        Op::MaxPool2d(p) => vec![Some(g.op1(Op::MaxPool2dGrad(*p), &[x(0), dy]))],
        Op::AvgPool2d {
            pool,
            count_include_pad,
        } => vec![Some(g.op1(
            Op::AvgPool2dGrad {
                pool: *pool,
                count_include_pad: *count_include_pad,
            },
            &[x(0), dy],
        ))],
        Op::GlobalAvgPool => {
            let s = dims(g, 0);
            let (n, c, hw) = match s.as_slice() {
                &[n, c, h, w] => (n, c, h * w),
                _ => return Err(no_grad(id, node, 0)),
            };
            let r = g.reshape(dy, &[n, c, 1, 1]);
            let b = g.broadcast_to(r, &s);
            vec![Some(g.scale(b, 1.0 / hw.max(1) as f32))]
        }
        Op::BatchNorm { eps } => {
            // Inference form: statistics are constants here.
            let s = dims(g, 0);
            let (c, rank) = (s.get(1).copied().unwrap_or(0), s.len());
            let red: Vec<usize> = (0..rank).filter(|&a| a != 1).collect();
            let e = g.scalar(*eps);
            let ve = g.add(x(4), e);
            let sd = g.sqrt(ve);
            let one = g.scalar(1.0);
            let invstd = g.div(one, sd);
            let inv_c = per_channel(g, invstd, c, rank);
            let dx = want[0].then(|| {
                let gi = g.mul(x(1), invstd);
                let gi = per_channel(g, gi, c, rank);
                g.mul(dy, gi)
            });
            let dgamma = want[1].then(|| {
                let m = per_channel(g, x(3), c, rank);
                let xc = g.sub(x(0), m);
                let xhat = g.mul(xc, inv_c);
                let t = g.mul(dy, xhat);
                g.sum(t, &red, false)
            });
            let dbeta = want[2].then(|| g.sum(dy, &red, false));
            vec![dx, dgamma, dbeta, None, None]
        }
        Op::BatchNormTrain { .. } => {
            let outs = g.op(
                Op::BatchNormTrainGrad,
                &[x(0), x(1), Outlet::new(id, 1), Outlet::new(id, 2), dy],
            );
            let o = |k: usize| outs.get(k).copied();
            vec![o(0), o(1), o(2), None, None]
        }
        Op::LayerNorm { eps } => {
            let outs = g.op(Op::LayerNormGrad { eps: *eps }, &[x(0), x(1), dy]);
            let o = |k: usize| outs.get(k).copied();
            vec![o(0), o(1), o(2)]
        }
        Op::Embedding => {
            let v = dims(g, 0).first().copied().unwrap_or(0);
            vec![
                Some(g.op1(Op::EmbeddingGrad { num_embeddings: v }, &[x(1), dy])),
                None,
            ]
        }
        Op::CrossEntropy => vec![Some(g.op1(Op::CrossEntropyGrad, &[x(0), x(1), dy])), None],
        // A mask of constants given its seed: nothing to differentiate.
        Op::DropoutMask { .. } => vec![None],
        Op::Where => {
            // dy flows to the branch each element was taken from.
            let (sa, sb) = (dims(g, 1), dims(g, 2));
            let dt = g.ty(dy).map_or(DType::F32, |t| t.dtype);
            let zero = |g: &mut GraphBuilder| g.constant(Tensor::zeros(&TensorType::new(dt, [])));
            let da = want[1].then(|| {
                let z = zero(g);
                let t = g.op1(Op::Where, &[x(0), dy, z]);
                unbroadcast(g, t, &sa)
            });
            let db = want[2].then(|| {
                let z = zero(g);
                let t = g.op1(Op::Where, &[x(0), z, dy]);
                unbroadcast(g, t, &sb)
            });
            vec![None, da, db]
        }
        // A float cast's gradient is the cast back to the input's dtype
        // (casts from i64 carry none: `want` is false for them).
        Op::Cast { .. } => {
            let from = g.ty(x(0)).map_or(DType::F32, |t| t.dtype);
            vec![Some(g.cast(dy, from))]
        }
        Op::MseLoss => {
            let n = g.ty(x(0)).map(|t| t.shape.numel()).unwrap_or(1).max(1);
            let diff = g.sub(x(0), x(1));
            let t = g.mul(diff, dy);
            let dp = g.scale(t, 2.0 / n as f32);
            let dt = want[1].then(|| g.scale(dp, -1.0));
            vec![Some(dp), dt]
        }
        _ => return Err(no_grad(id, node, 0)),
    };
    Ok(out)
}

#[cfg(test)]
mod tests;
