//! Per-job state: the spec the job opened its session with, its validated
//! program, and its counters. A session is driven by one worker at a time
//! (the dispatcher never hands two requests of one session to two workers),
//! so its methods take `&mut self` and need no inner locking.
//!
//! Each session has its own variable table: no name or handle of one
//! session resolves in another. Dropping a session frees its program and
//! variables (its memory is reclaimed).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use lanes_adaptor::wire::shm::SharedFeed;
use lanes_adaptor::wire::{BufferPool, ErrorCode, NamedTensor, SessionId, SessionSpec};
use lanes_adaptor::{GraphError, Tensor, TensorType, ValidGraph};

use crate::compile::{self, PlanError};
use crate::exec::cpu::CpuMemory;
use crate::exec::gate::{Armed, Gate};
pub use crate::exec::Backend;
use crate::exec::{ExecError, FetchInto, Fetched, HostFeed};
use crate::exec::{GpuShare, Program};
use crate::lanes::{Admission, AdmitError, JobId, LaneTurn, Lease, SharedLanes};
use crate::residency::Strategy;

mod load;
mod preempt;
mod slo;
pub use load::LoadTimes;
pub use preempt::YieldRequest;

/// Why a session request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    #[error("invalid graph: {0}")]
    Graph(#[from] GraphError),
    #[error("session {session} has no graph loaded")]
    NoGraph { session: SessionId },
    #[error("session {session} already has a graph loaded")]
    AlreadyLoaded { session: SessionId },
    #[error("feed `{name}`: {reason}")]
    Feed { name: String, reason: String },
    #[error("fetch `{key}` names no output of the graph")]
    Fetch { key: String },
    /// The fetched outputs (repeats counted) take more bytes than the job
    /// was admitted with: the reply would cost the service more memory than
    /// the job is allowed.
    #[error(
        "the fetches take {bytes} bytes, more than the {limit} bytes (P + T) the job was admitted with"
    )]
    FetchTooLarge { bytes: u64, limit: u64 },
    #[error("variable `{name}`: {reason}")]
    Variable { name: String, reason: String },
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("memory plan: {0}")]
    Plan(#[from] PlanError),
    #[error("memory: {0}")]
    Memory(#[from] AdmitError),
    /// An evicted job waited this long for memory to come back into.
    #[error(
        "session {session} waited {waited_ms} ms for memory to be brought back into; try again"
    )]
    NoRoom { session: SessionId, waited_ms: u64 },
}

impl SessionError {
    /// The stable wire code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            SessionError::Graph(_) => ErrorCode::InvalidGraph,
            SessionError::NoGraph { .. } => ErrorCode::NoGraph,
            SessionError::AlreadyLoaded { .. } => ErrorCode::GraphAlreadyLoaded,
            SessionError::Feed { .. } => ErrorCode::BadFeed,
            SessionError::Fetch { .. } => ErrorCode::UnknownFetch,
            SessionError::FetchTooLarge { .. } => ErrorCode::FetchTooLarge,
            SessionError::Variable { .. } => ErrorCode::BadVariable,
            SessionError::Exec(e) => exec_code(e),
            SessionError::Plan(PlanError::TensorTooLarge { .. } | PlanError::TotalOverflow)
            | SessionError::Memory(AdmitError::TooLarge { .. }) => ErrorCode::MemoryTooLarge,
            SessionError::Plan(PlanError::UnknownFetch { .. }) => ErrorCode::UnknownFetch,
            SessionError::Plan(_) | SessionError::Memory(_) => ErrorCode::Internal,
            SessionError::NoRoom { .. } => ErrorCode::Overloaded,
        }
    }
}

/// The stable wire code for an executor error.
pub fn exec_code(e: &ExecError) -> ErrorCode {
    match e {
        ExecError::MissingFeed { .. }
        | ExecError::UnknownFeed { .. }
        | ExecError::FeedType { .. } => ErrorCode::BadFeed,
        ExecError::UnknownFetch { .. } | ExecError::FetchParts { .. } => ErrorCode::UnknownFetch,
        ExecError::MissingVariable { .. } | ExecError::VariableType { .. } => {
            ErrorCode::BadVariable
        }
        ExecError::Op { .. } | ExecError::DType { .. } | ExecError::UnsupportedDType { .. } => {
            ErrorCode::Exec
        }
        ExecError::NoDevice { .. } => ErrorCode::NoDevice,
    }
}

/// How long an evicted job's Run waits for memory before it is answered
/// `Overloaded`.
pub const READMIT_TIMEOUT: Duration = Duration::from_secs(60);

/// A loaded graph: the program and what requests are checked against.
#[derive(Debug)]
struct Loaded {
    program: Program,
    placeholders: BTreeMap<String, TensorType>,
    variables: BTreeMap<String, TensorType>,
    nodes: u64,
}

/// One job's session on the service.
#[derive(Debug)]
pub struct Session {
    id: SessionId,
    spec: SessionSpec,
    loaded: Option<Loaded>,
    /// Runs that were iterations (every Run but an entry that updates
    /// nothing: an evaluation between steps).
    iterations: u64,
    /// Whether the last Run asked for ran the job's step rather than an
    /// entry that updates nothing (true until its part is known; the
    /// worker leaves out Runs answered with an error anyway).
    last_run_iteration: bool,
    /// The service's lanes, when it was started with `--memory`.
    lanes: Option<SharedLanes>,
    /// This job's claim on the lanes: its memory goes when the session goes.
    lease: Option<Lease>,
    /// (P, T) of the loaded graph.
    memory: Option<(u64, u64)>,
    /// The executor LoadGraph builds.
    backend: Backend,
    /// Evictions and returns so far (shared with the socket thread's
    /// Status, which reads them while the session runs).
    switches: SwitchCounts,
    /// Where the feeds' storage goes after a run (the service decodes the
    /// next request's tensors into it).
    pool: Option<BufferPool>,
    /// How the job's GPU work shares the device (its streams' urgency, and
    /// whether urgent lanes may run beside it).
    share: GpuShare,
    /// Keeps the device's gate armed while this urgent job is loaded
    /// (yielding jobs then run their iterations in segments).
    armed: Option<Armed>,
    /// Whether its Runs close the gate (an urgent job's latency objective
    /// and its recent Runs, `slo.rs`).
    slo: slo::SloGate,
    /// Its place in the lanes' admission queue when it has to wait (the
    /// policy's `admission_rank`) and the lanes it may share (its
    /// `lane_class`).
    ask: crate::lanes::Ask,
    /// Where the loaded graph's placeholders are published for the
    /// service's decoder (Runs' feeds are checked before being copied).
    feed_types: Option<FeedTypes>,
    /// Where the last LoadGraph's time went.
    load_times: Option<LoadTimes>,
    /// Set by the socket thread when this training job should give its
    /// memory up at its next iteration boundary (`preempt.rs`).
    yield_request: YieldRequest,
    /// Times it did.
    yields: u64,
}

/// A session's evictions and returns, shared: the session counts, the
/// socket thread's Status reads them at any time.
#[derive(Debug, Clone, Default)]
pub struct SwitchCounts(std::sync::Arc<[std::sync::atomic::AtomicU64; 2]>);

impl SwitchCounts {
    /// One more eviction, or (`returned`) one more return.
    fn count(&self, returned: bool) {
        self.0[usize::from(returned)].fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// (evictions, returns).
    pub fn get(&self) -> (u64, u64) {
        let n = |i: usize| self.0[i].load(std::sync::atomic::Ordering::Acquire);
        (n(0), n(1))
    }
}

/// A session's placeholders by name, set once its graph is loaded.
pub type FeedTypes = std::sync::Arc<std::sync::OnceLock<BTreeMap<String, TensorType>>>;

/// The (P, T) a job of `valid` asks the lanes for on `backend`: the memory
/// plan's, and on the GPU T also holds the cuDNN and cuBLAS workspaces
/// (they live in the lane's shared ephemeral block).
pub fn admission_sizes(
    backend: Backend,
    valid: &ValidGraph,
    plan: &compile::MemoryPlan,
) -> Result<(u64, u64), SessionError> {
    match backend {
        Backend::Cuda => Ok((
            plan.persistent,
            crate::exec::cuda::ephemeral_need(valid, plan.ephemeral)?,
        )),
        Backend::Cpu => Ok((plan.persistent, plan.ephemeral)),
    }
}

/// A Run's feeds as the service decoded them: tensors from the message's
/// frames, or views of the job's shared segment (read where the job wrote
/// them, by the executor).
#[derive(Debug)]
pub enum RunFeeds {
    Frames(Vec<NamedTensor>),
    Shared(Vec<SharedFeed>),
}

impl From<Vec<NamedTensor>> for RunFeeds {
    fn from(feeds: Vec<NamedTensor>) -> Self {
        RunFeeds::Frames(feeds)
    }
}

fn ty_mismatch(expected: &TensorType, got: &TensorType) -> String {
    format!("expected {expected}, got {got}")
}

impl Session {
    pub fn new(id: SessionId, spec: SessionSpec) -> Self {
        Session {
            id,
            spec,
            loaded: None,
            iterations: 0,
            last_run_iteration: true,
            lanes: None,
            lease: None,
            memory: None,
            backend: Backend::Cpu,
            switches: SwitchCounts::default(),
            pool: None,
            share: GpuShare::default(),
            armed: None,
            slo: slo::SloGate::default(),
            ask: Default::default(),
            feed_types: None,
            load_times: None,
            yield_request: YieldRequest::default(),
            yields: 0,
        }
    }

    /// Publishes the loaded graph's placeholders in `cell`.
    pub fn with_feed_types(mut self, cell: FeedTypes) -> Self {
        self.feed_types = Some(cell);
        self
    }

    /// Waits for memory at `ask.rank` in the lanes' admission queue
    /// (smaller first) and shares a lane only with jobs of `ask.class` (see
    /// `lanes_policies::Policy::admission_rank` and `lane_class`).
    pub fn with_ask(mut self, ask: crate::lanes::Ask) -> Self {
        self.ask = ask;
        self
    }

    /// The job's latency objective (`SessionSpec::slo_ms`): while its
    /// recent Runs leave room under it, its Runs leave the device's gate
    /// open (`slo.rs`).
    pub fn with_slo(mut self, target: Option<std::time::Duration>) -> Self {
        self.slo = slo::SloGate::new(target);
        self
    }

    /// How the job's GPU work shares the device (see [`GpuShare`]).
    pub fn with_share(mut self, share: GpuShare) -> Self {
        self.share = share;
        self
    }

    /// Gives the feeds' storage to `pool` after each run.
    pub fn with_pool(mut self, pool: Option<BufferPool>) -> Self {
        self.pool = pool;
        self
    }

    /// Runs this session's graph on `backend` (CPU unless the service found a GPU).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Admits this session's graph into `lanes` when it is loaded.
    pub fn with_lanes(mut self, lanes: Option<SharedLanes>) -> Self {
        self.lanes = lanes;
        self
    }

    /// (P, T) of the loaded graph.
    pub fn memory(&self) -> Option<(u64, u64)> {
        self.memory
    }

    /// Why the job waits for memory, while it does.
    pub fn waiting(&self) -> Option<String> {
        let (lanes, _) = (self.lanes.as_ref()?, self.lease.as_ref()?);
        let job = JobId(self.id.0);
        lanes
            .snapshot()
            .queue
            .into_iter()
            .find(|q| q.job == job)
            .map(|q| q.reason.to_string())
    }

    /// False while the job waits in the admission queue (its Runs wait).
    pub fn is_admitted(&self) -> bool {
        match (&self.lanes, &self.lease) {
            (Some(_), Some(l)) => l.placement().is_some(),
            _ => true,
        }
    }

    pub fn id(&self) -> SessionId {
        self.id
    }
    pub fn spec(&self) -> &SessionSpec {
        &self.spec
    }
    pub fn is_loaded(&self) -> bool {
        self.loaded.is_some()
    }
    /// Whether the job's persistent memory is on the device (true before a
    /// graph is loaded: there is nothing to bring back).
    pub fn is_resident(&self) -> bool {
        self.loaded.as_ref().is_none_or(|l| l.program.is_resident())
    }

    /// Device bytes the job's program holds alone (its lane's shared
    /// ephemeral memory not counted); `None` on the CPU or before LoadGraph.
    pub fn own_device_bytes(&self) -> Option<u64> {
        self.loaded.as_ref()?.program.own_device_bytes()
    }

    /// (evictions, returns) so far.
    pub fn switches(&self) -> (u64, u64) {
        self.switches.get()
    }

    /// The session's counts of evictions and returns, readable without
    /// its lock (a return is counted before its Run's reply is sent).
    pub fn switch_counts(&self) -> SwitchCounts {
        self.switches.clone()
    }

    /// Moves the job's persistent memory to host memory and gives its lane
    /// memory back (admitting waiting jobs); the next Run brings it back,
    /// pipelined. Returns the bytes copied out (0 for an inference job whose
    /// host copy is current).
    pub fn evict(&mut self) -> Result<u64, SessionError> {
        Ok(self.evict_with(true)?.unwrap_or(0))
    }

    /// [`Session::evict`] without waiting: `None` (nothing done) when the
    /// job's variables are in the lanes' reservation and its lane's turn
    /// cannot start now (a lane-mate runs an iteration), so the socket
    /// thread never waits for an iteration; it tries again later.
    pub fn try_evict(&mut self) -> Result<Option<u64>, SessionError> {
        self.evict_with(false)
    }

    fn evict_with(&mut self, wait: bool) -> Result<Option<u64>, SessionError> {
        let session = self.id;
        let loaded = self
            .loaded
            .as_mut()
            .ok_or(SessionError::NoGraph { session })?;
        if !loaded.program.is_resident() {
            return Ok(Some(0));
        }
        let copied = if loaded.program.needs_memory() {
            // The variables are in the lanes' reservation: read them out in
            // the job's turn.
            let mut turn = match (&self.lease, wait) {
                (Some(l), true) => l.turn(),
                (Some(l), false) => match l.try_turn() {
                    Some(t) => Some(t),
                    None => return Ok(None),
                },
                (None, _) => None,
            };
            let mem = turn.as_mut().and_then(LaneTurn::memory);
            let loaded = self
                .loaded
                .as_mut()
                .ok_or(SessionError::NoGraph { session })?;
            loaded
                .program
                .evict_in(mem.as_ref().map(|m| &*m.persistent))?
        } else {
            loaded.program.evict()?
        };
        self.lease = None; // releases the lane memory
        self.switches.count(false);
        tracing::info!(session = %session, copied, "evicted to host memory");
        Ok(Some(copied))
    }

    /// For an evicted job about to run: asks the lanes for its memory again
    /// without waiting (admitted now, or queued: the dispatcher holds its
    /// Runs back until admitted). True when it now waits for memory.
    pub fn prepare_return(&mut self) -> Result<bool, SessionError> {
        if self.is_resident() || self.lease.is_some() {
            return Ok(false);
        }
        let (Some(lanes), Some((p, t))) = (&self.lanes, self.memory) else {
            return Ok(false);
        };
        let (lease, admission) = lanes.admit_asking(JobId(self.id.0), p, t, self.ask)?;
        let queued = matches!(admission, Admission::Queued { .. });
        if let Admission::Queued { reason, .. } = &admission {
            tracing::info!(session = %self.id, %reason, "evicted job waits for memory");
        }
        self.lease = Some(lease);
        Ok(queued)
    }

    /// Takes lane memory again for an evicted job, waiting in the admission
    /// queue up to [`READMIT_TIMEOUT`].
    fn readmit(&mut self) -> Result<(), SessionError> {
        self.prepare_return()?;
        let Some(lease) = &self.lease else {
            return Ok(());
        };
        if lease.placement().is_none() {
            let t0 = std::time::Instant::now();
            if lease.wait(READMIT_TIMEOUT).is_none() {
                // Leave the queue: the next Run asks again.
                self.lease = None;
                return Err(SessionError::NoRoom {
                    session: self.id,
                    waited_ms: t0.elapsed().as_millis() as u64,
                });
            }
        }
        Ok(())
    }

    /// Before a Run whose fetches make the program need more ephemeral
    /// memory than the job was admitted with (on the GPU: outputs the
    /// memory plan lets die early, which a re-plan keeps to the end), asks
    /// the lanes again with the larger T: the program is evicted and its
    /// memory given back, and the Run re-admits it (waiting if need be), so
    /// the safety condition holds for what the lanes really hold. A T that
    /// could never fit is refused (`MemoryTooLarge`) and nothing changes.
    fn grow_for(&mut self, fetches: &[String]) -> Result<(), SessionError> {
        let (Some(lanes), Some((p, t))) = (&self.lanes, self.memory) else {
            return Ok(());
        };
        let lanes = lanes.clone();
        let session = self.id;
        let Some(need) = self.loaded()?.program.ephemeral_need_for(fetches)? else {
            return Ok(());
        };
        if need <= t {
            return Ok(());
        }
        // Refused as admission would refuse it, before anything changes.
        lanes.sizes(JobId(session.0), p, need)?;
        tracing::info!(
            %session,
            before = t,
            after = need,
            "the fetches need more ephemeral memory: admitted again"
        );
        self.evict()?;
        self.lease = None;
        self.memory = Some((p, need));
        Ok(())
    }

    /// The fetched outputs' bytes (each fetch counted, repeats included:
    /// the reply carries one copy per fetch) must fit in the memory the job
    /// was admitted with, P + T: so a Run's reply never costs the service
    /// more host memory than the job's own share.
    fn check_fetch_bytes(&mut self, fetches: &[String]) -> Result<(), SessionError> {
        let Some((p, t)) = self.memory else {
            return Ok(());
        };
        let limit = p.saturating_add(t);
        let graph = self.loaded()?.program.graph().graph();
        let bytes = fetches
            .iter()
            .filter_map(|k| graph.outlet_type(graph.resolve(k)?))
            .map(|ty| ty.checked_bytes().map_or(u64::MAX, |b| b as u64))
            .fold(0u64, u64::saturating_add);
        if bytes > limit {
            return Err(SessionError::FetchTooLarge { bytes, limit });
        }
        Ok(())
    }

    /// Iterations run so far (an entry's Run that updates nothing, such
    /// as an evaluation, is not one).
    pub fn iterations(&self) -> u64 {
        self.iterations
    }

    /// Whether the last Run asked for was one of the job's iterations
    /// rather than an entry that updates nothing (the scheduler's
    /// progress and iteration time count only iterations).
    pub fn last_run_was_iteration(&self) -> bool {
        self.last_run_iteration
    }

    fn loaded(&mut self) -> Result<&mut Loaded, SessionError> {
        let session = self.id;
        self.loaded
            .as_mut()
            .ok_or(SessionError::NoGraph { session })
    }

    /// Runs one iteration after checking feeds and fetches against the graph.
    pub fn run(
        &mut self,
        feeds: impl Into<RunFeeds>,
        fetches: &[String],
    ) -> Result<Vec<Tensor>, SessionError> {
        self.run_to(feeds, fetches, None).map(Fetched::into_tensors)
    }

    /// [`Session::run`] whose fetched values are written into `into` when
    /// it takes them (a reply slot: see [`FetchInto`]).
    pub fn run_to(
        &mut self,
        feeds: impl Into<RunFeeds>,
        fetches: &[String],
        into: Option<&mut dyn FetchInto>,
    ) -> Result<Fetched, SessionError> {
        self.last_run_iteration = true;
        match feeds.into() {
            RunFeeds::Frames(feeds) => {
                let fed =
                    self.check_feeds(feeds.into_iter().map(|f| (f.name, f.tensor)), fetches)?;
                let out = self.run_fed(&fed, fetches, into);
                // The feeds' storage is decoded into again.
                if let Some(pool) = &self.pool {
                    fed.into_values().for_each(|t| pool.give(t));
                }
                out
            }
            RunFeeds::Shared(feeds) => {
                let fed =
                    self.check_feeds(feeds.into_iter().map(|f| (f.name.clone(), f)), fetches)?;
                self.run_fed(&fed, fetches, into)
            }
        }
    }

    /// `feeds` by name, each a placeholder of the graph of its type, none
    /// twice, none missing that the part of the graph `fetches` run reads
    /// (the main iteration, or an entry: `lanes_adaptor::Entry`).
    fn check_feeds<F: HostFeed>(
        &mut self,
        feeds: impl Iterator<Item = (String, F)>,
        fetches: &[String],
    ) -> Result<BTreeMap<String, F>, SessionError> {
        let loaded = self.loaded()?;
        let mut fed = BTreeMap::new();
        for (name, f) in feeds {
            let Some(ty) = loaded.placeholders.get(&name) else {
                return Err(SessionError::Feed {
                    name,
                    reason: "the graph has no such placeholder".into(),
                });
            };
            if *ty != f.ty() {
                return Err(SessionError::Feed {
                    reason: ty_mismatch(ty, &f.ty()),
                    name,
                });
            }
            if fed.contains_key(&name) {
                return Err(SessionError::Feed {
                    name,
                    reason: "fed twice".into(),
                });
            }
            fed.insert(name, f);
        }
        let graph = loaded.program.graph();
        let part = crate::exec::part_of(graph, fetches)?;
        let iteration = part == lanes_adaptor::Part::Main || graph.part_updates(part);
        if let Some((_, missing, _)) = graph
            .graph()
            .placeholders()
            .find(|(id, name, _)| !fed.contains_key(*name) && graph.runs(part, *id))
        {
            return Err(SessionError::Feed {
                name: missing.to_string(),
                reason: "placeholder not fed".into(),
            });
        }
        self.last_run_iteration = iteration;
        Ok(fed)
    }

    /// Runs one iteration on checked feeds.
    fn run_fed<F: HostFeed>(
        &mut self,
        fed: &BTreeMap<String, F>,
        fetches: &[String],
        into: Option<&mut dyn FetchInto>,
    ) -> Result<Fetched, SessionError> {
        let loaded = self.loaded()?;
        let graph = loaded.program.graph().graph();
        if let Some(bad) = fetches.iter().find(|k| graph.resolve(k).is_none()) {
            return Err(SessionError::Fetch { key: bad.clone() });
        }
        self.grow_for(fetches)?;
        self.check_fetch_bytes(fetches)?;
        let loaded = self.loaded()?;
        let returning = !loaded.program.is_resident();
        if returning {
            self.readmit()?;
            self.switches.count(true);
        }
        let session = self.id;
        // A lane runs one iteration at a time (its jobs share its ephemeral
        // memory on the GPU): hold the lane's turn for this one.
        let mut turn = self.lease.as_ref().and_then(Lease::turn);
        let key = turn.as_ref().map(LaneTurn::key);
        let loaded = self.loaded()?;
        loaded.program.bind_lane(key)?;
        // An urgent job closes the device's gate while its iteration runs
        // (after taking its lane's turn: a yielding job holding the turn
        // must be able to finish its iteration).
        let inside = self
            .share
            .urgent_gate()
            .filter(|_| self.slo.closes())
            .map(Gate::enter);
        let loaded = self.loaded()?;
        // With a reservation (CPU), the job's memory in it for this turn.
        let mem = turn.as_mut().and_then(LaneTurn::memory).map(|m| CpuMemory {
            persistent: m.persistent,
            arena: m.arena,
        });
        let t0 = std::time::Instant::now();
        let (out, report) = loaded
            .program
            .run_in(mem, fed, fetches, Strategy::Pipelined, into)?;
        drop(inside);
        self.slo.record(t0.elapsed());
        drop(turn);
        if let Some(r) = report {
            tracing::debug!(
                %session,
                ms = t0.elapsed().as_secs_f64() * 1e3,
                groups = r.groups,
                replayed = r.replayed,
                predicted_ms = r.predicted * 1e3,
                "brought back"
            );
        }
        self.iterations += u64::from(self.last_run_iteration);
        Ok(out)
    }

    /// Current values of the named variables (all when `names` is empty).
    pub fn read_variables(&mut self, names: &[String]) -> Result<Vec<NamedTensor>, SessionError> {
        let loaded = self.loaded()?;
        if let Some(bad) = names.iter().find(|n| !loaded.variables.contains_key(*n)) {
            return Err(SessionError::Variable {
                name: bad.clone(),
                reason: "the graph has no such variable".into(),
            });
        }
        let values = if loaded.program.needs_memory() {
            let mut turn = self.lease.as_ref().and_then(Lease::turn);
            let mem = turn.as_mut().and_then(LaneTurn::memory);
            self.loaded()?
                .program
                .read_variables_in(mem.as_ref().map(|m| &*m.persistent), names)?
        } else {
            loaded.program.read_variables(names)?
        };
        Ok(values
            .into_iter()
            .map(|(n, t)| NamedTensor::new(n, t))
            .collect())
    }

    /// Overwrites variables; each must exist and keep its type. Nothing is
    /// written unless every value is acceptable.
    pub fn write_variables(&mut self, values: Vec<NamedTensor>) -> Result<u64, SessionError> {
        let loaded = self.loaded()?;
        let mut seen = BTreeSet::new();
        for v in &values {
            let Some(ty) = loaded.variables.get(&v.name) else {
                return Err(SessionError::Variable {
                    name: v.name.clone(),
                    reason: "the graph has no such variable".into(),
                });
            };
            if *ty != v.tensor.ty() {
                return Err(SessionError::Variable {
                    name: v.name.clone(),
                    reason: ty_mismatch(ty, &v.tensor.ty()),
                });
            }
            if !seen.insert(v.name.as_str()) {
                return Err(SessionError::Variable {
                    name: v.name.clone(),
                    reason: "given twice".into(),
                });
            }
        }
        let count = values.len() as u64;
        let values = values.into_iter().map(|v| (v.name, v.tensor)).collect();
        if loaded.program.needs_memory() {
            let mut turn = self.lease.as_ref().and_then(Lease::turn);
            let mut mem = turn.as_mut().and_then(LaneTurn::memory);
            self.loaded()?
                .program
                .write_variables_in(mem.as_mut().map(|m| &mut *m.persistent), values)?;
        } else {
            loaded.program.write_variables(values)?;
        }
        Ok(count)
    }

    /// Nodes of the loaded graph (0 before LoadGraph).
    pub fn nodes(&self) -> u64 {
        self.loaded.as_ref().map_or(0, |l| l.nodes)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
