//! Replays a trace against a running `lanes serve` with real adaptor jobs,
//! so the simulator's prediction can be checked against the service.
//!
//! Every trace job becomes a session of the model zoo's MLP (`width` wide,
//! `depth` hidden layers; training jobs send the training graph with SGD,
//! inference jobs the inference graph) opened at its scaled submission time
//! with the trace's kind, priority and iteration count, then sends its Runs
//! keeping `pipeline` of them outstanding, so its next iteration is queued
//! when one finishes (the simulator assumes a job is always ready).
//!
//! The depth is chosen so that one iteration takes the trace's iteration
//! time × time scale: before the replay, [`calibrate`] measures (through the
//! service's own per-session service times) one iteration at two depths per
//! kind and fits `fixed + depth × per_layer`. Iterations shorter than one
//! layer's cost cannot be made; they run at depth 1 and take longer.
//! [`RemoteRun::as_run`] is therefore the trace with each job's iteration
//! time replaced by what the service measured (unscaled), the input to
//! simulate for an apples-to-apples prediction.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use lanes_adaptor::wire::{
    self, Envelope, ErrorCode, NamedTensor, Reply, Request, SessionId, SessionSpec,
};
use lanes_adaptor::zoo::seeded_feeds;
use lanes_adaptor::{Arch, Graph, Limits, Optimizer, Tensor, ZooError};
use lanes_policies::JobKind;

use super::engine::{JobOutcome, SimRun, Startup};
use super::trace::TraceJob;

/// Settings of a replay against a service.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteConfig {
    /// The service's ZeroMQ endpoint.
    pub endpoint: String,
    /// Wall-clock seconds per trace second.
    pub time_scale: f64,
    /// Runs each job keeps outstanding (at least 1).
    pub pipeline: usize,
    /// Width of the MLP's layers.
    pub width: usize,
    /// Batch of every iteration.
    pub batch: usize,
    /// Most hidden layers a job's model gets.
    pub max_depth: usize,
    /// How long to wait for any one reply.
    pub timeout: Duration,
    /// Run every job as this zoo model ([`ZOO_MODELS`]) at `batch`
    /// instead of an MLP sized to the trace's iteration time: the work is
    /// real and its iteration time the model's own (compare with the
    /// simulator on [`RemoteRun::as_run`]). No calibration is needed.
    pub zoo: Option<String>,
    /// The service's metrics endpoint (`lanes serve --metrics ADDR`:
    /// `host:port`): [`measure_idle`] reads its own timing of each
    /// LoadGraph there. `None`: the load is timed by its round trip.
    pub metrics: Option<String>,
}

/// Zoo models a replay can run every job as (`RemoteConfig::zoo`).
pub const ZOO_MODELS: [&str; 6] = [
    "mlp",
    "lenet",
    "resnet18_cifar",
    "resnet50",
    "resnet152",
    "transformer",
];

impl RemoteConfig {
    /// Defaults for `endpoint`: scale 0.1, four Runs outstanding, width 128,
    /// batch 32, at most 400 layers, 120 s per reply.
    pub fn new(endpoint: impl Into<String>) -> Self {
        RemoteConfig {
            endpoint: endpoint.into(),
            time_scale: 0.1,
            pipeline: 4,
            width: 128,
            batch: 32,
            max_depth: 400,
            timeout: Duration::from_secs(120),
            zoo: None,
            metrics: None,
        }
    }
}

/// Why a replay against a service failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// Bad settings.
    #[error("replay: {0}")]
    Config(String),
    /// The socket failed.
    #[error("replay: zeromq: {0}")]
    Zmq(#[from] zmq::Error),
    /// A request could not be encoded.
    #[error("replay: {0}")]
    Encode(#[from] lanes_adaptor::WireError),
    /// A reply could not be decoded.
    #[error("replay: bad reply: {0}")]
    Decode(String),
    /// The service answered with an error.
    #[error("replay: job {job}: the service refused {request}: {code}: {message}")]
    Service {
        /// Trace job id (0 for calibration and status).
        job: u64,
        /// The request.
        request: &'static str,
        /// Its code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// No reply in time.
    #[error("replay: job {job}: no reply within {timeout:?}")]
    Timeout {
        /// Trace job id.
        job: u64,
        /// The limit.
        timeout: Duration,
    },
    /// A reply of the wrong kind.
    #[error("replay: job {job}: expected {expected}, got {got}")]
    Unexpected {
        /// Trace job id.
        job: u64,
        /// What was expected.
        expected: &'static str,
        /// What came.
        got: &'static str,
    },
    /// The service's policy is not one the simulator knows.
    #[error("replay: the service runs policy {0:?}, which the simulator does not know")]
    UnknownPolicy(String),
    /// A model could not be built.
    #[error("replay: {0}")]
    Zoo(#[from] ZooError),
    /// A job's thread panicked.
    #[error("replay: job {0}'s thread panicked")]
    Panicked(u64),
    /// The service's metrics endpoint could not be read.
    #[error("replay: metrics at {addr}: {reason}")]
    Metrics {
        /// The endpoint.
        addr: String,
        /// What went wrong.
        reason: String,
    },
}

/// Measured iteration cost of one kind of model at a few depths
/// (`(depth, seconds)`, depth increasing); between them the cost is
/// interpolated linearly, beyond them extrapolated from the nearest segment.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CostCurve {
    /// (hidden layers, seconds per iteration).
    pub points: Vec<(usize, f64)>,
}

impl CostCurve {
    /// The depth whose iteration takes closest to `target`, within `1..=max`.
    pub fn depth_for(&self, target: Duration, max: usize) -> usize {
        let t = target.as_secs_f64();
        let p = &self.points;
        if p.len() < 2 {
            return 1;
        }
        // The segment that brackets `t`, else the first or last one.
        let i = p
            .windows(2)
            .position(|w| t <= w[1].1)
            .unwrap_or(p.len() - 2);
        let ((d0, t0), (d1, t1)) = (p[i], p[i + 1]);
        let slope = (t1 - t0) / (d1 as f64 - d0 as f64);
        let d = if slope > 0.0 {
            d0 as f64 + (t - t0) / slope
        } else {
            d0 as f64
        };
        if d.is_finite() {
            (d.round().max(1.0) as usize).min(max.max(1))
        } else {
            1
        }
    }
}

impl CostCurve {
    /// Seconds per iteration at `depth`, interpolated (or extrapolated
    /// from the nearest segment); `None` without two points.
    pub fn cost_at(&self, depth: usize) -> Option<f64> {
        let p = &self.points;
        if p.len() < 2 {
            return None;
        }
        let d = depth as f64;
        let i = p
            .windows(2)
            .position(|w| d <= w[1].0 as f64)
            .unwrap_or(p.len() - 2);
        let ((d0, t0), (d1, t1)) = (p[i], p[i + 1]);
        let slope = (t1 - t0) / (d1 as f64 - d0 as f64);
        let t = t0 + (d - d0 as f64) * slope;
        (t.is_finite() && t > 0.0).then_some(t)
    }
}

/// The cost curves of both kinds of job.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Calibration {
    /// Training iterations (forward, backward, SGD update).
    pub training: CostCurve,
    /// Inference iterations (forward only).
    pub inference: CostCurve,
}

/// What a replay against a service measured.
#[derive(Debug, Clone)]
pub struct RemoteRun {
    /// Outcomes in trace time (wall time divided by the scale).
    pub run: SimRun,
    /// The trace with each job's iteration time as the service measured it
    /// (mean service time, unscaled) and its P and T as the service planned
    /// them (its LoadGraph reply).
    pub as_run: Vec<TraceJob>,
    /// Per job, in trace order: when it arrived, was admitted (its
    /// LoadGraph answered), got its first reply and ended.
    pub timelines: Vec<JobTimeline>,
    /// Hidden layers given to each job's MLP, in trace order (0 for zoo
    /// models).
    pub depths: Vec<usize>,
    /// The cost lines used.
    pub calibration: Calibration,
}

/// One job's life in a replay, in trace seconds from the replay's start.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct JobTimeline {
    /// Trace job id.
    pub job: u64,
    /// Training or inference.
    pub kind: JobKind,
    /// Its submission.
    pub arrival_s: f64,
    /// Its LoadGraph answered (the session is admitted into a lane).
    pub admitted_s: f64,
    /// Its first Run answered.
    pub first_reply_s: f64,
    /// Its last Run answered.
    pub end_s: f64,
    /// Mean iteration time the service measured (ms of trace time).
    pub iteration_ms: f64,
}

/// A raw DEALER that may have several requests outstanding.
struct Conn {
    socket: zmq::Socket,
    next: u64,
    timeout: Duration,
    job: u64,
    limits: Limits,
}

impl Conn {
    fn connect(
        ctx: &zmq::Context,
        endpoint: &str,
        timeout: Duration,
        job: u64,
    ) -> Result<Conn, RemoteError> {
        let socket = ctx.socket(zmq::DEALER)?;
        socket.set_linger(200)?;
        // The service gives sessions only to connections with an id of
        // their own choosing.
        socket.set_identity(&lanes_adaptor::wire::auth::connection_id())?;
        socket.connect(endpoint)?;
        Ok(Conn {
            socket,
            next: 1,
            timeout,
            job,
            limits: Limits::default(),
        })
    }

    fn send(&mut self, req: &Request) -> Result<u64, RemoteError> {
        let id = self.next;
        self.next += 1;
        self.socket
            .send_multipart(wire::encode_request(id, req)?, 0)?;
        Ok(id)
    }

    /// The next reply; error replies become [`RemoteError::Service`]. The
    /// service's unrequested pings (sent to clients quiet for a second) are
    /// skipped.
    fn recv(&mut self, request: &'static str) -> Result<Envelope<Reply>, RemoteError> {
        // One deadline for the reply: the pings the service sends a quiet
        // client every second must not restart the wait (a reply that never
        // came then waited for ever).
        let deadline = Instant::now() + self.timeout;
        let env = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX);
            if left.is_zero() || self.socket.poll(zmq::POLLIN, ms)? == 0 {
                return Err(RemoteError::Timeout {
                    job: self.job,
                    timeout: self.timeout,
                });
            }
            let frames = self.socket.recv_multipart(0)?;
            let env = wire::decode_reply(&frames, &self.limits)
                .map_err(|e| RemoteError::Decode(e.to_string()))?;
            if !matches!(env.message, Reply::Ping) {
                break env;
            }
        };
        if let Reply::Error(e) = &env.message {
            return Err(RemoteError::Service {
                job: self.job,
                request,
                code: e.code,
                message: e.message.clone(),
            });
        }
        Ok(env)
    }

    fn call(&mut self, req: &Request) -> Result<Reply, RemoteError> {
        let id = self.send(req)?;
        loop {
            let env = self.recv(req.name())?;
            if env.request_id == id {
                return Ok(env.message);
            }
        }
    }

    fn unexpected(&self, expected: &'static str, got: &Reply) -> RemoteError {
        RemoteError::Unexpected {
            job: self.job,
            expected,
            got: got.name(),
        }
    }

    fn status(&mut self) -> Result<wire::StatusReport, RemoteError> {
        match self.call(&Request::Status)? {
            Reply::Status(s) => Ok(s),
            other => Err(self.unexpected("status", &other)),
        }
    }

    /// Opens a session and loads `model` into it.
    fn open(&mut self, spec: SessionSpec, model: &Model) -> Result<SessionId, RemoteError> {
        self.open_planned(spec, model).map(|(s, _, _)| s)
    }

    /// [`Conn::open`], with the P and T the service planned for the graph.
    fn open_planned(
        &mut self,
        spec: SessionSpec,
        model: &Model,
    ) -> Result<(SessionId, u64, u64), RemoteError> {
        let session = match self.call(&Request::OpenSession(spec))? {
            Reply::SessionOpened { session } => session,
            other => return Err(self.unexpected("session_opened", &other)),
        };
        match self.call(&Request::LoadGraph {
            session,
            graph: model.graph.clone(),
            variables: model.vars.clone(),
        })? {
            Reply::GraphLoaded {
                persistent_bytes,
                ephemeral_bytes,
                ..
            } => Ok((session, persistent_bytes, ephemeral_bytes)),
            other => Err(self.unexpected("graph_loaded", &other)),
        }
    }

    /// [`Conn::open`], with when the LoadGraph was sent and when its reply
    /// came.
    fn open_timed(
        &mut self,
        spec: SessionSpec,
        model: &Model,
    ) -> Result<(SessionId, Instant, Instant), RemoteError> {
        let session = match self.call(&Request::OpenSession(spec))? {
            Reply::SessionOpened { session } => session,
            other => return Err(self.unexpected("session_opened", &other)),
        };
        let sent = Instant::now();
        match self.call(&Request::LoadGraph {
            session,
            graph: model.graph.clone(),
            variables: model.vars.clone(),
        })? {
            Reply::GraphLoaded { .. } => Ok((session, sent, Instant::now())),
            other => Err(self.unexpected("graph_loaded", &other)),
        }
    }

    fn run_request(session: SessionId, model: &Model) -> Request {
        Request::Run {
            session,
            feeds: model.feeds.clone(),
            fetches: vec![model.fetch.clone()],
        }
    }

    /// Runs `n` iterations, keeping `pipeline` outstanding.
    fn iterate(
        &mut self,
        session: SessionId,
        model: &Model,
        n: u64,
        pipeline: usize,
    ) -> Result<Option<Instant>, RemoteError> {
        let req = Self::run_request(session, model);
        let mut first = None;
        let mut outstanding = VecDeque::new();
        let (mut sent, mut done) = (0u64, 0u64);
        while done < n {
            while sent < n && outstanding.len() < pipeline.max(1) {
                outstanding.push_back(self.send(&req)?);
                sent += 1;
            }
            let env = self.recv("run")?;
            // Replies to a session's Runs may arrive in any order (the
            // service runs them in order, but its workers answer through
            // separate sockets).
            let at = outstanding.iter().position(|&id| id == env.request_id);
            match (env.message, at) {
                (Reply::RunDone { .. }, Some(at)) => {
                    outstanding.remove(at);
                    done += 1;
                    first = first.or(Some(Instant::now()));
                }
                (Reply::RunDone { .. }, None) => {
                    return Err(RemoteError::Decode(format!(
                        "job {}: a Run reply to request {}, which is not outstanding",
                        self.job, env.request_id
                    )))
                }
                (other, _) => return Err(self.unexpected("run_done", &other)),
            }
        }
        Ok(first)
    }

    /// (iterations, mean service time) the service measured for `session`.
    fn measured(&mut self, session: SessionId) -> Result<(u64, Duration), RemoteError> {
        let s = self.status()?;
        Ok(s.sessions
            .iter()
            .find(|x| x.session == session)
            .map(|x| (x.iterations, Duration::from_micros(x.service_mean_us)))
            .unwrap_or_default())
    }

    fn close(&mut self, session: SessionId) -> Result<(), RemoteError> {
        match self.call(&Request::CloseSession { session })? {
            Reply::SessionClosed { .. } => Ok(()),
            other => Err(self.unexpected("session_closed", &other)),
        }
    }
}

/// A job's graph, initial variables and per-iteration feeds.
#[derive(Debug, Clone)]
struct Model {
    graph: Graph,
    vars: Vec<NamedTensor>,
    feeds: Vec<NamedTensor>,
    fetch: String,
}

fn model(kind: JobKind, depth: usize, cfg: &RemoteConfig, seed: u64) -> Result<Model, RemoteError> {
    const CLASSES: usize = 10;
    let arch = Arch::Mlp {
        inputs: cfg.width,
        hidden: vec![cfg.width; depth.max(1)],
        classes: CLASSES,
    };
    let b = cfg.batch.max(1);
    let n = b * cfg.width;
    let input: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 % 1000) as f32) / 1000.0 - 0.5)
        .collect();
    let input =
        Tensor::from_f32([b, cfg.width], input).map_err(|e| RemoteError::Config(e.to_string()))?;
    let (graph, vars, fetch, mut feeds) = match kind {
        JobKind::Training => {
            let (t, _) = arch.training(b, seed, &Optimizer::sgd(0.01))?;
            let labels: Vec<i64> = (0..b).map(|i| (i % CLASSES) as i64).collect();
            let labels =
                Tensor::from_i64([b], labels).map_err(|e| RemoteError::Config(e.to_string()))?;
            (
                t.graph,
                t.vars,
                t.loss,
                vec![NamedTensor::new("labels", labels)],
            )
        }
        JobKind::Inference => {
            let m = arch.inference(b, seed)?;
            (m.graph, m.vars, m.output, Vec::new())
        }
    };
    feeds.insert(0, NamedTensor::new("input", input));
    Ok(Model {
        graph,
        vars: vars
            .into_iter()
            .map(|(k, v)| NamedTensor::new(k, v))
            .collect(),
        feeds,
        fetch,
    })
}

/// Job `seed`'s session of the zoo model `name`: the training graph (SGD)
/// or the inference graph at `batch`, with deterministic feeds.
fn zoo_model(name: &str, kind: JobKind, batch: usize, seed: u64) -> Result<Model, RemoteError> {
    // The architecture and the range of its integer inputs (labels, ids).
    let (arch, ints) = match name {
        "mlp" => (
            Arch::Mlp {
                inputs: 784,
                hidden: vec![256, 128],
                classes: 10,
            },
            10,
        ),
        "lenet" => (
            Arch::LeNet {
                channels: 1,
                image: 28,
                classes: 10,
            },
            10,
        ),
        "resnet18_cifar" => (Arch::ResNet18Cifar { classes: 10 }, 10),
        "resnet50" => (Arch::ResNet50, 1000),
        "resnet152" => (Arch::ResNet152, 1000),
        "transformer" => (
            Arch::Transformer {
                vocab: 1000,
                seq: 32,
                dim: 128,
                heads: 4,
                ff: 512,
                classes: 10,
            },
            10,
        ),
        other => {
            return Err(RemoteError::Config(format!(
                "unknown zoo model {other:?} (one of {})",
                ZOO_MODELS.join(", ")
            )))
        }
    };
    let batch = batch.max(1);
    let (graph, vars, fetch, inputs) = match kind {
        JobKind::Training => {
            let (t, inputs) = arch.training(batch, seed, &Optimizer::sgd(0.01))?;
            (t.graph, t.vars, t.loss, inputs)
        }
        JobKind::Inference => {
            let m = arch.inference(batch, seed)?;
            (m.graph, m.vars, m.output, m.inputs)
        }
    };
    let feeds = seeded_feeds(&inputs, seed, ints)
        .map_err(|e| RemoteError::Config(e.to_string()))?
        .into_iter()
        .map(|(k, v)| NamedTensor::new(k, v))
        .collect();
    Ok(Model {
        graph,
        vars: vars
            .into_iter()
            .map(|(k, v)| NamedTensor::new(k, v))
            .collect(),
        feeds,
        fetch,
    })
}

/// Total service time the service measured for `session` so far, and its
/// iteration count.
fn service_total(conn: &mut Conn, session: SessionId) -> Result<(u64, f64), RemoteError> {
    let (n, mean) = conn.measured(session)?;
    Ok((n, mean.as_secs_f64() * n as f64))
}

/// Depths [`calibrate`] measures.
pub const CALIBRATION_DEPTHS: [usize; 6] = [1, 4, 16, 48, 128, 400];
/// Rounds of [`calibrate`]; each depth's cost is the median of the rounds.
const ROUNDS: usize = 3;
/// Iterations per depth and round.
const RUNS_PER_ROUND: u64 = 8;

/// Measures the iteration cost of both kinds on the service (which should
/// be otherwise idle) at [`CALIBRATION_DEPTHS`] up to `cfg.max_depth`, one
/// depth at a time: a session of that depth, one warm-up iteration, then
/// [`ROUNDS`] rounds of [`RUNS_PER_ROUND`] iterations keeping
/// `cfg.pipeline` Runs outstanding as the replay does, and the session
/// closed before the next depth's opens; a depth's cost is the median over
/// rounds of the service's measured mean.
///
/// One session at a time: with every depth's session open at once, the
/// deepest one's LoadGraph could wait for room in the service's `--memory`
/// that only the calibration's own idle sessions held, and calibration
/// waited for itself (`--batch 2048 --width 256`).
pub fn calibrate(cfg: &RemoteConfig) -> Result<Calibration, RemoteError> {
    let ctx = zmq::Context::new();
    let mut conn = Conn::connect(&ctx, &cfg.endpoint, cfg.timeout, 0)?;
    let mut curve = |kind| -> Result<CostCurve, RemoteError> {
        let mut points = Vec::new();
        for d in CALIBRATION_DEPTHS {
            if d > cfg.max_depth.max(1) {
                break;
            }
            let m = model(kind, d, cfg, 1)?;
            let spec = match kind {
                JobKind::Training => SessionSpec::training(format!("calibrate-{d}")),
                JobKind::Inference => SessionSpec::inference(format!("calibrate-{d}")),
            };
            let s = conn.open(spec, &m)?;
            conn.iterate(s, &m, 1, 1)?;
            let mut rounds = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                let (n1, t1) = service_total(&mut conn, s)?;
                // Back to back, as in the replay (an idle worker between
                // iterations runs them cold and measures them slower).
                conn.iterate(s, &m, RUNS_PER_ROUND, cfg.pipeline)?;
                let (n2, t2) = service_total(&mut conn, s)?;
                rounds.push((t2 - t1) / n2.saturating_sub(n1).max(1) as f64);
            }
            conn.close(s)?;
            rounds.sort_by(f64::total_cmp);
            points.push((d, rounds[rounds.len() / 2]));
        }
        Ok(CostCurve { points })
    };
    Ok(Calibration {
        training: curve(JobKind::Training)?,
        inference: curve(JobKind::Inference)?,
    })
}

/// The service's policy, as the simulator names it.
pub fn service_policy(endpoint: &str, timeout: Duration) -> Result<&'static str, RemoteError> {
    let ctx = zmq::Context::new();
    let mut conn = Conn::connect(&ctx, endpoint, timeout, 0)?;
    let name = conn.status()?.policy;
    lanes_policies::POLICY_NAMES
        .iter()
        .find(|p| **p == name)
        .copied()
        .ok_or(RemoteError::UnknownPolicy(name))
}

struct Done {
    persistent: u64,
    ephemeral: u64,
    admitted: Duration,
    first: Duration,
    end: Duration,
    iterations: u64,
    service_mean: Duration,
}

/// Replays `trace` against the service at `cfg.endpoint`, whose policy is
/// `policy` (see [`service_policy`]), using `calibration` to size the models.
pub fn replay_remote(
    trace: &[TraceJob],
    policy: &'static str,
    cfg: &RemoteConfig,
    calibration: &Calibration,
) -> Result<RemoteRun, RemoteError> {
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return Err(RemoteError::Config("time scale must be positive".into()));
    }
    let scale = |d: Duration| Duration::from_secs_f64(d.as_secs_f64() * cfg.time_scale);
    let unscale = |d: Duration| Duration::from_secs_f64(d.as_secs_f64() / cfg.time_scale);
    // Models are built before the clock starts.
    let mut depths = Vec::with_capacity(trace.len());
    let mut models = Vec::with_capacity(trace.len());
    for j in trace {
        let fit = match j.kind {
            JobKind::Training => &calibration.training,
            JobKind::Inference => &calibration.inference,
        };
        if let Some(name) = &cfg.zoo {
            depths.push(0);
            models.push(Arc::new(zoo_model(name, j.kind, cfg.batch, j.id)?));
            continue;
        }
        let depth = fit.depth_for(scale(j.iteration), cfg.max_depth);
        depths.push(depth);
        models.push(Arc::new(model(j.kind, depth, cfg, j.id)?));
    }
    let ctx = zmq::Context::new();
    let start = Instant::now();
    let mut handles = Vec::with_capacity(trace.len());
    for (j, m) in trace.iter().zip(models) {
        let (j, ctx, cfg) = (j.clone(), ctx.clone(), cfg.clone());
        let submit = scale(j.submit);
        handles.push((
            j.id,
            thread::spawn(move || -> Result<Done, RemoteError> {
                if let Some(wait) = submit.checked_sub(start.elapsed()) {
                    thread::sleep(wait);
                }
                let mut conn = Conn::connect(&ctx, &cfg.endpoint, cfg.timeout, j.id)?;
                let spec = match j.kind {
                    JobKind::Training => SessionSpec::training(format!("replay-{}", j.id)),
                    JobKind::Inference => SessionSpec::inference(format!("replay-{}", j.id)),
                }
                .with_priority(j.priority)
                .with_expected_iterations(j.iterations);
                let (session, persistent, ephemeral) = conn.open_planned(spec, &m)?;
                let admitted = start.elapsed();
                let first = conn.iterate(session, &m, j.iterations, cfg.pipeline)?;
                let end = start.elapsed();
                let first = first.map_or(end, |f| f.saturating_duration_since(start));
                let (iterations, service_mean) = conn.measured(session)?;
                conn.close(session)?;
                Ok(Done {
                    persistent,
                    ephemeral,
                    admitted,
                    first,
                    end,
                    iterations,
                    service_mean,
                })
            }),
        ));
    }
    let mut outcomes = Vec::with_capacity(trace.len());
    let mut timelines = Vec::with_capacity(trace.len());
    let mut as_run = Vec::with_capacity(trace.len());
    let mut busy = Duration::ZERO;
    let mut first_err = None;
    for ((id, h), j) in handles.into_iter().zip(trace) {
        match h.join() {
            Ok(Ok(d)) => {
                let measured = unscale(d.service_mean);
                busy += measured.saturating_mul(u32::try_from(d.iterations).unwrap_or(u32::MAX));
                outcomes.push(JobOutcome {
                    id: j.id,
                    kind: j.kind,
                    submit: j.submit,
                    admitted: unscale(d.admitted).max(j.submit),
                    lane: 0,
                    finish: unscale(d.end).max(j.submit),
                    service: measured
                        .saturating_mul(u32::try_from(j.iterations).unwrap_or(u32::MAX)),
                });
                timelines.push(JobTimeline {
                    job: j.id,
                    kind: j.kind,
                    arrival_s: j.submit.as_secs_f64(),
                    admitted_s: unscale(d.admitted).as_secs_f64(),
                    first_reply_s: unscale(d.first).as_secs_f64(),
                    end_s: unscale(d.end).as_secs_f64(),
                    iteration_ms: measured.as_secs_f64() * 1e3,
                });
                let mut r = j.clone();
                r.iteration = measured;
                r.persistent_bytes = d.persistent;
                r.ephemeral_bytes = d.ephemeral;
                as_run.push(r);
            }
            Ok(Err(e)) => first_err = first_err.or(Some(e)),
            Err(_) => first_err = first_err.or(Some(RemoteError::Panicked(id))),
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(RemoteRun {
        run: SimRun {
            policy,
            lanes: 1,
            outcomes,
            schedule: Vec::new(),
            busy,
        },
        as_run,
        timelines,
        depths,
        calibration: calibration.clone(),
    })
}

/// What [`measure_idle`] measured on the idle service, in trace time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleMeasure {
    /// Each kind's start-up.
    pub startup: Startup,
    /// The part of the start-up during which the LoadGraph held a worker:
    /// the service's own time for it (its metrics'
    /// `lanes_request_duration_seconds`, arrival at the scheduler to the
    /// reply; nothing else queued on the idle service) when
    /// `RemoteConfig::metrics` is given, else its round trip (which also
    /// counts the graph's transfer): see `load_from_metrics`.
    pub load: Startup,
    /// The LoadGraph's round trip (sent to its reply received).
    pub load_round_trip: Startup,
    /// The part of the start-up after the LoadGraph's reply: the first
    /// Run's trip and its reply's, less its service time.
    pub after_load: Startup,
    /// Whether `load` is the service's own timing (else the round trip).
    pub load_from_metrics: bool,
    /// Each kind's iteration alone: the service's mean over
    /// [`SOLO_RUNS`] Runs after [`SOLO_WARMUP`] more than the first.
    pub solo: Startup,
    /// Each kind's warm-up: the service time of a session's first
    /// `1 + SOLO_WARMUP` Runs beyond as many solo iterations (its first
    /// Runs may run op by op, before its CUDA graph is recorded). A job's
    /// mean iteration alone over `n` iterations is `solo + warmup / n`.
    pub warmup: Startup,
}

/// Runs [`measure_idle`] sends after the first before it times the solo
/// iteration (a session's first iterations may run op by op, before its
/// CUDA graph is recorded).
pub const SOLO_WARMUP: u64 = 4;
/// Runs [`measure_idle`] times for the solo iteration.
pub const SOLO_RUNS: u64 = 10;

/// Measures each kind's start-up and solo iteration on the service (which
/// should be otherwise idle), in trace time (wall time divided by the
/// scale). The start-up is the wall time from sending OpenSession to the
/// first Run's reply, less the service time the service measured for that
/// Run: what a job waits before its iterations count as service (the
/// session's opening, the graph's transfer, compilation and load on the
/// lane's worker, the replies' trips), split into the part before the
/// LoadGraph's reply less the load, the load (the time it holds a worker:
/// the service's own timing with `cfg.metrics`, else its round trip), and
/// the part after its reply. The solo iteration is the service's
/// mean over [`SOLO_RUNS`] Runs after [`SOLO_WARMUP`] more: a job's speed with no lane
/// beside it, which a contention model scales (a job's mean measured
/// during a replay with several lanes already carries the slowdown). Each
/// kind is measured `rounds` times (each a new session of the replay's
/// model: the zoo model, or an MLP of `depth` hidden layers); each figure
/// is the median of the rounds after the first, as the replay's jobs come
/// after the service has seen the model once.
pub fn measure_idle(
    cfg: &RemoteConfig,
    depth: usize,
    rounds: usize,
) -> Result<IdleMeasure, RemoteError> {
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return Err(RemoteError::Config("time scale must be positive".into()));
    }
    let ctx = zmq::Context::new();
    let mut conn = Conn::connect(&ctx, &cfg.endpoint, cfg.timeout, 0)?;
    let trace_time = |wall: f64| Duration::from_secs_f64(wall.max(0.0) / cfg.time_scale);
    let mut measure = |kind| -> Result<Idle, RemoteError> {
        let m = match &cfg.zoo {
            Some(name) => zoo_model(name, kind, cfg.batch, 1)?,
            None => model(kind, depth, cfg, 1)?,
        };
        let mut seen = Vec::with_capacity(rounds.max(1));
        for round in 0..rounds.max(1) {
            let spec = match kind {
                JobKind::Training => SessionSpec::training(format!("startup-{round}")),
                JobKind::Inference => SessionSpec::inference(format!("startup-{round}")),
            };
            let t0 = Instant::now();
            let (s, load_sent, loaded) = conn.open_timed(spec, &m)?;
            let first = conn.iterate(s, &m, 1, 1)?.unwrap_or_else(Instant::now);
            let wall = first.saturating_duration_since(t0);
            let (_, service) = conn.measured(s)?;
            let round_trip = loaded.saturating_duration_since(load_sent);
            let worker = match &cfg.metrics {
                Some(addr) => Some(load_seconds(addr, s, cfg.timeout)?),
                None => None,
            };
            // A session's first iterations may run op by op before its
            // CUDA graph is recorded: the solo time is taken after them,
            // from the difference of the service's totals.
            conn.iterate(s, &m, SOLO_WARMUP, cfg.pipeline)?;
            let (n0, mean0) = conn.measured(s)?;
            conn.iterate(s, &m, SOLO_RUNS, cfg.pipeline)?;
            let (n, mean) = conn.measured(s)?;
            conn.close(s)?;
            let total = |n: u64, mean: Duration| mean.as_secs_f64() * n as f64;
            let later =
                (total(n, mean) - total(n0, mean0)).max(0.0) / n.saturating_sub(n0).max(1) as f64;
            let warmup = total(n0, mean0) - n0 as f64 * later;
            // The worker's time is within the round trip.
            let load = worker.map_or(round_trip.as_secs_f64(), |w| {
                w.min(round_trip.as_secs_f64())
            });
            seen.push(Idle {
                startup: trace_time(wall.saturating_sub(service).as_secs_f64()),
                solo: trace_time(later),
                warmup: trace_time(warmup),
                load: trace_time(load),
                round_trip: trace_time(round_trip.as_secs_f64()),
                after: trace_time(
                    first
                        .saturating_duration_since(loaded)
                        .saturating_sub(service)
                        .as_secs_f64(),
                ),
            });
        }
        Ok(Idle::median(&seen))
    };
    let t = measure(JobKind::Training)?;
    let i = measure(JobKind::Inference)?;
    let both = |f: fn(&Idle) -> Duration| Startup {
        training: f(&t),
        inference: f(&i),
    };
    Ok(IdleMeasure {
        startup: both(|x| x.startup),
        load: both(|x| x.load),
        load_round_trip: both(|x| x.round_trip),
        after_load: both(|x| x.after),
        load_from_metrics: cfg.metrics.is_some(),
        solo: both(|x| x.solo),
        warmup: both(|x| x.warmup),
    })
}

/// One kind's figures in [`measure_idle`] (trace time).
#[derive(Debug, Default, Clone, Copy)]
struct Idle {
    startup: Duration,
    solo: Duration,
    warmup: Duration,
    load: Duration,
    round_trip: Duration,
    after: Duration,
}

impl Idle {
    /// Each figure's median over the rounds after the first (the replay's
    /// jobs come after the service has seen the model once); the first
    /// round's when there is only one.
    fn median(rounds: &[Idle]) -> Idle {
        let counted = if rounds.len() > 1 {
            &rounds[1..]
        } else {
            rounds
        };
        let med = |f: fn(&Idle) -> Duration| {
            let mut v: Vec<Duration> = counted.iter().map(f).collect();
            v.sort_unstable();
            match v.len() {
                0 => Duration::ZERO,
                n if n % 2 == 1 => v[n / 2],
                n => (v[n / 2 - 1] + v[n / 2]) / 2,
            }
        };
        Idle {
            startup: med(|x| x.startup),
            solo: med(|x| x.solo),
            warmup: med(|x| x.warmup),
            load: med(|x| x.load),
            round_trip: med(|x| x.round_trip),
            after: med(|x| x.after),
        }
    }
}

/// The service's own time for `session`'s LoadGraph, in wall seconds:
/// the sum of its `lanes_request_duration_seconds` series for
/// `load_graph`, read from the metrics endpoint at `addr` (`host:port`,
/// or `http://host:port/metrics`).
pub fn load_seconds(addr: &str, session: SessionId, timeout: Duration) -> Result<f64, RemoteError> {
    let text = scrape(addr, timeout)?;
    let key = format!(
        "lanes_request_duration_seconds_sum{{session=\"{}\",request=\"load_graph\"}}",
        session.0
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .ok_or_else(|| RemoteError::Metrics {
            addr: addr.to_string(),
            reason: format!("no load_graph time for session {}", session.0),
        })
}

/// `GET /metrics` from `addr` (`host:port` or a URL).
fn scrape(addr: &str, timeout: Duration) -> Result<String, RemoteError> {
    let fail = |reason: String| RemoteError::Metrics {
        addr: addr.to_string(),
        reason,
    };
    let url = if addr.starts_with("http://") {
        addr.to_string()
    } else {
        format!("http://{addr}/metrics")
    };
    let r = minreq::get(&url)
        .with_timeout(timeout.as_secs().max(1))
        .send()
        .map_err(|e| fail(e.to_string()))?;
    if r.status_code != 200 {
        return Err(fail(format!(
            "answered {} {}",
            r.status_code, r.reason_phrase
        )));
    }
    r.as_str()
        .map(str::to_string)
        .map_err(|e| fail(e.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Under a `--memory` with room for the deepest calibration session
    /// alone and not beside the shallower ones, calibration still
    /// finishes: each depth's session is closed before the next opens
    /// (all open at once, the deepest one's LoadGraph waited for memory
    /// that only the calibration's own idle sessions held, and the
    /// service's pings kept the client's timeout from ever firing).
    #[test]
    fn calibration_does_not_wait_for_its_own_sessions() {
        let mut cfg = RemoteConfig {
            width: 64,
            batch: 64,
            max_depth: 48,
            timeout: Duration::from_secs(30),
            ..RemoteConfig::new("")
        };
        let size = |kind, d| {
            let m = model(kind, d, &cfg, 1).unwrap();
            let vg =
                lanes_adaptor::validate(m.graph, &lanes_adaptor::GraphLimits::default()).unwrap();
            let (p, t) = crate::server::admission_sizes("cpu", &vg, false).unwrap();
            p + t
        };
        let deepest = size(JobKind::Training, 48).max(size(JobKind::Inference, 48));
        let service = crate::server::start(crate::server::ServerConfig {
            endpoint: "tcp://127.0.0.1:*".into(),
            workers: 1,
            memory_bytes: Some(deepest),
            ..crate::server::ServerConfig::default()
        })
        .unwrap();
        cfg.endpoint = service.endpoint().to_string();
        let cal = calibrate(&cfg).unwrap();
        let depths: Vec<usize> = cal.training.points.iter().map(|p| p.0).collect();
        assert_eq!(depths, [1, 4, 16, 48]);
        assert_eq!(cal.inference.points.len(), 4);
        service.shutdown().unwrap();
    }

    #[test]
    fn depth_follows_the_measured_curve_and_stays_in_range() {
        let c = CostCurve {
            points: vec![(1, 0.001), (11, 0.006), (21, 0.016)],
        };
        assert_eq!(c.depth_for(Duration::from_micros(3500), 400), 6);
        assert_eq!(c.depth_for(Duration::from_millis(11), 400), 16);
        // Below the first point: extrapolated, at least 1.
        assert_eq!(c.depth_for(Duration::from_micros(100), 400), 1);
        // Beyond the last: extrapolated from the last segment, then capped.
        assert_eq!(c.depth_for(Duration::from_millis(26), 400), 31);
        assert_eq!(c.depth_for(Duration::from_secs(10), 400), 400);
        let flat = CostCurve {
            points: vec![(1, 0.001), (4, 0.001)],
        };
        assert_eq!(flat.depth_for(Duration::from_millis(5), 400), 1);
        assert_eq!(
            CostCurve { points: vec![] }.depth_for(Duration::from_millis(5), 9),
            1
        );
    }

    /// Serves `reply` to each of `n` connections, after reading the request.
    fn canned(reply: &'static str, n: usize) -> String {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        thread::spawn(move || {
            for _ in 0..n {
                let (mut c, _) = l.accept().unwrap();
                let mut buf = [0u8; 1024];
                let _ = c.read(&mut buf);
                c.write_all(reply.as_bytes()).unwrap();
            }
        });
        addr
    }

    #[test]
    fn the_load_time_is_read_from_the_metrics_text() {
        let t = Duration::from_secs(5);
        let text = "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n\
            lanes_request_duration_seconds_sum{session=\"15\",request=\"load_graph\"} 9.0\n\
            lanes_request_duration_seconds_sum{session=\"5\",request=\"run\"} 1.5\n\
            lanes_request_duration_seconds_sum{session=\"5\",request=\"load_graph\"} 0.0625\n";
        let addr = canned(text, 3);
        assert_eq!(load_seconds(&addr, SessionId(5), t).unwrap(), 0.0625);
        let url = format!("http://{addr}/metrics");
        assert_eq!(load_seconds(&url, SessionId(15), t).unwrap(), 9.0);
        let err = load_seconds(&addr, SessionId(6), t).unwrap_err();
        assert!(
            err.to_string().contains("no load_graph time for session 6"),
            "{err}"
        );
        let addr = canned("HTTP/1.0 404 Not Found\r\n\r\nsee /metrics\n", 1);
        let err = load_seconds(&addr, SessionId(5), t).unwrap_err();
        assert!(err.to_string().contains("404"), "{err}");
    }

    #[test]
    fn cost_at_inverts_depth_for() {
        let c = CostCurve {
            points: vec![(1, 0.001), (11, 0.006), (21, 0.016)],
        };
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-12);
        assert!(close(c.cost_at(6), 0.0035), "{:?}", c.cost_at(6));
        assert!(close(c.cost_at(16), 0.011));
        assert!(close(c.cost_at(31), 0.026), "beyond the last point");
        for d in [2, 7, 13, 20, 40] {
            let t = c.cost_at(d).unwrap();
            assert_eq!(c.depth_for(Duration::from_secs_f64(t), 400), d);
        }
        assert_eq!(
            CostCurve {
                points: vec![(1, 0.001)]
            }
            .cost_at(3),
            None
        );
    }
}
