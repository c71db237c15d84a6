//! Why a client call failed ([`ClientError`]), and the endpoint checks a
//! client makes before it connects.

use super::*;

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
