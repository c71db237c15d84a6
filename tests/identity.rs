//! Who a peer is. A connection is its ZeroMQ routing id, and a DEALER may
//! choose its own (`ZMQ_ROUTING_ID`), including the id of another client;
//! libzmq cannot be told to refuse chosen ids. What holds: Lanes clients
//! choose 128 random bits, only such ids own sessions, the service never
//! gives them away (its log shows a fingerprint), and the ids ZeroMQ hands
//! out itself start from an unpredictable value, so neither a client's id
//! nor the service's next ones can be named ahead. With `--auth-key-file`,
//! a peer without the key never completes ZeroMQ's handshake at all.
//! Through real sockets against `lanes serve` child processes whose debug
//! log shows how each request's peer is named.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanes_adaptor::wire::{self, Envelope, NamedTensor, Reply, Request, SessionId};
use lanes_adaptor::{AuthKey, Limits, SessionSpec};
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
        let line = serve::serving_line(&mut child);
        let endpoint =
            serve::endpoint_of(&line).unwrap_or_else(|| panic!("did not start: {line:?}"));
        Logged {
            child,
            endpoint,
            log,
            dir,
        }
    }

    /// How the log names the peers whose requests it shows, in the order
    /// they first appear: the hex of an id ZeroMQ assigned, `#` and a
    /// fingerprint for an id a client chose.
    fn peers(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for line in self.text().lines().filter(|l| l.contains(" request ")) {
            let Some(rest) = line.split(" peer=").nth(1) else {
                continue;
            };
            let id: String = rest
                .chars()
                .take_while(|c| c.is_ascii_hexdigit() || *c == '#')
                .collect();
            if !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap()
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

/// A DEALER, optionally with a routing id of its own choosing, that
/// numbers its requests.
struct Peer {
    raw: RawPeer,
    next: u64,
}

impl Peer {
    /// With `key`, a connection token in its ZeroMQ handshake (without
    /// one a service that authenticates accepts no connection).
    fn connect(endpoint: &str, routing_id: Option<&[u8]>, key: Option<&AuthKey>) -> Peer {
        let token = key.map(|k| k.connection_token(wire::auth::unix_now()));
        Peer {
            raw: RawPeer::connect_full(endpoint, routing_id, token.as_deref()),
            next: 1,
        }
    }

    /// The reply to `req`, or `None` within `wait`.
    fn try_call(&mut self, req: &Request, wait: Duration) -> Option<Envelope<Reply>> {
        let id = self.next;
        self.next += 1;
        // A connection the service refused takes no message at all.
        if !self.raw.try_send(wire::encode_request(id, req).unwrap()) {
            return None;
        }
        let deadline = Instant::now() + wait;
        loop {
            let frames = self
                .raw
                .recv_raw(deadline.saturating_duration_since(Instant::now()))?;
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

/// The victim: a connection with an id of its own as a Lanes client
/// chooses, authenticated (when the service asks), one training session
/// with its graph loaded.
fn victim(endpoint: &str, auth: bool) -> (Peer, Vec<u8>, SessionId) {
    let key = auth.then(key);
    let id = wire::auth::connection_id().to_vec();
    let mut v = Peer::connect(endpoint, Some(&id), key.as_ref());
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
    (v, id, session)
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

/// What a peer without the key, claiming `id`, gets when it names the
/// victim's session: nothing, since its connection never passes ZeroMQ's
/// handshake (no connection token).
fn keyless_hijack(endpoint: &str, id: &[u8], session: SessionId) {
    let mut keyless = Peer::connect(endpoint, Some(id), None);
    for req in against(session) {
        assert!(
            keyless.try_call(&req, Duration::from_secs(2)).is_none(),
            "{} answered",
            req.name()
        );
    }
}

/// With `--auth-key-file`, a peer without the key that names a live
/// client's routing id (as if it had learnt it), and then the id of that
/// client just gone, gets nothing: the victim's variables are not read,
/// its session not closed, and the service hears only the victim.
#[test]
fn a_peer_without_the_key_cannot_take_over_a_session_by_its_routing_id() {
    let mut service = Logged::start(true);
    let ep = service.endpoint.clone();
    let (mut v, vid, session) = victim(&ep, true);
    let peers = service.peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    keyless_hijack(&ep, &vid, session);
    // The victim is still served, its session intact.
    assert!(matches!(
        v.call(&read_vars(session)),
        Reply::Variables { .. }
    ));
    // The victim dies (its connection closes); at once a peer without the
    // key claims its id: nothing of the victim's is reachable.
    drop(v);
    keyless_hijack(&ep, &vid, session);
    std::thread::sleep(Duration::from_millis(200));
    let peers = service.peers();
    assert_eq!(peers.len(), 1, "only the victim was heard: {peers:?}");
    assert!(service.running());
}

/// Without a key (loopback): the service never gives a client's id away —
/// its log names the victim by a fingerprint, not by its id — so no other
/// peer can name it; a peer that leaves its id to ZeroMQ (the ids an
/// attacker could predict or claim) cannot open a session nor reach the
/// victim's, and is told why.
#[test]
fn only_a_connection_with_an_unguessable_id_of_its_own_owns_sessions() {
    let service = Logged::start(false);
    let ep = service.endpoint.clone();
    let (mut v, vid, session) = victim(&ep, false);
    assert!(matches!(
        v.call(&read_vars(session)),
        Reply::Variables { .. }
    ));
    let log = service.text();
    assert!(
        !log.contains(&wire::auth::hex(&vid)),
        "the log gives the victim's id away"
    );
    let label = format!("#{}", wire::auth::fingerprint(&vid));
    assert_eq!(service.peers(), vec![label]);

    let mut unnamed = Peer::connect(&ep, None, None);
    for req in [
        Request::Hello {
            client: "unnamed".into(),
        },
        Request::OpenSession(SessionSpec::training("squatter")),
    ] {
        match unnamed.call(&req) {
            Reply::Error(e) => {
                assert_eq!(e.code, wire::ErrorCode::BadRequest, "{e:?}");
                assert!(e.message.contains("routing id"), "{}", e.message);
            }
            other => panic!("{} answered {other:?}", req.name()),
        }
    }
    for req in against(session) {
        match unnamed.call(&req) {
            Reply::Error(e) => assert_eq!(e.code, wire::ErrorCode::UnknownSession, "{e:?}"),
            other => panic!("{} answered {other:?}", req.name()),
        }
    }
    // A short id of one's choosing owns nothing either.
    let mut short = Peer::connect(&ep, Some(b"victim"), None);
    match short.call(&Request::OpenSession(SessionSpec::training("short"))) {
        Reply::Error(e) => assert_eq!(e.code, wire::ErrorCode::BadRequest, "{e:?}"),
        other => panic!("a short id opened a session: {other:?}"),
    }
    assert!(matches!(
        v.call(&read_vars(session)),
        Reply::Variables { .. }
    ));
}

/// The first id a peer that names none is handed, as the log shows it.
fn first_assigned_id(service: &Logged) -> String {
    let mut p = Peer::connect(&service.endpoint, None, None);
    assert!(matches!(p.call(&Request::Status), Reply::Status(_)));
    let peers = service.peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    peers[0].clone()
}

/// Stock libzmq draws the first id its ROUTER hands out from an unseeded
/// `rand ()`: every process handed out `006b8b4567`, then `…68`, and so
/// on. The service seeds it, so two fresh services start elsewhere.
#[test]
fn the_ids_a_fresh_service_hands_out_are_not_predictable() {
    let a = first_assigned_id(&Logged::start(false));
    let b = first_assigned_id(&Logged::start(false));
    assert_eq!(a.len(), 10, "{a}");
    assert!(a.starts_with("00") && b.starts_with("00"), "{a} {b}");
    assert_ne!(a, "006b8b4567");
    assert_ne!(b, "006b8b4567");
    assert_ne!(a, b, "two fresh services handed out the same first id");
}

/// A peer that claims, ahead of time, the ids an unseeded ROUTER would
/// hand out next (libzmq aborts the process when its counter reaches a
/// claimed id) does not stop the service: the ids it hands out start
/// elsewhere, and ordinary clients that name no id are served.
#[test]
fn claiming_the_ids_libzmq_would_hand_out_does_not_crash_the_service() {
    let mut service = Logged::start(false);
    let ep = service.endpoint.clone();
    let claimed: Vec<Peer> = (0..64u32)
        .map(|k| {
            let mut id = vec![0u8];
            id.extend_from_slice(&0x6b8b_4567u32.wrapping_add(k).to_be_bytes());
            let mut p = Peer::connect(&ep, Some(&id), None);
            assert!(matches!(p.call(&Request::Status), Reply::Status(_)));
            p
        })
        .collect();
    for _ in 0..64 {
        let mut p = Peer::connect(&ep, None, None);
        assert!(matches!(p.call(&Request::Status), Reply::Status(_)));
    }
    assert!(service.running());
    let (mut v, _, session) = victim(&ep, false);
    assert!(matches!(
        v.call(&read_vars(session)),
        Reply::Variables { .. }
    ));
    drop(claimed);
}
