//! How long the memory planner takes on model-sized graphs (the ones of
//! `tests/memory_zoo.rs`), and what it plans.
//!
//! `cargo bench --bench planner` (prints P, T, lower bound and no-reuse once per graph).

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

criterion_group!(benches, bench);
criterion_main!(benches);
