//! Packing many models from one client: no count of sessions meant for
//! hostile clients refuses a deployment (docs/protocol.md, *Limits*), and
//! loads of an architecture the service has seen reuse what a load
//! computes that does not depend on the weights (the load cache,
//! docs/memory.md). CPU here; `LANES_TEST_DEVICE=cuda` runs the same cases
//! against a GPU-backed service.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::sync::{Mutex, MutexGuard, PoisonError};

use lanes::compile::cache;
use lanes_adaptor::wire::{Reply, Request, SessionId};
use lanes_adaptor::{Client, Graph, GraphBuilder, SessionSpec, Tensor, TensorType, VarValues};
use util::*;

/// The load cache and its counters are the process's: these tests take
/// turns, so that one's loads do not count in another's.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `y = relu(x @ w + b)`, x [rows, cols], w [cols, outs], b [outs], the
/// weights from `seed`.
fn dense(rows: usize, cols: usize, outs: usize, seed: u64) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([rows, cols]));
    let w = g.variable(
        "w",
        Tensor::from_f32([cols, outs], values(seed, cols * outs)).unwrap(),
    );
    let b = g.variable(
        "b",
        Tensor::from_f32([outs], values(seed + 1, outs)).unwrap(),
    );
    let h = g.matmul(x, w);
    let h = g.add(h, b);
    let y = g.relu(h);
    g.set_name(y, "y");
    g.finish().unwrap()
}

/// Loads `dense(rows, cols, outs, seed)` into a new session of `c`, runs
/// it once and checks the result against the reference; returns it.
fn load_and_check(
    c: &mut Client,
    (rows, cols, outs): (usize, usize, usize),
    seed: u64,
) -> (SessionId, Vec<f32>) {
    let id = open(c, &format!("dense-{rows}x{cols}x{outs}-{seed}"));
    let (graph, vars) = dense(rows, cols, outs, seed);
    c.load_in(id, &graph, vars).unwrap();
    let x = Tensor::from_f32([rows, cols], values(99, rows * cols)).unwrap();
    let out = c.run_in(id, vec![("x", x.clone())], &["y"]).unwrap();
    let got = out[0].f32s().unwrap().to_vec();
    let want = dense_relu_ref(
        x.f32s().unwrap(),
        &values(seed, cols * outs),
        &values(seed + 1, outs),
        rows,
        cols,
        outs,
    );
    assert_close(&got, &want);
    (id, got)
}

fn open(c: &mut Client, name: &str) -> SessionId {
    match c
        .request(&Request::OpenSession(SessionSpec::inference(name)))
        .unwrap()
    {
        Reply::SessionOpened { session } => session,
        other => panic!("{other:?}"),
    }
}

fn x_for(seed: u64) -> Tensor {
    Tensor::from_f32([BATCH, IN], values(seed, BATCH * IN)).unwrap()
}

/// 200 sessions, each with a graph and weights of its own, opened and
/// loaded over one connection under the default limits (the old per-client
/// cap was 64), and every one of them answers its Runs correctly.
#[test]
fn two_hundred_packed_models_from_one_client_all_answer() {
    const MODELS: u64 = 200;
    let _turn = one_at_a_time();
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let mut models = Vec::new();
    for m in 0..MODELS {
        let id = open(&mut c, &format!("model-{m}"));
        let (graph, vars) = linear_relu(1000 + 2 * m);
        c.load_in(id, &graph, vars).unwrap();
        models.push(id);
    }
    assert_eq!(c.status().unwrap().sessions.len(), MODELS as usize);
    for (m, id) in models.iter().enumerate() {
        let seed = 1000 + 2 * m as u64;
        let x = x_for(m as u64);
        let out = c.run_in(*id, vec![("x", x.clone())], &["y"]).unwrap();
        let want = linear_relu_ref(
            x.f32s().unwrap(),
            &values(seed, IN * OUT),
            &values(seed + 1, OUT),
        );
        assert_close(out[0].f32s().unwrap(), &want);
    }
}

/// A second load of an architecture the service has seen takes its
/// validated graph and memory plans from the load cache (every lookup
/// hits, none misses) and answers correctly.
#[test]
fn a_second_load_of_an_architecture_hits_the_load_cache() {
    let _turn = one_at_a_time();
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let shape = (5, 7, 3); // this test's alone
    let before = cache::stats();
    load_and_check(&mut c, shape, 1);
    let first = cache::stats();
    assert_eq!(
        (first.graph_hits, first.graph_misses),
        (before.graph_hits, before.graph_misses + 1),
        "the first load validates: {before:?} → {first:?}"
    );
    assert!(
        first.plan_misses > before.plan_misses,
        "and plans: {before:?} → {first:?}"
    );
    load_and_check(&mut c, shape, 3);
    let second = cache::stats();
    assert_eq!(
        (second.graph_hits, second.graph_misses, second.plan_misses),
        (first.graph_hits + 1, first.graph_misses, first.plan_misses),
        "validation and planning skipped: {first:?} → {second:?}"
    );
    assert!(second.plan_hits > first.plan_hits, "{first:?} → {second:?}");
    assert!(second.entries > 0 && second.bytes > 0, "{second:?}");
}

/// A graph of another shape, or another architecture, does not hit: its
/// lookups miss and it is validated and planned afresh (and correct).
#[test]
fn another_shape_or_architecture_does_not_hit() {
    let _turn = one_at_a_time();
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    load_and_check(&mut c, (3, 9, 4), 5);
    let seen = cache::stats();
    // Another shape of the same layers.
    load_and_check(&mut c, (3, 9, 5), 5);
    let shape = cache::stats();
    let missed = |a: &cache::CacheStats, b: &cache::CacheStats| {
        assert_eq!(
            (b.graph_hits, b.graph_misses),
            (a.graph_hits, a.graph_misses + 1),
            "validated afresh: {a:?} → {b:?}"
        );
        assert!(
            b.plan_misses > a.plan_misses,
            "planned afresh: {a:?} → {b:?}"
        );
    };
    missed(&seen, &shape);
    // Another architecture: a Sigmoid where the Relu was.
    let id = open(&mut c, "sigmoid");
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([3, 9]));
    let w = g.variable("w", Tensor::from_f32([9, 4], values(5, 36)).unwrap());
    let b = g.variable("b", Tensor::from_f32([4], values(6, 4)).unwrap());
    let h = g.matmul(x, w);
    let h = g.add(h, b);
    let y = g.sigmoid(h);
    g.set_name(y, "y");
    let (graph, vars) = g.finish().unwrap();
    c.load_in(id, &graph, vars).unwrap();
    missed(&shape, &cache::stats());
    let out = c
        .run_in(id, vec![("x", Tensor::full([3, 9], 0.0))], &["y"])
        .unwrap();
    // x = 0: y = sigmoid(b), whatever w.
    let row: Vec<f32> = values(6, 4)
        .iter()
        .map(|b| 1.0 / (1.0 + (-b).exp()))
        .collect();
    let want = row.repeat(3);
    assert_close(out[0].f32s().unwrap(), &want);
}

/// Two sessions of one architecture with different weights share the
/// cache's entries and still give different results, each its own
/// weights' (checked against the reference).
#[test]
fn one_architecture_with_different_weights_gives_each_its_own_results() {
    let _turn = one_at_a_time();
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let shape = (6, 4, 2);
    let (first, a) = load_and_check(&mut c, shape, 11);
    let hits = cache::stats().graph_hits;
    let (_, b) = load_and_check(&mut c, shape, 21);
    assert_eq!(cache::stats().graph_hits, hits + 1, "the second load hit");
    assert_ne!(a, b, "different weights, different results");
    // The first session still answers with its own weights.
    let x = Tensor::from_f32([6, 4], values(99, 24)).unwrap();
    let again = c.run_in(first, vec![("x", x)], &["y"]).unwrap();
    assert_eq!(again[0].f32s().unwrap(), a.as_slice());
}
