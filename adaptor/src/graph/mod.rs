//! The graph IR: an arena of nodes, each output addressed as `(node, slot)`
//! with a static type. A [`Graph`] is what travels on the wire; [`validate`]
//! turns one into a [`ValidGraph`] (acyclic, every input resolvable, every
//! node's declared types equal to the inferred ones, limits respected) — the
//! only form the service plans and runs.

mod builder;
mod entry;
pub mod infer;
pub mod op;

pub use builder::GraphBuilder;
pub use entry::{add_entry, Entry, Part, MAX_ENTRIES};
pub use op::{Conv2dAttrs, Op, Pool2dAttrs};

use crate::tensor::{Tensor, TensorType};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;

/// Index of a node in its graph's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One output of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Outlet {
    pub node: NodeId,
    pub slot: u32,
}

impl Outlet {
    pub fn new(node: NodeId, slot: u32) -> Self {
        Outlet { node, slot }
    }
}

/// A node: a unique name, an op, its inputs and the types of its outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub op: Op,
    pub inputs: Vec<Outlet>,
    pub outputs: Vec<TensorType>,
}

/// A computation graph as built by a job and sent to the service.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Graph {
    pub nodes: Vec<Node>,
    /// Parts that run on their own, outside the main iteration (see
    /// [`Entry`]); usually none (and none in a saved job's JSON from
    /// before entries).
    #[serde(default)]
    pub entries: Vec<Entry>,
}

/// The fetch key of output `slot` of the node `name`: `name`, or
/// `name:slot` for a later output (what [`Graph::resolve`] reads).
pub fn fetch_key(name: &str, slot: u32) -> String {
    if slot == 0 {
        name.to_string()
    } else {
        format!("{name}:{slot}")
    }
}

/// Initial values of a graph's variables, keyed by variable node name.
pub type VarValues = BTreeMap<String, Tensor>;

impl Graph {
    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id.index())
    }
    /// Type of an output, if it exists.
    pub fn outlet_type(&self, o: Outlet) -> Option<&TensorType> {
        self.node(o.node)?.outputs.get(o.slot as usize)
    }
    /// Finds a node by name.
    pub fn find(&self, name: &str) -> Option<NodeId> {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .map(|i| NodeId(i as u32))
    }
    /// Resolves a fetch key: `name` (slot 0) or `name:slot`.
    pub fn resolve(&self, key: &str) -> Option<Outlet> {
        let (name, slot) = match key.rsplit_once(':') {
            Some((n, s)) if s.chars().all(|c| c.is_ascii_digit()) && !s.is_empty() => {
                (n, s.parse::<u32>().ok()?)
            }
            _ => (key, 0),
        };
        let node = self.find(name)?;
        let o = Outlet::new(node, slot);
        self.outlet_type(o).map(|_| o)
    }
    /// Placeholders: (node, name, type).
    pub fn placeholders(&self) -> impl Iterator<Item = (NodeId, &str, &TensorType)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match &n.op {
                Op::Placeholder(t) => Some((NodeId(i as u32), n.name.as_str(), t)),
                _ => None,
            })
    }
    /// Variables: (node, name, type).
    pub fn variables(&self) -> impl Iterator<Item = (NodeId, &str, &TensorType)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| match &n.op {
                Op::Variable(t) => Some((NodeId(i as u32), n.name.as_str(), t)),
                _ => None,
            })
    }
}

/// Bounds applied when validating a graph from the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphLimits {
    pub max_nodes: usize,
    pub max_inputs_per_node: usize,
    pub max_tensor_bytes: usize,
    pub max_constant_bytes: usize,
}

impl Default for GraphLimits {
    fn default() -> Self {
        GraphLimits {
            max_nodes: 100_000,
            max_inputs_per_node: 1024,
            max_tensor_bytes: 8 << 30,
            max_constant_bytes: 64 << 20,
        }
    }
}

/// Why a graph is not valid. Node-level errors name the node and its op.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    #[error("graph is empty")]
    Empty,
    #[error("graph has {nodes} nodes, more than the limit of {limit}")]
    TooManyNodes { nodes: usize, limit: usize },
    #[error("node {node} `{name}` ({op}): {reason}")]
    Invalid {
        node: NodeId,
        name: String,
        op: &'static str,
        reason: String,
    },
    #[error("node {node} `{name}` ({op}): input {input} refers to {target}:{slot}, which does not exist")]
    Dangling {
        node: NodeId,
        name: String,
        op: &'static str,
        input: usize,
        target: NodeId,
        slot: u32,
    },
    #[error("graph has a cycle through node {node} `{name}` ({op})")]
    Cycle {
        node: NodeId,
        name: String,
        op: &'static str,
    },
    #[error("entry `{entry}`: {reason}")]
    BadEntry { entry: String, reason: String },
    #[error("node name `{name}` is used by nodes {first} and {second}")]
    DuplicateName {
        name: String,
        first: NodeId,
        second: NodeId,
    },
}

impl GraphError {
    pub(crate) fn invalid(id: NodeId, node: &Node, reason: impl Into<String>) -> Self {
        GraphError::Invalid {
            node: id,
            name: node.name.clone(),
            op: node.op.name(),
            reason: reason.into(),
        }
    }
}

/// A graph that passed [`validate`]: it can be planned and run.
#[derive(Debug, Clone)]
pub struct ValidGraph {
    graph: Graph,
    order: Vec<NodeId>,
    consumers: Vec<Vec<(NodeId, usize)>>,
    /// Which nodes each part runs (boxed: most graphs have no entries).
    parts: Box<entry::Parts>,
}

impl ValidGraph {
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
    /// Execution order: topological, and every in-place update of a variable
    /// runs after all other readers of that variable in the main
    /// iteration. The main iteration's nodes come first
    /// ([`ValidGraph::main_order`]), then the nodes only entries run.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }
    /// Consumers of a node's outputs: (consumer, input position).
    pub fn consumers(&self, id: NodeId) -> &[(NodeId, usize)] {
        &self.consumers[id.index()]
    }
    pub fn into_graph(self) -> Graph {
        self.graph
    }
}

/// Checks a graph: size limits, unique names, resolvable inputs, declared
/// types equal to inferred types, in-place updates only on variables (each
/// variable updated by at most one node), and no cycles.
pub fn validate(graph: Graph, limits: &GraphLimits) -> Result<ValidGraph, GraphError> {
    let n = graph.nodes.len();
    if n == 0 {
        return Err(GraphError::Empty);
    }
    if n > limits.max_nodes || n > u32::MAX as usize {
        return Err(GraphError::TooManyNodes {
            nodes: n,
            limit: limits.max_nodes,
        });
    }
    let mut names: HashMap<&str, NodeId> = HashMap::with_capacity(n);
    for (i, node) in graph.nodes.iter().enumerate() {
        let id = NodeId(i as u32);
        if node.name.is_empty() {
            return Err(GraphError::invalid(id, node, "node name is empty"));
        }
        if let Some(&first) = names.get(node.name.as_str()) {
            return Err(GraphError::DuplicateName {
                name: node.name.clone(),
                first,
                second: id,
            });
        }
        names.insert(&node.name, id);
    }
    // Inputs resolve; declared types match inference; limits.
    let mut consumers: Vec<Vec<(NodeId, usize)>> = vec![Vec::new(); n];
    for (i, node) in graph.nodes.iter().enumerate() {
        let id = NodeId(i as u32);
        if node.inputs.len() > limits.max_inputs_per_node {
            return Err(GraphError::invalid(
                id,
                node,
                format!(
                    "{} inputs, more than the limit of {}",
                    node.inputs.len(),
                    limits.max_inputs_per_node
                ),
            ));
        }
        let mut types = Vec::with_capacity(node.inputs.len());
        for (k, inp) in node.inputs.iter().enumerate() {
            match graph.outlet_type(*inp) {
                Some(t) => types.push(t.clone()),
                None => {
                    return Err(GraphError::Dangling {
                        node: id,
                        name: node.name.clone(),
                        op: node.op.name(),
                        input: k,
                        target: inp.node,
                        slot: inp.slot,
                    })
                }
            }
            consumers[inp.node.index()].push((id, k));
        }
        if let Op::Constant(t) = &node.op {
            if t.ty().bytes() > limits.max_constant_bytes {
                return Err(GraphError::invalid(
                    id,
                    node,
                    format!(
                        "constant of {} bytes exceeds the limit of {}",
                        t.ty().bytes(),
                        limits.max_constant_bytes
                    ),
                ));
            }
        }
        let inferred =
            infer::infer(&node.op, &types).map_err(|r| GraphError::invalid(id, node, r))?;
        if inferred != node.outputs {
            return Err(GraphError::invalid(
                id,
                node,
                format!(
                    "declared outputs {} but inputs give {}",
                    types_str(&node.outputs),
                    types_str(&inferred)
                ),
            ));
        }
        for t in &inferred {
            if t.checked_bytes()
                .is_none_or(|b| b > limits.max_tensor_bytes)
            {
                return Err(GraphError::invalid(
                    id,
                    node,
                    format!(
                        "output {t} exceeds the tensor limit of {} bytes",
                        limits.max_tensor_bytes
                    ),
                ));
            }
        }
    }
    let mut parts = entry::parts(&graph)?;
    // In-place updates: the mutated input must be a variable's output; one
    // writer per variable in any part (a main iteration and an entry may
    // each update it: they never run together).
    let mut writers: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    let mut extra: Vec<Vec<NodeId>> = vec![Vec::new(); n]; // extra[a] = nodes that must wait for a
    for (i, node) in graph.nodes.iter().enumerate() {
        let id = NodeId(i as u32);
        for &k in node.op.mutated_inputs() {
            let Some(target) = node.inputs.get(k) else {
                continue;
            };
            let tnode = &graph.nodes[target.node.index()];
            if !matches!(tnode.op, Op::Variable(_)) {
                return Err(GraphError::invalid(
                    id,
                    node,
                    format!(
                        "input {k} is updated in place and must be a variable, but `{}` is a {}",
                        tnode.name,
                        tnode.op.name()
                    ),
                ));
            }
            let others = writers.entry(target.node).or_default();
            if let Some(prev) = others.iter().find(|&&w| w != id && parts.together(w, id)) {
                return Err(GraphError::invalid(
                    id,
                    node,
                    format!(
                        "variable `{}` is already updated by node {prev}",
                        tnode.name
                    ),
                ));
            }
            others.push(id);
            // Its other readers first, those of a part that runs the
            // update (the parts run apart).
            for &(reader, _) in &consumers[target.node.index()] {
                if reader != id && parts.together(reader, id) {
                    extra[reader.index()].push(id);
                }
            }
        }
    }
    // Kahn's algorithm, smallest id first, so the order follows the arena
    // where it can; the main iteration's nodes before the entries' (nothing
    // of the main iteration needs an entry's node).
    let mut indeg = vec![0usize; n];
    let mut succ: Vec<Vec<NodeId>> = vec![Vec::new(); n];
    for (i, node) in graph.nodes.iter().enumerate() {
        for inp in &node.inputs {
            succ[inp.node.index()].push(NodeId(i as u32));
            indeg[i] += 1;
        }
        for &after in &extra[i] {
            succ[i].push(after);
            indeg[after.index()] += 1;
        }
    }
    let main = &parts.main;
    let key = |i: usize| Reverse((!main[i], NodeId(i as u32)));
    let mut ready: BinaryHeap<Reverse<(bool, NodeId)>> =
        (0..n).filter(|&i| indeg[i] == 0).map(key).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse((_, id))) = ready.pop() {
        order.push(id);
        for &s in &succ[id.index()] {
            indeg[s.index()] -= 1;
            if indeg[s.index()] == 0 {
                ready.push(key(s.index()));
            }
        }
    }
    if order.len() != n {
        let stuck = (0..n).find(|&i| indeg[i] > 0).unwrap_or(0);
        let node = &graph.nodes[stuck];
        return Err(GraphError::Cycle {
            node: NodeId(stuck as u32),
            name: node.name.clone(),
            op: node.op.name(),
        });
    }
    parts.main_len = parts.main.iter().filter(|&&m| m).count();
    Ok(ValidGraph {
        graph,
        order,
        consumers,
        parts: Box::new(parts),
    })
}

fn types_str(ts: &[TensorType]) -> String {
    let v: Vec<String> = ts.iter().map(|t| t.to_string()).collect();
    format!("({})", v.join(", "))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::tensor::TensorType;

    fn small() -> Graph {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 3]));
        let w = g.variable("w", Tensor::full([3, 4], 0.5));
        let y = g.matmul(x, w);
        let y = g.relu(y);
        g.set_name(y, "y");
        g.finish().unwrap().0
    }

    fn err(g: Graph) -> GraphError {
        validate(g, &GraphLimits::default()).unwrap_err()
    }

    #[test]
    fn valid_graph_orders_nodes() {
        let v = validate(small(), &GraphLimits::default()).unwrap();
        assert_eq!(v.order().len(), 4);
        assert!(v.graph().resolve("y").is_some());
        assert!(v.graph().resolve("y:1").is_none());
    }

    #[test]
    fn cycle_is_named() {
        let mut g = small();
        g.nodes[2].inputs[0] = Outlet::new(NodeId(3), 0);
        g.nodes[2].outputs = vec![TensorType::f32([2, 4])];
        // relu(3) -> matmul(2) -> relu(3): declared types still infer, so the cycle is reported.
        g.nodes[2].inputs[0] = Outlet::new(NodeId(3), 0);
        let e = err(g);
        assert!(
            matches!(e, GraphError::Invalid { .. } | GraphError::Cycle { .. }),
            "{e}"
        );
    }

    #[test]
    fn dangling_and_mismatch() {
        let mut g = small();
        g.nodes[2].inputs[1] = Outlet::new(NodeId(9), 0);
        assert!(matches!(err(g), GraphError::Dangling { input: 1, .. }));
        let mut g = small();
        g.nodes[3].outputs = vec![TensorType::f32([9])];
        assert!(matches!(err(g), GraphError::Invalid { op: "relu", .. }));
        let mut g = small();
        g.nodes[3].name = "x".into();
        assert!(matches!(err(g), GraphError::DuplicateName { .. }));
        assert!(matches!(err(Graph::default()), GraphError::Empty));
    }

    #[test]
    fn true_cycle() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2]));
        let a = g.relu(x);
        let b = g.relu(a);
        let (mut graph, _) = g.finish().unwrap();
        graph.nodes[a.node.index()].inputs[0] = b;
        assert!(matches!(err(graph), GraphError::Cycle { .. }));
    }

    #[test]
    fn in_place_update_runs_after_readers() {
        let mut g = GraphBuilder::new();
        let w = g.variable("w", Tensor::full([3], 1.0));
        let buf = g.variable("buf", Tensor::full([3], 0.0));
        let grad = g.placeholder("grad", TensorType::f32([3]));
        g.op(
            Op::SgdUpdate {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: false,
            },
            &[w, grad, buf],
        );
        let r = g.relu(w); // a reader created after the update
        let (graph, _) = g.finish().unwrap();
        let v = validate(graph, &GraphLimits::default()).unwrap();
        let pos = |id: NodeId| v.order().iter().position(|&x| x == id).unwrap();
        assert!(pos(r.node) < pos(NodeId(3)));
    }

    #[test]
    fn in_place_update_of_non_variable_is_refused() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([3]));
        let y = g.placeholder("y", TensorType::f32([3]));
        g.op(Op::Assign, &[x, y]);
        let (graph, _) = g.finish().unwrap();
        assert!(matches!(
            err(graph),
            GraphError::Invalid { op: "assign", .. }
        ));
    }

    #[test]
    fn limits() {
        let limits = GraphLimits {
            max_nodes: 2,
            ..GraphLimits::default()
        };
        assert!(matches!(
            validate(small(), &limits),
            Err(GraphError::TooManyNodes { nodes: 4, limit: 2 })
        ));
    }
}
