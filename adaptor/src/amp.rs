//! Mixed and half precision as a graph pass (docs/precision.md).
//!
//! [`apply`] rewrites a forward graph, before any gradient or update is
//! appended, so that its matrix products and convolutions run in bf16 or
//! fp16. Nothing here runs at iteration time: the pass only inserts
//! `Cast` nodes, which autodiff differentiates (a cast's gradient is a cast
//! back), so a mixed-precision training graph is an ordinary training graph
//! of the rewritten forward graph.
//!
//! The op lists follow PyTorch's autocast:
//! - matrix products and convolutions take their inputs in the half dtype;
//! - the normalising ops (softmax, norms, losses), reductions, `exp` and
//!   `log` take theirs in f32, and so do the pools and `Where` (no half
//!   kernels for them on CUDA yet);
//! - elementwise ops of several inputs run in the widest dtype among their
//!   *activations*; a weight or a constant beside an activation follows the
//!   activation's dtype (a linear layer's bias is added in bf16, as in
//!   PyTorch's `addmm`, and a scalar does not widen a bf16 tensor);
//! - every other op runs in the dtype its input comes in.
//!
//! Under [`Precision::Bf16Mixed`] / [`Precision::F16Mixed`] the variables
//! stay f32 (master weights, f32 gradients and optimizer state); under
//! [`Precision::Bf16`] / [`Precision::F16`] (serving) a variable or constant
//! read only by half-capable ops is stored in the half dtype. In every mode
//! the placeholders stay as they were, and a result no node reads (what a
//! job fetches) comes back in f32 under its own name.

use crate::graph::infer::infer;
use crate::graph::{validate, Graph, GraphError, GraphLimits, Node, NodeId, Op, Outlet, VarValues};
use crate::tensor::{DType, Tensor, TensorData, TensorType};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

/// The precision a job computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything in f32 (the graph as built).
    #[default]
    F32,
    /// Autocast to bf16, f32 weights.
    Bf16Mixed,
    /// Autocast to fp16, f32 weights.
    F16Mixed,
    /// Weights and activations in bf16 (serving).
    Bf16,
    /// Weights and activations in fp16 (serving).
    F16,
}

impl Precision {
    /// The half dtype products run in, if any.
    pub fn half(self) -> Option<DType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16Mixed | Precision::Bf16 => Some(DType::BF16),
            Precision::F16Mixed | Precision::F16 => Some(DType::F16),
        }
    }
    /// Whether weights stay f32 (mixed precision).
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16Mixed | Precision::F16Mixed)
    }
    /// The names [`FromStr`] takes.
    pub const NAMES: &'static [&'static str] =
        &["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16"];
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "fp32",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::F16Mixed => "fp16-mixed",
            Precision::Bf16 => "bf16",
            Precision::F16 => "fp16",
        })
    }
}

impl FromStr for Precision {
    type Err = AmpError;
    fn from_str(s: &str) -> Result<Self, AmpError> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "32" | "float32" => Precision::F32,
            "bf16-mixed" => Precision::Bf16Mixed,
            "fp16-mixed" | "16-mixed" | "f16-mixed" => Precision::F16Mixed,
            "bf16" | "bf16-true" | "bfloat16" => Precision::Bf16,
            "fp16" | "f16" | "16-true" | "float16" => Precision::F16,
            _ => return Err(AmpError::UnknownPrecision(s.to_string())),
        })
    }
}

/// Why a graph could not be rewritten.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AmpError {
    #[error("unknown precision {0:?}: one of fp32, bf16-mixed, fp16-mixed, bf16, fp16")]
    UnknownPrecision(String),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(
        "node {node:?} ({op}) is part of a training step: apply the precision to the forward \
         graph, before gradients and updates are appended"
    )]
    NotForward { node: String, op: String },
    #[error("node {node:?}: no dtype fits its inputs under {precision}: {reason}")]
    NoFit {
        node: String,
        precision: Precision,
        reason: String,
    },
    #[error("variable or constant {name:?}: {reason}")]
    Value { name: String, reason: String },
}

/// How an op takes its float inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// In the half dtype (autocast's lower-precision list).
    Lower,
    /// In f32 (autocast's f32 list).
    Wide,
    /// In the widest dtype among its activations.
    Promote,
    /// As they come.
    Follow,
}

fn class(op: &Op) -> Class {
    use Op::*;
    match op {
        MatMul { .. } | Conv2d(_) => Class::Lower,
        Softmax { .. }
        | LogSoftmax { .. }
        | LayerNorm { .. }
        | BatchNorm { .. }
        | BatchNormTrain { .. }
        | CrossEntropy
        | MseLoss
        | ReduceSum { .. }
        | ReduceMean { .. }
        | SumTo { .. }
        | Exp
        | Log => Class::Wide,
        // Half on the CPU, but the CUDA backend has no half kernels for
        // them yet (docs/cuda.md): in f32, so a graph runs on both.
        MaxPool2d(_) | AvgPool2d { .. } | GlobalAvgPool | Where => Class::Wide,
        Add | Sub | Mul | Div | Concat { .. } => Class::Promote,
        _ => Class::Follow,
    }
}

/// Whether every backend runs `op` on fp16/bf16 inputs: shape inference
/// takes them and the CUDA backend has half kernels for the op and for its
/// gradient. The ops of autocast's f32 list that do have half kernels (the
/// sums and means, `Exp`, `Log`) are half-capable here: the list is a
/// policy, this is a capability. A graph whose dtypes are given rather than
/// chosen (one captured from PyTorch with its autocast regions and half
/// weights, `lanes.torch`) keeps them and casts to f32 only the inputs of
/// the ops this refuses, as [`apply`] does.
pub fn takes_half(op: &Op) -> bool {
    use Op::*;
    match class(op) {
        Class::Wide => matches!(
            op,
            ReduceSum { .. } | ReduceMean { .. } | SumTo { .. } | Exp | Log
        ),
        // No half Embedding kernel on CUDA; ReduceMax has one, its gradient not.
        _ => !matches!(op, Embedding | ReduceMax { .. } | DropoutMask { .. }),
    }
}

/// Ops of a training step (gradients, updates), which the pass refuses.
/// `Assign` is not one: a forward graph may write a variable (`lanes.torch`
/// updates BatchNorm's running statistics with it under gradient
/// accumulation).
fn is_training_op(op: &Op) -> bool {
    use Op::*;
    matches!(
        op,
        ReluGrad
            | GeluGrad
            | SigmoidGrad
            | TanhGrad
            | SoftmaxGrad { .. }
            | LogSoftmaxGrad { .. }
            | ReduceMaxGrad { .. }
            | SliceGrad { .. }
            | Conv2dGradInput { .. }
            | Conv2dGradFilter { .. }
            | MaxPool2dGrad(_)
            | AvgPool2dGrad { .. }
            | BatchNormTrainGrad
            | LayerNormGrad { .. }
            | EmbeddingGrad { .. }
            | CrossEntropyGrad
            | SgdUpdate { .. }
            | AdamUpdate { .. }
            | HardSigmoidGrad
            | HardSwishGrad
            | AmpUnscale
            | AmpScaleUpdate { .. }
    )
}

/// Rewrites a forward graph (and its variables' values) to compute in
/// `precision`. [`Precision::F32`] gives the graph back unchanged.
pub fn apply(
    graph: Graph,
    mut vars: VarValues,
    precision: Precision,
) -> Result<(Graph, VarValues), AmpError> {
    let Some(half) = precision.half() else {
        return Ok((graph, vars));
    };
    let valid = validate(graph, &GraphLimits::default())?;
    let old = valid.graph();
    for node in &old.nodes {
        if is_training_op(&node.op) {
            return Err(AmpError::NotForward {
                node: node.name.clone(),
                op: format!("{:?}", node.op),
            });
        }
    }
    // Values stored in the half dtype (serving modes): variables and
    // constants whose every reader is happy with half inputs.
    let mut stored_half: HashSet<NodeId> = HashSet::new();
    if !precision.is_mixed() {
        for &id in valid.order() {
            let node = &old.nodes[id.index()];
            let ty = match &node.op {
                Op::Variable(t) => t.clone(),
                Op::Constant(t) => t.ty(),
                _ => continue,
            };
            let readers = valid.consumers(id);
            if ty.dtype == DType::F32
                && !readers.is_empty()
                && readers.iter().all(|&(r, _)| {
                    let op = &old.nodes[r.index()].op;
                    class(op) != Class::Wide && !matches!(op, Op::Embedding)
                })
            {
                stored_half.insert(id);
            }
        }
    }

    let mut out = Rewriter::new(old, half);
    for &id in valid.order() {
        let node = &old.nodes[id.index()];
        let new_id = match &node.op {
            Op::Variable(t) if stored_half.contains(&id) => {
                let ty = TensorType::new(half, t.shape.clone());
                if let Some(v) = vars.get_mut(&node.name) {
                    *v = to_dtype(v, half).map_err(|reason| AmpError::Value {
                        name: node.name.clone(),
                        reason,
                    })?;
                }
                out.push(
                    node.name.clone(),
                    Op::Variable(ty.clone()),
                    vec![],
                    vec![ty],
                )
            }
            Op::Constant(t) if stored_half.contains(&id) => {
                let v = to_dtype(t, half).map_err(|reason| AmpError::Value {
                    name: node.name.clone(),
                    reason,
                })?;
                let ty = v.ty();
                out.push(node.name.clone(), Op::Constant(v), vec![], vec![ty])
            }
            _ => out.node(node)?,
        };
        out.map.insert(id, new_id);
    }
    // What no node reads comes back in f32 under its own name.
    for &id in valid.order() {
        if valid.consumers(id).is_empty() {
            out.widen_sink(id);
        }
    }
    Ok((
        Graph {
            nodes: out.nodes,
            entries: valid.graph().entries.clone(),
        },
        vars,
    ))
}

/// The graph being built: new nodes, where each old node went, and the
/// casts made so far (one per value and dtype).
struct Rewriter<'g> {
    old: &'g Graph,
    half: DType,
    nodes: Vec<Node>,
    map: HashMap<NodeId, NodeId>,
    casts: HashMap<(Outlet, DType), Outlet>,
    names: HashSet<String>,
}

impl<'g> Rewriter<'g> {
    fn new(old: &'g Graph, half: DType) -> Self {
        Rewriter {
            old,
            half,
            nodes: Vec::with_capacity(old.nodes.len() * 2),
            map: HashMap::new(),
            casts: HashMap::new(),
            names: old.nodes.iter().map(|n| n.name.clone()).collect(),
        }
    }

    fn push(
        &mut self,
        name: String,
        op: Op,
        inputs: Vec<Outlet>,
        outputs: Vec<TensorType>,
    ) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        self.nodes.push(Node {
            name,
            op,
            inputs,
            outputs,
        });
        id
    }

    fn ty(&self, o: Outlet) -> &TensorType {
        &self.nodes[o.node.index()].outputs[o.slot as usize]
    }

    /// A name no node has: `base`, or `base` with a counter.
    fn fresh(&mut self, base: String) -> String {
        let mut name = base.clone();
        let mut k = 1;
        while self.names.contains(&name) {
            name = format!("{base}.{k}");
            k += 1;
        }
        self.names.insert(name.clone());
        name
    }

    /// `o` in dtype `to`, through a cast made once.
    fn cast(&mut self, o: Outlet, to: DType) -> Outlet {
        if self.ty(o).dtype == to {
            return o;
        }
        if let Some(&c) = self.casts.get(&(o, to)) {
            return c;
        }
        let src = &self.nodes[o.node.index()].name;
        let base = if o.slot == 0 {
            format!("{src}/to_{to}")
        } else {
            format!("{src}:{}/to_{to}", o.slot)
        };
        let name = self.fresh(base);
        let ty = TensorType::new(to, self.ty(o).shape.clone());
        let id = self.push(name, Op::Cast { to }, vec![o], vec![ty]);
        let c = Outlet::new(id, 0);
        self.casts.insert((o, to), c);
        c
    }

    /// Whether a new outlet holds a weight or a constant (possibly cast).
    fn is_param(&self, o: Outlet) -> bool {
        let node = &self.nodes[o.node.index()];
        match &node.op {
            Op::Variable(_) | Op::Constant(_) => true,
            Op::Cast { .. } => node.inputs.first().is_some_and(|&i| self.is_param(i)),
            _ => false,
        }
    }

    /// The old node's inputs in their new places, cast as its class says;
    /// then the node itself, its outputs inferred.
    fn node(&mut self, node: &Node) -> Result<NodeId, AmpError> {
        let inputs: Vec<Outlet> = node
            .inputs
            .iter()
            .map(|i| Outlet::new(self.map[&i.node], i.slot))
            .collect();
        let floats: Vec<usize> = (0..inputs.len())
            .filter(|&k| self.ty(inputs[k]).dtype.is_float())
            .collect();
        let target = match class(&node.op) {
            Class::Lower => Some(self.half),
            Class::Wide => Some(DType::F32),
            Class::Follow => None,
            Class::Promote => {
                let acts: Vec<DType> = floats
                    .iter()
                    .filter(|&&k| !self.is_param(inputs[k]))
                    .map(|&k| self.ty(inputs[k]).dtype)
                    .collect();
                if acts.contains(&DType::F32) {
                    Some(DType::F32)
                } else if acts.is_empty() {
                    // Only weights and constants: as the first of them.
                    floats.first().map(|&k| self.ty(inputs[k]).dtype)
                } else {
                    Some(self.half)
                }
            }
        };
        let tries: Vec<Option<DType>> = match target {
            Some(DType::F32) => vec![Some(DType::F32)],
            t => vec![t, Some(DType::F32)],
        };
        let mut last = String::new();
        for t in tries {
            let ins: Vec<Outlet> = match t {
                None => inputs.clone(),
                Some(d) => (0..inputs.len())
                    .map(|k| {
                        if floats.contains(&k) {
                            self.cast(inputs[k], d)
                        } else {
                            inputs[k]
                        }
                    })
                    .collect(),
            };
            let types: Vec<TensorType> = ins.iter().map(|&o| self.ty(o).clone()).collect();
            match infer(&node.op, &types) {
                Ok(outputs) => {
                    return Ok(self.push(node.name.clone(), node.op.clone(), ins, outputs));
                }
                Err(e) => last = e,
            }
        }
        Err(AmpError::NoFit {
            node: node.name.clone(),
            precision: Precision::from_half(self.half),
            reason: last,
        })
    }

    /// A node no one reads, with one half output: renamed `<name>/half`,
    /// and a cast to f32 takes its name.
    fn widen_sink(&mut self, old_id: NodeId) {
        let new_id = self.map[&old_id];
        let node = &self.nodes[new_id.index()];
        if node.outputs.len() != 1 || !node.outputs[0].dtype.is_half() {
            return;
        }
        if matches!(node.op, Op::Variable(_) | Op::Constant(_)) {
            return;
        }
        let name = self.old.nodes[old_id.index()].name.clone();
        let renamed = self.fresh(format!("{name}/half"));
        self.nodes[new_id.index()].name = renamed;
        let ty = TensorType::new(
            DType::F32,
            self.nodes[new_id.index()].outputs[0].shape.clone(),
        );
        self.push(
            name,
            Op::Cast { to: DType::F32 },
            vec![Outlet::new(new_id, 0)],
            vec![ty],
        );
    }
}

impl Precision {
    fn from_half(d: DType) -> Precision {
        if d == DType::F16 {
            Precision::F16
        } else {
            Precision::Bf16
        }
    }
}

/// An f32 tensor's values rounded to `to` (round to nearest even).
fn to_dtype(t: &Tensor, to: DType) -> Result<Tensor, String> {
    let TensorData::F32(v) = t.data() else {
        return Err(format!("is {}, not f32", t.dtype()));
    };
    let data =
        TensorData::from_f32_rounded(to, v).ok_or_else(|| format!("{to} is not a float dtype"))?;
    Tensor::new(t.shape().clone(), data).map_err(|e| e.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::graph::GraphBuilder;
    use crate::optim::{training_graph_at, Optimizer, TrainError};

    /// x [4,3] → Linear(3,5) → ReLU → Linear(5,2) = `logits`.
    fn mlp_logits() -> (GraphBuilder, Outlet) {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([4, 3]));
        let w1 = g.variable("w1", Tensor::full([3, 5], 0.1));
        let b1 = g.variable("b1", Tensor::full([5], 0.01));
        let w2 = g.variable("w2", Tensor::full([5, 2], -0.3));
        let b2 = g.variable("b2", Tensor::full([2], 0.02));
        let h = g.matmul(x, w1);
        let h = g.add(h, b1);
        let h = g.relu(h);
        let h = g.matmul(h, w2);
        let logits = g.add(h, b2);
        g.set_name(logits, "logits");
        (g, logits)
    }

    /// [`mlp_logits`] and the cross-entropy `loss` against `y`.
    fn mlp() -> GraphBuilder {
        let (mut g, logits) = mlp_logits();
        let y = g.placeholder("y", TensorType::i64([4]));
        let l = g.cross_entropy(logits, y);
        g.set_name(l, "loss");
        g
    }

    fn node<'a>(g: &'a Graph, name: &str) -> &'a Node {
        &g.nodes[g.find(name).expect(name).index()]
    }

    fn input_types(g: &Graph, n: &Node) -> Vec<DType> {
        n.inputs
            .iter()
            .map(|&i| g.outlet_type(i).unwrap().dtype)
            .collect()
    }

    #[test]
    fn mixed_puts_products_and_bias_adds_in_bf16_and_keeps_weights_f32() {
        let (graph, vars) = mlp().finish().unwrap();
        let (out, out_vars) = apply(graph, vars.clone(), Precision::Bf16Mixed).unwrap();
        assert_eq!(out_vars, vars, "master weights are unchanged");
        let mut products = 0;
        for n in &out.nodes {
            match &n.op {
                Op::MatMul { .. } => {
                    products += 1;
                    assert_eq!(input_types(&out, n), vec![DType::BF16; 2], "{}", n.name);
                    assert_eq!(n.outputs[0].dtype, DType::BF16);
                }
                Op::Variable(t) => assert_eq!(t.dtype, DType::F32, "{}", n.name),
                Op::CrossEntropy => {
                    assert_eq!(input_types(&out, n), vec![DType::F32, DType::I64]);
                }
                _ => {}
            }
        }
        assert_eq!(products, 2);
        // The bias add follows the product (the bias is cast), and so does
        // the ReLU after it.
        let logits = node(&out, "logits");
        assert!(matches!(logits.op, Op::Add));
        assert_eq!(logits.outputs[0].dtype, DType::BF16);
        // The loss reads the logits in f32; a sink already f32 is not renamed.
        assert_eq!(node(&out, "loss").outputs[0].dtype, DType::F32);
        assert!(out.find("loss/half").is_none());
        validate(out, &GraphLimits::default()).unwrap();
    }

    #[test]
    fn serving_in_bf16_stores_weights_in_half_and_answers_in_f32() {
        let (graph, vars) = mlp_logits().0.finish().unwrap();
        let (out, out_vars) = apply(graph, vars.clone(), Precision::Bf16).unwrap();
        for (name, t) in &out_vars {
            assert_eq!(t.dtype(), DType::BF16, "{name}");
            let TensorData::BF16(v) = t.data() else {
                panic!("{name} not bf16")
            };
            let TensorData::F32(orig) = vars[name].data() else {
                panic!()
            };
            for (a, b) in v.iter().zip(orig) {
                assert_eq!(*a, half::bf16::from_f32(*b), "{name}");
            }
        }
        let logits = node(&out, "logits");
        assert_eq!(logits.op, Op::Cast { to: DType::F32 });
        assert_eq!(logits.outputs[0], TensorType::f32([4, 2]));
        assert_eq!(
            out.nodes[logits.inputs[0].node.index()].name,
            "logits/half",
            "the half result is renamed"
        );
        // The placeholder stays f32 and is cast once.
        assert_eq!(node(&out, "x").outputs[0].dtype, DType::F32);
        assert_eq!(
            out.nodes
                .iter()
                .filter(|n| matches!(n.op, Op::Cast { .. }))
                .count(),
            2,
            "one cast of x in, one of the logits out"
        );
        validate(out, &GraphLimits::default()).unwrap();
    }

    #[test]
    fn normalising_ops_take_f32_and_a_residual_widens() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 4]));
        let w = g.variable("w", Tensor::full([4, 4], 0.5));
        let gamma = g.variable("gamma", Tensor::full([4], 1.0));
        let beta = g.variable("beta", Tensor::full([4], 0.0));
        let h = g.matmul(x, w);
        let half_scaled = {
            let s = g.scalar(0.125);
            g.mul(h, s)
        };
        g.set_name(half_scaled, "scaled");
        let sm = g.softmax(half_scaled, 1);
        g.set_name(sm, "sm");
        let r = g.add(x, half_scaled);
        g.set_name(r, "residual");
        let ln = g.layer_norm(r, gamma, beta, 1e-5);
        let out = g.add(ln, sm);
        g.set_name(out, "out");
        let (graph, vars) = g.finish().unwrap();
        let (out, _) = apply(graph, vars, Precision::F16Mixed).unwrap();
        // A scalar does not widen a half activation.
        assert_eq!(node(&out, "scaled").outputs[0].dtype, DType::F16);
        assert_eq!(input_types(&out, node(&out, "sm")), vec![DType::F32]);
        // f32 input + f16 activation: f32.
        assert_eq!(node(&out, "residual").outputs[0].dtype, DType::F32);
        assert_eq!(node(&out, "out").outputs[0].dtype, DType::F32);
        // One cast of `scaled` to f32 serves the softmax and the residual.
        let casts_of_scaled = out
            .nodes
            .iter()
            .filter(|n| n.name.starts_with("scaled/to_f32"))
            .count();
        assert_eq!(casts_of_scaled, 1);
        validate(out, &GraphLimits::default()).unwrap();
    }

    #[test]
    fn takes_half_is_a_capability_not_autocasts_list() {
        let half = [
            Op::MatMul {
                transpose_a: false,
                transpose_b: true,
            },
            Op::Relu,
            Op::Add,
            Op::ReduceSum {
                axes: vec![0],
                keep_dims: false,
            },
            Op::Exp,
            Op::Cast { to: DType::BF16 },
        ];
        for op in &half {
            assert!(takes_half(op), "{op:?}");
        }
        let f32_only = [
            Op::Softmax { axis: 1 },
            Op::CrossEntropy,
            Op::Where,
            Op::GlobalAvgPool,
            Op::Embedding,
            Op::ReduceMax {
                axes: vec![0],
                keep_dims: false,
            },
        ];
        for op in &f32_only {
            assert!(!takes_half(op), "{op:?}");
        }
        // What takes_half admits, shape inference takes in bf16.
        let x = TensorType::new(DType::BF16, [2, 2]);
        for op in &half[..5] {
            let ins = if matches!(op, Op::Relu | Op::Exp | Op::ReduceSum { .. }) {
                vec![x.clone()]
            } else {
                vec![x.clone(), x.clone()]
            };
            assert!(infer(op, &ins).is_ok(), "{op:?}");
        }
    }

    #[test]
    fn fp32_is_the_graph_unchanged() {
        let (graph, vars) = mlp().finish().unwrap();
        let (out, out_vars) = apply(graph.clone(), vars.clone(), Precision::F32).unwrap();
        assert_eq!(out, graph);
        assert_eq!(out_vars, vars);
    }

    #[test]
    fn names_and_refusals() {
        for p in Precision::NAMES {
            let parsed: Precision = p.parse().unwrap();
            assert_eq!(parsed.to_string(), *p);
        }
        assert!(matches!(
            "int8".parse::<Precision>(),
            Err(AmpError::UnknownPrecision(_))
        ));
        // A finished training step is not a forward graph.
        let g = mlp();
        let loss = Outlet::new(NodeId(g.graph_nodes().len() as u32 - 1), 0);
        let t = training_graph_at(g, loss, &Optimizer::sgd(0.1), Precision::F32).unwrap();
        assert!(matches!(
            apply(t.graph, t.vars, Precision::Bf16Mixed),
            Err(AmpError::NotForward { .. })
        ));
        // Half weights do not train.
        for p in [Precision::Bf16, Precision::F16] {
            let g = mlp();
            let loss = Outlet::new(NodeId(g.graph_nodes().len() as u32 - 1), 0);
            let e = training_graph_at(g, loss, &Optimizer::sgd(0.1), p).unwrap_err();
            assert!(matches!(e, TrainError::HalfWeights(..)), "{e}");
        }
    }

    #[test]
    fn an_fp16_mixed_training_graph_scales_its_loss() {
        let g = mlp();
        let loss = Outlet::new(NodeId(g.graph_nodes().len() as u32 - 1), 0);
        let t =
            training_graph_at(g, loss, &Optimizer::adamw(1e-3, 0.01), Precision::F16Mixed).unwrap();
        assert_eq!(t.loss, "loss");
        assert_eq!(
            t.vars[crate::optim::SCALE_VARIABLE].f32s().unwrap(),
            &[65536.0]
        );
        assert_eq!(
            t.vars[crate::optim::GROWTH_TRACKER_VARIABLE]
                .f32s()
                .unwrap(),
            &[0.0]
        );
        for v in [
            crate::optim::SCALE_VARIABLE,
            crate::optim::GROWTH_TRACKER_VARIABLE,
        ] {
            assert!(t.state.iter().any(|s| s == v), "{v} in {:?}", t.state);
        }
        let count = |name: &str| t.graph.nodes.iter().filter(|n| n.op.name() == name).count();
        assert_eq!(count("amp_unscale"), t.params.len());
        assert_eq!(count("amp_scale_update"), 1);
        assert!(t
            .graph
            .resolve(&format!("{}:1", crate::optim::FOUND_INF_NODE))
            .is_some());
        validate(t.graph, &GraphLimits::default()).unwrap();
    }

    #[test]
    fn a_bf16_mixed_training_graph_validates() {
        let g = mlp();
        let loss = Outlet::new(NodeId(g.graph_nodes().len() as u32 - 1), 0);
        let t = training_graph_at(g, loss, &Optimizer::adamw(1e-3, 0.01), Precision::Bf16Mixed)
            .unwrap();
        assert_eq!(t.loss, "loss");
        assert_eq!(t.params, vec!["w1", "b1", "w2", "b2"]);
        for p in &t.params {
            assert_eq!(t.vars[p].dtype(), DType::F32, "{p}");
        }
        validate(t.graph, &GraphLimits::default()).unwrap();
    }
}
