//! How long the memory planner takes on model-sized graphs (the ones of
//! `tests/memory_zoo.rs`), and what it plans.
//!
//! `cargo bench --bench planner` (prints P, T, lower bound and no-reuse once per graph).
//!
//! The `load` group times what a service does with a LoadGraph of a huge
//! graph on the CPU backend (validate, plan, build the program): a
//! 100,000-node chain and one input read by 99,999 nodes, each must load
//! in well under a second (issue 17: they took 30 s and 75 s).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use lanes::compile;

#[path = "../tests/memory/models.rs"]
mod models;

fn bench(c: &mut Criterion) {
    let cases = [
        (
            "resnet50 inference b8",
            models::resnet([3, 4, 6, 3], 8, false),
        ),
        (
            "resnet50 training b8",
            models::resnet([3, 4, 6, 3], 8, true),
        ),
        (
            "bert-base training b8 s128",
            models::bert_base(8, 128, true),
        ),
    ];
    let mut g = c.benchmark_group("plan");
    g.sample_size(20);
    for (name, graph) in &cases {
        let plan = compile::plan(graph).unwrap();
        compile::verify(&plan).unwrap();
        println!("{name}: {plan}");
        g.bench_function(*name, |b| {
            b.iter(|| compile::plan(std::hint::black_box(graph)).unwrap())
        });
    }
    g.finish();
}

/// A chain of `n` ReLUs, or (`fan`) `n` ReLUs of one input.
fn huge(n: usize, fan: bool) -> (lanes_adaptor::Graph, lanes_adaptor::VarValues) {
    use lanes_adaptor::{GraphBuilder, TensorType};
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4]));
    let mut h = x;
    for _ in 0..n {
        let y = g.relu(if fan { x } else { h });
        h = y;
    }
    g.finish().unwrap()
}

fn load(c: &mut Criterion) {
    use lanes_adaptor::{validate, GraphLimits};
    let limits = GraphLimits {
        max_nodes: 1 << 20,
        ..GraphLimits::default()
    };
    let mut g = c.benchmark_group("load");
    g.sample_size(10);
    for (name, fan) in [("chain 100k", false), ("fan-out 100k", true)] {
        let (graph, vars) = huge(99_999, fan);
        g.bench_function(name, |b| {
            b.iter(|| {
                let v = validate(graph.clone(), &limits).unwrap();
                let plan = compile::plan(&v).unwrap();
                std::hint::black_box(plan.ephemeral);
                lanes::exec::cpu::CpuProgram::new(v, vars.clone()).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench, load);
criterion_main!(benches);
