//! Round trips through a real service on loopback TCP: one Run of a tiny
//! graph, Runs with a 19.3 MB feed and a 19.3 MB fetch (the size of a
//! ResNet-50 training batch of 32) with the feed through shared memory (the
//! client's default on loopback) and over the socket (`_socket`), and
//! sending a 64 MiB tensor (WriteVariables). Results and the command are in `docs/benchmarks.md`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use lanes::server::{self, ServerConfig};
use lanes_adaptor::{
    Client, ClientOptions, GraphBuilder, SessionSpec, Tensor, TensorType, VarValues,
};

fn service() -> server::ServerHandle {
    server::start(ServerConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        workers: 1,
        ..ServerConfig::default()
    })
    .expect("service starts")
}

fn tiny_run(c: &mut Criterion) {
    let svc = service();
    let mut client = Client::connect(svc.endpoint()).unwrap();
    let mut s = client
        .open_session(SessionSpec::inference("bench-tiny"))
        .unwrap();
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([1, 4]));
    let w = g.variable("w", Tensor::full([4, 4], 0.25));
    let y = g.matmul(x, w);
    let y = g.relu(y);
    g.set_name(y, "y");
    let (graph, vars) = g.finish().unwrap();
    s.load(&graph, vars).unwrap();
    let x = Tensor::from_f32([1, 4], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
    c.bench_function("roundtrip/run_tiny_graph", |b| {
        b.iter(|| s.run(vec![("x", x.clone())], &["y"]).unwrap())
    });
}

fn big_tensor(c: &mut Criterion) {
    const N: usize = 16 << 20; // 16 Mi f32 = 64 MiB
    let svc = service();
    let mut client = Client::connect(svc.endpoint()).unwrap();
    let mut s = client
        .open_session(SessionSpec::inference("bench-64mib"))
        .unwrap();
    let mut g = GraphBuilder::new();
    let v = g.variable("v", Tensor::full([N], 0.0));
    g.set_name(v, "v");
    let (graph, vars) = g.finish().unwrap();
    s.load(&graph, vars).unwrap();
    let t = Tensor::full([N], 1.5);
    let mut group = c.benchmark_group("roundtrip");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Bytes((N * 4) as u64));
    group.bench_function("write_variables_64MiB", |b| {
        b.iter(|| {
            let mut vals = VarValues::new();
            vals.insert("v".into(), t.clone());
            s.write_variables(vals).unwrap()
        })
    });
    group.finish();
}

/// Elements of the large feed: 32 × 3 × 224 × 224 f32, 19.3 MB.
const FEED: usize = 32 * 3 * 224 * 224;

/// A Run whose feed is large and whose work and fetch are tiny: `x[FEED]`
/// fed, `x[0..1]` fetched; and one that fetches all of `x` scaled by 1.
/// The feed is cloned outside the timed part (a Run consumes its feeds).
fn large_feed(c: &mut Criterion) {
    let svc = service();
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([FEED]));
    let head = g.slice(x, 0, 0, 1);
    g.set_name(head, "head");
    let all = g.scale(x, 1.0);
    g.set_name(all, "all");
    let (graph, vars) = g.finish().unwrap();
    let x = Tensor::full([FEED], 1.5);
    let mut group = c.benchmark_group("roundtrip");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Bytes((FEED * 4) as u64));
    // The client's default on loopback (feeds through a shared segment),
    // then the feeds over the socket.
    for (suffix, shared_memory) in [("", true), ("_socket", false)] {
        let mut client = Client::connect_with(
            svc.endpoint(),
            ClientOptions {
                shared_memory,
                ..ClientOptions::default()
            },
        )
        .unwrap();
        let mut s = client
            .open_session(SessionSpec::inference("bench-19MB"))
            .unwrap();
        s.load(&graph, vars.clone()).unwrap();
        group.bench_function(format!("run_feed_19MB{suffix}"), |b| {
            b.iter_batched(
                || vec![("x", x.clone())],
                |feeds| s.run(feeds, &["head"]).unwrap(),
                BatchSize::PerIteration,
            )
        });
        group.bench_function(format!("run_feed_fetch_19MB{suffix}"), |b| {
            b.iter_batched(
                || vec![("x", x.clone())],
                |feeds| s.run(feeds, &["all"]).unwrap(),
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, tiny_run, large_feed, big_tensor);
criterion_main!(benches);
