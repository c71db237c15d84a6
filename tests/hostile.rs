//! Hostile and careless clients, each case through real sockets against a
//! real service (in this process, or a `lanes serve` child where the
//! service's own memory is measured):
//! - shared memory: a forged offer is refused, and a peer of another uid
//!   cannot have the service attach this process's memory (when the test
//!   runs as root; skipped with a message otherwise); many feeds aliasing
//!   one range are refused before any copy;
//! - a Run of frames for placeholders the graph lacks is refused without
//!   copying them;
//! - the 100,000-node chain and the 99,999-consumer fan-out load while a
//!   bystander's Runs are served;
//! - a client that vanishes or is SIGKILLed with Runs in flight is
//!   reclaimed within 5 s;
//! - error texts are bounded, bad-message warnings throttled, and extra
//!   frames answer Malformed.
//!
//! What one peer may hold (sessions, requests, fetches, memory) is
//! `tests/peer_limits.rs`.
//!
//! Peers that must be separate processes (the SIGKILLed client, the peer of
//! another uid) are this test binary run again with `LANES_HOSTILE_ROLE`
//! set: see [`hostile_peer_child`].

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lanes_adaptor::wire::shm::{OwnedSegment, SegmentOffer, TOKEN_BYTES};
use lanes_adaptor::wire::{self, NamedTensor, Reply, Request, SessionId};
use lanes_adaptor::{
    Client, ErrorCode, Graph, GraphBuilder, SessionSpec, Tensor, TensorType, VarValues,
};
use util::serve::Serve;
use util::*;

/// Set in a child run of this binary: which hostile peer to play.
const ROLE: &str = "LANES_HOSTILE_ROLE";
/// The service's endpoint, for a child.
const ENDPOINT: &str = "LANES_HOSTILE_ENDPOINT";
/// `pid:fd:session` of the victim's attached segment, for a child.
const VICTIM: &str = "LANES_HOSTILE_VICTIM";

/// Rows of [`wide`]'s feed: 65 536 × 8 f32 = 2 MiB, above the client's
/// shared-memory threshold.
const ROWS: usize = 1 << 16;

/// `y = relu(x @ w + b)` with a 2 MiB x.
fn wide(seed: u64) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([ROWS, 8]));
    let w = g.variable("w", Tensor::from_f32([8, 2], values(seed, 16)).unwrap());
    let h = g.matmul(x, w);
    let y = g.relu(h);
    g.set_name(y, "y");
    g.finish().unwrap()
}

/// The desk a service's Hello names.
fn desk_of(peer: &RawPeer) -> String {
    let hello = Request::Hello {
        client: "hostile".into(),
    };
    match peer.call(wire::encode_request(90, &hello).unwrap()).message {
        Reply::Hello { desk, .. } => desk.expect("the service attaches shared memory"),
        other => panic!("{other:?}"),
    }
}

fn share(peer: &RawPeer, id: u64, session: SessionId, offer: SegmentOffer) -> Reply {
    let req = Request::ShareMemory { session, offer };
    peer.call(wire::encode_request(id, &req).unwrap()).message
}

/// What a hostile peer tries against a victim whose segment (`victim_token`)
/// is attached to session `victim_session` of another connection: forged
/// offers (a made-up token, the victim's token, a descriptor never handed
/// over), Runs naming a segment its session does not have, and the victim's
/// session itself. Each must be refused with a typed error.
fn attack_the_victim(endpoint: &str, victim_session: SessionId, victim_token: [u8; TOKEN_BYTES]) {
    let peer = RawPeer::connect(endpoint);
    let desk = desk_of(&peer);
    let mine = peer.open_and_load(SessionSpec::inference("hostile"), wide(7));
    let mut seg = OwnedSegment::create(1, 4 << 20).unwrap();
    // Forged: made-up token, the victim's token, and its own segment's
    // token before the descriptor was handed over.
    for (i, token) in [[0x5a; TOKEN_BYTES], victim_token, seg.offer().token]
        .into_iter()
        .enumerate()
    {
        let offer = SegmentOffer {
            token,
            ..seg.offer()
        };
        let r = share(&peer, 10 + i as u64, mine, offer);
        assert_eq!(error_code(&r), ErrorCode::SharedMemory, "offer {i}: {r:?}");
    }
    // Offered into the victim's session: not this connection's.
    seg.hand_over(&desk).unwrap();
    let r = share(&peer, 20, victim_session, seg.offer());
    assert_eq!(error_code(&r), ErrorCode::UnknownSession, "{r:?}");
    // A Run of its own session naming segment 1, which its session does
    // not have (the victim's session does).
    let run = |session| Request::Run {
        session,
        feeds: vec![NamedTensor::new(
            "x",
            Tensor::from_f32([ROWS, 8], values(1, ROWS * 8)).unwrap(),
        )],
        fetches: vec!["y".into()],
    };
    let frames = wire::encode_request_into(21, &run(mine), Some(&mut seg)).unwrap();
    let r = peer.call(frames).message;
    assert_eq!(error_code(&r), ErrorCode::SharedMemory, "{r:?}");
    // The victim's session, with the victim's segment id.
    let frames = wire::encode_request_into(22, &run(victim_session), Some(&mut seg)).unwrap();
    let r = peer.call(frames).message;
    assert!(
        matches!(
            error_code(&r),
            ErrorCode::SharedMemory | ErrorCode::UnknownSession
        ),
        "{r:?}"
    );
}

/// A victim: a session with a segment attached, its descriptor's number in
/// this process, the session and the (spent) token.
struct Victim {
    peer: RawPeer,
    session: SessionId,
    seg: OwnedSegment,
    fd: u32,
}

fn victim(endpoint: &str) -> Victim {
    let before = memfds();
    let seg = OwnedSegment::create(1, 4 << 20).unwrap();
    let fd = *memfds()
        .iter()
        .find(|fd| !before.contains(fd))
        .expect("the segment's memfd is among this process's descriptors");
    let peer = RawPeer::connect(endpoint);
    let desk = desk_of(&peer);
    let session = peer.open_and_load(SessionSpec::inference("victim"), wide(3));
    seg.hand_over(&desk).unwrap();
    assert!(matches!(
        share(&peer, 30, session, seg.offer()),
        Reply::MemoryShared { segment: 1, .. }
    ));
    Victim {
        peer,
        session,
        seg,
        fd,
    }
}

/// This process's descriptors that are memfds.
fn memfds() -> Vec<u32> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let target = std::fs::read_link(e.path()).ok()?;
            target
                .to_string_lossy()
                .starts_with("/memfd:")
                .then(|| e.file_name().to_str()?.parse().ok())?
        })
        .collect()
}

/// The victim still runs on its segment after the attacks.
fn victim_still_served(v: &mut Victim) {
    let run = Request::Run {
        session: v.session,
        feeds: vec![NamedTensor::new(
            "x",
            Tensor::from_f32([ROWS, 8], values(5, ROWS * 8)).unwrap(),
        )],
        fetches: vec!["y".into()],
    };
    let frames = wire::encode_request_into(40, &run, Some(&mut v.seg)).unwrap();
    let shared = v.peer.call(frames).message;
    let socket = v.peer.call(wire::encode_request(41, &run).unwrap()).message;
    assert!(matches!(shared, Reply::RunDone { .. }), "{shared:?}");
    assert_eq!(shared, socket);
}

/// Forged shared-memory offers are refused, from a peer of this uid.
#[test]
fn a_forged_offer_is_refused() {
    let service = start();
    let mut v = victim(service.endpoint());
    attack_the_victim(service.endpoint(), v.session, v.seg.offer().token);
    victim_still_served(&mut v);
}

/// This test binary, copied where another uid can run it.
fn copy_of_this_binary() -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("lanes-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = dir.join("hostile");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    exe
}

/// A peer of another uid cannot read this process's memfd itself, nor get
/// the service to attach it (the service opens no file a peer names): when
/// the test runs as root, the hostile peer is this binary run as `nobody`.
#[test]
fn another_uid_cannot_get_this_process_memory_attached() {
    use std::os::unix::process::CommandExt;
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"));
    if !root {
        println!(
            "skipped: changing uid needs root (the same-uid case is a_forged_offer_is_refused)"
        );
        return;
    }
    let service = start();
    let mut v = victim(service.endpoint());
    let exe = copy_of_this_binary();
    let out = Command::new(&exe)
        .args(["hostile_peer_child", "--exact", "--nocapture"])
        .env(ROLE, "other_uid")
        .env(ENDPOINT, service.endpoint())
        .env(
            VICTIM,
            format!(
                "{}:{}:{}:{}",
                std::process::id(),
                v.fd,
                v.session.0,
                wire::auth::hex(&v.seg.offer().token)
            ),
        )
        .uid(65534)
        .gid(65534)
        .current_dir(exe.parent().unwrap())
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(exe.parent().unwrap());
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the hostile peer's run:\n{log}");
    assert!(
        log.contains("hostile peer (uid 65534): all refused"),
        "{log}"
    );
    victim_still_served(&mut v);
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// Not a test of its own: the hostile peers that must be other processes.
/// Does nothing unless `LANES_HOSTILE_ROLE` is set.
#[test]
fn hostile_peer_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let endpoint = std::env::var(ENDPOINT).unwrap();
    match role.as_str() {
        // A training client with Runs in flight, waiting to be killed.
        "busy_client" => {
            let mut client = Client::connect(&endpoint).unwrap();
            let mut s = client
                .open_session(SessionSpec::training("to be killed"))
                .unwrap();
            let (graph, vars) = heavy();
            s.load(&graph, vars).unwrap();
            let x = Tensor::from_f32([512, 512], values(4, 512 * 512)).unwrap();
            let _pending: Vec<_> = (0..4)
                .map(|_| s.submit_run(vec![("x", x.clone())], &["y"]).unwrap())
                .collect();
            println!("ready");
            std::thread::sleep(Duration::from_secs(120));
        }
        // A peer of another uid against a victim's attached segment.
        "other_uid" => {
            let victim = std::env::var(VICTIM).unwrap();
            let parts: Vec<&str> = victim.split(':').collect();
            let (pid, fd) = (parts[0], parts[1]);
            let session = SessionId(parts[2].parse().unwrap());
            let token: [u8; TOKEN_BYTES] = unhex(parts[3]).try_into().unwrap();
            // It cannot open the victim's memfd itself …
            let own = std::fs::File::open(format!("/proc/{pid}/fd/{fd}"));
            assert!(own.is_err(), "uid 65534 opened another uid's memfd itself");
            // … nor have the service attach it or read it.
            attack_the_victim(&endpoint, session, token);
            println!("hostile peer (uid 65534): all refused");
        }
        other => panic!("unknown role {other}"),
    }
}

/// A client killed with SIGKILL while four long Runs are in flight has its
/// session reclaimed within 5 s (idle timeout 300 s), its queued Runs
/// dropped, and a newcomer is served.
#[test]
fn a_sigkilled_client_is_reclaimed_within_five_seconds() {
    let service = start_with(|c| c.idle_timeout = Duration::from_secs(300));
    let ep = service.endpoint().to_string();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["hostile_peer_child", "--exact", "--nocapture"])
        .env(ROLE, "busy_client")
        .env(ENDPOINT, &ep)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.find(|l| l.as_ref().is_ok_and(|l| l.trim() == "ready"));
    assert!(ready.is_some(), "the busy client got ready");
    let mut watcher = Client::connect(&ep).unwrap();
    let before = watcher.status().unwrap();
    assert_eq!(before.sessions.len(), 1);
    let queued_before = before.queued;
    child.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    child.wait().unwrap();
    loop {
        let status = watcher.status().unwrap();
        if status.sessions.is_empty() {
            assert_eq!(status.queued, 0, "its queued Runs were dropped");
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "a SIGKILLed client's session ({queued_before} Runs queued) was not reclaimed within 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let reclaimed = killed.elapsed();
    let mut s = watcher
        .open_session(SessionSpec::inference("newcomer"))
        .unwrap();
    let (graph, vars) = linear_relu(1);
    s.load(&graph, vars).unwrap();
    s.run(vec![("x", x_for(1))], &["y"]).unwrap();
    println!("reclaimed {reclaimed:?} after SIGKILL");
}

/// A client that vanishes without closing its sessions (its connection
/// closes) has them reclaimed within seconds, with Runs in flight or idle,
/// long before the idle timeout.
#[test]
fn a_vanished_client_is_reclaimed_within_seconds() {
    let service = start_with(|c| c.idle_timeout = Duration::from_secs(300));
    let ep = service.endpoint().to_string();
    let mut watcher = Client::connect(&ep).unwrap();
    for in_flight in [0u64, 4] {
        let peer = RawPeer::connect(&ep);
        let session = peer.open_and_load(SessionSpec::training("doomed"), linear_relu(3));
        for i in 0..in_flight {
            let run = Request::Run {
                session,
                feeds: vec![NamedTensor::new("x", x_for(i))],
                fetches: vec!["y".into()],
            };
            peer.send(wire::encode_request(10 + i, &run).unwrap());
        }
        assert_eq!(watcher.status().unwrap().sessions.len(), 1);
        let gone = Instant::now();
        drop(peer);
        while !watcher.status().unwrap().sessions.is_empty() {
            assert!(
                gone.elapsed() < Duration::from_secs(5),
                "a vanished client's session ({in_flight} Runs in flight) was not reclaimed within 5 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A chain of `n` ReLUs after one placeholder, or (`fan`) `n` ReLUs of the
/// placeholder, `n + 1` nodes in all.
fn huge(n: usize, fan: bool) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4]));
    let mut h = x;
    for _ in 0..n {
        h = g.relu(if fan { x } else { h });
    }
    g.set_name(h, "y");
    g.finish().unwrap()
}

/// The 100,000-node chain and the 99,999-consumer fan-out load (at the
/// node limit), and while they load a bystander's Runs are served: loads
/// never take the last worker, so the bystander's iterations finish before
/// the loads do (ordering, not wall time).
#[test]
fn huge_graphs_load_while_a_bystander_is_served() {
    let service = start_with(|c| c.workers = 2);
    let ep = service.endpoint().to_string();
    let mut bystander = Client::connect(&ep).unwrap();
    let mut s = bystander
        .open_session(SessionSpec::inference("bystander"))
        .unwrap();
    let (graph, vars) = linear_relu(4);
    s.load(&graph, vars).unwrap();
    let loaders: Vec<(RawPeer, SessionId)> = [false, true]
        .into_iter()
        .map(|fan| {
            let peer = RawPeer::connect(&ep);
            let open =
                Request::OpenSession(SessionSpec::training(if fan { "fan-out" } else { "chain" }));
            let session = match peer.call(wire::encode_request(1, &open).unwrap()).message {
                Reply::SessionOpened { session } => session,
                other => panic!("{other:?}"),
            };
            (peer, session)
        })
        .collect();
    for ((peer, session), fan) in loaders.iter().zip([false, true]) {
        let (graph, _) = huge(99_999, fan);
        assert_eq!(graph.nodes.len(), 100_000);
        let load = Request::LoadGraph {
            session: *session,
            graph,
            variables: Vec::new(),
        };
        peer.send(wire::encode_request(2, &load).unwrap());
    }
    // The bystander's Runs, sent after both loads: each is answered while
    // a load is still under way.
    let mut served_during_loads = 0;
    let mut loaded = 0;
    let mut rounds = 0;
    while loaded < loaders.len() {
        rounds += 1;
        assert!(rounds < 100_000, "the loads never finished");
        s.run(vec![("x", x_for(rounds))], &["y"]).unwrap();
        for (peer, _) in &loaders {
            if let Some(frames) = peer.recv_raw(Duration::ZERO) {
                let reply = wire::decode_reply(&frames, &lanes_adaptor::Limits::default())
                    .unwrap()
                    .message;
                match reply {
                    Reply::GraphLoaded { nodes, .. } => {
                        assert_eq!(nodes, 100_000);
                        loaded += 1;
                    }
                    Reply::Ping => {}
                    other => panic!("{other:?}"),
                }
            }
        }
        if loaded < loaders.len() {
            served_during_loads += 1;
        }
    }
    println!("{served_during_loads} bystander Runs answered while the huge graphs loaded");
    assert!(
        served_during_loads >= 3,
        "the bystander was starved: {served_during_loads} Runs while loading"
    );
    // Both run.
    for (i, (peer, session)) in loaders.iter().enumerate() {
        let run = Request::Run {
            session: *session,
            feeds: vec![NamedTensor::new("x", Tensor::full([4], -1.0))],
            fetches: vec!["y".into()],
        };
        match peer.call(wire::encode_request(3, &run).unwrap()).message {
            Reply::RunDone { outputs } => {
                assert_eq!(outputs[0].f32s().unwrap(), &[0.0; 4], "graph {i}")
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Error replies carry at most `MAX_ERROR_TEXT` bytes of text, whatever the
/// request (here a graph declaring 200,000 outputs on one node).
#[test]
fn error_texts_are_bounded() {
    let service = start();
    let peer = RawPeer::connect(service.endpoint());
    let open = Request::OpenSession(SessionSpec::inference("verbose"));
    let session = match peer.call(wire::encode_request(1, &open).unwrap()).message {
        Reply::SessionOpened { session } => session,
        other => panic!("{other:?}"),
    };
    let (mut graph, _) = huge(3, false);
    let last = graph.nodes.len() - 1;
    graph.nodes[last].outputs = vec![TensorType::f32([1, 2, 3]); 200_000];
    let load = Request::LoadGraph {
        session,
        graph,
        variables: Vec::new(),
    };
    match peer.call(wire::encode_request(2, &load).unwrap()).message {
        Reply::Error(e) => {
            assert_eq!(e.code, ErrorCode::InvalidGraph);
            assert!(
                e.message.len() <= wire::MAX_ERROR_TEXT,
                "{}",
                e.message.len()
            );
        }
        other => panic!("{other:?}"),
    }
    // A name as long as the header allows, in a request that fails.
    let bad = Request::ReadVariables {
        session,
        names: vec!["v".repeat(1 << 20)],
    };
    match peer.call(wire::encode_request(3, &bad).unwrap()).message {
        Reply::Error(e) => assert!(e.message.len() <= wire::MAX_ERROR_TEXT),
        other => panic!("{other:?}"),
    }
}

/// Tensor frames beyond those the header announces answer Malformed.
#[test]
fn extra_frames_are_malformed() {
    let service = start();
    let peer = RawPeer::connect(service.endpoint());
    let session = peer.open_and_load(SessionSpec::inference("extra"), linear_relu(1));
    let run = Request::Run {
        session,
        feeds: vec![NamedTensor::new("x", x_for(1))],
        fetches: vec!["y".into()],
    };
    let mut frames = wire::encode_request(3, &run).unwrap();
    frames.push(vec![0; 48]);
    let r = peer.call(frames);
    assert_eq!(
        (r.request_id, error_code(&r.message)),
        (3, ErrorCode::Malformed)
    );
    // A header-only request with a frame attached, too.
    let mut frames = wire::encode_request(4, &Request::Status).unwrap();
    frames.push(vec![1, 2, 3]);
    assert_eq!(error_code(&peer.call(frames).message), ErrorCode::Malformed);
    // The session is still served.
    let r = peer.call(wire::encode_request(5, &run).unwrap());
    assert!(
        matches!(r.message, Reply::RunDone { .. }),
        "{:?}",
        r.message
    );
}

/// Eight feeds all naming the same 32 MiB range of a segment are refused
/// before any is copied: the service's peak resident memory grows by far
/// less than the 256 MiB the copies would cost. Through `lanes serve`
/// (its own process, so its memory is its own).
#[test]
fn aliased_shared_feeds_are_refused_before_any_copy() {
    const N: usize = 8;
    const ELEMS: usize = 8 << 20; // 32 MiB of f32
    let serve = Serve::start(&["--memory", "none"]);
    let peer = RawPeer::connect(&serve.endpoint);
    let desk = desk_of(&peer);
    let session = peer.open_and_load(SessionSpec::training("aliases"), many_inputs(N, ELEMS));
    let bytes = (N * ELEMS * 4) + (1 << 20);
    let mut seg = OwnedSegment::create(1, bytes).unwrap();
    seg.hand_over(&desk).unwrap();
    assert!(matches!(
        share(&peer, 3, session, seg.offer()),
        Reply::MemoryShared { .. }
    ));
    let run = Request::Run {
        session,
        feeds: (0..N)
            .map(|i| NamedTensor::new(format!("x{i}"), Tensor::full([ELEMS], i as f32)))
            .collect(),
        fetches: vec!["y".into()],
    };
    let mut frames = wire::encode_request_into(4, &run, Some(&mut seg)).unwrap();
    // The body ends with the feeds' offsets (u64 LE each), then the reply
    // slot and the doorbell (none: a zero byte each): point every offset
    // at the first feed's range.
    let header = &mut frames[0];
    assert!(header.ends_with(&[0, 0]), "no reply slot, no doorbell");
    let at = header.len() - 2 - 8 * N;
    let first: [u8; 8] = header[at..at + 8].try_into().unwrap();
    for i in 1..N {
        header[at + 8 * i..at + 8 * i + 8].copy_from_slice(&first);
    }
    let before = serve.memory("VmHWM");
    let r = peer.call(frames).message;
    assert_eq!(error_code(&r), ErrorCode::SharedMemory, "{r:?}");
    let grew = serve.memory("VmHWM").saturating_sub(before);
    assert!(
        grew < 64 * MIB,
        "refusing aliased feeds raised the service's peak memory by {} MiB",
        grew / MIB
    );
}

/// A Run whose frames are for placeholders the graph does not have is
/// refused before they are copied: the service's peak memory grows by
/// about the message (which ZeroMQ buffers), not twice it.
#[test]
fn frames_for_placeholders_the_graph_lacks_are_not_copied() {
    const ELEMS: usize = 12 << 20; // 48 MiB of f32
    let serve = Serve::start(&["--memory", "none"]);
    let peer = RawPeer::connect(&serve.endpoint);
    let session = peer.open_and_load(SessionSpec::training("strangers"), many_inputs(2, 4));
    let run = Request::Run {
        session,
        feeds: (0..4)
            .map(|i| NamedTensor::new(format!("nope{i}"), Tensor::full([ELEMS], 1.0)))
            .collect(),
        fetches: vec!["y".into()],
    };
    let frames = wire::encode_request(4, &run).unwrap();
    let message: u64 = frames.iter().map(|f| f.len() as u64).sum();
    let before = serve.memory("VmHWM");
    let r = peer.call(frames).message;
    assert_eq!(error_code(&r), ErrorCode::BadFeed, "{r:?}");
    let grew = serve.memory("VmHWM").saturating_sub(before);
    assert!(
        grew < message * 3 / 2,
        "a refused {} MiB Run raised the service's peak memory by {} MiB",
        message / MIB,
        grew / MIB
    );
}

/// A flood of garbage is answered message by message, and the service
/// logs at most about one warning a second about it, with counts.
#[test]
fn bad_message_warnings_are_throttled() {
    let serve = Serve::start(&["--memory", "none"]);
    let peer = RawPeer::connect(&serve.endpoint);
    let t0 = Instant::now();
    for i in 0..500u32 {
        let r = peer.call(vec![i.to_le_bytes().to_vec()]);
        assert_eq!(error_code(&r.message), ErrorCode::Malformed);
    }
    let secs = t0.elapsed().as_secs() + 2;
    let log = serve.stop();
    let warnings = log.lines().filter(|l| l.contains("bad message")).count() as u64;
    assert!(
        (1..=secs).contains(&warnings),
        "{warnings} warnings for 500 bad messages in {secs} s"
    );
    assert!(log.contains("suppressed"), "{log}");
}

/// A Run naming more fetches than its reply could carry frames (each a
/// look-up in the graph) is refused from its header with `TooManyFrames`.
#[test]
fn more_fetches_than_a_reply_can_carry_are_refused() {
    let service = start_with(|c| c.limits.max_frames = 64);
    let peer = RawPeer::connect(service.endpoint());
    let session = peer.open_and_load(SessionSpec::inference("fetcher"), huge(1000, false));
    let run = |n: usize| Request::Run {
        session,
        feeds: vec![NamedTensor::new("x", Tensor::full([4], 1.0))],
        fetches: vec!["y".into(); n],
    };
    let r = peer.call(wire::encode_request(3, &run(64)).unwrap());
    assert_eq!(
        (r.request_id, error_code(&r.message)),
        (3, ErrorCode::TooManyFrames)
    );
    // Fewer are served (as many as P + T allows: 16 bytes each).
    match peer
        .call(wire::encode_request(4, &run(20)).unwrap())
        .message
    {
        Reply::RunDone { outputs } => assert_eq!(outputs.len(), 20),
        other => panic!("{other:?}"),
    }
}

/// `y = relu(x @ w)` with a 2 MiB `w` (1024 × 512, every weight `wv`): its
/// LoadGraph is decoded off the socket thread.
fn large_load(session: SessionId, wv: f32, w_shape: [usize; 2]) -> Request {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 1024]));
    let w = g.variable("w", Tensor::full([1024, 512], 0.0));
    let h = g.matmul(x, w);
    let y = g.relu(h);
    g.set_name(y, "y");
    let (graph, _) = g.finish().unwrap();
    Request::LoadGraph {
        session,
        graph,
        variables: vec![NamedTensor::new("w", Tensor::full(w_shape, wv))],
    }
}

/// A client that pipelines a large LoadGraph (decoded by the service's
/// decoder thread) with the requests after it gets its replies in order,
/// each right: the Run after a load is not decoded and served before the
/// load (which would answer NoGraph), and the Run after a refused load is
/// refused as having no graph. A bystander is served meanwhile.
#[test]
fn requests_behind_a_large_one_keep_their_order() {
    let service = start();
    let ep = service.endpoint().to_string();
    let peer = RawPeer::connect(&ep);
    let open = |id, name: &str| match peer
        .call(
            wire::encode_request(id, &Request::OpenSession(SessionSpec::inference(name))).unwrap(),
        )
        .message
    {
        Reply::SessionOpened { session } => session,
        other => panic!("{other:?}"),
    };
    let good = open(1, "large-load");
    let bad = open(2, "large-bad-load");
    let run = |session| Request::Run {
        session,
        feeds: vec![NamedTensor::new("x", Tensor::full([2, 1024], 1.0))],
        fetches: vec!["y".into()],
    };
    let load = wire::encode_request(3, &large_load(good, 0.001, [1024, 512])).unwrap();
    assert!(load.iter().map(Vec::len).sum::<usize>() >= 2 << 20);
    // Pipelined: nothing waits for the load's reply.
    peer.send(load);
    peer.send(wire::encode_request(4, &run(good)).unwrap());
    peer.send(wire::encode_request(5, &large_load(bad, 1.0, [512, 1024])).unwrap());
    peer.send(wire::encode_request(6, &run(bad)).unwrap());
    bystander_is_served(&ep, 4, 1);
    let mut replies = Vec::new();
    while replies.len() < 4 {
        let env = peer.recv();
        replies.push((env.request_id, env.message));
    }
    let mut ids: Vec<u64> = replies.iter().map(|r| r.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, [3, 4, 5, 6]);
    // The replies' order is not checked: workers answer through separate
    // sockets, so a session's next reply may overtake one (clients match
    // replies by request id). What each says shows the order they ran in:
    // the Run after the load computed with its weights, the Run after the
    // refused load found no graph.
    for (id, reply) in replies {
        match (id, reply) {
            (3, Reply::GraphLoaded { .. }) => {}
            (4, Reply::RunDone { outputs }) => {
                for v in outputs[0].f32s().unwrap() {
                    assert!((v - 1.024).abs() < 1e-4, "{v}");
                }
            }
            (5, Reply::Error(e)) => assert_eq!(e.code, ErrorCode::BadVariable, "{}", e.message),
            (6, Reply::Error(e)) => assert_eq!(e.code, ErrorCode::NoGraph, "{}", e.message),
            (id, other) => panic!("request {id}: {other:?}"),
        }
    }
}
