//! The matcher on the CPU: which chains fuse and which must not.

use super::*;
use crate::compile::{self, MemoryPlan};
use lanes_adaptor::{
    validate, Arch, Conv2dAttrs, GraphBuilder, GraphLimits, Op, Tensor, TensorType, ValidGraph,
};

/// Ranges of `plan`'s ephemeral tensors.
pub(super) fn ranges(plan: &MemoryPlan) -> impl Fn(Outlet) -> Option<(usize, usize)> + '_ {
    move |o| {
        plan.slot(o)
            .map(|s| (s.offset as usize, (s.offset + s.bytes) as usize))
    }
}

/// Validates `g`, plans it for its sinks plus `fetch`, and matches.
pub(super) fn matched(g: GraphBuilder, fetch: &[&str]) -> (ValidGraph, Fusion) {
    let (graph, _) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let mut fetchable = compile::sinks(&vg);
    for k in fetch {
        fetchable.insert(vg.graph().resolve(k).unwrap());
    }
    let plan = compile::plan_outlets(&vg, fetchable.clone(), Default::default()).unwrap();
    let f = find_chains(vg.graph(), vg.order(), &fetchable, &ranges(&plan));
    (vg, f)
}

/// x [2, 4, 6, 6] → conv (4 → 4, 3×3, pad 1, bias or not).
fn conv(g: &mut GraphBuilder, x: Outlet, name: &str, bias: bool) -> Outlet {
    let w = g.variable(&format!("{name}.w"), Tensor::full([4, 4, 3, 3], 0.1));
    let b = bias.then(|| g.variable(&format!("{name}.b"), Tensor::full([4], 0.5)));
    let attrs = Conv2dAttrs {
        padding: [1, 1],
        ..Default::default()
    };
    g.conv2d(x, w, b, attrs)
}

fn bn(g: &mut GraphBuilder, x: Outlet, name: &str) -> Outlet {
    let v: Vec<Outlet> = ["g", "b", "m", "v"]
        .iter()
        .map(|p| g.variable(&format!("{name}.{p}"), Tensor::full([4], 1.0)))
        .collect();
    g.batch_norm(x, v[0], v[1], v[2], v[3], 1e-5)
}

fn input(g: &mut GraphBuilder, name: &str) -> Outlet {
    g.placeholder(name, TensorType::f32([2, 4, 6, 6]))
}

#[test]
fn conv_bn_relu_fuses_bn_and_relu() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let c = conv(&mut g, x, "c", false);
    let b = bn(&mut g, c, "bn");
    let r = g.relu(b);
    let (_, f) = matched(g, &[]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    let ch = &f.chains[0];
    assert_eq!(ch.x, c);
    assert!(ch.bn.is_some() && ch.relu && ch.residual.is_none() && ch.bias.is_none());
    assert_eq!(ch.nodes, vec![b.node, r.node]);
    assert_eq!(f.role(b.node), Role::Skip);
    assert_eq!(f.role(r.node), Role::Last(0));
    assert_eq!(f.role(c.node), Role::Plain);
    assert_eq!(ch.name(), "fused batch_norm+relu");
}

#[test]
fn conv_bn_add_relu_fuses_with_the_residual() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let c = conv(&mut g, x, "c", false);
    let b = bn(&mut g, c, "bn");
    // The residual on the left: the order of the Add's operands is free.
    let a = g.add(x, b);
    let r = g.relu(a);
    let (_, f) = matched(g, &[]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    let ch = &f.chains[0];
    assert_eq!((ch.x, ch.residual, ch.relu), (c, Some(x), true));
    assert_eq!(ch.nodes, vec![b.node, a.node, r.node]);
    assert_eq!(f.role(a.node), Role::Skip);
    assert_eq!(f.skipped(), 2);
    assert_eq!(ch.name(), "fused batch_norm+add+relu");
}

#[test]
fn bn_relu_without_a_conv_fuses() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let b = bn(&mut g, x, "bn");
    let _ = g.relu(b);
    let (_, f) = matched(g, &[]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    assert_eq!(f.chains[0].x, x);
}

#[test]
fn conv_bias_relu_moves_the_bias_into_the_kernel() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let c = conv(&mut g, x, "c", true);
    let r = g.relu(c);
    let (vg, f) = matched(g, &[]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    let ch = &f.chains[0];
    assert_eq!(ch.x, c);
    let b = vg.graph().nodes[c.node.index()].inputs[2];
    assert_eq!(ch.bias, Some((c.node, b)));
    assert_eq!(f.role(c.node), Role::ConvWithoutBias);
    assert_eq!(f.role(r.node), Role::Last(0));
    assert_eq!(ch.name(), "fused bias+relu");
}

#[test]
fn a_fetchable_intermediate_stops_the_chain() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let c = conv(&mut g, x, "c", false);
    let b = bn(&mut g, c, "bn");
    g.set_name(b, "bn_out");
    let _ = g.relu(b);
    let (_, f) = matched(g, &["bn_out"]);
    assert!(f.chains.is_empty(), "{f:?}");
    // A fetched conv output keeps its bias add too.
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let c = conv(&mut g, x, "c", true);
    g.set_name(c, "conv_out");
    let _ = g.relu(c);
    let (_, f) = matched(g, &["conv_out"]);
    assert!(f.chains.is_empty(), "{f:?}");
}

#[test]
fn an_intermediate_with_two_users_stops_the_chain() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let b = bn(&mut g, x, "bn");
    let r = g.relu(b);
    let _ = g.add(r, b);
    let (_, f) = matched(g, &[]);
    assert!(
        f.chains.iter().all(|c| c.bn.is_none()),
        "the batch norm's output is read twice: {f:?}"
    );
    // bn+add+relu: the Add's output read twice keeps the Add and Relu apart.
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let b = bn(&mut g, x, "bn");
    let a = g.add(b, x);
    let r = g.relu(a);
    let _ = g.add(r, a);
    let (_, f) = matched(g, &[]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    assert_eq!(f.chains[0].nodes, vec![b.node, a.node]);
    assert!(!f.chains[0].relu);
}

#[test]
fn a_node_between_the_ops_stops_the_chain() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let y = input(&mut g, "y");
    let b = bn(&mut g, x, "bn");
    let other = g.relu(y);
    let r = g.relu(b);
    let (graph, _) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let plan = compile::plan(&vg).unwrap();
    let fetchable = compile::sinks(&vg);
    // Any order with `other` between the batch norm and its Relu.
    let mut order: Vec<NodeId> = vg
        .order()
        .iter()
        .copied()
        .filter(|&n| n != other.node && n != r.node)
        .collect();
    let at = order.iter().position(|&n| n == b.node).unwrap();
    order.insert(at + 1, other.node);
    order.insert(at + 2, r.node);
    let f = find_chains(vg.graph(), &order, &fetchable, &ranges(&plan));
    assert!(f.chains.is_empty(), "{f:?}");
    // Back to back, they fuse.
    order.swap(at + 1, at + 2);
    let f = find_chains(vg.graph(), &order, &fetchable, &ranges(&plan));
    assert_eq!(f.chains.len(), 1, "{f:?}");
}

#[test]
fn the_output_may_only_overlap_an_input_exactly() {
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let res = input(&mut g, "res");
    let b = bn(&mut g, x, "bn");
    let a = g.add(b, res);
    let r = g.relu(a);
    let (graph, _) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let fetchable = compile::sinks(&vg);
    let bytes = 2 * 4 * 6 * 6 * 4;
    // Every tensor in its own bytes except the output, placed by `out_at`.
    let layout = |out_at: usize| {
        move |o: Outlet| -> Option<(usize, usize)> {
            let k = if o == r {
                return Some((out_at, out_at + bytes));
            } else if o == x {
                0
            } else if o == res {
                1
            } else if o == b {
                2
            } else if o == a {
                3
            } else {
                return None;
            };
            Some((k * 4096, k * 4096 + bytes))
        }
    };
    // The node the fused chain ends at, if any.
    let last = |out_at: usize| {
        let f = find_chains(vg.graph(), vg.order(), &fetchable, &layout(out_at));
        assert!(f.chains.len() <= 1, "{f:?}");
        f.chains.first().map(Chain::last)
    };
    assert_eq!(last(8 * 4096), Some(r.node), "disjoint");
    assert_eq!(last(0), Some(r.node), "on x exactly");
    assert_eq!(last(4096), Some(r.node), "on the residual exactly");
    assert_eq!(last(2 * 4096), Some(r.node), "on the skipped intermediate");
    // Partly over an input: the chain stops short of the Relu (the Add's
    // output has its own bytes), or does not form.
    assert_eq!(last(256), Some(a.node), "partly over x");
    assert_eq!(last(4096 - 256), Some(a.node), "partly over the residual");
    assert_eq!(
        last(3 * 4096 + 256),
        Some(r.node),
        "over the skipped Add output"
    );
}

#[test]
fn training_graphs_and_broadcasts_do_not_fuse() {
    // Add with a broadcast operand.
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x");
    let b = bn(&mut g, x, "bn");
    let bias = g.variable("bias", Tensor::full([6], 1.0));
    let _ = g.add(b, bias);
    let (_, f) = matched(g, &[]);
    assert!(f.chains.is_empty(), "{f:?}");
}

/// The zoo's inference CNNs: how much fuses with the planner's layout
/// (`--nocapture` prints the counts).
#[test]
fn zoo_cnns_fuse_most_batch_norms() {
    for arch in [Arch::ResNet50, Arch::InceptionV3] {
        let m = arch.inference(2, 0).unwrap();
        let vg = validate(m.graph, &GraphLimits::default()).unwrap();
        let fetchable = compile::sinks(&vg);
        let plan = compile::plan_outlets(&vg, fetchable.clone(), Default::default()).unwrap();
        let f = find_chains(vg.graph(), vg.order(), &fetchable, &ranges(&plan));
        let bns = vg
            .graph()
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::BatchNorm { .. }))
            .count();
        let fused_bns = f.chains.iter().filter(|c| c.bn.is_some()).count();
        eprintln!(
            "{}: {} chains, {} of {bns} batch norms fused, {} nodes skipped",
            arch.name(),
            f.chains.len(),
            fused_bns,
            f.skipped()
        );
        // Those left out: a batch norm whose Relu's output the planner put
        // partly over its input (Inception-v3: 10 of 94), and ResNet's
        // shortcut batch norms (their output is the residual of a chain).
        assert!(
            fused_bns * 20 >= bns * 17,
            "{}: {fused_bns} of {bns}",
            arch.name()
        );
    }
}

#[test]
fn linear_bias_then_gelu_fuses_as_a_row_chain() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 3, 8]));
    let w = g.variable("w", Tensor::full([8, 8], 0.1));
    let b = g.variable("b", Tensor::full([8], 0.1));
    let m = g.matmul(x, w);
    // The bias on the left: the order of the Add's operands is free.
    let a = g.add(b, m);
    let y = g.gelu(a);
    let (_, f) = matched(g, &[]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    let ch = &f.chains[0];
    assert_eq!((ch.x, ch.row), (m, Some((b, Act::Gelu))));
    assert_eq!(ch.nodes, vec![a.node, y.node]);
    assert_eq!(f.role(a.node), Role::Skip);
    assert_eq!(ch.name(), "fused bias_row+gelu");
    // A bias along another axis is not a row bias.
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 8, 3]));
    let b = g.variable("b", Tensor::full([8, 1], 0.1));
    let a = g.add(x, b);
    let _ = g.gelu(a);
    let (_, f) = matched(g, &[]);
    assert!(f.chains.is_empty(), "{f:?}");
}

/// BERT's feed-forward bias + GELU fuses in every layer.
#[test]
fn bert_bias_gelu_fuses_in_every_layer() {
    let m = Arch::BertBase { seq: 16 }.inference(1, 0).unwrap();
    let vg = validate(m.graph, &GraphLimits::default()).unwrap();
    let fetchable = compile::sinks(&vg);
    let plan = compile::plan_outlets(&vg, fetchable.clone(), Default::default()).unwrap();
    let f = find_chains(vg.graph(), vg.order(), &fetchable, &ranges(&plan));
    let gelus = vg
        .graph()
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Gelu))
        .count();
    let fused = f
        .chains
        .iter()
        .filter(|c| matches!(c.row, Some((_, Act::Gelu))))
        .count();
    eprintln!(
        "bert_base: {} chains, {fused} of {gelus} GELUs",
        f.chains.len()
    );
    assert!(gelus > 0 && fused * 20 >= gelus * 17, "{fused} of {gelus}");
}

/// Inception-v3 (batch 8, 299×299) on the planner's layout: every chain
/// the matcher finds on a layout where no two tensors share a byte also
/// fuses on the plan (the planner puts a chain's last output exactly over
/// its convolution's output, or apart from it).
#[test]
fn inception_chains_all_fuse_on_the_planner_layout() {
    let m = lanes_adaptor::Arch::InceptionV3.inference(8, 0).unwrap();
    let limits = GraphLimits {
        max_nodes: 1 << 20,
        ..Default::default()
    };
    let vg = validate(m.graph, &limits).unwrap();
    let plan = compile::plan(&vg).unwrap();
    compile::verify(&plan).unwrap();
    assert_eq!(plan.ephemeral, plan.lower_bound);
    let fetchable: HashSet<Outlet> = plan.fetched.iter().copied().collect();
    let apart = |o: Outlet| {
        let k = (o.node.index() * 8 + o.slot as usize) << 24;
        Some((k, k + 1))
    };
    let all = find_chains(vg.graph(), vg.order(), &fetchable, &apart);
    let f = find_chains(vg.graph(), vg.order(), &fetchable, &ranges(&plan));
    assert_eq!(all.chains.len(), 94);
    assert_eq!(f.chains, all.chains);
}
