//! What a peer without the key costs the service before it authenticates,
//! and large tensors under the service's small frame cap. The service's
//! socket takes no frame above `wire::CHUNK_BYTES` (64 KiB), ZeroMQ's own
//! handshake commands included, and requests carry larger parts in several
//! frames (docs/protocol.md, *Memory before authentication*). Through
//! `lanes serve` child processes with `--auth-key-file` and raw TCP
//! connections that speak just enough ZMTP 3.0 to announce huge frames.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use lanes_adaptor::{
    wire, AuthKey, Client, ClientOptions, GraphBuilder, SessionSpec, Tensor, TensorType,
};
use util::serve::Serve;

const KEY: &[u8; 48] = b"a pre-shared key of the jobs and of the service!";
const MIB: u64 = 1 << 20;

fn key() -> AuthKey {
    AuthKey::new(*KEY).unwrap()
}

/// `lanes serve` with the key in a file, and that file's directory.
fn serve_with_key(extra: &[&str]) -> (Serve, PathBuf) {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("lanes-preauth-{}-{k}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("key");
    std::fs::write(&file, KEY).unwrap();
    let file = file.to_string_lossy().into_owned();
    let mut args = vec!["--device", "cpu", "--auth-key-file", file.as_str()];
    args.extend_from_slice(extra);
    (Serve::start(&args), dir)
}

fn keyed_client(endpoint: &str) -> Client {
    Client::connect_with(
        endpoint,
        ClientOptions {
            auth_key: Some(key()),
            ..ClientOptions::default()
        },
    )
    .unwrap()
}

/// A ZMTP 3.0 greeting (64 bytes) of a client proposing `mechanism`.
fn greeting(mechanism: &str) -> Vec<u8> {
    let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F, 3, 0];
    let mut m = [0u8; 20];
    m[..mechanism.len()].copy_from_slice(mechanism.as_bytes());
    g.extend_from_slice(&m);
    g.push(0); // as-server
    g.extend_from_slice(&[0; 31]);
    g
}

/// How a hostile connection went: bytes of the huge frame the service
/// took before it closed the connection, and whether it closed it.
struct Attempt {
    sent: usize,
    closed: bool,
}

/// Connects over raw TCP, sends `greeting` and then a frame header with
/// `flags` (ZMTP: 0x02 long, 0x04 command) announcing `announced` bytes,
/// and streams up to `stream` bytes of its body; then waits (at most 20 s)
/// for the service to close the connection.
fn announce(endpoint: &str, greeting: &[u8], flags: u8, announced: u64, stream: usize) -> Attempt {
    let addr = endpoint.trim_start_matches("tcp://");
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut head = greeting.to_vec();
    head.push(flags);
    head.extend_from_slice(&announced.to_be_bytes());
    if flags & 0x04 != 0 {
        head.extend_from_slice(b"\x05HELLO");
    }
    let mut sent = 0;
    if s.write_all(&head).is_ok() {
        let block = vec![0x5Au8; 64 << 10];
        while sent < stream {
            match s.write(&block) {
                Ok(0) | Err(_) => break,
                Ok(n) => sent += n,
            }
        }
    }
    // The service's greeting may come first; then the end of the stream.
    let mut buf = [0u8; 4096];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break false
            }
            Err(_) => break true,
        }
    };
    Attempt { sent, closed }
}

/// Connections without the key that announce frames of 256 MiB in their
/// handshake (a PLAIN HELLO, a message frame) or speak NULL or garbage are
/// closed by libzmq at the frame's size, before it is allocated: the
/// service's peak resident memory grows by at most 8 MiB while eight of
/// them each try to stream 32 MiB (with the former cap of twice
/// `--max-frame`, each would have made it hold the 32 MiB it sent), and a
/// client with the key is served before and after.
#[test]
fn a_peer_without_the_key_costs_at_most_a_frame_before_authenticating() {
    let (serve, dir) = serve_with_key(&["--memory", "none"]);
    let mut client = keyed_client(&serve.endpoint);
    assert!(client.status().unwrap().sessions.is_empty());
    std::thread::sleep(Duration::from_millis(200));
    let before = serve.memory("VmHWM");
    const STREAM: usize = 32 << 20;
    let attempts = [
        (greeting("PLAIN"), 0x06, 256 * MIB), // a long HELLO command
        (greeting("PLAIN"), 0x02, 256 * MIB), // a long message frame
        (greeting("PLAIN"), 0x06, u64::MAX),
        (greeting("PLAIN"), 0x06, wire::CHUNK_BYTES as u64 + 1),
        (greeting("NULL"), 0x06, 256 * MIB),
        (greeting("NULL"), 0x02, 256 * MIB),
        (greeting("CURVE"), 0x06, 256 * MIB),
        (vec![0x47; 64], 0x02, 256 * MIB), // not ZMTP at all
    ];
    let handles: Vec<_> = attempts
        .into_iter()
        .map(|(g, flags, n)| {
            let ep = serve.endpoint.clone();
            std::thread::spawn(move || announce(&ep, &g, flags, n, STREAM))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let a = h.join().unwrap();
        assert!(a.closed, "attempt {i}: the service kept the connection");
        assert!(
            a.sent < STREAM,
            "attempt {i}: the service took all {} MiB of a frame above its cap",
            a.sent as u64 / MIB
        );
    }
    let mut serve = serve;
    assert!(serve.is_running());
    let grew = serve.memory("VmHWM").saturating_sub(before);
    println!("peak resident memory grew by {} KiB", grew / 1024);
    assert!(
        grew <= 8 * MIB,
        "peers without the key raised the service's peak memory by {} MiB",
        grew / MIB
    );
    // Still serving a client with the key, on its old connection and a new one.
    assert!(client.status().unwrap().sessions.is_empty());
    let mut again = keyed_client(&serve.endpoint);
    assert!(again.status().unwrap().sessions.is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

/// An 8 MiB feed and fetch and a 16 MiB variable cross the socket in frames
/// of at most 64 KiB (the service's cap) and come back exact.
#[test]
fn large_tensors_round_trip_under_the_small_frame_cap() {
    const N: usize = 2 << 20; // 8 MiB of f32
    let (serve, dir) = serve_with_key(&["--memory", "none", "--no-shared-memory"]);
    let mut client = keyed_client(&serve.endpoint);
    let mut s = client
        .open_session(SessionSpec::inference("large"))
        .unwrap();
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([N]));
    let v: Vec<f32> = (0..2 * N).map(|i| (i % 1009) as f32 - 500.0).collect();
    let big = g.variable("big", Tensor::from_f32([2 * N], v.clone()).unwrap());
    let head = g.slice(big, 0, 0, N);
    let y = g.add(x, head);
    g.set_name(y, "y");
    let (graph, vars) = g.finish().unwrap();
    s.load(&graph, vars).unwrap();
    let xs: Vec<f32> = (0..N).map(|i| (i % 7919) as f32 * 0.5).collect();
    let out = s
        .run(
            vec![("x", Tensor::from_f32([N], xs.clone()).unwrap())],
            &["y"],
        )
        .unwrap();
    let want: Vec<f32> = xs.iter().zip(&v).map(|(a, b)| a + b).collect();
    assert_eq!(out[0].f32s().unwrap(), want.as_slice());
    let back = s.read_variables(&["big"]).unwrap();
    assert_eq!(back["big"].f32s().unwrap(), v.as_slice());
    let mut serve = serve;
    assert!(serve.is_running());
    let _ = std::fs::remove_dir_all(dir);
}
