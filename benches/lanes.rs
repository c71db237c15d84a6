//! Do two jobs in different lanes run in parallel? A lane is a worker
//! thread ([`LaneWorkers`]); each job's iteration is an MLP forward pass
//! (batch 64, four 512×512 layers with ReLU, a plain triple-loop matrix
//! product on the job's own weights: CPU-bound, single-threaded). Three
//! cases, each running `ITERS` iterations per job:
//!
//! - `one job alone`: job A on lane 0;
//! - `pair, same lane`: A and B both on lane 0 (time-shared: ~2× the time);
//! - `pair, two lanes`: A on lane 0, B on lane 1 (parallel: ~1× the time
//!   when two cores are free).
//!
//! Throughput is reported in iterations per second.
//!
//! `cargo bench --bench lanes`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lanes::lanes::{LaneId, LaneWorkers};
use std::sync::Arc;
use std::time::Duration;

const ITERS: usize = 4;
const BATCH: usize = 64;
const WIDTH: usize = 512;
const LAYERS: usize = 4;

/// A job: its weights.
type Job = Arc<Vec<Vec<f32>>>;

fn job(seed: f32) -> Job {
    Arc::new(
        (0..LAYERS)
            .map(|l| {
                (0..WIDTH * WIDTH)
                    .map(|i| ((i + l) % 7) as f32 * seed / WIDTH as f32)
                    .collect()
            })
            .collect(),
    )
}

/// One iteration: x -> (matmul, relu) × LAYERS.
fn iteration(weights: &[Vec<f32>]) -> f32 {
    let mut h = vec![0.5f32; BATCH * WIDTH];
    let mut out = vec![0.0f32; BATCH * WIDTH];
    for w in weights {
        out.fill(0.0);
        for i in 0..BATCH {
            let row = &mut out[i * WIDTH..(i + 1) * WIDTH];
            for k in 0..WIDTH {
                let a = h[i * WIDTH + k];
                let wr = &w[k * WIDTH..(k + 1) * WIDTH];
                for (o, &b) in row.iter_mut().zip(wr) {
                    *o += a * b;
                }
            }
        }
        for v in out.iter_mut() {
            *v = v.max(0.0);
        }
        std::mem::swap(&mut h, &mut out);
    }
    h[0]
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
                    .submit(*lane, move || std::hint::black_box(iteration(&j)))
                    .unwrap(),
            );
        }
    }
    for p in pending {
        p.recv().unwrap();
    }
}

fn bench(c: &mut Criterion) {
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
