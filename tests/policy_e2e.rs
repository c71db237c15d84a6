//! `lanes serve --policy` through real sockets: with one worker, Run
//! requests that queue behind a long one are served in the order the policy
//! decides, not in arrival order.
//!
//! Determinism: every session lives on one DEALER connection, so replies
//! arrive in the order the single worker finished them. A first, long Run
//! (a chain of matrix products) holds the worker while the other Runs are
//! queued; the test checks through `Status` that they all were queued while
//! it still ran before it reads the order.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lanes::server::PolicyChoice;
use lanes_adaptor::wire::{
    self, NamedTensor, Reply, Request, SessionId, SessionSpec, SessionState,
};
use lanes_adaptor::{Client, Graph, GraphBuilder, Tensor, TensorType, VarValues};
use util::*;

/// `y = x @ w @ w … (k products)`, x and w `[n, n]`; w is scaled so values
/// stay bounded.
fn chain(n: usize, k: usize) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([n, n]));
    let w = g.variable(
        "w",
        Tensor::from_f32(
            [n, n],
            values(7, n * n).iter().map(|v| v / n as f32).collect(),
        )
        .unwrap(),
    );
    let mut y = x;
    for _ in 0..k {
        y = g.matmul(y, w);
    }
    g.set_name(y, "y");
    g.finish().unwrap()
}

fn x(n: usize) -> Tensor {
    Tensor::from_f32([n, n], values(3, n * n)).unwrap()
}

/// One DEALER carrying every session, with request ids it hands out.
struct Conn {
    peer: RawPeer,
    next: u64,
    /// Which session each Run's request id belongs to.
    runs: HashMap<u64, SessionId>,
}

impl Conn {
    fn new(endpoint: &str) -> Self {
        Conn {
            peer: RawPeer::connect(endpoint),
            next: 1,
            runs: HashMap::new(),
        }
    }

    fn send(&mut self, req: &Request) -> u64 {
        let id = self.next;
        self.next += 1;
        self.peer.send(wire::encode_request(id, req).unwrap());
        id
    }

    fn call(&mut self, req: &Request) -> Reply {
        let id = self.send(req);
        let env = self.peer.recv();
        assert_eq!(env.request_id, id);
        match env.message {
            Reply::Error(e) => panic!("{} failed: {e:?}", req.name()),
            r => r,
        }
    }

    /// Opens a session and loads `graph` into it.
    fn job(&mut self, spec: SessionSpec, graph: &(Graph, VarValues)) -> SessionId {
        let Reply::SessionOpened { session } = self.call(&Request::OpenSession(spec)) else {
            panic!("no session")
        };
        let variables = graph
            .1
            .iter()
            .map(|(k, v)| NamedTensor::new(k.clone(), v.clone()))
            .collect();
        let reply = self.call(&Request::LoadGraph {
            session,
            graph: graph.0.clone(),
            variables,
        });
        assert!(matches!(reply, Reply::GraphLoaded { .. }), "{reply:?}");
        session
    }

    /// Queues one Run of `session` without waiting for it.
    fn run(&mut self, session: SessionId, n: usize) {
        let id = self.send(&Request::Run {
            session,
            feeds: vec![NamedTensor::new("x", x(n))],
            fetches: vec!["y".into()],
        });
        self.runs.insert(id, session);
    }

    /// Waits for `count` replies; the sessions in the order they finished.
    fn finished(&mut self, count: usize) -> Vec<SessionId> {
        (0..count)
            .map(|_| {
                let env = self.peer.recv();
                assert!(
                    matches!(env.message, Reply::RunDone { .. }),
                    "{:?}",
                    env.message
                );
                self.runs[&env.request_id]
            })
            .collect()
    }
}

const N: usize = 64;

/// Starts a one-worker service under `policy`, opens a blocker session
/// whose Runs take a while, and returns it with its connection.
fn setup(policy: PolicyChoice) -> (lanes::server::ServerHandle, Conn, SessionId, Client) {
    let service = start_with(|c| {
        c.workers = 1;
        c.policy = policy;
    });
    let mut conn = Conn::new(service.endpoint());
    let status = Client::connect(service.endpoint()).unwrap();
    // Calibrate: the blocker's Run should take about 0.4 s on this machine.
    let probe = conn.job(SessionSpec::inference("probe"), &chain(256, 10));
    let mut best = Duration::MAX;
    for _ in 0..2 {
        let t0 = Instant::now();
        conn.run(probe, 256);
        conn.finished(1);
        best = best.min(t0.elapsed());
    }
    let k = (0.4 / best.as_secs_f64() * 10.0).ceil().clamp(10.0, 4000.0) as usize;
    let blocker = conn.job(
        SessionSpec::inference("blocker").with_priority(9),
        &chain(256, k),
    );
    conn.call(&Request::CloseSession { session: probe });
    (service, conn, blocker, status)
}

/// Asserts that `queued` Runs wait while the blocker still runs. (Status
/// comes on another connection and may overtake the Runs: the blocker may
/// look idle until its Run has arrived.)
fn assert_all_queued_behind(status: &mut Client, blocker: SessionId, queued: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen_active = false;
    loop {
        let s = status.status().unwrap();
        let b = s.sessions.iter().find(|x| x.session == blocker).unwrap();
        let active = matches!(b.state, SessionState::Running | SessionState::Queued);
        assert!(
            active || !seen_active,
            "the blocker finished before the other Runs were queued; make it longer"
        );
        seen_active |= active;
        if b.state == SessionState::Running && s.queued == queued {
            return;
        }
        assert!(Instant::now() < deadline, "only {} queued", s.queued);
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn priority_serves_waiting_inference_before_earlier_training() {
    let (_service, mut conn, blocker, mut status) = setup(PolicyChoice::Priority);
    assert_eq!(status.status().unwrap().policy, "priority");
    let g = chain(N, 2);
    let train = conn.job(
        SessionSpec::training("train")
            .with_priority(5)
            .with_expected_iterations(10),
        &g,
    );
    let infer = conn.job(
        SessionSpec::inference("infer").with_expected_iterations(3),
        &g,
    );
    conn.run(blocker, 256);
    // Training Runs are submitted before the inference ones.
    for _ in 0..3 {
        conn.run(train, N);
    }
    for _ in 0..3 {
        conn.run(infer, N);
    }
    assert_all_queued_behind(&mut status, blocker, 6);
    let order = conn.finished(7);
    assert_eq!(
        order,
        vec![blocker, infer, infer, infer, train, train, train],
        "no training iteration may run while an inference request waits"
    );
    // Queueing delay and service time are measured per session.
    let s = status.status().unwrap();
    let of = |id| s.sessions.iter().find(|x| x.session == id).unwrap().clone();
    let (t, i) = (of(train), of(infer));
    assert!(t.service_mean_us > 0 && i.service_mean_us > 0);
    assert!(
        t.queueing_mean_us > i.queueing_mean_us,
        "training waited for the blocker and the inference Runs: {} vs {} µs",
        t.queueing_mean_us,
        i.queueing_mean_us
    );
}

#[test]
fn fifo_serves_jobs_in_arrival_order_for_contrast() {
    let (_service, mut conn, blocker, mut status) = setup(PolicyChoice::Fifo);
    assert_eq!(status.status().unwrap().policy, "fifo");
    let g = chain(N, 2);
    let train = conn.job(
        SessionSpec::training("train").with_expected_iterations(10),
        &g,
    );
    let infer = conn.job(
        SessionSpec::inference("infer").with_expected_iterations(3),
        &g,
    );
    conn.run(blocker, 256);
    // Interleaved submissions: job-level FIFO still finishes `train` first.
    for _ in 0..3 {
        conn.run(infer, N);
        conn.run(train, N);
    }
    assert_all_queued_behind(&mut status, blocker, 6);
    let order = conn.finished(7);
    assert_eq!(
        order,
        vec![blocker, train, train, train, infer, infer, infer]
    );
}

#[test]
fn srtf_finishes_the_job_with_less_work_left_first() {
    let (_service, mut conn, blocker, mut status) = setup(PolicyChoice::Srtf);
    let g = chain(N, 2);
    let long = conn.job(
        SessionSpec::training("long").with_expected_iterations(40),
        &g,
    );
    let short = conn.job(
        SessionSpec::training("short").with_expected_iterations(4),
        &g,
    );
    // One measured iteration each, so SRTF knows their iteration times.
    for s in [long, short] {
        conn.run(s, N);
        assert_eq!(conn.finished(1), vec![s]);
    }
    conn.run(blocker, 256);
    // The long job's Runs are queued first.
    for _ in 0..3 {
        conn.run(long, N);
    }
    for _ in 0..3 {
        conn.run(short, N);
    }
    assert_all_queued_behind(&mut status, blocker, 6);
    let order = conn.finished(7);
    assert_eq!(order, vec![blocker, short, short, short, long, long, long]);
}

#[test]
fn closing_a_session_removes_its_job_and_its_queued_runs() {
    let (_service, mut conn, blocker, mut status) = setup(PolicyChoice::Fair);
    let g = chain(N, 2);
    let a = conn.job(SessionSpec::training("a").with_expected_iterations(10), &g);
    let b = conn.job(SessionSpec::training("b").with_expected_iterations(10), &g);
    conn.run(blocker, 256);
    for _ in 0..2 {
        conn.run(a, N);
        conn.run(b, N);
    }
    assert_all_queued_behind(&mut status, blocker, 4);
    // Close `a` while its Runs wait: they are dropped, `b`'s still run.
    let closed = conn.send(&Request::CloseSession { session: a });
    let mut seen = Vec::new();
    let mut closed_ok = false;
    while seen.len() < 3 || !closed_ok {
        let env = conn.peer.recv();
        match env.message {
            Reply::SessionClosed { session } => {
                assert_eq!((env.request_id, session), (closed, a));
                closed_ok = true;
            }
            Reply::RunDone { .. } => seen.push(conn.runs[&env.request_id]),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, vec![blocker, b, b]);
    let s = status.status().unwrap();
    assert_eq!(s.queued, 0);
    assert!(s.sessions.iter().all(|x| x.session != a));
}

#[test]
fn a_trace_replays_against_the_service_and_tracks_the_simulator() {
    use lanes::sim::{calibrate, replay_remote, service_policy, simulate, RemoteConfig, SimConfig};
    use lanes::sim::{Summary, TraceJob};
    use lanes_policies::JobKind;
    let service = start_with(|c| {
        c.workers = 1;
        c.policy = PolicyChoice::Srtf;
    });
    let job = |id, submit_ms, kind, iterations, iter_ms| TraceJob {
        id,
        submit: Duration::from_millis(submit_ms),
        kind,
        iterations,
        iteration: Duration::from_millis(iter_ms),
        persistent_bytes: 0,
        ephemeral_bytes: 0,
        priority: 0,
    };
    // Trace time; at scale 0.25 about 0.3 s of wall time.
    let trace = vec![
        job(1, 0, JobKind::Training, 30, 20),
        job(2, 100, JobKind::Training, 6, 20),
        job(3, 200, JobKind::Inference, 5, 4),
    ];
    let cfg = RemoteConfig {
        time_scale: 0.25,
        max_depth: 48,
        ..RemoteConfig::new(service.endpoint())
    };
    let policy = service_policy(service.endpoint(), Duration::from_secs(5)).unwrap();
    assert_eq!(policy, "srtf");
    let cal = calibrate(&cfg).unwrap();
    assert!(cal.training.points.windows(2).all(|w| w[0].0 < w[1].0));
    let r = replay_remote(&trace, policy, &cfg, &cal).unwrap();
    assert_eq!(r.run.outcomes.len(), 3);
    assert_eq!(r.as_run.len(), 3);
    for (o, a) in r.run.outcomes.iter().zip(&r.as_run) {
        assert!(
            a.iteration > Duration::ZERO,
            "job {} has a measured time",
            a.id
        );
        assert!(o.finish >= o.submit + o.service, "job {}: {o:?}", o.id);
    }
    let sim = simulate(
        &r.as_run,
        lanes_policies::by_name(policy).unwrap().as_mut(),
        SimConfig {
            memory: 1 << 40,
            lanes: 1,
        },
    )
    .unwrap();
    let (live, sim) = (Summary::of(&r.run), Summary::of(&sim));
    eprintln!(
        "live {} s, simulated as run {} s",
        live.avg_jct_s, sim.avg_jct_s
    );
    // Loose (0.8 s of trace time is 0.2 s of wall time for a thread that
    // was not scheduled): the machine running tests is shared;
    // docs/scheduling.md has the measured comparison.
    assert!(
        live.avg_jct_s >= 0.8 * sim.avg_jct_s && live.avg_jct_s <= 2.0 * sim.avg_jct_s + 0.8,
        "live {} vs simulated {}",
        live.avg_jct_s,
        sim.avg_jct_s
    );
}

/// `lanes replay --zoo`: every trace job runs a real zoo model (here
/// ResNet-18 for CIFAR at batch 1 on the CPU backend), no calibration; the
/// as-run trace carries the iteration times the service measured.
#[test]
fn a_trace_replays_as_real_zoo_models() {
    use lanes::sim::TraceJob;
    use lanes::sim::{replay_remote, service_policy, Calibration, CostCurve, RemoteConfig};
    use lanes_policies::JobKind;
    let metrics = std::sync::Arc::new(lanes::server::metrics::Metrics::new());
    let http =
        lanes::server::metrics::serve_http("127.0.0.1:0", std::sync::Arc::clone(&metrics)).unwrap();
    let service = start_with(|c| {
        c.workers = 1;
        c.policy = PolicyChoice::Fifo;
        c.metrics = Some(std::sync::Arc::clone(&metrics));
    });
    let job = |id, submit_ms, kind, iterations| TraceJob {
        id,
        submit: Duration::from_millis(submit_ms),
        kind,
        iterations,
        iteration: Duration::from_millis(10),
        persistent_bytes: 0,
        ephemeral_bytes: 0,
        priority: 0,
    };
    let trace = vec![
        job(1, 0, JobKind::Training, 2),
        job(2, 5, JobKind::Inference, 3),
    ];
    let cfg = RemoteConfig {
        time_scale: 1.0,
        batch: 1,
        zoo: Some("resnet18_cifar".into()),
        ..RemoteConfig::new(service.endpoint())
    };
    let policy = service_policy(service.endpoint(), Duration::from_secs(5)).unwrap();
    let none = Calibration {
        training: CostCurve { points: vec![] },
        inference: CostCurve { points: vec![] },
    };
    let r = replay_remote(&trace, policy, &cfg, &none).unwrap();
    assert_eq!(r.run.outcomes.len(), 2);
    assert_eq!(r.depths, vec![0, 0]);
    for (o, a) in r.run.outcomes.iter().zip(&r.as_run) {
        assert!(
            a.iteration > Duration::ZERO,
            "job {} has a measured time",
            a.id
        );
        assert!(o.finish >= o.submit + o.service, "job {}: {o:?}", o.id);
    }
    // The as-run trace carries the P the service planned for the model.
    assert!(
        r.as_run.iter().all(|a| a.persistent_bytes > 0),
        "{:?}",
        r.as_run
    );
    // Each job's timeline is in order: arrival, admission, first reply, end.
    assert_eq!(r.timelines.len(), 2);
    for t in &r.timelines {
        assert!(
            t.arrival_s <= t.admitted_s + 1e-9
                && t.admitted_s <= t.first_reply_s
                && t.first_reply_s <= t.end_s
                && t.iteration_ms > 0.0,
            "{t:?}"
        );
    }
    // Start-up on the idle service (the opening and load before a Run)
    // and each kind's iteration alone.
    let idle = lanes::sim::measure_idle(&cfg, 1, 1).unwrap();
    assert!(
        idle.startup.training > Duration::ZERO && idle.startup.inference > Duration::ZERO,
        "{idle:?}"
    );
    assert!(
        idle.solo.training > Duration::ZERO && idle.solo.inference > Duration::ZERO,
        "{idle:?}"
    );
    // Without the metrics endpoint the load is timed by its round trip.
    assert!(!idle.load_from_metrics);
    assert_eq!(idle.load, idle.load_round_trip);
    // With it, by the service: within the round trip, and the load and
    // what follows its reply are parts of the start-up.
    let timed = RemoteConfig {
        metrics: Some(http.addr().to_string()),
        ..cfg.clone()
    };
    let idle = lanes::sim::measure_idle(&timed, 1, 1).unwrap();
    assert!(idle.load_from_metrics);
    for kind in [JobKind::Training, JobKind::Inference] {
        let (load, trip) = (idle.load.of(kind), idle.load_round_trip.of(kind));
        assert!(load > Duration::ZERO && load <= trip, "{kind:?}: {idle:?}");
        assert!(
            load + idle.after_load.of(kind) <= idle.startup.of(kind) + Duration::from_micros(1),
            "{kind:?}: {idle:?}"
        );
    }
    // A metrics address where nothing answers is a typed error.
    let nowhere = RemoteConfig {
        metrics: Some("127.0.0.1:1".into()),
        ..cfg.clone()
    };
    let err = lanes::sim::measure_idle(&nowhere, 1, 1).unwrap_err();
    assert!(err.to_string().contains("metrics at 127.0.0.1:1"), "{err}");
    // An unknown model is a typed error before anything is sent.
    let bad = RemoteConfig {
        zoo: Some("alexnet".into()),
        ..cfg.clone()
    };
    let err = replay_remote(&trace, policy, &bad, &none).unwrap_err();
    assert!(err.to_string().contains("alexnet"), "{err}");
}
