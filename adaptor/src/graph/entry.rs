//! Entries: parts of a graph that a Run runs instead of the main
//! iteration (docs/protocol.md, *Entries*). Which nodes each part runs,
//! the rules they keep, which part a Run's fetches choose, and
//! [`add_entry`], which joins a second graph into a first as an entry on
//! the first's variables.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::{fetch_key, Graph, GraphError, Node, NodeId, Op, Outlet, ValidGraph, VarValues};

/// A named part of a graph that a Run runs instead of the main iteration
/// when it fetches the entry's own outputs: those outputs, the in-place
/// updates it names, and everything they read. Nodes that only entries
/// need never run in the main iteration; the main iteration's nodes an
/// entry also needs (variables, a cast of a weight) run in both. Two uses:
/// a training job's evaluation-mode forward of its current weights (no
/// updates), and its step at another batch size (the same variables'
/// updates, see [`add_entry`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    /// Its outputs as fetch keys (`node` or `node:slot`).
    pub outputs: Vec<String>,
    /// Names of the in-place updates it runs besides what its outputs
    /// read (an optimizer's: they have no outputs to fetch).
    pub updates: Vec<String>,
}

/// At most this many entries per graph.
pub const MAX_ENTRIES: usize = 16;

/// What one Run runs: the main iteration, or one entry (its index in
/// [`Graph::entries`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Main,
    Entry(usize),
}

/// Which nodes each part runs.
#[derive(Debug, Clone)]
pub(super) struct Parts {
    /// Nodes of the main iteration: the first `main_len` of the order.
    pub(super) main_len: usize,
    /// Per node, whether the main iteration runs it.
    pub(super) main: Vec<bool>,
    /// Per entry, per node, whether the entry runs it.
    pub(super) entry_nodes: Vec<Vec<bool>>,
    /// Whether the main iteration, and each entry, updates a variable.
    pub(super) main_updates: bool,
    pub(super) entry_updates: Vec<bool>,
}

impl Parts {
    /// Whether some part runs both `a` and `b` (an update of a variable
    /// and another reader or writer of it must then be ordered).
    pub(super) fn together(&self, a: NodeId, b: NodeId) -> bool {
        let (a, b) = (a.index(), b.index());
        (self.main[a] && self.main[b]) || self.entry_nodes.iter().any(|m| m[a] && m[b])
    }
}

/// Which nodes the main iteration runs and which each entry runs: an
/// entry, its outputs and updates and everything they read; the main
/// iteration, every node no entry needs and everything those read. An
/// entry's outputs are its own and its updates update a variable;
/// `main_len` is filled in once the order is known.
pub(super) fn parts(graph: &Graph) -> Result<Parts, GraphError> {
    let n = graph.nodes.len();
    let updates = |runs: &[bool]| {
        graph
            .nodes
            .iter()
            .zip(runs)
            .any(|(node, &r)| r && !node.op.mutated_inputs().is_empty())
    };
    if graph.entries.is_empty() {
        let main = vec![true; n];
        return Ok(Parts {
            main_len: n,
            main_updates: updates(&main),
            main,
            entry_nodes: Vec::new(),
            entry_updates: Vec::new(),
        });
    }
    if graph.entries.len() > MAX_ENTRIES {
        return Err(GraphError::BadEntry {
            entry: graph.entries[MAX_ENTRIES].name.clone(),
            reason: format!("more than {MAX_ENTRIES} entries"),
        });
    }
    // Ancestors of `roots`, themselves included (inputs resolve: checked
    // before).
    let closure = |roots: &mut Vec<NodeId>| {
        let mut seen = vec![false; n];
        while let Some(id) = roots.pop() {
            if std::mem::replace(&mut seen[id.index()], true) {
                continue;
            }
            roots.extend(graph.nodes[id.index()].inputs.iter().map(|o| o.node));
        }
        seen
    };
    let mut entry_nodes = Vec::with_capacity(graph.entries.len());
    let mut outputs = Vec::with_capacity(graph.entries.len());
    for (k, e) in graph.entries.iter().enumerate() {
        let bad = |reason: String| GraphError::BadEntry {
            entry: e.name.clone(),
            reason,
        };
        if e.name.is_empty() {
            return Err(bad("the name is empty".into()));
        }
        if graph.entries[..k].iter().any(|f| f.name == e.name) {
            return Err(bad("the name is used twice".into()));
        }
        if e.outputs.is_empty() {
            return Err(bad("it has no outputs".into()));
        }
        let mut roots = Vec::with_capacity(e.outputs.len() + e.updates.len());
        for key in &e.outputs {
            let o = graph
                .resolve(key)
                .ok_or_else(|| bad(format!("output `{key}` is no node's output")))?;
            roots.push(o.node);
        }
        outputs.push(roots.clone());
        for name in &e.updates {
            let id = graph
                .find(name)
                .ok_or_else(|| bad(format!("update `{name}` names no node")))?;
            if graph.nodes[id.index()].op.mutated_inputs().is_empty() {
                return Err(bad(format!("`{name}` updates no variable")));
            }
            roots.push(id);
        }
        entry_nodes.push(closure(&mut roots));
    }
    let mut roots: Vec<NodeId> = (0..n)
        .filter(|&i| !entry_nodes.iter().any(|m| m[i]))
        .map(|i| NodeId(i as u32))
        .collect();
    if roots.is_empty() {
        return Err(GraphError::BadEntry {
            entry: graph.entries[0].name.clone(),
            reason: "every node belongs to an entry: the main iteration would run nothing".into(),
        });
    }
    let main = closure(&mut roots);
    for (k, e) in graph.entries.iter().enumerate() {
        for (id, key) in outputs[k].iter().zip(&e.outputs) {
            if main[id.index()] {
                return Err(GraphError::BadEntry {
                    entry: e.name.clone(),
                    reason: format!(
                        "output `{key}` is computed by the main iteration too: an entry's outputs are its own"
                    ),
                });
            }
        }
    }
    Ok(Parts {
        main_len: 0,
        main_updates: updates(&main),
        entry_updates: entry_nodes.iter().map(|m| updates(m)).collect(),
        main,
        entry_nodes,
    })
}

impl ValidGraph {
    /// The main iteration's nodes in execution order (all of [`Self::order`]
    /// for a graph without entries).
    pub fn main_order(&self) -> &[NodeId] {
        &self.order[..self.parts.main_len]
    }
    /// Whether the main iteration runs `id`.
    pub fn in_main(&self, id: NodeId) -> bool {
        self.parts.main.get(id.index()).copied().unwrap_or(false)
    }
    /// Whether `part` runs `id`.
    pub fn runs(&self, part: Part, id: NodeId) -> bool {
        match part {
            Part::Main => self.in_main(id),
            Part::Entry(k) => self
                .parts
                .entry_nodes
                .get(k)
                .and_then(|m| m.get(id.index()))
                .copied()
                .unwrap_or(false),
        }
    }
    /// Whether `part` updates a variable in place.
    pub fn part_updates(&self, part: Part) -> bool {
        match part {
            Part::Main => self.parts.main_updates,
            Part::Entry(k) => self.parts.entry_updates.get(k).copied().unwrap_or(false),
        }
    }
    /// Whether the graph has entries besides its main iteration.
    pub fn has_entries(&self) -> bool {
        !self.parts.entry_nodes.is_empty()
    }
    /// The part a Run fetching `outs` runs: an entry when one of them is
    /// an output only entries compute (then every fetch must be that
    /// entry's node or a variable or constant), the main iteration
    /// otherwise. The error says which fetches cannot go together.
    pub fn part_for(&self, outs: &[Outlet]) -> Result<Part, String> {
        let g = &self.graph;
        let Some(own) = outs.iter().find(|o| !self.in_main(o.node)) else {
            return Ok(Part::Main);
        };
        let source = |o: &Outlet| {
            matches!(
                g.nodes[o.node.index()].op,
                Op::Variable(_) | Op::Constant(_)
            )
        };
        let name = |o: &Outlet| g.nodes[o.node.index()].name.clone();
        let fits = |k: usize| {
            outs.iter()
                .all(|o| source(o) || self.runs(Part::Entry(k), o.node))
        };
        if let Some(k) = (0..g.entries.len()).find(|&k| fits(k)) {
            return Ok(Part::Entry(k));
        }
        // No entry computes them all: name one that its entry lacks.
        let k = (0..g.entries.len())
            .find(|&k| self.runs(Part::Entry(k), own.node))
            .unwrap_or(0);
        let entry = g.entries.get(k).map_or("", |e| e.name.as_str());
        let other = outs
            .iter()
            .find(|o| !source(o) && !self.runs(Part::Entry(k), o.node))
            .map_or_else(String::new, name);
        Err(format!(
            "`{}` is computed by entry `{entry}` and `{other}` outside it: one Run fetches from the main iteration or from one entry",
            name(own)
        ))
    }
}

/// Joins `part` (a graph and its variables' initial values) into `graph`
/// as the entry `name`: its variables are `graph`'s of the same name (the
/// same type, else an error; `graph`'s value is kept), any others join
/// `graph`'s; every other node is renamed `{prefix}{name}`; the entry's
/// outputs are `outputs` (fetch keys in `part`, renamed likewise) and its
/// updates are all of `part`'s in-place updates. A training step at
/// another batch size, its variables and optimizer state named as the
/// main step's, so becomes an entry that trains the same weights.
pub fn add_entry(
    graph: &mut Graph,
    vars: &mut VarValues,
    part: Graph,
    mut part_vars: VarValues,
    name: &str,
    prefix: &str,
    outputs: &[String],
) -> Result<(), GraphError> {
    let bad = |reason: String| GraphError::BadEntry {
        entry: name.to_string(),
        reason,
    };
    if !part.entries.is_empty() {
        return Err(bad("the joined graph has entries of its own".into()));
    }
    let existing: HashMap<&str, NodeId> = graph
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), NodeId(i as u32)))
        .collect();
    let base = graph.nodes.len();
    // Where each of `part`'s nodes lands: a variable of `graph`, or a new
    // node (in `part`'s order after `graph`'s).
    let mut map: Vec<NodeId> = Vec::with_capacity(part.nodes.len());
    let mut added: Vec<(usize, String)> = Vec::new();
    for (i, node) in part.nodes.iter().enumerate() {
        if let (Op::Variable(ty), Some(&id)) = (&node.op, existing.get(node.name.as_str())) {
            match &graph.nodes[id.index()].op {
                Op::Variable(have) if have == ty => {
                    map.push(id);
                    continue;
                }
                _ => {
                    return Err(bad(format!(
                        "variable `{}` is {ty} here and not a variable of that type in the graph",
                        node.name
                    )))
                }
            }
        }
        let renamed = if matches!(node.op, Op::Variable(_)) {
            node.name.clone()
        } else {
            format!("{prefix}{}", node.name)
        };
        if existing.contains_key(renamed.as_str()) {
            return Err(bad(format!("node `{renamed}` is in the graph already")));
        }
        map.push(NodeId((base + added.len()) as u32));
        added.push((i, renamed));
    }
    let mut updates = Vec::new();
    let mut new_vars: BTreeMap<String, crate::tensor::Tensor> = BTreeMap::new();
    let mut nodes: Vec<Node> = Vec::with_capacity(added.len());
    for (i, renamed) in added {
        let node = &part.nodes[i];
        let inputs = node
            .inputs
            .iter()
            .map(|o| {
                map.get(o.node.index())
                    .map(|&n| Outlet::new(n, o.slot))
                    .ok_or_else(|| bad(format!("node `{}` reads no node {}", node.name, o.node)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if matches!(node.op, Op::Variable(_)) {
            let v = part_vars
                .remove(&node.name)
                .ok_or_else(|| bad(format!("variable `{}` has no value", node.name)))?;
            new_vars.insert(renamed.clone(), v);
        }
        if !node.op.mutated_inputs().is_empty() {
            updates.push(renamed.clone());
        }
        nodes.push(Node {
            name: renamed,
            op: node.op.clone(),
            inputs,
            outputs: node.outputs.clone(),
        });
    }
    // Each output by the name its node has in `graph` now.
    let outputs = outputs
        .iter()
        .map(|k| {
            let o = part
                .resolve(k)
                .ok_or_else(|| bad(format!("output `{k}` is no node's output")))?;
            let id = map[o.node.index()];
            let node = match id.index().checked_sub(base) {
                Some(j) => &nodes[j].name,
                None => &graph.nodes[id.index()].name,
            };
            Ok(fetch_key(node, o.slot))
        })
        .collect::<Result<Vec<_>, GraphError>>()?;
    graph.nodes.extend(nodes);
    vars.extend(new_vars);
    graph.entries.push(Entry {
        name: name.to_string(),
        outputs,
        updates,
    });
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::graph::{validate, GraphBuilder, GraphLimits};
    use crate::tensor::{Tensor, TensorType};

    fn err(g: Graph) -> GraphError {
        validate(g, &GraphLimits::default()).unwrap_err()
    }

    #[test]
    fn entry_nodes_come_after_the_main_iteration_and_outside_it() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([3]));
        let w = g.variable("w", Tensor::full([3], 0.5));
        let z = g.placeholder("z", TensorType::f32([3]));
        // The entry's nodes are made first: their ids are smaller.
        let e = g.mul(z, w);
        let e = g.relu(e);
        g.set_name(e, "eval_out");
        let y = g.mul(x, w);
        let d = g.relu(y);
        g.op(Op::Assign, &[w, d]);
        g.entry("eval", &[e]);
        let (graph, _) = g.finish().unwrap();
        let v = validate(graph, &GraphLimits::default()).unwrap();
        let main: Vec<NodeId> = v.main_order().to_vec();
        // x, w, mul, relu, assign: z and the entry's mul and relu are not.
        assert_eq!(main.len(), 5);
        assert!(main.contains(&w.node) && !main.contains(&z.node) && !main.contains(&e.node));
        assert_eq!(&v.order()[..5], &main[..]);
        // The entry reads w after the update in the order (no edge holds
        // the update back for it), and runs w, z and its two ops.
        let pos = |id: NodeId| v.order().iter().position(|&n| n == id).unwrap();
        assert!(pos(e.node) > pos(NodeId(7)));
        let entry: Vec<NodeId> = v
            .order()
            .iter()
            .copied()
            .filter(|&id| v.runs(Part::Entry(0), id))
            .collect();
        assert_eq!(entry.len(), 4);
        assert!(entry.contains(&w.node) && entry.contains(&z.node));
        // Which part a Run runs, from its fetches.
        let out = |k: &str| v.graph().resolve(k).unwrap();
        assert_eq!(v.part_for(&[out("eval_out")]), Ok(Part::Entry(0)));
        assert_eq!(v.part_for(&[out("eval_out"), out("w")]), Ok(Part::Entry(0)));
        assert_eq!(v.part_for(&[out("w")]), Ok(Part::Main));
        assert_eq!(v.part_for(&[d]), Ok(Part::Main));
        let mixed = v.part_for(&[out("eval_out"), d]).unwrap_err();
        assert!(
            mixed.contains("eval_out") && mixed.contains("entry `eval`"),
            "{mixed}"
        );
    }

    #[test]
    fn bad_entries_are_refused_with_the_reason() {
        let bad = |f: &dyn Fn(&mut GraphBuilder, Outlet, Outlet)| {
            let mut g = GraphBuilder::new();
            let x = g.placeholder("x", TensorType::f32([3]));
            let w = g.variable("w", Tensor::full([3], 0.5));
            let y = g.mul(x, w);
            let y = g.relu(y);
            g.set_name(y, "y");
            g.op(Op::Assign, &[w, y]);
            let z = g.placeholder("z", TensorType::f32([3]));
            let e = g.mul(z, w);
            g.set_name(e, "e");
            f(&mut g, y, e);
            match err(g.finish().unwrap().0) {
                GraphError::BadEntry { reason, .. } => reason,
                other => panic!("{other:?}"),
            }
        };
        assert!(bad(&|g, _, e| {
            g.entry("a", &[e]);
            g.entry("a", &[e]);
        })
        .contains("used twice"));
        assert!(bad(&|g, y, _| g.entry("a", &[y])).contains("main iteration too"));
        assert!(bad(&|g, _, _| g.entry("a", &[])).contains("no outputs"));
        assert!(bad(&|g, y, e| g.entry("a", &[y, e])).contains("main iteration"));
        // Updates that name no node, or a node that updates nothing.
        let with_updates = |updates: &[&str]| {
            let mut g = GraphBuilder::new();
            let x = g.placeholder("x", TensorType::f32([3]));
            let w = g.variable("w", Tensor::full([3], 0.5));
            let y = g.mul(x, w);
            g.op(Op::Assign, &[w, y]);
            let z = g.placeholder("z", TensorType::f32([3]));
            let e = g.mul(z, w);
            g.set_name(e, "e");
            let (mut graph, _) = g.finish().unwrap();
            graph.entries.push(Entry {
                name: "a".into(),
                outputs: vec!["e".into()],
                updates: updates.iter().map(|s| s.to_string()).collect(),
            });
            match err(graph) {
                GraphError::BadEntry { reason, .. } => reason,
                other => panic!("{other:?}"),
            }
        };
        assert!(with_updates(&["nope"]).contains("names no node"));
        assert!(with_updates(&["e"]).contains("updates no variable"));
        // Every node in an entry.
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([3]));
        let y = g.relu(x);
        g.entry("all", &[y]);
        assert!(matches!(
            err(g.finish().unwrap().0),
            GraphError::BadEntry { reason, .. } if reason.contains("run nothing")
        ));
        // An output that is no node's.
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([3]));
        g.relu(x);
        let (mut graph, _) = g.finish().unwrap();
        graph.entries.push(Entry {
            name: "x".into(),
            outputs: vec!["nope".into()],
            updates: Vec::new(),
        });
        assert!(matches!(err(graph), GraphError::BadEntry { entry, .. } if entry == "x"));
    }

    /// A step of `w` at batch `n` (x [n, 3] · w, its sum the loss, w
    /// updated by Assign from it).
    fn step(n: usize) -> (Graph, VarValues) {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([n, 3]));
        let w = g.variable("w", Tensor::full([3, 2], 0.5));
        let y = g.matmul(x, w);
        g.set_name(y, "y");
        let t = g.transpose(x, &[1, 0]);
        let d = g.matmul(t, y);
        g.op(Op::Assign, &[w, d]);
        g.finish().unwrap()
    }

    /// The step at 4 with the step at 2 joined as the entry `b2`, the
    /// latter's own value of w set to 9 (not taken: the graph's is).
    fn joined() -> (Graph, VarValues) {
        let (mut graph, mut vars) = step(4);
        let (part, mut part_vars) = step(2);
        part_vars.insert("w".into(), Tensor::full([3, 2], 9.0));
        add_entry(
            &mut graph,
            &mut vars,
            part,
            part_vars,
            "b2",
            "b2/",
            &["y".into()],
        )
        .unwrap();
        (graph, vars)
    }

    #[test]
    fn a_joined_step_updates_the_same_variable_apart_from_the_main_one() {
        let (graph, vars) = joined();
        assert_eq!(vars.len(), 1);
        assert_eq!(vars["w"].f32s().unwrap()[0], 0.5);
        let e = graph.entries[0].clone();
        assert_eq!(e.outputs, vec!["b2/y".to_string()]);
        assert_eq!(e.updates.len(), 1);
        let v = validate(graph, &GraphLimits::default()).unwrap();
        let g = v.graph();
        let id = |name: &str| g.find(name).unwrap();
        let (main_up, entry_up) = (id("assign"), id(&e.updates[0]));
        assert!(v.in_main(main_up) && !v.in_main(entry_up));
        assert!(v.runs(Part::Entry(0), entry_up) && !v.runs(Part::Entry(0), main_up));
        assert!(v.runs(Part::Entry(0), id("w")) && v.runs(Part::Main, id("w")));
        assert!(v.part_updates(Part::Main) && v.part_updates(Part::Entry(0)));
        // Within the entry, its readers of w come before its update.
        let pos = |n: NodeId| v.order().iter().position(|&x| x == n).unwrap();
        assert!(pos(id("b2/y")) < pos(entry_up));
        assert!(v.main_order().len() < v.order().len());
        // An output of the main iteration's is not the entry's.
        let (mut graph, _) = joined();
        graph.entries[0].outputs.push("y".into());
        assert!(matches!(
            validate(graph, &GraphLimits::default()),
            Err(GraphError::BadEntry { reason, .. }) if reason.contains("main iteration too")
        ));
        // Two writers of w in one part are refused: a second update like
        // the entry's own, named among its updates.
        let (mut graph, _) = joined();
        let id = graph.find(&graph.entries[0].updates[0]).unwrap();
        let mut again = graph.nodes[id.index()].clone();
        again.name = "b2/again".into();
        graph.nodes.push(again);
        graph.entries[0].updates.push("b2/again".into());
        let e = validate(graph, &GraphLimits::default()).unwrap_err();
        assert!(e.to_string().contains("already updated"), "{e}");
        // A variable of another type is refused when joining.
        let (mut graph, mut vars) = step(4);
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 4]));
        let w = g.variable("w", Tensor::full([4, 2], 0.5));
        let y = g.matmul(x, w);
        g.set_name(y, "y");
        let (part, part_vars) = g.finish().unwrap();
        let e = add_entry(
            &mut graph,
            &mut vars,
            part,
            part_vars,
            "b",
            "b/",
            &["y".into()],
        );
        assert!(matches!(e, Err(GraphError::BadEntry { reason, .. }) if reason.contains("`w`")));
    }
}
