//! Lowering: ONNX nodes whose inputs are not all known at import become
//! Lanes ops. Known inputs of such nodes are materialized: initializers as
//! variables, other constants as `Constant` nodes.

use std::collections::{HashMap, HashSet};

use super::attrs::Attrs;
use super::fold::{self, norm_axis};
use super::value::{broadcast, elem_of, Elem, Host};
use super::{OnnxError, Val};
use crate::graph::{Conv2dAttrs, GraphBuilder, GraphError, NodeId, Op, Outlet, Pool2dAttrs};
use crate::tensor::{DType, Tensor};

/// Why a node could not be lowered.
#[derive(Debug)]
pub enum LowerError {
    /// The op, or this use of it, has no lowering.
    Unsupported(String),
    /// The node is inconsistent (bad attribute, shapes that do not fit).
    Invalid(String),
    /// Building the Lanes op failed (its shape rules refused the inputs).
    Graph(GraphError),
}

impl LowerError {
    pub(super) fn into_onnx(self, node: &str, op: &str) -> OnnxError {
        let (node, op) = (node.to_string(), op.to_string());
        match self {
            LowerError::Unsupported(reason) => OnnxError::Unsupported { node, op, reason },
            LowerError::Invalid(reason) => OnnxError::Node { node, op, reason },
            LowerError::Graph(e) => OnnxError::Node {
                node,
                op,
                reason: e.to_string(),
            },
        }
    }
}

impl std::fmt::Display for LowerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LowerError::Unsupported(r) => write!(f, "not supported: {r}"),
            LowerError::Invalid(r) => f.write_str(r),
            LowerError::Graph(e) => write!(f, "{e}"),
        }
    }
}

impl From<&str> for LowerError {
    fn from(s: &str) -> Self {
        LowerError::Invalid(s.to_string())
    }
}

impl From<String> for LowerError {
    fn from(s: String) -> Self {
        LowerError::Invalid(s)
    }
}

type R<T> = Result<T, LowerError>;
type In = Option<(String, Val)>;

fn unsupported<T>(reason: impl Into<String>) -> R<T> {
    Err(LowerError::Unsupported(reason.into()))
}

/// The importer's state: the graph being built and every ONNX value so far.
pub(super) struct Importer {
    pub g: GraphBuilder,
    pub vals: HashMap<String, Val>,
    limit: usize,
    /// Materialized known values, by parameter or value name.
    cache: HashMap<String, Outlet>,
    /// The ONNX node being lowered (the name scope of its Lanes nodes).
    scope: String,
    /// Nodes already named after a graph output.
    named: HashSet<NodeId>,
}

impl Importer {
    pub fn new(limit: usize) -> Self {
        Importer {
            g: GraphBuilder::new(),
            vals: HashMap::new(),
            limit,
            cache: HashMap::new(),
            scope: String::new(),
            named: HashSet::new(),
        }
    }

    /// Evaluates the node now if all its inputs are known (or, for `Shape`
    /// and `Size`, only their shapes are needed).
    pub fn try_fold(
        &mut self,
        op: &str,
        a: &Attrs<'_>,
        ins: &[In],
    ) -> Result<Option<Vec<Val>>, String> {
        if let ("Shape" | "Size", Some(Some((_, Val::Rt { o, .. })))) = (op, ins.first()) {
            let dims = self.g.dims(*o);
            let h = if op == "Shape" {
                fold::shape_of(&dims, a)?
            } else {
                Host::i64s(vec![], vec![dims.iter().product::<usize>() as i64])?
            };
            return Ok(Some(vec![Val::Known { h, param: None }]));
        }
        let keep = matches!(op, "Identity" | "Dropout");
        let mut hosts = Vec::with_capacity(ins.len());
        let mut param = None;
        for i in ins {
            match i {
                None => hosts.push(None),
                Some((_, Val::Known { h, param: p })) => {
                    if p.is_some() {
                        // A weight is never folded into something else:
                        // the node runs on the variable.
                        if !(keep || matches!(op, "Shape" | "Size")) {
                            return Ok(None);
                        }
                        param.clone_from(p);
                    }
                    hosts.push(Some(h))
                }
                Some(_) => return Ok(None),
            }
        }
        let Some(res) = fold::eval(op, a, &hosts, self.limit)? else {
            return Ok(None);
        };
        Ok(Some(
            res.into_iter()
                .map(|h| Val::Known {
                    h,
                    // An initializer seen through Identity stays that variable.
                    param: if keep { param.clone() } else { None },
                })
                .collect(),
        ))
    }

    /// A run-time outlet for input `k` (materializing a known value).
    fn rt(&mut self, ins: &[In], k: usize) -> R<(Outlet, Elem)> {
        let (name, v) = ins
            .get(k)
            .and_then(|i| i.as_ref())
            .ok_or_else(|| LowerError::Invalid(format!("input {k} is missing")))?;
        match v {
            Val::Rt { o, elem } => Ok((*o, *elem)),
            Val::Missing { op } => unsupported(format!(
                "`{name}` is an output of {op} the importer does not compute"
            )),
            Val::Known { h, param } => {
                let key = param.clone().unwrap_or_else(|| name.clone());
                if let Some(&o) = self.cache.get(&key) {
                    return Ok((o, h.elem()));
                }
                let t = h.to_tensor()?;
                // Sources are named outside the node's scope.
                self.g.pop_scope();
                let o = match param {
                    Some(p) if h.elem() == Elem::F32 => self.g.variable(p, t),
                    _ => self.g.constant(t),
                };
                self.g.push_scope(&self.scope);
                self.check()?;
                self.cache.insert(key, o);
                Ok((o, h.elem()))
            }
        }
    }

    /// Input `k` as an f32 run-time value (bool masks refused).
    fn f32(&mut self, ins: &[In], k: usize) -> R<Outlet> {
        match self.rt(ins, k)? {
            (o, Elem::F32) => Ok(o),
            (_, e) => unsupported(format!(
                "input {k} is {e} at run time; only float is supported here"
            )),
        }
    }

    fn known<'a>(&self, ins: &'a [In], k: usize) -> Option<&'a Host> {
        match ins.get(k) {
            Some(Some((_, Val::Known { h, .. }))) => Some(h),
            _ => None,
        }
    }

    /// Input `k`, which must be known at import (shapes, axes, bounds).
    fn need_known<'a>(&self, ins: &'a [In], k: usize, what: &str) -> R<&'a Host> {
        match ins.get(k) {
            Some(Some((_, Val::Known { h, .. }))) => Ok(h),
            Some(Some(_)) => unsupported(format!(
                "{what} (input {k}) must be known at import, but it is computed at run time"
            )),
            _ => Err(LowerError::Invalid(format!(
                "{what} (input {k}) is missing"
            ))),
        }
    }

    fn check(&self) -> R<()> {
        match self.g.error() {
            Some(e) => Err(LowerError::Graph(e.clone())),
            None => Ok(()),
        }
    }

    fn op(&mut self, op: Op, inputs: &[Outlet]) -> R<Outlet> {
        let o = self.g.op1(op, inputs);
        self.check()?;
        Ok(o)
    }

    fn reshape(&mut self, x: Outlet, dims: Vec<usize>) -> R<Outlet> {
        if self.g.dims(x) == dims {
            return Ok(x);
        }
        self.op(Op::Reshape { shape: dims }, &[x])
    }

    fn constant(&mut self, t: Tensor) -> R<Outlet> {
        let o = self.g.constant(t);
        self.check()?;
        Ok(o)
    }

    fn rt_val(o: Outlet, elem: Elem) -> Vec<Val> {
        vec![Val::Rt { o, elem }]
    }

    /// Names the outlet of a graph output after it (adding a copy where the
    /// node is a source or already carries another output's name).
    pub fn output(&mut self, name: &str, v: Val) -> Result<Outlet, String> {
        let o = match v {
            Val::Rt { o, .. } => o,
            Val::Missing { op } => {
                return Err(format!("an output of {op} the importer does not compute"))
            }
            known @ Val::Known { .. } => {
                let ins = [Some((name.to_string(), known))];
                self.rt(&ins, 0).map_err(|e| e.to_string())?.0
            }
        };
        let node = self
            .g
            .graph_nodes()
            .get(o.node.index())
            .ok_or("dangling output")?;
        let o = if node.op.is_source() || self.named.contains(&o.node) || node.outputs.len() != 1 {
            let dims = self.g.dims(o);
            let c = self.g.op1(Op::Reshape { shape: dims }, &[o]);
            self.check().map_err(|e| e.to_string())?;
            c
        } else {
            o
        };
        self.g.set_name(o, name);
        if let Some(e) = self.g.error() {
            return Err(e.to_string());
        }
        self.named.insert(o.node);
        Ok(o)
    }

    /// Lowers one node; `node` names the scope of the ops it becomes.
    pub fn lower(&mut self, node: &str, op: &str, a: &Attrs<'_>, ins: &[In]) -> R<Vec<Val>> {
        self.scope = node.to_string();
        self.g.push_scope(node);
        let r = self.lower_op(op, a, ins);
        self.g.pop_scope();
        r
    }

    fn lower_op(&mut self, op: &str, a: &Attrs<'_>, ins: &[In]) -> R<Vec<Val>> {
        let f = Self::rt_val;
        match op {
            "Identity" | "Dropout" => {
                let (o, e) = self.rt(ins, 0)?;
                Ok(f(o, e))
            }
            "Relu" | "Sigmoid" | "Tanh" | "Exp" | "Log" | "Sqrt" | "Erf" | "Neg" => {
                let x = self.f32(ins, 0)?;
                let lop = match op {
                    "Relu" => Op::Relu,
                    "Sigmoid" => Op::Sigmoid,
                    "Tanh" => Op::Tanh,
                    "Exp" => Op::Exp,
                    "Log" => Op::Log,
                    "Sqrt" => Op::Sqrt,
                    "Erf" => Op::Erf,
                    _ => Op::Scale(-1.0),
                };
                Ok(f(self.op(lop, &[x])?, Elem::F32))
            }
            "Gelu" => {
                let approx = a.string("approximate").unwrap_or_else(|| "none".into());
                if approx != "none" {
                    return unsupported(format!("approximate = {approx}"));
                }
                let x = self.f32(ins, 0)?;
                Ok(f(self.op(Op::Gelu, &[x])?, Elem::F32))
            }
            "IsNaN" => {
                let x = self.f32(ins, 0)?;
                Ok(f(self.op(Op::IsNan, &[x])?, Elem::Bool))
            }
            "Clip" => {
                let x = self.f32(ins, 0)?;
                let bound = |k: usize, d: f32| -> R<f32> {
                    match ins.get(k) {
                        Some(Some(_)) => Ok(self.need_known(ins, k, "a clip bound")?.scalar_f32()?),
                        _ => Ok(d),
                    }
                };
                let (min, max) = (bound(1, f32::NEG_INFINITY)?, bound(2, f32::INFINITY)?);
                Ok(f(self.op(Op::Clip { min, max }, &[x])?, Elem::F32))
            }
            "Add" | "Sub" | "Mul" | "Div" => {
                let (x, ex) = self.rt(ins, 0)?;
                let (y, ey) = self.rt(ins, 1)?;
                let lop = match op {
                    "Add" => Op::Add,
                    "Sub" => Op::Sub,
                    "Mul" => Op::Mul,
                    _ => Op::Div,
                };
                match (ex, ey) {
                    (Elem::F32, Elem::F32) => Ok(f(self.op(lop, &[x, y])?, Elem::F32)),
                    _ => unsupported(format!("{op} of {ex} and {ey} at run time (only float)")),
                }
            }
            "Pow" => {
                let x = self.f32(ins, 0)?;
                let p = self.need_known(ins, 1, "the exponent")?.scalar_f32()?;
                let y = match p {
                    1.0 => x,
                    2.0 => self.op(Op::Mul, &[x, x])?,
                    3.0 => {
                        let x2 = self.op(Op::Mul, &[x, x])?;
                        self.op(Op::Mul, &[x2, x])?
                    }
                    0.5 => self.op(Op::Sqrt, &[x])?,
                    _ => return unsupported(format!("exponent {p} (1, 2, 3 and 0.5 are)")),
                };
                Ok(f(y, Elem::F32))
            }
            "And" | "Or" | "Not" => {
                let mut v = Vec::new();
                for k in 0..ins.len() {
                    match self.rt(ins, k)? {
                        (o, Elem::Bool) => v.push(o),
                        (_, e) => return Err(LowerError::Invalid(format!("input {k} is {e}, not bool"))),
                    }
                }
                let y = match (op, v.as_slice()) {
                    ("And", &[p, q]) => self.op(Op::Mul, &[p, q])?,
                    ("Or", &[p, q]) => {
                        let s = self.op(Op::Add, &[p, q])?;
                        let m = self.op(Op::Mul, &[p, q])?;
                        self.op(Op::Sub, &[s, m])?
                    }
                    ("Not", &[p]) => {
                        let one = self.constant(Tensor::scalar(1.0))?;
                        self.op(Op::Sub, &[one, p])?
                    }
                    _ => return Err(LowerError::Invalid("wrong number of inputs".into())),
                };
                Ok(f(y, Elem::Bool))
            }
            "Where" => {
                let (c, ec) = self.rt(ins, 0)?;
                if ec != Elem::Bool {
                    return Err(LowerError::Invalid(format!("the condition is {ec}, not bool")));
                }
                let (x, ex) = self.rt(ins, 1)?;
                let (y, ey) = self.rt(ins, 2)?;
                if ex != ey || ex == Elem::I64 {
                    return unsupported(format!("branches of {ex} and {ey} at run time (only float or bool)"));
                }
                Ok(f(self.op(Op::Where, &[c, x, y])?, ex))
            }
            "Cast" => {
                let to = elem_of(a.int("to").unwrap_or(0) as i32)?;
                let (x, from) = self.rt(ins, 0)?;
                let y = match (from, to) {
                    _ if from == to => x,
                    (Elem::I64, Elem::F32) => self.op(Op::Cast { to: DType::F32 }, &[x])?,
                    (Elem::Bool, Elem::F32) => x,
                    (Elem::F32 | Elem::Bool, Elem::I64) => self.op(Op::Cast { to: DType::I64 }, &[x])?,
                    (Elem::F32, Elem::Bool) => self.mask(x)?,
                    (Elem::I64, Elem::Bool) => {
                        let xf = self.op(Op::Cast { to: DType::F32 }, &[x])?;
                        self.mask(xf)?
                    }
                    _ => x,
                };
                Ok(f(y, to))
            }
            "Conv" => self.conv(a, ins),
            "BatchNormalization" => {
                if a.int("training_mode").unwrap_or(0) != 0 {
                    return unsupported("training_mode = 1 (inference only)");
                }
                let x = self.f32(ins, 0)?;
                let mut p = vec![x];
                for k in 1..5 {
                    p.push(self.f32(ins, k)?);
                }
                let eps = a.float("epsilon").unwrap_or(1e-5);
                Ok(f(self.op(Op::BatchNorm { eps }, &p)?, Elem::F32))
            }
            "MaxPool" | "AveragePool" => self.pool(op, a, ins),
            "GlobalAveragePool" => {
                let x = self.f32(ins, 0)?;
                let d = self.g.dims(x);
                let y = if d.len() == 4 {
                    let p = self.op(Op::GlobalAvgPool, &[x])?;
                    self.reshape(p, vec![d[0], d[1], 1, 1])?
                } else if d.len() > 2 {
                    self.op(
                        Op::ReduceMean {
                            axes: (2..d.len()).collect(),
                            keep_dims: true,
                        },
                        &[x],
                    )?
                } else {
                    return Err(LowerError::Invalid(format!("input {d:?} has no spatial axes")));
                };
                Ok(f(y, Elem::F32))
            }
            "Flatten" | "Reshape" | "Unsqueeze" | "Squeeze" => {
                let (x, e) = self.rt(ins, 0)?;
                let d = self.g.dims(x);
                let dims = match op {
                    "Flatten" => fold::flatten(&d, a.int("axis").unwrap_or(1))?,
                    "Reshape" => {
                        let s = self.need_known(ins, 1, "the shape")?.as_i64s()?;
                        fold::reshape(&d, &s, a.int("allowzero").unwrap_or(0) != 0)?
                    }
                    "Unsqueeze" => {
                        let axes = match self.known(ins, 1) {
                            Some(h) => h.as_i64s()?,
                            None if ins.len() > 1 => {
                                self.need_known(ins, 1, "the axes")?;
                                Vec::new()
                            }
                            None => a.ints("axes").ok_or("axes are missing")?,
                        };
                        fold::unsqueeze(&d, &axes)?
                    }
                    _ => {
                        let axes = match ins.get(1) {
                            Some(Some(_)) => Some(self.need_known(ins, 1, "the axes")?.as_i64s()?),
                            _ => a.ints("axes"),
                        };
                        fold::squeeze(&d, axes.as_deref())?
                    }
                };
                Ok(f(self.reshape(x, dims)?, e))
            }
            "Transpose" => {
                let (x, e) = self.rt(ins, 0)?;
                let perm = fold::perm_of(a, self.g.dims(x).len())?;
                if perm.iter().enumerate().all(|(i, &p)| i == p) {
                    return Ok(f(x, e));
                }
                Ok(f(self.op(Op::Transpose { perm }, &[x])?, e))
            }
            "Concat" => {
                let mut xs = Vec::with_capacity(ins.len());
                let mut elem = None;
                for k in 0..ins.len() {
                    let (o, e) = self.rt(ins, k)?;
                    if elem.is_some_and(|x| x != e) {
                        return Err(LowerError::Invalid("inputs differ in type".into()));
                    }
                    elem = Some(e);
                    xs.push(o);
                }
                let first = *xs.first().ok_or("no inputs")?;
                let axis = norm_axis(a.int("axis").ok_or("attribute `axis` is missing")?, self.g.dims(first).len())?;
                Ok(f(self.op(Op::Concat { axis }, &xs)?, elem.unwrap_or(Elem::F32)))
            }
            "Slice" => {
                let (x, e) = self.rt(ins, 0)?;
                let d = self.g.dims(x);
                let starts = self.need_known(ins, 1, "starts")?.as_i64s()?;
                let ends = self.need_known(ins, 2, "ends")?.as_i64s()?;
                let opt = |k: usize| -> R<Option<Vec<i64>>> {
                    match ins.get(k) {
                        Some(Some(_)) => Ok(Some(self.need_known(ins, k, "axes and steps")?.as_i64s()?)),
                        _ => Ok(None),
                    }
                };
                let (axes, steps) = (opt(3)?, opt(4)?);
                let ranges = fold::slice_ranges(&d, &starts, &ends, axes.as_deref(), steps.as_deref())?;
                let mut y = x;
                for (ax, &(s, step, len)) in ranges.iter().enumerate() {
                    if (s, len) == (0, d[ax]) && (step == 1 || len <= 1) {
                        continue;
                    }
                    if step != 1 && len > 1 {
                        return unsupported(format!("step {step} at run time (only 1)"));
                    }
                    if len == 0 {
                        return unsupported("an empty slice");
                    }
                    let start = s as usize;
                    y = self.op(Op::Slice { axis: ax, start, end: start + len }, &[y])?;
                }
                Ok(f(y, e))
            }
            "Gather" => self.gather(a, ins),
            "Expand" => {
                let (x, e) = self.rt(ins, 0)?;
                let shape = fold::dims_of(self.need_known(ins, 1, "the shape")?)?;
                let d = self.g.dims(x);
                let out = broadcast(&d, &shape)?;
                if out == d {
                    return Ok(f(x, e));
                }
                if e == Elem::I64 {
                    return unsupported("expanding int64 values at run time");
                }
                Ok(f(self.op(Op::BroadcastTo { shape: out }, &[x])?, e))
            }
            "Gemm" => {
                let x = self.f32(ins, 0)?;
                let w = self.f32(ins, 1)?;
                let ta = a.int("transA").unwrap_or(0) != 0;
                let tb = a.int("transB").unwrap_or(0) != 0;
                let mut y = self.op(Op::MatMul { transpose_a: ta, transpose_b: tb }, &[x, w])?;
                let alpha = a.float("alpha").unwrap_or(1.0);
                if alpha != 1.0 {
                    y = self.op(Op::Scale(alpha), &[y])?;
                }
                if matches!(ins.get(2), Some(Some(_))) {
                    let mut c = self.f32(ins, 2)?;
                    let beta = a.float("beta").unwrap_or(1.0);
                    if beta != 1.0 {
                        c = self.op(Op::Scale(beta), &[c])?;
                    }
                    y = self.op(Op::Add, &[y, c])?;
                }
                Ok(f(y, Elem::F32))
            }
            "MatMul" => {
                let x = self.f32(ins, 0)?;
                let w = self.f32(ins, 1)?;
                let (dx, dw) = (self.g.dims(x), self.g.dims(w));
                let x2 = if dx.len() == 1 { self.reshape(x, vec![1, dx[0]])? } else { x };
                let w2 = if dw.len() == 1 { self.reshape(w, vec![dw[0], 1])? } else { w };
                let mut y = self.op(Op::MatMul { transpose_a: false, transpose_b: false }, &[x2, w2])?;
                if dx.len() == 1 || dw.len() == 1 {
                    let mut d = self.g.dims(y);
                    if dw.len() == 1 {
                        d.pop();
                    }
                    if dx.len() == 1 {
                        let n = d.len();
                        d.remove(n - if dw.len() == 1 { 1 } else { 2 });
                    }
                    y = self.reshape(y, d)?;
                }
                Ok(f(y, Elem::F32))
            }
            "Softmax" | "LogSoftmax" => {
                let x = self.f32(ins, 0)?;
                let axis = norm_axis(a.int("axis").unwrap_or(-1), self.g.dims(x).len())?;
                let lop = if op == "Softmax" { Op::Softmax { axis } } else { Op::LogSoftmax { axis } };
                Ok(f(self.op(lop, &[x])?, Elem::F32))
            }
            "LayerNormalization" => self.layer_norm(a, ins),
            "ReduceMean" | "ReduceSum" | "ReduceMax" => {
                let x = self.f32(ins, 0)?;
                let r = self.g.dims(x).len();
                let axes = match ins.get(1) {
                    Some(Some(_)) => Some(self.need_known(ins, 1, "the axes")?.as_i64s()?),
                    _ => a.ints("axes"),
                };
                let keep_dims = a.int("keepdims").unwrap_or(1) != 0;
                let axes: Vec<usize> = match axes {
                    Some(v) if !v.is_empty() => v.iter().map(|&x| norm_axis(x, r)).collect::<Result<_, _>>()?,
                    _ if a.int("noop_with_empty_axes").unwrap_or(0) != 0 => return Ok(f(x, Elem::F32)),
                    _ => (0..r).collect(),
                };
                let lop = match op {
                    "ReduceMean" => Op::ReduceMean { axes, keep_dims },
                    "ReduceSum" => Op::ReduceSum { axes, keep_dims },
                    _ => Op::ReduceMax { axes, keep_dims },
                };
                Ok(f(self.op(lop, &[x])?, Elem::F32))
            }
            "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "Xor" | "Min" | "Max"
            | "Range" | "ConstantOfShape" | "GatherElements" => unsupported("with inputs computed at run time (it is folded only when its inputs are known at import)"),
            _ => unsupported("no lowering exists for it"),
        }
    }

    /// A bool mask (f32 0/1) from f32 values: 1 where non-zero.
    fn mask(&mut self, x: Outlet) -> R<Outlet> {
        let one = self.constant(Tensor::scalar(1.0))?;
        let zero = self.constant(Tensor::scalar(0.0))?;
        self.op(Op::Where, &[x, one, zero])
    }

    fn conv(&mut self, a: &Attrs<'_>, ins: &[In]) -> R<Vec<Val>> {
        let x = self.f32(ins, 0)?;
        let w = self.f32(ins, 1)?;
        let (dx, dw) = (self.g.dims(x), self.g.dims(w));
        if dw.len() != 4 || dx.len() != 4 {
            return unsupported(format!("a convolution of rank {} (only 2-D)", dx.len()));
        }
        let two = |name: &str, d: usize| -> R<[usize; 2]> {
            match a.ints(name) {
                None => Ok([d, d]),
                Some(v) => match v.as_slice() {
                    &[p, q] if p > 0 && q > 0 => Ok([p as usize, q as usize]),
                    _ => Err(LowerError::Invalid(format!(
                        "{name} {v:?} must be two positive values"
                    ))),
                },
            }
        };
        let stride = two("strides", 1)?;
        let dilation = two("dilations", 1)?;
        if let Some(k) = a.ints("kernel_shape") {
            if k.len() != 2 || k[0] != dw[2] as i64 || k[1] != dw[3] as i64 {
                return Err(LowerError::Invalid(format!(
                    "kernel_shape {k:?} does not match weights {dw:?}"
                )));
            }
        }
        let padding = pads(a, &dx[2..], &[dw[2], dw[3]], stride, dilation)?;
        let groups = usize::try_from(a.int("group").unwrap_or(1))
            .map_err(|_| "negative group".to_string())?;
        let attrs = Conv2dAttrs {
            stride,
            padding,
            dilation,
            groups,
        };
        let mut inputs = vec![x, w];
        if matches!(ins.get(2), Some(Some(_))) {
            inputs.push(self.f32(ins, 2)?);
        }
        Ok(Self::rt_val(
            self.op(Op::Conv2d(attrs), &inputs)?,
            Elem::F32,
        ))
    }

    fn pool(&mut self, op: &str, a: &Attrs<'_>, ins: &[In]) -> R<Vec<Val>> {
        let x = self.f32(ins, 0)?;
        let d = self.g.dims(x);
        let k = a.ints("kernel_shape").ok_or("kernel_shape is missing")?;
        let kernel = match k.as_slice() {
            &[p, q] if p > 0 && q > 0 => [p as usize, q as usize],
            _ => return unsupported(format!("kernel_shape {k:?} (only 2-D windows)")),
        };
        if d.len() != 4 {
            return unsupported("pooling of a tensor that is not [N, C, H, W]");
        }
        let stride = match a.ints("strides") {
            None => [1, 1],
            Some(v) => match v.as_slice() {
                &[p, q] if p > 0 && q > 0 => [p as usize, q as usize],
                _ => return Err(LowerError::Invalid(format!("strides {v:?}"))),
            },
        };
        if a.ints("dilations")
            .is_some_and(|v| v.iter().any(|&x| x != 1))
        {
            return unsupported("dilated pooling");
        }
        let padding = pads(a, &d[2..], &kernel, stride, [1, 1])?;
        if a.int("ceil_mode").unwrap_or(0) != 0 {
            // Ceil mode is floor mode when the windows fit exactly.
            for i in 0..2 {
                let span = d[2 + i].saturating_add(padding[i].saturating_mul(2));
                if span < kernel[i] || (span - kernel[i]) % stride[i] != 0 {
                    return unsupported("ceil_mode = 1 where it changes the output size");
                }
            }
        }
        let pool = Pool2dAttrs {
            kernel,
            stride,
            padding,
        };
        let lop = if op == "MaxPool" {
            if a.int("storage_order").unwrap_or(0) != 0 {
                return unsupported("storage_order = 1");
            }
            Op::MaxPool2d(pool)
        } else {
            Op::AvgPool2d {
                pool,
                count_include_pad: a.int("count_include_pad").unwrap_or(0) != 0,
            }
        };
        Ok(Self::rt_val(self.op(lop, &[x])?, Elem::F32))
    }

    fn gather(&mut self, a: &Attrs<'_>, ins: &[In]) -> R<Vec<Val>> {
        let (data, e) = self.rt(ins, 0)?;
        let d = self.g.dims(data);
        let axis = norm_axis(a.int("axis").unwrap_or(0), d.len())?;
        // A known scalar index: a slice without the axis.
        if let Some(h) = self.known(ins, 1) {
            if h.dims.is_empty() {
                let k = h.scalar_i64()?;
                let n = d[axis] as i64;
                let k = if k < 0 { k + n } else { k };
                if !(0..n).contains(&k) {
                    return Err(LowerError::Invalid(format!(
                        "index {k} out of range for length {n}"
                    )));
                }
                let k = k as usize;
                let s = self.op(
                    Op::Slice {
                        axis,
                        start: k,
                        end: k + 1,
                    },
                    &[data],
                )?;
                let mut out = d.clone();
                out.remove(axis);
                return Ok(Self::rt_val(self.reshape(s, out)?, e));
            }
        }
        if e == Elem::I64 {
            return unsupported("gathering int64 values at run time");
        }
        let (idx, ei) = self.rt(ins, 1)?;
        if ei != Elem::I64 {
            return Err(LowerError::Invalid(format!("indices are {ei}, not int64")));
        }
        if let Some(h) = self.known(ins, 1) {
            let n = d[axis] as i64;
            if let Some(bad) = h.as_i64s()?.into_iter().find(|&k| !(0..n).contains(&k)) {
                return unsupported(format!(
                    "index {bad} (negative or out of range for length {n})"
                ));
            }
        }
        // Gather along `axis` = embedding lookup on [d[axis], rest] after
        // moving the axis to the front.
        let mut table = data;
        let mut moved: Vec<usize> = d.clone();
        if axis != 0 {
            let mut perm: Vec<usize> = vec![axis];
            perm.extend((0..d.len()).filter(|&i| i != axis));
            moved = perm.iter().map(|&p| d[p]).collect();
            table = self.op(Op::Transpose { perm }, &[table])?;
        }
        let rest: usize = moved[1..].iter().product();
        let table = self.reshape(table, vec![moved[0], rest])?;
        let y = self.op(Op::Embedding, &[table, idx])?;
        let id = self.g.dims(idx);
        let mut out = id.clone();
        out.extend_from_slice(&moved[1..]);
        let y = self.reshape(y, out)?;
        let y = if axis != 0 {
            // y is [idx..., d without axis]; ONNX wants [d[..axis], idx..., d[axis+1..]].
            let ri = id.len();
            let mut perm: Vec<usize> = (ri..ri + axis).collect();
            perm.extend(0..ri);
            perm.extend(ri + axis..ri + d.len() - 1);
            self.op(Op::Transpose { perm }, &[y])?
        } else {
            y
        };
        Ok(Self::rt_val(y, e))
    }

    fn layer_norm(&mut self, a: &Attrs<'_>, ins: &[In]) -> R<Vec<Val>> {
        let x = self.f32(ins, 0)?;
        let d = self.g.dims(x);
        let axis = norm_axis(a.int("axis").unwrap_or(-1), d.len())?;
        let inner: usize = d[axis..].iter().product();
        let eps = a.float("epsilon").unwrap_or(1e-5);
        let gamma = self.f32(ins, 1)?;
        let beta = if matches!(ins.get(2), Some(Some(_))) {
            self.f32(ins, 2)?
        } else {
            self.constant(Tensor::full([inner], 0.0))?
        };
        let (gamma, beta) = if self.g.dims(gamma) == [inner] && self.g.dims(beta) == [inner] {
            (gamma, beta)
        } else {
            let full = |s: &mut Self, t: Outlet| -> R<Outlet> {
                let td = s.g.dims(t);
                let want = d[axis..].to_vec();
                let t = if broadcast(&td, &want)? == want && td != want {
                    s.op(Op::BroadcastTo { shape: want }, &[t])?
                } else {
                    t
                };
                s.reshape(t, vec![inner])
            };
            (full(self, gamma)?, full(self, beta)?)
        };
        let x2 = self.reshape(x, vec![d[..axis].iter().product(), inner])?;
        let y = self.op(Op::LayerNorm { eps }, &[x2, gamma, beta])?;
        Ok(Self::rt_val(self.reshape(y, d)?, Elem::F32))
    }
}

/// Symmetric 2-D padding from `pads` / `auto_pad`.
fn pads(
    a: &Attrs<'_>,
    input: &[usize],
    kernel: &[usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
) -> R<[usize; 2]> {
    let auto = a.string("auto_pad").unwrap_or_else(|| "NOTSET".into());
    match auto.as_str() {
        "NOTSET" | "" => match a.ints("pads") {
            None => Ok([0, 0]),
            Some(p) => match *p.as_slice() {
                [t, l, b, r] if t >= 0 && l >= 0 && t == b && l == r => {
                    Ok([t as usize, l as usize])
                }
                [t, l, b, r] if t >= 0 && l >= 0 && b >= 0 && r >= 0 => {
                    unsupported(format!("asymmetric pads {p:?}"))
                }
                _ => Err(LowerError::Invalid(format!(
                    "pads {p:?} must be four non-negative values"
                ))),
            },
        },
        "VALID" => Ok([0, 0]),
        "SAME_UPPER" | "SAME_LOWER" => {
            let mut out = [0; 2];
            for i in 0..2 {
                let (n, s) = (input[i], stride[i]);
                let span = dilation[i]
                    .saturating_mul(kernel[i].max(1) - 1)
                    .saturating_add(1);
                let total = (n.div_ceil(s).saturating_sub(1).saturating_mul(s))
                    .saturating_add(span)
                    .saturating_sub(n);
                if total % 2 != 0 {
                    return unsupported(format!("auto_pad = {auto} with odd total padding"));
                }
                out[i] = total / 2;
            }
            Ok(out)
        }
        other => Err(LowerError::Invalid(format!("auto_pad = {other}"))),
    }
}
