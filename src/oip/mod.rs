//! The Open Inference Protocol (KServe v2) over HTTP, with Triton's
//! extensions that the stock tools need: `lanes serve --http ADDR
//! --model-repository DIR`.
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
//! channel and are answered through a one-shot channel, so the HTTP side
//! (axum on a small tokio runtime, `routes.rs`) never blocks on the
//! service.
//!
//! - `repository.rs`: the model repository (Triton's layout) and the
//!   little of `config.pbtxt` that is read;
//! - `tensors.rs`: request and response bodies, JSON tensors and the
//!   binary tensor data extension;
//! - `batch.rs`: dynamic batching (requests gathered into one Run);
//! - `stats.rs`: per-model statistics (Triton's statistics extension);
//! - `error.rs`: the protocol's error responses.

mod batch;
mod error;
mod model;
mod repository;
mod routes;
mod stats;
mod tensors;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

pub use error::ApiError;
pub use repository::{RepositoryError, DEFAULT_MAX_BATCH};

/// How to serve the protocol.
#[derive(Debug, Clone)]
pub struct OipConfig {
    /// The address to listen on (`127.0.0.1:8000`; port 0 picks one).
    pub http: String,
    /// The service's endpoint that the models' sessions are opened on.
    pub endpoint: String,
    /// The key for a service that authenticates its peers.
    pub auth_key: Option<lanes_adaptor::AuthKey>,
    /// The model repository; `None`: no models until loaded (and none can
    /// be, as loading reads the repository).
    pub repository: Option<PathBuf>,
    /// Largest request body (JSON and binary data together).
    pub max_body_bytes: usize,
    /// Most inference requests being served at once; more are answered
    /// 503 at once.
    pub max_in_flight: usize,
    /// How long a model's thread waits for the service's reply to one Run.
    pub run_timeout: std::time::Duration,
    /// The service's stop flag ([`crate::server::ServerHandle::stop_flag`]):
    /// once set, `v2/health/ready` answers 503.
    pub stopping: Option<Arc<std::sync::atomic::AtomicBool>>,
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
    #[error("cannot start the HTTP front end's threads: {0}")]
    Runtime(std::io::Error),
    #[error("model repository: {0}")]
    Repository(#[from] RepositoryError),
}

/// The running front end. Dropping it stops the HTTP server and the
/// models' threads (their sessions close with their connections).
#[derive(Debug)]
pub struct OipHandle {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    state: Arc<routes::State>,
}

impl OipHandle {
    /// The address actually bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
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
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.state.models.unload_all();
    }
}

/// Binds the address, loads the repository's models (waiting for each to
/// be loaded or to fail) and serves until the handle is dropped.
pub fn start(config: OipConfig) -> Result<OipHandle, OipError> {
    let listener = std::net::TcpListener::bind(&config.http).map_err(|source| OipError::Bind {
        addr: config.http.clone(),
        source,
    })?;
    let addr = listener.local_addr().map_err(|source| OipError::Bind {
        addr: config.http.clone(),
        source,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| OipError::Bind {
            addr: config.http.clone(),
            source,
        })?;
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
    let state = Arc::new(routes::State::new(models, &config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("lanes-http")
        .enable_io()
        .enable_time()
        .build()
        .map_err(OipError::Runtime)?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = routes::router(Arc::clone(&state));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("lanes-http".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => {
                        let _ = ready_tx.send(Ok(()));
                        l
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let served = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = rx.await;
                    })
                    .await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "the HTTP front end stopped");
                }
            });
        })
        .map_err(OipError::Runtime)?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(source)) => {
            return Err(OipError::Bind {
                addr: config.http,
                source,
            })
        }
        Err(_) => {
            return Err(OipError::Runtime(std::io::Error::other(
                "the HTTP thread ended at start",
            )))
        }
    }
    Ok(OipHandle {
        addr,
        shutdown: Some(tx),
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
