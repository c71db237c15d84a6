//! Loss scaling in fp16-mixed training on the CPU reference backend
//! (docs/precision.md, *Loss scaling*): `GradScaler`'s semantics inside one
//! Run. An overflowing step is skipped exactly (weights and optimizer state
//! bit for bit as before), the scale halves until steps apply and no NaN
//! reaches a weight; clean steps grow the scale every `growth_interval`;
//! clipping sees unscaled gradients; bf16 and f32 steps have no scaler.
//! Through a service (`LANES_TEST_DEVICE=cuda`: on the GPU) the scaler's
//! variables are read and written like any other.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes_adaptor::graph::{validate, GraphBuilder, GraphLimits, Outlet};
use lanes_adaptor::{
    training_graph_grouped, Client, LossScale, Optimizer, ParamGroup, Precision, SessionSpec,
    Tensor, TensorType, TrainOptions, VarValues, FOUND_INF_NODE, GROWTH_TRACKER_VARIABLE,
    SCALE_VARIABLE,
};

const N: usize = 16;
const PARAMS: [&str; 4] = ["w1", "b1", "w2", "b2"];

/// A two-layer MLP (8 → 16 → 4) with a cross-entropy loss over a batch of
/// 16: the matrix products run in fp16 under fp16-mixed.
fn model() -> (GraphBuilder, Outlet) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([N, 8]));
    let y = g.placeholder("y", TensorType::i64([N]));
    let init =
        |n: usize, k: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * k).sin() * 0.3).collect() };
    let w1 = g.variable("w1", Tensor::from_f32([8, 16], init(128, 0.77)).unwrap());
    let b1 = g.variable("b1", Tensor::from_f32([16], init(16, 1.3)).unwrap());
    let w2 = g.variable("w2", Tensor::from_f32([16, 4], init(64, 0.41)).unwrap());
    let b2 = g.variable("b2", Tensor::from_f32([4], init(4, 2.1)).unwrap());
    let h = g.matmul(x, w1);
    let h = g.add(h, b1);
    let h = g.relu(h);
    let o = g.matmul(h, w2);
    let o = g.add(o, b2);
    let l = g.cross_entropy(o, y);
    g.set_name(l, "loss");
    (g, l)
}

/// Batch `k` (`util::sine_batch`).
fn feeds(k: usize) -> BTreeMap<String, Tensor> {
    util::sine_batch(k, N)
}

fn options(opt: Optimizer, precision: Precision, loss_scale: LossScale) -> TrainOptions {
    TrainOptions {
        groups: vec![ParamGroup {
            params: PARAMS.iter().map(|s| s.to_string()).collect(),
            optimizer: opt,
        }],
        precision,
        loss_scale,
        ..TrainOptions::default()
    }
}

fn program(opts: &TrainOptions) -> CpuProgram {
    let (g, l) = model();
    let t = training_graph_grouped(g, l, opts).unwrap();
    CpuProgram::new(validate(t.graph, &GraphLimits::default()).unwrap(), t.vars).unwrap()
}

/// One step on batch `k`: the loss and the overflow flag.
fn step(p: &mut CpuProgram, k: usize) -> (f32, f32) {
    let found = format!("{FOUND_INF_NODE}:1");
    let out = p.run(&feeds(k), &["loss".to_string(), found]).unwrap();
    (out[0].f32s().unwrap()[0], out[1].f32s().unwrap()[0])
}

fn scalar(vars: &VarValues, name: &str) -> f32 {
    vars[name].f32s().unwrap()[0]
}

/// Every variable but the scaler's, as raw bits.
fn bits_but_scaler(vars: &VarValues) -> BTreeMap<String, Vec<u32>> {
    vars.iter()
        .filter(|(k, _)| !k.starts_with("amp/"))
        .map(|(k, v)| {
            (
                k.clone(),
                v.f32s().unwrap().iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect()
}

fn sgd_momentum() -> Optimizer {
    Optimizer::sgd_momentum(0.1, 0.9, 1e-4)
}

fn adamw() -> Optimizer {
    Optimizer::adamw(1e-2, 0.01)
}

/// With a scale of 2^40 the fp16 gradients overflow (fp16's largest value
/// is 65504): each such step leaves every weight and every piece of
/// optimizer state (momentum; Adam's moments and step count) bit for bit
/// as it was, halves the scale and zeroes the tracker, until the scale is
/// small enough; then steps apply (the tracker counting them), and no NaN
/// reaches a weight.
#[test]
fn overflowing_steps_are_skipped_exactly_and_the_scale_backs_off() {
    for opt in [sgd_momentum(), adamw()] {
        let ls = LossScale {
            init_scale: 2f32.powi(40),
            ..LossScale::default()
        };
        let mut p = program(&options(opt, Precision::F16Mixed, ls));
        let mut before = p.read_variables(&[]).unwrap();
        let (mut skipped, mut applied, mut clean) = (0, 0, 0);
        for k in 0..60 {
            let (loss, found) = step(&mut p, k);
            assert!(loss.is_finite(), "{opt:?}: the unscaled loss {loss}");
            let after = p.read_variables(&[]).unwrap();
            let (s0, s1) = (
                scalar(&before, SCALE_VARIABLE),
                scalar(&after, SCALE_VARIABLE),
            );
            if found != 0.0 {
                skipped += 1;
                clean = 0;
                assert_eq!(
                    bits_but_scaler(&before),
                    bits_but_scaler(&after),
                    "{opt:?}: skipped step {k} changed a weight or the optimizer's state"
                );
                assert_eq!(s1, s0 * 0.5, "{opt:?}: step {k}'s scale");
            } else {
                // Once the scale is near the edge a later batch may
                // overflow again (as under PyTorch); the first 20 may not
                // apply.
                assert!(k >= 20, "{opt:?}: step {k} applied at scale {s0}");
                applied += 1;
                clean += 1;
                assert_ne!(
                    bits_but_scaler(&before),
                    bits_but_scaler(&after),
                    "{opt:?}: step {k} applied nothing"
                );
                assert_eq!(s1, s0, "{opt:?}: a clean step before the growth interval");
            }
            assert_eq!(scalar(&after, GROWTH_TRACKER_VARIABLE), clean as f32);
            before = after;
        }
        // dlogits alone reach 2^40 / 16 in fp16: at least the 20 halvings
        // down to 2^20 are skipped.
        assert!(skipped >= 20, "{opt:?}: {skipped} skipped");
        assert!(applied >= 10, "{opt:?}: {applied} applied");
        for name in PARAMS {
            let w = before[name].f32s().unwrap();
            assert!(w.iter().all(|x| x.is_finite()), "{opt:?}: {name} {w:?}");
        }
        if matches!(opt, Optimizer::AdamW { .. }) {
            assert_eq!(
                scalar(&before, "opt/w1/step"),
                applied as f32,
                "Adam counts applied steps only"
            );
        }
    }
}

/// With a growth interval of 3, the scale doubles after three clean steps
/// in a row and the tracker counts 1, 2, then 0 again.
#[test]
fn the_scale_grows_after_the_growth_interval() {
    for opt in [sgd_momentum(), adamw()] {
        let ls = LossScale {
            init_scale: 256.0,
            growth_interval: 3,
            ..LossScale::default()
        };
        let mut p = program(&options(opt, Precision::F16Mixed, ls));
        let mut seen = Vec::new();
        for k in 0..7 {
            let (_, found) = step(&mut p, k);
            assert_eq!(found, 0.0, "{opt:?}: step {k} overflowed at a small scale");
            let v = p.read_variables(&[]).unwrap();
            seen.push((
                scalar(&v, SCALE_VARIABLE),
                scalar(&v, GROWTH_TRACKER_VARIABLE),
            ));
        }
        assert_eq!(
            seen,
            vec![
                (256.0, 1.0),
                (256.0, 2.0),
                (512.0, 0.0),
                (512.0, 1.0),
                (512.0, 2.0),
                (1024.0, 0.0),
                (1024.0, 1.0),
            ],
            "{opt:?}"
        );
    }
}

/// Clipping by global norm sees unscaled gradients: with a tiny max norm
/// and plain SGD at rate 1, one step moves the weights by max_norm in all,
/// whatever the scale (clipping scaled gradients would move them by
/// max_norm / scale).
#[test]
fn clipping_sees_unscaled_gradients() {
    let max_norm = 1e-3f32;
    let ls = LossScale {
        init_scale: 1024.0,
        ..LossScale::default()
    };
    let opts = TrainOptions {
        max_grad_norm: Some(max_norm),
        ..options(Optimizer::sgd(1.0), Precision::F16Mixed, ls)
    };
    let mut p = program(&opts);
    let before = p.read_variables(&[]).unwrap();
    let (_, found) = step(&mut p, 0);
    assert_eq!(found, 0.0);
    let after = p.read_variables(&[]).unwrap();
    let moved: f32 = PARAMS
        .iter()
        .flat_map(|n| {
            let (a, b) = (before[*n].f32s().unwrap(), after[*n].f32s().unwrap());
            a.iter()
                .zip(b)
                .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2) as f32)
                .collect::<Vec<_>>()
        })
        .sum::<f32>()
        .sqrt();
    assert!(
        (moved - max_norm).abs() <= 0.02 * max_norm,
        "the step moved {moved}, the max norm is {max_norm}"
    );
}

/// fp16-mixed follows f32 training of the same model from the same
/// weights on the same batches (SGD with momentum and AdamW): the losses
/// of the last 10 of 100 steps agree within 0.05 in mean. The default
/// scale (2^16) does not overflow this model, so no step is skipped.
#[test]
fn fp16_mixed_training_follows_fp32() {
    for opt in [sgd_momentum(), adamw()] {
        let run = |precision: Precision| -> (f32, f32) {
            let mut p = program(&options(opt, precision, LossScale::default()));
            let fetch = ["loss".to_string()];
            let mut losses = Vec::new();
            for k in 0..100 {
                losses.push(p.run(&feeds(k % 20), &fetch).unwrap()[0].f32s().unwrap()[0]);
            }
            let last = losses[90..].iter().sum::<f32>() / 10.0;
            (losses[0], last)
        };
        let (first32, last32) = run(Precision::F32);
        let (first16, last16) = run(Precision::F16Mixed);
        eprintln!("{opt:?}: loss {first32:.4} -> {last32:.4} in fp32, {first16:.4} -> {last16:.4} in fp16-mixed");
        assert!(
            last32 < 0.6 * first32,
            "{opt:?}: fp32 must learn ({first32} -> {last32})"
        );
        assert!(
            (first16 - first32).abs() <= 1e-2,
            "{opt:?}: first loss {first16} vs {first32}"
        );
        assert!(
            (last16 - last32).abs() <= 0.05,
            "{opt:?}: last losses {last16} vs fp32 {last32}"
        );
    }
}

/// bf16-mixed and fp32 steps have no scaler: no scale variable, no
/// unscaling op, no skip flag.
#[test]
fn only_fp16_mixed_scales() {
    for precision in [Precision::F32, Precision::Bf16Mixed, Precision::F16Mixed] {
        let (g, l) = model();
        let t = training_graph_grouped(g, l, &options(adamw(), precision, LossScale::default()))
            .unwrap();
        let scaled = precision == Precision::F16Mixed;
        assert_eq!(t.vars.contains_key(SCALE_VARIABLE), scaled, "{precision}");
        assert_eq!(
            t.vars.contains_key(GROWTH_TRACKER_VARIABLE),
            scaled,
            "{precision}"
        );
        let amp_ops = t
            .graph
            .nodes
            .iter()
            .filter(|n| n.op.name().starts_with("amp_"))
            .count();
        assert_eq!(
            amp_ops,
            if scaled { PARAMS.len() + 1 } else { 0 },
            "{precision}"
        );
    }
}

/// Settings a scaler cannot run with are refused when the graph is built.
#[test]
fn bad_settings_are_refused() {
    for ls in [
        LossScale {
            init_scale: 0.0,
            ..LossScale::default()
        },
        LossScale {
            init_scale: f32::INFINITY,
            ..LossScale::default()
        },
        LossScale {
            growth_factor: 1.0,
            ..LossScale::default()
        },
        LossScale {
            backoff_factor: 1.5,
            ..LossScale::default()
        },
        LossScale {
            growth_interval: 0,
            ..LossScale::default()
        },
    ] {
        let (g, l) = model();
        let e =
            training_graph_grouped(g, l, &options(adamw(), Precision::F16Mixed, ls)).unwrap_err();
        assert!(e.to_string().contains("loss scaling"), "{e}");
    }
}

/// An fp16-mixed training session of a service: three clean steps at a
/// growth interval of 3 double the scale (read back with ReadVariables); a
/// scale written so large that the fp16 gradients overflow makes the next
/// step a skipped one (its flag fetched as `amp/found_inf:1`): the weights
/// and momentum buffers read back unchanged, the scale halved.
#[test]
fn a_service_session_reads_and_writes_its_scaler() {
    let service = util::start();
    let mut client = Client::connect(service.endpoint()).unwrap();
    let mut s = client
        .open_session(SessionSpec::training("fp16-mixed"))
        .unwrap();
    let ls = LossScale {
        init_scale: 1024.0,
        growth_interval: 3,
        ..LossScale::default()
    };
    let (g, l) = model();
    let t =
        training_graph_grouped(g, l, &options(sgd_momentum(), Precision::F16Mixed, ls)).unwrap();
    s.load(&t.graph, t.vars).unwrap();
    let found_key = format!("{FOUND_INF_NODE}:1");
    let fetch = ["loss", found_key.as_str()];
    let step = |s: &mut lanes_adaptor::Session<'_>, k: usize| -> f32 {
        let out = s.run(feeds(k).into_iter().collect(), &fetch).unwrap();
        assert!(out[0].f32s().unwrap()[0].is_finite());
        out[1].f32s().unwrap()[0]
    };
    for k in 0..3 {
        assert_eq!(step(&mut s, k), 0.0, "step {k} overflowed");
    }
    let scaler = [SCALE_VARIABLE, GROWTH_TRACKER_VARIABLE];
    let v = s.read_variables(&scaler).unwrap();
    assert_eq!(scalar(&v, SCALE_VARIABLE), 2048.0);
    assert_eq!(scalar(&v, GROWTH_TRACKER_VARIABLE), 0.0);
    let mut kept: Vec<String> = PARAMS.iter().map(|p| p.to_string()).collect();
    kept.extend(PARAMS.iter().map(|p| format!("opt/{p}/momentum")));
    let kept: Vec<&str> = kept.iter().map(String::as_str).collect();
    let before = s.read_variables(&kept).unwrap();
    let huge = Tensor::full(v[SCALE_VARIABLE].shape().clone(), 2f32.powi(40));
    s.write_variables(VarValues::from([(SCALE_VARIABLE.to_string(), huge)]))
        .unwrap();
    assert_eq!(step(&mut s, 3), 1.0, "a scale of 2^40 must overflow");
    assert_eq!(
        bits_but_scaler(&before),
        bits_but_scaler(&s.read_variables(&kept).unwrap())
    );
    let v = s.read_variables(&scaler).unwrap();
    assert_eq!(scalar(&v, SCALE_VARIABLE), 2f32.powi(39));
    assert_eq!(scalar(&v, GROWTH_TRACKER_VARIABLE), 0.0);
    s.close().unwrap();
}
