//! The matcher on half chains (`compile::chains::epilogue`): which nodes a
//! chain spanning casts takes in fp16 and bf16, how each stage rounds, and
//! what it must refuse.

use super::tests::{matched, ranges};
use super::*;
use crate::compile;
use lanes_adaptor::{
    amp, validate, Arch, Conv2dAttrs, DType, GraphBuilder, GraphLimits, Op, Precision, Tensor,
    TensorData, TensorType,
};

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

fn var(g: &mut GraphBuilder, name: &str, dims: &[usize], v: f32, dt: DType) -> Outlet {
    let n: usize = dims.iter().product();
    let data = TensorData::from_f32_rounded(dt, &vec![v; n]).unwrap();
    g.variable(name, Tensor::new(dims.to_vec(), data).unwrap())
}

/// An input [2, 4, 6, 6] fed f32 and cast to `dt`.
fn input(g: &mut GraphBuilder, name: &str, dt: DType) -> Outlet {
    let x = g.placeholder(name, TensorType::f32([2, 4, 6, 6]));
    g.cast(x, dt)
}

/// A 3×3 convolution 4 → 4 in `dt`, with a bias or not.
fn conv(g: &mut GraphBuilder, x: Outlet, name: &str, bias: bool, dt: DType) -> Outlet {
    let w = var(g, &format!("{name}.w"), &[4, 4, 3, 3], 0.1, dt);
    let b = bias.then(|| var(g, &format!("{name}.b"), &[4], 0.5, dt));
    let attrs = Conv2dAttrs {
        padding: [1, 1],
        ..Default::default()
    };
    g.conv2d(x, w, b, attrs)
}

/// An f32 batch norm of `x` (f32).
fn bn(g: &mut GraphBuilder, x: Outlet, name: &str) -> Outlet {
    let v: Vec<Outlet> = ["g", "b", "m", "v"]
        .iter()
        .map(|p| var(g, &format!("{name}.{p}"), &[4], 1.0, DType::F32))
        .collect();
    g.batch_norm(x, v[0], v[1], v[2], v[3], 1e-5)
}

/// A model captured in half: Conv → Cast f32 → BatchNorm → Cast half →
/// Add (half residual) → Relu, one chain of five nodes rounding after the
/// batch norm's cast and the Add.
#[test]
fn captured_half_conv_bn_add_relu_is_one_chain() {
    for dt in HALVES {
        let mut g = GraphBuilder::new();
        let x = input(&mut g, "x", dt);
        let c = conv(&mut g, x, "c", false, dt);
        let w = g.cast(c, DType::F32);
        let b = bn(&mut g, w, "bn");
        let n = g.cast(b, dt);
        let a = g.add(n, x);
        let r = g.relu(a);
        let (_, f) = matched(g, &[]);
        assert_eq!(f.chains.len(), 1, "{dt:?}: {f:?}");
        let ch = &f.chains[0];
        assert_eq!(ch.x, c, "{dt:?}");
        assert_eq!(ch.residual, Some(x), "{dt:?}");
        assert!(ch.bn.is_some() && ch.relu && ch.bias.is_none(), "{dt:?}");
        assert_eq!(ch.nodes, vec![w.node, b.node, n.node, a.node, r.node]);
        assert_eq!(ch.rounds(Stage::Bn), dt);
        assert_eq!(ch.rounds(Stage::Add), dt);
        assert_eq!(ch.rounds(Stage::Relu), dt);
        assert_eq!(ch.rounds(Stage::Bias), DType::F32);
        assert_eq!(f.skipped(), 4);
        assert_eq!(f.role(r.node), Role::Last(0));
        assert_eq!(f.role(c.node), Role::Plain);
        assert_eq!(ch.name(), "fused batch_norm+add+relu");
    }
}

/// The `amp` pass's form: Conv → Cast f32 → BatchNorm → Relu (f32) → Cast
/// half read by the next convolution: one chain, rounding once after the
/// Relu.
#[test]
fn amp_conv_bn_relu_cast_is_one_chain() {
    for dt in HALVES {
        let mut g = GraphBuilder::new();
        let x = input(&mut g, "x", dt);
        let c = conv(&mut g, x, "c", false, dt);
        let w = g.cast(c, DType::F32);
        let b = bn(&mut g, w, "bn");
        let r = g.relu(b);
        let n = g.cast(r, dt);
        let _ = conv(&mut g, n, "c2", false, dt);
        let (_, f) = matched(g, &[]);
        assert_eq!(f.chains.len(), 1, "{dt:?}: {f:?}");
        let ch = &f.chains[0];
        assert_eq!(ch.nodes, vec![w.node, b.node, r.node, n.node]);
        assert_eq!(ch.rounds(Stage::Bn), DType::F32);
        assert_eq!(ch.rounds(Stage::Relu), dt);
        assert_eq!(f.role(n.node), Role::Last(0));
        assert_eq!(ch.name(), "fused batch_norm+relu");
    }
}

/// A residual block's output in the `amp` form: the f32 Relu is read by
/// the next block's Add and, through a Cast, by its convolution. The chain
/// writes the Relu's output and its half copy, ending at the Cast.
#[test]
fn an_f32_result_read_twice_is_written_with_its_half_copy() {
    for dt in HALVES {
        let mut g = GraphBuilder::new();
        let x = input(&mut g, "x", dt);
        let res = g.placeholder("res", TensorType::f32([2, 4, 6, 6]));
        let c = conv(&mut g, x, "c", false, dt);
        let w = g.cast(c, DType::F32);
        let b = bn(&mut g, w, "bn");
        let a = g.add(b, res);
        let r = g.relu(a);
        let h = g.cast(r, dt);
        let c2 = conv(&mut g, h, "c2", false, dt);
        let c2w = g.cast(c2, DType::F32);
        let _ = g.add(c2w, r);
        let (_, f) = matched(g, &[]);
        let ch = f.chains.iter().find(|c| c.bn.is_some()).unwrap();
        assert_eq!(
            ch.nodes,
            vec![w.node, b.node, a.node, r.node, h.node],
            "{dt:?}"
        );
        assert_eq!(ch.also, Some(h));
        assert_eq!(ch.output(), r);
        assert_eq!(ch.writes(), vec![r, h]);
        assert_eq!(ch.rounds(Stage::Relu), DType::F32);
        assert_eq!(f.role(r.node), Role::Skip);
        assert_eq!(f.role(h.node), Role::Last(0));
        // Without the Cast right after it, the Relu's output alone.
        let mut g = GraphBuilder::new();
        let x = input(&mut g, "x", dt);
        let w = g.cast(x, DType::F32);
        let b = bn(&mut g, w, "bn");
        let r = g.relu(b);
        let _ = g.add(r, w);
        let (_, f) = matched(g, &[]);
        let ch = f.chains.iter().find(|c| c.bn.is_some()).unwrap();
        assert_eq!(ch.also, None, "{dt:?}");
        assert_eq!(ch.output(), r);
    }
}

/// A biased f32 convolution read twice, then cast: no chain (its bias add
/// stays with it; the kernel writes no convolution's output).
#[test]
fn a_biased_convolution_read_twice_is_not_a_chain() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 4, 6, 6]));
    let c = conv(&mut g, x, "c", true, DType::F32);
    let h = g.cast(c, DType::BF16);
    let _ = g.relu(h);
    let _ = g.add(c, x);
    let (_, f) = matched(g, &[]);
    assert!(f.chains.iter().all(|ch| ch.bias.is_none()), "{f:?}");
    assert_eq!(f.role(c.node), Role::Plain);
}

/// Without a batch norm: a biased half convolution, a half residual Add and
/// Relu, the bias moved into the kernel and rounded there.
#[test]
fn half_conv_bias_add_relu_fuses() {
    for dt in HALVES {
        let mut g = GraphBuilder::new();
        let x = input(&mut g, "x", dt);
        let c = conv(&mut g, x, "c", true, dt);
        let a = g.add(x, c);
        let r = g.relu(a);
        let (vg, f) = matched(g, &[]);
        assert_eq!(f.chains.len(), 1, "{dt:?}: {f:?}");
        let ch = &f.chains[0];
        let bias = vg.graph().nodes[c.node.index()].inputs[2];
        assert_eq!(ch.bias, Some((c.node, bias)));
        assert_eq!((ch.x, ch.residual), (c, Some(x)));
        assert_eq!(ch.nodes, vec![a.node, r.node]);
        assert_eq!(ch.rounds(Stage::Bias), dt);
        assert_eq!(ch.rounds(Stage::Add), dt);
        assert_eq!(f.role(c.node), Role::ConvWithoutBias);
        assert_eq!(ch.name(), "fused bias+add+relu");
    }
}

/// A second use of an intermediate stops the chain before the node that
/// would skip it: the batch norm's f32 output read again here is written,
/// with the half cast right after it as its copy, and nothing after that
/// joins.
#[test]
fn a_second_use_of_an_intermediate_stops_a_half_chain() {
    for dt in HALVES {
        let mut g = GraphBuilder::new();
        let x = input(&mut g, "x", dt);
        let w = g.cast(x, DType::F32);
        let b = bn(&mut g, w, "bn");
        let n = g.cast(b, dt);
        let r = g.relu(n);
        let other = g.relu(b);
        g.set_name(other, "other");
        let (_, f) = matched(g, &[]);
        assert_eq!(f.chains.len(), 1, "{dt:?}: {f:?}");
        let ch = &f.chains[0];
        assert_eq!(ch.nodes, vec![w.node, b.node, n.node], "{dt:?}");
        assert_eq!((ch.output(), ch.also), (b, Some(n)), "{dt:?}");
        assert_eq!(ch.rounds(Stage::Bn), DType::F32);
        assert_eq!(f.role(r.node), Role::Plain);
        assert_eq!(f.role(other.node), Role::Plain);
    }
}

/// A fetched intermediate (the half cast after the batch norm) is written
/// by its own node: the chain ends there.
#[test]
fn a_fetched_cast_ends_a_half_chain() {
    let dt = DType::BF16;
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x", dt);
    let w = g.cast(x, DType::F32);
    let b = bn(&mut g, w, "bn");
    let n = g.cast(b, dt);
    g.set_name(n, "bn_half");
    let r = g.relu(n);
    let (_, f) = matched(g, &["bn_half"]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    assert_eq!(f.chains[0].nodes, vec![w.node, b.node, n.node]);
    assert_eq!(f.role(r.node), Role::Plain);
}

/// What a half chain must refuse: a widening cast not followed by its batch
/// norm, a narrowing cast to the other half dtype, a residual Add whose
/// operands are not of the value's dtype (an f32 Add after the value was
/// narrowed: a Cast stands between them), a broadcast residual.
#[test]
fn half_chains_refuse_what_does_not_round_alike() {
    // Cast f32 → Relu: no batch norm after the widening cast.
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x", DType::F16);
    let w = g.cast(x, DType::F32);
    let _ = g.relu(w);
    let (_, f) = matched(g, &[]);
    assert!(f.chains.is_empty(), "{f:?}");

    // fp16 in, bf16 out: the chain stops before the bf16 cast.
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x", DType::F16);
    let w = g.cast(x, DType::F32);
    let b = bn(&mut g, w, "bn");
    let n = g.cast(b, DType::BF16);
    let _ = g.relu(n);
    let (_, f) = matched(g, &[]);
    assert_eq!(f.chains.len(), 1, "{f:?}");
    assert_eq!(f.chains[0].nodes, vec![w.node, b.node]);

    // BatchNorm → Cast half → Cast f32 → Add (f32): the second cast is not
    // before a batch norm, so the chain ends at the half cast.
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x", DType::BF16);
    let res = g.placeholder("res", TensorType::f32([2, 4, 6, 6]));
    let w = g.cast(x, DType::F32);
    let b = bn(&mut g, w, "bn");
    let n = g.cast(b, DType::BF16);
    let back = g.cast(n, DType::F32);
    let a = g.add(back, res);
    let _ = g.relu(a);
    let (_, f) = matched(g, &[]);
    let ch = f.chains.iter().find(|c| c.bn.is_some()).unwrap();
    assert_eq!(ch.nodes, vec![w.node, b.node, n.node], "{f:?}");
    assert!(f.chains.iter().all(|c| !c.nodes.contains(&back.node)));

    // A half residual broadcast over the batch: not this kernel's.
    let mut g = GraphBuilder::new();
    let x = input(&mut g, "x", DType::F16);
    let w = g.cast(x, DType::F32);
    let b = bn(&mut g, w, "bn");
    let n = g.cast(b, DType::F16);
    let res = g.placeholder("res", TensorType::f32([1, 4, 6, 6]));
    let res = g.cast(res, DType::F16);
    let a = g.add(n, res);
    let (_, f) = matched(g, &[]);
    assert!(f.chains.iter().all(|c| !c.nodes.contains(&a.node)), "{f:?}");
}

/// The plan keeps what a chain spanning a cast reads alive to its last
/// node: its output never lands on them, and every chain the matcher finds
/// on a layout where no two tensors share a byte fuses on the plan. For the
/// zoo's ResNet-50 and Inception-v3 in fp16 and bf16 (the `amp` pass),
/// every batch norm fuses.
#[test]
fn zoo_cnns_in_half_fuse_every_batch_norm() {
    for arch in [Arch::ResNet50, Arch::InceptionV3] {
        for p in [Precision::F16, Precision::Bf16, Precision::F16Mixed] {
            let m = arch.inference(2, 0).unwrap();
            let (graph, _) = amp::apply(m.graph, m.vars, p).unwrap();
            let vg = validate(graph, &GraphLimits::default()).unwrap();
            let plan = compile::plan(&vg).unwrap();
            compile::verify(&plan).unwrap();
            let fetchable: HashSet<Outlet> = plan.fetched.iter().copied().collect();
            let apart = |o: Outlet| {
                let k = (o.node.index() * 8 + o.slot as usize) << 24;
                Some((k, k + 1))
            };
            let all = find_chains(vg.graph(), vg.order(), &fetchable, &apart);
            let f = find_chains(vg.graph(), vg.order(), &fetchable, &ranges(&plan));
            let what = format!("{} {p}", arch.name());
            assert_eq!(f.chains, all.chains, "{what}");
            let bns = vg
                .graph()
                .nodes
                .iter()
                .filter(|n| matches!(n.op, Op::BatchNorm { .. }))
                .count();
            let fused = f.chains.iter().filter(|c| c.bn.is_some()).count();
            let casts = f
                .chains
                .iter()
                .flat_map(|c| &c.nodes)
                .filter(|n| matches!(vg.graph().nodes[n.index()].op, Op::Cast { .. }))
                .count();
            eprintln!(
                "{what}: {} chains, {fused} of {bns} batch norms, {casts} casts, {} nodes skipped",
                f.chains.len(),
                f.skipped()
            );
            assert_eq!(fused, bns, "{what}");
            // Each batch norm's widening cast at least.
            assert!(casts >= bns, "{what}: {casts} casts");
        }
    }
}
