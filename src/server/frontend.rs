//! The socket thread: ROUTER socket, session table, idle reaping.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lanes_adaptor::wire::shm::{AttachedSegment, FdDesk, SegmentLookup};
use lanes_adaptor::wire::{self, BufferPool, ErrorCode, Reply, SessionId, SessionSpec};

use super::auth::Gate;
use super::decoder::{Decoder, DECODED};
use super::dispatch::{Dispatcher, Work, WorkItem};
use super::policy_queue::PolicyQueue;
use super::worker::{self, REPLIES};
use super::zap::{Zap, ZAP_DOMAIN};
use super::{ServerConfig, ServerError};
use crate::session::Session;

mod bells;
mod connections;
mod pressure;
mod requests;
mod segments;
mod shutdown;
mod slo;
mod status;

/// Longest job name accepted.
const MAX_NAME_BYTES: usize = 256;
/// Messages handled per socket per loop turn, so replies and reaping keep
/// flowing under a flood of requests.
const BATCH: usize = 256;
/// How long the loop sleeps in poll when idle (bounds shutdown latency).
const POLL_MS: i64 = 50;
/// How often clients whose sessions were quiet that long are pinged: a
/// client that is gone (its connection closed, or silent past the
/// heartbeat timeout) is noticed at the next ping and its sessions are
/// reclaimed (within about [`PING_EVERY`] + [`HEARTBEAT_TIMEOUT_MS`]).
const PING_EVERY: Duration = Duration::from_secs(1);
/// ZeroMQ heartbeats on the service's connections (ZMTP PING/PONG, answered
/// by the peer's I/O thread even while its application is busy): a
/// connection with no traffic for this long is closed.
const HEARTBEAT_IVL_MS: i32 = 1000;
const HEARTBEAT_TIMEOUT_MS: i32 = 3000;
/// Messages ZeroMQ holds per connection before the socket thread reads
/// them (`ZMQ_RCVHWM`); beyond, it stops reading that connection (the
/// sender waits), so a flooding peer costs at most this many messages of
/// buffering.
pub(crate) const RECV_HWM: i32 = 8;
/// Replies (and pings) ZeroMQ holds per connection beyond its requests in
/// flight (`ZMQ_SNDHWM` is `max_requests_per_client` + this): a client
/// that does not read its replies has further ones dropped.
pub(crate) const SEND_HWM_EXTRA: usize = 16;
/// How often the socket thread hands the metrics (`--metrics`) its view.
const METRICS_EVERY: Duration = Duration::from_millis(500);

/// One open session as the socket thread sees it.
#[derive(Debug)]
struct Entry {
    /// Routing id of the connection that opened it; only it may use it.
    owner: Vec<u8>,
    /// The peer that connection is from (see `ServerConfig::max_sessions_per_peer`).
    origin: String,
    spec: SessionSpec,
    state: Arc<Mutex<Session>>,
    last_seen: Instant,
    /// Last values read from the session while it was not running.
    loaded: bool,
    iterations: u64,
    resident: bool,
    /// The session's evictions and returns (read at any time).
    switches: crate::session::SwitchCounts,
    /// Shared-memory segments its Runs may carry feeds in, by the client's
    /// segment id; unmapped when the session goes.
    segments: HashMap<u32, Arc<AttachedSegment>>,
    /// Its graph's placeholders once loaded: Runs' feeds are checked
    /// against them before being copied.
    feed_types: crate::session::FeedTypes,
    /// Its Runs' count against its `slo_ms`, when it stated one.
    slo: Option<slo::SloTrack>,
    /// Asks its job (training) to give its memory up at its next iteration
    /// boundary (`pressure.rs`).
    yields: crate::session::YieldRequest,
}

/// Largest message a connection that has not authenticated may send (a
/// Hello or an Authenticate, one frame).
const HANDSHAKE_BYTES: usize = 4096;

/// Most shared-memory segments one session may attach.
const MAX_SEGMENTS_PER_SESSION: usize = 8;

/// The segments of the sessions a connection owns, for the decoder.
struct PeerSegments<'a> {
    sessions: &'a HashMap<SessionId, Entry>,
    peer: &'a [u8],
}

impl SegmentLookup for PeerSegments<'_> {
    fn segment(&self, session: SessionId, segment: u32) -> Option<&Arc<AttachedSegment>> {
        let e = self.sessions.get(&session)?;
        if e.owner != self.peer {
            return None;
        }
        e.segments.get(&segment)
    }

    fn feed_types(
        &self,
        session: SessionId,
    ) -> Option<&BTreeMap<String, lanes_adaptor::TensorType>> {
        let e = self.sessions.get(&session)?;
        if e.owner != self.peer {
            return None;
        }
        e.feed_types.get()
    }
}

struct Frontend {
    config: ServerConfig,
    router: zmq::Socket,
    pull: zmq::Socket,
    dispatcher: Arc<Dispatcher>,
    /// Storage of finished runs' feeds, decoded into again.
    pool: Option<BufferPool>,
    sessions: HashMap<SessionId, Entry>,
    next_session: u64,
    started: Instant,
    stop: Arc<AtomicBool>,
    /// Lanes of the `--memory` reservation, if one was given.
    lanes: Option<crate::lanes::SharedLanes>,
    /// The device memory behind them (GPU); released when the service
    /// stops.
    _reservation: Option<crate::exec::cuda::DeviceReservation>,
    /// Where local jobs hand over their shared-memory segments'
    /// descriptors (`None` with `--no-shared-memory`, or where it could not
    /// be bound: jobs then send feeds through the socket).
    desk: Option<FdDesk>,
    /// The address space of the segments' mappings, per connection and in
    /// all (`segments.rs`).
    mapped: segments::MappedSpace,
    /// Warnings about bad messages, at most one a second.
    bad_messages: Throttle,
    /// Warnings about replies dropped for clients that do not read them.
    dropped_replies: Throttle,
    /// Which connections have authenticated, when the service
    /// authenticates its peers (`--auth-key-file`).
    gate: Option<Gate>,
    /// Admits connections at their ZeroMQ handshake when the service
    /// authenticates its peers (`zap.rs`).
    zap: Option<Zap>,
    /// Keeps lower-urgency GPU work off the device while urgent Runs run
    /// (`exec::gate`; under `priority` with stream priorities, unless
    /// `--no-gate`).
    device_gate: Option<Arc<crate::exec::gate::Gate>>,
    /// Warnings about connections refused at their handshake.
    refused_connections: Throttle,
    /// Decodes large requests off this thread (`decoder.rs`); `decoded`
    /// is where it wakes this thread.
    decoder: Decoder,
    decoded: zmq::Socket,
    /// Peers with a request at the decoder, and their later messages,
    /// waiting behind it undecoded (a peer's requests keep their order).
    decoding: HashSet<Vec<u8>>,
    held: HashMap<Vec<u8>, VecDeque<(Vec<zmq::Message>, Instant)>>,
    /// Doorbells of busy-polling clients' feed buffers, learned from the
    /// Runs that name them (see `wire::shm::Doorbell`).
    bells: bells::Bells,
    /// The peer address of the OpenSession or Hello being handled
    /// (ZeroMQ's `Peer-Address` of its message).
    opening_from: String,
    /// Gives memory back to the system after sessions go (trim.rs).
    trim: Option<super::trim::Trimmer>,
    workers: Vec<JoinHandle<Result<(), zmq::Error>>>,
    /// Once stopping: when the grace period ends (`shutdown.rs`).
    stopping: Option<Instant>,
    /// How long the request being handled took to decode (from its
    /// arrival), for a LoadGraph's time breakdown.
    decode_took: Duration,
    /// The training job asked to yield its memory at its next iteration
    /// boundary, if one is (`pressure.rs`).
    asked: Option<SessionId>,
}

/// Binds the sockets and starts the workers and the socket thread.
pub(super) fn spawn(
    config: ServerConfig,
    stop: Arc<AtomicBool>,
) -> Result<(String, JoinHandle<Result<(), ServerError>>), ServerError> {
    let ctx = zmq::Context::new();
    // Before the ROUTER draws the first id it will hand out.
    connections::seed_assigned_ids();
    let router = ctx.socket(zmq::ROUTER)?;
    router.set_linger(500)?;
    // With a key, a connection is admitted at its handshake only with a
    // token made with the key (the ZAP handler is bound first): a peer
    // without it cannot send a single message.
    let gate = config.auth_key.clone().map(Gate::new);
    let zap = match gate {
        Some(_) => {
            let zap = Zap::bind(&ctx)?;
            router.set_plain_server(true)?;
            router.set_zap_domain(ZAP_DOMAIN)?;
            Some(zap)
        }
        None => None,
    };
    // Sending to a peer that is gone fails (EHOSTUNREACH) instead of being
    // dropped silently: that is how a dead client is noticed.
    router.set_router_mandatory(true)?;
    router.set_heartbeat_ivl(HEARTBEAT_IVL_MS)?;
    router.set_heartbeat_timeout(HEARTBEAT_TIMEOUT_MS)?;
    router.set_rcvhwm(RECV_HWM)?;
    let send_hwm = config
        .max_requests_per_client
        .saturating_add(SEND_HWM_EXTRA);
    router.set_sndhwm(i32::try_from(send_hwm).unwrap_or(i32::MAX))?;
    // Every frame a peer sends, ZeroMQ's handshake commands included, is
    // at most `wire::CHUNK_BYTES`: libzmq drops a connection that announces
    // a larger one before allocating it. Requests' parts larger than that
    // come in several frames (`wire::frames`), so a peer without the key
    // can make the service hold about one such frame per connection.
    let cap = i64::try_from(wire::CHUNK_BYTES).unwrap_or(i64::MAX);
    router.set_maxmsgsize(cap)?;
    router
        .bind(&config.endpoint)
        .map_err(|source| ServerError::Bind {
            endpoint: config.endpoint.clone(),
            source,
        })?;
    let endpoint = router
        .get_last_endpoint()?
        .unwrap_or_else(|_| config.endpoint.clone());
    let pull = ctx.socket(zmq::PULL)?;
    pull.bind(REPLIES)?;

    let dispatcher = Dispatcher::new(Box::new(PolicyQueue::of(config.policy)));
    dispatcher.busy_poll(config.busy_poll);
    if !config.busy_poll.is_zero() {
        // CUDA workers wait for their iterations without sleeping as long.
        crate::exec::cuda::set_wait_spin(config.busy_poll);
    }
    // Loading graphs never takes the last worker from the Runs.
    dispatcher.limit_loads(config.workers.saturating_sub(1));
    let (lanes, reservation) = match config.memory_bytes {
        Some(bytes) => {
            // Admission under the safety condition, the queue, the lanes'
            // turns; on the GPU the device reservation (see
            // `super::lanes_for`).
            let (l, r) = super::lanes_for(
                bytes,
                config.max_lanes,
                super::backend_of(&config.device),
                config.reserve,
            )?;
            dispatcher.gate_on(l.clone());
            (Some(l), r)
        }
        None => (None, None),
    };
    let graph_limits = config.limits.graph_limits();
    let mut workers = Vec::new();
    for i in 0..config.workers.max(1) {
        let ctx = ctx.clone();
        let d = Arc::clone(&dispatcher);
        let metrics = config.metrics.clone();
        workers.push(
            std::thread::Builder::new()
                .name(format!("lanes-worker-{i}"))
                .spawn(move || worker::run(ctx, d, graph_limits, metrics))?,
        );
    }
    let pool = (config.feed_pool_bytes > 0).then(|| BufferPool::new(config.feed_pool_bytes));
    let decoded = ctx.socket(zmq::PULL)?;
    decoded.bind(DECODED)?;
    let decoder = Decoder::start(&ctx, config.limits, pool.clone())?;
    let desk = if config.shared_memory {
        FdDesk::bind()
            .map_err(|e| tracing::warn!(error = %e, "no shared-memory desk; feeds go through the socket"))
            .ok()
    } else {
        None
    };
    if gate.is_some() {
        tracing::info!("peers must authenticate (pre-shared key; traffic is not encrypted)");
    }
    let config_shared = (config.max_shared_per_client, config.max_shared);
    let device_gate = config.gate.map(crate::exec::gate::Gate::new);
    if let (Some(g), Some(m)) = (&device_gate, &config.metrics) {
        m.watch_gate(Arc::clone(g));
    }
    let fe = Frontend {
        pool,
        config,
        router,
        pull,
        dispatcher,
        sessions: HashMap::new(),
        next_session: 1,
        started: Instant::now(),
        stop,
        workers,
        lanes,
        _reservation: reservation,
        desk,
        mapped: segments::MappedSpace::new(config_shared.0, config_shared.1),
        bad_messages: Throttle::default(),
        dropped_replies: Throttle::default(),
        gate,
        zap,
        device_gate,
        refused_connections: Throttle::default(),
        decoder,
        decoded,
        decoding: HashSet::new(),
        held: HashMap::new(),
        bells: bells::Bells::default(),
        opening_from: String::new(),
        trim: super::trim::Trimmer::start(),
        stopping: None,
        decode_took: Duration::ZERO,
        asked: None,
    };
    let thread = std::thread::Builder::new()
        .name("lanes-frontend".into())
        .spawn(move || fe.run())?;
    Ok((endpoint, thread))
}

fn recv_message(socket: &zmq::Socket) -> Result<Option<Vec<zmq::Message>>, zmq::Error> {
    let first = match socket.recv_msg(zmq::DONTWAIT) {
        Ok(m) => m,
        Err(zmq::Error::EAGAIN) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut frames = vec![first];
    while socket.get_rcvmore()? {
        frames.push(socket.recv_msg(0)?);
    }
    Ok(Some(frames))
}

impl Frontend {
    fn run(mut self) -> Result<(), ServerError> {
        tracing::info!(
            endpoint = %self.router.get_last_endpoint().ok().and_then(|r| r.ok()).unwrap_or_default(),
            workers = self.workers.len(),
            device = %self.config.device,
            policy = %self.config.policy,
            memory = %self.config.memory_bytes.map_or_else(|| "none".to_string(), crate::size::format_size),
            idle_timeout_s = self.config.idle_timeout.as_secs_f64(),
            "lanes service ready"
        );
        let reap_every =
            (self.config.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let mut last_reap = Instant::now();
        let mut last_ping = Instant::now();
        let mut last_metrics = Instant::now();
        // Busy polling: no sleeping in `poll` this long after a message.
        let busy = self.config.busy_poll;
        let mut last_message = Instant::now() - busy;
        let result = loop {
            if self.stopping.is_none() && self.stop.load(Ordering::SeqCst) {
                self.begin_stop();
            }
            if self.stop_done() {
                break Ok(());
            }
            let spinning = !busy.is_zero() && last_message.elapsed() < busy;
            let (requests, replies, decoded, zap) = {
                let mut items = vec![
                    self.router.as_poll_item(zmq::POLLIN),
                    self.pull.as_poll_item(zmq::POLLIN),
                    self.decoded.as_poll_item(zmq::POLLIN),
                ];
                if let Some(z) = &self.zap {
                    items.push(z.socket().as_poll_item(zmq::POLLIN));
                }
                match zmq::poll(&mut items, if spinning { 0 } else { POLL_MS }) {
                    Ok(_) => (
                        items[0].is_readable(),
                        items[1].is_readable(),
                        items[2].is_readable(),
                        items.get(3).is_some_and(|i| i.is_readable()),
                    ),
                    Err(zmq::Error::EINTR) => (false, false, false, false),
                    Err(e) => break Err(ServerError::Zmq(e)),
                }
            };
            if zap {
                if let Err(e) = self.admit_connections() {
                    break Err(e.into());
                }
            }
            if requests || replies || decoded {
                last_message = Instant::now();
            }
            // Only while a decode is under way or its wake-up is waiting:
            // the common turn of the loop pays nothing for the decoder.
            if decoded || !self.decoding.is_empty() {
                if let Err(e) = self.take_decoded() {
                    break Err(e.into());
                }
            }
            if replies {
                if let Err(e) = self.forward_replies() {
                    break Err(e.into());
                }
            }
            if requests {
                if let Err(e) = self.serve_requests() {
                    break Err(e.into());
                }
            }
            if !self.bells.is_empty() && self.stopping.is_none() {
                if let Err(e) = self.poll_bells() {
                    break Err(e.into());
                }
            }
            if let Some(desk) = self.desk.as_mut() {
                desk.poll();
            }
            self.relieve_pressure();
            if last_reap.elapsed() >= reap_every {
                self.reap();
                last_reap = Instant::now();
            }
            if self.config.metrics.is_some() && last_metrics.elapsed() >= METRICS_EVERY {
                self.publish_metrics();
                last_metrics = Instant::now();
            }
            if last_ping.elapsed() >= PING_EVERY {
                if let Err(e) = self.ping_quiet_clients() {
                    break Err(e.into());
                }
                last_ping = Instant::now();
            }
        };
        self.finish_stop();
        result
    }

    fn forward_replies(&mut self) -> Result<(), zmq::Error> {
        for _ in 0..BATCH {
            let Some(mut frames) = recv_message(&self.pull)? else {
                break;
            };
            if frames.len() < 3 {
                continue;
            }
            let sid = <[u8; 8]>::try_from(&frames[0][..])
                .ok()
                .map(|b| SessionId(u64::from_le_bytes(b)));
            frames.remove(0);
            if let Some(t) = sid
                .and_then(|s| self.sessions.get_mut(&s))
                .and_then(|e| e.slo.as_mut())
            {
                if let Some(id) = wire::peek_request_id(&frames[1]) {
                    t.answered(id, wire::peek_run_done(&frames[1]), Instant::now());
                }
            }
            let peer = frames[0].to_vec();
            // A reply that reached its client shows the client is there; one
            // to a client that is gone reclaims its sessions.
            if self.deliver(&peer, frames)? {
                if let Some(e) = sid.and_then(|s| self.sessions.get_mut(&s)) {
                    e.last_seen = Instant::now();
                }
            }
        }
        Ok(())
    }

    fn serve_requests(&mut self) -> Result<(), zmq::Error> {
        for _ in 0..BATCH {
            let Some(mut frames) = recv_message(&self.router)? else {
                break;
            };
            let peer = frames.remove(0).to_vec();
            self.handle(peer, frames)?;
        }
        Ok(())
    }

    fn reply(&mut self, peer: &[u8], request_id: u64, reply: &Reply) -> Result<(), zmq::Error> {
        if let (Reply::Error(e), Some(m)) = (reply, &self.config.metrics) {
            m.error(e.code);
        }
        let frames = wire::encode_reply(request_id, reply).unwrap_or_else(|e| {
            wire::encode_error(request_id, ErrorCode::Internal, &e.to_string())
        });
        self.send(peer, frames)
    }

    /// A session went: its memory goes back to the system soon.
    fn trim_soon(&self) {
        if let Some(t) = &self.trim {
            t.soon();
        }
    }

    /// An error reply built here (not by a worker), counted in the metrics
    /// like every other.
    fn send_error(
        &mut self,
        peer: &[u8],
        request_id: u64,
        code: ErrorCode,
        message: &str,
    ) -> Result<(), zmq::Error> {
        if let Some(m) = &self.config.metrics {
            m.error(code);
        }
        self.send(peer, wire::encode_error(request_id, code, message))
    }

    fn open(&mut self, peer: &[u8], spec: SessionSpec) -> Reply {
        if !wire::auth::is_chosen_id(peer) {
            return Reply::error(ErrorCode::BadRequest, UNCHOSEN_ID);
        }
        if spec.name.trim().is_empty() || spec.name.len() > MAX_NAME_BYTES {
            return Reply::error(
                ErrorCode::BadRequest,
                format!("job name must be 1 to {MAX_NAME_BYTES} bytes"),
            );
        }
        if let Err(e) = spec.check() {
            return Reply::error(ErrorCode::BadRequest, e.to_string());
        }
        if self.sessions.len() >= self.config.max_sessions {
            return Reply::error(
                ErrorCode::Overloaded,
                format!(
                    "the service is at its limit of {} sessions (--max-sessions)",
                    self.config.max_sessions
                ),
            );
        }
        let origin = std::mem::take(&mut self.opening_from);
        let from_peer = self
            .sessions
            .values()
            .filter(|e| e.origin == origin)
            .count();
        if from_peer >= self.config.max_sessions_per_peer {
            return Reply::error(
                ErrorCode::Overloaded,
                format!(
                    "this peer ({}) already has {from_peer} sessions open over its connections, its limit (--max-sessions-per-peer)",
                    if origin.is_empty() { "address unknown" } else { origin.as_str() }
                ),
            );
        }
        let (mine, unloaded) = self
            .sessions
            .values()
            .filter(|e| e.owner.as_slice() == peer)
            .fold((0, 0), |(n, u), e| {
                (n + 1, u + usize::from(e.feed_types.get().is_none()))
            });
        if let Some(limit) = self.config.max_sessions_per_client {
            if mine >= limit {
                return Reply::error(
                    ErrorCode::Overloaded,
                    format!(
                        "this connection already has {mine} sessions open, its limit (--max-sessions-per-client {limit})"
                    ),
                );
            }
        }
        let limit = self.config.max_unloaded_per_client;
        if unloaded >= limit {
            return Reply::error(
                ErrorCode::Overloaded,
                format!(
                    "this connection already has {unloaded} sessions with no graph loaded, its limit (--max-unloaded-per-client {limit}): load a graph into one, or close one"
                ),
            );
        }
        let session = SessionId(self.next_session);
        self.next_session += 1;
        tracing::info!(%session, name = %spec.name, kind = %spec.kind, priority = spec.priority, "session opened");
        let feed_types = crate::session::FeedTypes::default();
        let slo = spec.slo_ms.map(slo::SloTrack::new);
        let state = Session::new(session, spec.clone());
        let yields = state.yield_request();
        let switches = state.switch_counts();
        self.sessions.insert(
            session,
            Entry {
                owner: peer.to_vec(),
                origin,
                state: Arc::new(Mutex::new(
                    state
                        .with_feed_types(Arc::clone(&feed_types))
                        .with_lanes(self.lanes.clone())
                        .with_pool(self.pool.clone())
                        .with_backend(super::backend_of(&self.config.device))
                        .with_ask(self.config.policy.ask(&spec))
                        .with_slo(spec.slo_ms.map(|ms| Duration::from_secs_f64(ms / 1e3)))
                        .with_share(self.config.policy.share(
                            spec.kind,
                            spec.priority,
                            self.config.stream_priority,
                            self.device_gate.as_ref(),
                        )),
                )),
                spec,
                last_seen: Instant::now(),
                loaded: false,
                iterations: 0,
                resident: true,
                switches,
                segments: HashMap::new(),
                feed_types,
                slo,
                yields,
            },
        );
        Reply::SessionOpened { session }
    }

    fn queue(
        &mut self,
        peer: Vec<u8>,
        request_id: u64,
        session: SessionId,
        work: Work,
    ) -> Result<(), zmq::Error> {
        if let Err(e) = self.owned(&peer, session) {
            return self.reply(&peer, request_id, &Reply::Error(e));
        }
        // One look at the dispatcher for all of the connection's sessions:
        // a connection may own thousands.
        let in_flight = self.dispatcher.requests_of(
            self.sessions
                .iter()
                .filter(|(_, e)| e.owner == peer)
                .map(|(id, _)| *id),
        );
        let limit = self.config.max_requests_per_client;
        if in_flight >= limit {
            let e = Reply::error(
                ErrorCode::Overloaded,
                format!("this connection already has {in_flight} requests queued or running, its limit (--max-requests-per-client {limit})"),
            );
            return self.reply(&peer, request_id, &e);
        }
        let entry = match self.owned(&peer, session) {
            Ok(e) => e,
            Err(e) => return self.reply(&peer, request_id, &Reply::Error(e)),
        };
        // A Run of an evicted job asks for its memory now, so that idle jobs
        // can be evicted for it before a worker picks the Run up.
        let returning = matches!(work, Work::Run { .. })
            && match entry.state.try_lock() {
                Ok(mut s) => s.prepare_return().unwrap_or(false),
                Err(_) => false,
            };
        let enqueued = Instant::now();
        if let (Some(t), Work::Run { .. }) = (entry.slo.as_mut(), &work) {
            t.queued(request_id, enqueued);
        }
        let item = WorkItem {
            session,
            kind: entry.spec.kind,
            priority: entry.spec.priority,
            expected_iterations: entry.spec.expected_iterations,
            enqueued,
            peer,
            request_id,
            work,
            state: Arc::clone(&entry.state),
        };
        self.dispatcher.submit(item);
        if returning {
            self.relieve_pressure();
        }
        Ok(())
    }

    /// Reclaims sessions silent past the idle timeout with nothing queued
    /// or running; dropping the entry frees the program and its variables.
    fn reap(&mut self) {
        let timeout = self.config.idle_timeout;
        let stale: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(id, e)| e.last_seen.elapsed() > timeout && self.dispatcher.is_idle(**id))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            if let Some(e) = self.sessions.remove(&id) {
                self.dispatcher.cancel(id); // its job leaves the policy
                tracing::info!(session = %id, name = %e.spec.name, idle_s = e.last_seen.elapsed().as_secs_f64(), "idle session reclaimed");
                self.trim_soon();
                self.dispatcher.wake();
            }
        }
        self.forget_bells();
        self.mapped.forget_unmapped();
    }
}

/// At most one log line per [`Throttle::EVERY`]: a peer sending a flood of
/// bad messages gets one warning a second, each counting those it stands
/// for.
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    const EVERY: Duration = Duration::from_secs(1);

    /// `Some(n)` when a line may be logged now (`n` lines were suppressed
    /// since the last one), `None` when this one is suppressed.
    fn allow(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Self::EVERY)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// The refusal of a connection whose routing id may not own sessions.
const UNCHOSEN_ID: &str = "this connection has no routing id of its own: sessions belong to \
     connections whose ZeroMQ routing id (ZMQ_ROUTING_ID) is at least 16 random bytes not \
     starting with a zero byte, as Lanes clients choose";

/// How the log names a peer. A routing id a client chose is the secret
/// that keeps its sessions its own, so the log shows only a fingerprint of
/// it (`#` and the first 4 bytes of its SHA-256); ids that ZeroMQ assigned
/// (a zero byte and a counter) own nothing and are shown as they are.
fn peer_label(id: &[u8]) -> String {
    if wire::auth::is_chosen_id(id) {
        format!("#{}", wire::auth::fingerprint(id))
    } else {
        wire::auth::hex(id)
    }
}
