//! Shared by the integration tests: a real service on an ephemeral loopback
//! port, a raw DEALER for sending hand-made frames, and a small graph with a
//! reference computation.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod jobs;
pub mod oip;
pub mod serve;

use std::time::Duration;

use lanes::server::{self, ServerConfig, ServerHandle};
use lanes_adaptor::wire::{self, Envelope, Reply};
use lanes_adaptor::{
    Client, Graph, GraphBuilder, Limits, SessionSpec, Tensor, TensorType, VarValues,
};

/// Starts a service on `tcp://127.0.0.1:*` with `f` applied to the config.
/// `LANES_TEST_DEVICE=cuda` runs the same tests against a GPU-backed service
/// (on the GPU machine; it fails fast where there is no GPU).
pub fn start_with(f: impl FnOnce(&mut ServerConfig)) -> ServerHandle {
    let device = device();
    let mut config = ServerConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        workers: 2,
        device,
        ..ServerConfig::default()
    };
    f(&mut config);
    server::start(config).expect("service starts")
}

/// The resolved device the tests' services run on (`LANES_TEST_DEVICE`).
#[allow(dead_code)]
pub fn device() -> String {
    match std::env::var("LANES_TEST_DEVICE").as_deref() {
        Ok("cuda") => server::resolve_device(server::DeviceChoice::Cuda).expect("a usable GPU"),
        _ => "cpu".into(),
    }
}

/// The `lanes` binary: `LANES_BIN` when set (the GPU machine runs copied test
/// binaries, where Cargo's build path does not exist), else Cargo's.
pub fn lanes_bin() -> std::path::PathBuf {
    std::env::var_os("LANES_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_lanes").into())
}

pub fn start() -> ServerHandle {
    start_with(|_| {})
}

/// A DEALER that sends frames exactly as given.
pub struct RawPeer {
    socket: zmq::Socket,
    _ctx: zmq::Context,
}

impl RawPeer {
    /// With a routing id of its own, as Lanes clients choose (only such
    /// connections may own sessions).
    pub fn connect(endpoint: &str) -> Self {
        Self::connect_as(endpoint, Some(&lanes_adaptor::wire::auth::connection_id()))
    }

    /// With the routing id `id`, or with none (ZeroMQ then assigns one).
    pub fn connect_as(endpoint: &str, id: Option<&[u8]>) -> Self {
        Self::connect_full(endpoint, id, None)
    }

    /// A DEALER presenting `token` (a connection token, see
    /// `AuthKey::connection_token`) in its ZeroMQ handshake, as a client with
    /// the key does to a service that authenticates its peers.
    pub fn connect_with_token(endpoint: &str, token: &str) -> Self {
        let id = lanes_adaptor::wire::auth::connection_id();
        Self::connect_full(endpoint, Some(&id), Some(token))
    }

    /// With the routing id `id` (or none) and the connection token `token`
    /// (or none).
    pub fn connect_full(endpoint: &str, id: Option<&[u8]>, token: Option<&str>) -> Self {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::DEALER).unwrap();
        socket.set_linger(0).unwrap();
        if let Some(id) = id {
            socket.set_identity(id).unwrap();
        }
        if let Some(token) = token {
            socket
                .set_plain_username(Some(lanes_adaptor::wire::auth::TOKEN_USER))
                .unwrap();
            socket.set_plain_password(Some(token)).unwrap();
        }
        socket.connect(endpoint).unwrap();
        RawPeer { socket, _ctx: ctx }
    }

    /// [`RawPeer::connect_with_token`] with a fresh token of `key`.
    pub fn connect_keyed(endpoint: &str, key: &lanes_adaptor::AuthKey) -> Self {
        let now = lanes_adaptor::wire::auth::unix_now();
        Self::connect_with_token(endpoint, &key.connection_token(now))
    }

    pub fn send(&self, frames: Vec<Vec<u8>>) {
        self.socket.send_multipart(frames, 0).unwrap();
    }

    /// Sends without waiting: false when the socket takes nothing (no
    /// connection, e.g. one the service refused at its handshake).
    pub fn try_send(&self, frames: Vec<Vec<u8>>) -> bool {
        match self.socket.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => true,
            Err(zmq::Error::EAGAIN) => false,
            Err(e) => panic!("{e}"),
        }
    }

    /// The next reply's raw frames, or `None` after `timeout`.
    pub fn recv_raw(&self, timeout: Duration) -> Option<Vec<Vec<u8>>> {
        if self
            .socket
            .poll(zmq::POLLIN, timeout.as_millis() as i64)
            .unwrap()
            == 0
        {
            return None;
        }
        Some(self.socket.recv_multipart(0).unwrap())
    }

    /// The next reply, decoded (the service's pings skipped, as clients
    /// skip them).
    pub fn recv(&self) -> Envelope<Reply> {
        loop {
            let frames = self
                .recv_raw(Duration::from_secs(10))
                .expect("a reply within 10 s");
            let env = wire::decode_reply(&frames, &Limits::default()).expect("a decodable reply");
            if env.message != Reply::Ping {
                return env;
            }
        }
    }

    /// Sends frames and returns the decoded reply.
    pub fn call(&self, frames: Vec<Vec<u8>>) -> Envelope<Reply> {
        self.send(frames);
        self.recv()
    }

    /// Opens a session of `spec` (request 1) and loads `graph` with its
    /// variables into it (request 2).
    pub fn open_and_load(
        &self,
        spec: lanes_adaptor::SessionSpec,
        (graph, vars): (Graph, VarValues),
    ) -> lanes_adaptor::wire::SessionId {
        use lanes_adaptor::wire::{NamedTensor, Request};
        let session = match self
            .call(wire::encode_request(1, &Request::OpenSession(spec)).unwrap())
            .message
        {
            Reply::SessionOpened { session } => session,
            other => panic!("{other:?}"),
        };
        let load = Request::LoadGraph {
            session,
            graph,
            variables: vars
                .into_iter()
                .map(|(n, t)| NamedTensor::new(n, t))
                .collect(),
        };
        match self.call(wire::encode_request(2, &load).unwrap()).message {
            Reply::GraphLoaded { .. } => session,
            other => panic!("{other:?}"),
        }
    }
}

/// The code of an error reply (panics on any other reply).
pub fn error_code(reply: &Reply) -> lanes_adaptor::ErrorCode {
    match reply {
        Reply::Error(e) => e.code,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

pub const BATCH: usize = 4;
pub const IN: usize = 3;
pub const OUT: usize = 2;

/// Deterministic values in [-1, 1) from a seed.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `y = relu(x @ w + b)` with x [4,3] (placeholder), w [3,2], b [2] (variables).
pub fn linear_relu(seed: u64) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([BATCH, IN]));
    let w = g.variable(
        "w",
        Tensor::from_f32([IN, OUT], values(seed, IN * OUT)).unwrap(),
    );
    let b = g.variable("b", Tensor::from_f32([OUT], values(seed + 1, OUT)).unwrap());
    let h = g.matmul(x, w);
    let h = g.add(h, b);
    let y = g.relu(h);
    g.set_name(y, "y");
    g.finish().unwrap()
}

/// Reference for [`linear_relu`].
pub fn linear_relu_ref(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    dense_relu_ref(x, w, b, BATCH, IN, OUT)
}

/// `relu(x @ w + b)` for x [rows, cols], w [cols, outs], b [outs].
pub fn dense_relu_ref(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    rows: usize,
    cols: usize,
    outs: usize,
) -> Vec<f32> {
    let mut y = vec![0.0; rows * outs];
    for i in 0..rows {
        for j in 0..outs {
            let mut acc = b[j];
            for k in 0..cols {
                acc += x[i * cols + k] * w[k * outs + j];
            }
            y[i * outs + j] = acc.max(0.0);
        }
    }
    y
}

pub fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "element {i}: got {g}, want {w}"
        );
    }
}

/// Seeded feeds for a model's placeholders: f32 values in [-1, 1), integer
/// inputs (token ids, labels) in `0..int_range`.
pub fn feeds_for(
    inputs: &[(String, TensorType)],
    seed: u64,
    int_range: i64,
) -> std::collections::BTreeMap<String, Tensor> {
    lanes_adaptor::zoo::seeded_feeds(inputs, seed, int_range).unwrap()
}

/// A feed for [`linear_relu`]'s `x`, from `seed`.
pub fn x_for(seed: u64) -> Tensor {
    Tensor::from_f32([BATCH, IN], values(seed, BATCH * IN)).unwrap()
}

/// `y = relu(x @ w)` chained 24 times on 512 × 512: a Run that takes a
/// while on the CPU.
pub fn heavy() -> (Graph, VarValues) {
    heavy_of(512)
}

/// `y = relu(x @ w)` chained 24 times on `n` × `n`.
pub fn heavy_of(n: usize) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([n, n]));
    let w = g.variable(
        "w",
        Tensor::from_f32([n, n], values(2, n * n).iter().map(|v| v / 16.0).collect()).unwrap(),
    );
    let mut h = x;
    for _ in 0..24 {
        let m = g.matmul(h, w);
        h = g.relu(m);
    }
    g.set_name(h, "y");
    g.finish().unwrap()
}

/// `n` placeholders `x0..` of `elems` f32 each, summed into `y`.
pub fn many_inputs(n: usize, elems: usize) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let xs: Vec<_> = (0..n)
        .map(|i| g.placeholder(&format!("x{i}"), TensorType::f32([elems])))
        .collect();
    let mut y = xs[0];
    for x in &xs[1..] {
        y = g.add(y, *x);
    }
    g.set_name(y, "y");
    g.finish().unwrap()
}

/// MiB.
pub const MIB: u64 = 1 << 20;

/// Another client opens a session, loads a small model (`seed`) and gets
/// one Run (`x_for(run)`) answered.
pub fn bystander_is_served(ep: &str, seed: u64, run: u64) {
    let mut bystander = Client::connect(ep).unwrap();
    let mut s = bystander
        .open_session(SessionSpec::inference("bystander"))
        .unwrap();
    let (graph, vars) = linear_relu(seed);
    s.load(&graph, vars).unwrap();
    s.run(vec![("x", x_for(run))], &["y"]).unwrap();
}

/// Batch `k` of `n` rows for an MLP over 8 features: inputs `x` from a
/// sine, labels `y` (4 classes) from the sign pattern of two of them (a
/// task an MLP learns).
pub fn sine_batch(k: usize, n: usize) -> std::collections::BTreeMap<String, Tensor> {
    let x: Vec<f32> = (0..n * 8)
        .map(|i| ((i + 131 * k) as f32 * 0.61).sin() * 2.0)
        .collect();
    let y: Vec<i64> = (0..n)
        .map(|r| i64::from(x[r * 8] > 0.0) * 2 + i64::from(x[r * 8 + 3] > 0.0))
        .collect();
    std::collections::BTreeMap::from([
        ("x".to_string(), Tensor::from_f32([n, 8], x).unwrap()),
        ("y".to_string(), Tensor::from_i64([n], y).unwrap()),
    ])
}
