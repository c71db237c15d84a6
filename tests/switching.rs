//! Residency and pipelined switching: after any sequence of evictions and
//! pipelined loads (every strategy), outputs are bit-identical to a run that
//! stayed resident, for inference and for training (optimizer state included).
//!
//! Runs on the CPU backend in CI; `LANES_TEST_DEVICE=cuda` runs the same
//! tests on the CUDA backend (on the GPU machine).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use util::feeds_for;

use lanes::exec::cpu::CpuProgram;
use lanes::exec::{Backend, Program};
use lanes::residency::Strategy;
use std::collections::BTreeMap;

use lanes_adaptor::zoo::{Arch, ModelGraph};
use lanes_adaptor::{validate, GraphLimits, Optimizer, Tensor, VarValues};

fn cuda() -> bool {
    std::env::var("LANES_TEST_DEVICE").as_deref() == Ok("cuda")
}

/// The backend under test.
fn program(graph: lanes_adaptor::Graph, vars: VarValues) -> Program {
    let v = validate(graph, &GraphLimits::default()).unwrap();
    let backend = if cuda() { Backend::Cuda } else { Backend::Cpu };
    Program::new(backend, v, vars).unwrap()
}

/// A small MLP's inference graph (8 → 4 → 3, batch 1), feeds for it and
/// its fetch.
fn small_mlp() -> (ModelGraph, BTreeMap<String, Tensor>, [String; 1]) {
    let m = Arch::Mlp {
        inputs: 8,
        hidden: vec![4],
        classes: 3,
    }
    .inference(1, 1)
    .unwrap();
    let feeds = feeds_for(&m.inputs, 9, 3);
    let fetch = [m.output.clone()];
    (m, feeds, fetch)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.f32s().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn models() -> Vec<Arch> {
    vec![
        Arch::Mlp {
            inputs: 64,
            hidden: vec![64, 32],
            classes: 10,
        },
        Arch::LeNet {
            channels: 1,
            image: 28,
            classes: 10,
        },
        Arch::Transformer {
            vocab: 50,
            seq: 8,
            dim: 16,
            heads: 2,
            ff: 32,
            classes: 4,
        },
    ]
}

#[test]
fn inference_after_evictions_is_bit_identical_for_every_strategy() {
    for arch in models() {
        let m = arch.inference(2, 7).unwrap();
        let feeds = feeds_for(&m.inputs, 3, 4);
        let fetch = [m.output.clone()];
        let mut p = program(m.graph, m.vars);
        let (want, rep) = p
            .run_switching(&feeds, &fetch, Strategy::Pipelined)
            .unwrap();
        assert!(rep.is_none(), "resident runs switch nothing");
        let want = bits(&want[0]);
        for round in 0..2 {
            for s in Strategy::ALL {
                let copied = p.evict().unwrap();
                assert!(!p.is_resident());
                // The first eviction copies; an inference model's host copy
                // stays current, so later ones copy nothing.
                assert_eq!(
                    copied > 0,
                    round == 0 && s == Strategy::Pipelined,
                    "{}",
                    arch.name()
                );
                assert_eq!(p.evict().unwrap(), 0, "evicting twice is a no-op");
                let (got, rep) = p.run_switching(&feeds, &fetch, s).unwrap();
                let rep = rep.expect("a non-resident run switches");
                assert_eq!(rep.strategy, s);
                assert!(rep.groups >= 1 && rep.bytes > 0);
                match s {
                    Strategy::Single => assert_eq!(rep.groups, 1),
                    Strategy::PerLayer => assert!(rep.groups > 1),
                    Strategy::Pipelined => {}
                }
                assert!(p.is_resident());
                assert_eq!(bits(&got[0]), want, "{} {s} round {round}", arch.name());
                // And resident again afterwards.
                let (again, rep) = p.run_switching(&feeds, &fetch, s).unwrap();
                assert!(rep.is_none());
                assert_eq!(bits(&again[0]), want);
            }
        }
    }
}

#[test]
fn training_with_evictions_matches_training_without() {
    let arch = Arch::LeNet {
        channels: 1,
        image: 28,
        classes: 10,
    };
    let opt = Optimizer::adam(1e-3);
    let build = || {
        let (t, inputs) = arch.training(2, 5, &opt).unwrap();
        (program(t.graph, t.vars), inputs, t.loss)
    };
    let (mut steady, inputs, loss) = build();
    let (mut switched, _, _) = build();
    let fetch = [loss];
    for step in 0..6u64 {
        let feeds = feeds_for(&inputs, 100 + step, 10);
        let (a, _) = steady
            .run_switching(&feeds, &fetch, Strategy::Pipelined)
            .unwrap();
        // Evict before every other step, cycling through the strategies.
        if step % 2 == 1 {
            assert!(
                switched.evict().unwrap() > 0,
                "training state is copied out"
            );
        }
        let s = Strategy::ALL[(step as usize / 2) % 3];
        let (b, rep) = switched.run_switching(&feeds, &fetch, s).unwrap();
        assert_eq!(rep.is_some(), step % 2 == 1);
        assert_eq!(bits(&a[0]), bits(&b[0]), "loss at step {step}");
    }
    let (va, vb) = (
        steady.read_variables(&[]).unwrap(),
        switched.read_variables(&[]).unwrap(),
    );
    assert_eq!(va.len(), vb.len());
    for (name, t) in &va {
        assert_eq!(bits(t), bits(&vb[name]), "variable {name}");
    }
}

#[test]
fn variables_are_readable_and_writable_while_evicted() {
    let (m, feeds, fetch) = small_mlp();
    let mut p = program(m.graph.clone(), m.vars.clone());
    let before = p.read_variables(&[]).unwrap();
    p.evict().unwrap();
    assert_eq!(
        p.read_variables(&[]).unwrap(),
        before,
        "read from the host copy"
    );
    // A write while evicted lands in the host copy and is used on return.
    let zeroed = zeros_like(&before);
    p.write_variables(zeroed.clone()).unwrap();
    assert!(!p.is_resident());
    let (out, _) = p
        .run_switching(&feeds, &fetch, Strategy::Pipelined)
        .unwrap();
    assert!(out[0].f32s().unwrap().iter().all(|&x| x == 0.0));
    assert_eq!(p.read_variables(&[]).unwrap(), zeroed);
}

/// Every variable of `vars` as f32 zeros of its shape.
fn zeros_like(vars: &VarValues) -> VarValues {
    vars.iter()
        .map(|(n, t)| {
            let z = vec![0.0; t.shape().numel()];
            (n.clone(), Tensor::from_f32(t.shape().clone(), z).unwrap())
        })
        .collect()
}

#[test]
fn plans_cover_every_unit_in_order() {
    let m = Arch::LeNet {
        channels: 1,
        image: 28,
        classes: 10,
    }
    .inference(2, 1)
    .unwrap();
    let v = validate(m.graph, &GraphLimits::default()).unwrap();
    let mut p = CpuProgram::new(v, m.vars).unwrap();
    let feeds = feeds_for(&m.inputs, 1, 10);
    p.run(&feeds, std::slice::from_ref(&m.output)).unwrap();
    assert!(p.profile().is_some(), "the first resident run is profiled");
    p.evict().unwrap();
    let units = p.layout().units.len();
    assert!(units >= 8, "LeNet has weights and biases in several layers");
    for s in Strategy::ALL {
        let plan = p.plan(s);
        assert_eq!(plan.starts[0], 0);
        assert!(plan.starts.windows(2).all(|w| w[0] < w[1]));
        assert!(plan.starts.iter().all(|&u| u < units));
        assert!(plan.predicted.is_finite() && plan.predicted > 0.0);
    }
    assert!(p.plan(Strategy::Pipelined).predicted <= p.plan(Strategy::Single).predicted);
    assert!(p.plan(Strategy::Pipelined).predicted <= p.plan(Strategy::PerLayer).predicted);
}

/// The bytes of a program's first `n` units.
fn units_bytes(p: &Program, n: usize) -> u64 {
    p.layout().units[..n].iter().map(|u| u.bytes).sum()
}

/// Partial eviction: the program keeps its first units (at least the
/// bytes asked, whole units; on the GPU whole pieces of the mapping
/// granularity), the switch copies only the rest, the plan's first group is
/// the kept units, and the output is bit-identical to the resident run for
/// every strategy and size kept; evicting whole afterwards gives the kept
/// prefix up.
#[test]
fn partial_eviction_switches_back_bit_identical() {
    for arch in models() {
        let m = arch.inference(2, 7).unwrap();
        let feeds = feeds_for(&m.inputs, 3, 4);
        let fetch = [m.output.clone()];
        let mut p = program(m.graph, m.vars);
        let (want, _) = p
            .run_switching(&feeds, &fetch, Strategy::Pipelined)
            .unwrap();
        let want = bits(&want[0]);
        let total = p.persistent_bytes();
        let units = p.layout().units.len();
        // The first (whole) eviction measures the copy costs; a resident
        // iteration after it is profiled (the CUDA program profiles its
        // second resident iteration, the CPU one its first).
        p.evict().unwrap();
        for _ in 0..3 {
            p.run(&feeds, &fetch).unwrap();
        }
        let auto = p.auto_keep_bytes().expect("the costs are measured");
        // Whole units: none, or at least the first.
        assert!(auto == 0 || auto >= units_bytes(&p, 1), "{auto}");
        let half = units_bytes(&p, units / 2).max(1);
        for keep in [1, half, auto, u64::MAX] {
            for s in Strategy::ALL {
                p.evict_keeping(keep).unwrap();
                assert!(!p.is_resident());
                let (kept, ku) = (p.kept_bytes(), p.kept_units());
                if keep > 0 {
                    assert!(ku >= 1, "{} keep {keep}: nothing kept", arch.name());
                    assert!(kept >= units_bytes(&p, ku), "{kept} bytes for {ku} units");
                } else {
                    assert_eq!((kept, ku), (0, 0));
                }
                if keep == u64::MAX {
                    assert_eq!(ku, units, "keeping P or more keeps every unit");
                }
                // A CUDA program's kept block is device memory it holds.
                if let Some(own) = p.own_device_bytes() {
                    assert_eq!(own, kept, "an evicted program holds its kept block only");
                }
                let plan = p.plan(s);
                assert_eq!(plan.kept, ku, "{s}");
                if ku > 0 {
                    assert_eq!(plan.starts[0], 0);
                    assert_eq!(plan.starts.get(1).copied().unwrap_or(units), ku);
                    assert!(!plan.copies(0));
                }
                let (got, rep) = p.run_switching(&feeds, &fetch, s).unwrap();
                let rep = rep.expect("a partially evicted program switches");
                assert_eq!(rep.kept_bytes, units_bytes(&p, ku), "{s}");
                assert_eq!(rep.kept_bytes + rep.bytes, total, "{s}");
                assert_eq!(rep.groups, plan.groups());
                assert!(p.is_resident());
                assert_eq!((p.kept_bytes(), p.kept_units()), (0, 0));
                assert_eq!(
                    bits(&got[0]),
                    want,
                    "{} {s} keeping {keep} bytes ({ku} units)",
                    arch.name()
                );
            }
        }
        // Evicted partially, then whole: the kept prefix goes too, and the
        // next switch copies every unit.
        p.evict_keeping(half).unwrap();
        assert!(p.kept_bytes() > 0);
        assert_eq!(p.evict().unwrap(), 0, "the host copy is current");
        assert_eq!((p.kept_bytes(), p.kept_units()), (0, 0));
        assert_eq!(p.plan(Strategy::Pipelined).kept, 0);
        if let Some(own) = p.own_device_bytes() {
            assert_eq!(own, 0);
        }
        let (got, rep) = p
            .run_switching(&feeds, &fetch, Strategy::Pipelined)
            .unwrap();
        let rep = rep.unwrap();
        assert_eq!((rep.kept_bytes, rep.bytes), (0, total));
        assert_eq!(
            bits(&got[0]),
            want,
            "{} after a whole eviction",
            arch.name()
        );
    }
}

/// A variable of the kept prefix written while the program is evicted
/// partially is what the switched iteration uses (the kept units are not
/// copied back from the host image, so the write must reach them).
#[test]
fn writes_while_evicted_partially_reach_the_kept_units() {
    let (m, feeds, fetch) = small_mlp();
    let mut p = program(m.graph.clone(), m.vars.clone());
    p.run(&feeds, &fetch).unwrap();
    let before = p.read_variables(&[]).unwrap();
    p.evict_keeping(u64::MAX).unwrap();
    assert_eq!(p.kept_units(), p.layout().units.len());
    assert_eq!(p.read_variables(&[]).unwrap(), before);
    let zeroed = zeros_like(&before);
    p.write_variables(zeroed.clone()).unwrap();
    let (out, rep) = p
        .run_switching(&feeds, &fetch, Strategy::Pipelined)
        .unwrap();
    assert_eq!(rep.unwrap().bytes, 0, "every unit was kept");
    assert!(out[0].f32s().unwrap().iter().all(|&x| x == 0.0));
    assert_eq!(p.read_variables(&[]).unwrap(), zeroed);
}

/// The service evicts whole: a CPU program whose variables live in memory
/// handed in (the lanes' reservation) refuses a partial eviction, which
/// the lanes' accounting (a job's P all or nothing) could not count.
#[test]
fn memory_handed_in_is_only_evicted_whole() {
    use lanes::exec::cpu::CpuMemory;
    let (m, feeds, fetch) = small_mlp();
    let v = validate(m.graph, &GraphLimits::default()).unwrap();
    let mut p = CpuProgram::new(v, m.vars).unwrap();
    let words = p.persistent_buffer_bytes() as usize / 8;
    let mut region = vec![0u64; words];
    let mut arena = vec![0u64; (p.ephemeral_bytes() as usize).div_ceil(8)];
    let mem = CpuMemory {
        persistent: &mut region,
        arena: &mut arena,
    };
    p.run_in(Some(mem), &feeds, &fetch, Strategy::Pipelined)
        .unwrap();
    assert!(p.is_given());
    assert!(p.evict_keeping(1).is_err());
    assert!(
        p.is_given(),
        "a refused eviction leaves the program as it was"
    );
    p.evict_in(Some(&region)).unwrap();
    assert!(!p.is_resident());
    assert_eq!(p.kept_bytes(), 0);
}

/// On the GPU a switch copies its feeds into the staging buffer while the
/// host maps the arena (docs/switching.md, *Feeds staged*); with staging
/// off it maps first and copies them into place. Both give the resident
/// run's outputs bit for bit, for every model and across repeated
/// switches. On the CPU nothing is staged.
#[test]
fn feeds_staged_or_not_give_the_resident_outputs() {
    for arch in models() {
        let m = arch.inference(3, 5).unwrap();
        let feeds = feeds_for(&m.inputs, 11, 6);
        let fetch = [m.output.clone()];
        let mut p = program(m.graph, m.vars);
        let (want, _) = p
            .run_switching(&feeds, &fetch, Strategy::Pipelined)
            .unwrap();
        let want = bits(&want[0]);
        let mut staged = 0;
        for round in 0..6 {
            // Alternated; other tests of this binary may switch meanwhile
            // (they then take the buffer, or find staging off).
            let stage = round % 2 == 0;
            lanes::exec::cuda::set_stage_feeds(stage);
            p.evict().unwrap();
            let (got, rep) = p
                .run_switching(&feeds, &fetch, Strategy::Pipelined)
                .unwrap();
            lanes::exec::cuda::set_stage_feeds(true);
            let rep = rep.expect("a non-resident run switches");
            if !cuda() || !stage {
                assert!(!rep.feeds_staged, "{} round {round}", arch.name());
            }
            staged += usize::from(rep.feeds_staged);
            assert_eq!(bits(&got[0]), want, "{} round {round}", arch.name());
        }
        if cuda() {
            assert!(staged >= 1, "{}: no switch staged its feeds", arch.name());
            assert!(lanes::exec::cuda::staging_bytes() > 0);
        }
    }
}
