//! Training graphs with parameter groups, learning rates held in variables
//! and gradient clipping by global norm, run on the CPU backend against the
//! formulas PyTorch uses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes_adaptor::graph::{validate, GraphBuilder, GraphLimits, Outlet};
use lanes_adaptor::{
    lr_variable, training_graph_grouped, Optimizer, ParamGroup, Tensor, TensorType, TrainError,
    TrainOptions,
};

/// loss = mean((x·wᵀ + b − t)²) for a 4×3 input: w [2, 3], b [2].
fn model() -> (GraphBuilder, Outlet) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4, 3]));
    let t = g.placeholder("t", TensorType::f32([4, 2]));
    let w = g.variable(
        "w",
        Tensor::from_f32([2, 3], vec![0.5, -0.2, 0.1, 0.3, 0.8, -0.6]).unwrap(),
    );
    let b = g.variable("b", Tensor::from_f32([2], vec![0.05, -0.1]).unwrap());
    let y = g.matmul_t(x, w, false, true);
    let y = g.add(y, b);
    let l = g.mse_loss(y, t);
    g.set_name(l, "loss");
    (g, l)
}

fn feeds() -> BTreeMap<String, Tensor> {
    let x: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
    let t: Vec<f32> = (0..8).map(|i| (i as f32 * 0.71).cos() * 3.0).collect();
    BTreeMap::from([
        ("x".to_string(), Tensor::from_f32([4, 3], x).unwrap()),
        ("t".to_string(), Tensor::from_f32([4, 2], t).unwrap()),
    ])
}

/// The gradients of w and b by hand (mean squared error).
fn grads(w: &[f32], b: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let f = feeds();
    let (x, t) = (f["x"].f32s().unwrap(), f["t"].f32s().unwrap());
    let (mut dw, mut db) = (vec![0.0f32; 6], vec![0.0f32; 2]);
    for r in 0..4 {
        for o in 0..2 {
            let y: f32 = (0..3).map(|k| x[r * 3 + k] * w[o * 3 + k]).sum::<f32>() + b[o];
            let d = 2.0 * (y - t[r * 2 + o]) / 8.0;
            db[o] += d;
            for k in 0..3 {
                dw[o * 3 + k] += d * x[r * 3 + k];
            }
        }
    }
    (dw, db)
}

fn program(opts: &TrainOptions) -> CpuProgram {
    let (g, l) = model();
    let tg = training_graph_grouped(g, l, opts).unwrap();
    let valid = validate(tg.graph, &GraphLimits::default()).unwrap();
    CpuProgram::new(valid, tg.vars).unwrap()
}

fn values(p: &CpuProgram, name: &str) -> Vec<f32> {
    p.read_variables(&[name.to_string()]).unwrap()[name]
        .f32s()
        .unwrap()
        .to_vec()
}

#[test]
fn groups_have_their_own_rates_and_the_rate_is_a_variable() {
    // No decay on the bias, as PyTorch users set up groups.
    let opts = TrainOptions {
        groups: vec![
            ParamGroup {
                params: vec!["w".into()],
                optimizer: Optimizer::sgd_momentum(0.1, 0.0, 0.01),
            },
            ParamGroup {
                params: vec!["b".into()],
                optimizer: Optimizer::sgd(0.5),
            },
        ],
        max_grad_norm: None,
        ..Default::default()
    };
    let mut p = program(&opts);
    let (w0, b0) = (values(&p, "w"), values(&p, "b"));
    p.run(&feeds(), &["loss".to_string()]).unwrap();
    let (dw, db) = grads(&w0, &b0);
    let (w1, b1) = (values(&p, "w"), values(&p, "b"));
    for i in 0..6 {
        let want = w0[i] - 0.1 * (dw[i] + 0.01 * w0[i]);
        assert!((w1[i] - want).abs() < 1e-6, "w[{i}] {} vs {want}", w1[i]);
    }
    for i in 0..2 {
        let want = b0[i] - 0.5 * db[i];
        assert!((b1[i] - want).abs() < 1e-6, "b[{i}] {} vs {want}", b1[i]);
    }
    // A scheduler's step: group 1's rate becomes 0, group 0's 0.2.
    let mut w = BTreeMap::new();
    w.insert(lr_variable(0), Tensor::full([1], 0.2));
    w.insert(lr_variable(1), Tensor::full([1], 0.0));
    p.write_variables(w).unwrap();
    p.run(&feeds(), &["loss".to_string()]).unwrap();
    let (dw, _) = grads(&w1, &b1);
    let (w2, b2) = (values(&p, "w"), values(&p, "b"));
    for i in 0..6 {
        let want = w1[i] - 0.2 * (dw[i] + 0.01 * w1[i]);
        assert!((w2[i] - want).abs() < 1e-6, "w[{i}] {} vs {want}", w2[i]);
    }
    assert_eq!(b2, b1, "a rate of 0 leaves the group as it was");
}

#[test]
fn clipping_scales_all_gradients_by_the_global_norm() {
    let max_norm = 0.05;
    let opts = TrainOptions {
        groups: vec![ParamGroup {
            params: vec!["w".into(), "b".into()],
            optimizer: Optimizer::sgd(1.0),
        }],
        max_grad_norm: Some(max_norm),
        ..Default::default()
    };
    let mut p = program(&opts);
    let (w0, b0) = (values(&p, "w"), values(&p, "b"));
    p.run(&feeds(), &["loss".to_string()]).unwrap();
    let (dw, db) = grads(&w0, &b0);
    let norm = dw.iter().chain(&db).map(|g| g * g).sum::<f32>().sqrt();
    assert!(
        norm > max_norm,
        "the test needs a norm above the limit: {norm}"
    );
    let coef = max_norm / (norm + 1e-6);
    let (w1, b1) = (values(&p, "w"), values(&p, "b"));
    for i in 0..6 {
        let want = w0[i] - coef * dw[i];
        assert!((w1[i] - want).abs() < 1e-6, "w[{i}] {} vs {want}", w1[i]);
    }
    for i in 0..2 {
        let want = b0[i] - coef * db[i];
        assert!((b1[i] - want).abs() < 1e-6, "b[{i}] {} vs {want}", b1[i]);
    }
}

#[test]
fn bad_groups_are_named() {
    let (g, l) = model();
    let opts = TrainOptions {
        groups: vec![ParamGroup {
            params: vec!["nope".into()],
            optimizer: Optimizer::sgd(0.1),
        }],
        max_grad_norm: None,
        ..Default::default()
    };
    assert!(matches!(
        training_graph_grouped(g, l, &opts),
        Err(TrainError::UnknownParameter { name, .. }) if name == "nope"
    ));
    let (g, l) = model();
    let opts = TrainOptions {
        groups: vec![
            ParamGroup {
                params: vec!["w".into()],
                optimizer: Optimizer::sgd(0.1),
            },
            ParamGroup {
                params: vec!["w".into()],
                optimizer: Optimizer::adam(0.1),
            },
        ],
        max_grad_norm: None,
        ..Default::default()
    };
    assert!(matches!(
        training_graph_grouped(g, l, &opts),
        Err(TrainError::DuplicateParameter { .. })
    ));
    let (g, l) = model();
    let opts = TrainOptions {
        groups: vec![ParamGroup {
            params: vec!["w".into()],
            optimizer: Optimizer::sgd(0.1),
        }],
        max_grad_norm: Some(-1.0),
        ..Default::default()
    };
    assert!(matches!(
        training_graph_grouped(g, l, &opts),
        Err(TrainError::BadClipNorm(_))
    ));
}
