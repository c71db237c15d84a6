//! What one peer may hold, each limit through real sockets against a
//! real service (in this process, or a `lanes serve` child where the
//! service's own memory is measured; docs/protocol.md, *Limits* and
//! *Worst-case memory*): a connection filling the table with empty
//! sessions is refused while a bystander is served (and loading a graph
//! frees its place: loaded sessions are not counted), a per-connection cap
//! a deployment sets holds, one peer's connections meet the per-peer
//! share, requests in flight per connection are bounded, fetches beyond a
//! job's admitted memory are refused, and the service's memory under a
//! hostile flood stays within the stated formula. Packing many models
//! from one client is `tests/packing.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::time::Duration;

use lanes_adaptor::wire::{self, NamedTensor, Reply, Request, SessionId};
use lanes_adaptor::{Client, ErrorCode, GraphBuilder, SessionSpec, Tensor, TensorType};
use util::serve::Serve;
use util::*;

/// One connection cannot fill the session table with empty sessions: past
/// `--max-unloaded-per-client` sessions with no graph it is refused with
/// `Overloaded` (the message naming the flag), while another connection
/// opens a session and is served; loading a graph into one of its empty
/// sessions, or closing one, frees a slot, and sessions with graphs are
/// not counted at all (they are bounded by their memory and requests).
#[test]
fn a_session_hog_is_refused_while_a_bystander_is_served() {
    let service = start_with(|c| {
        c.max_sessions = 100;
        c.max_unloaded_per_client = 5;
    });
    let ep = service.endpoint().to_string();
    let open =
        |c: &mut Client, name: &str| c.request(&Request::OpenSession(SessionSpec::inference(name)));
    let mut hog = Client::connect(&ep).unwrap();
    let mut ids = Vec::new();
    for i in 0..5 {
        match open(&mut hog, &format!("hog{i}")).unwrap() {
            Reply::SessionOpened { session } => ids.push(session),
            other => panic!("{other:?}"),
        }
    }
    for _ in 0..20 {
        let refused = open(&mut hog, "one too many").unwrap_err();
        assert_eq!(refused.code(), Some(ErrorCode::Overloaded));
        assert!(
            refused.to_string().contains("--max-unloaded-per-client"),
            "{refused}"
        );
    }
    let mut bystander = Client::connect(&ep).unwrap();
    let mut s = bystander
        .open_session(SessionSpec::inference("bystander"))
        .unwrap();
    let (graph, vars) = linear_relu(2);
    s.load(&graph, vars).unwrap();
    let out = s.run(vec![("x", x_for(3))], &["y"]).unwrap();
    assert_eq!(out[0].ty(), TensorType::f32([BATCH, OUT]));
    drop(s);
    hog.close_in(ids[0]).unwrap();
    let reopened = match open(&mut hog, "after a close").unwrap() {
        Reply::SessionOpened { session } => session,
        other => panic!("{other:?}"),
    };
    assert!(open(&mut hog, "full again").is_err());
    // A graph loaded into an empty session frees its slot: a deployment
    // that loads every session it opens never meets the limit.
    let (graph, vars) = linear_relu(2);
    hog.load_in(reopened, &graph, vars).unwrap();
    assert!(matches!(
        open(&mut hog, "after a load").unwrap(),
        Reply::SessionOpened { .. }
    ));
}

/// A deployment may still cap one connection's sessions, loaded or not
/// (`--max-sessions-per-client`); the refusal names the flag.
#[test]
fn a_per_client_session_cap_set_by_the_deployment_holds() {
    let service = start_with(|c| c.max_sessions_per_client = Some(3));
    let ep = service.endpoint().to_string();
    let mut c = Client::connect(&ep).unwrap();
    for i in 0..3 {
        let session = match c
            .request(&Request::OpenSession(SessionSpec::inference(format!(
                "m{i}"
            ))))
            .unwrap()
        {
            Reply::SessionOpened { session } => session,
            other => panic!("{other:?}"),
        };
        let (graph, vars) = linear_relu(2);
        c.load_in(session, &graph, vars).unwrap();
    }
    let refused = c
        .request(&Request::OpenSession(SessionSpec::inference("m3")))
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::Overloaded));
    assert!(
        refused.to_string().contains("--max-sessions-per-client 3"),
        "{refused}"
    );
}

/// One process opening many connections cannot take every slot either:
/// its sessions over all its connections count against
/// `--max-sessions-per-peer` (on loopback every client is one peer), and
/// the refusal says which limit it met.
#[test]
fn many_connections_of_one_peer_meet_the_per_peer_limit() {
    let service = start_with(|c| {
        c.max_sessions = 100;
        c.max_sessions_per_client = Some(2);
        c.max_sessions_per_peer = 5;
    });
    let ep = service.endpoint().to_string();
    let open =
        |c: &mut Client, name: &str| c.request(&Request::OpenSession(SessionSpec::inference(name)));
    let mut conns: Vec<Client> = (0..4).map(|_| Client::connect(&ep).unwrap()).collect();
    let mut opened = Vec::new();
    let mut refusals = Vec::new();
    for (i, c) in conns.iter_mut().enumerate() {
        for j in 0..2 {
            match open(c, &format!("p{i}-{j}")) {
                Ok(Reply::SessionOpened { session }) => opened.push((i, session)),
                Ok(other) => panic!("{other:?}"),
                Err(e) => refusals.push(e),
            }
        }
    }
    assert_eq!(opened.len(), 5, "five of eight, over three connections");
    assert_eq!(refusals.len(), 3);
    for e in &refusals {
        assert_eq!(e.code(), Some(ErrorCode::Overloaded));
        assert!(e.to_string().contains("--max-sessions-per-peer"), "{e}");
    }
    // Closing one frees a slot for any of its connections.
    let (i, s) = opened[0];
    conns[i].close_in(s).unwrap();
    assert!(matches!(
        open(&mut conns[3], "after a close").unwrap(),
        Reply::SessionOpened { .. }
    ));
}

/// A Run's fetched outputs must fit in the memory its job was admitted
/// with (P + T): one output fetched many times (each a copy in the reply)
/// is refused with `FetchTooLarge` before the iteration runs, and the same
/// output fetched a few times is served. Under `--memory` and without.
#[test]
fn fetches_beyond_the_admitted_memory_are_refused() {
    for memory in [Some(64 << 20), None] {
        let service = start_with(|c| c.memory_bytes = memory);
        let peer = RawPeer::connect(service.endpoint());
        let open = Request::OpenSession(SessionSpec::inference("fetcher"));
        let session = match peer.call(wire::encode_request(1, &open).unwrap()).message {
            Reply::SessionOpened { session } => session,
            other => panic!("{other:?}"),
        };
        // One 1 MiB output: P + T is a few MiB.
        let (graph, vars) = {
            let mut g = GraphBuilder::new();
            let x = g.placeholder("x", TensorType::f32([1 << 18]));
            let y = g.relu(x);
            g.set_name(y, "y");
            g.finish().unwrap()
        };
        let load = Request::LoadGraph {
            session,
            graph,
            variables: vars
                .into_iter()
                .map(|(n, t)| NamedTensor::new(n, t))
                .collect(),
        };
        let (p, t) = match peer.call(wire::encode_request(2, &load).unwrap()).message {
            Reply::GraphLoaded {
                persistent_bytes,
                ephemeral_bytes,
                ..
            } => (persistent_bytes, ephemeral_bytes),
            other => panic!("{other:?}"),
        };
        let fits = ((p + t) >> 20).max(1) as usize;
        let run = |fetches: usize| Request::Run {
            session,
            feeds: vec![NamedTensor::new("x", Tensor::full([1 << 18], 2.0))],
            fetches: vec!["y".into(); fetches],
        };
        match peer
            .call(wire::encode_request(3, &run(fits)).unwrap())
            .message
        {
            Reply::RunDone { outputs } => assert_eq!(outputs.len(), fits),
            other => panic!("{memory:?}: {other:?}"),
        }
        // 1,000 copies of 1 MiB: 1,000 MiB of reply for a job of a few MiB.
        let r = peer.call(wire::encode_request(4, &run(1000)).unwrap());
        assert_eq!(
            (r.request_id, error_code(&r.message)),
            (4, ErrorCode::FetchTooLarge),
            "{memory:?}"
        );
        let r = peer.call(wire::encode_request(5, &run(1)).unwrap());
        assert!(
            matches!(r.message, Reply::RunDone { .. }),
            "{:?}",
            r.message
        );
    }
}

/// One connection may have at most `max_requests_per_client` requests
/// queued or running: a client sending many long Runs at once has the rest
/// refused with `Overloaded`, and a bystander is served meanwhile.
#[test]
fn requests_in_flight_per_client_are_limited() {
    let service = start_with(|c| c.max_requests_per_client = 3);
    let ep = service.endpoint().to_string();
    let hog = RawPeer::connect(&ep);
    let session = hog.open_and_load(SessionSpec::training("hog"), heavy());
    let x = Tensor::from_f32([512, 512], values(4, 512 * 512)).unwrap();
    let run = Request::Run {
        session,
        feeds: vec![NamedTensor::new("x", x)],
        fetches: vec!["y".into()],
    };
    const SENT: u64 = 10;
    for i in 0..SENT {
        hog.send(wire::encode_request(100 + i, &run).unwrap());
    }
    bystander_is_served(&ep, 2, 3);
    let (mut done, mut refused) = (0, 0);
    for _ in 0..SENT {
        match hog.recv().message {
            Reply::RunDone { .. } => done += 1,
            Reply::Error(e) if e.code == ErrorCode::Overloaded => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(done >= 3, "{done} done, {refused} refused");
    assert!(refused >= 1, "{done} done, {refused} refused");
}

/// Memory of `lanes serve` under a hostile load stays within the bound
/// docs/protocol.md states as a formula of its limits (with slack for the
/// program itself): four connections each flood Runs (more than they may
/// have in flight, never reading a reply), Status requests, frames above
/// the frame limit and garbage, while half their jobs wait for memory.
#[test]
fn memory_under_a_hostile_load_stays_within_the_stated_bound() {
    const F: u64 = MIB; // --max-frame
    const N: u64 = 4; // --max-frames: a header and three 1 MiB feeds
    const H: u64 = 256 << 10; // --max-header
    const M: u64 = 8 * MIB; // --memory
    const S: u64 = 4; // --max-sessions
    const R: u64 = 1; // --max-requests-per-client
    const W: u64 = 1; // --workers
    const C: u64 = 4; // connections
    const POOL: u64 = 256 * MIB; // the feed pool (ServerConfig default)
    const L: u64 = 256 * MIB; // the load cache (--load-cache default)
                              // On the CPU whatever LANES_TEST_DEVICE says: the bound is on the
                              // service's host memory, and 8 MiB is below one GPU reservation chunk.
    let serve = Serve::start(&[
        "--device",
        "cpu",
        "--memory",
        "8MiB",
        "--max-frame",
        "1MiB",
        "--max-frames",
        "4",
        "--max-header",
        "256KiB",
        "--max-tensor",
        "1MiB",
        "--max-sessions",
        "4",
        "--max-sessions-per-client",
        "1",
        "--max-requests-per-client",
        "1",
    ]);
    std::thread::sleep(Duration::from_millis(200));
    let base = serve.memory("VmRSS");
    let elems = (F / 4) as usize;
    let peers: Vec<(RawPeer, SessionId)> = (0..C)
        .map(|_| {
            let peer = RawPeer::connect(&serve.endpoint);
            let s = peer.open_and_load(SessionSpec::inference("flood"), many_inputs(3, elems));
            (peer, s)
        })
        .collect();
    for (peer, session) in &peers {
        let run = Request::Run {
            session: *session,
            feeds: (0..3)
                .map(|i| NamedTensor::new(format!("x{i}"), Tensor::full([elems], 1.0)))
                .collect(),
            fetches: vec!["y".into()],
        };
        let frames = wire::encode_request(7, &run).unwrap();
        for _ in 0..60 {
            peer.send(frames.clone());
            peer.send(wire::encode_request(8, &Request::Status).unwrap());
            peer.send(vec![b"garbage".to_vec()]);
        }
        let oversized = Request::Run {
            session: *session,
            feeds: vec![NamedTensor::new("x0", Tensor::full([elems * 3 / 2], 1.0))],
            fetches: vec!["y".into()],
        };
        for _ in 0..20 {
            peer.send(wire::encode_request(9, &oversized).unwrap());
        }
    }
    // Until the service has taken everything in and gone quiet.
    let mut last = 0;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(100));
        let now = serve.memory("VmRSS");
        if now == last {
            break;
        }
        last = now;
    }
    let peak = serve.memory("VmHWM");
    // docs/protocol.md, "Worst-case memory of the service".
    let message = N * 2 * F;
    let decoded = N * F + 4 * H;
    let reply = M.max(S * 1024).max(4096);
    let per_connection = (8 + 1) * message + R * decoded + (R + 16) * reply;
    let bound = M + POOL + L + S * (M + MIB) + W * 2 * M + 2 * message + C * per_connection;
    let slack = 64 * MIB;
    println!(
        "peak {} MiB, started at {} MiB, bound {} MiB + slack",
        peak / MIB,
        base / MIB,
        (base + bound) / MIB
    );
    assert!(
        peak <= base + bound + slack,
        "peak {} MiB above the stated bound {} MiB",
        peak / MIB,
        (base + bound + slack) / MIB
    );
    let mut serve = serve;
    assert!(serve.is_running());
    let status = serve.status();
    println!("{status}");
}
