//! Reshapes as views (`compile::views`) on the GPU: a reshape of an
//! ephemeral tensor shares its input's bytes, launches nothing, and every
//! member of its class reads what the CPU reference computes, op by op
//! and replayed from a recorded CUDA graph; a reshape of a variable is
//! still a copy.

use super::*;

/// x → reshape (a feed's view) → relu → reshape → reshape → matmul, the
/// relu's output read again after its reshapes, a variable reshaped (a
/// copy), every member fetched.
fn reshape_graph(rng: &mut StdRng) -> (lanes_adaptor::ValidGraph, VarValues, Vec<String>) {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", lanes_adaptor::TensorType::f32([8, 4, 32]));
    let r0 = b.reshape(x, &[32, 32]);
    let a = b.relu(r0);
    let flat = b.reshape(a, &[1024]);
    let sq = b.reshape(flat, &[32, 32]);
    let w = b.variable("w", rnd(rng, &[32, 32], -0.2, 0.2));
    let m = b.matmul(sq, w);
    let again = b.tanh(a);
    let y = b.add(m, again);
    let wr = b.reshape(w, &[1024]);
    let z = b.add(flat, wr);
    let names = ["r0", "a", "flat", "sq", "y", "z"];
    for (o, n) in [r0, a, flat, sq, y, z].into_iter().zip(names) {
        b.set_name(o, n);
    }
    let (graph, vars) = b.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    (vg, vars, names.iter().map(|s| s.to_string()).collect())
}

/// Every fetch of the reshape chain within `ACCUM` of the CPU (the
/// reshapes themselves exactly: same bytes), over iterations launched op
/// by op and replayed; the three views launch nothing (not in the op
/// profile), the variable's reshape launches its copy.
#[test]
#[ignore = "needs a GPU"]
fn reshape_views_match_the_cpu_and_launch_nothing() {
    let mut rng = StdRng::seed_from_u64(29);
    let (vg, vars, fetches) = reshape_graph(&mut rng);
    let plan = lanes::compile::plan(&vg).unwrap();
    lanes::compile::verify(&plan).unwrap();
    assert_eq!(plan.views(), 3, "{plan}");
    let feeds: BTreeMap<String, Tensor> =
        [("x".to_string(), rnd(&mut rng, &[8, 4, 32], -1.0, 1.0))].into();
    let mut cpu = CpuProgram::new(vg.clone(), vars.clone()).unwrap();
    let mut gpu = CudaProgram::new(vg, vars).unwrap();
    let want = cpu.run(&feeds, &fetches).unwrap();
    // Warm-up, profiled, recorded, replayed.
    for k in 0..4 {
        let got = gpu.run(&feeds, &fetches).unwrap();
        for ((c, g), key) in want.iter().zip(&got).zip(&fetches) {
            compare(&format!("iteration {k}: {key}"), c, g, ACCUM).unwrap();
        }
        // A view reads its class's bytes: exactly the relu's values.
        assert_eq!(got[2].f32s().unwrap(), got[1].f32s().unwrap());
        assert_eq!(got[3].f32s().unwrap(), got[1].f32s().unwrap());
    }
    assert_eq!(gpu.views(), 3);
    let prof = gpu.profile_ops(&feeds, &fetches).unwrap();
    let reshapes: Vec<_> = prof.by_op.iter().filter(|r| r.0 == "reshape").collect();
    assert_eq!(reshapes.len(), 1, "{:?}", prof.by_op);
    assert_eq!(reshapes[0].1, 1, "only the variable's reshape launches");
}

/// LeNet training steps (its flatten and the flatten's gradient are
/// views) on both backends, FP32 convolutions: after one step the loss and
/// the variables within the model tolerances, later (recorded and
/// replayed) steps' losses close, and no reshape in the op profile. With views off
/// (`LANES_NO_VIEWS=1` set for the whole test process) the same test
/// checks the copies instead: the views count is then 0.
#[test]
#[ignore = "needs a GPU"]
fn training_with_views_matches_the_cpu() {
    use lanes_adaptor::{Arch, Optimizer};
    let (t, inputs) = Arch::LeNet {
        channels: 1,
        image: 28,
        classes: 10,
    }
    .training(8, 3, &Optimizer::sgd_momentum(0.05, 0.9, 1e-4))
    .unwrap();
    let feeds = lanes_adaptor::zoo::seeded_feeds(&inputs, 3, 10).unwrap();
    let vg = validate(t.graph, &large_limits()).unwrap();
    let plan = lanes::compile::plan(&vg).unwrap();
    let views_on = std::env::var("LANES_NO_VIEWS").as_deref() != Ok("1");
    assert_eq!(plan.views() > 0, views_on, "{plan}");
    let mut cpu = CpuProgram::new(vg.clone(), t.vars.clone()).unwrap();
    let opts = CudaOptions {
        conv_tf32: false,
        ..CudaOptions::default()
    };
    let mut gpu = CudaProgram::with_options(vg, t.vars, opts).unwrap();
    let fetch = vec![t.loss.clone()];
    // One step: the loss and every variable (as `models_training`).
    let a = cpu.run(&feeds, &fetch).unwrap();
    let b = gpu.run(&feeds, &fetch).unwrap();
    compare("loss, step 0", &a[0], &b[0], ACCUM).unwrap();
    let va: BTreeMap<String, Tensor> = cpu.read_variables(&[]).unwrap().into_iter().collect();
    let vb: BTreeMap<String, Tensor> = gpu.read_variables(&[]).unwrap().into_iter().collect();
    for (name, x) in &va {
        compare(name, x, &vb[name], TRAIN_VARS).unwrap();
    }
    // Recorded and replayed steps: the losses stay close.
    for step in 1..4 {
        let a = cpu.run(&feeds, &fetch).unwrap();
        let b = gpu.run(&feeds, &fetch).unwrap();
        compare(&format!("loss, step {step}"), &a[0], &b[0], TF32).unwrap();
    }
    assert_eq!(gpu.views(), plan.views());
    let prof = gpu.profile_ops(&feeds, &fetch).unwrap();
    let launched = prof.by_op.iter().any(|r| r.0 == "reshape");
    assert_eq!(launched, !views_on, "{:?}", prof.by_op);
}
