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
mod error;
mod session;
mod socket;
mod transport;
pub mod wait;

pub use buffers::{BufferOutputs, FeedBuffers, PendingBufferRun};
pub use error::{check_endpoint, is_local, ClientError, EndpointError};
pub use session::Session;
use socket::*;

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
