//! Doorbells of busy-polling clients' feed buffers, learned from the Runs
//! that name them (see `wire::shm::Doorbell`): which copy of a Run is
//! served, and taking Runs rung there.

use std::time::Instant;

use lanes_adaptor::wire::{self, SessionId};

use super::{peer_label, Frontend, PeerSegments, MAX_SEGMENTS_PER_SESSION};

/// A doorbell this thread polls, and the last request id taken through it
/// (from the doorbell or the socket: the other copy is dropped).
pub(super) struct Bell {
    peer: Vec<u8>,
    session: SessionId,
    bell: lanes_adaptor::wire::shm::Doorbell,
    last: u64,
}

/// Most doorbells one session may have polled (its feed buffers' count is
/// bounded by its segments).
const MAX_BELLS_PER_SESSION: usize = MAX_SEGMENTS_PER_SESSION;

impl Frontend {
    /// Whether this copy of a shared Run is the first the service sees: a
    /// Run naming a doorbell comes both through it and through the socket,
    /// and only the first copy is served. A copy from the socket records
    /// its id (and makes the doorbell known); one from a doorbell was
    /// recorded when it was taken, and must name that doorbell.
    pub(super) fn first_copy(
        &mut self,
        peer: &[u8],
        session: SessionId,
        request_id: u64,
        named: Option<lanes_adaptor::wire::shm::Doorbell>,
        rung: Option<&lanes_adaptor::wire::shm::Doorbell>,
    ) -> bool {
        let Some(named) = named else {
            return rung.is_none();
        };
        if let Some(from) = rung {
            return from.same(&named);
        }
        if let Some(b) = self
            .bells
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
        let mine: Vec<usize> = (0..self.bells.len())
            .filter(|&i| self.bells[i].session == session)
            .collect();
        if mine.len() >= MAX_BELLS_PER_SESSION {
            self.bells.remove(mine[0]);
        }
        self.bells.push(Bell {
            peer: peer.to_vec(),
            session,
            bell: named,
            last: request_id,
        });
        true
    }

    /// Forgets the doorbells of sessions gone (and their segments'
    /// mappings with them).
    pub(super) fn forget_bells(&mut self) {
        let sessions = &self.sessions;
        self.bells
            .retain(|b| sessions.get(&b.session).is_some_and(|e| e.owner == b.peer));
    }

    /// Takes the Runs rung in the doorbells since their last, and handles
    /// each as if it came through the socket. A peer with requests held
    /// behind a decode is skipped (its Run comes through the socket, in
    /// order).
    pub(super) fn poll_bells(&mut self) -> Result<(), zmq::Error> {
        let mut taken = Vec::new();
        for b in &mut self.bells {
            // The common turn: nothing rung, one load per doorbell.
            if !b.bell.rung_since(b.last)
                || self.decoding.contains(&b.peer)
                || self.held.contains_key(&b.peer)
            {
                continue;
            }
            if let Some((id, bytes)) = b.bell.take(b.last) {
                b.last = id;
                taken.push((b.peer.clone(), id, bytes, b.bell.clone()));
            }
        }
        for (peer, id, bytes, bell) in taken {
            let t0 = Instant::now();
            // The copy must be the request the doorbell's word names, and
            // a Run (never a large request that would go to the decoder).
            if wire::peek_request_id(&bytes) != Some(id)
                || wire::peek_request_name(&bytes) != Some("run")
                || self
                    .gate
                    .as_ref()
                    .is_some_and(|g| !g.is_authenticated(&peer))
            {
                tracing::debug!(peer = %peer_label(&peer), id, "a doorbell rung with something else than its Run");
                continue;
            }
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
            self.handle_decoded_from(peer, decoded, Some(&bell))?;
        }
        Ok(())
    }
}
