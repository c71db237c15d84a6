//! Gradient checks: for every differentiable op of v1, and for whole small
//! models, the gradients built by `lanes_adaptor::autodiff` and run on the
//! CPU reference backend agree with central finite differences.
//!
//! Every checked input is a variable; the scalar loss is `sum(out * R)` with
//! a fixed random `R`, so every output element matters with its own weight.
//! Values stay away from kinks (ReLU at 0, ties in max) by more than the
//! perturbation, so the finite differences are meaningful in f32.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes_adaptor::autodiff::{gradients, trainable_variables};
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::{
    validate, Conv2dAttrs, GraphBuilder, GraphLimits, Op, Outlet, Pool2dAttrs, Tensor,
};

/// Deterministic values in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn tensor(&mut self, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_f32(shape.to_vec(), (0..n).map(|_| self.next()).collect()).unwrap()
    }
    /// Values with |x| >= 0.1 (away from ReLU's kink).
    fn away_from_zero(&mut self, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        let v = (0..n)
            .map(|_| {
                let x = self.next();
                x.signum() * (0.1 + x.abs())
            })
            .collect();
        Tensor::from_f32(shape.to_vec(), v).unwrap()
    }
    /// Distinct values spaced 0.05 apart in random order (no ties for max).
    fn distinct(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let mut v: Vec<f32> = (0..n).map(|i| i as f32 * 0.05 - n as f32 * 0.025).collect();
        for i in (1..n).rev() {
            let j = ((self.next() + 1.0) * 0.5 * (i + 1) as f32) as usize % (i + 1);
            v.swap(i, j);
        }
        Tensor::from_f32(shape.to_vec(), v).unwrap()
    }
    fn positive(&mut self, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_f32(
            shape.to_vec(),
            (0..n).map(|_| 0.5 + (self.next() + 1.0)).collect(),
        )
        .unwrap()
    }
}

fn key(g: &GraphBuilder, o: Outlet) -> String {
    if o.slot == 0 {
        g.name_of(o).to_string()
    } else {
        format!("{}:{}", g.name_of(o), o.slot)
    }
}

/// Checks d loss / d v for every trainable variable `v` of `g`, where the
/// loss is `out` itself if it is a scalar, else `sum(out * R)`.
fn check_with(name: &str, mut g: GraphBuilder, out: Outlet, h: f32, tol: f32) {
    let dims = g.dims(out);
    let loss = if dims.iter().product::<usize>() == 1 && dims.len() <= 1 {
        out
    } else {
        let r = Lcg(99).tensor(&dims);
        let r = g.constant(r);
        let p = g.mul(out, r);
        let axes: Vec<usize> = (0..dims.len()).collect();
        g.sum(p, &axes, false)
    };
    g.set_name(loss, "loss_for_check");
    let wrt = trainable_variables(&g, loss);
    assert!(!wrt.is_empty(), "{name}: nothing to check");
    let grads = gradients(&mut g, loss, &wrt).unwrap_or_else(|e| panic!("{name}: {e}"));
    let var_names: Vec<String> = wrt.iter().map(|v| g.name_of(*v).to_string()).collect();
    let grad_keys: Vec<String> = grads
        .iter()
        .map(|gr| key(&g, gr.expect("every trainable variable has a gradient")))
        .collect();
    let (graph, vars) = g.finish().unwrap_or_else(|e| panic!("{name}: {e}"));
    let valid = validate(graph, &GraphLimits::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut p = CpuProgram::new(valid, vars.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let feeds: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut fetches = vec!["loss_for_check".to_string()];
    fetches.extend(grad_keys.iter().cloned());
    let got = p
        .run(&feeds, &fetches)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut worst = 0.0f32;
    for (vi, vname) in var_names.iter().enumerate() {
        let analytic = got[vi + 1].f32s().unwrap().to_vec();
        let base = vars[vname].clone();
        let n = base.numel();
        let step = (n / 12).max(1);
        for i in (0..n).step_by(step) {
            let mut eval = |delta: f32| {
                let mut t = base.clone();
                t.f32s_mut().unwrap()[i] += delta;
                let mut w = BTreeMap::new();
                w.insert(vname.clone(), t);
                p.write_variables(w).unwrap();
                let l = p.run(&feeds, &fetches[..1]).unwrap();
                l[0].f32s().unwrap()[0]
            };
            let numeric = (eval(h) - eval(-h)) / (2.0 * h);
            let a = analytic[i];
            let err = (numeric - a).abs() / (1.0f32).max(a.abs()).max(numeric.abs());
            worst = worst.max(err);
            assert!(
                err <= tol,
                "{name}: d/d {vname}[{i}]: analytic {a}, numeric {numeric} (rel err {err})"
            );
        }
        let mut w = BTreeMap::new();
        w.insert(vname.clone(), base);
        p.write_variables(w).unwrap();
    }
    eprintln!("{name}: worst relative error {worst:.2e}");
}

fn check(name: &str, g: GraphBuilder, out: Outlet) {
    check_with(name, g, out, 1e-2, 2e-2);
}

fn var(g: &mut GraphBuilder, name: &str, t: Tensor) -> Outlet {
    g.variable(name, t)
}

#[test]
fn elementwise_with_broadcasting() {
    type Bin = fn(&mut GraphBuilder, Outlet, Outlet) -> Outlet;
    let ops: [(&str, Bin); 4] = [
        ("add", GraphBuilder::add),
        ("sub", GraphBuilder::sub),
        ("mul", GraphBuilder::mul),
        ("div", GraphBuilder::div),
    ];
    for (name, f) in ops {
        let mut r = Lcg(1);
        let mut g = GraphBuilder::new();
        let a = var(&mut g, "a", r.tensor(&[3, 4]));
        let b = var(&mut g, "b", r.positive(&[4]));
        let c = var(&mut g, "c", r.positive(&[3, 1]));
        let y = f(&mut g, a, b);
        let y = f(&mut g, y, c);
        check(name, g, y);
    }
}

#[test]
fn unary_ops() {
    type Un = fn(&mut GraphBuilder, Outlet) -> Outlet;
    let ops: [(&str, Un, bool); 9] = [
        ("relu", GraphBuilder::relu, false),
        ("gelu", GraphBuilder::gelu, false),
        ("sigmoid", GraphBuilder::sigmoid, false),
        ("tanh", GraphBuilder::tanh, false),
        ("exp", GraphBuilder::exp, false),
        ("log", GraphBuilder::log, true),
        ("sqrt", GraphBuilder::sqrt, true),
        ("softmax", |g, x| g.softmax(x, 1), false),
        ("log_softmax", |g, x| g.log_softmax(x, 0), false),
    ];
    for (name, f, positive) in ops {
        let mut r = Lcg(2);
        let mut g = GraphBuilder::new();
        let t = if positive {
            r.positive(&[3, 5])
        } else {
            r.away_from_zero(&[3, 5])
        };
        let x = var(&mut g, "x", t);
        let y = f(&mut g, x);
        check(name, g, y);
    }
    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", Lcg(3).tensor(&[4]));
    let y = g.scale(x, -2.5);
    check("scale", g, y);
}

#[test]
fn shape_ops() {
    let mut r = Lcg(4);
    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", r.tensor(&[2, 3, 4]));
    let y = g.reshape(x, &[6, 4]);
    let y = g.transpose(y, &[1, 0]);
    let z = var(&mut g, "z", r.tensor(&[2, 6]));
    let c = g.concat(&[y, z], 0);
    let s = g.slice(c, 1, 1, 5);
    check("reshape/transpose/concat/slice", g, s);

    // q, k, v from one tensor (slices that tile it: their gradients join
    // as one concat), each used non-linearly.
    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", r.tensor(&[3, 6]));
    let v = g.slice(x, 1, 4, 6);
    let q = g.slice(x, 1, 0, 2);
    let k = g.slice(x, 1, 2, 4);
    let qk = g.mul(q, k);
    let t = g.tanh(v);
    let s = g.mul(qk, t);
    check("slices tiling their input", g, s);

    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", r.tensor(&[3, 1]));
    let b = g.broadcast_to(x, &[2, 3, 4]);
    let s = g.sum_to(b, &[3, 4]);
    check("broadcast_to/sum_to", g, s);
}

#[test]
fn reductions() {
    let mut r = Lcg(5);
    for (name, keep) in [("keep", true), ("drop", false)] {
        let mut g = GraphBuilder::new();
        let x = var(&mut g, "x", r.tensor(&[2, 3, 4]));
        let a = g.sum(x, &[0, 2], keep);
        let b = g.mean(x, &[1], keep);
        let sa = g.sum(a, &(0..g.dims(a).len()).collect::<Vec<_>>(), false);
        let sb = g.sum(b, &(0..g.dims(b).len()).collect::<Vec<_>>(), false);
        let y = g.add(sa, sb);
        check(&format!("sum/mean {name}"), g, y);
        let mut g = GraphBuilder::new();
        let x = var(&mut g, "x", r.distinct(&[2, 3, 4]));
        let m = g.max(x, &[2], keep);
        check(&format!("max {name}"), g, m);
    }
}

#[test]
fn matmul_all_transposes_and_batch_broadcast() {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let mut r = Lcg(6);
        let mut g = GraphBuilder::new();
        let a_shape = if ta { [2, 4, 3] } else { [2, 3, 4] };
        let b_shape = if tb { [5, 4] } else { [4, 5] };
        let a = var(&mut g, "a", r.tensor(&a_shape));
        let b = var(&mut g, "b", r.tensor(&b_shape));
        let y = g.matmul_t(a, b, ta, tb);
        check(&format!("matmul ta={ta} tb={tb}"), g, y);
    }
}

#[test]
fn conv2d_with_stride_padding_bias_and_groups() {
    for (stride, pad, groups) in [(1, 1, 1), (2, 0, 1), (1, 1, 2)] {
        let mut r = Lcg(7);
        let mut g = GraphBuilder::new();
        let x = var(&mut g, "x", r.tensor(&[2, 4, 5, 5]));
        let w = var(&mut g, "w", r.tensor(&[6, 4 / groups, 3, 3]));
        let b = var(&mut g, "b", r.tensor(&[6]));
        let attrs = Conv2dAttrs {
            stride: [stride, stride],
            padding: [pad, pad],
            dilation: [1, 1],
            groups,
        };
        let y = g.conv2d(x, w, Some(b), attrs);
        check(&format!("conv2d s{stride} p{pad} g{groups}"), g, y);
    }
}

#[test]
fn pooling() {
    let p = Pool2dAttrs {
        kernel: [2, 2],
        stride: [2, 2],
        padding: [0, 0],
    };
    let p3 = Pool2dAttrs {
        kernel: [3, 3],
        stride: [1, 1],
        padding: [1, 1],
    };
    let mut r = Lcg(8);
    for pool in [p, p3] {
        let mut g = GraphBuilder::new();
        let x = var(&mut g, "x", r.distinct(&[1, 2, 4, 4]));
        let y = g.max_pool2d(x, pool);
        check("max_pool2d", g, y);
        for cip in [true, false] {
            let mut g = GraphBuilder::new();
            let x = var(&mut g, "x", r.tensor(&[1, 2, 4, 4]));
            let y = g.avg_pool2d(x, pool, cip);
            check(&format!("avg_pool2d include_pad={cip}"), g, y);
        }
    }
    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", r.tensor(&[2, 3, 3, 2]));
    let y = g.global_avg_pool(x);
    check("global_avg_pool", g, y);
}

#[test]
fn normalisation() {
    let mut r = Lcg(9);
    // Inference form: statistics are frozen inputs (constants for autodiff).
    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", r.tensor(&[2, 3, 2, 2]));
    let gamma = var(&mut g, "gamma", r.positive(&[3]));
    let beta = var(&mut g, "beta", r.tensor(&[3]));
    let mean = g.constant(r.tensor(&[3]));
    let v = g.constant(r.positive(&[3]));
    let y = g.batch_norm(x, gamma, beta, mean, v, 1e-5);
    check("batch_norm", g, y);

    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", r.tensor(&[3, 2, 2, 2]));
    let gamma = var(&mut g, "gamma", r.positive(&[2]));
    let beta = var(&mut g, "beta", r.tensor(&[2]));
    let rm = g.variable("running_mean", Tensor::full([2], 0.0));
    let rv = g.variable("running_var", Tensor::full([2], 1.0));
    let y = g.op(
        Op::BatchNormTrain {
            eps: 1e-5,
            momentum: 0.1,
        },
        &[x, gamma, beta, rm, rv],
    )[0];
    check_with("batch_norm_train", g, y, 1e-2, 3e-2);

    let mut g = GraphBuilder::new();
    let x = var(&mut g, "x", r.tensor(&[2, 3, 5]));
    let gamma = var(&mut g, "gamma", r.positive(&[5]));
    let beta = var(&mut g, "beta", r.tensor(&[5]));
    let y = g.layer_norm(x, gamma, beta, 1e-5);
    check_with("layer_norm", g, y, 1e-2, 3e-2);
}

#[test]
fn embedding_and_losses() {
    let mut r = Lcg(10);
    let mut g = GraphBuilder::new();
    let table = var(&mut g, "table", r.tensor(&[5, 3]));
    let idx = g.constant(Tensor::from_i64([2, 3], vec![0, 4, 4, 1, 0, 2]).unwrap());
    let y = g.embedding(table, idx);
    check("embedding (repeated indices)", g, y);

    let mut g = GraphBuilder::new();
    let logits = var(&mut g, "logits", r.tensor(&[4, 5]));
    let labels = g.constant(Tensor::from_i64([4], vec![0, 3, 4, 3]).unwrap());
    let l = g.cross_entropy(logits, labels);
    check("cross_entropy", g, l);

    let mut g = GraphBuilder::new();
    let p = var(&mut g, "p", r.tensor(&[3, 2]));
    let t = var(&mut g, "t", r.tensor(&[3, 2]));
    let l = g.mse_loss(p, t);
    check("mse_loss", g, l);
}

/// A whole model: every parameter of a small CNN with batch norm, a
/// residual block and a classifier, through cross-entropy.
#[test]
fn whole_small_cnn() {
    use lanes_adaptor::nn::{Mode, Nn, WeightInit};
    let mut nn = Nn::new(3, Mode::Train);
    let mut r = Lcg(12);
    // Inputs as a constant so only parameters are checked.
    let xin = nn.g.constant(r.tensor(&[4, 2, 6, 6]));
    let h = nn.conv_bn(
        "conv1",
        "bn1",
        xin,
        4,
        [3, 3],
        [1, 1],
        [1, 1],
        WeightInit::TorchDefault,
        1e-5,
        true,
    );
    let h = nn.basic_block("block", h, 4, 2);
    let h = nn.g.global_avg_pool(h);
    let logits = nn.linear("fc", h, 3, true);
    let labels =
        nn.g.constant(Tensor::from_i64([4], vec![0, 1, 2, 1]).unwrap());
    let l = nn.g.cross_entropy(logits, labels);
    check_with("small cnn", nn.g, l, 1e-2, 5e-2);
}

/// A whole model: the zoo's 2-layer transformer (embeddings, attention,
/// layer norms, feed-forward, classifier).
#[test]
fn whole_small_transformer() {
    let arch = Arch::Transformer {
        vocab: 7,
        seq: 4,
        dim: 8,
        heads: 2,
        ff: 16,
        classes: 3,
    };
    let (g, loss, _) = arch.with_loss(2, 5).unwrap();
    let ids = Tensor::from_i64([2, 4], vec![1, 2, 3, 4, 5, 6, 0, 1]).unwrap();
    let labels = Tensor::from_i64([2], vec![0, 2]).unwrap();
    check_transformer(g, loss, ids, labels);
}

fn check_transformer(mut g: GraphBuilder, loss: Outlet, ids: Tensor, labels: Tensor) {
    // As check_with, with the token ids and labels fed.
    let wrt = trainable_variables(&g, loss);
    let grads = gradients(&mut g, loss, &wrt).unwrap();
    let names: Vec<String> = wrt.iter().map(|v| g.name_of(*v).to_string()).collect();
    let keys: Vec<String> = grads.iter().map(|o| key(&g, o.unwrap())).collect();
    let (graph, vars) = g.finish().unwrap();
    let mut p = CpuProgram::new(
        validate(graph, &GraphLimits::default()).unwrap(),
        vars.clone(),
    )
    .unwrap();
    let mut feeds = BTreeMap::new();
    feeds.insert("input_ids".to_string(), ids);
    feeds.insert("labels".to_string(), labels);
    let mut fetches = vec!["loss".to_string()];
    fetches.extend(keys);
    let got = p.run(&feeds, &fetches).unwrap();
    let h = 1e-2;
    for (vi, name) in names.iter().enumerate() {
        let analytic = got[vi + 1].f32s().unwrap().to_vec();
        let base = vars[name].clone();
        for i in (0..base.numel()).step_by((base.numel() / 4).max(1)) {
            let mut eval = |d: f32| {
                let mut t = base.clone();
                t.f32s_mut().unwrap()[i] += d;
                p.write_variables(BTreeMap::from([(name.clone(), t)]))
                    .unwrap();
                p.run(&feeds, &fetches[..1]).unwrap()[0].f32s().unwrap()[0]
            };
            let numeric = (eval(h) - eval(-h)) / (2.0 * h);
            let a = analytic[i];
            let err = (numeric - a).abs() / 1f32.max(a.abs()).max(numeric.abs());
            assert!(
                err <= 5e-2,
                "transformer d/d {name}[{i}]: analytic {a}, numeric {numeric}"
            );
        }
        p.write_variables(BTreeMap::from([(name.clone(), base)]))
            .unwrap();
    }
}

#[test]
fn where_routes_the_gradient_to_the_chosen_branch() {
    let mut r = Lcg(5);
    let mut g = GraphBuilder::new();
    let a = var(&mut g, "a", r.tensor(&[3, 4]));
    let b = var(&mut g, "b", r.tensor(&[4]));
    // A 0/1 mask, broadcast over rows: the causal-mask shape of attention.
    let mask = Tensor::from_f32(
        [3, 4],
        (0..12).map(|i| f32::from(u8::from(i % 3 != 0))).collect(),
    )
    .unwrap();
    let cond = g.constant(mask);
    let y = g.op1(Op::Where, &[cond, a, b]);
    check("where", g, y);
}

#[test]
fn hard_sigmoid_and_hard_swish() {
    // Values on every piece of the functions, away from the kinks at ±3
    // where finite differences do not apply.
    let xs: Vec<f32> = (0..24).map(|i| -5.4 + 0.45 * i as f32).collect();
    assert!(xs.iter().all(|x| (x.abs() - 3.0).abs() > 0.05));
    for (name, op) in [
        ("hard_sigmoid", Op::HardSigmoid),
        ("hard_swish", Op::HardSwish),
    ] {
        let mut g = GraphBuilder::new();
        let x = var(&mut g, "x", Tensor::from_f32([4, 6], xs.clone()).unwrap());
        let y = g.op1(op, &[x]);
        check(name, g, y);
    }
}
