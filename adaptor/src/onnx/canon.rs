//! Canonical forms after import, so that an imported graph runs as the
//! zoo's graph of the same architecture does (the executor's fusions match
//! the zoo's patterns):
//!
//! - **Common subexpressions**: a node that computes what an earlier node
//!   computes (the same op on the same inputs; constants by value) is
//!   replaced by it. Exporters repeat per layer what depends only on the
//!   inputs: Hugging Face's attention mask, made again in each of BERT's
//!   layers, becomes one tensor as in the zoo.
//! - **Scaled products**: `MatMul(a · s, b · t)`, `s` and `t` one-element
//!   f32 constants and each scaled operand read by the product alone,
//!   becomes `Scale(MatMul(a, b), s · t)`. PyTorch's scaled-dot-product
//!   attention exports its scale as √scale on q and on k; scaling the
//!   scores instead is what the softmax chain (`compile::chains`) takes in,
//!   as the zoo's attention writes it. It rounds differently (one product
//!   instead of two), within an f32 ulp or so of each score.
//! - **Dead nodes**: what no output reads is dropped (placeholders and
//!   variables stay).
//!
//! The pass keeps node names, so fetch keys and variable names hold.

use std::collections::{HashMap, HashSet};

use crate::graph::{Graph, Node, NodeId, Op, Outlet};
use crate::tensor::DType;

/// What [`simplify`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Simplified {
    /// Nodes replaced by an earlier equal one.
    pub merged: usize,
    /// Scaled products rewritten.
    pub scales: usize,
    /// Nodes dropped because nothing read them.
    pub dead: usize,
}

/// Rewrites `g` (see the module docs); `outputs` names the nodes whose
/// outputs are fetched, which stay as they are. A graph whose nodes are
/// not in topological order by index is returned unchanged.
pub fn simplify(g: Graph, outputs: &HashSet<String>) -> (Graph, Simplified) {
    let topological = g.nodes.iter().enumerate().all(|(i, n)| {
        n.inputs
            .iter()
            .all(|o| o.node.index() < i && g.node(o.node).is_some())
    });
    if !topological {
        return (g, Simplified::default());
    }
    let mut stats = Simplified::default();
    let mut uses: HashMap<Outlet, usize> = HashMap::new();
    for n in &g.nodes {
        for &o in &n.inputs {
            *uses.entry(o).or_default() += 1;
        }
    }
    let names: HashSet<&str> = g.nodes.iter().map(|n| n.name.as_str()).collect();
    let mut out: Vec<Node> = Vec::with_capacity(g.nodes.len());
    // Old node -> the new node standing for its outputs.
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    // (op name, inputs) -> new nodes with that key.
    let mut seen: HashMap<(&'static str, Vec<Outlet>), Vec<NodeId>> = HashMap::new();
    // The Scale nodes of rewritten products.
    let mut scales = HashSet::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let inputs: Vec<Outlet> = node
            .inputs
            .iter()
            .map(|o| Outlet::new(map[o.node.index()], o.slot))
            .collect();
        let kept = outputs.contains(&node.name);
        if !kept && mergeable(&node.op) {
            let key = (node.op.name(), inputs.clone());
            let same = seen.get(&key).and_then(|ids| {
                ids.iter().copied().find(|id| {
                    let m = &out[id.index()];
                    m.op == node.op && m.outputs == node.outputs
                })
            });
            if let Some(id) = same {
                map.push(id);
                stats.merged += 1;
                continue;
            }
        }
        let id = NodeId(out.len() as u32);
        let scaled = scaled_product(&g, &out, &uses, outputs, i, &inputs);
        match scaled {
            Some((a, b, factor)) if !names.contains(format!("{}/unscaled", node.name).as_str()) => {
                out.push(Node {
                    name: format!("{}/unscaled", node.name),
                    op: node.op.clone(),
                    inputs: vec![a, b],
                    outputs: node.outputs.clone(),
                });
                let scale = NodeId(out.len() as u32);
                out.push(Node {
                    name: node.name.clone(),
                    op: Op::Scale(factor),
                    inputs: vec![Outlet::new(id, 0)],
                    outputs: node.outputs.clone(),
                });
                map.push(scale);
                scales.insert(scale);
                stats.scales += 1;
            }
            _ => {
                if mergeable(&node.op) {
                    seen.entry((node.op.name(), inputs.clone()))
                        .or_default()
                        .push(id);
                }
                out.push(Node {
                    name: node.name.clone(),
                    op: node.op.clone(),
                    inputs,
                    outputs: node.outputs.clone(),
                });
                map.push(id);
            }
        }
    }
    let out = sink(out, &scales);
    let (graph, dead) = drop_dead(out, outputs);
    stats.dead = dead;
    (graph, stats)
}

/// Moves each of the `late` nodes to just before its first reader (the end
/// when none), keeping the rest in order: a scaled product's Scale then runs
/// right before the mask Add and the softmax it feeds, where the softmax
/// chain takes it in, even when the mask is computed after the product.
fn sink(nodes: Vec<Node>, late: &HashSet<NodeId>) -> Vec<Node> {
    if late.is_empty() {
        return nodes;
    }
    let mut order = Vec::with_capacity(nodes.len());
    let mut placed = vec![false; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        if late.contains(&NodeId(i as u32)) {
            continue;
        }
        for o in &n.inputs {
            let k = o.node.index();
            // A late node reads only earlier, already placed nodes.
            if late.contains(&o.node) && !placed[k] {
                placed[k] = true;
                order.push(k);
            }
        }
        placed[i] = true;
        order.push(i);
    }
    for (i, done) in placed.iter().enumerate() {
        if !done {
            order.push(i);
        }
    }
    let mut new_id = vec![NodeId(0); nodes.len()];
    for (to, &from) in order.iter().enumerate() {
        new_id[from] = NodeId(to as u32);
    }
    let mut slots: Vec<Option<Node>> = nodes.into_iter().map(Some).collect();
    order
        .iter()
        .filter_map(|&from| slots[from].take())
        .map(|mut n| {
            for o in &mut n.inputs {
                o.node = new_id[o.node.index()];
            }
            n
        })
        .collect()
}

/// Whether two nodes with this op and the same inputs compute the same:
/// pure ops, constants by value; not sources a job feeds or owns, nor ops
/// that update their inputs.
fn mergeable(op: &Op) -> bool {
    !matches!(op, Op::Placeholder(_) | Op::Variable(_)) && op.mutated_inputs().is_empty()
}

/// For old node `i`, a product whose (new) `inputs` are both one-element
/// constant scalings read by it alone: the unscaled operands and the
/// factor.
fn scaled_product(
    g: &Graph,
    out: &[Node],
    uses: &HashMap<Outlet, usize>,
    outputs: &HashSet<String>,
    i: usize,
    inputs: &[Outlet],
) -> Option<(Outlet, Outlet, f32)> {
    let node = &g.nodes[i];
    if !matches!(node.op, Op::MatMul { .. }) || inputs.len() != 2 {
        return None;
    }
    if node.outputs.first().map(|t| t.dtype) != Some(DType::F32) {
        return None;
    }
    // The old operands, for their uses.
    let single = node
        .inputs
        .iter()
        .all(|o| uses.get(o) == Some(&1) && !outputs.contains(&g.nodes[o.node.index()].name));
    if !single || node.inputs[0] == node.inputs[1] {
        return None;
    }
    let (a, s) = scaling(out, inputs[0])?;
    let (b, t) = scaling(out, inputs[1])?;
    let factor = s * t;
    factor.is_finite().then_some((a, b, factor))
}

/// `o` as `x · c`, `c` a one-element f32 constant, `x` of `o`'s type: `x`
/// and `c`'s value.
fn scaling(out: &[Node], o: Outlet) -> Option<(Outlet, f32)> {
    let n = out.get(o.node.index())?;
    if !matches!(n.op, Op::Mul) || o.slot != 0 {
        return None;
    }
    let ty = n.outputs.first()?;
    let constant = |k: usize| -> Option<f32> {
        let c = out.get(n.inputs.get(k)?.node.index())?;
        match &c.op {
            Op::Constant(t) if t.numel() == 1 && t.dtype() == DType::F32 => {
                t.f32s().ok()?.first().copied()
            }
            _ => None,
        }
    };
    let type_of = |x: Outlet| out.get(x.node.index())?.outputs.get(x.slot as usize);
    for (k, other) in [(1, 0), (0, 1)] {
        let (Some(c), Some(&x)) = (constant(k), n.inputs.get(other)) else {
            continue;
        };
        if type_of(x) == Some(ty) {
            return Some((x, c));
        }
    }
    None
}

/// Drops nodes no output reads (placeholders and variables stay) and
/// renumbers the rest.
fn drop_dead(nodes: Vec<Node>, outputs: &HashSet<String>) -> (Graph, usize) {
    let mut live = vec![false; nodes.len()];
    for i in (0..nodes.len()).rev() {
        let n = &nodes[i];
        if matches!(n.op, Op::Placeholder(_) | Op::Variable(_))
            || outputs.contains(&n.name)
            || !n.op.mutated_inputs().is_empty()
        {
            live[i] = true;
        }
        if live[i] {
            for o in &n.inputs {
                live[o.node.index()] = true;
            }
        }
    }
    let mut new_id = vec![NodeId(0); nodes.len()];
    let mut kept = Vec::with_capacity(nodes.len());
    let mut dead = 0;
    for (i, mut n) in nodes.into_iter().enumerate() {
        if !live[i] {
            dead += 1;
            continue;
        }
        new_id[i] = NodeId(kept.len() as u32);
        for o in &mut n.inputs {
            o.node = new_id[o.node.index()];
        }
        kept.push(n);
    }
    (
        Graph {
            nodes: kept,
            entries: Vec::new(),
        },
        dead,
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::graph::GraphBuilder;
    use crate::tensor::{Tensor, TensorType};

    fn names(v: &[&str]) -> HashSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn count(g: &Graph, name: &str) -> usize {
        g.nodes.iter().filter(|n| n.op.name() == name).count()
    }

    #[test]
    fn repeated_subexpressions_merge_and_dead_nodes_go() {
        let mut b = GraphBuilder::new();
        let m = b.placeholder("mask", TensorType::f32([2, 4]));
        let x = b.placeholder("x", TensorType::f32([2, 4]));
        // The same mask made twice, each with its own equal constant.
        let c1 = b.constant(Tensor::full([2, 4], -1.0));
        let m1 = b.mul(m, c1);
        let c2 = b.constant(Tensor::full([2, 4], -1.0));
        let m2 = b.mul(m, c2);
        let y1 = b.add(x, m1);
        let y2 = b.add(y1, m2);
        b.set_name(y2, "y");
        // A constant of another value is not merged.
        let c3 = b.constant(Tensor::full([2, 4], 2.0));
        let y3 = b.mul(y2, c3);
        b.set_name(y3, "z");
        let (g, _) = b.finish().unwrap();
        let before = g.nodes.len();
        let (s, st) = simplify(g, &names(&["y", "z"]));
        assert_eq!(count(&s, "mul"), 2, "{s:#?}");
        assert_eq!(count(&s, "constant"), 2);
        assert_eq!(st.merged, 2);
        assert_eq!(s.nodes.len(), before - 2);
        // y reads the one mask twice.
        let y = &s.nodes[s.find("y").unwrap().index()];
        let first = &s.nodes[y.inputs[0].node.index()];
        assert_eq!(first.inputs[1], y.inputs[1]);
        assert!(s.find("z").is_some() && s.find("x").is_some());
    }

    #[test]
    fn an_output_is_never_merged_away() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", TensorType::f32([3]));
        let a = b.relu(x);
        b.set_name(a, "a");
        let c = b.relu(x);
        b.set_name(c, "c");
        let (g, _) = b.finish().unwrap();
        let (s, st) = simplify(g, &names(&["a", "c"]));
        assert_eq!(st.merged, 0);
        assert_eq!(count(&s, "relu"), 2);
    }

    fn attention(scale_k_twice: bool) -> (Graph, HashSet<String>) {
        let mut b = GraphBuilder::new();
        let q = b.placeholder("q", TensorType::f32([2, 3, 4]));
        let k = b.placeholder("k", TensorType::f32([2, 4, 3]));
        let s = b.constant(Tensor::from_f32([], vec![0.5]).unwrap());
        let t = b.constant(Tensor::from_f32([1], vec![0.25]).unwrap());
        let qs = b.mul(q, s);
        let ks = b.mul(t, k);
        let scores = b.matmul(qs, ks);
        b.set_name(scores, "scores");
        let p = b.softmax(scores, 2);
        b.set_name(p, "p");
        let mut out = vec!["p"];
        if scale_k_twice {
            let other = b.relu(ks);
            b.set_name(other, "other");
            out.push("other");
        }
        (b.finish().unwrap().0, names(&out))
    }

    #[test]
    fn a_product_of_scaled_operands_scales_the_product() {
        let (g, outs) = attention(false);
        let (s, st) = simplify(g, &outs);
        assert_eq!(st.scales, 1);
        assert_eq!(count(&s, "mul"), 0, "{s:#?}");
        let scores = &s.nodes[s.find("scores").unwrap().index()];
        assert_eq!(scores.op, Op::Scale(0.125));
        let mm = &s.nodes[scores.inputs[0].node.index()];
        assert!(matches!(mm.op, Op::MatMul { .. }));
        assert_eq!(mm.name, "scores/unscaled");
        let from: Vec<&str> = mm
            .inputs
            .iter()
            .map(|o| s.nodes[o.node.index()].name.as_str())
            .collect();
        assert_eq!(from, ["q", "k"]);
        // Right before the softmax, as the softmax chain wants it.
        assert_eq!(
            s.find("scores").unwrap().index() + 1,
            s.find("p").unwrap().index()
        );
    }

    #[test]
    fn the_scale_moves_to_just_before_its_reader() {
        let mut b = GraphBuilder::new();
        let q = b.placeholder("q", TensorType::f32([2, 3, 3]));
        let k = b.placeholder("k", TensorType::f32([2, 3, 3]));
        let m = b.placeholder("m", TensorType::f32([2, 3, 3]));
        let s = b.constant(Tensor::from_f32([], vec![0.5]).unwrap());
        let qs = b.mul(q, s);
        let ks = b.mul(k, s);
        let scores = b.matmul(qs, ks);
        b.set_name(scores, "scores");
        // The mask is made after the product, before the Add.
        let mask = b.relu(m);
        b.set_name(mask, "mask");
        let a = b.add(scores, mask);
        b.set_name(a, "masked");
        let p = b.softmax(a, 2);
        b.set_name(p, "p");
        let (g, _) = b.finish().unwrap();
        let (s, st) = simplify(g, &names(&["p"]));
        assert_eq!(st.scales, 1);
        let at = |n: &str| s.find(n).unwrap().index();
        assert!(at("mask") < at("scores"), "{s:#?}");
        assert_eq!(at("scores") + 1, at("masked"));
        // Every input still comes before its reader.
        for (i, n) in s.nodes.iter().enumerate() {
            assert!(n.inputs.iter().all(|o| o.node.index() < i), "{s:#?}");
        }
        assert_eq!(
            s.nodes[at("scores")].inputs[0].node.index(),
            at("scores/unscaled")
        );
    }

    #[test]
    fn a_scaled_operand_read_elsewhere_stays() {
        let (g, outs) = attention(true);
        let (s, st) = simplify(g, &outs);
        assert_eq!(st.scales, 0);
        assert_eq!(count(&s, "mul"), 2);
    }

    #[test]
    fn a_graph_out_of_order_is_left_alone() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", TensorType::f32([3]));
        let y = b.relu(x);
        b.set_name(y, "y");
        let (mut g, _) = b.finish().unwrap();
        g.nodes.swap(0, 1);
        g.nodes[1].inputs.clear();
        g.nodes[0].inputs = vec![Outlet::new(NodeId(1), 0)];
        let (s, st) = simplify(g.clone(), &names(&["y"]));
        assert_eq!(s, g);
        assert_eq!(st, Simplified::default());
    }
}
