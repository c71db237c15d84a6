//! Loaded models: the table the routes read, and each model's thread,
//! which owns a connection to the service and one inference session per
//! batch size seen.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use lanes_adaptor::onnx::{import, ImportOptions, OnnxModel};
use lanes_adaptor::wire::{Reply, Request};
use lanes_adaptor::{
    AuthKey, Client, ClientError, ClientOptions, DType, ErrorCode, FeedBuffers, SessionId,
    SessionSpec, Tensor,
};

use super::batch::{self, FeedsOf};
use super::control::Override;
use super::error::ApiError;
use super::repository::{
    plain_name, DynamicBatching, ModelEntry, Repository, DEFAULT_MAX_BATCH, MODEL_FILE,
};
use super::stats::{RequestTimes, Stats};
use super::tensors::Feed;

/// One input or output as the protocol describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    /// Without the batch dimension when the model batches.
    pub dims: Vec<usize>,
}

/// What the protocol says of a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub name: String,
    pub version: String,
    /// 0: the model does not batch (its inputs' shapes are fixed).
    pub max_batch_size: usize,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    pub batching: Option<DynamicBatching>,
}

impl ModelInfo {
    /// A tensor's shape as the metadata gives it (-1 for the batch).
    pub fn shape(&self, spec: &TensorSpec) -> Vec<i64> {
        let dims = spec.dims.iter().map(|&d| d as i64);
        if self.max_batch_size > 0 {
            std::iter::once(-1).chain(dims).collect()
        } else {
            dims.collect()
        }
    }
    pub fn shape_text(&self, spec: &TensorSpec) -> String {
        format!("{:?}", self.shape(spec))
    }
    fn names(specs: &[TensorSpec]) -> String {
        specs
            .iter()
            .map(|s| format!("`{}`", s.name))
            .collect::<Vec<_>>()
            .join(", ")
    }
    pub fn input_names(&self) -> String {
        Self::names(&self.inputs)
    }
    pub fn output_names(&self) -> String {
        Self::names(&self.outputs)
    }
}

/// How the models' threads reach the service.
#[derive(Debug, Clone)]
pub struct Connect {
    pub endpoint: String,
    pub auth_key: Option<AuthKey>,
    pub run_timeout: Duration,
}

/// One inference request on its way to a model's thread.
#[derive(Debug)]
pub struct Job {
    pub rows: usize,
    /// One feed per model input, in the model's order.
    pub feeds: Vec<(String, Feed)>,
    pub arrived: Instant,
    /// The model's outputs, in the model's order.
    pub reply: tokio::sync::oneshot::Sender<Result<Vec<Tensor>, ApiError>>,
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    pub info: ModelInfo,
    pub stats: Arc<Stats>,
    tx: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Model {
    /// Queues a request on the model's thread; a model stopped meanwhile
    /// (unloaded, or replaced by a reload) hands the request back.
    pub fn submit(&self, job: Job) -> Result<(), (ApiError, Job)> {
        let unloaded = || ApiError::Unavailable(format!("model `{}` is unloaded", self.info.name));
        match lock(&self.tx).as_ref() {
            Some(tx) => tx.send(job).map_err(|e| (unloaded(), e.into_inner())),
            None => Err((unloaded(), job)),
        }
    }

    /// Stops the model's thread once the requests queued are served; its
    /// sessions close. With `wait`, returns when they have.
    fn stop(&self, wait: bool) {
        lock(&self.tx).take();
        if let Some(t) = lock(&self.thread).take() {
            if wait {
                let _ = t.join();
            }
        }
    }
}

/// A model's state in the repository index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelState {
    Ready,
    Unavailable,
}

impl std::fmt::Display for ModelState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModelState::Ready => "READY",
            ModelState::Unavailable => "UNAVAILABLE",
        })
    }
}

/// An entry of the repository index.
#[derive(Debug, Clone)]
pub struct IndexEntry {
    pub name: String,
    pub version: Option<String>,
    pub state: ModelState,
    pub reason: Option<String>,
}

#[derive(Debug)]
enum Slot {
    Ready(Arc<Model>),
    Failed {
        version: Option<String>,
        reason: String,
    },
    Unloaded {
        version: Option<String>,
    },
}

/// The models: loaded, failed or unloaded.
#[derive(Debug)]
pub struct Models {
    connect: Connect,
    repo: Mutex<Option<Repository>>,
    table: Mutex<BTreeMap<String, Slot>>,
    /// One load or unload at a time.
    loading: Mutex<()>,
}

impl Models {
    pub fn new(connect: Connect) -> Models {
        Models {
            connect,
            repo: Mutex::new(None),
            table: Mutex::new(BTreeMap::new()),
            loading: Mutex::new(()),
        }
    }

    pub fn set_repository(&self, repo: Repository) {
        *lock(&self.repo) = Some(repo);
    }

    /// Loads every model of the repository; failures are kept in the
    /// index with their reasons.
    pub fn load_all(&self) {
        let names = match lock(&self.repo).as_ref().map(|r| r.names()) {
            Some(Ok(n)) => n,
            Some(Err(e)) => {
                tracing::error!(error = %e, "cannot list the model repository");
                return;
            }
            None => return,
        };
        for name in names {
            // A failure is kept in the index, with its reason.
            let _ = self.load(&name, Override::default());
        }
    }

    /// The model `name` if it is loaded; `version` (if given) must be its.
    pub fn get(&self, name: &str, version: Option<&str>) -> Result<Arc<Model>, ApiError> {
        let table = lock(&self.table);
        match table.get(name) {
            Some(Slot::Ready(m)) => match version {
                Some(v) if v != m.info.version => Err(ApiError::NotFound(format!(
                    "model `{name}` has no version {v} loaded (version {} is)",
                    m.info.version
                ))),
                _ => Ok(Arc::clone(m)),
            },
            Some(Slot::Failed { reason, .. }) => Err(ApiError::Unavailable(format!(
                "model `{name}` is not available: {reason}"
            ))),
            Some(Slot::Unloaded { .. }) => {
                Err(ApiError::Unavailable(format!("model `{name}` is unloaded")))
            }
            None => Err(ApiError::NotFound(format!("unknown model `{name}`"))),
        }
    }

    /// Every model loaded now.
    pub fn ready(&self) -> Vec<Arc<Model>> {
        lock(&self.table)
            .values()
            .filter_map(|s| match s {
                Slot::Ready(m) => Some(Arc::clone(m)),
                _ => None,
            })
            .collect()
    }

    /// The repository's models and those known from loads, with states.
    pub fn index(&self) -> Vec<IndexEntry> {
        let mut names: Vec<String> = match lock(&self.repo).as_ref().map(|r| r.names()) {
            Some(Ok(n)) => n,
            _ => Vec::new(),
        };
        let table = lock(&self.table);
        for n in table.keys() {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let (version, state, reason) = match table.get(&name) {
                    Some(Slot::Ready(m)) => (Some(m.info.version.clone()), ModelState::Ready, None),
                    Some(Slot::Failed { version, reason }) => (
                        version.clone(),
                        ModelState::Unavailable,
                        Some(reason.clone()),
                    ),
                    Some(Slot::Unloaded { version }) => (
                        version.clone(),
                        ModelState::Unavailable,
                        Some("unloaded".to_string()),
                    ),
                    None => (
                        None,
                        ModelState::Unavailable,
                        Some("not loaded".to_string()),
                    ),
                };
                IndexEntry {
                    name,
                    version,
                    state,
                    reason,
                }
            })
            .collect()
    }

    /// Loads (or reloads) `name` from the repository, or from the file
    /// and configuration a load request sent (`over`). A failed reload
    /// keeps the model loaded before; a successful one replaces it.
    pub fn load(&self, name: &str, over: Override) -> Result<(), ApiError> {
        let _one = lock(&self.loading);
        // A failed load from a request's file is kept in the index only
        // for a name known already (no entry per name a caller makes up).
        let keep_failure = over.file.is_none() || lock(&self.table).contains_key(name);
        let (entry, bytes) = match over.file {
            Some((version, bytes)) => {
                if !plain_name(name) {
                    return Err(ApiError::BadRequest(format!(
                        "`{name}` cannot name a model (one path component, not starting with `.`)"
                    )));
                }
                let entry = ModelEntry {
                    name: name.to_string(),
                    version,
                    file: format!("file:{version}/{MODEL_FILE}").into(),
                    config: over.config.unwrap_or_default(),
                };
                (entry, bytes)
            }
            None => {
                let mut entry = self.entry(name)?;
                let bytes = std::fs::read(&entry.file).map_err(|e| {
                    let reason = format!("cannot read `{}`: {e}", entry.file.display());
                    self.failed(name, Some(entry.version.to_string()), reason)
                })?;
                if let Some(c) = over.config {
                    entry.config = c;
                }
                (entry, bytes)
            }
        };
        let version = Some(entry.version.to_string());
        let model = match spawn(&self.connect, entry, bytes) {
            Ok(m) => Arc::new(m),
            Err(reason) if keep_failure => return Err(self.failed(name, version, reason)),
            Err(reason) => return Err(load_failed(name, &reason)),
        };
        let old = lock(&self.table).insert(name.to_string(), Slot::Ready(model));
        if let Some(Slot::Ready(old)) = old {
            old.stop(true);
        }
        Ok(())
    }

    /// The repository's entry for `name`.
    fn entry(&self, name: &str) -> Result<ModelEntry, ApiError> {
        let repo = lock(&self.repo);
        let repo = repo
            .as_ref()
            .ok_or_else(|| ApiError::NotFound("no model repository (--model-repository)".into()))?;
        match repo.entry(name) {
            Ok(e) => Ok(e),
            Err(super::RepositoryError::NoModel(_)) => Err(ApiError::NotFound(format!(
                "no model `{name}` in the repository"
            ))),
            Err(e) => Err(self.failed(name, None, e.to_string())),
        }
    }

    fn failed(&self, name: &str, version: Option<String>, reason: String) -> ApiError {
        let mut table = lock(&self.table);
        if !matches!(table.get(name), Some(Slot::Ready(_))) {
            table.insert(
                name.to_string(),
                Slot::Failed {
                    version,
                    reason: reason.clone(),
                },
            );
        }
        load_failed(name, &reason)
    }

    /// Unloads `name`: requests queued are served, later ones refused.
    pub fn unload(&self, name: &str) -> Result<(), ApiError> {
        let _one = lock(&self.loading);
        let slot = {
            let mut table = lock(&self.table);
            let version = match table.get(name) {
                None => return Err(ApiError::NotFound(format!("unknown model `{name}`"))),
                Some(Slot::Ready(m)) => Some(m.info.version.clone()),
                Some(Slot::Failed { version, .. } | Slot::Unloaded { version }) => version.clone(),
            };
            table.insert(name.to_string(), Slot::Unloaded { version })
        };
        if let Some(Slot::Ready(m)) = slot {
            m.stop(true);
        }
        Ok(())
    }

    /// Stops every model's thread without waiting for it (the service
    /// may have stopped already; its connection's end closes the
    /// sessions).
    pub fn unload_all(&self) {
        let models: Vec<Arc<Model>> = self.ready();
        lock(&self.table).clear();
        for m in models {
            m.stop(false);
        }
    }
}

fn load_failed(name: &str, reason: &str) -> ApiError {
    ApiError::BadRequest(format!("failed to load model `{name}`: {reason}"))
}

/// Starts a model's thread and waits until its first session is loaded.
fn spawn(connect: &Connect, entry: ModelEntry, bytes: Vec<u8>) -> Result<Model, String> {
    let (tx, rx) = crossbeam_channel::unbounded::<Job>();
    let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
    let connect = connect.clone();
    let stats = Arc::new(Stats::default());
    let thread_stats = Arc::clone(&stats);
    let thread = std::thread::Builder::new()
        .name(format!("oip-{}", entry.name))
        .spawn(move || match Worker::start(&connect, &entry, bytes) {
            Ok(mut w) => {
                let _ = ready_tx.send(Ok(w.info.clone()));
                w.serve(&rx, &thread_stats);
                w.close();
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .map_err(|e| format!("cannot start the model's thread: {e}"))?;
    let info = match ready_rx.recv() {
        Ok(r) => r,
        Err(_) => Err("the model's thread ended while loading".to_string()),
    };
    match info {
        Ok(info) => Ok(Model {
            info,
            stats,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        }),
        Err(e) => {
            let _ = thread.join();
            Err(e)
        }
    }
}

/// A model's thread: its connection and sessions.
struct Worker {
    info: ModelInfo,
    client: Client,
    bytes: Vec<u8>,
    /// Sessions by batch size (1 for a model that does not batch).
    sessions: BTreeMap<usize, SessionId>,
    /// Each session's feed buffers, made on its first Run and written
    /// by every later one (so the requests' values land in memory
    /// mapped once).
    buffers: BTreeMap<usize, FeedBuffers>,
    /// Reply slots larger than the default that sessions' outputs wanted.
    reply_bytes: BTreeMap<usize, usize>,
    /// Batch sizes whose feeds cannot go through feed buffers (the
    /// service refused the shared segment): their Runs carry the feeds.
    unshared: std::collections::BTreeSet<usize>,
    fetch: Vec<String>,
}

fn imported(bytes: &[u8], batch: usize) -> Result<OnnxModel, String> {
    import(
        bytes,
        &ImportOptions {
            batch,
            ..ImportOptions::default()
        },
    )
    .map_err(|e| format!("the model file does not import ({}): {e}", e.kind()))
}

/// Whether every input and output of `one` (imported at batch 1) and `two`
/// (at batch 2) has the batch as its first dimension.
fn batches(one: &OnnxModel, two: &OnnxModel) -> bool {
    let first = |m: &OnnxModel, want: usize| {
        m.inputs
            .iter()
            .chain(&m.outputs)
            .all(|(_, t)| t.shape.dims().first() == Some(&want))
    };
    first(one, 1) && first(two, 2) && !one.inputs.is_empty()
}

fn specs(list: &[(String, lanes_adaptor::TensorType)], batched: bool) -> Vec<TensorSpec> {
    list.iter()
        .map(|(name, t)| TensorSpec {
            name: name.clone(),
            dtype: t.dtype,
            dims: if batched {
                t.shape.dims().get(1..).unwrap_or_default().to_vec()
            } else {
                t.shape.dims().to_vec()
            },
        })
        .collect()
}

impl Worker {
    fn start(connect: &Connect, entry: &ModelEntry, bytes: Vec<u8>) -> Result<Worker, String> {
        let one = imported(&bytes, 1)?;
        let max_batch_size = match entry.config.max_batch_size {
            Some(0) => 0,
            Some(n) => {
                if !batches(&one, &imported(&bytes, 2)?) {
                    return Err(format!(
                        "config.pbtxt gives max_batch_size {n}, but the model's inputs and outputs do not all have a batch (symbolic first) dimension"
                    ));
                }
                n
            }
            None => match imported(&bytes, 2) {
                Ok(two) if batches(&one, &two) => DEFAULT_MAX_BATCH,
                _ => 0,
            },
        };
        let batched = max_batch_size > 0;
        let info = ModelInfo {
            name: entry.name.clone(),
            version: entry.version.to_string(),
            max_batch_size,
            inputs: specs(&one.inputs, batched),
            outputs: specs(&one.outputs, batched),
            batching: entry.config.dynamic_batching.clone().filter(|_| batched),
        };
        let options = ClientOptions {
            timeout: connect.run_timeout,
            name: format!("lanes-oip/{}", entry.name),
            auth_key: connect.auth_key.clone(),
            ..ClientOptions::default()
        };
        let client = Client::connect_with(&connect.endpoint, options)
            .map_err(|e| format!("cannot connect to the service: {e}"))?;
        let fetch = one.outputs.iter().map(|(n, _)| n.clone()).collect();
        let mut w = Worker {
            info,
            client,
            bytes,
            sessions: BTreeMap::new(),
            buffers: BTreeMap::new(),
            reply_bytes: BTreeMap::new(),
            unshared: std::collections::BTreeSet::new(),
            fetch,
        };
        w.open(1, Some(one))?;
        Ok(w)
    }

    /// Opens and loads the session for `batch` rows.
    fn open(&mut self, batch: usize, model: Option<OnnxModel>) -> Result<SessionId, String> {
        let m = match model {
            Some(m) => m,
            None => imported(&self.bytes, batch)?,
        };
        let spec = SessionSpec::inference(format!("oip:{}:b{batch}", self.info.name));
        let req = Request::OpenSession(spec);
        let id = match self.client.request(&req) {
            Ok(Reply::SessionOpened { session }) => session,
            Ok(other) => return Err(format!("unexpected reply {} to OpenSession", other.name())),
            Err(e) => return Err(format!("cannot open a session: {e}")),
        };
        if let Err(e) = self.client.load_in(id, &m.graph, m.vars) {
            let _ = self.client.close_in(id);
            return Err(format!("the service refused the model: {e}"));
        }
        self.sessions.insert(batch, id);
        Ok(id)
    }

    /// Runs the requests' feeds (`feeds_of`, of `batch` rows together)
    /// once; a session the service has reclaimed (idle past
    /// `--idle-timeout`) is opened again. Also how long opening a session
    /// for `batch` took, if one was opened.
    fn run(
        &mut self,
        batch: usize,
        feeds_of: &FeedsOf,
    ) -> Result<(Vec<Tensor>, Duration), ApiError> {
        let mut opening = Duration::ZERO;
        let name = self.info.name.clone();
        for attempt in 0..2 {
            let id = match self.sessions.get(&batch) {
                Some(&id) => id,
                None => {
                    let t = Instant::now();
                    let id = self.open(batch, None).map_err(|e| {
                        ApiError::Internal(format!("model `{name}` at batch {batch}: {e}"))
                    })?;
                    opening += t.elapsed();
                    id
                }
            };
            let shared = self.run_shared(batch, id, feeds_of);
            let through_buffers = shared.is_some();
            let result = match shared {
                Some(r) => r,
                None => {
                    let feeds = batch::join(feeds_of)
                        .map_err(|e| ApiError::Internal(format!("model `{name}`: {e}")))?;
                    let fetch: Vec<&str> = self.fetch.iter().map(String::as_str).collect();
                    self.client.run_in(id, feeds, &fetch)
                }
            };
            match result {
                Ok(out) => return Ok((out, opening)),
                // A reclaimed session's segment is detached with it: a Run
                // from its buffers is refused as SharedMemory, checked
                // before the session is.
                Err(e)
                    if attempt == 0
                        && (e.code() == Some(ErrorCode::UnknownSession)
                            || (through_buffers && e.code() == Some(ErrorCode::SharedMemory))) =>
                {
                    self.sessions.remove(&batch);
                    self.buffers.remove(&batch);
                    // Closed in case it was not reclaimed after all.
                    let _ = self.client.close_in(id);
                }
                Err(e) => return Err(ApiError::from_client(&name, &e)),
            }
        }
        Err(ApiError::Internal(format!(
            "model `{name}`: the session was reclaimed twice"
        )))
    }

    /// Runs the feeds through session `id`'s feed buffers: each request's
    /// values copied once, from the request body into the shared segment
    /// the service reads; the outputs come back through its reply slot.
    /// `None` where the batch size's feeds cannot go that way.
    fn run_shared(
        &mut self,
        batch: usize,
        id: SessionId,
        feeds_of: &FeedsOf,
    ) -> Option<Result<Vec<Tensor>, ClientError>> {
        if self.unshared.contains(&batch) {
            return None;
        }
        let buffers = match self.buffers.entry(batch) {
            std::collections::btree_map::Entry::Occupied(b) => b.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                let types = batch::feed_types(&self.info, batch);
                let list: Vec<(&str, lanes_adaptor::TensorType)> =
                    types.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
                let reply = self
                    .reply_bytes
                    .get(&batch)
                    .copied()
                    .unwrap_or(lanes_adaptor::client::DEFAULT_REPLY_BYTES);
                match self.client.feed_buffers_with_reply_in(id, &list, reply) {
                    Ok(b) => v.insert(b),
                    Err(ClientError::NoSharedMemory { reason }) => {
                        tracing::warn!(
                            model = %self.info.name, batch, %reason,
                            "no feed buffers: this batch size's Runs carry their feeds"
                        );
                        self.unshared.insert(batch);
                        return None;
                    }
                    Err(e) => return Some(Err(e)),
                }
            }
        };
        if let Err(reason) = batch::fill(buffers, feeds_of) {
            return Some(Err(ClientError::FeedBuffer { reason }));
        }
        let fetch: Vec<&str> = self.fetch.iter().map(String::as_str).collect();
        let out = self.client.run_buffers_in(buffers, &fetch);
        if let Some(wanted) = buffers.reply_wanted() {
            // Outputs larger than the slot came through the socket: the
            // next Run's buffers get a slot that holds them.
            self.reply_bytes.insert(batch, wanted);
            self.buffers.remove(&batch);
        }
        Some(out)
    }

    /// Serves requests until the channel closes.
    fn serve(&mut self, rx: &Receiver<Job>, stats: &Stats) {
        let mut held: Option<Job> = None;
        loop {
            let first = match held.take() {
                Some(j) => j,
                None => match rx.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                },
            };
            let group = match &self.info.batching {
                Some(b) => {
                    let (group, rest) = batch::gather(first, rx, b, self.info.max_batch_size);
                    held = rest;
                    group
                }
                None => vec![first],
            };
            self.serve_group(group, stats);
        }
    }

    fn serve_group(&mut self, group: Vec<Job>, stats: &Stats) {
        let start = Instant::now();
        let rows: usize = group.iter().map(|j| j.rows).sum();
        let (feeds_of, parts) = batch::parts_of(group);
        let result = self.run(rows, &feeds_of);
        drop(feeds_of);
        let took = start.elapsed();
        let result = result.and_then(|(out, opening)| {
            batch::split(out, &parts, &self.info.name).map(|p| (p, opening))
        });
        match result {
            Ok((per_request, opening)) => {
                // Counted before anyone is answered: a caller that reads
                // the statistics after its answer sees its request.
                let times: Vec<(usize, RequestTimes)> = parts
                    .iter()
                    .map(|part| {
                        let t = RequestTimes {
                            queue: start.saturating_duration_since(part.arrived),
                            input: opening,
                            infer: took.saturating_sub(opening),
                            total: part.arrived.elapsed(),
                        };
                        (part.rows, t)
                    })
                    .collect();
                stats.record_run(rows, &times, took.saturating_sub(opening));
                for (part, out) in parts.into_iter().zip(per_request) {
                    let _ = part.reply.send(Ok(out));
                }
            }
            Err(e) => {
                for part in parts {
                    stats.record_failure(part.arrived.elapsed());
                    let _ = part.reply.send(Err(e.clone()));
                }
            }
        }
    }

    fn close(mut self) {
        self.buffers.clear();
        for (_, id) in std::mem::take(&mut self.sessions) {
            let _ = self.client.close_in(id);
        }
    }
}
