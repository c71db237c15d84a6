//! Unit tests of reverse-mode differentiation.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use crate::graph::{validate, GraphLimits};

#[test]
fn gradients_of_a_linear_layer_validate() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4, 3]));
    let w = g.variable("w", Tensor::full([5, 3], 0.1));
    let b = g.variable("b", Tensor::full([5], 0.0));
    let h = g.matmul_t(x, w, false, true);
    let h = g.add(h, b);
    let h = g.relu(h);
    let l = g.mean(h, &[0, 1], false);
    let wrt = trainable_variables(&g, l);
    assert_eq!(wrt, vec![w, b]);
    let gr = gradients(&mut g, l, &wrt).unwrap();
    assert_eq!(g.dims(gr[0].unwrap()), vec![5, 3]);
    assert_eq!(g.dims(gr[1].unwrap()), vec![5]);
    let (graph, _) = g.finish().unwrap();
    validate(graph, &GraphLimits::default()).unwrap();
}

#[test]
fn fan_out_accumulates() {
    let mut g = GraphBuilder::new();
    let w = g.variable("w", Tensor::full([2], 1.0));
    let a = g.mul(w, w);
    let l = g.sum(a, &[0], false);
    let gr = gradients(&mut g, l, &[w]).unwrap()[0].unwrap();
    let node = &g.graph_nodes()[gr.node.index()];
    assert_eq!(node.op, Op::Add);
}

#[test]
fn slices_that_tile_their_input_get_one_concat() {
    // q, k, v = w[0:2], w[2:4], w[4:6] (any order): one Concat, no
    // SliceGrad, no Add.
    let mut g = GraphBuilder::new();
    let w = g.variable("w", Tensor::full([6, 3], 1.0));
    let k = g.slice(w, 0, 2, 4);
    let q = g.slice(w, 0, 0, 2);
    let v = g.slice(w, 0, 4, 6);
    let qk = g.mul(q, k);
    let s = g.add(qk, v);
    let l = g.sum(s, &[0, 1], false);
    let gr = gradients(&mut g, l, &[w]).unwrap()[0].unwrap();
    let node = &g.graph_nodes()[gr.node.index()];
    assert_eq!(node.op, Op::Concat { axis: 0 });
    assert_eq!(g.dims(gr), vec![6, 3]);
    assert!(!g
        .graph_nodes()
        .iter()
        .any(|n| matches!(n.op, Op::SliceGrad { .. })));
    // Slices that leave a gap, or overlap, are padded and summed.
    for ranges in [[(0, 2), (4, 6)], [(0, 4), (2, 6)]] {
        let mut g = GraphBuilder::new();
        let w = g.variable("w", Tensor::full([6, 3], 1.0));
        let a = g.slice(w, 0, ranges[0].0, ranges[0].1);
        let b = g.slice(w, 0, ranges[1].0, ranges[1].1);
        let la = g.sum(a, &[0, 1], false);
        let lb = g.sum(b, &[0, 1], false);
        let l = g.add(la, lb);
        let gr = gradients(&mut g, l, &[w]).unwrap()[0].unwrap();
        assert_eq!(g.graph_nodes()[gr.node.index()].op, Op::Add);
        let pads = g
            .graph_nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::SliceGrad { .. }))
            .count();
        assert_eq!(pads, 2, "{ranges:?}");
    }
    // A slice beside a dense use of the same tensor: summed.
    let mut g = GraphBuilder::new();
    let w = g.variable("w", Tensor::full([4], 1.0));
    let a = g.slice(w, 0, 0, 4);
    let b = g.mul(a, w);
    let l = g.sum(b, &[0], false);
    let gr = gradients(&mut g, l, &[w]).unwrap()[0].unwrap();
    assert_eq!(g.graph_nodes()[gr.node.index()].op, Op::Add);
}

#[test]
fn op_without_rule_is_named() {
    let mut g = GraphBuilder::new();
    let w = g.variable("w", Tensor::full([2], 1.0));
    let x = g.placeholder("x", TensorType::f32([2]));
    let r = g.op1(Op::ReluGrad, &[x, w]);
    g.set_name(r, "bad");
    let l = g.sum(r, &[0], false);
    match gradients(&mut g, l, &[w]) {
        Err(AutodiffError::NoGradient { name, op, .. }) => {
            assert_eq!(name, "bad");
            assert_eq!(op, "relu_grad");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn loss_must_be_scalar_and_running_stats_are_not_trained() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4, 2]));
    let gamma = g.variable("gamma", Tensor::full([2], 1.0));
    let beta = g.variable("beta", Tensor::full([2], 0.0));
    let rm = g.variable("rm", Tensor::full([2], 0.0));
    let rv = g.variable("rv", Tensor::full([2], 1.0));
    let outs = g.op(
        Op::BatchNormTrain {
            eps: 1e-5,
            momentum: 0.1,
        },
        &[x, gamma, beta, rm, rv],
    );
    assert!(matches!(
        gradients(&mut g, outs[0], &[gamma]),
        Err(AutodiffError::LossNotScalar { .. })
    ));
    let l = g.mean(outs[0], &[0, 1], false);
    assert_eq!(trainable_variables(&g, l), vec![gamma, beta]);
}
