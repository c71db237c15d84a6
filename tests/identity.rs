//! Who a peer is: the service's ROUTER assigns every connection's routing
//! id itself (from a secure random start; a peer's own `ZMQ_ROUTING_ID` is
//! ignored, see third_party/zeromq-src/PATCHES.md), so a peer can neither
//! take over another connection's sessions (nor its authentication) by
//! naming its id, alive or just gone, nor kill the service by claiming ids
//! ahead of the counter. Through real sockets against `lanes serve` child
//! processes whose debug log shows the routing ids.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanes_adaptor::wire::{self, Envelope, NamedTensor, Reply, Request, SessionId};
use lanes_adaptor::{AuthKey, Client, ClientOptions, ErrorCode, Limits, SessionSpec};
use util::*;

const KEY: &[u8; 48] = b"c2hhcmVkIGJ5IHRoZSBqb2JzIGFuZCB0aGUgc2VydmljZQ==";

fn key() -> AuthKey {
    AuthKey::new(*KEY).unwrap()
}

/// `lanes serve` with its log (debug level: requests with their peer's
/// routing id) in a file the test reads while it runs.
struct Logged {
    child: Child,
    endpoint: String,
    log: PathBuf,
    dir: PathBuf,
}

impl Logged {
    fn start(auth: bool) -> Logged {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("lanes-identity-{}-{k}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("serve.log");
        let mut cmd = Command::new(lanes_bin());
        cmd.args(["serve", "--device", "cpu", "--memory", "none"])
            .args(["--workers", "1", "--endpoint", "tcp://127.0.0.1:*"]);
        if auth {
            let file = dir.join("key");
            std::fs::write(&file, KEY).unwrap();
            cmd.arg("--auth-key-file").arg(&file);
        }
        let mut child = cmd
            .env("RUST_LOG", "lanes=debug")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let endpoint = line
            .strip_prefix("lanes serving on ")
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("did not start: {line:?}"))
            .to_string();
        Logged {
            child,
            endpoint,
            log,
            dir,
        }
    }

    /// The routing ids of the peers whose requests the log shows, in the
    /// order they first appear.
    fn peers(&self) -> Vec<String> {
        let log = std::fs::read_to_string(&self.log).unwrap();
        let mut out: Vec<String> = Vec::new();
        for line in log.lines().filter(|l| l.contains(" request ")) {
            let Some(rest) = line.split(" peer=").nth(1) else {
                continue;
            };
            let id: String = rest.chars().take_while(char::is_ascii_hexdigit).collect();
            if !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A DEALER, optionally with a routing id of its own choosing.
struct Peer {
    socket: zmq::Socket,
    _ctx: zmq::Context,
    next: u64,
}

impl Peer {
    /// With `key`, a connection token in its ZeroMQ handshake (without
    /// one a service that authenticates accepts no connection).
    fn connect(endpoint: &str, routing_id: Option<&[u8]>, key: Option<&AuthKey>) -> Peer {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::DEALER).unwrap();
        socket.set_linger(0).unwrap();
        if let Some(id) = routing_id {
            socket.set_identity(id).unwrap();
        }
        if let Some(key) = key {
            let token = key.connection_token(wire::auth::unix_now());
            socket
                .set_plain_username(Some(wire::auth::TOKEN_USER))
                .unwrap();
            socket.set_plain_password(Some(&token)).unwrap();
        }
        socket.connect(endpoint).unwrap();
        Peer {
            socket,
            _ctx: ctx,
            next: 1,
        }
    }

    /// The reply to `req`, or `None` within `wait`.
    fn try_call(&mut self, req: &Request, wait: Duration) -> Option<Envelope<Reply>> {
        let id = self.next;
        self.next += 1;
        // A connection the service refused takes no message at all.
        match self
            .socket
            .send_multipart(wire::encode_request(id, req).unwrap(), zmq::DONTWAIT)
        {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => return None,
            Err(e) => panic!("{e}"),
        }
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if self
                .socket
                .poll(zmq::POLLIN, left.as_millis() as i64)
                .unwrap()
                == 0
            {
                return None;
            }
            let frames = self.socket.recv_multipart(0).unwrap();
            let env = wire::decode_reply(&frames, &Limits::default()).unwrap();
            if env.message != Reply::Ping && env.request_id == id {
                return Some(env);
            }
        }
    }

    fn call(&mut self, req: &Request) -> Reply {
        self.try_call(req, Duration::from_secs(20))
            .expect("a reply within 20 s")
            .message
    }

    /// Hello, and with a key the answer to its challenge.
    fn handshake(&mut self, key: Option<&AuthKey>) {
        let hello = Request::Hello {
            client: "identity-test".into(),
        };
        let Reply::Hello { challenge, .. } = self.call(&hello) else {
            panic!("no Hello reply");
        };
        if let (Some(c), Some(key)) = (challenge, key) {
            let nonce = wire::auth::random_bytes();
            let proof = key.client_proof(&c, &nonce);
            let r = self.call(&Request::Authenticate { nonce, proof });
            assert!(matches!(r, Reply::Authenticated { .. }), "{r:?}");
        }
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The victim: authenticated (when the service asks), one training
/// session with its graph loaded.
fn victim(endpoint: &str, auth: bool) -> (Peer, SessionId) {
    let key = auth.then(key);
    let mut v = Peer::connect(endpoint, None, key.as_ref());
    v.handshake(key.as_ref());
    let Reply::SessionOpened { session } =
        v.call(&Request::OpenSession(SessionSpec::training("victim")))
    else {
        panic!("no session");
    };
    let (graph, vars) = linear_relu(3);
    let load = Request::LoadGraph {
        session,
        graph,
        variables: vars
            .into_iter()
            .map(|(n, t)| NamedTensor::new(n, t))
            .collect(),
    };
    assert!(matches!(v.call(&load), Reply::GraphLoaded { .. }));
    (v, session)
}

fn read_vars(session: SessionId) -> Request {
    Request::ReadVariables {
        session,
        names: vec![],
    }
}

/// Requests naming the victim's session.
fn against(session: SessionId) -> Vec<Request> {
    vec![
        read_vars(session),
        Request::Run {
            session,
            feeds: vec![NamedTensor::new(
                "x",
                lanes_adaptor::Tensor::full([BATCH, IN], 1.0),
            )],
            fetches: vec!["y".into()],
        },
        Request::CloseSession { session },
    ]
}

/// What peers claiming `id` get when they name the victim's session:
/// never its variables. With auth, one without the key is not even
/// connected; one with the key is refused until it authenticates, then
/// finds no such session on its connection. Returns how many of them the
/// service heard.
fn hijack(endpoint: &str, id: &[u8], session: SessionId, auth: bool) -> usize {
    let wait = Duration::from_secs(2);
    if !auth {
        let mut thief = Peer::connect(endpoint, Some(id), None);
        for req in against(session) {
            let r = thief.call(&req);
            assert_eq!(
                error_code(&r),
                ErrorCode::UnknownSession,
                "{}: {r:?}",
                req.name()
            );
        }
        return 1;
    }
    let mut keyless = Peer::connect(endpoint, Some(id), None);
    for req in against(session) {
        assert!(
            keyless.try_call(&req, wait).is_none(),
            "{} answered",
            req.name()
        );
    }
    let mut keyed = Peer::connect(endpoint, Some(id), Some(&key()));
    for req in against(session) {
        let r = keyed.call(&req);
        assert_eq!(
            error_code(&r),
            ErrorCode::Unauthenticated,
            "{}: {r:?}",
            req.name()
        );
    }
    keyed.handshake(Some(&key()));
    for req in against(session) {
        let r = keyed.call(&req);
        assert_eq!(
            error_code(&r),
            ErrorCode::UnknownSession,
            "{}: {r:?}",
            req.name()
        );
    }
    1
}

fn takeover_fails(auth: bool) {
    let mut service = Logged::start(auth);
    let ep = service.endpoint.clone();
    // A peer claiming the id of a live, authenticated client.
    let (mut v, session) = victim(&ep, auth);
    let peers = service.peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    let vid = unhex(&peers[0]);
    let mut heard = 1 + hijack(&ep, &vid, session, auth);
    // The victim is still served, its session intact.
    assert!(matches!(
        v.call(&read_vars(session)),
        Reply::Variables { .. }
    ));
    // The victim dies (its connection closes); at once a peer claims its
    // id: nothing of the victim's is reachable.
    drop(v);
    heard += hijack(&ep, &vid, session, auth);
    std::thread::sleep(Duration::from_millis(200));
    let peers = service.peers();
    assert_eq!(peers.len(), heard, "each connection its own id: {peers:?}");
    for p in &peers[1..] {
        assert_ne!(p, &peers[0]);
        assert_eq!(p.len(), 10, "{p}");
        assert!(p.starts_with("00"), "{p}");
    }
    assert!(service.running());
}

#[test]
fn a_peer_cannot_take_over_a_session_by_its_routing_id_with_auth() {
    takeover_fails(true);
}

#[test]
fn a_peer_cannot_take_over_a_session_by_its_routing_id_without_auth() {
    takeover_fails(false);
}

/// Routing ids are the service's: not the stock libzmq sequence that every
/// process starts at (`006b8b4567`), different between two services, and
/// not what the peer asked for.
#[test]
fn routing_ids_are_neither_predictable_nor_chosen() {
    let mut firsts = Vec::new();
    for _ in 0..2 {
        let service = Logged::start(false);
        let mut p = Peer::connect(&service.endpoint, None, None);
        p.handshake(None);
        let mut chooser = Peer::connect(&service.endpoint, Some(b"chosen-by-the-peer"), None);
        chooser.handshake(None);
        std::thread::sleep(Duration::from_millis(200));
        let peers = service.peers();
        assert_eq!(peers.len(), 2, "{peers:?}");
        assert_ne!(peers[0], "006b8b4567");
        assert_eq!(peers[1].len(), 10, "{}", peers[1]);
        assert!(peers[1].starts_with("00"), "{}", peers[1]);
        firsts.push(peers[0].clone());
    }
    assert_ne!(firsts[0], firsts[1], "two services, the same first id");
}

/// Stock libzmq aborted (`socket_base.cpp:2128`) when its counter reached
/// an id a peer had claimed: 64 peers claiming the next ids, then an
/// ordinary client, which is served, and the service lives on.
#[test]
fn claiming_the_next_routing_ids_does_not_kill_the_service() {
    let mut service = Logged::start(true);
    let ep = service.endpoint.clone();
    let mut first = Client::connect_with(
        &ep,
        ClientOptions {
            auth_key: Some(key()),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    first.status().unwrap();
    let peers = service.peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    let counter = u32::from_str_radix(&peers[0][2..], 16).unwrap();
    let claimers: Vec<Peer> = (1..=64u32)
        .map(|k| {
            let mut id = vec![0u8];
            id.extend_from_slice(&counter.wrapping_add(k).to_be_bytes());
            let mut p = Peer::connect(&ep, Some(&id), Some(&key()));
            // Connected and known to the ROUTER: the service answers it.
            let r = p.call(&Request::Status);
            assert_eq!(error_code(&r), ErrorCode::Unauthenticated);
            p
        })
        .collect();
    for _ in 0..3 {
        let mut c = Client::connect_with(
            &ep,
            ClientOptions {
                auth_key: Some(key()),
                timeout: Duration::from_secs(20),
                ..ClientOptions::default()
            },
        )
        .unwrap();
        c.status().unwrap();
    }
    first.status().unwrap();
    assert!(service.running(), "the service died");
    drop(claimers);
}

/// A field of `/proc/PID/status` in bytes (`VmRSS`, `VmHWM`).
fn memory_of(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap()
}

/// A raw TCP peer that opens a ZMTP 3.0 handshake with `mechanism` and,
/// instead of its credentials, sends a frame announcing `bytes` (a command
/// or a message) and streams them: how many bytes the service took before
/// it closed the connection.
fn big_frame_in_the_handshake(endpoint: &str, mechanism: &[u8], command: bool, bytes: u64) -> u64 {
    use std::io::Write;
    let addr = endpoint.strip_prefix("tcp://").unwrap();
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut greeting = vec![0xFFu8, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 0];
    let mut mech = mechanism.to_vec();
    mech.resize(20, 0);
    greeting.extend_from_slice(&mech);
    greeting.push(0); // as-server
    greeting.resize(64, 0);
    let mut header = vec![if command { 0x06 } else { 0x02 }];
    header.extend_from_slice(&bytes.to_be_bytes());
    if tcp.write_all(&greeting).is_err() || tcp.write_all(&header).is_err() {
        return 0;
    }
    let chunk = vec![0u8; 1 << 20];
    let mut sent = 0u64;
    while sent < bytes {
        match tcp.write(&chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => sent += n as u64,
        }
    }
    sent
}

/// Before it holds the key, a peer makes the service hold no more than a
/// handshake: no connection without a connection token (ZAP), and no
/// frame above 4 KiB until the handshake is done (patched libzmq). Frames
/// of 1 GiB in the handshake, as commands and as messages, over NULL and
/// PLAIN: the service's resident memory stays within 64 MiB of where it
/// was (a generous bound: one such frame held would be 1 GiB), and it
/// serves a client with the key afterwards.
#[test]
fn a_peer_without_the_key_cannot_make_the_service_hold_memory() {
    const GIB: u64 = 1 << 30;
    let mut service = Logged::start(true);
    let ep = service.endpoint.clone();
    let pid = service.child.id();
    let mut c = Client::connect_with(
        &ep,
        ClientOptions {
            auth_key: Some(key()),
            ..ClientOptions::default()
        },
    )
    .unwrap();
    c.status().unwrap();
    let before = memory_of(pid, "VmRSS").max(memory_of(pid, "VmHWM"));
    let mut taken = Vec::new();
    for (mechanism, command) in [
        (&b"PLAIN"[..], true),
        (b"PLAIN", false),
        (b"PLAIN", true),
        (b"NULL", false),
    ] {
        taken.push(big_frame_in_the_handshake(&ep, mechanism, command, GIB));
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = memory_of(pid, "VmHWM");
    assert!(
        after <= before + (64 << 20),
        "peak {after} bytes against {before} before; bytes taken per peer {taken:?}"
    );
    // The socket buffers aside, the service stopped reading each at once.
    for t in &taken {
        assert!(*t < GIB / 4, "{taken:?}");
    }
    c.status().unwrap();
    assert!(service.running());
}
