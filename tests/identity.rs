//! Who a peer is, with the stock libzmq the service links: a connection is
//! its routing id, and a DEALER may choose its own (`ZMQ_ROUTING_ID`),
//! including the id of another client. What holds is the ZAP handler's
//! connection token (`--auth-key-file`): a peer without the key never
//! completes ZeroMQ's handshake, so naming a live or just-gone client's id
//! gets it nothing and the service never hears it. Without a key file a
//! peer that takes a dead client's id before the service notices it gone
//! takes its sessions (docs/protocol.md, *Security*: open). Through real
//! sockets against `lanes serve` child processes whose debug log shows the
//! routing ids.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::{BufRead, BufReader};
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
/// client's routing id, and then the id of that client just gone, gets
/// nothing: the victim's variables are not read, its session not closed,
/// and the service hears only the victim.
#[test]
fn a_peer_without_the_key_cannot_take_over_a_session_by_its_routing_id() {
    let mut service = Logged::start(true);
    let ep = service.endpoint.clone();
    let (mut v, session) = victim(&ep, true);
    let peers = service.peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    let vid = unhex(&peers[0]);
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
