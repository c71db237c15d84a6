//! Clean stops: `lanes serve` on SIGTERM (or SIGINT) accepts no new work,
//! gives the requests in flight the grace period (`--shutdown-grace`) to
//! finish, answers those left `ShuttingDown`, removes its `ipc://` socket
//! file and exits 0; clients raise at once on that reply, and fail fast
//! when nothing listens or the service goes away.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::Read;
use std::process::Command;
use std::time::{Duration, Instant};

use lanes_adaptor::{
    Client, ClientError, ClientOptions, ErrorCode, Graph, SessionSpec, Tensor, VarValues,
};
use util::serve::Serve;
use util::values;

const N: usize = 1024;

/// `y = relu(x @ w)` chained 24 times on 1024 × 1024: a Run that takes a
/// while on the CPU (about a second).
fn heavy() -> (Graph, VarValues) {
    util::heavy_of(N)
}

fn x() -> Tensor {
    Tensor::from_f32([N, N], values(5, N * N)).unwrap()
}

fn signal(serve: &Serve, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &serve.child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// Waits for the child to exit (at most `limit`): its status and log.
fn exit_of(mut serve: Serve, limit: Duration) -> (std::process::ExitStatus, String) {
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = serve.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < limit,
            "still running {limit:?} after the signal"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut log = String::new();
    if let Some(mut e) = serve.child.stderr.take() {
        let _ = e.read_to_string(&mut log);
    }
    (status, log)
}

/// A service on a fresh `ipc://` path with `grace`, a client with a heavy
/// graph loaded, and how long one of its Runs takes.
fn service_with_a_heavy_job(grace: &str) -> (Serve, std::path::PathBuf, Client, Duration) {
    let dir = std::env::temp_dir().join(format!("lanes-shutdown-{}-{grace}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lanes.sock");
    let endpoint = format!("ipc://{}", path.display());
    let serve = Serve::start(&[
        "--memory",
        "none",
        "--endpoint",
        &endpoint,
        "--shutdown-grace",
        grace,
    ]);
    assert!(path.exists(), "the socket file");
    let mut c = Client::connect(&serve.endpoint).unwrap();
    let (graph, vars) = heavy();
    let took = {
        let mut s = c.open_session(SessionSpec::training("heavy")).unwrap();
        s.load(&graph, vars).unwrap();
        let t0 = Instant::now();
        s.run(vec![("x", x())], &["y"]).unwrap();
        let took = t0.elapsed();
        std::mem::forget(s); // the session stays open for the test
        took
    };
    (serve, path, c, took)
}

/// The one session of `c` (opened by `service_with_a_heavy_job`).
fn session_of(c: &mut Client) -> lanes_adaptor::SessionId {
    let status = c.status().unwrap();
    assert_eq!(status.sessions.len(), 1);
    status.sessions[0].session
}

#[test]
fn sigterm_lets_runs_in_flight_finish_within_the_grace_period() {
    let (serve, path, mut c, took) = service_with_a_heavy_job("60");
    let id = session_of(&mut c);
    // At least 2 s of Runs in flight, then SIGTERM.
    let n = (Duration::from_secs(2).as_secs_f64() / took.as_secs_f64()).ceil() as usize;
    let n = n.clamp(2, 12);
    let pending: Vec<_> = (0..n)
        .map(|_| c.submit_run_in(id, vec![("x", x())], &["y"]).unwrap())
        .collect();
    std::thread::sleep(took / 4);
    signal(&serve, "-TERM");
    // A new request meanwhile is refused at once.
    std::thread::sleep(Duration::from_millis(200));
    let refused = Client::connect(&serve.endpoint).and_then(|mut o| o.status().map(|_| ()));
    match refused {
        Err(ClientError::Service { code, .. }) => assert_eq!(code, ErrorCode::ShuttingDown),
        r => panic!("a request while stopping: {r:?}"),
    }
    // Every Run in flight finishes: the grace is long.
    for (i, p) in pending.into_iter().enumerate() {
        match c.wait_run(p) {
            Ok(out) => assert_eq!(out.len(), 1),
            Err(e) => panic!("Run {i} of {n} (each {took:?}): {e:?}"),
        }
    }
    let (status, log) = exit_of(serve, Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("SIGINT or SIGTERM: stopping"), "{log}");
    assert!(log.contains("lanes service stopped"), "{log}");
    assert!(!path.exists(), "the ipc socket file was left behind");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn runs_left_at_the_end_of_the_grace_period_are_answered_shutting_down() {
    let (serve, path, mut c, took) = service_with_a_heavy_job("0.5");
    let id = session_of(&mut c);
    // More Runs than the grace period holds (at least 3 s of them).
    let n =
        ((Duration::from_secs(3).as_secs_f64() / took.as_secs_f64()).ceil() as usize).clamp(4, 12);
    let pending: Vec<_> = (0..n)
        .map(|_| c.submit_run_in(id, vec![("x", x())], &["y"]).unwrap())
        .collect();
    std::thread::sleep(took / 4);
    signal(&serve, "-INT");
    let t0 = Instant::now();
    let mut done = 0;
    let mut stopped = 0;
    for p in pending {
        match c.wait_run(p) {
            Ok(_) => done += 1,
            Err(ClientError::Service { code, .. }) => {
                assert_eq!(code, ErrorCode::ShuttingDown);
                stopped += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    // Answered within the grace period (generously), not the request
    // timeout.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert!(
        stopped >= 1,
        "{done} done, {stopped} answered ShuttingDown (a Run took {took:?})"
    );
    let (status, log) = exit_of(serve, Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{log}");
    assert!(!path.exists(), "the ipc socket file was left behind");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// Nothing listens: the client gives up after its connect timeout (5 s by
/// default), not its request timeout.
#[test]
fn a_client_fails_fast_where_nothing_listens() {
    // A port that was free a moment ago.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t0 = Instant::now();
    let r = Client::connect_with(
        &format!("tcp://127.0.0.1:{port}"),
        ClientOptions {
            timeout: Duration::from_secs(300),
            ..ClientOptions::default()
        },
    );
    let took = t0.elapsed();
    assert!(
        matches!(r, Err(ClientError::NoService { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    assert!(
        took >= Duration::from_secs(4),
        "{took:?}: the connect timeout is 5 s"
    );
}

/// The service is killed mid-Run: the client's wait ends within seconds
/// (its connection is gone), not at the request timeout (300 s here).
#[test]
fn a_service_killed_mid_run_is_noticed_within_seconds() {
    let (mut serve, path, first, took) = service_with_a_heavy_job("10");
    drop(first);
    let mut c = Client::connect_with(
        &serve.endpoint,
        ClientOptions {
            timeout: Duration::from_secs(300),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    let mut s = c.open_session(SessionSpec::training("victim")).unwrap();
    let (graph, vars) = heavy();
    s.load(&graph, vars).unwrap();
    let pending: Vec<_> = (0..4)
        .map(|_| s.submit_run(vec![("x", x())], &["y"]).unwrap())
        .collect();
    std::thread::sleep(took / 4);
    serve.child.kill().unwrap();
    let t0 = Instant::now();
    let mut gone = 0;
    for p in pending {
        match s.wait_run(p) {
            Ok(_) => {}
            Err(ClientError::ServiceGone { .. }) => gone += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(gone >= 1, "no wait noticed the service gone");
    // Every wait ended at once, not at the request timeout.
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    // So does any later request of this client.
    let t1 = Instant::now();
    match s.run(vec![("x", x())], &["y"]) {
        Err(ClientError::ServiceGone { .. }) => {}
        r => panic!("{:?}", r.map(|_| ())),
    }
    assert!(t1.elapsed() < Duration::from_secs(30), "{:?}", t1.elapsed());
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// A client dropped with Runs still unsent, whose service dies while its
/// socket lingers, leaves the other clients of the process working.
/// (libzmq reports the broken connection to the socket's monitor from the
/// context's one I/O thread, with a blocking send; once the monitor's
/// reader was closed that send never returned and every client of the
/// process stalled: new ones timed out connecting.)
#[test]
fn a_client_dropped_as_its_service_dies_leaves_the_others_working() {
    let mut serve = Serve::start(&["--memory", "none"]);
    let mut c = Client::connect_with(
        &serve.endpoint,
        ClientOptions {
            shared_memory: false,
            ..ClientOptions::default()
        },
    )
    .unwrap();
    {
        let mut s = c.open_session(SessionSpec::training("doomed")).unwrap();
        let (graph, vars) = heavy();
        s.load(&graph, vars).unwrap();
        // The service reads nothing more: 32 MB of feeds stay in the socket.
        signal(&serve, "-STOP");
        for _ in 0..8 {
            s.submit_run(vec![("x", x())], &["y"]).unwrap();
        }
        std::mem::forget(s);
    }
    drop(c);
    serve.child.kill().unwrap();
    serve.child.wait().unwrap();
    // The broken connection is noticed while the dropped socket lingers.
    std::thread::sleep(Duration::from_millis(300));
    let other = util::start();
    let r = Client::connect(other.endpoint());
    assert!(r.is_ok(), "{:?}", r.map(|_| ()));
    other.shutdown().unwrap();
}
