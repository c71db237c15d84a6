//! A builder that reads like a small framework: `g.matmul(x, w)`, `g.relu(h)`.
//!
//! Each call infers the output type at once. The first error is remembered
//! (naming the node and op) and returned by [`GraphBuilder::finish`], so model
//! code needs no `?` on every line.

use super::infer::infer;
use super::op::{Conv2dAttrs, Op, Pool2dAttrs};
use super::{fetch_key, Entry, Graph, GraphError, Node, NodeId, Outlet, VarValues};
use crate::tensor::{DType, Tensor, TensorType};
use std::collections::{HashMap, HashSet};

/// Builds a [`Graph`] and the initial values of its variables.
#[derive(Debug, Default)]
pub struct GraphBuilder {
    nodes: Vec<Node>,
    vars: VarValues,
    names: HashSet<String>,
    /// Per base name, the first suffix that may be free: every `{base}_{i}`
    /// below it is taken (names are freed only by `set_name`, which lowers
    /// it), so a fresh name costs O(1) instead of a scan of all suffixes.
    next_suffix: HashMap<String, usize>,
    scopes: Vec<String>,
    error: Option<GraphError>,
    entries: Vec<Entry>,
}

impl GraphBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Nodes added so far.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Type of an output built so far (`None` if it does not exist or its
    /// node failed to infer).
    pub fn ty(&self, o: Outlet) -> Option<&TensorType> {
        self.nodes.get(o.node.index())?.outputs.get(o.slot as usize)
    }

    /// Dimensions of an output (empty if unknown).
    pub fn dims(&self, o: Outlet) -> Vec<usize> {
        self.ty(o).map(|t| t.shape.0.clone()).unwrap_or_default()
    }

    /// The graph being built (read-only).
    pub fn graph_nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Enters a name scope: nodes created until [`Self::pop_scope`] get `scope/` prefixed.
    pub fn push_scope(&mut self, scope: &str) {
        self.scopes.push(scope.to_string());
    }
    pub fn pop_scope(&mut self) {
        self.scopes.pop();
    }
    /// Runs `f` inside a name scope.
    pub fn scoped<T>(&mut self, scope: &str, f: impl FnOnce(&mut Self) -> T) -> T {
        self.push_scope(scope);
        let r = f(self);
        self.pop_scope();
        r
    }

    fn scoped_name(&self, base: &str) -> String {
        if self.scopes.is_empty() {
            base.to_string()
        } else {
            format!("{}/{}", self.scopes.join("/"), base)
        }
    }

    fn fresh_name(&mut self, base: &str) -> String {
        let name = self.scoped_name(base);
        if !self.names.contains(&name) {
            return name;
        }
        let next = self.next_suffix.entry(name.clone()).or_insert(1);
        loop {
            let cand = format!("{name}_{next}");
            *next += 1;
            if !self.names.contains(&cand) {
                return cand;
            }
        }
    }

    fn fail(&mut self, e: GraphError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    /// Renames the node of `o` (names must stay unique; the scope is not applied).
    pub fn set_name(&mut self, o: Outlet, name: &str) {
        let Some(node) = self.nodes.get(o.node.index()) else {
            return;
        };
        if node.name == name {
            return;
        }
        if self.names.contains(name) {
            let first = self.nodes.iter().position(|n| n.name == name).unwrap_or(0);
            self.fail(GraphError::DuplicateName {
                name: name.to_string(),
                first: NodeId(first as u32),
                second: o.node,
            });
            return;
        }
        let old = std::mem::replace(&mut self.nodes[o.node.index()].name, name.to_string());
        self.names.remove(&old);
        // `{base}_{i}` is free again: a fresh name of that base may take it.
        if let Some((base, i)) = old
            .rsplit_once('_')
            .and_then(|(b, i)| Some((b, i.parse::<usize>().ok()?)))
        {
            if let Some(next) = self.next_suffix.get_mut(base) {
                *next = (*next).min(i.max(1));
            }
        }
        self.names.insert(name.to_string());
        if let Some(v) = self.vars.remove(&old) {
            self.vars.insert(name.to_string(), v);
        }
    }

    fn push(&mut self, name: String, op: Op, inputs: &[Outlet]) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        let mut types = Vec::with_capacity(inputs.len());
        let mut known = true;
        for (k, i) in inputs.iter().enumerate() {
            match self.ty(*i) {
                Some(t) => types.push(t.clone()),
                None => {
                    known = false;
                    if self.error.is_none() {
                        self.error = Some(GraphError::Dangling {
                            node: id,
                            name: name.clone(),
                            op: op.name(),
                            input: k,
                            target: i.node,
                            slot: i.slot,
                        });
                    }
                }
            }
        }
        let outputs = if known {
            match infer(&op, &types) {
                Ok(o) => o,
                Err(reason) => {
                    let e = GraphError::Invalid {
                        node: id,
                        name: name.clone(),
                        op: op.name(),
                        reason,
                    };
                    self.fail(e);
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        self.names.insert(name.clone());
        self.nodes.push(Node {
            name,
            op,
            inputs: inputs.to_vec(),
            outputs,
        });
        id
    }

    /// Adds any op; returns one outlet per output.
    pub fn op(&mut self, op: Op, inputs: &[Outlet]) -> Vec<Outlet> {
        let name = self.fresh_name(op.name());
        let id = self.push(name, op, inputs);
        (0..self.nodes[id.index()].outputs.len() as u32)
            .map(|s| Outlet::new(id, s))
            .collect()
    }

    /// Adds an op and returns its first output.
    pub fn op1(&mut self, op: Op, inputs: &[Outlet]) -> Outlet {
        let name = self.fresh_name(op.name());
        Outlet::new(self.push(name, op, inputs), 0)
    }

    /// A per-iteration input, fed under `name` (scope applied).
    pub fn placeholder(&mut self, name: &str, ty: TensorType) -> Outlet {
        let name = self.exact_name(name);
        Outlet::new(self.push(name, Op::Placeholder(ty), &[]), 0)
    }

    /// A persistent tensor with its initial value, named `name` (scope applied).
    pub fn variable(&mut self, name: &str, init: Tensor) -> Outlet {
        let name = self.exact_name(name);
        let id = self.push(name.clone(), Op::Variable(init.ty()), &[]);
        self.vars.insert(name, init);
        Outlet::new(id, 0)
    }

    fn exact_name(&mut self, name: &str) -> String {
        let full = self.scoped_name(name);
        if self.names.contains(&full) {
            let first = self.nodes.iter().position(|n| n.name == full).unwrap_or(0);
            self.fail(GraphError::DuplicateName {
                name: full.clone(),
                first: NodeId(first as u32),
                second: NodeId(self.nodes.len() as u32),
            });
            return self.fresh_name(name);
        }
        full
    }

    pub fn constant(&mut self, t: Tensor) -> Outlet {
        self.op1(Op::Constant(t), &[])
    }
    pub fn scalar(&mut self, v: f32) -> Outlet {
        self.constant(Tensor::scalar(v))
    }

    pub fn add(&mut self, a: Outlet, b: Outlet) -> Outlet {
        self.op1(Op::Add, &[a, b])
    }
    pub fn sub(&mut self, a: Outlet, b: Outlet) -> Outlet {
        self.op1(Op::Sub, &[a, b])
    }
    pub fn mul(&mut self, a: Outlet, b: Outlet) -> Outlet {
        self.op1(Op::Mul, &[a, b])
    }
    pub fn div(&mut self, a: Outlet, b: Outlet) -> Outlet {
        self.op1(Op::Div, &[a, b])
    }
    /// `x`'s values as `to` (floats round to nearest, ties to even).
    pub fn cast(&mut self, x: Outlet, to: DType) -> Outlet {
        self.op1(Op::Cast { to }, &[x])
    }
    pub fn relu(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::Relu, &[x])
    }
    pub fn gelu(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::Gelu, &[x])
    }
    pub fn sigmoid(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::Sigmoid, &[x])
    }
    pub fn tanh(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::Tanh, &[x])
    }
    pub fn exp(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::Exp, &[x])
    }
    pub fn log(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::Log, &[x])
    }
    pub fn sqrt(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::Sqrt, &[x])
    }
    pub fn scale(&mut self, x: Outlet, factor: f32) -> Outlet {
        self.op1(Op::Scale(factor), &[x])
    }
    pub fn softmax(&mut self, x: Outlet, axis: usize) -> Outlet {
        self.op1(Op::Softmax { axis }, &[x])
    }
    pub fn log_softmax(&mut self, x: Outlet, axis: usize) -> Outlet {
        self.op1(Op::LogSoftmax { axis }, &[x])
    }
    pub fn reshape(&mut self, x: Outlet, shape: &[usize]) -> Outlet {
        self.op1(
            Op::Reshape {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }
    /// Flattens all axes after the first: [N, ...] -> [N, prod(...)].
    pub fn flatten(&mut self, x: Outlet) -> Outlet {
        let d = self.dims(x);
        let n = d.first().copied().unwrap_or(1);
        let rest: usize = d.iter().skip(1).product();
        self.reshape(x, &[n, rest])
    }
    pub fn transpose(&mut self, x: Outlet, perm: &[usize]) -> Outlet {
        self.op1(
            Op::Transpose {
                perm: perm.to_vec(),
            },
            &[x],
        )
    }
    pub fn concat(&mut self, xs: &[Outlet], axis: usize) -> Outlet {
        self.op1(Op::Concat { axis }, xs)
    }
    pub fn slice(&mut self, x: Outlet, axis: usize, start: usize, end: usize) -> Outlet {
        self.op1(Op::Slice { axis, start, end }, &[x])
    }
    pub fn broadcast_to(&mut self, x: Outlet, shape: &[usize]) -> Outlet {
        self.op1(
            Op::BroadcastTo {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }
    pub fn sum_to(&mut self, x: Outlet, shape: &[usize]) -> Outlet {
        self.op1(
            Op::SumTo {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }
    pub fn sum(&mut self, x: Outlet, axes: &[usize], keep_dims: bool) -> Outlet {
        self.op1(
            Op::ReduceSum {
                axes: axes.to_vec(),
                keep_dims,
            },
            &[x],
        )
    }
    pub fn mean(&mut self, x: Outlet, axes: &[usize], keep_dims: bool) -> Outlet {
        self.op1(
            Op::ReduceMean {
                axes: axes.to_vec(),
                keep_dims,
            },
            &[x],
        )
    }
    pub fn max(&mut self, x: Outlet, axes: &[usize], keep_dims: bool) -> Outlet {
        self.op1(
            Op::ReduceMax {
                axes: axes.to_vec(),
                keep_dims,
            },
            &[x],
        )
    }
    pub fn matmul(&mut self, a: Outlet, b: Outlet) -> Outlet {
        self.matmul_t(a, b, false, false)
    }
    pub fn matmul_t(
        &mut self,
        a: Outlet,
        b: Outlet,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Outlet {
        self.op1(
            Op::MatMul {
                transpose_a,
                transpose_b,
            },
            &[a, b],
        )
    }
    pub fn conv2d(
        &mut self,
        x: Outlet,
        w: Outlet,
        bias: Option<Outlet>,
        attrs: Conv2dAttrs,
    ) -> Outlet {
        match bias {
            Some(b) => self.op1(Op::Conv2d(attrs), &[x, w, b]),
            None => self.op1(Op::Conv2d(attrs), &[x, w]),
        }
    }
    pub fn max_pool2d(&mut self, x: Outlet, pool: Pool2dAttrs) -> Outlet {
        self.op1(Op::MaxPool2d(pool), &[x])
    }
    pub fn avg_pool2d(&mut self, x: Outlet, pool: Pool2dAttrs, count_include_pad: bool) -> Outlet {
        self.op1(
            Op::AvgPool2d {
                pool,
                count_include_pad,
            },
            &[x],
        )
    }
    pub fn global_avg_pool(&mut self, x: Outlet) -> Outlet {
        self.op1(Op::GlobalAvgPool, &[x])
    }
    /// Inference-form batch norm.
    pub fn batch_norm(
        &mut self,
        x: Outlet,
        gamma: Outlet,
        beta: Outlet,
        mean: Outlet,
        var: Outlet,
        eps: f32,
    ) -> Outlet {
        self.op1(Op::BatchNorm { eps }, &[x, gamma, beta, mean, var])
    }
    pub fn layer_norm(&mut self, x: Outlet, gamma: Outlet, beta: Outlet, eps: f32) -> Outlet {
        self.op1(Op::LayerNorm { eps }, &[x, gamma, beta])
    }
    pub fn embedding(&mut self, table: Outlet, indices: Outlet) -> Outlet {
        self.op1(Op::Embedding, &[table, indices])
    }
    pub fn cross_entropy(&mut self, logits: Outlet, labels: Outlet) -> Outlet {
        self.op1(Op::CrossEntropy, &[logits, labels])
    }
    pub fn mse_loss(&mut self, prediction: Outlet, target: Outlet) -> Outlet {
        self.op1(Op::MseLoss, &[prediction, target])
    }

    /// Continues building on an existing graph and its variables' values
    /// (e.g. to append gradient and optimizer nodes to a forward graph).
    pub fn from_parts(graph: Graph, vars: VarValues) -> Self {
        let names = graph.nodes.iter().map(|n| n.name.clone()).collect();
        GraphBuilder {
            nodes: graph.nodes,
            vars,
            names,
            next_suffix: HashMap::new(),
            scopes: Vec::new(),
            error: None,
            entries: graph.entries,
        }
    }

    /// Declares `outputs` (named as they are now: name them first) an entry
    /// of the graph, run on its own by a Run that fetches them (see
    /// [`Entry`]; `validate` checks it).
    pub fn entry(&mut self, name: &str, outputs: &[Outlet]) {
        let outputs = outputs.iter().map(|&o| self.key_of(o)).collect();
        self.entries.push(Entry {
            name: name.to_string(),
            outputs,
            updates: Vec::new(),
        });
    }

    /// Initial values of the variables added so far.
    pub fn var_values(&self) -> &VarValues {
        &self.vars
    }

    /// Name of the node of `o` (empty if it does not exist).
    pub fn name_of(&self, o: Outlet) -> &str {
        self.nodes
            .get(o.node.index())
            .map(|n| n.name.as_str())
            .unwrap_or("")
    }

    /// The fetch key of `o` (`name`, or `name:slot` for a node's later
    /// outputs).
    pub fn key_of(&self, o: Outlet) -> String {
        fetch_key(self.name_of(o), o.slot)
    }

    /// The first error met while building, if any.
    pub fn error(&self) -> Option<&GraphError> {
        self.error.as_ref()
    }

    /// The graph and its variables' initial values, or the first error.
    pub fn finish(self) -> Result<(Graph, VarValues), GraphError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok((
                Graph {
                    nodes: self.nodes,
                    entries: self.entries,
                },
                self.vars,
            )),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Fresh names take the lowest free suffix, also one freed by a
    /// rename, as a scan from 1 would.
    #[test]
    fn fresh_names_take_the_lowest_free_suffix() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2]));
        let r: Vec<Outlet> = (0..3).map(|_| g.relu(x)).collect();
        let fresh = |g: &mut GraphBuilder| {
            let o = g.relu(x);
            g.nodes[o.node.index()].name.clone()
        };
        assert_eq!(g.nodes[r[2].node.index()].name, "relu_2");
        g.set_name(r[1], "renamed");
        assert_eq!(fresh(&mut g), "relu_1");
        assert_eq!(fresh(&mut g), "relu_3");
        g.set_name(r[0], "relu_9");
        assert_eq!(fresh(&mut g), "relu");
        assert_eq!(fresh(&mut g), "relu_4");
    }

    #[test]
    fn first_error_names_node_and_op() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 3]));
        let w = g.variable("w", Tensor::full([4, 5], 0.1));
        let y = g.matmul(x, w);
        let _ = g.relu(y);
        match g.finish() {
            Err(GraphError::Invalid {
                op: "matmul", name, ..
            }) => assert_eq!(name, "matmul"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn scopes_and_unique_names() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2]));
        let a = g.scoped("block", |g| g.relu(x));
        let b = g.scoped("block", |g| g.relu(x));
        let (graph, _) = g.finish().unwrap();
        assert_eq!(graph.nodes[a.node.index()].name, "block/relu");
        assert_eq!(graph.nodes[b.node.index()].name, "block/relu_1");
    }

    #[test]
    fn duplicate_placeholder_is_an_error() {
        let mut g = GraphBuilder::new();
        g.placeholder("x", TensorType::f32([2]));
        g.placeholder("x", TensorType::f32([2]));
        assert!(matches!(g.finish(), Err(GraphError::DuplicateName { .. })));
    }
}
