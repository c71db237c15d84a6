//! The socket thread's connections: sending to a peer (and noticing one
//! that is gone), pinging quiet ones, admitting connections at their
//! handshake and refusing requests before authentication, and which
//! sessions a connection owns. A connection is its routing id: Lanes
//! clients choose 128 random bits (`wire::auth::connection_id`), only such
//! ids may own sessions, and the ids ZeroMQ assigns itself start from an
//! unpredictable value (docs/protocol.md, *Identity*). A session belongs
//! to the connection that opened it, and ends with it.

use std::time::Instant;

use lanes_adaptor::wire::{self, ErrorCode, ErrorReply, Reply, SessionId};

use super::{peer_label, Entry, Frontend, PING_EVERY};

impl Frontend {
    pub(super) fn send(&mut self, peer: &[u8], frames: Vec<Vec<u8>>) -> Result<(), zmq::Error> {
        let mut out = Vec::with_capacity(frames.len() + 1);
        out.push(peer.to_vec());
        out.extend(frames);
        self.deliver(peer, out).map(|_| ())
    }

    /// Sends `frames` (the peer's routing id first) without blocking.
    /// `Ok(true)`: sent. `Ok(false)`: not sent, because the peer is gone
    /// (its sessions are reclaimed now) or its queue is full (the message is
    /// dropped, as ZeroMQ's ROUTER drops it by default).
    pub(super) fn deliver<T: Into<zmq::Message>>(
        &mut self,
        peer: &[u8],
        frames: Vec<T>,
    ) -> Result<bool, zmq::Error> {
        match self.router.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => Ok(true),
            Err(zmq::Error::EHOSTUNREACH) => {
                self.peer_gone(peer);
                Ok(false)
            }
            Err(zmq::Error::EAGAIN) => {
                if let Some(suppressed) = self.dropped_replies.allow() {
                    tracing::warn!(peer = %peer_label(peer), suppressed, "a client does not read its replies: one dropped");
                }
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Pings every client whose sessions have been quiet for [`PING_EVERY`]:
    /// a ping to a client that is gone fails and reclaims its sessions.
    /// Clients waiting for a long Run are pinged too: a client killed with
    /// Runs queued is reclaimed within seconds, not when its running Run's
    /// reply finally fails.
    pub(super) fn ping_quiet_clients(&mut self) -> Result<(), zmq::Error> {
        let mut quiet: Vec<Vec<u8>> = self
            .sessions
            .values()
            .filter(|e| e.last_seen.elapsed() >= PING_EVERY)
            .map(|e| e.owner.clone())
            .collect();
        // Authenticated connections without sessions too: one that is gone
        // is forgotten.
        if let Some(gate) = &self.gate {
            quiet.extend(
                gate.authenticated()
                    .filter(|p| !self.sessions.values().any(|e| &e.owner == *p))
                    .cloned(),
            );
        }
        quiet.sort();
        quiet.dedup();
        if quiet.is_empty() {
            return Ok(());
        }
        let ping = wire::encode_reply(0, &Reply::Ping).map_err(|_| zmq::Error::EPROTO)?;
        for peer in quiet {
            self.send(&peer, ping.clone())?;
        }
        Ok(())
    }

    /// Reclaims every session of a client that is gone: its queued requests
    /// are dropped, a running one finishes, and its memory is returned.
    pub(super) fn peer_gone(&mut self, peer: &[u8]) {
        if let Some(gate) = self.gate.as_mut() {
            gate.forget(peer);
        }
        let ids: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, e)| e.owner.as_slice() == peer)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(e) = self.sessions.remove(&id) {
                let dropped = self.dispatcher.cancel(id);
                tracing::info!(session = %id, name = %e.spec.name, dropped, "client gone: session reclaimed");
                self.trim_soon();
            }
        }
        self.forget_bells();
        self.dispatcher.wake();
    }

    /// Answers libzmq's questions about connections being handshaken
    /// (`zap.rs`).
    pub(super) fn admit_connections(&mut self) -> Result<(), zmq::Error> {
        let (Some(zap), Some(gate)) = (self.zap.as_mut(), self.gate.as_mut()) else {
            return Ok(());
        };
        let refusals = zap.serve(gate)?;
        if let Some(reason) = refusals.last() {
            if let Some(suppressed) = self.refused_connections.allow() {
                tracing::warn!(%reason, suppressed = suppressed + refusals.len() as u64 - 1, "connection refused at its handshake");
            }
        }
        Ok(())
    }

    /// Answers a request of a connection that has not authenticated.
    pub(super) fn refuse_unauthenticated(
        &mut self,
        peer: &[u8],
        request_id: u64,
    ) -> Result<(), zmq::Error> {
        self.send_error(
            peer,
            request_id,
            ErrorCode::Unauthenticated,
            "this service authenticates its peers: send Hello, then Authenticate with the key",
        )
    }

    /// The session if `peer` opened it; else an UnknownSession reply.
    pub(super) fn owned(
        &mut self,
        peer: &[u8],
        session: SessionId,
    ) -> Result<&mut Entry, ErrorReply> {
        match self.sessions.get_mut(&session) {
            Some(e) if e.owner == peer => {
                e.last_seen = Instant::now();
                Ok(e)
            }
            _ => Err(ErrorReply {
                code: ErrorCode::UnknownSession,
                message: format!("session {session} is not open on this connection"),
            }),
        }
    }
}

/// Seeds the C library's `rand`, from which libzmq's ROUTER draws the first
/// of the ids it hands out to peers that name none (then counts up). Stock
/// libzmq never seeds it, so every service handed out the same ids in the
/// same order (`006b8b4567`, `…68`, …), and a peer that claimed the next
/// ones first could make libzmq abort the process when its counter got
/// there. Seeded from a cryptographically secure generator, the ids are not
/// predictable, so claiming them ahead is a guess among 2^32 per id.
pub(super) fn seed_assigned_ids() {
    use rand::RngCore;
    let seed = rand::thread_rng().next_u32();
    // SAFETY: `srand` only sets the C library's generator state (glibc
    // guards it with a lock); it takes a plain integer and touches no
    // memory that Rust owns.
    #[allow(unsafe_code)]
    unsafe {
        libc::srand(seed);
    }
}
