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

/// Five steps of the small ResNet, gated (an urgent session armed, 50 µs
/// segments) and not: the same loss each step and the same variables
/// after (the same kernels in the same order; only atomics may reorder
/// sums).
#[test]
#[ignore = "needs a GPU"]
fn gated_training_matches_the_whole_iteration() {
    let (t, feeds) = small_training();
    let vg = validate(t.graph, &large_limits()).unwrap();
    let fetch = vec![t.loss.clone()];
    let g = gate(50);
    let _armed = g.arm();
    let mut runs = Vec::new();
    for gated in [true, false] {
        let mut p = yielding(&vg, &t.vars, gated.then(|| Arc::clone(&g)));
        let losses: Vec<Tensor> = (0..5)
            .map(|_| p.run(&feeds, &fetch).unwrap().remove(0))
            .collect();
        if gated {
            let Program::Cuda(c) = &p else {
                panic!("a CPU program for the CUDA backend")
            };
            let segments = c.gated_segments();
            println!("gated: {segments} segments");
            assert!(segments > 4, "cut into {segments} segments");
        }
        runs.push((losses, p.read_variables(&[]).unwrap()));
    }
    // The first iterations run op by op either way; from the fourth the
    // gated program replays segments. Training steps reorder atomics'
    // sums (cuDNN's weight gradients, the batch norms' reductions) from
    // run to run: the tolerances of `models_training`.
    let mut worst = 0.0f32;
    for (k, (a, b)) in runs[0].0.iter().zip(&runs[1].0).enumerate() {
        worst = worst.max(compare(&format!("loss {k}"), a, b, ACCUM).unwrap());
    }
    for (name, x) in &runs[0].1 {
        let tol = var_tol(name, ACCUM, Some(TRAIN_VARS));
        worst = worst.max(compare(name, x, &runs[1].1[name], tol).unwrap());
    }
    println!("gated vs whole iteration, five steps: worst {worst:.3} of tolerance");
    let s = g.stats();
    assert!(s.launches > 0, "{s:?}");
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
