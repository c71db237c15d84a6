//! The messages a job and the service exchange, as Rust values. Tensors are
//! held here as [`Tensor`]s; the codec moves their values into raw frames.

use super::error::ErrorCode;
use super::Limits;
use crate::graph::Graph;
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A session's id, unique within one service run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionId(pub u64);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// What a job does with its iterations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum JobKind {
    Training,
    Inference,
}

impl fmt::Display for JobKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JobKind::Training => "training",
            JobKind::Inference => "inference",
        })
    }
}

/// What a job tells the service when it opens a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSpec {
    /// Human-readable job name (shown by `lanes status`); not empty.
    pub name: String,
    pub kind: JobKind,
    /// Larger runs first under priority policies.
    pub priority: i32,
    /// Iterations the job expects to run, if known (used by SRTF-like policies).
    pub expected_iterations: Option<u64>,
    /// The latency objective of its Runs, in milliseconds (a p99 target):
    /// the service counts how many of its Runs answered within it
    /// (`lanes status`, `/metrics`). Positive, finite, at most
    /// [`MAX_SLO_MS`] ([`SessionSpec::check`]); `None`: no objective.
    pub slo_ms: Option<f64>,
}

/// The largest `slo_ms` a session may state: one hour.
pub const MAX_SLO_MS: f64 = 3_600_000.0;

/// Why a [`SessionSpec`] is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// `slo_ms` is not a finite number of milliseconds in (0, [`MAX_SLO_MS`]].
    #[error("slo_ms must be a finite number of milliseconds above 0 and at most {MAX_SLO_MS}, not {slo_ms}")]
    Slo {
        /// The value given.
        slo_ms: f64,
    },
}

impl SessionSpec {
    pub fn new(name: impl Into<String>, kind: JobKind) -> Self {
        SessionSpec {
            name: name.into(),
            kind,
            priority: 0,
            expected_iterations: None,
            slo_ms: None,
        }
    }
    pub fn inference(name: impl Into<String>) -> Self {
        Self::new(name, JobKind::Inference)
    }
    pub fn training(name: impl Into<String>) -> Self {
        Self::new(name, JobKind::Training)
    }
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
    pub fn with_expected_iterations(mut self, n: u64) -> Self {
        self.expected_iterations = Some(n);
        self
    }
    /// States a latency objective for the session's Runs, in milliseconds
    /// (e.g. `SessionSpec::inference("resnet").with_slo_ms(5.0)?`); refused
    /// unless positive, finite and at most [`MAX_SLO_MS`].
    pub fn with_slo_ms(mut self, slo_ms: f64) -> Result<Self, SpecError> {
        check_slo_ms(slo_ms)?;
        self.slo_ms = Some(slo_ms);
        Ok(self)
    }
    /// What the service checks of a spec's numbers when a session opens
    /// (its name is the service's business): `slo_ms`, when given.
    pub fn check(&self) -> Result<(), SpecError> {
        self.slo_ms.map_or(Ok(()), check_slo_ms)
    }
}

fn check_slo_ms(slo_ms: f64) -> Result<(), SpecError> {
    if slo_ms.is_finite() && slo_ms > 0.0 && slo_ms <= MAX_SLO_MS {
        Ok(())
    } else {
        Err(SpecError::Slo { slo_ms })
    }
}

/// A tensor with a name: a feed, a variable value.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub tensor: Tensor,
}

impl NamedTensor {
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Self {
        NamedTensor {
            name: name.into(),
            tensor,
        }
    }
}

/// A request from a job.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Versioned handshake; the service answers with its version and limits.
    Hello {
        client: String,
    },
    OpenSession(SessionSpec),
    /// The graph and the initial values of all its variables.
    LoadGraph {
        session: SessionId,
        graph: Graph,
        variables: Vec<NamedTensor>,
    },
    /// One iteration: feeds by placeholder name, fetches as `node` or `node:slot`.
    Run {
        session: SessionId,
        feeds: Vec<NamedTensor>,
        fetches: Vec<String>,
    },
    /// A Run whose feeds' values are in a shared-memory segment the job's
    /// session attached: what the service decodes from a Run sent through a
    /// segment (`encode_request_into`). The values are read where they lie,
    /// by the worker that runs the iteration.
    RunShared {
        session: SessionId,
        feeds: Vec<super::shm::SharedFeed>,
        fetches: Vec<String>,
        /// Where in the segment to write the fetched tensors as well
        /// (see [`super::shm::ReplySlot`]), when the client asked.
        reply: Option<super::shm::ReplySlot>,
        /// The doorbell the client may also leave such Runs in (see
        /// [`super::shm::Doorbell`]).
        doorbell: Option<super::shm::Doorbell>,
    },
    /// Current variable values; all variables when `names` is empty.
    ReadVariables {
        session: SessionId,
        names: Vec<String>,
    },
    WriteVariables {
        session: SessionId,
        variables: Vec<NamedTensor>,
    },
    CloseSession {
        session: SessionId,
    },
    Status,
    /// Attach a shared-memory segment the job made (see
    /// [`super::shm`]); later Runs of the session may carry their feeds in
    /// it.
    ShareMemory {
        session: SessionId,
        offer: super::shm::SegmentOffer,
    },
    /// The answer to a Hello's challenge (services that authenticate
    /// peers, see [`super::auth`]): the client's nonce and its proof of the
    /// key.
    Authenticate {
        nonce: [u8; super::auth::AUTH_BYTES],
        proof: [u8; super::auth::AUTH_BYTES],
    },
}

impl Request {
    /// Short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::OpenSession(_) => "open_session",
            Request::LoadGraph { .. } => "load_graph",
            Request::Run { .. } | Request::RunShared { .. } => "run",
            Request::ReadVariables { .. } => "read_variables",
            Request::WriteVariables { .. } => "write_variables",
            Request::CloseSession { .. } => "close_session",
            Request::Status => "status",
            Request::ShareMemory { .. } => "share_memory",
            Request::Authenticate { .. } => "authenticate",
        }
    }
    /// The session a request addresses, if any.
    pub fn session(&self) -> Option<SessionId> {
        match self {
            Request::LoadGraph { session, .. }
            | Request::Run { session, .. }
            | Request::RunShared { session, .. }
            | Request::ReadVariables { session, .. }
            | Request::WriteVariables { session, .. }
            | Request::CloseSession { session }
            | Request::ShareMemory { session, .. } => Some(*session),
            Request::Hello { .. }
            | Request::OpenSession(_)
            | Request::Status
            | Request::Authenticate { .. } => None,
        }
    }
}

/// Where a session stands, as `lanes status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SessionState {
    /// Open, no graph loaded yet.
    Open,
    /// Graph loaded, nothing queued.
    Ready,
    /// A request waits for a worker.
    Queued,
    /// A worker is running one of its requests.
    Running,
}

impl fmt::Display for SessionState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SessionState::Open => "open",
            SessionState::Ready => "ready",
            SessionState::Queued => "queued",
            SessionState::Running => "running",
        })
    }
}

/// One session in a [`StatusReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionStatus {
    pub session: SessionId,
    pub spec: SessionSpec,
    pub state: SessionState,
    /// Iterations completed: Runs, but not those of an entry that updates
    /// nothing (an evaluation between steps).
    pub iterations: u64,
    /// Milliseconds since the session's last request or reply.
    pub idle_ms: u64,
    /// Mean time its Runs waited between arrival and dispatch (µs).
    pub queueing_mean_us: u64,
    /// Mean measured duration of its Runs (µs).
    pub service_mean_us: u64,
    /// Its persistent memory is on the device (false: evicted to host memory).
    pub resident: bool,
    /// Times it was evicted to host memory, and brought back.
    pub evictions: u64,
    pub returns: u64,
    /// Bytes of the shared-memory segments it has attached (its Runs' large
    /// feeds travel in them; 0: over the socket).
    pub shared_bytes: u64,
    /// How its Runs kept its `slo_ms`, when it stated one.
    pub slo: Option<SloAttainment>,
}

/// How a session's Runs kept its latency objective (`SessionSpec::slo_ms`).
/// A Run's latency is measured in the service from when its request was
/// decoded and queued to when its reply was handed to the socket; only
/// Runs that answered with outputs count (an error reply is no completion).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SloAttainment {
    /// The objective, milliseconds (the session's `slo_ms`).
    pub slo_ms: f64,
    /// Runs completed.
    pub runs: u64,
    /// Of them, answered within `slo_ms`.
    pub within: u64,
    /// The 99th percentile (nearest rank) of the latest Runs' latencies,
    /// up to [`SLO_WINDOW`] of them, milliseconds; `None` before the first.
    pub recent_p99_ms: Option<f64>,
}

/// Latest Runs over which [`SloAttainment::recent_p99_ms`] is taken.
pub const SLO_WINDOW: usize = 1000;

impl SloAttainment {
    /// `within / runs` as a fraction; `None` before the first Run.
    pub fn attainment(&self) -> Option<f64> {
        (self.runs > 0).then(|| self.within as f64 / self.runs as f64)
    }
}

/// The service's answer to [`Request::Status`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    pub server: String,
    pub version: u32,
    /// The device iterations run on (`cpu`, or the GPU's name).
    pub device: String,
    /// The scheduling policy ordering Run requests (`--policy`).
    pub policy: String,
    /// Memory given with `--memory`, if any.
    pub memory_bytes: Option<u64>,
    /// The lanes, their jobs (P/T) and the admission queue, rendered
    /// (boxed: keeps `Reply` small).
    pub lanes: Option<Box<String>>,
    /// The same as one JSON object (capacity, free, lanes with their
    /// jobs' P, T and offsets, the queue with reasons), for tools:
    /// `lanes status --json` shows it as `lanes`. Opaque to this crate.
    pub lanes_json: Option<Box<String>>,
    /// Most lanes the service opens at once (`--max-lanes`).
    pub max_lanes: u32,
    pub workers: u32,
    pub uptime_ms: u64,
    /// Requests waiting for a worker.
    pub queued: u64,
    pub sessions: Vec<SessionStatus>,
}

/// An error reply: a stable code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

/// A reply from the service. Every reply carries its request's id in the header.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Hello {
        server: String,
        version: u32,
        limits: Limits,
        /// The abstract Unix socket to which a job on this host hands its
        /// shared-memory segments' descriptors (`shm::OwnedSegment::hand_over`);
        /// `None` when the service attaches no shared memory.
        desk: Option<String>,
        /// Set when the service authenticates its peers: a fresh random
        /// challenge the client answers with [`Request::Authenticate`]
        /// before any other request (see [`super::auth`]).
        challenge: Option<[u8; super::auth::AUTH_BYTES]>,
    },
    SessionOpened {
        session: SessionId,
    },
    GraphLoaded {
        session: SessionId,
        nodes: u64,
        variables: u64,
        /// P: persistent bytes (variables, optimizer state, running stats).
        persistent_bytes: u64,
        /// T: ephemeral bytes of one iteration.
        ephemeral_bytes: u64,
        /// Set when the job waits for memory: why. Its Runs wait too.
        waiting: Option<String>,
    },
    /// Fetched tensors, in the order of the Run's fetches.
    RunDone {
        outputs: Vec<Tensor>,
    },
    Variables {
        variables: Vec<NamedTensor>,
    },
    VariablesWritten {
        count: u64,
    },
    SessionClosed {
        session: SessionId,
    },
    Status(StatusReport),
    Error(ErrorReply),
    /// The segment of a [`Request::ShareMemory`] is attached.
    MemoryShared {
        session: SessionId,
        segment: u32,
    },
    /// Unrequested, with request id 0: the service checks that a client
    /// whose sessions are quiet is still connected (clients skip it).
    Ping,
    /// The client's proof was good: the service's own proof of the key.
    Authenticated {
        proof: [u8; super::auth::AUTH_BYTES],
    },
}

impl Reply {
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Reply::Error(ErrorReply {
            code,
            message: message.into(),
        })
    }
    /// Short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Reply::Hello { .. } => "hello",
            Reply::SessionOpened { .. } => "session_opened",
            Reply::GraphLoaded { .. } => "graph_loaded",
            Reply::RunDone { .. } => "run_done",
            Reply::Variables { .. } => "variables",
            Reply::VariablesWritten { .. } => "variables_written",
            Reply::SessionClosed { .. } => "session_closed",
            Reply::Status(_) => "status",
            Reply::Error(_) => "error",
            Reply::MemoryShared { .. } => "memory_shared",
            Reply::Ping => "ping",
            Reply::Authenticated { .. } => "authenticated",
        }
    }
}
