//! One scheduling decision (`Policy::pick`) with 1,000 active jobs, per
//! policy; and one placement over 8 lanes. Target: under 10 µs per decision.
//!
//! `cargo bench --bench policy`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use lanes_policies::{by_name, Event, JobKind, JobSpec, JobTable, LaneView, POLICY_NAMES};

const JOBS: u64 = 1_000;
const LANES: usize = 4;

/// 1,000 jobs over 4 lanes, mixed kinds and priorities, each with a few
/// measured iterations, 90 % of them waiting.
fn snapshot() -> JobTable {
    let mut t = JobTable::new();
    let z = Duration::ZERO;
    for id in 0..JOBS {
        let kind = if id % 3 == 0 {
            JobKind::Inference
        } else {
            JobKind::Training
        };
        let spec = JobSpec::new(id, kind, 100 + (id * 7919) % 5000)
            .with_priority((id % 5) as i32)
            .with_memory(1 << 20, 1 << 22)
            .with_hint(Duration::from_micros(500 + (id * 31) % 20_000));
        t.apply(
            &Event::Arrived {
                spec,
                lane: (id as usize) % LANES,
            },
            z,
        )
        .unwrap();
        for k in 0..(id % 4) {
            t.apply(&Event::Queued { job: id }, z).unwrap();
            t.apply(&Event::Started { job: id }, z).unwrap();
            let d = Duration::from_micros(400 + (id * 13 + k * 101) % 30_000);
            t.apply(
                &Event::IterationFinished {
                    job: id,
                    duration: d,
                },
                z,
            )
            .unwrap();
        }
        if id % 10 != 0 {
            t.apply(&Event::Queued { job: id }, z).unwrap();
        }
    }
    t
}

fn pick(c: &mut Criterion) {
    let table = snapshot();
    let mut g = c.benchmark_group("pick_1000_jobs");
    for name in POLICY_NAMES {
        let mut policy = by_name(name).unwrap();
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            let mut lane = 0;
            b.iter(|| {
                lane = (lane + 1) % LANES;
                black_box(policy.pick(
                    black_box(lane),
                    black_box(table.jobs()),
                    Duration::from_secs(1),
                ))
            })
        });
    }
    g.finish();
}

fn place(c: &mut Criterion) {
    let lanes: Vec<LaneView> = (0..8)
        .map(|i| LaneView {
            id: i,
            capacity: 8 << 30,
            persistent_sum: (i as u64 + 1) << 29,
            max_ephemeral: 1 << 28,
            jobs: i,
        })
        .collect();
    let spec = JobSpec::new(1, JobKind::Training, 10).with_memory(1 << 29, 1 << 28);
    let mut g = c.benchmark_group("place_8_lanes");
    for name in POLICY_NAMES {
        let mut policy = by_name(name).unwrap();
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| black_box(policy.place(black_box(&spec), black_box(&lanes), Duration::ZERO)))
        });
    }
    g.finish();
}

criterion_group!(benches, pick, place);
criterion_main!(benches);
