//! Do two jobs in different lanes run in parallel? Each job is an MLP
//! (batch 64, four 512×512 layers) on the CPU backend; a lane is a worker
//! thread ([`LaneWorkers`]). Three cases, each running `ITERS` iterations
//! per job:
//!
//! - `one job alone`: job A on lane 0;
//! - `pair, same lane`: A and B both on lane 0 (time-shared: ~2× the time);
//! - `pair, two lanes`: A on lane 0, B on lane 1 (parallel: ~1× the time
//!   when two cores are free).
//!
//! Throughput is reported in iterations per second. Matrix products are
//! kept single-threaded (`MATMUL_NUM_THREADS=1`) so that parallelism comes
//! from the lanes only.
//!
//! `cargo bench --bench lanes`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lanes::exec::cpu::CpuProgram;
use lanes::lanes::{LaneId, LaneWorkers};
use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Tensor, TensorType};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const ITERS: usize = 4;
const BATCH: usize = 64;
const WIDTH: usize = 512;

type Job = Arc<Mutex<CpuProgram>>;

fn job(seed: f32) -> Job {
    let mut b = GraphBuilder::new();
    let mut h = b.placeholder("x", TensorType::f32([BATCH, WIDTH]));
    for i in 0..4 {
        let w = b.variable(
            &format!("w{i}"),
            Tensor::full([WIDTH, WIDTH], seed / WIDTH as f32),
        );
        let y = b.matmul(h, w);
        h = b.relu(y);
    }
    b.set_name(h, "y");
    let (g, vars) = b.finish().unwrap();
    let g = validate(g, &GraphLimits::default()).unwrap();
    Arc::new(Mutex::new(CpuProgram::new(g, vars).unwrap()))
}

fn feeds() -> BTreeMap<String, Tensor> {
    let mut f = BTreeMap::new();
    f.insert("x".to_string(), Tensor::full([BATCH, WIDTH], 0.5));
    f
}

/// Runs `ITERS` iterations of each (job, lane) pair, each job's iterations
/// back to back on its lane, and waits for all of them.
fn run(workers: &mut LaneWorkers, jobs: &[(Job, LaneId)]) {
    let mut pending = Vec::new();
    for _ in 0..ITERS {
        for (j, lane) in jobs {
            let j = j.clone();
            pending.push(
                workers
                    .submit(*lane, move || {
                        let out = j.lock().unwrap().run(&feeds(), &["y".to_string()]).unwrap();
                        std::hint::black_box(out);
                    })
                    .unwrap(),
            );
        }
    }
    for p in pending {
        p.recv().unwrap();
    }
}

fn bench(c: &mut Criterion) {
    std::env::set_var("MATMUL_NUM_THREADS", "1");
    let (a, b) = (job(1.0), job(2.0));
    let mut workers = LaneWorkers::new();
    let mut g = c.benchmark_group("lanes");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    g.throughput(Throughput::Elements(ITERS as u64));
    g.bench_function("one job alone", |bch| {
        bch.iter(|| run(&mut workers, &[(a.clone(), LaneId(0))]))
    });
    g.throughput(Throughput::Elements(2 * ITERS as u64));
    g.bench_function("pair, same lane", |bch| {
        bch.iter(|| {
            run(
                &mut workers,
                &[(a.clone(), LaneId(0)), (b.clone(), LaneId(0))],
            )
        })
    });
    g.bench_function("pair, two lanes", |bch| {
        bch.iter(|| {
            run(
                &mut workers,
                &[(a.clone(), LaneId(0)), (b.clone(), LaneId(1))],
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
