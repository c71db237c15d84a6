//! A yielding job's iterations through the device gate (`exec::gate`) on
//! the GPU: cut into segments, they compute what the whole recorded
//! iteration computes, and an urgent Run never finds more than one of
//! them on the GPU.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use lanes::exec::gate::{Gate, GateConfig, GateMode};

fn gate(segment_us: u64) -> Arc<Gate> {
    Gate::new(GateConfig {
        mode: GateMode::Hold,
        release: Duration::from_micros(100),
        segment: Duration::from_micros(segment_us),
        ..GateConfig::default()
    })
}

fn yielding(vg: &lanes_adaptor::ValidGraph, vars: &VarValues, gate: Option<Arc<Gate>>) -> Program {
    let share = GpuShare {
        urgency: 0,
        yields: true,
        gate,
    };
    Program::sharing(Backend::Cuda, vg.clone(), vars.clone(), share).unwrap()
}

/// `steps` training steps of `t` on a yielding program, through `gate`
/// (armed) or not: each step's loss, then every variable.
fn train(
    t: &lanes_adaptor::TrainingGraph,
    feeds: &BTreeMap<String, Tensor>,
    gate: Option<Arc<Gate>>,
    steps: usize,
) -> (Vec<Tensor>, Vec<(String, Tensor)>, usize) {
    let vg = validate(t.graph.clone(), &large_limits()).unwrap();
    let mut p = yielding(&vg, &t.vars, gate);
    let fetch = vec![t.loss.clone()];
    let losses = (0..steps)
        .map(|_| p.run(feeds, &fetch).unwrap().remove(0))
        .collect();
    let segments = match &p {
        Program::Cuda(c) => c.gated_segments(),
        Program::Cpu(_) => panic!("a CPU program for the CUDA backend"),
    };
    let vars = p.read_variables(&[]).unwrap().into_iter().collect();
    (losses, vars, segments)
}

/// An MLP's training steps (matrix products and elementwise kernels; no
/// batch norm, so differences do not grow) through the gate in 10 µs
/// segments, and replayed whole: within `FP32` after 8 steps (the same
/// program's first, op-by-op step already differed in the last bits
/// between two runs on the H200).
/// A small ResNet's (cuDNN's weight gradients and the batch norms'
/// reductions reorder sums from run to run, and the differences grow step
/// by step: after four steps a batch norm's bias near zero differed by
/// 1e-4 between the two on the H200): its first four losses within
/// `models_training`'s tolerances; the fourth step is the first the gated
/// program replays as segments.
#[test]
#[ignore = "needs a GPU"]
fn gated_training_matches_the_whole_iteration() {
    use lanes_adaptor::{Arch, Optimizer};
    let arch = Arch::Mlp {
        inputs: 256,
        hidden: vec![512, 512],
        classes: 10,
    };
    let (t, inputs) = arch
        .training(64, 3, &Optimizer::sgd_momentum(0.05, 0.9, 1e-4))
        .unwrap();
    let feeds = lanes_adaptor::zoo::seeded_feeds(&inputs, 5, 10).unwrap();
    let g = gate(10);
    let _armed = g.arm();
    let (la, va, segments) = train(&t, &feeds, Some(Arc::clone(&g)), 8);
    let (lb, vb, _) = train(&t, &feeds, None, 8);
    println!("mlp gated: {segments} segments");
    assert!(segments > 2, "cut into {segments} segments");
    let mut worst = 0.0f32;
    for (k, (a, b)) in la.iter().zip(&lb).enumerate() {
        worst = worst.max(compare(&format!("mlp loss {k}"), a, b, FP32).unwrap());
    }
    for ((name, a), (_, b)) in va.iter().zip(&vb) {
        worst = worst.max(compare(name, a, b, FP32).unwrap());
    }
    println!("mlp gated vs whole iteration, eight steps: worst {worst:.3} of tolerance");

    let (t, feeds) = small_training();
    let g = gate(50);
    let _armed = g.arm();
    let (la, _, segments) = train(&t, &feeds, Some(Arc::clone(&g)), 4);
    let (lb, _, _) = train(&t, &feeds, None, 4);
    println!("resnet gated: {segments} segments");
    assert!(segments > 4, "cut into {segments} segments");
    // The first loss comes from the same weights: within ACCUM. Later ones
    // follow updates whose gradients differ run to run on the GPU alone
    // (atomics, cuDNN's algorithms; ReLU kinks amplify it): on an H200
    // the fourth loss of the gated run was 0.07509 in one process and
    // 0.07479 in another, so they are held to TRAIN_VARS.
    let mut worst = 0.0f32;
    for (k, (a, b)) in la.iter().zip(&lb).enumerate() {
        let tol = if k == 0 { ACCUM } else { TRAIN_VARS };
        worst = worst.max(compare(&format!("loss {k}"), a, b, tol).unwrap());
    }
    println!("resnet gated vs whole iteration, four losses: worst {worst:.3} of tolerance");
    assert!(g.stats().launches > 0, "{:?}", g.stats());
}

/// Training through the gate while another thread runs urgent iterations
/// of a small ResNet inside it: whenever an urgent Run entered, at most
/// one training segment was on the GPU; training made progress and waited
/// at the gate.
#[test]
#[ignore = "needs a GPU"]
fn an_urgent_run_finds_at_most_one_segment_in_flight() {
    let (t, feeds) = small_training();
    let vg = validate(t.graph, &large_limits()).unwrap();
    let g = gate(100);
    let armed = g.arm();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let urgent = {
        let (g, stop) = (Arc::clone(&g), Arc::clone(&stop));
        let built = models::resnet(&[1, 1, 1, 1], 2, 32).unwrap();
        let mut rng = StdRng::seed_from_u64(3);
        let feeds: BTreeMap<String, Tensor> = built
            .inputs
            .iter()
            .map(|(n, ty)| (n.clone(), rnd(&mut rng, ty.shape.dims(), -1.0, 1.0)))
            .collect();
        let vg = validate(built.graph, &large_limits()).unwrap();
        let fetch = vec![built.output.clone()];
        std::thread::spawn(move || {
            let mut p = CudaProgram::new(vg, built.vars).unwrap();
            let mut runs = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let inside = g.enter();
                p.run(&feeds, &fetch).unwrap();
                drop(inside);
                runs += 1;
                std::thread::sleep(Duration::from_micros(500));
            }
            runs
        })
    };
    let mut p = yielding(&vg, &t.vars, Some(Arc::clone(&g)));
    let fetch = vec![t.loss.clone()];
    for _ in 0..30 {
        p.run(&feeds, &fetch).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let runs = urgent.join().unwrap();
    drop(armed);
    let s = g.stats();
    println!("urgent runs {runs}, gate {s:?}");
    assert!(runs > 10, "{runs} urgent runs");
    assert!(s.max_in_flight_at_entry <= 1, "{s:?}");
    assert_eq!(s.launched_beside_urgent, 0, "hold mode: {s:?}");
    assert!(
        s.refusals > 0 && s.waited_ns > 0,
        "training never waited: {s:?}"
    );
}
