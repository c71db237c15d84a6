//! The Open Inference Protocol (KServe v2) over HTTP and gRPC, with
//! Triton's extensions that the stock tools need: `lanes serve --http ADDR
//! --grpc ADDR --model-repository DIR`.
//!
//! # Design: an in-process client of the service
//!
//! The front end is a client of the service it runs beside, over the
//! service's own endpoint: every model is an ordinary inference session
//! opened, loaded and run through [`lanes_adaptor::Client`], so lanes,
//! admission, eviction and switching, the `--policy`, the limits and the
//! metrics apply to it exactly as to any other job, and nothing in
//! `server` knows HTTP. The alternative, handing work to the dispatcher
//! directly, would have meant a second way into the session table and the
//! policy queue (a session without a connection, its replies routed back
//! somewhere other than the socket thread), for a saving that is one
//! loopback round trip per request; the client also sends large feeds
//! through shared memory when the endpoint is local.
//!
//! Each loaded model has a thread of its own (`model.rs`) owning one
//! connection and one session per batch size seen (the ONNX importer makes
//! static shapes: a model is imported again for each batch size, lazily,
//! at most `max_batch_size` of them). Requests reach the thread through a
//! channel and are answered through a one-shot channel, so the front
//! doors (axum and tonic on one small tokio runtime) never block on the
//! service. Both share one models' table, one limit on the requests in
//! flight and the batching (`infer.rs`); they differ only in how a request
//! is read and an answer written.
//!
//! # What is copied
//!
//! A binary input is copied once on its way from the socket to the
//! service, as a `lanes` Python client's NumPy array is: the body is kept
//! in the pieces hyper read it into (`body.rs`, never gathered into one
//! buffer), an input is a range of them (`tensors::Feed::Raw`), and the
//! model's thread writes each request's rows of it straight into the
//! session's *feed buffers* (a shared segment made once per batch size and
//! written by every Run, so no request's bytes land in freshly mapped
//! memory), whose Run carries only a header; the outputs come back through
//! the buffers' reply slot. A gRPC input's `raw_input_contents` is moved,
//! not copied, until then. Where the service refuses the segment
//! (`--no-shared-memory`, its limits), the feeds are made tensors (one
//! copy) and travel in the Run. A binary output is copied once, behind
//! the JSON header in the response body. A compressed request body is
//! inflated into one buffer first, and a response compressed for a
//! caller that asks (`encoding.rs`). With Triton's system shared memory
//! extension (`shm.rs`) no tensor crosses a socket: the model's thread
//! copies an input once from the client's registered region into the
//! feed buffers (`tensors::Feed::Shm`), and an output is copied once into
//! its region instead of the response.
//!
//! - `routes.rs`: the REST routes;
//! - `grpc/`: the gRPC service (`inference.proto`, its generated code
//!   checked in as `inference.rs`);
//! - `infer.rs`: what the two share, and running a checked request;
//! - `config.rs`: the model configuration extension, which both doors
//!   serve;
//! - `control.rs`: the repository extension's index, load and unload,
//!   which both doors serve;
//! - `repository.rs`: the model repository (Triton's layout) and the
//!   little of `config.pbtxt` that is read;
//! - `body.rs`: a request body in the pieces it arrived in;
//! - `encoding.rs`: gzip and deflate request and response bodies;
//! - `tensors.rs`: request bodies, JSON tensors and the binary tensor
//!   data extension;
//! - `response.rs`: response bodies;
//! - `batch.rs`: dynamic batching (requests gathered into one Run);
//! - `stats.rs`: per-model statistics (Triton's statistics extension);
//! - `shm.rs`: Triton's system shared memory extension (registered
//!   regions, which both doors serve);
//! - `error.rs`: the protocol's error responses.

mod batch;
mod body;
mod config;
mod control;
mod encoding;
mod error;
pub mod grpc;
mod infer;
mod model;
mod repository;
mod response;
mod routes;
mod shm;
mod stats;
mod tensors;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

pub use error::ApiError;
pub use repository::{RepositoryError, DEFAULT_MAX_BATCH};
pub use shm::{Limits as ShmLimits, DEFAULT_MAX_BYTES as DEFAULT_SHM_MAX_BYTES};

/// How to serve the protocol.
#[derive(Debug, Clone)]
pub struct OipConfig {
    /// The address to serve HTTP on (`127.0.0.1:8000`; port 0 picks one).
    pub http: Option<String>,
    /// The address to serve gRPC on (`127.0.0.1:8001`; port 0 picks one).
    pub grpc: Option<String>,
    /// The service's endpoint that the models' sessions are opened on.
    pub endpoint: String,
    /// The key for a service that authenticates its peers.
    pub auth_key: Option<lanes_adaptor::AuthKey>,
    /// The model repository; `None`: no models until loaded (and none can
    /// be, as loading reads the repository).
    pub repository: Option<PathBuf>,
    /// Largest request body (JSON and binary data together), and largest
    /// gRPC request message.
    pub max_body_bytes: usize,
    /// Most inference and load requests being served at once over HTTP
    /// and gRPC together; more are answered 503 (RESOURCE_EXHAUSTED) at
    /// once.
    pub max_in_flight: usize,
    /// How long a model's thread waits for the service's reply to one Run.
    pub run_timeout: std::time::Duration,
    /// Whether Triton's system shared memory extension is served
    /// (`--system-shared-memory`; off by default: docs/serving.md).
    pub system_shared_memory: bool,
    /// Bounds on the shared memory regions registered at once.
    pub shm_limits: ShmLimits,
    /// The service's stop flag ([`crate::server::ServerHandle::stop_flag`]):
    /// once set, `v2/health/ready` answers 503.
    pub stopping: Option<Arc<std::sync::atomic::AtomicBool>>,
}

/// The server's name in its metadata.
const SERVER_NAME: &str = "lanes";

/// The platform models' metadata names.
const PLATFORM: &str = "lanes_onnx";

/// The protocol extensions served over HTTP (gRPC serves all but binary
/// tensor data, [`GRPC_EXTENSIONS`]), and
/// [`SHM_EXTENSION`] when it is on.
const EXTENSIONS: [&str; 4] = [
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
];

/// The protocol extensions served over gRPC.
const GRPC_EXTENSIONS: [&str; 3] = ["model_repository", "model_configuration", "statistics"];

/// Triton's system shared memory extension, served over both when on.
const SHM_EXTENSION: &str = "system_shared_memory";

/// The extensions a server's metadata lists: `base`, and the shared
/// memory extension when `shm` is on.
fn extensions(base: &[&'static str], shm: bool) -> Vec<&'static str> {
    let mut v = base.to_vec();
    if shm {
        v.push(SHM_EXTENSION);
    }
    v
}

/// Default of [`OipConfig::max_body_bytes`].
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;

/// Default of [`OipConfig::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;

/// Why the front end could not start.
#[derive(Debug, thiserror::Error)]
pub enum OipError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot start the front end's threads: {0}")]
    Runtime(std::io::Error),
    #[error("model repository: {0}")]
    Repository(#[from] RepositoryError),
}

/// The running front end. Dropping it stops the HTTP and gRPC servers
/// and the models' threads (their sessions close with their connections).
#[derive(Debug)]
pub struct OipHandle {
    http: Option<SocketAddr>,
    grpc: Option<SocketAddr>,
    shutdown: tokio::sync::watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
    state: Arc<infer::State>,
}

impl OipHandle {
    /// The HTTP address actually bound.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http
    }
    /// The gRPC address actually bound.
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc
    }
    /// The models of the repository and their states, as the index lists
    /// them (for the start-up log).
    pub fn models(&self) -> Vec<(String, String, Option<String>)> {
        self.state
            .models
            .index()
            .into_iter()
            .map(|e| (e.name, e.state.to_string(), e.reason))
            .collect()
    }
}

impl Drop for OipHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.state.models.unload_all();
        // Unmapped now, not when the last Arc of the state goes.
        self.state.shm.clear();
    }
}

/// A listener bound at `addr`, ready for tokio.
fn bind(addr: &str) -> Result<(std::net::TcpListener, SocketAddr), OipError> {
    let err = |source| OipError::Bind {
        addr: addr.to_string(),
        source,
    };
    let listener = std::net::TcpListener::bind(addr).map_err(err)?;
    let bound = listener.local_addr().map_err(err)?;
    listener.set_nonblocking(true).map_err(err)?;
    Ok((listener, bound))
}

/// Resolves once the handle is dropped.
async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    // An error: the handle is gone, which is a stop too.
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Binds the addresses, loads the repository's models (waiting for each
/// to be loaded or to fail) and serves until the handle is dropped.
pub fn start(config: OipConfig) -> Result<OipHandle, OipError> {
    let http = config.http.as_deref().map(bind).transpose()?;
    let grpc = config.grpc.as_deref().map(bind).transpose()?;
    let models = model::Models::new(model::Connect {
        endpoint: local_endpoint(&config.endpoint),
        auth_key: config.auth_key.clone(),
        run_timeout: config.run_timeout,
    });
    if let Some(dir) = &config.repository {
        let repo = repository::Repository::open(dir)?;
        models.set_repository(repo);
        models.load_all();
    }
    let state = Arc::new(infer::State::new(models, &config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("lanes-oip")
        .enable_io()
        .enable_time()
        .build()
        .map_err(OipError::Runtime)?;
    let (tx, rx) = tokio::sync::watch::channel(false);
    let app = routes::router(Arc::clone(&state));
    let grpc_state = Arc::clone(&state);
    let (http_addr, grpc_addr) = (http.as_ref().map(|h| h.1), grpc.as_ref().map(|g| g.1));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("lanes-oip".into())
        .spawn(move || {
            runtime.block_on(async move {
                let tokio_listener = |l: Option<(std::net::TcpListener, SocketAddr)>| {
                    l.map(|(l, _)| tokio::net::TcpListener::from_std(l))
                        .transpose()
                };
                let (http, grpc) = match (tokio_listener(http), tokio_listener(grpc)) {
                    (Ok(h), Ok(g)) => {
                        let _ = ready_tx.send(Ok(()));
                        (h, g)
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let http_rx = rx.clone();
                let serve_http = async move {
                    if let Some(l) = http {
                        let served = axum::serve(l, app)
                            .with_graceful_shutdown(stopped(http_rx))
                            .await;
                        if let Err(e) = served {
                            tracing::error!(error = %e, "the HTTP front end stopped");
                        }
                    }
                };
                let serve_grpc = async move {
                    if let Some(l) = grpc {
                        if let Err(e) = grpc::serve(l, grpc_state, stopped(rx)).await {
                            tracing::error!(error = %e, "the gRPC front end stopped");
                        }
                    }
                };
                tokio::join!(serve_http, serve_grpc);
            });
        })
        .map_err(OipError::Runtime)?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(source)) => {
            return Err(OipError::Bind {
                addr: config.http.or(config.grpc).unwrap_or_default(),
                source,
            })
        }
        Err(_) => {
            return Err(OipError::Runtime(std::io::Error::other(
                "the front end's thread ended at start",
            )))
        }
    }
    Ok(OipHandle {
        http: http_addr,
        grpc: grpc_addr,
        shutdown: tx,
        thread: Some(thread),
        state,
    })
}

/// The endpoint a client on this host reaches a service bound at
/// `endpoint` through: a wildcard host becomes loopback.
fn local_endpoint(endpoint: &str) -> String {
    for any in ["tcp://0.0.0.0:", "tcp://*:"] {
        if let Some(port) = endpoint.strip_prefix(any) {
            return format!("tcp://127.0.0.1:{port}");
        }
    }
    if let Some(port) = endpoint.strip_prefix("tcp://[::]:") {
        return format!("tcp://[::1]:{port}");
    }
    endpoint.to_string()
}

#[cfg(test)]
mod tests {
    use super::local_endpoint;

    #[test]
    fn wildcard_hosts_are_reached_on_loopback() {
        assert_eq!(local_endpoint("tcp://0.0.0.0:5555"), "tcp://127.0.0.1:5555");
        assert_eq!(local_endpoint("tcp://*:7"), "tcp://127.0.0.1:7");
        assert_eq!(local_endpoint("tcp://[::]:9"), "tcp://[::1]:9");
        assert_eq!(local_endpoint("ipc:///tmp/x"), "ipc:///tmp/x");
    }
}
