//! The service's frontend: a ZeroMQ ROUTER socket, the session table, and
//! the workers that run sessions' requests.
//!
//! Threads:
//! - the **socket thread** (`frontend.rs`) owns the ROUTER socket and the
//!   session table. It decodes every message (bounded by [`Limits`]; tensor
//!   values into storage reused from the service's
//!   [`BufferPool`](lanes_adaptor::wire::BufferPool), which sessions refill
//!   with their feeds after each run),
//!   answers control requests itself (Hello, OpenSession, CloseSession,
//!   Status), queues compute requests on the [`dispatch::Dispatcher`], and
//!   reclaims sessions that have been silent past the idle timeout;
//! - the dispatcher's queue ([`policy_queue::PolicyQueue`]) decides whose
//!   Run goes next under the `--policy` ([`PolicyChoice`]);
//! - **workers** (`worker.rs`) take items from the dispatcher, run them on
//!   the session's program, encode the reply and hand it back to the socket
//!   thread over an `inproc://` PUSH/PULL pair (ZeroMQ moves the frames
//!   without copying).
//!
//! Nothing from the network can panic the service: decoding is bounded and
//! typed, and a panic inside an executor is caught and answered as
//! [`ErrorCode::Internal`](lanes_adaptor::ErrorCode::Internal).

mod auth;
mod decoder;
pub mod dispatch;
mod frontend;
pub mod memory;
pub mod metrics;
pub mod policy_queue;
mod trim;
mod worker;
mod zap;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use lanes_adaptor::Limits;

pub use dispatch::{Dispatcher, FifoQueue, ReadyQueue, Work, WorkItem};
pub use memory::{resolve_memory, MemoryChoice, MemoryChoiceError};
pub use policy_queue::{PolicyChoice, PolicyQueue, UnknownPolicy, MAX_URGENCY};

/// Where iterations run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The GPU if one is usable, else the CPU (with a log line).
    Auto,
    Cpu,
    /// The GPU; an error if none is usable.
    Cuda,
}

/// `lanes serve --device`: `auto`, `cpu`, `cuda` (the first GPU) or
/// `cuda:N` (GPU N by ordinal, as `nvidia-smi` numbers them under the
/// default `CUDA_DEVICE_ORDER`). One service serves one GPU; every GPU of
/// a host is one service each (`lanes host`, docs/multi-gpu.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceArg {
    pub choice: DeviceChoice,
    /// The GPU's ordinal, for `cuda:N`.
    pub ordinal: Option<usize>,
}

impl From<DeviceChoice> for DeviceArg {
    fn from(choice: DeviceChoice) -> Self {
        DeviceArg {
            choice,
            ordinal: None,
        }
    }
}

/// A `--device` that is none of `auto`, `cpu`, `cuda`, `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?}: give auto, cpu, cuda (the first GPU) or cuda:N (GPU N, from 0)")]
pub struct UnknownDevice(pub String);

impl std::str::FromStr for DeviceArg {
    type Err = UnknownDevice;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let choice = match s {
            "auto" => DeviceChoice::Auto,
            "cpu" => DeviceChoice::Cpu,
            "cuda" => DeviceChoice::Cuda,
            _ => {
                let ordinal = s
                    .strip_prefix("cuda:")
                    .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(|| UnknownDevice(s.to_string()))?;
                return Ok(DeviceArg {
                    choice: DeviceChoice::Cuda,
                    ordinal: Some(ordinal),
                });
            }
        };
        Ok(choice.into())
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.choice, self.ordinal) {
            (DeviceChoice::Auto, _) => f.write_str("auto"),
            (DeviceChoice::Cpu, _) => f.write_str("cpu"),
            (DeviceChoice::Cuda, None) => f.write_str("cuda"),
            (DeviceChoice::Cuda, Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// Resolves `--device` to the device name the service reports: `cuda:N
/// (…)` when iterations run on GPU N, `cpu` otherwise (see [`backend_of`]).
pub fn resolve_device(choice: DeviceChoice) -> Result<String, ServerError> {
    resolve_device_arg(choice.into())
}

/// [`resolve_device`] for a `--device` that may name a GPU by ordinal:
/// GPU N is chosen for the process before anything opens the GPU, and an
/// ordinal the host does not have is an error (`no GPU 3: this host has
/// 2`).
pub fn resolve_device_arg(arg: DeviceArg) -> Result<String, ServerError> {
    let gpu = || -> Result<String, crate::exec::ExecError> {
        if let Some(n) = arg.ordinal {
            crate::exec::cuda::select_device(n)?;
        }
        let info = crate::exec::cuda::probe()?;
        Ok(format!(
            "cuda:{} ({})",
            crate::exec::cuda::selected_device(),
            info.name
        ))
    };
    match arg.choice {
        DeviceChoice::Cpu => Ok("cpu".into()),
        DeviceChoice::Auto => match gpu() {
            Ok(name) => Ok(name),
            Err(e) => {
                tracing::info!(reason = %e, "no usable GPU; running on the CPU");
                Ok("cpu".into())
            }
        },
        DeviceChoice::Cuda => gpu().map_err(|e| ServerError::NoDevice {
            reason: match e {
                crate::exec::ExecError::NoDevice { reason } => reason,
                other => other.to_string(),
            },
        }),
    }
}

/// The executor sessions use for a resolved device name.
pub fn backend_of(device: &str) -> crate::session::Backend {
    if device.starts_with("cuda") {
        crate::session::Backend::Cuda
    } else {
        crate::session::Backend::Cpu
    }
}

/// The lanes over `bytes` of memory (`--memory`), at most `max_lanes`
/// open: admission under the safety condition, the queue, the lanes'
/// turns. With `reserve` on the GPU (`--reserve`) the memory is taken now,
/// as one device reservation in equal chunks that every admitted job's
/// blocks are made of (lane sizes are whole chunks); keep it as long as
/// the lanes. Without it the GPU's lanes keep the books only: programs
/// take their blocks from the driver as admission allows. On the CPU the
/// lanes own one host buffer of `bytes` standing in for device memory (an
/// anonymous mapping, touched as used): every admitted job's variables and
/// its lane's arena live in it (`lanes::LaneTurn::memory`).
pub fn lanes_for(
    bytes: u64,
    max_lanes: usize,
    backend: crate::session::Backend,
    reserve: bool,
) -> Result<
    (
        crate::lanes::SharedLanes,
        Option<crate::exec::cuda::DeviceReservation>,
    ),
    ServerError,
> {
    use crate::lanes::{LanesConfig, SharedError, SharedLanes};
    let mut cfg = LanesConfig {
        max_lanes,
        ..LanesConfig::new(bytes)
    };
    let reservation = match backend {
        crate::session::Backend::Cuda if reserve => {
            let r = crate::exec::cuda::DeviceReservation::new(bytes).map_err(|e| {
                ServerError::DeviceMemory {
                    bytes,
                    reason: e.to_string(),
                }
            })?;
            cfg.capacity = r.size();
            cfg.alignment = r.chunk();
            tracing::info!(
                bytes = r.size(),
                chunk = r.chunk(),
                "device memory reserved"
            );
            Some(r)
        }
        _ => None,
    };
    let lanes = match backend {
        // The CPU's stand-in for device memory: one host buffer of
        // `bytes` (an anonymous mapping, touched as used) in which every
        // admitted job's variables and its lane's arena live.
        crate::session::Backend::Cpu => SharedLanes::new(cfg)?,
        crate::session::Backend::Cuda => {
            SharedLanes::accounting_only(cfg).map_err(SharedError::from)?
        }
    };
    Ok((lanes, reservation))
}

/// The (P, T) a job of `graph` asks the lanes for on the service's
/// resolved `device` (with `--reserve` or not), rounded as the lanes round
/// them: on the GPU T also holds the cuDNN and cuBLAS workspaces that the
/// lane's block holds. For sizing `--memory` in benchmarks and tests.
pub fn admission_sizes(
    device: &str,
    graph: &lanes_adaptor::ValidGraph,
    reserve: bool,
) -> Result<(u64, u64), ServerError> {
    let no = |reason: String| ServerError::Sizes { reason };
    let plan = crate::compile::plan(graph).map_err(|e| no(e.to_string()))?;
    let (p, t) = crate::session::admission_sizes(backend_of(device), graph, &plan)
        .map_err(|e| no(e.to_string()))?;
    // With `--reserve`: whole chunks (`RESERVE_CHUNK`, the chunk of every
    // reservation up to 128 GiB, see `cuda::reserve_chunk`).
    let align = match backend_of(device) {
        crate::session::Backend::Cuda if reserve => crate::exec::cuda::RESERVE_CHUNK,
        _ => crate::compile::DEFAULT_ALIGNMENT,
    };
    let up = |b: u64| b.checked_next_multiple_of(align.max(1));
    up(p).zip(up(t)).ok_or_else(|| no("sizes overflow".into()))
}

pub use crate::size::{ByteSize, SizeError};

/// How to run a service.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// ZeroMQ endpoint to bind; `tcp://127.0.0.1:*` picks a free port.
    pub endpoint: String,
    pub limits: Limits,
    /// Worker threads running sessions' requests.
    pub workers: usize,
    /// A session with no request for this long (and nothing queued or
    /// running) is reclaimed.
    pub idle_timeout: Duration,
    /// Most open sessions in all (the session table's capacity); more are
    /// refused with `Overloaded`.
    pub max_sessions: usize,
    /// Most open sessions of one connection, if the deployment sets one
    /// (`--max-sessions-per-client`); `None`, the default: no count of its
    /// own. A session that holds a graph is bounded by what it costs (its
    /// memory, admitted under `--memory`; its requests, under
    /// `max_requests_per_client`), so packing many models over one
    /// connection is never refused for their number; an empty one by
    /// `max_unloaded_per_client`.
    pub max_sessions_per_client: Option<usize>,
    /// Most sessions of one connection with no graph loaded yet (opened,
    /// their LoadGraph not yet done or failed); more are refused with
    /// `Overloaded`. They cost a table entry and nothing else bounds
    /// them: this keeps one connection from filling the table with empty
    /// sessions, while a deployment that loads each session it opens never
    /// meets it.
    pub max_unloaded_per_client: usize,
    /// Most open sessions of one peer across all its connections (a peer
    /// is the source ZeroMQ reports for a connection: the IP address of a
    /// TCP client, so every client on loopback is one peer; the user,
    /// group and process of an `ipc://` client); more are refused with
    /// `Overloaded`, so that one process opening many connections cannot
    /// take more than its share of `max_sessions`.
    pub max_sessions_per_peer: usize,
    /// Most requests of one connection queued or running at once (Loads,
    /// Runs, variable reads and writes); more are refused with
    /// `Overloaded`. Also sizes the connection's reply queue (see
    /// `docs/protocol.md`, worst-case memory).
    pub max_requests_per_client: usize,
    /// Device name reported by Status (see [`resolve_device`]).
    pub device: String,
    /// The memory the lanes share (`--memory`, resolved by
    /// [`resolve_memory`]): one reservation, divided into lanes; jobs are
    /// admitted under the safety condition. `None` (`--memory none`, and
    /// this struct's default): no admission.
    pub memory_bytes: Option<u64>,
    /// Most lanes open at once (`--max-lanes`): jobs beyond share lanes.
    pub max_lanes: usize,
    /// On the GPU, take `memory_bytes` at start-up as one device
    /// reservation that jobs' memory is carved from (`--reserve`).
    pub reserve: bool,
    /// The policy that orders Run requests (`--policy`).
    pub policy: PolicyChoice,
    /// Under memory pressure, evict idle jobs to host memory (inference
    /// jobs, least recently used first); their next Run brings them back.
    pub evict_idle: bool,
    /// Training jobs may be evicted too (their state is copied out): idle
    /// ones, and a busy one at its next iteration boundary while an
    /// inference job waits for memory (`frontend/pressure.rs`).
    pub evict_training: bool,
    /// Most bytes of feed storage kept after runs for decoding the next
    /// requests' tensors into (see [`lanes_adaptor::wire::BufferPool`]);
    /// 0 keeps none.
    pub feed_pool_bytes: usize,
    /// Attach the shared-memory segments local jobs offer for their feeds
    /// (see `lanes_adaptor::wire::shm`); off, their Runs use the socket.
    pub shared_memory: bool,
    /// Most address space one connection's shared-memory segments may
    /// take in the service, every mapping counted (`--max-shared-per-client`):
    /// an offer beyond is refused with `SharedMemory`.
    pub max_shared_per_client: u64,
    /// Most address space all connections' segments together may take
    /// (`--max-shared`), counted likewise.
    pub max_shared: u64,
    /// On the GPU, give each job's streams the priority its policy ranks
    /// it at ([`PolicyChoice::urgency`]); off, every lane's streams have
    /// CUDA's default priority (`--no-stream-priority`, for comparison).
    pub stream_priority: bool,
    /// Under `priority` with stream priorities: the device's gate
    /// (`exec::gate`) keeps training's segments off the GPU while an
    /// inference Run runs; `None` (`--no-gate`): stream priorities alone.
    pub gate: Option<crate::exec::gate::GateConfig>,
    /// Authenticate peers with this pre-shared key (`--auth-key-file`):
    /// a connection is admitted at ZeroMQ's handshake only with a
    /// connection token made with the key (`zap.rs`), and must answer its
    /// Hello's challenge before any other request
    /// (`lanes_adaptor::wire::auth`); `None`: every peer that reaches the
    /// endpoint is served.
    pub auth_key: Option<lanes_adaptor::AuthKey>,
    /// Prometheus metrics the workers and the socket thread feed
    /// (`--metrics`; see [`metrics`]); `None`: none are kept.
    pub metrics: Option<std::sync::Arc<metrics::Metrics>>,
    /// Busy polling (`--busy-poll MS`; zero, the default, is off): for this
    /// long after a message, the socket thread polls its sockets without
    /// sleeping, a worker that finished an item looks for the next one
    /// without sleeping, and a CUDA worker waits for its iteration without
    /// sleeping. Each busy thread takes a core for the window; the wake-ups
    /// it saves are tens of microseconds each on a request's path.
    pub busy_poll: Duration,
    /// When stopping, how long the requests queued or running may take to
    /// finish before they are answered `ShuttingDown` (`--shutdown-grace`).
    pub shutdown_grace: Duration,
    /// Bound of the load cache (`--load-cache`; see
    /// [`crate::compile::cache`]): what loads of a graph's structure
    /// compute, kept for the next load of that architecture. One cache per
    /// process: the last service started sets it. 0 turns it off.
    pub load_cache_bytes: u64,
}

/// Default of [`ServerConfig::shutdown_grace`].
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Default of [`ServerConfig::max_unloaded_per_client`]: a client opening
/// sessions ahead of loading them has room for 64.
pub const DEFAULT_UNLOADED_PER_CLIENT: usize = 64;

/// Default of [`ServerConfig::max_sessions`]: an entry costs a few
/// kilobytes besides its graph, so the table is large enough that several
/// deployments of a thousand models each fit.
pub const DEFAULT_MAX_SESSIONS: usize = 8192;

/// Default of [`ServerConfig::max_sessions_per_peer`]: half of the table,
/// so one host (or one local process) never takes the other half.
pub const DEFAULT_SESSIONS_PER_PEER: usize = DEFAULT_MAX_SESSIONS / 2;

/// Default of [`ServerConfig::max_requests_per_client`]: a client keeps
/// at most 4 Runs in flight per session (`lanes_adaptor::Client`), so this
/// is room for 16 busy sessions.
pub const DEFAULT_REQUESTS_PER_CLIENT: usize = 64;

/// Default of [`ServerConfig::feed_pool_bytes`]: room for a few
/// iterations' worth of large feeds (a ResNet-50 batch of 32 is 19.3 MB).
pub const DEFAULT_FEED_POOL_BYTES: usize = 256 << 20;

/// Default of [`ServerConfig::max_shared_per_client`]: 1 TiB of mappings,
/// segments of 512 GiB mapped twice.
pub const DEFAULT_SHARED_PER_CLIENT: u64 = 1 << 40;

/// Default of [`ServerConfig::max_shared`]: 16 TiB, an eighth of x86-64's
/// 128 TiB of user address space, so segments cannot take the room the
/// service needs for its threads, its reservation and the driver.
pub const DEFAULT_MAX_SHARED: u64 = 16 << 40;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            endpoint: "tcp://127.0.0.1:5555".into(),
            limits: Limits::default(),
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            idle_timeout: Duration::from_secs(300),
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_sessions_per_client: None,
            max_unloaded_per_client: DEFAULT_UNLOADED_PER_CLIENT,
            max_sessions_per_peer: DEFAULT_SESSIONS_PER_PEER,
            max_requests_per_client: DEFAULT_REQUESTS_PER_CLIENT,
            device: "cpu".into(),
            memory_bytes: None,
            max_lanes: crate::lanes::LanesConfig::new(0).max_lanes,
            reserve: false,
            policy: PolicyChoice::Fifo,
            evict_idle: true,
            evict_training: false,
            feed_pool_bytes: DEFAULT_FEED_POOL_BYTES,
            shared_memory: true,
            max_shared_per_client: DEFAULT_SHARED_PER_CLIENT,
            max_shared: DEFAULT_MAX_SHARED,
            stream_priority: true,
            gate: Some(crate::exec::gate::GateConfig::default()),
            auth_key: None,
            metrics: None,
            busy_poll: Duration::ZERO,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            load_cache_bytes: crate::compile::cache::DEFAULT_CACHE_BYTES,
        }
    }
}

/// Why the service could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("zeromq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: zmq::Error,
    },
    #[error("no usable GPU: {reason}")]
    NoDevice { reason: String },
    #[error("could not start a thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("the socket thread panicked")]
    Panicked,
    #[error("memory reservation: {0}")]
    Memory(#[from] crate::lanes::SharedError),
    #[error("cannot size a job for the lanes: {reason}")]
    Sizes { reason: String },
    #[error("cannot reserve {bytes} bytes of device memory (--memory): {reason}")]
    DeviceMemory { bytes: u64, reason: String },
    #[error(
        "cannot choose --memory auto: {reason}; pass --memory SIZE (e.g. 8GiB), or --memory none to run without admission"
    )]
    AutoMemory { reason: String },
}

/// A running service. Dropping it shuts the service down and waits for it.
#[derive(Debug)]
pub struct ServerHandle {
    endpoint: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

impl ServerHandle {
    /// The endpoint actually bound (with the port a `*` resolved to).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
    /// A flag that stops the service when set (e.g. from a Ctrl-C handler).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }
    /// Stops the service and waits for its threads.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        self.stop.store(true, Ordering::SeqCst);
        self.join()
    }
    /// Waits until the service stops (its stop flag is set elsewhere).
    pub fn wait(mut self) -> Result<(), ServerError> {
        self.join()
    }
    fn join(&mut self) -> Result<(), ServerError> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| ServerError::Panicked)?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.join();
    }
}

/// Binds the endpoint, starts the socket thread and the workers.
pub fn start(config: ServerConfig) -> Result<ServerHandle, ServerError> {
    lanes_adaptor::wire::keep_freed_blocks_mapped();
    crate::compile::cache::configure(config.load_cache_bytes);
    let stop = Arc::new(AtomicBool::new(false));
    let (endpoint, thread) = frontend::spawn(config, Arc::clone(&stop))?;
    Ok(ServerHandle {
        endpoint,
        stop,
        thread: Some(thread),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn device_resolution_never_panics() {
        assert_eq!(resolve_device(DeviceChoice::Cpu).unwrap(), "cpu");
        let auto = resolve_device(DeviceChoice::Auto).unwrap();
        match resolve_device(DeviceChoice::Cuda) {
            Ok(name) => assert_eq!(name, auto),
            Err(e) => {
                assert!(matches!(e, ServerError::NoDevice { .. }));
                assert_eq!(auto, "cpu");
            }
        }
    }

    #[test]
    fn device_flag_takes_an_ordinal() {
        let a: DeviceArg = "cuda:1".parse().unwrap();
        assert_eq!(a.choice, DeviceChoice::Cuda);
        assert_eq!(a.ordinal, Some(1));
        assert_eq!(a.to_string(), "cuda:1");
        assert_eq!("cuda".parse::<DeviceArg>().unwrap().ordinal, None);
        assert_eq!(
            "cpu".parse::<DeviceArg>().unwrap().choice,
            DeviceChoice::Cpu
        );
        for bad in ["cuda:", "cuda:x", "cuda:-1", "gpu", "cuda:1 "] {
            assert!(bad.parse::<DeviceArg>().is_err(), "{bad}");
        }
    }

    /// An ordinal past the host's GPUs is an error naming the count (or,
    /// without a GPU, the reason there is none), never a panic.
    #[test]
    fn an_ordinal_the_host_lacks_is_refused() {
        let arg: DeviceArg = "cuda:4096".parse().unwrap();
        match resolve_device_arg(arg) {
            Err(ServerError::NoDevice { reason }) => {
                assert!(!reason.is_empty());
                if crate::exec::cuda::device_count().is_ok() {
                    assert!(reason.starts_with("no GPU 4096: this host has"), "{reason}");
                }
            }
            other => panic!("{other:?}"),
        }
    }
}
