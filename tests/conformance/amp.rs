//! Loss scaling on CUDA against the CPU reference (docs/precision.md, *Loss
//! scaling*): `AmpUnscale` (exact: a product by the reciprocal of a power
//! of two; the found flag on clean, overflowing and chained gradients),
//! `AmpScaleUpdate` (exact), the optimizers' skip flag, and fp16-mixed
//! training steps of an MLP whose first step overflows.
//!
//! On the GPU machine: `cargo test --release --test conformance --
//! --ignored --test-threads=1 --nocapture amp_`.

use super::*;
use lanes_adaptor::{
    training_graph_grouped, LossScale, Optimizer, ParamGroup, Precision, TrainOptions,
    FOUND_INF_NODE, SCALE_VARIABLE,
};

const EXACT: Tol = Tol {
    rtol: 0.0,
    atol: 0.0,
};

/// A gradient with a NaN and an infinity among finite values.
fn overflowed(rng: &mut StdRng) -> Tensor {
    let mut t = rnd(rng, &[5, 7], -1.0, 1.0);
    let v = t.f32s_mut().unwrap();
    v[3] = f32::INFINITY;
    v[20] = f32::NAN;
    t
}

/// `AmpUnscale` cases: (name, gradient, found_in, whether the unscaled
/// gradient is fetched (not with a NaN or infinity in it: the comparison
/// takes finite values and NaNs), the found flag expected).
fn unscale_cases() -> Vec<(Case, f32)> {
    let mut rng = StdRng::seed_from_u64(41);
    let mut cases = Vec::new();
    let clean = rnd(&mut rng, &[5, 7], -3e4, 3e4);
    let bad = overflowed(&mut rng);
    for (name, grad, found_in, fetch_grad, want) in [
        ("amp_unscale clean", clean.clone(), None, true, 0.0),
        (
            "amp_unscale clean, found in 0",
            clean.clone(),
            Some(0.0),
            true,
            0.0,
        ),
        ("amp_unscale clean, found in 1", clean, Some(1.0), true, 1.0),
        ("amp_unscale nan and inf", bad, Some(0.0), false, 1.0),
    ] {
        let mut c = Case::new(name);
        let g = c.input("g", grad);
        let scale = c.var("scale", Tensor::full([1], 1024.0));
        let mut ins = vec![g, scale];
        if let Some(f) = found_in {
            ins.push(c.input("found_in", Tensor::full([1], f)));
        }
        let outs = c.g.op(Op::AmpUnscale, &ins);
        c.g.set_name(outs[0], "out");
        if fetch_grad {
            c.fetches.push("out".into());
        }
        c.fetches.push("out:1".into());
        c.tol = EXACT;
        cases.push((c, want));
    }
    cases
}

/// `AmpScaleUpdate` over four runs with a growth interval of 2: clean runs
/// grow the scale on the second, an overflow on every run halves it.
fn scale_update_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for found in [0.0f32, 1.0] {
        let mut c = Case::new(&format!("amp_scale_update found {found}"));
        let scale = c.var("scale", Tensor::full([1], 65536.0));
        let tracker = c.var("tracker", Tensor::full([1], 0.0));
        let f = c.input("found", Tensor::full([1], found));
        c.g.op(
            Op::AmpScaleUpdate {
                growth_factor: 2.0,
                backoff_factor: 0.5,
                growth_interval: 2,
            },
            &[scale, tracker, f],
        );
        c.runs = 4;
        c.tol = EXACT;
        cases.push(c);
    }
    cases
}

/// SGD with momentum and AdamW with a learning-rate scale and a skip flag
/// of 0 (the step applies) or 1 (nothing changes, Adam's step count
/// included), three runs each.
fn skip_cases() -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(42);
    let mut cases = Vec::new();
    for skip in [0.0f32, 1.0] {
        let mut c = Case::new(&format!("sgd skip {skip}"));
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let buf = c.var("buf", rnd(&mut rng, &[5, 7], -0.1, 0.1));
        let lr = c.var("lr", Tensor::full([1], 0.05));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let s = c.input("skip", Tensor::full([1], skip));
        let sgd = Op::SgdUpdate {
            lr: 1.0,
            momentum: 0.9,
            weight_decay: 1e-2,
            nesterov: false,
        };
        c.g.op(sgd, &[p, gi, buf, lr, s]);
        c.runs = 3;
        cases.push(c);
        let mut c = Case::new(&format!("adamw skip {skip}"));
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let m = c.var("m", Tensor::full([5, 7], 0.0));
        let v = c.var("v", Tensor::full([5, 7], 0.0));
        let step = c.var("step", Tensor::full([1], 0.0));
        let lr = c.var("lr", Tensor::full([1], 3e-3));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let s = c.input("skip", Tensor::full([1], skip));
        let adam = Op::AdamUpdate {
            lr: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            decoupled: true,
        };
        c.g.op(adam, &[p, gi, m, v, step, lr, s]);
        c.runs = 3;
        cases.push(c);
    }
    cases
}

/// fp16-mixed training of an MLP (16 → 32 → 10, batch 8) from a scale of
/// 2^30: the first run's fp16 gradients overflow on both backends and the
/// step is skipped; the backoff factor 2^-22 brings the scale to 2^8,
/// where the next three steps apply and the scale grows after two.
fn training_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for opt in [
        Optimizer::sgd_momentum(0.05, 0.9, 1e-4),
        Optimizer::adamw(1e-2, 0.01),
    ] {
        let mut rng = StdRng::seed_from_u64(43);
        let mut c = Case::new(&format!("amp fp16-mixed step {}", opt_name(&opt)));
        let x = c.input("x", rnd(&mut rng, &[8, 16], -1.0, 1.0));
        let labels = c.input("labels", ints(&mut rng, &[8], 10));
        let w1 = c.var("w1", rnd(&mut rng, &[16, 32], -0.3, 0.3));
        let b1 = c.var("b1", rnd(&mut rng, &[32], -0.1, 0.1));
        let w2 = c.var("w2", rnd(&mut rng, &[32, 10], -0.3, 0.3));
        let b2 = c.var("b2", rnd(&mut rng, &[10], -0.1, 0.1));
        let mut g = std::mem::take(&mut c.g);
        let h = g.matmul(x, w1);
        let h = g.add(h, b1);
        let h = g.relu(h);
        let logits = g.matmul(h, w2);
        let logits = g.add(logits, b2);
        let loss = g.cross_entropy(logits, labels);
        g.set_name(loss, "loss");
        let opts = TrainOptions {
            groups: vec![ParamGroup {
                params: ["w1", "b1", "w2", "b2"].map(String::from).to_vec(),
                optimizer: opt,
            }],
            precision: Precision::F16Mixed,
            loss_scale: LossScale {
                init_scale: 2f32.powi(30),
                growth_factor: 2.0,
                backoff_factor: 2f32.powi(-22),
                growth_interval: 2,
            },
            ..TrainOptions::default()
        };
        let t = training_graph_grouped(g, loss, &opts).unwrap();
        c.fetches.push(t.loss.clone());
        c.fetches.push(format!("{FOUND_INF_NODE}:1"));
        c.prebuilt = Some((t.graph, t.vars));
        // fp16 products: 8 units of fp16 (as half.rs's training step).
        let u = 1.0 / 1024.0;
        c.tol = Tol {
            rtol: 8.0 * u,
            atol: 8.0 * u,
        };
        c.runs = 4;
        cases.push(c);
    }
    cases
}

fn opt_name(o: &Optimizer) -> &'static str {
    match o {
        Optimizer::Sgd { .. } => "sgd momentum",
        Optimizer::Adam { .. } => "adam",
        Optimizer::AdamW { .. } => "adamw",
    }
}

#[test]
#[ignore = "needs a GPU"]
fn amp_ops_match_the_cpu() {
    let mut cases: Vec<Case> = unscale_cases().into_iter().map(|(c, _)| c).collect();
    cases.extend(scale_update_cases());
    cases.extend(skip_cases());
    run_all(cases);
}

#[test]
#[ignore = "needs a GPU"]
fn amp_fp16_mixed_training_steps_match_the_cpu() {
    run_all(training_cases());
}

/// A case's graph on the CPU backend, and what running it takes.
struct OnCpu {
    p: CpuProgram,
    name: String,
    feeds: BTreeMap<String, Tensor>,
    fetches: Vec<String>,
    runs: usize,
}

fn on_cpu(c: Case) -> OnCpu {
    let Case {
        name,
        g,
        feeds,
        fetches,
        runs,
        prebuilt,
        ..
    } = c;
    let (graph, vars) = match prebuilt {
        Some(p) => p,
        None => g.finish().unwrap(),
    };
    let vg = validate(graph, &large_limits()).unwrap();
    OnCpu {
        p: CpuProgram::new(vg, vars).unwrap(),
        name,
        feeds,
        fetches,
        runs,
    }
}

/// What the GPU cases check holds on the CPU: each builds and runs; the
/// found flags are the expected ones; the training case skips its first
/// step only (weights as initialised, the scale backed off to 2^8), then
/// grows the scale to 2^9 after two clean steps.
#[test]
fn amp_cases_hold_on_the_cpu() {
    for (c, want) in unscale_cases() {
        let mut c = on_cpu(c);
        let out = c.p.run(&c.feeds, &c.fetches).unwrap();
        let found = out.last().unwrap().f32s().unwrap()[0];
        assert_eq!(found, want, "{}", c.name);
    }
    for c in scale_update_cases().into_iter().chain(skip_cases()) {
        let mut c = on_cpu(c);
        for _ in 0..c.runs {
            c.p.run(&c.feeds, &c.fetches).unwrap();
        }
    }
    for c in training_cases() {
        let mut c = on_cpu(c);
        let name = c.name.clone();
        let init = c.p.read_variables(&[]).unwrap();
        let mut flags = Vec::new();
        for _ in 0..c.runs {
            let out = c.p.run(&c.feeds, &c.fetches).unwrap();
            assert!(out[0].f32s().unwrap()[0].is_finite(), "{name}");
            flags.push(out[1].f32s().unwrap()[0]);
            if flags.len() == 1 {
                let after = c.p.read_variables(&[]).unwrap();
                for (k, v) in &init {
                    if !k.starts_with("amp/") {
                        assert_eq!(v, &after[k], "{name}: {k} after the skipped step");
                    }
                }
                assert_eq!(after[SCALE_VARIABLE].f32s().unwrap(), &[256.0], "{name}");
            }
        }
        assert_eq!(flags, vec![1.0, 0.0, 0.0, 0.0], "{name}");
        let end = c.p.read_variables(&[]).unwrap();
        assert_eq!(end[SCALE_VARIABLE].f32s().unwrap(), &[512.0], "{name}");
        assert_ne!(end["w1"], init["w1"], "{name}");
    }
}
