//! Doorbells of busy-polling clients' feed buffers, learned from the Runs
//! that name them (see `wire::shm::Doorbell`): which copy of a Run is
//! served, and taking Runs rung there.
//!
//! What a ring may cost is bounded: a doorbell is at most the service's
//! `max_doorbell_bytes` (a Run naming a larger one is refused when it is
//! decoded); the length word, the request id and the request's kind are
//! checked where they lie, so a ring with anything else costs a few loads
//! and copies nothing; each connection has at most one ring taken per turn
//! of the socket thread's loop, whatever its number of doorbells; and
//! after [`MAX_GARBAGE_RINGS`] rings that were not a Run the service could
//! take, the connection's doorbells are closed for as long as it has
//! sessions ([`BellClosed`], logged): its Runs then come through the
//! socket only, and its doorbells cost nothing more.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use lanes_adaptor::wire::shm::Doorbell;
use lanes_adaptor::wire::{self, Request, SessionId};

use super::{peer_label, Frontend, PeerSegments, MAX_SEGMENTS_PER_SESSION};
use crate::server::metrics::RingOutcome;

/// A doorbell this thread polls, and the last request id taken through it
/// (from the doorbell or the socket: the other copy is dropped).
struct Bell {
    peer: Vec<u8>,
    session: SessionId,
    bell: Doorbell,
    last: u64,
}

/// Most doorbells one session may have polled (its feed buffers' count is
/// bounded by its segments).
const MAX_BELLS_PER_SESSION: usize = MAX_SEGMENTS_PER_SESSION;

/// Rings of a connection's doorbells that held no Run the service could
/// take (garbage, another id than the word's, another request, a Run that
/// does not decode or names another doorbell) before its doorbells are
/// closed. A client that rings only its own Runs never makes one.
pub(crate) const MAX_GARBAGE_RINGS: u32 = 16;

/// Why a connection's doorbells were closed (its Runs still come through
/// the socket).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum BellClosed {
    #[error(
        "{rings} rings of its doorbells held no Run the service could take (the last: {last})"
    )]
    Garbage { rings: u32, last: String },
}

/// The doorbells the socket thread polls, and what their connections'
/// rings cost so far.
#[derive(Default)]
pub(super) struct Bells {
    list: Vec<Bell>,
    /// Rings that held no Run to take, per connection.
    garbage: HashMap<Vec<u8>, u32>,
    /// Connections whose doorbells were closed, and why.
    closed: HashMap<Vec<u8>, BellClosed>,
    /// Where the next turn starts in `list` (round robin).
    start: usize,
}

impl Bells {
    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.list.clear();
    }
}

impl Frontend {
    /// Whether this copy of a shared Run is the first the service sees: a
    /// Run naming a doorbell comes both through it and through the socket,
    /// and only the first copy is served. A copy from the socket records
    /// its id (and makes the doorbell known, unless the connection's
    /// doorbells were closed); one from a doorbell was recorded when it
    /// was taken, and must name that doorbell.
    pub(super) fn first_copy(
        &mut self,
        peer: &[u8],
        session: SessionId,
        request_id: u64,
        named: Option<Doorbell>,
        rung: Option<&Doorbell>,
    ) -> bool {
        let Some(named) = named else {
            return rung.is_none();
        };
        if let Some(from) = rung {
            return from.same(&named);
        }
        if self.bells.closed.contains_key(peer) {
            return true;
        }
        let list = &mut self.bells.list;
        if let Some(b) = list
            .iter_mut()
            .find(|b| b.session == session && b.peer == peer && b.bell.same(&named))
        {
            if request_id <= b.last {
                tracing::trace!(%session, request_id, "taken from its doorbell already");
                return false;
            }
            b.last = request_id;
            return true;
        }
        // A new doorbell of the session: its oldest goes beyond the bound.
        let mine: Vec<usize> = (0..list.len())
            .filter(|&i| list[i].session == session)
            .collect();
        if mine.len() >= MAX_BELLS_PER_SESSION {
            list.remove(mine[0]);
        }
        list.push(Bell {
            peer: peer.to_vec(),
            session,
            bell: named,
            last: request_id,
        });
        true
    }

    /// Forgets the doorbells of sessions gone (and their segments'
    /// mappings with them), and what the rings of connections without
    /// sessions cost.
    pub(super) fn forget_bells(&mut self) {
        let sessions = &self.sessions;
        self.bells
            .list
            .retain(|b| sessions.get(&b.session).is_some_and(|e| e.owner == b.peer));
        let owners: HashSet<&[u8]> = sessions.values().map(|e| e.owner.as_slice()).collect();
        self.bells
            .garbage
            .retain(|p, _| owners.contains(p.as_slice()));
        self.bells
            .closed
            .retain(|p, _| owners.contains(p.as_slice()));
    }

    /// Counts a ring of `peer`'s that held no Run to take; at the
    /// [`MAX_GARBAGE_RINGS`]th its doorbells are closed.
    fn garbage_ring(&mut self, peer: &[u8], why: &dyn std::fmt::Display) {
        if let Some(m) = &self.config.metrics {
            m.doorbell_ring(RingOutcome::Garbage, 0);
        }
        let rings = self.bells.garbage.entry(peer.to_vec()).or_insert(0);
        *rings += 1;
        tracing::debug!(peer = %peer_label(peer), rings = *rings, reason = %why, "a doorbell rung with no Run to take");
        if *rings < MAX_GARBAGE_RINGS {
            return;
        }
        let reason = BellClosed::Garbage {
            rings: *rings,
            last: why.to_string(),
        };
        tracing::warn!(peer = %peer_label(peer), %reason, "doorbells closed: this connection's Runs come through the socket only");
        if let Some(m) = &self.config.metrics {
            m.doorbells_closed();
        }
        self.bells.list.retain(|b| b.peer != peer);
        self.bells.closed.insert(peer.to_vec(), reason);
    }

    /// Takes the Runs rung in the doorbells since their last, at most one
    /// per connection per turn (starting at another doorbell each turn),
    /// and handles each as if it came through the socket. A peer with
    /// requests held behind a decode is skipped (its Run comes through
    /// the socket, in order).
    pub(super) fn poll_bells(&mut self) -> Result<(), zmq::Error> {
        let mut taken = Vec::new();
        let mut served: HashSet<Vec<u8>> = HashSet::new();
        let n = self.bells.list.len();
        let start = self.bells.start % n.max(1);
        self.bells.start = start + 1;
        let (list, decoding, held) = (&mut self.bells.list, &self.decoding, &self.held);
        let (back, front) = list.split_at_mut(start);
        for b in front.iter_mut().chain(back.iter_mut()) {
            // The common turn: nothing rung, one load per doorbell.
            if !b.bell.rung_since(b.last)
                || served.contains(&b.peer)
                || decoding.contains(&b.peer)
                || held.contains_key(&b.peer)
            {
                continue;
            }
            if let Some((id, copy)) = b.bell.take(b.last) {
                b.last = id;
                served.insert(b.peer.clone());
                taken.push((b.peer.clone(), id, copy, b.bell.clone()));
            }
        }
        for (peer, id, copy, bell) in taken {
            let t0 = Instant::now();
            let bytes = match copy {
                Ok(bytes) => bytes,
                Err(why) => {
                    self.garbage_ring(&peer, &why);
                    continue;
                }
            };
            if self
                .gate
                .as_ref()
                .is_some_and(|g| !g.is_authenticated(&peer))
            {
                self.garbage_ring(&peer, &"the connection has not authenticated");
                continue;
            }
            let copied = bytes.len() as u64;
            let frames = [zmq::Message::from(bytes)];
            let segments = PeerSegments {
                sessions: &self.sessions,
                peer: &peer,
            };
            let decoded = wire::decode_request_with(
                &frames,
                &self.config.limits,
                self.pool.as_ref(),
                &segments,
            );
            tracing::trace!(
                request_id = id,
                decode_us = t0.elapsed().as_micros() as u64,
                "request taken from a doorbell"
            );
            // Only a Run naming this doorbell is served from it; anything
            // else is the client's garbage, answered nowhere (its socket
            // copy, if any, gets the reply).
            match &decoded {
                Ok(env) => match &env.message {
                    Request::RunShared {
                        doorbell: Some(named),
                        ..
                    } if named.same(&bell) => {}
                    _ => {
                        self.garbage_ring(
                            &peer,
                            &"a request that is not a Run naming this doorbell",
                        );
                        continue;
                    }
                },
                Err(e) => {
                    self.garbage_ring(&peer, e);
                    continue;
                }
            }
            if let Some(m) = &self.config.metrics {
                m.doorbell_ring(RingOutcome::Taken, copied);
            }
            self.handle_decoded_from(peer, decoded, Some(&bell))?;
        }
        Ok(())
    }
}
