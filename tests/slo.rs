//! `slo_ms` through a real service: a session that states a latency
//! objective has its Runs counted against it in `status` (and `lanes
//! status`); one without keeps no count; an objective outside (0, one
//! hour] or not finite is refused with `BadRequest`. No timing asserts: a
//! generous objective (a minute) holds every Run of a small graph, and a
//! microsecond holds none (a Run crosses two threads and does real work).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use lanes_adaptor::wire::{SloAttainment, MAX_SLO_MS};
use lanes_adaptor::{
    Client, ClientError, ErrorCode, Graph, GraphBuilder, SessionSpec, Tensor, TensorType, VarValues,
};
use util::*;

const N: usize = 128;

/// `relu(x @ w)` four times on 128 × 128: real work, quick on the CPU.
fn chain() -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([N, N]));
    let w = g.variable(
        "w",
        Tensor::from_f32([N, N], values(3, N * N).iter().map(|v| v / 8.0).collect()).unwrap(),
    );
    let mut h = x;
    for _ in 0..4 {
        let m = g.matmul(h, w);
        h = g.relu(m);
    }
    g.set_name(h, "y");
    g.finish().unwrap()
}

fn x() -> Tensor {
    Tensor::from_f32([N, N], values(4, N * N)).unwrap()
}

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> ErrorCode {
    match r {
        Err(e) => e
            .code()
            .unwrap_or_else(|| panic!("not a service error: {e}")),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

/// Opens `spec`, loads the chain and runs it `runs` times (and once with a
/// fetch that does not exist, an error reply that is no completion);
/// returns the session's id, left open.
fn run_some(c: &mut Client, spec: SessionSpec, runs: usize) -> lanes_adaptor::wire::SessionId {
    let mut s = c.open_session(spec).unwrap();
    let (graph, vars) = chain();
    s.load(&graph, vars).unwrap();
    for _ in 0..runs {
        s.run(vec![("x", x())], &["y"]).unwrap();
    }
    let bad = s.run(vec![("x", x())], &["nope"]);
    assert!(matches!(bad, Err(ClientError::Service { .. })), "{bad:?}");
    let id = s.id();
    std::mem::forget(s);
    id
}

#[test]
fn status_counts_runs_within_each_sessions_objective() {
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let generous = run_some(
        &mut c,
        SessionSpec::inference("generous")
            .with_slo_ms(60_000.0)
            .unwrap(),
        5,
    );
    let tight = run_some(
        &mut c,
        SessionSpec::inference("tight").with_slo_ms(0.001).unwrap(),
        4,
    );
    let none = run_some(&mut c, SessionSpec::inference("no-objective"), 2);
    let st = c.status().unwrap();
    let slo =
        |id| -> Option<SloAttainment> { st.sessions.iter().find(|s| s.session == id).unwrap().slo };
    let g = slo(generous).expect("an objective is reported");
    assert_eq!((g.slo_ms, g.runs, g.within), (60_000.0, 5, 5), "{g:?}");
    assert_eq!(g.attainment(), Some(1.0));
    let p99 = g.recent_p99_ms.expect("a p99 after five Runs");
    assert!(p99 > 0.0 && p99.is_finite(), "{g:?}");
    let t = slo(tight).expect("an objective is reported");
    assert_eq!((t.slo_ms, t.runs, t.within), (0.001, 4, 0), "{t:?}");
    assert_eq!(t.attainment(), Some(0.0));
    assert!(slo(none).is_none());

    // `lanes status` shows the same counts, as text and as JSON.
    let status = |json: bool| {
        let mut cmd = std::process::Command::new(lanes_bin());
        cmd.args(["status", "--endpoint", service.endpoint()]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let text = status(false);
    assert!(text.contains("60000ms: 5/5 100.0%"), "{text}");
    assert!(text.contains("0.001ms: 0/4 0.0%"), "{text}");
    let v: serde_json::Value = serde_json::from_str(status(true).trim()).unwrap();
    let sessions = v["sessions"].as_array().unwrap();
    let of = |name: &str| {
        sessions
            .iter()
            .find(|s| s["spec"]["name"] == name)
            .unwrap()
            .clone()
    };
    assert_eq!(of("generous")["slo"]["attainment"].as_f64(), Some(1.0));
    assert_eq!(of("generous")["spec"]["slo_ms"].as_f64(), Some(60_000.0));
    assert_eq!(of("tight")["slo"]["within"].as_u64(), Some(0));
    assert!(of("no-objective")["slo"].is_null());
}

#[test]
fn objectives_outside_the_bounds_are_refused() {
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    for bad in [0.0, -5.0, f64::NAN, f64::INFINITY, MAX_SLO_MS + 1.0] {
        // Built by hand: the builder would refuse it before the wire.
        let mut spec = SessionSpec::inference("bad");
        spec.slo_ms = Some(bad);
        let r = c.open_session(spec).map(|s| s.id());
        assert_eq!(code(r), ErrorCode::BadRequest, "{bad}");
    }
    assert!(c.status().unwrap().sessions.is_empty());
    let ok = c
        .open_session(
            SessionSpec::inference("edge")
                .with_slo_ms(MAX_SLO_MS)
                .unwrap(),
        )
        .map(|s| s.id());
    assert!(ok.is_ok(), "{ok:?}");
}
