//! A request's way through the socket thread: held behind a peer's
//! request at the decoder (a peer's requests keep their order), refused
//! before it is decoded when its connection has not authenticated or the
//! service is stopping, decoded here or on the decoder's thread, and
//! answered (control requests) or queued for the workers.

use std::collections::VecDeque;
use std::time::Instant;

use lanes_adaptor::wire::{self, Envelope, ErrorCode, Reply, Request};

use super::super::decoder::{Decoded, OFFLOAD_BYTES};
use super::super::dispatch::Work;
use super::{peer_label, Frontend, PeerSegments, HANDSHAKE_BYTES};
use crate::session::RunFeeds;

impl Frontend {
    /// Handles a message now, or holds it behind the peer's request at the
    /// decoder.
    pub(super) fn handle(
        &mut self,
        peer: Vec<u8>,
        frames: Vec<zmq::Message>,
    ) -> Result<(), zmq::Error> {
        let received = Instant::now();
        if self.stopping.is_some() {
            let id = frames
                .first()
                .and_then(|f| wire::peek_request_id(f))
                .unwrap_or(0);
            return self.refuse_stopping(&peer, id);
        }
        let waiting = self.held.get(&peer).map_or(0, VecDeque::len);
        if waiting == 0 && !self.decoding.contains(&peer) {
            return self.handle_now(peer, frames, received);
        }
        if waiting >= self.config.max_requests_per_client {
            let id = frames
                .first()
                .and_then(|f| wire::peek_request_id(f))
                .unwrap_or(0);
            let message =
                format!("more than {waiting} requests wait behind a large one being decoded");
            return self.send_error(&peer, id, ErrorCode::Overloaded, &message);
        }
        self.held
            .entry(peer)
            .or_default()
            .push_back((frames, received));
        Ok(())
    }

    /// Takes back the requests the decoder finished, and handles what
    /// their peers sent after them.
    pub(super) fn take_decoded(&mut self) -> Result<(), zmq::Error> {
        // Wake-ups carry nothing: the channel has the requests.
        while self.decoded.recv_msg(zmq::DONTWAIT).is_ok() {}
        loop {
            let Some(d) = self.decoder.try_next() else {
                return Ok(());
            };
            let Decoded {
                peer,
                result,
                bytes,
                received,
            } = d;
            self.decoding.remove(&peer);
            self.decode_took = received.elapsed();
            tracing::trace!(
                bytes,
                decode_us = received.elapsed().as_micros() as u64,
                "request decoded off the socket thread"
            );
            self.handle_decoded(peer.clone(), result)?;
            self.drain_held(&peer)?;
        }
    }

    /// Handles `peer`'s held messages in order, until one goes to the
    /// decoder.
    pub(super) fn drain_held(&mut self, peer: &[u8]) -> Result<(), zmq::Error> {
        while !self.decoding.contains(peer) {
            let Some((frames, received)) = self.held.get_mut(peer).and_then(VecDeque::pop_front)
            else {
                break;
            };
            self.handle_now(peer.to_vec(), frames, received)?;
        }
        if self.held.get(peer).is_some_and(VecDeque::is_empty) {
            self.held.remove(peer);
        }
        Ok(())
    }

    pub(super) fn handle_now(
        &mut self,
        peer: Vec<u8>,
        mut frames: Vec<zmq::Message>,
        t0: Instant,
    ) -> Result<(), zmq::Error> {
        if let Some(first) = frames.first_mut() {
            if matches!(
                wire::peek_request_name(first),
                Some("open_session" | "hello")
            ) {
                self.opening_from = first.gets("Peer-Address").unwrap_or("").to_string();
            }
        }
        // A connection that has not authenticated may only say Hello and
        // Authenticate: one small frame. Anything else is refused before it
        // is decoded.
        let unauthenticated = self
            .gate
            .as_ref()
            .is_some_and(|g| !g.is_authenticated(&peer));
        if unauthenticated && (frames.len() != 1 || frames[0].len() > HANDSHAKE_BYTES) {
            let id = frames
                .first()
                .and_then(|f| wire::peek_request_id(f))
                .unwrap_or(0);
            return self.refuse_unauthenticated(&peer, id);
        }
        let bytes: usize = frames.iter().map(|f| f.len()).sum();
        // Runs stay here: their feeds are checked against the session's
        // graph before they are copied (`PeerSegments::feed_types`).
        let offload = bytes >= OFFLOAD_BYTES
            && frames
                .first()
                .and_then(|f| wire::peek_request_name(f))
                .is_some_and(|name| name != "run");
        let (peer, frames) = if offload {
            match self.decoder.submit(peer.clone(), frames, t0) {
                Ok(()) => {
                    self.decoding.insert(peer);
                    return Ok(());
                }
                // The decoder thread is gone: decoded here.
                Err(back) => back,
            }
        } else {
            (peer, frames)
        };
        let segments = PeerSegments {
            sessions: &self.sessions,
            peer: &peer,
        };
        let decoded =
            wire::decode_request_with(&frames, &self.config.limits, self.pool.as_ref(), &segments);
        drop(frames);
        self.decode_took = t0.elapsed();
        tracing::trace!(
            bytes,
            decode_us = t0.elapsed().as_micros() as u64,
            "request decoded"
        );
        self.handle_decoded(peer, decoded)
    }

    /// Answers a decoded request (or its decoding error).
    pub(super) fn handle_decoded(
        &mut self,
        peer: Vec<u8>,
        decoded: Result<Envelope<Request>, wire::DecodeError>,
    ) -> Result<(), zmq::Error> {
        self.handle_decoded_from(peer, decoded, None)
    }

    /// [`Frontend::handle_decoded`]; `rung` is the doorbell the request was
    /// taken from (its id already recorded), `None` for the socket.
    pub(super) fn handle_decoded_from(
        &mut self,
        peer: Vec<u8>,
        decoded: Result<Envelope<Request>, wire::DecodeError>,
        rung: Option<&lanes_adaptor::wire::shm::Doorbell>,
    ) -> Result<(), zmq::Error> {
        let unauthenticated = self
            .gate
            .as_ref()
            .is_some_and(|g| !g.is_authenticated(&peer));
        let env = match decoded {
            Ok(env) => env,
            Err(e) => {
                if let Some(suppressed) = self.bad_messages.allow() {
                    tracing::warn!(peer = %peer_label(&peer), code = %e.error.code(), error = %wire::bounded_text(&e.to_string()), suppressed, "bad message");
                }
                let id = e.request_id.unwrap_or(0);
                return self.send_error(&peer, id, e.error.code(), &e.to_string());
            }
        };
        let Envelope {
            request_id,
            message,
        } = env;
        if self.stopping.is_some() {
            return self.refuse_stopping(&peer, request_id);
        }
        tracing::debug!(peer = %peer_label(&peer), request = message.name(), request_id, "request");
        if unauthenticated
            && !matches!(
                message,
                Request::Hello { .. } | Request::Authenticate { .. }
            )
        {
            return self.refuse_unauthenticated(&peer, request_id);
        }
        let reply = match message {
            Request::Hello { .. } if !wire::auth::is_chosen_id(&peer) => {
                Reply::error(ErrorCode::BadRequest, super::UNCHOSEN_ID)
            }
            Request::Hello { client } => {
                tracing::debug!(peer = %peer_label(&peer), %client, "hello");
                let origin = std::mem::take(&mut self.opening_from);
                match self
                    .gate
                    .as_mut()
                    .map(|g| g.challenge(&peer, &origin))
                    .transpose()
                {
                    Ok(challenge) => Reply::Hello {
                        server: format!("lanes/{}", env!("CARGO_PKG_VERSION")),
                        version: wire::PROTOCOL_VERSION,
                        limits: self.config.limits,
                        desk: self.desk.as_ref().map(|d| d.name().to_string()),
                        challenge,
                    },
                    Err(busy) => Reply::error(ErrorCode::Overloaded, busy.to_string()),
                }
            }
            Request::Authenticate { nonce, proof } => match self.gate.as_mut() {
                None => Reply::error(
                    ErrorCode::BadRequest,
                    "this service does not authenticate its peers",
                ),
                Some(gate) => match gate.authenticate(&peer, &nonce, &proof) {
                    Ok(proof) => {
                        tracing::debug!(peer = %peer_label(&peer), "authenticated");
                        Reply::Authenticated { proof }
                    }
                    Err(e) => {
                        if let Some(suppressed) = self.bad_messages.allow() {
                            tracing::warn!(peer = %peer_label(&peer), reason = %e, suppressed, "authentication refused");
                        }
                        Reply::error(ErrorCode::Unauthenticated, e.to_string())
                    }
                },
            },
            Request::OpenSession(spec) => self.open(&peer, spec),
            Request::ShareMemory { session, offer } => self.share(&peer, session, &offer),
            Request::Status => Reply::Status(self.status()),
            Request::CloseSession { session } => match self.owned(&peer, session) {
                Ok(_) => {
                    let dropped = self.dispatcher.cancel(session);
                    self.sessions.remove(&session);
                    self.forget_bells();
                    self.dispatcher.wake(); // its memory may admit a waiting job
                    tracing::info!(%session, dropped, "session closed");
                    self.trim_soon();
                    Reply::SessionClosed { session }
                }
                Err(e) => Reply::Error(e),
            },
            Request::LoadGraph {
                session,
                graph,
                variables,
            } => {
                let decoded = std::mem::take(&mut self.decode_took);
                let work = Work::Load {
                    graph,
                    variables,
                    decoded,
                };
                return self.queue(peer, request_id, session, work);
            }
            Request::Run {
                session,
                feeds,
                fetches,
            } => {
                let feeds = RunFeeds::Frames(feeds);
                let work = Work::Run {
                    feeds,
                    fetches,
                    reply: None,
                };
                return self.queue(peer, request_id, session, work);
            }
            Request::RunShared {
                session,
                feeds,
                fetches,
                reply,
                doorbell,
            } => {
                if !self.first_copy(&peer, session, request_id, doorbell, rung) {
                    return Ok(());
                }
                let feeds = RunFeeds::Shared(feeds);
                let work = Work::Run {
                    feeds,
                    fetches,
                    reply,
                };
                return self.queue(peer, request_id, session, work);
            }
            Request::ReadVariables { session, names } => {
                return self.queue(peer, request_id, session, Work::ReadVariables { names })
            }
            Request::WriteVariables { session, variables } => {
                return self.queue(
                    peer,
                    request_id,
                    session,
                    Work::WriteVariables { variables },
                )
            }
        };
        self.reply(&peer, request_id, &reply)
    }
}
