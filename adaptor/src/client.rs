//! The blocking client a job uses: a ZeroMQ DEALER talking to `lanes serve`.
//!
//! ```no_run
//! use lanes_adaptor::{Client, GraphBuilder, SessionSpec, Tensor, TensorType};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut g = GraphBuilder::new();
//! let x = g.placeholder("x", TensorType::f32([1, 2]));
//! let w = g.variable("w", Tensor::full([2, 2], 0.5));
//! let y = g.matmul(x, w);
//! g.set_name(y, "y");
//! let (graph, vars) = g.finish()?;
//!
//! let mut client = Client::connect("tcp://127.0.0.1:5555")?;
//! let mut session = client.open_session(SessionSpec::inference("doc"))?;
//! session.load(&graph, vars)?;
//! let out = session.run(vec![("x", Tensor::from_f32([1, 2], vec![1.0, 2.0])?)], &["y"])?;
//! assert_eq!(out[0].f32s()?, &[1.5, 1.5]);
//! session.close()?;
//! # Ok(()) }
//! ```

use crate::graph::{Graph, VarValues};
use crate::tensor::{Tensor, TensorType};
use crate::wire::auth::{self, AuthKey, AUTH_BYTES};
use crate::wire::shm::{OwnedSegment, SharedMemoryError};
use crate::wire::{
    self, BufferPool, DecodeError, ErrorCode, Limits, NamedTensor, Reply, Request, SessionId,
    SessionSpec, StatusReport, WireError,
};
use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod buffers;
pub mod wait;

pub use buffers::{BufferOutputs, FeedBuffers, PendingBufferRun};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("zeromq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("no reply to {request} within {timeout:?}")]
    Timeout {
        request: &'static str,
        timeout: Duration,
    },
    #[error("could not encode the request: {0}")]
    Encode(WireError),
    #[error("undecodable reply: {0}")]
    Decode(#[from] DecodeError),
    /// The service answered with an error reply.
    #[error("service error {code}: {message}")]
    Service { code: ErrorCode, message: String },
    #[error("service speaks protocol {server}, this client {client}")]
    Version { server: u32, client: u32 },
    #[error("unexpected reply `{got}` to `{request}`")]
    UnexpectedReply {
        request: &'static str,
        got: &'static str,
    },
    #[error("the session was already closed")]
    Closed,
    /// The service authenticates its peers and this client has no key,
    /// could not read it, or the service did not prove it holds the same
    /// key.
    #[error("authentication: {reason}")]
    Auth { reason: String },
    /// The endpoint is not of a form ZeroMQ takes.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// Feed buffers asked for feeds they cannot hold, or a feed they do
    /// not have.
    #[error("feed buffers: {reason}")]
    FeedBuffer { reason: String },
    /// Feed buffers need a shared segment with the service, which cannot be
    /// had: the service is on another host or does not attach shared
    /// memory (`lanes serve --no-shared-memory`).
    #[error("no shared memory with the service: {reason}")]
    NoSharedMemory { reason: String },
    /// Nothing answered the handshake: most likely no service listens there.
    #[error("no reply from {endpoint} within {timeout:?}: is `lanes serve` running there? (start one with `lanes serve --endpoint {endpoint}`)")]
    NoService { endpoint: String, timeout: Duration },
    /// The connection to the service was lost (it stopped, or stopped
    /// answering ZeroMQ's heartbeats): the service has dropped this
    /// connection's sessions, and this client fails every request at once
    /// from then on; connect a new one.
    #[error("the connection to the service was lost (waiting for {request}); connect again")]
    ServiceGone { request: &'static str },
}

/// An endpoint that is not `tcp://HOST:PORT` or `ipc://PATH`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{endpoint}` is not an endpoint: give tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555) or ipc://PATH{hint}")]
pub struct EndpointError {
    pub endpoint: String,
    /// A closer guess, when there is one (`; did you mean tcp://…?`).
    pub hint: String,
}

/// Checks that `endpoint` has a form ZeroMQ takes, `tcp://HOST:PORT`
/// (PORT a number, or `*` when binding) or `ipc://PATH`, so that a typo is
/// answered with the accepted forms rather than `Invalid argument`.
pub fn check_endpoint(endpoint: &str) -> Result<(), EndpointError> {
    let bad = |hint: String| EndpointError {
        endpoint: endpoint.to_string(),
        hint,
    };
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        return if path.is_empty() {
            Err(bad(String::new()))
        } else {
            Ok(())
        };
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        let guess = if endpoint.contains("://") {
            String::new()
        } else {
            format!("; did you mean tcp://{endpoint}?")
        };
        return Err(bad(guess));
    };
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && (port == "*" || port.parse::<u16>().is_ok()) => {
            Ok(())
        }
        _ => Err(bad(String::new())),
    }
}

impl ClientError {
    /// The service's error code, when the service answered with an error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Service { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Options of [`Client::connect_with`].
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// How long to wait for each reply (and for a send to be queued).
    pub timeout: Duration,
    /// How long connecting and the handshake may take, together: an
    /// endpoint where no service answers fails after this long, not after
    /// [`ClientOptions::timeout`].
    pub connect_timeout: Duration,
    /// Bounds on the replies this client decodes.
    pub limits: Limits,
    /// Name sent in the handshake (shown in the service's logs).
    pub name: String,
    /// When the service is on this host (an `ipc://` endpoint, or `tcp://`
    /// to a loopback address), send large Runs' feeds through a
    /// shared-memory segment instead of the socket (see
    /// [`crate::wire::shm`]). Falls back to the socket by itself when the
    /// service cannot attach the segment.
    pub shared_memory: bool,
    /// The pre-shared key for a service that authenticates its peers
    /// (`lanes serve --auth-key-file`). `None`: the key in the file
    /// `LANES_AUTH_KEY_FILE` names, when that is set.
    pub auth_key: Option<AuthKey>,
    /// Busy polling: wait for each reply this long by polling the socket
    /// without sleeping before blocking on it (a core is busy meanwhile;
    /// a reply that arrives then is taken tens of microseconds sooner).
    /// Zero, the default, leaves the wait to [`ClientOptions::adaptive_wait`].
    /// A Run from feed buffers whose last Run took longer than this window
    /// (a training step, say) first sleeps until [`SPIN_FROM`] of that time
    /// has passed and polls from there, so that the window covers the
    /// reply's arrival.
    pub busy_poll: Duration,
    /// Without `busy_poll`: a Run from feed buffers sleeps until shortly
    /// before its reply is expected (from the buffers' recent Runs), polls
    /// the reply slot for a bounded window around then (a quarter of the
    /// expected time, 0.1 to 0.5 ms), and sleeps again after (see
    /// [`wait`]). On by default; off, every wait sleeps until its reply.
    /// Other requests always sleep.
    pub adaptive_wait: bool,
    /// While busy polling, also leave each Run from feed buffers in their
    /// doorbell (see [`crate::wire::shm::Doorbell`]), where a service that
    /// polls takes it without waiting for the socket. On by default.
    pub doorbell: bool,
}

pub use wait::SPIN_FROM;

/// The environment variable naming the key file a client uses when its
/// options give no key.
pub const AUTH_KEY_FILE_ENV: &str = "LANES_AUTH_KEY_FILE";

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout: Duration::from_secs(30),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            limits: Limits::default(),
            name: format!("lanes-adaptor/{}", env!("CARGO_PKG_VERSION")),
            shared_memory: true,
            auth_key: None,
            busy_poll: Duration::ZERO,
            adaptive_wait: true,
            doorbell: true,
        }
    }
}

/// Default of [`ClientOptions::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// ZeroMQ heartbeats on the client's connection: a service that stops
/// answering them for [`HEARTBEAT_TIMEOUT_MS`] is taken as gone (and so is
/// one whose connection closes), failing a wait at once with
/// [`ClientError::ServiceGone`].
const HEARTBEAT_IVL_MS: i32 = 1000;
const HEARTBEAT_TIMEOUT_MS: i32 = 3000;

/// libzmq's `ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH`: the two sides of
/// a handshake use different security mechanisms.
const MECHANISM_MISMATCH: u32 = 0x1100_0002;

fn context() -> &'static zmq::Context {
    static CTX: OnceLock<zmq::Context> = OnceLock::new();
    CTX.get_or_init(zmq::Context::new)
}

/// A request on its way: what the reply is matched and timed against.
#[derive(Debug)]
struct Sent {
    id: u64,
    request: &'static str,
    bytes: usize,
    start: Instant,
    encoded: Instant,
    sent: Instant,
}

/// A connection to one Lanes service. Blocking: one request at a time.
pub struct Client {
    /// The DEALER and its monitor (the handshake, and a lost connection).
    conn: Monitored,
    /// When the connection was lost. ZeroMQ would connect again, but the
    /// service reclaims a closed connection's sessions and sees a new one
    /// as a stranger: from then on every wait fails at once.
    lost_at: Option<Instant>,
    /// A Run's feeds between its send and its reply (empty otherwise).
    pool: BufferPool,
    next_id: u64,
    options: ClientOptions,
    server: String,
    server_limits: Limits,
    /// Runs submitted ahead and not yet waited for (by request id), and
    /// replies that arrived while waiting for another request.
    ahead: HashSet<u64>,
    early: HashMap<u64, Result<Reply, ClientError>>,
    /// Shared-memory segments by session (see [`ClientOptions::shared_memory`]).
    shared: SharedFeeds,
}

/// Runs whose feeds (all together) are at least this large use a shared
/// segment when one can be had: below it the socket costs about as much as
/// the copy into the segment.
pub const SHARED_FEEDS_MIN_BYTES: usize = 1 << 20;
/// Bytes of the reply slot [`Client::feed_buffers_in`] makes beside the
/// feeds (see [`Client::feed_buffers_with_reply_in`]).
pub const DEFAULT_REPLY_BYTES: usize = 1 << 20;
/// Bytes of the doorbell feed buffers have for their Runs' requests (see
/// [`crate::wire::shm::Doorbell`]); a request larger than it goes through
/// the socket only.
pub const DOORBELL_BYTES: usize = 4096;
/// Smallest doorbell feed buffers have: a service whose
/// `max_doorbell_bytes` is below it gets none (Runs go through the socket).
const MIN_DOORBELL_BYTES: usize = 1024;
/// Most segments one session keeps (one per Run in flight).
const MAX_SEGMENTS_PER_SESSION: usize = 4;
/// Segments are sized in multiples of this.
const SEGMENT_GRANULE: usize = 2 << 20;

/// A client's shared-memory segments.
#[derive(Debug, Default)]
struct SharedFeeds {
    /// False once the service refused a segment, or never for remote
    /// services: every Run then goes through the socket.
    usable: bool,
    /// The service's desk for the segments' descriptors (from its Hello).
    desk: Option<String>,
    next_id: u32,
    by_session: HashMap<SessionId, Vec<ClientSegment>>,
}

#[derive(Debug)]
struct ClientSegment {
    seg: OwnedSegment,
    /// The request whose feeds it holds until its reply arrives. A request
    /// that timed out keeps its segment forever (the service may still read
    /// it).
    busy: Option<u64>,
}

impl SharedFeeds {
    /// Frees the segment that held `request`'s feeds.
    fn release(&mut self, request: u64) {
        for segs in self.by_session.values_mut() {
            for s in segs.iter_mut() {
                if s.busy == Some(request) {
                    s.busy = None;
                }
            }
        }
    }
}

/// Whether `endpoint` is on this host: `ipc://`, or `tcp://` to a
/// loopback address or `localhost`.
pub fn is_local(endpoint: &str) -> bool {
    if endpoint.starts_with("ipc://") {
        return true;
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return false;
    };
    let host = match rest.rsplit_once(':') {
        Some((h, _)) => h,
        None => rest,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The Run request for `session` with `feeds` and `fetches`.
/// A Run's feeds by name, as [`Client::run_in_keeping`] takes and gives
/// them back.
pub type Feeds = Vec<(String, Tensor)>;

fn run_request<N: Into<String>>(
    session: SessionId,
    feeds: Vec<(N, Tensor)>,
    fetches: &[&str],
) -> Request {
    Request::Run {
        session,
        feeds: feeds
            .into_iter()
            .map(|(n, t)| NamedTensor::new(n, t))
            .collect(),
        fetches: fetches.iter().map(|s| s.to_string()).collect(),
    }
}

/// A Run sent ahead with [`Client::submit_run_in`]; its reply is taken
/// with [`Client::wait_run`].
#[derive(Debug)]
pub struct PendingRun {
    sent: Sent,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.server)
            .field("next_id", &self.next_id)
            .field("options", &self.options)
            .finish()
    }
}

impl Client {
    /// Connects with default options and performs the versioned handshake.
    pub fn connect(endpoint: &str) -> Result<Client, ClientError> {
        Self::connect_with(endpoint, ClientOptions::default())
    }

    /// Connects and performs the versioned handshake. The first connection
    /// of a process also calls [`wire::keep_freed_blocks_mapped`] (large
    /// frames then reuse mapped pages under glibc).
    pub fn connect_with(endpoint: &str, options: ClientOptions) -> Result<Client, ClientError> {
        check_endpoint(endpoint)?;
        wire::keep_freed_blocks_mapped();
        let started = Instant::now();
        let key = resolve_key(&options);
        // With a key: a connection token in the ZeroMQ handshake (PLAIN),
        // which a service that authenticates requires before any message;
        // a service that does not refuses that mechanism, and is then
        // connected to without one.
        let mut token = match &key {
            Ok(Some(k)) => Some(k.connection_token(auth::unix_now())),
            _ => None,
        };
        let conn = loop {
            let conn = open_socket(endpoint, &options, token.as_deref())?;
            let left = options.connect_timeout.saturating_sub(started.elapsed());
            match handshake(&conn.monitor, left)? {
                Handshake::Done => break conn,
                // Which side notices a mismatch first varies: either failure
                // with a token is tried again without.
                Handshake::Mismatch | Handshake::Failed(_) if token.is_some() => token = None,
                Handshake::Mismatch => {
                    return Err(ClientError::Auth {
                        reason: match key {
                            Err(e) => e,
                            Ok(_) => needs_key(),
                        },
                    })
                }
                Handshake::Refused => {
                    return Err(ClientError::Auth {
                        reason: format!(
                            "the service refused the key (a wrong key, or this host's clock is more than {} s off the service's)",
                            auth::TOKEN_SKEW_SECS
                        ),
                    })
                }
                Handshake::Failed(event) => {
                    let why = match key {
                        Err(e) => e,
                        Ok(_) => needs_key(),
                    };
                    return Err(ClientError::Auth {
                        reason: format!(
                            "the ZeroMQ handshake failed ({event}): not a Lanes service, or one that requires a key ({why})"
                        ),
                    });
                }
                Handshake::TimedOut => {
                    return Err(ClientError::NoService {
                        endpoint: endpoint.to_string(),
                        timeout: options.connect_timeout,
                    })
                }
            }
        };
        let request_timeout = options.timeout;
        let mut client = Client {
            conn,
            lost_at: None,
            pool: BufferPool::new(usize::MAX),
            next_id: 1,
            server: String::new(),
            server_limits: Limits::default(),
            ahead: HashSet::new(),
            early: HashMap::new(),
            shared: SharedFeeds {
                usable: options.shared_memory && is_local(endpoint),
                ..SharedFeeds::default()
            },
            options,
        };
        // Hello and Authenticate within what is left of the connect timeout.
        client.options.timeout = client
            .options
            .connect_timeout
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        let greeted = client.greet(endpoint, key);
        client.options.timeout = request_timeout;
        greeted?;
        Ok(client)
    }

    /// Hello (and, when the service asks, Authenticate).
    fn greet(
        &mut self,
        endpoint: &str,
        key: Result<Option<AuthKey>, String>,
    ) -> Result<(), ClientError> {
        let hello = Request::Hello {
            client: self.options.name.clone(),
        };
        let timeout = self.options.timeout;
        let reply = self.request(&hello).map_err(|e| match e {
            ClientError::Timeout { .. } => ClientError::NoService {
                endpoint: endpoint.to_string(),
                timeout,
            },
            other => other,
        })?;
        match reply {
            Reply::Hello {
                server,
                version,
                limits,
                desk,
                challenge,
            } => {
                if version != wire::PROTOCOL_VERSION {
                    return Err(ClientError::Version {
                        server: version,
                        client: wire::PROTOCOL_VERSION,
                    });
                }
                if let Some(challenge) = challenge {
                    let key = match key {
                        Ok(Some(k)) => k,
                        Ok(None) => {
                            return Err(ClientError::Auth {
                                reason: needs_key(),
                            })
                        }
                        Err(reason) => return Err(ClientError::Auth { reason }),
                    };
                    self.authenticate(&key, &challenge)?;
                }
                self.server = server;
                self.server_limits = limits;
                self.shared.usable &= desk.is_some();
                self.shared.desk = desk;
                Ok(())
            }
            other => Err(unexpected(hello.name(), &other)),
        }
    }

    /// Answers the Hello's challenge with the key and checks the service's
    /// proof.
    fn authenticate(
        &mut self,
        key: &AuthKey,
        challenge: &[u8; AUTH_BYTES],
    ) -> Result<(), ClientError> {
        let nonce = auth::random_bytes();
        let req = Request::Authenticate {
            nonce,
            proof: key.client_proof(challenge, &nonce),
        };
        match self.request(&req) {
            Ok(Reply::Authenticated { proof }) if key.check_service(challenge, &nonce, &proof) => {
                Ok(())
            }
            Ok(Reply::Authenticated { .. }) => Err(ClientError::Auth {
                reason: "the service's proof does not match this key".into(),
            }),
            Ok(other) => Err(unexpected(req.name(), &other)),
            Err(ClientError::Service {
                code: ErrorCode::Unauthenticated,
                message,
            }) => Err(ClientError::Auth {
                reason: format!("the service refused the key: {message}"),
            }),
            Err(e) => Err(e),
        }
    }

    /// The service's name and version string from the handshake.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The limits the service enforces.
    pub fn server_limits(&self) -> &Limits {
        &self.server_limits
    }

    /// Sends one request and waits for its reply. Error replies become
    /// [`ClientError::Service`]; replies to earlier, timed-out requests are
    /// skipped.
    pub fn request(&mut self, req: &Request) -> Result<Reply, ClientError> {
        let sent = self.send(req)?;
        self.receive(&sent, None)
    }

    /// A Run: once it is sent, the storage of its feeds is where the tensors
    /// of the reply are decoded, when sizes fit (a fetch as large as a feed
    /// then writes into memory already mapped instead of fresh pages).
    fn request_run(&mut self, req: Request) -> Result<Reply, ClientError> {
        let sent = self.send_run(&req)?;
        let pool = self.pool.clone();
        if let Request::Run { feeds, .. } = req {
            feeds.into_iter().for_each(|f| pool.give(f.tensor));
        }
        let reply = self.receive(&sent, Some(&pool));
        pool.clear();
        reply
    }

    /// Encodes and queues a request.
    fn send(&mut self, req: &Request) -> Result<Sent, ClientError> {
        self.send_via(req, None)
    }

    /// Encodes and queues a request, a Run's feeds into `shared` when given.
    fn send_via(
        &mut self,
        req: &Request,
        shared: Option<&mut OwnedSegment>,
    ) -> Result<Sent, ClientError> {
        self.send_encoded(req.name(), |id| wire::encode_request_into(id, req, shared))
    }

    /// Takes the next request id, encodes with it and queues the frames.
    fn send_encoded(
        &mut self,
        request: &'static str,
        encode: impl FnOnce(u64) -> Result<Vec<Vec<u8>>, WireError>,
    ) -> Result<Sent, ClientError> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let start = Instant::now();
        let frames = encode(id).map_err(ClientError::Encode)?;
        let bytes: usize = frames.iter().map(Vec::len).sum();
        let encoded = Instant::now();
        self.conn
            .socket
            .send_multipart(frames, 0)
            .map_err(|e| match e {
                zmq::Error::EAGAIN => ClientError::Timeout {
                    request,
                    timeout: self.options.timeout,
                },
                other => ClientError::Zmq(other),
            })?;
        Ok(Sent {
            id,
            request,
            bytes,
            start,
            encoded,
            sent: Instant::now(),
        })
    }

    /// Waits for the reply to `sent`, decoding its tensors into `pool`'s
    /// storage where it fits.
    fn receive(&mut self, sent: &Sent, pool: Option<&BufferPool>) -> Result<Reply, ClientError> {
        if let Some(r) = self.early.remove(&sent.id) {
            return r;
        }
        let deadline = sent.sent + self.options.timeout;
        loop {
            if self.lost_at.is_some() {
                return Err(ClientError::ServiceGone {
                    request: sent.request,
                });
            }
            if !self.options.busy_poll.is_zero() {
                let until = Instant::now() + self.options.busy_poll;
                while Instant::now() < until.min(deadline)
                    && self.conn.socket.poll(zmq::POLLIN, 0)? == 0
                {
                    std::hint::spin_loop();
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX);
            let (readable, event) = if left.is_zero() {
                (false, false)
            } else {
                let mut items = [
                    self.conn.socket.as_poll_item(zmq::POLLIN),
                    self.conn.monitor.as_poll_item(zmq::POLLIN),
                ];
                zmq::poll(&mut items, ms)?;
                (items[0].is_readable(), items[1].is_readable())
            };
            if readable {
                if let Some(r) = self.take_reply(sent, pool)? {
                    return r;
                }
                continue;
            }
            if event && connection_lost(&self.conn.monitor)? {
                self.lost_at = Some(Instant::now());
            }
            if event {
                continue;
            }
            return Err(ClientError::Timeout {
                request: sent.request,
                timeout: self.options.timeout,
            });
        }
    }

    /// Takes one message from the socket, which has one: `Some` when it
    /// answers `sent`; a reply to a Run submitted ahead is kept for its
    /// wait, any other (a request that timed out, a Run whose outputs came
    /// through its reply slot) dropped.
    fn take_reply(
        &mut self,
        sent: &Sent,
        pool: Option<&BufferPool>,
    ) -> Result<Option<Result<Reply, ClientError>>, ClientError> {
        let ready = Instant::now();
        let frames = recv_frames(&self.conn.socket)?;
        let received = Instant::now();
        let decoded = wire::decode_reply_in(&frames, &self.options.limits, pool);
        drop(frames);
        // The service has read a Run's feeds once it answers.
        let answered = match &decoded {
            Ok(env) => Some(env.request_id),
            Err(e) => e.request_id,
        };
        if let Some(id) = answered {
            self.shared.release(id);
        }
        let service = |message: Reply| match message {
            Reply::Error(e) => Err(ClientError::Service {
                code: e.code,
                message: e.message,
            }),
            r => Ok(r),
        };
        match decoded {
            Ok(env) if env.request_id != sent.id => {
                // A Run submitted ahead: keep its reply for its wait.
                if self.ahead.contains(&env.request_id) {
                    self.early.insert(env.request_id, service(env.message));
                }
                Ok(None)
            }
            Ok(env) => {
                let us = |a: Instant, b: Instant| b.duration_since(a).as_micros() as u64;
                tracing::trace!(
                    request = sent.request,
                    bytes = sent.bytes,
                    encode_us = us(sent.start, sent.encoded),
                    send_us = us(sent.encoded, sent.sent),
                    wait_us = us(sent.sent, ready),
                    recv_us = us(ready, received),
                    decode_us = received.elapsed().as_micros() as u64,
                    "round trip"
                );
                Ok(Some(service(env.message)))
            }
            Err(e) if e.request_id.is_some_and(|r| r != sent.id) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends a Run, its feeds through a shared segment when that is
    /// possible and worth it (see [`ClientOptions::shared_memory`]).
    fn send_run(&mut self, req: &Request) -> Result<Sent, ClientError> {
        let Request::Run { session, feeds, .. } = req else {
            return self.send(req);
        };
        let need =
            wire::shm::layout(feeds.iter().map(|f| f.tensor.ty().bytes())).map(|(_, end)| end);
        let Some(need) = need.filter(|n| {
            self.shared.usable && n - wire::shm::SEGMENT_HEADER >= SHARED_FEEDS_MIN_BYTES
        }) else {
            return self.send(req);
        };
        let Some(at) = self.free_segment(*session, need)? else {
            return self.send(req);
        };
        // Taken out while the request borrows `self`; put back below.
        let mut seg = self
            .shared
            .by_session
            .get_mut(session)
            .map(|v| v.swap_remove(at))
            .ok_or(ClientError::Closed)?;
        let sent = self.send_via(req, Some(&mut seg.seg));
        if let Ok(s) = &sent {
            seg.busy = Some(s.id);
        }
        self.shared
            .by_session
            .entry(*session)
            .or_default()
            .push(seg);
        sent
    }

    /// Index of a free segment of `session` with at least `need` bytes,
    /// making and attaching one if none is free; `None` when shared memory
    /// is not to be had (the Run then goes through the socket).
    fn free_segment(
        &mut self,
        session: SessionId,
        need: usize,
    ) -> Result<Option<usize>, ClientError> {
        let segs = self.shared.by_session.entry(session).or_default();
        if let Some(i) = segs
            .iter()
            .position(|s| s.busy.is_none() && s.seg.len() >= need)
        {
            return Ok(Some(i));
        }
        // A free segment that is too small is replaced under its id (the
        // service then drops its mapping of the old one).
        let id = match segs.iter().position(|s| s.busy.is_none()) {
            Some(i) => segs.swap_remove(i).seg.id(),
            None if segs.len() >= MAX_SEGMENTS_PER_SESSION => return Ok(None),
            None => {
                let id = self.shared.next_id;
                self.shared.next_id = self.shared.next_id.wrapping_add(1);
                id
            }
        };
        let bytes = need.next_multiple_of(SEGMENT_GRANULE);
        let seg = match self.share_segment(session, id, bytes)? {
            Ok(seg) => seg,
            Err(reason) => {
                tracing::debug!(%reason, "no shared-memory segment; feeds go through the socket");
                self.shared.usable = false;
                return Ok(None);
            }
        };
        let segs = self.shared.by_session.entry(session).or_default();
        segs.push(ClientSegment { seg, busy: None });
        Ok(Some(segs.len() - 1))
    }

    /// Makes segment `id` of `bytes` bytes, hands its descriptor to the
    /// service's desk and attaches it to `session`. The inner error says
    /// why shared memory cannot be had here (no desk, a segment the OS or
    /// the service refused); the outer one is any other failure.
    fn share_segment(
        &mut self,
        session: SessionId,
        id: u32,
        bytes: usize,
    ) -> Result<Result<OwnedSegment, String>, ClientError> {
        let made = OwnedSegment::create(id, bytes).and_then(|seg| {
            match &self.shared.desk {
                Some(desk) => seg.hand_over(desk)?,
                None => return Err(SharedMemoryError::NotHandedOver),
            }
            Ok(seg)
        });
        let seg = match made {
            Ok(s) => s,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let req = Request::ShareMemory {
            session,
            offer: seg.offer(),
        };
        match self.request(&req) {
            Ok(Reply::MemoryShared { .. }) => Ok(Ok(seg)),
            Ok(other) => Err(unexpected(req.name(), &other)),
            Err(ClientError::Service { code, message })
                if code == ErrorCode::SharedMemory || code == ErrorCode::BadRequest =>
            {
                Ok(Err(format!(
                    "the service cannot attach shared memory: {message}"
                )))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether Runs with large feeds currently go through shared memory.
    pub fn shares_memory(&self) -> bool {
        self.shared.usable
    }

    /// Opens a session for a job.
    pub fn open_session(&mut self, spec: SessionSpec) -> Result<Session<'_>, ClientError> {
        let req = Request::OpenSession(spec);
        match self.request(&req)? {
            Reply::SessionOpened { session } => Ok(Session {
                client: self,
                id: session,
                closed: false,
            }),
            other => Err(unexpected(req.name(), &other)),
        }
    }

    /// The service's sessions and queue.
    pub fn status(&mut self) -> Result<StatusReport, ClientError> {
        let req = Request::Status;
        match self.request(&req)? {
            Reply::Status(s) => Ok(s),
            other => Err(unexpected(req.name(), &other)),
        }
    }

    /// Loads a graph into a session by id (see [`Session::load`]).
    pub fn load_in(
        &mut self,
        session: SessionId,
        graph: &Graph,
        variables: VarValues,
    ) -> Result<(), ClientError> {
        let req = Request::LoadGraph {
            session,
            graph: graph.clone(),
            variables: named(variables),
        };
        match self.request(&req)? {
            Reply::GraphLoaded { .. } => Ok(()),
            other => Err(unexpected(req.name(), &other)),
        }
    }

    /// Runs one iteration of a session by id (see [`Session::run`]).
    pub fn run_in<N: Into<String>>(
        &mut self,
        session: SessionId,
        feeds: Vec<(N, Tensor)>,
        fetches: &[&str],
    ) -> Result<Vec<Tensor>, ClientError> {
        let req = run_request(session, feeds, fetches);
        match self.request_run(req)? {
            Reply::RunDone { outputs } => Ok(outputs),
            other => Err(unexpected("run", &other)),
        }
    }

    /// [`Client::run_in`] that hands the feeds back beside the result, so
    /// that a caller can send them again (after opening anew a session the
    /// service reclaimed) without keeping a copy of them.
    pub fn run_in_keeping(
        &mut self,
        session: SessionId,
        feeds: Feeds,
        fetches: &[&str],
    ) -> (Result<Vec<Tensor>, ClientError>, Feeds) {
        let req = run_request(session, feeds, fetches);
        let result = self
            .send_run(&req)
            .and_then(|sent| self.receive(&sent, None))
            .and_then(|reply| match reply {
                Reply::RunDone { outputs } => Ok(outputs),
                other => Err(unexpected("run", &other)),
            });
        let feeds = match req {
            Request::Run { feeds, .. } => feeds.into_iter().map(|f| (f.name, f.tensor)).collect(),
            _ => Vec::new(),
        };
        (result, feeds)
    }

    /// Sends one iteration of a session by id without waiting for it, so
    /// that the next iteration's feeds travel while this one runs (the
    /// service runs a session's requests in order). Take its result with
    /// [`Client::wait_run`]; replies may be waited for in any order.
    pub fn submit_run_in<N: Into<String>>(
        &mut self,
        session: SessionId,
        feeds: Vec<(N, Tensor)>,
        fetches: &[&str],
    ) -> Result<PendingRun, ClientError> {
        let req = run_request(session, feeds, fetches);
        let sent = self.send_run(&req)?;
        self.ahead.insert(sent.id);
        Ok(PendingRun { sent })
    }

    /// The fetched tensors of a Run submitted ahead.
    pub fn wait_run(&mut self, run: PendingRun) -> Result<Vec<Tensor>, ClientError> {
        let r = self.receive(&run.sent, None);
        self.ahead.remove(&run.sent.id);
        match r? {
            Reply::RunDone { outputs } => Ok(outputs),
            other => Err(unexpected("run", &other)),
        }
    }

    /// Reads variables of a session by id; all when `names` is empty.
    pub fn read_variables_in(
        &mut self,
        session: SessionId,
        names: &[&str],
    ) -> Result<VarValues, ClientError> {
        let req = Request::ReadVariables {
            session,
            names: names.iter().map(|s| s.to_string()).collect(),
        };
        match self.request(&req)? {
            Reply::Variables { variables } => {
                Ok(variables.into_iter().map(|t| (t.name, t.tensor)).collect())
            }
            other => Err(unexpected(req.name(), &other)),
        }
    }

    /// Overwrites variables of a session by id.
    pub fn write_variables_in(
        &mut self,
        session: SessionId,
        values: VarValues,
    ) -> Result<(), ClientError> {
        let req = Request::WriteVariables {
            session,
            variables: named(values),
        };
        match self.request(&req)? {
            Reply::VariablesWritten { .. } => Ok(()),
            other => Err(unexpected(req.name(), &other)),
        }
    }

    /// Closes a session by id.
    pub fn close_in(&mut self, session: SessionId) -> Result<(), ClientError> {
        let req = Request::CloseSession { session };
        let reply = self.request(&req);
        self.shared.by_session.remove(&session);
        match reply? {
            Reply::SessionClosed { .. } => Ok(()),
            other => Err(unexpected(req.name(), &other)),
        }
    }
}

fn named(values: VarValues) -> Vec<NamedTensor> {
    values
        .into_iter()
        .map(|(n, t)| NamedTensor::new(n, t))
        .collect()
}

fn unexpected(request: &'static str, got: &Reply) -> ClientError {
    ClientError::UnexpectedReply {
        request,
        got: got.name(),
    }
}

/// The key a client presents: the options', else the one in the file
/// `LANES_AUTH_KEY_FILE` names; `Err`: why that file could not be read
/// (an error only if the service asks for a key).
fn resolve_key(options: &ClientOptions) -> Result<Option<AuthKey>, String> {
    if let Some(k) = &options.auth_key {
        return Ok(Some(k.clone()));
    }
    match std::env::var_os(AUTH_KEY_FILE_ENV) {
        Some(path) => AuthKey::from_file(std::path::Path::new(&path))
            .map(Some)
            .map_err(|e| e.to_string()),
        None => Ok(None),
    }
}

fn needs_key() -> String {
    format!("the service requires a key: set ClientOptions::auth_key or {AUTH_KEY_FILE_ENV}")
}

/// Names the inproc endpoints client monitors bind (unique in the process).
static MONITORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn monitor_address() -> String {
    let n = MONITORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("inproc://lanes-client-monitor-{n}")
}

/// A DEALER and the PAIR its socket monitor reports to.
///
/// libzmq sends monitor events from the context's I/O thread with a
/// blocking send, and keeps the monitor until the socket is destroyed,
/// which happens after the linger, on the reaper. Closed in field order,
/// the PAIR is gone while the socket lingers; an event then (the service
/// going away) blocks the I/O thread for good, and with it every client of
/// the process (they share one context). Dropping this first points the
/// monitor at a fresh endpoint with no events, which closes the old one
/// and sends nothing.
struct Monitored {
    socket: zmq::Socket,
    monitor: zmq::Socket,
}

impl Drop for Monitored {
    fn drop(&mut self) {
        // Only fails once the context is terminated, when no event is sent.
        let _ = self.socket.monitor(&monitor_address(), 0);
    }
}

/// A DEALER connecting to `endpoint` (with a connection token, as PLAIN
/// password, when given) and the PAIR its monitor reports to.
fn open_socket(
    endpoint: &str,
    options: &ClientOptions,
    token: Option<&str>,
) -> Result<Monitored, ClientError> {
    let socket = context().socket(zmq::DEALER)?;
    let ms = i32::try_from(options.timeout.as_millis()).unwrap_or(i32::MAX);
    socket.set_sndtimeo(ms)?;
    socket.set_linger(200)?;
    socket.set_maxmsgsize(i64::try_from(options.limits.max_frame_bytes).unwrap_or(i64::MAX))?;
    socket.set_heartbeat_ivl(HEARTBEAT_IVL_MS)?;
    socket.set_heartbeat_timeout(HEARTBEAT_TIMEOUT_MS)?;
    // 128 random bits: the connection's identity, which owns its sessions.
    socket.set_identity(&auth::connection_id())?;
    if let Some(token) = token {
        socket.set_plain_username(Some(auth::TOKEN_USER))?;
        socket.set_plain_password(Some(token))?;
    }
    let address = monitor_address();
    let events = zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32
        | zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL as i32
        | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL as i32
        | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH as i32
        | zmq::SocketEvent::DISCONNECTED as i32;
    socket.monitor(&address, events)?;
    let monitor = context().socket(zmq::PAIR)?;
    monitor.set_linger(0)?;
    let conn = Monitored { socket, monitor };
    conn.monitor.connect(&address)?;
    conn.socket.connect(endpoint)?;
    Ok(conn)
}

/// How a connection's ZeroMQ handshake ended.
#[derive(Debug)]
enum Handshake {
    Done,
    /// The service uses another security mechanism.
    Mismatch,
    /// The service refused the connection token.
    Refused,
    Failed(String),
    TimedOut,
}

/// One event of a socket monitor: its kind and value.
fn monitor_event(monitor: &zmq::Socket) -> Result<(zmq::SocketEvent, u32), ClientError> {
    let frames = monitor.recv_multipart(0)?;
    let head = frames.first().map(Vec::as_slice).unwrap_or_default();
    match head {
        [a, b, v0, v1, v2, v3, ..] => Ok((
            zmq::SocketEvent::from_raw(u16::from_ne_bytes([*a, *b])),
            u32::from_ne_bytes([*v0, *v1, *v2, *v3]),
        )),
        _ => Err(ClientError::Zmq(zmq::Error::EPROTO)),
    }
}

/// Waits up to `left` for the end of the socket's handshake.
fn handshake(monitor: &zmq::Socket, left: Duration) -> Result<Handshake, ClientError> {
    let deadline = Instant::now() + left;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX);
        if left.is_zero() || monitor.poll(zmq::POLLIN, ms)? == 0 {
            return Ok(Handshake::TimedOut);
        }
        let (event, value) = monitor_event(monitor)?;
        return Ok(match event {
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED => Handshake::Done,
            zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL if value == MECHANISM_MISMATCH => {
                Handshake::Mismatch
            }
            zmq::SocketEvent::HANDSHAKE_FAILED_AUTH => Handshake::Refused,
            zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL
            | zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL => {
                Handshake::Failed(format!("{event:?} {value:#x}"))
            }
            // A connection lost before its handshake ended: ZeroMQ retries.
            _ => continue,
        });
    }
}

/// Whether the monitor's waiting events say the connection was lost.
fn connection_lost(monitor: &zmq::Socket) -> Result<bool, ClientError> {
    let mut lost = false;
    while monitor.poll(zmq::POLLIN, 0)? != 0 {
        let (event, _) = monitor_event(monitor)?;
        lost |= matches!(event, zmq::SocketEvent::DISCONNECTED);
    }
    Ok(lost)
}

fn recv_frames(socket: &zmq::Socket) -> Result<Vec<zmq::Message>, zmq::Error> {
    let mut frames = vec![socket.recv_msg(0)?];
    while socket.get_rcvmore()? {
        frames.push(socket.recv_msg(0)?);
    }
    Ok(frames)
}

/// An open session of a job. Closed by [`Session::close`]; dropping it sends
/// a close without waiting (the service also reclaims silent sessions).
#[derive(Debug)]
pub struct Session<'c> {
    client: &'c mut Client,
    id: SessionId,
    closed: bool,
}

impl Session<'_> {
    pub fn id(&self) -> SessionId {
        self.id
    }

    fn live(&self) -> Result<SessionId, ClientError> {
        if self.closed {
            Err(ClientError::Closed)
        } else {
            Ok(self.id)
        }
    }

    /// Sends the graph and the initial values of all its variables.
    pub fn load(&mut self, graph: &Graph, variables: VarValues) -> Result<(), ClientError> {
        let id = self.live()?;
        self.client.load_in(id, graph, variables)
    }

    /// Runs one iteration: feeds by placeholder name, fetches as `node` or
    /// `node:slot`; returns the fetched tensors in order.
    pub fn run<N: Into<String>>(
        &mut self,
        feeds: Vec<(N, Tensor)>,
        fetches: &[&str],
    ) -> Result<Vec<Tensor>, ClientError> {
        let id = self.live()?;
        self.client.run_in(id, feeds, fetches)
    }

    /// Sends one iteration without waiting (see [`Client::submit_run_in`]).
    pub fn submit_run<N: Into<String>>(
        &mut self,
        feeds: Vec<(N, Tensor)>,
        fetches: &[&str],
    ) -> Result<PendingRun, ClientError> {
        let id = self.live()?;
        self.client.submit_run_in(id, feeds, fetches)
    }

    /// The result of an iteration sent with [`Session::submit_run`].
    pub fn wait_run(&mut self, run: PendingRun) -> Result<Vec<Tensor>, ClientError> {
        self.client.wait_run(run)
    }

    /// Buffers for this session's feeds in a segment shared with the
    /// service (see [`FeedBuffers`]); `feeds` names each placeholder and its
    /// type. Only for a service on this host that attaches shared memory
    /// ([`ClientError::NoSharedMemory`] otherwise).
    pub fn feed_buffers(
        &mut self,
        feeds: &[(&str, TensorType)],
    ) -> Result<FeedBuffers, ClientError> {
        let id = self.live()?;
        self.client.feed_buffers_in(id, feeds)
    }

    /// [`Session::feed_buffers`] with a reply slot of `reply_bytes` bytes
    /// (see [`Client::feed_buffers_with_reply_in`]).
    pub fn feed_buffers_with_reply(
        &mut self,
        feeds: &[(&str, TensorType)],
        reply_bytes: usize,
    ) -> Result<FeedBuffers, ClientError> {
        let id = self.live()?;
        self.client
            .feed_buffers_with_reply_in(id, feeds, reply_bytes)
    }

    /// Runs one iteration on the values written into `buffers`.
    pub fn run_buffers(
        &mut self,
        buffers: &mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<Vec<Tensor>, ClientError> {
        self.own(buffers)?;
        self.client.run_buffers_in(buffers, fetches)
    }

    /// [`Session::run_buffers`] without waiting; the buffers stay borrowed
    /// until [`Session::wait_buffer_run`].
    pub fn submit_run_buffers<'b>(
        &mut self,
        buffers: &'b mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<PendingBufferRun<'b>, ClientError> {
        self.own(buffers)?;
        self.client.submit_run_buffers_in(buffers, fetches)
    }

    /// The result of a Run sent with [`Session::submit_run_buffers`].
    pub fn wait_buffer_run(
        &mut self,
        run: PendingBufferRun<'_>,
    ) -> Result<Vec<Tensor>, ClientError> {
        self.client.wait_buffer_run(run)
    }

    /// Buffers made for this session (a segment is attached to one).
    fn own(&self, buffers: &FeedBuffers) -> Result<(), ClientError> {
        let id = self.live()?;
        if buffers.session != id {
            return Err(ClientError::FeedBuffer {
                reason: format!(
                    "these buffers belong to session {}, not {id}",
                    buffers.session
                ),
            });
        }
        Ok(())
    }

    /// Current values of variables; all of them when `names` is empty.
    pub fn read_variables(&mut self, names: &[&str]) -> Result<VarValues, ClientError> {
        let id = self.live()?;
        self.client.read_variables_in(id, names)
    }

    /// Overwrites variables (each must exist and keep its type).
    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ClientError> {
        let id = self.live()?;
        self.client.write_variables_in(id, values)
    }

    /// Closes the session; its memory is released on the service.
    pub fn close(mut self) -> Result<(), ClientError> {
        let id = self.live()?;
        self.closed = true;
        self.client.close_in(id)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let id = self.client.next_id;
        self.client.next_id = self.client.next_id.wrapping_add(1);
        self.client.shared.by_session.remove(&self.id);
        if let Ok(frames) = wire::encode_request(id, &Request::CloseSession { session: self.id }) {
            // Best effort: the reply is skipped by the next request's id check.
            let _ = self
                .client
                .conn
                .socket
                .send_multipart(frames, zmq::DONTWAIT);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{check_endpoint, is_local};

    #[test]
    fn endpoints_are_checked_with_the_accepted_forms_in_the_error() {
        for e in [
            "tcp://127.0.0.1:5555",
            "tcp://127.0.0.1:*",
            "tcp://[::1]:5555",
            "tcp://gpu-box:5555",
            "ipc:///tmp/lanes.sock",
        ] {
            assert_eq!(check_endpoint(e), Ok(()), "{e}");
        }
        for e in [
            "localhost:5599",
            "tcp://localhost",
            "tcp://:5555",
            "tcp://host:port",
            "tcp://host:70000",
            "ipc://",
            "http://x:1",
            "",
        ] {
            let err = check_endpoint(e).unwrap_err().to_string();
            assert!(
                err.contains("tcp://HOST:PORT") && err.contains("ipc://PATH"),
                "{err}"
            );
        }
        let err = check_endpoint("localhost:5599").unwrap_err().to_string();
        assert!(err.contains("did you mean tcp://localhost:5599?"), "{err}");
    }

    #[test]
    fn only_endpoints_on_this_host_are_local() {
        for e in [
            "ipc:///tmp/lanes.sock",
            "tcp://127.0.0.1:5555",
            "tcp://127.1.2.3:1",
            "tcp://localhost:5555",
            "tcp://[::1]:5555",
        ] {
            assert!(is_local(e), "{e}");
        }
        for e in [
            "tcp://10.0.0.7:5555",
            "tcp://gpu-box:5555",
            "tcp://[2001:db8::1]:5555",
            "inproc://x",
            "garbage",
        ] {
            assert!(!is_local(e), "{e}");
        }
    }
}
