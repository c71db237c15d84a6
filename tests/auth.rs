//! Authentication with a pre-shared key (`lanes serve --auth-key-file`),
//! both ways: a client with the key is served (and checks the service holds
//! it too); one without it, with a wrong key, or a raw peer that skips the
//! handshake is refused with typed errors, its requests never decoded; a
//! service without a key answers no challenge. Through real sockets, in
//! this process and as `lanes serve` on an address reachable from other
//! hosts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::process::Command;

use lanes_adaptor::wire::auth::{self, AUTH_BYTES};
use lanes_adaptor::wire::{self, NamedTensor, Reply, Request};
use lanes_adaptor::{AuthKey, Client, ClientError, ClientOptions, ErrorCode, SessionSpec, Tensor};
use util::serve::Serve;
use util::*;

fn key() -> AuthKey {
    AuthKey::new(*b"c2hhcmVkIGJ5IHRoZSBqb2JzIGFuZCB0aGUgc2VydmljZQ==").unwrap()
}

fn with_key(key: Option<AuthKey>) -> ClientOptions {
    ClientOptions {
        auth_key: key,
        ..ClientOptions::default()
    }
}

fn x() -> Tensor {
    Tensor::from_f32([BATCH, IN], values(1, BATCH * IN)).unwrap()
}

/// The Hello reply's challenge.
fn hello(peer: &RawPeer, id: u64) -> Option<[u8; AUTH_BYTES]> {
    let hello = Request::Hello {
        client: "raw".into(),
    };
    match peer.call(wire::encode_request(id, &hello).unwrap()).message {
        Reply::Hello { challenge, .. } => challenge,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_client_with_the_key_is_served_and_others_are_refused() {
    let service = start_with(|c| c.auth_key = Some(key()));
    let ep = service.endpoint().to_string();
    // With the key: served.
    let mut client = Client::connect_with(&ep, with_key(Some(key()))).unwrap();
    let mut s = client
        .open_session(SessionSpec::inference("keyed"))
        .unwrap();
    let (graph, vars) = linear_relu(1);
    s.load(&graph, vars).unwrap();
    assert_eq!(s.run(vec![("x", x())], &["y"]).unwrap().len(), 1);
    drop(s);
    // Without a key, or with a wrong one: refused at connect.
    match Client::connect_with(&ep, with_key(None)) {
        Err(ClientError::Auth { reason }) => assert!(reason.contains("requires a key"), "{reason}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    let wrong = AuthKey::new(*b"a guess at the key, 32 bytes....").unwrap();
    match Client::connect_with(&ep, with_key(Some(wrong.clone()))) {
        Err(ClientError::Auth { reason }) => assert!(reason.contains("refused"), "{reason}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    // A raw peer without a connection token, with one of a wrong key, or
    // with one used already: not even its connection is accepted, so none
    // of its requests is answered.
    let used = key().connection_token(auth::unix_now());
    let first = RawPeer::connect_with_token(&ep, &used);
    let r = first.call(wire::encode_request(1, &Request::Status).unwrap());
    assert_eq!(error_code(&r.message), ErrorCode::Unauthenticated);
    for peer in [
        RawPeer::connect(&ep),
        RawPeer::connect_keyed(&ep, &wrong),
        RawPeer::connect_with_token(&ep, &used),
    ] {
        std::thread::sleep(std::time::Duration::from_millis(300));
        if peer.try_send(wire::encode_request(2, &Request::Status).unwrap()) {
            assert_eq!(peer.recv_raw(std::time::Duration::from_secs(2)), None);
        }
    }
    // A raw peer with a token that skips the Hello and Authenticate: every
    // request refused, large ones without being decoded.
    let raw = RawPeer::connect_keyed(&ep, &key());
    for (i, req) in [
        Request::Status,
        Request::OpenSession(SessionSpec::inference("sneaky")),
        Request::Run {
            session: lanes_adaptor::SessionId(1),
            feeds: vec![NamedTensor::new("x", Tensor::full([1 << 20], 1.0))],
            fetches: vec!["y".into()],
        },
    ]
    .iter()
    .enumerate()
    {
        let r = raw.call(wire::encode_request(10 + i as u64, req).unwrap());
        assert_eq!(
            (r.request_id, error_code(&r.message)),
            (10 + i as u64, ErrorCode::Unauthenticated),
            "{req:?}"
        );
    }
    // Hello, a wrong proof: refused, and the challenge is used up (the
    // right proof for it is refused too); a new Hello and the right proof:
    // authenticated, and the service's proof checks.
    let c = hello(&raw, 20).expect("a challenge");
    let nonce = auth::random_bytes();
    let bad = Request::Authenticate {
        nonce,
        proof: [0; AUTH_BYTES],
    };
    let r = raw.call(wire::encode_request(21, &bad).unwrap());
    assert_eq!(error_code(&r.message), ErrorCode::Unauthenticated);
    let good = |c: &[u8; AUTH_BYTES]| Request::Authenticate {
        nonce,
        proof: key().client_proof(c, &nonce),
    };
    let r = raw.call(wire::encode_request(22, &good(&c)).unwrap());
    assert_eq!(error_code(&r.message), ErrorCode::Unauthenticated);
    let c2 = hello(&raw, 23).expect("a challenge");
    assert_ne!(c, c2, "a fresh challenge per Hello");
    match raw
        .call(wire::encode_request(24, &good(&c2)).unwrap())
        .message
    {
        Reply::Authenticated { proof } => assert!(key().check_service(&c2, &nonce, &proof)),
        other => panic!("{other:?}"),
    }
    let r = raw.call(wire::encode_request(25, &Request::Status).unwrap());
    assert!(matches!(r.message, Reply::Status(_)), "{:?}", r.message);
    // Another connection does not inherit it.
    let other = RawPeer::connect_keyed(&ep, &key());
    let r = other.call(wire::encode_request(26, &Request::Status).unwrap());
    assert_eq!(error_code(&r.message), ErrorCode::Unauthenticated);
}

#[test]
fn a_service_without_a_key_sends_no_challenge() {
    let service = start();
    let raw = RawPeer::connect(service.endpoint());
    assert_eq!(hello(&raw, 1), None);
    let req = Request::Authenticate {
        nonce: [1; AUTH_BYTES],
        proof: [2; AUTH_BYTES],
    };
    let r = raw.call(wire::encode_request(2, &req).unwrap());
    assert_eq!(error_code(&r.message), ErrorCode::BadRequest);
    // A client with a key is served all the same.
    let mut client = Client::connect_with(service.endpoint(), with_key(Some(key()))).unwrap();
    client.status().unwrap();
}

/// With `--auth-key-file` the service may bind an address reachable from
/// other hosts; `lanes status` gets in with `LANES_AUTH_KEY_FILE` and is
/// refused without it.
#[test]
fn lanes_serve_on_a_remote_address_with_a_key_file() {
    let dir = std::env::temp_dir().join(format!("lanes-auth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("key");
    std::fs::write(&file, b"c2hhcmVkIGJ5IHRoZSBqb2JzIGFuZCB0aGUgc2VydmljZQ==\n").unwrap();
    let serve = Serve::start(&[
        "--memory",
        "none",
        "--endpoint",
        "tcp://0.0.0.0:*",
        "--auth-key-file",
        file.to_str().unwrap(),
    ]);
    let status = |key: Option<&std::path::Path>| {
        let mut cmd = Command::new(lanes_bin());
        cmd.args(["status", "--endpoint", &serve.endpoint]);
        cmd.env_remove("LANES_AUTH_KEY_FILE");
        if let Some(k) = key {
            cmd.env("LANES_AUTH_KEY_FILE", k);
        }
        cmd.output().unwrap()
    };
    let ok = status(Some(&file));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let refused = status(None);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("authentication"), "{err}");
    let log = serve.stop();
    assert!(log.contains("peers must authenticate"), "{log}");
    // A key file too short is refused at start.
    std::fs::write(&file, b"short").unwrap();
    let out = Command::new(lanes_bin())
        .args(["serve", "--device", "cpu", "--memory", "none"])
        .args(["--endpoint", "tcp://127.0.0.1:0", "--auth-key-file"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("fewer than 16"));
    std::fs::remove_dir_all(&dir).unwrap();
}
