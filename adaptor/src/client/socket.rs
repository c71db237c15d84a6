//! The client's ZeroMQ socket: its context, the key it presents, the
//! socket monitor that tells a handshake's outcome and a lost connection,
//! and receiving a message's frames.

use super::*;

/// The key a client presents: the options', else the one in the file
/// `LANES_AUTH_KEY_FILE` names; `Err`: why that file could not be read
/// (an error only if the service asks for a key).
pub(super) fn resolve_key(options: &ClientOptions) -> Result<Option<AuthKey>, String> {
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

pub(super) fn needs_key() -> String {
    format!("the service requires a key: set ClientOptions::auth_key or {AUTH_KEY_FILE_ENV}")
}

/// Names the inproc endpoints client monitors bind (unique in the process).
static MONITORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(super) fn monitor_address() -> String {
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
pub(super) struct Monitored {
    pub(super) socket: zmq::Socket,
    pub(super) monitor: zmq::Socket,
}

impl Drop for Monitored {
    fn drop(&mut self) {
        // Only fails once the context is terminated, when no event is sent.
        let _ = self.socket.monitor(&monitor_address(), 0);
    }
}

/// A DEALER connecting to `endpoint` (with a connection token, as PLAIN
/// password, when given) and the PAIR its monitor reports to.
pub(super) fn open_socket(
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
pub(super) enum Handshake {
    Done,
    /// The service uses another security mechanism.
    Mismatch,
    /// The service refused the connection token.
    Refused,
    Failed(String),
    TimedOut,
}

/// One event of a socket monitor: its kind and value.
pub(super) fn monitor_event(monitor: &zmq::Socket) -> Result<(zmq::SocketEvent, u32), ClientError> {
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
pub(super) fn handshake(monitor: &zmq::Socket, left: Duration) -> Result<Handshake, ClientError> {
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
pub(super) fn connection_lost(monitor: &zmq::Socket) -> Result<bool, ClientError> {
    let mut lost = false;
    while monitor.poll(zmq::POLLIN, 0)? != 0 {
        let (event, _) = monitor_event(monitor)?;
        lost |= matches!(event, zmq::SocketEvent::DISCONNECTED);
    }
    Ok(lost)
}

pub(super) fn recv_frames(socket: &zmq::Socket) -> Result<Vec<zmq::Message>, zmq::Error> {
    let mut frames = vec![socket.recv_msg(0)?];
    while socket.get_rcvmore()? {
        frames.push(socket.recv_msg(0)?);
    }
    Ok(frames)
}
