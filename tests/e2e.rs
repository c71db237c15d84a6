//! End-to-end through real ZeroMQ sockets on loopback: many concurrent
//! sessions with correct numbers, and every kind of bad input answered with
//! its typed error while other sessions carry on.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use lanes_adaptor::wire::{self, Reply, Request, SessionId, SessionState};
use lanes_adaptor::{
    Client, ClientError, ClientOptions, ErrorCode, GraphBuilder, NodeId, Outlet, SessionSpec,
    Tensor, TensorType, VarValues,
};
use util::*;

fn x_for(seed: u64) -> Tensor {
    Tensor::from_f32([BATCH, IN], values(seed, BATCH * IN)).unwrap()
}

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> ErrorCode {
    match r {
        Err(e) => e
            .code()
            .unwrap_or_else(|| panic!("not a service error: {e}")),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

#[test]
fn thirty_two_concurrent_sessions_get_correct_results() {
    const SESSIONS: usize = 32;
    const ITERS: u64 = 5;
    let service = start_with(|c| c.workers = 4);
    let endpoint = service.endpoint().to_string();
    let barrier = Arc::new(Barrier::new(SESSIONS));
    let threads: Vec<_> = (0..SESSIONS as u64)
        .map(|s| {
            let ep = endpoint.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut client = Client::connect(&ep).unwrap();
                let mut session = client
                    .open_session(
                        SessionSpec::inference(format!("job-{s}")).with_expected_iterations(ITERS),
                    )
                    .unwrap();
                let (graph, vars) = linear_relu(1000 * s);
                let w = vars["w"].f32s().unwrap().to_vec();
                let b = vars["b"].f32s().unwrap().to_vec();
                session.load(&graph, vars).unwrap();
                barrier.wait();
                for i in 0..ITERS {
                    let x = x_for(s * 100 + i);
                    let want = linear_relu_ref(x.f32s().unwrap(), &w, &b);
                    let out = session.run(vec![("x", x)], &["y"]).unwrap();
                    assert_eq!(out.len(), 1);
                    assert_eq!(out[0].shape().dims(), &[BATCH, OUT]);
                    assert_close(out[0].f32s().unwrap(), &want);
                }
                // Variables are per session: read ours back, then replace them.
                let read = session.read_variables(&["w"]).unwrap();
                assert_eq!(read["w"].f32s().unwrap(), &w[..]);
                let w2: Vec<f32> = w.iter().map(|v| v * -2.0).collect();
                let mut new = VarValues::new();
                new.insert("w".into(), Tensor::from_f32([IN, OUT], w2.clone()).unwrap());
                session.write_variables(new).unwrap();
                let x = x_for(7);
                let want = linear_relu_ref(x.f32s().unwrap(), &w2, &b);
                let out = session.run(vec![("x", x)], &["y"]).unwrap();
                assert_close(out[0].f32s().unwrap(), &want);
                session.close().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut c = Client::connect(&endpoint).unwrap();
    assert!(
        c.status().unwrap().sessions.is_empty(),
        "all sessions closed"
    );
}

/// A well-behaved job that keeps running while bad input arrives; returns
/// how many iterations it ran, each checked.
fn good_job(endpoint: String, stop: Arc<std::sync::atomic::AtomicBool>) -> u64 {
    let mut client = Client::connect(&endpoint).unwrap();
    let mut session = client.open_session(SessionSpec::inference("good")).unwrap();
    let (graph, vars) = linear_relu(42);
    let w = vars["w"].f32s().unwrap().to_vec();
    let b = vars["b"].f32s().unwrap().to_vec();
    session.load(&graph, vars).unwrap();
    let mut n = 0;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) || n < 3 {
        let x = x_for(n);
        let want = linear_relu_ref(x.f32s().unwrap(), &w, &b);
        let out = session.run(vec![("x", x)], &["y"]).unwrap();
        assert_close(out[0].f32s().unwrap(), &want);
        n += 1;
    }
    session.close().unwrap();
    n
}

#[test]
fn bad_input_gets_typed_errors_while_others_carry_on() {
    let service = start_with(|c| {
        c.limits.max_frame_bytes = 1 << 20;
        c.limits.max_tensor_bytes = 1 << 20;
    });
    let ep = service.endpoint().to_string();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let good = {
        let (ep, stop) = (ep.clone(), Arc::clone(&stop));
        std::thread::spawn(move || good_job(ep, stop))
    };

    let raw = RawPeer::connect(&ep);
    // Garbage bytes.
    let r = raw.call(vec![b"\x00\xffGET / HTTP/1.1\r\n\r\n".to_vec()]);
    assert_eq!(error_code(&r.message), ErrorCode::Malformed);
    let r = raw.call(vec![vec![0xAB; 3]]);
    assert_eq!(error_code(&r.message), ErrorCode::Malformed);

    // A valid session for this raw peer.
    let r = raw.call(
        wire::encode_request(1, &Request::OpenSession(SessionSpec::inference("raw"))).unwrap(),
    );
    let Reply::SessionOpened { session } = r.message else {
        panic!("{:?}", r.message)
    };
    let (graph, vars) = linear_relu(5);
    let load = Request::LoadGraph {
        session,
        graph,
        variables: vars
            .into_iter()
            .map(|(n, t)| wire::NamedTensor::new(n, t))
            .collect(),
    };
    // Truncated header (cut in the middle of the graph): request id still echoed.
    let mut frames = wire::encode_request(2, &load).unwrap();
    let n = frames[0].len();
    frames[0].truncate(n - 5);
    let r = raw.call(frames);
    assert_eq!(r.request_id, 2);
    assert_eq!(error_code(&r.message), ErrorCode::Truncated);
    // Missing tensor frame.
    let mut frames = wire::encode_request(3, &load).unwrap();
    frames.pop();
    let r = raw.call(frames);
    assert_eq!(
        (r.request_id, error_code(&r.message)),
        (3, ErrorCode::Truncated)
    );
    // Tensor frame shorter than its type.
    let mut frames = wire::encode_request(4, &load).unwrap();
    frames[1].truncate(4);
    assert_eq!(error_code(&raw.call(frames).message), ErrorCode::Truncated);
    // Wrong protocol version.
    let mut frames = wire::encode_request(5, &load).unwrap();
    frames[0][4..8].copy_from_slice(&(wire::PROTOCOL_VERSION + 1).to_le_bytes());
    let r = raw.call(frames);
    assert_eq!(
        (r.request_id, error_code(&r.message)),
        (5, ErrorCode::VersionMismatch)
    );
    // Oversized frame (1.5 MiB against a 1 MiB limit).
    let run = Request::Run {
        session,
        feeds: vec![wire::NamedTensor::new("x", Tensor::full([384 * 1024], 1.0))],
        fetches: vec!["y".into()],
    };
    let r = raw.call(wire::encode_request(6, &run).unwrap());
    assert_eq!(
        (r.request_id, error_code(&r.message)),
        (6, ErrorCode::FrameTooLarge)
    );
    // The real load still works after all that.
    let r = raw.call(wire::encode_request(7, &load).unwrap());
    assert!(
        matches!(
            r.message,
            Reply::GraphLoaded {
                nodes: 6,
                variables: 2,
                ..
            }
        ),
        "{:?}",
        r.message
    );

    // Typed errors through the client.
    let mut client = Client::connect(&ep).unwrap();
    // Unknown session, and a session of another connection.
    assert_eq!(
        code(client.run_in(SessionId(999_999), vec![("x", x_for(1))], &["y"])),
        ErrorCode::UnknownSession
    );
    assert_eq!(
        code(client.run_in(session, vec![("x", x_for(1))], &["y"])),
        ErrorCode::UnknownSession
    );
    let mut s = client.open_session(SessionSpec::inference("bad")).unwrap();
    // Run before load.
    assert_eq!(
        code(s.run(vec![("x", x_for(1))], &["y"])),
        ErrorCode::NoGraph
    );
    // Invalid graph: a dangling input.
    let (mut graph, vars) = linear_relu(9);
    graph.nodes[3].inputs[0] = Outlet::new(NodeId(77), 0);
    assert_eq!(code(s.load(&graph, vars)), ErrorCode::InvalidGraph);
    // Invalid graph: declared type that inference contradicts.
    let (mut graph, vars) = linear_relu(9);
    graph.nodes[5].outputs = vec![TensorType::f32([9, 9])];
    assert_eq!(code(s.load(&graph, vars)), ErrorCode::InvalidGraph);
    // Missing variable value.
    let (graph, mut vars) = linear_relu(9);
    vars.remove("b");
    assert_eq!(code(s.load(&graph, vars)), ErrorCode::BadVariable);
    let (graph, vars) = linear_relu(9);
    s.load(&graph, vars.clone()).unwrap();
    assert_eq!(code(s.load(&graph, vars)), ErrorCode::GraphAlreadyLoaded);
    // Wrong feed shape, wrong dtype, unknown feed, missing feed, unknown fetch.
    let bad = Tensor::from_f32([BATCH, IN + 1], vec![0.0; BATCH * (IN + 1)]).unwrap();
    assert_eq!(code(s.run(vec![("x", bad)], &["y"])), ErrorCode::BadFeed);
    let ints = Tensor::from_i64([BATCH, IN], vec![0; BATCH * IN]).unwrap();
    assert_eq!(code(s.run(vec![("x", ints)], &["y"])), ErrorCode::BadFeed);
    assert_eq!(
        code(s.run(vec![("x", x_for(1)), ("z", x_for(2))], &["y"])),
        ErrorCode::BadFeed
    );
    assert_eq!(
        code(s.run(Vec::<(String, Tensor)>::new(), &["y"])),
        ErrorCode::BadFeed
    );
    assert_eq!(
        code(s.run(vec![("x", x_for(1))], &["nope"])),
        ErrorCode::UnknownFetch
    );
    // Bad variable writes leave the session usable.
    let mut wrong = VarValues::new();
    wrong.insert("w".into(), Tensor::full([2, 2], 1.0));
    assert_eq!(code(s.write_variables(wrong)), ErrorCode::BadVariable);
    assert_eq!(code(s.read_variables(&["missing"])), ErrorCode::BadVariable);
    drop(s);
    // Empty job name.
    assert_eq!(
        code(
            client
                .open_session(SessionSpec::inference(""))
                .map(|s| s.id())
        ),
        ErrorCode::BadRequest
    );

    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let iterations = good.join().expect("the good job never failed");
    assert!(iterations >= 3);
}

#[test]
fn silent_sessions_are_reclaimed() {
    let service = start_with(|c| c.idle_timeout = Duration::from_millis(300));
    let ep = service.endpoint().to_string();
    let opts = ClientOptions {
        timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    };
    let mut quiet = Client::connect_with(&ep, opts.clone()).unwrap();
    let sid = {
        let mut s = quiet.open_session(SessionSpec::training("quiet")).unwrap();
        let (graph, vars) = linear_relu(3);
        s.load(&graph, vars).unwrap();
        let id = s.id();
        std::mem::forget(s); // no close: the client just goes silent
        id
    };
    let mut watcher = Client::connect_with(&ep, opts).unwrap();
    let st = watcher.status().unwrap();
    assert_eq!(st.sessions.len(), 1);
    assert_eq!(st.sessions[0].spec.name, "quiet");
    // The worker replies to the load just before it marks the session
    // done, so the status may still say Running for a moment.
    let ready_by = Instant::now() + Duration::from_millis(250);
    let mut state = st.sessions[0].state;
    while state == SessionState::Running && Instant::now() < ready_by {
        std::thread::sleep(Duration::from_millis(5));
        let st = watcher.status().unwrap();
        state = st.sessions.first().expect("not reclaimed yet").state;
    }
    assert_eq!(state, SessionState::Ready);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !watcher.status().unwrap().sessions.is_empty() {
        assert!(Instant::now() < deadline, "session not reclaimed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        code(quiet.run_in(sid, vec![("x", x_for(0))], &["y"])),
        ErrorCode::UnknownSession
    );
}

#[test]
fn status_reports_sessions_and_close_forgets_them() {
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let mut a = c
        .open_session(SessionSpec::inference("alpha").with_priority(3))
        .unwrap();
    let (graph, vars) = linear_relu(1);
    a.load(&graph, vars).unwrap();
    for i in 0..3 {
        a.run(vec![("x", x_for(i))], &["y"]).unwrap();
    }
    let aid = a.id();
    std::mem::forget(a);
    let mut c2 = Client::connect(service.endpoint()).unwrap();
    let st = c2.status().unwrap();
    assert_eq!(st.version, wire::PROTOCOL_VERSION);
    // Under LANES_TEST_DEVICE=cuda the service reports the GPU, not the CPU.
    let want_gpu = std::env::var("LANES_TEST_DEVICE").as_deref() == Ok("cuda");
    assert_eq!(st.device != "cpu", want_gpu, "device {}", st.device);
    let s = st.sessions.iter().find(|s| s.session == aid).unwrap();
    assert_eq!(
        (s.spec.name.as_str(), s.spec.priority, s.iterations),
        ("alpha", 3, 3)
    );
    assert_eq!(s.state, SessionState::Ready);
    c.close_in(aid).unwrap();
    assert!(c2.status().unwrap().sessions.is_empty());
    assert_eq!(code(c.close_in(aid)), ErrorCode::UnknownSession);
}

#[test]
fn a_graph_with_constants_and_two_fetches() {
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let mut s = c.open_session(SessionSpec::inference("two")).unwrap();
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 2]));
    let k = g.constant(Tensor::from_f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap());
    let y = g.mul(x, k);
    g.set_name(y, "y");
    let z = g.sum(y, &[0, 1], false);
    g.set_name(z, "z");
    let (graph, vars) = g.finish().unwrap();
    s.load(&graph, vars).unwrap();
    let out = s
        .run(
            vec![(
                "x",
                Tensor::from_f32([2, 2], vec![1.0, -1.0, 0.5, 2.0]).unwrap(),
            )],
            &["y", "z"],
        )
        .unwrap();
    assert_eq!(out[0].f32s().unwrap(), &[1.0, -2.0, 1.5, 8.0]);
    assert_eq!(out[1].f32s().unwrap(), &[8.5]);
}

#[test]
fn shutdown_is_clean_with_clients_connected() {
    let service = start();
    let ep = service.endpoint().to_string();
    let opts = ClientOptions {
        timeout: Duration::from_millis(500),
        ..ClientOptions::default()
    };
    let mut c = Client::connect_with(&ep, opts).unwrap();
    let s = c.open_session(SessionSpec::inference("left-open")).unwrap();
    let sid = s.id();
    std::mem::forget(s);
    let t = Instant::now();
    service.shutdown().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    // The client noticed its connection close: it fails at once, not at
    // its timeout.
    let t = Instant::now();
    let r = c.close_in(sid);
    assert!(matches!(r, Err(ClientError::ServiceGone { .. })), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn cli_status_and_device_errors() {
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let s = c
        .open_session(SessionSpec::training("cli-visible"))
        .unwrap();
    let out = std::process::Command::new(util::lanes_bin())
        .args(["status", "--endpoint", service.endpoint()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("cli-visible") && stdout.contains("training"),
        "{stdout}"
    );
    drop(s);
    if lanes::exec::cuda::probe().is_err() {
        let out = std::process::Command::new(util::lanes_bin())
            .args([
                "serve",
                "--device",
                "cuda",
                "--endpoint",
                "tcp://127.0.0.1:*",
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(stderr.contains("GPU"), "{stderr}");
    }
}

/// Runs submitted ahead (the next one's feeds travel while the current one
/// runs) give each iteration's own result, waited for in order or not; a
/// failing one fails only its own wait.
#[test]
fn runs_submitted_ahead_answer_in_order() {
    let service = start_with(|_| {});
    let mut client = Client::connect(service.endpoint()).unwrap();
    let mut session = client
        .open_session(SessionSpec::inference("ahead"))
        .unwrap();
    let (graph, vars) = linear_relu(7);
    let w = vars["w"].f32s().unwrap().to_vec();
    let b = vars["b"].f32s().unwrap().to_vec();
    session.load(&graph, vars).unwrap();
    let want = |seed: u64| linear_relu_ref(x_for(seed).f32s().unwrap(), &w, &b);
    // Two in flight at a time, waited for in order.
    let mut pending = session.submit_run(vec![("x", x_for(0))], &["y"]).unwrap();
    for i in 1..6u64 {
        let next = session.submit_run(vec![("x", x_for(i))], &["y"]).unwrap();
        let out = session.wait_run(pending).unwrap();
        assert_close(out[0].f32s().unwrap(), &want(i - 1));
        pending = next;
    }
    let out = session.wait_run(pending).unwrap();
    assert_close(out[0].f32s().unwrap(), &want(5));
    // Three in flight, the middle one bad, waited for last first.
    let a = session.submit_run(vec![("x", x_for(10))], &["y"]).unwrap();
    let bad = session
        .submit_run(vec![("x", x_for(11))], &["nope"])
        .unwrap();
    let c = session.submit_run(vec![("x", x_for(12))], &["y"]).unwrap();
    let out_c = session.wait_run(c).unwrap();
    assert_close(out_c[0].f32s().unwrap(), &want(12));
    assert_eq!(code(session.wait_run(bad)), ErrorCode::UnknownFetch);
    let out_a = session.wait_run(a).unwrap();
    assert_close(out_a[0].f32s().unwrap(), &want(10));
}
