//! Shared-memory segments offered by local jobs: attaching them, and the
//! address space their mappings take, bounded per connection
//! (`--max-shared-per-client`) and in all (`--max-shared`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lanes_adaptor::wire::shm::{AttachedSegment, SegmentOffer, SharedMemoryError};
use lanes_adaptor::wire::{ErrorCode, Reply, SessionId};

use super::{Frontend, MAX_SEGMENTS_PER_SESSION};

/// Why a segment was not mapped: its mappings would take more address
/// space than a cap allows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum MapRefused {
    #[error(
        "this connection's segments already take {mapped} bytes of the service's address space; {more} more would pass its limit of {limit} (--max-shared-per-client)"
    )]
    Client { mapped: u64, more: u64, limit: u64 },
    #[error(
        "the segments of all clients already take {mapped} bytes of the service's address space; {more} more would pass its limit of {limit} (--max-shared)"
    )]
    Service { mapped: u64, more: u64, limit: u64 },
}

/// The address space segments' mappings take: per connection and in all.
/// Counted when a segment is mapped, given back when its last holder (the
/// session's table, a Run in flight, a program that registered it) drops
/// it and it is unmapped ([`Charge`]).
#[derive(Debug)]
pub(super) struct MappedSpace {
    per_client: HashMap<Vec<u8>, Arc<AtomicU64>>,
    total: Arc<AtomicU64>,
    client_limit: u64,
    limit: u64,
}

/// One segment's share of [`MappedSpace`], held by the segment and given
/// back once it is unmapped.
#[derive(Debug)]
struct Charge {
    client: Arc<AtomicU64>,
    total: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.client.fetch_sub(self.bytes, Ordering::AcqRel);
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl MappedSpace {
    pub(super) fn new(client_limit: u64, limit: u64) -> Self {
        MappedSpace {
            per_client: HashMap::new(),
            total: Arc::new(AtomicU64::new(0)),
            client_limit,
            limit,
        }
    }

    /// Bytes mapped for `peer`'s segments now.
    pub(super) fn of(&self, peer: &[u8]) -> u64 {
        self.per_client
            .get(peer)
            .map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Bytes mapped for all segments now.
    pub(super) fn total(&self) -> u64 {
        self.total.load(Ordering::Acquire)
    }

    /// Whether `peer` may map `more` bytes. Only the socket thread adds
    /// (here, then [`MappedSpace::charge`]); others only give back, so a
    /// check passed stays true until the charge.
    fn check(&self, peer: &[u8], more: u64) -> Result<(), MapRefused> {
        let mapped = self.of(peer);
        if mapped.saturating_add(more) > self.client_limit {
            return Err(MapRefused::Client {
                mapped,
                more,
                limit: self.client_limit,
            });
        }
        let mapped = self.total();
        if mapped.saturating_add(more) > self.limit {
            return Err(MapRefused::Service {
                mapped,
                more,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// Counts `seg`'s mappings against `peer` until they are unmapped.
    fn charge(&mut self, peer: &[u8], seg: AttachedSegment) -> AttachedSegment {
        let bytes = seg.mapped_bytes();
        let client = Arc::clone(self.per_client.entry(peer.to_vec()).or_default());
        client.fetch_add(bytes, Ordering::AcqRel);
        self.total.fetch_add(bytes, Ordering::AcqRel);
        seg.with_charge(Charge {
            client,
            total: Arc::clone(&self.total),
            bytes,
        })
    }

    /// Forgets the connections none of whose segments is mapped any more.
    pub(super) fn forget_unmapped(&mut self) {
        self.per_client
            .retain(|_, c| Arc::strong_count(c) > 1 || c.load(Ordering::Acquire) > 0);
    }
}

impl Frontend {
    /// Attaches a job's shared-memory segment to its session (replacing
    /// one of the same id): the descriptor the peer handed to the desk
    /// under the offer's token, never a file the peer names, and only
    /// while the address space of the connection's segments and of all
    /// segments stays within its caps.
    pub(super) fn share(&mut self, peer: &[u8], session: SessionId, offer: &SegmentOffer) -> Reply {
        if let Err(e) = self.owned(peer, session) {
            return Reply::Error(e);
        }
        let Some(desk) = self.desk.as_mut() else {
            return Reply::error(
                ErrorCode::SharedMemory,
                "this service does not attach shared memory (--no-shared-memory)",
            );
        };
        // A segment holds one Run's feeds: no larger than the largest
        // message the service accepts.
        let limits = &self.config.limits;
        let limit = (limits.max_frame_bytes as u64).saturating_mul(limits.max_frames as u64);
        let full = self.sessions.get(&session).is_some_and(|e| {
            e.segments.len() >= MAX_SEGMENTS_PER_SESSION && !e.segments.contains_key(&offer.segment)
        });
        if full {
            return Reply::error(
                ErrorCode::SharedMemory,
                format!("session {session} already has {MAX_SEGMENTS_PER_SESSION} segments"),
            );
        }
        // At most two mappings (read-only, writable), checked before any:
        // a refused offer maps nothing. Its descriptor is taken (closed)
        // all the same, so it does not wait on the desk.
        let at_most = offer.bytes.saturating_mul(2);
        if let Err(refused) = self.mapped.check(peer, at_most) {
            drop(desk.take(&offer.token));
            tracing::warn!(%session, segment = offer.segment, bytes = offer.bytes, reason = %refused, "shared memory refused");
            return Reply::error(
                ErrorCode::SharedMemory,
                format!("cannot attach the segment: {refused}"),
            );
        }
        let attached = desk
            .take(&offer.token)
            .ok_or(SharedMemoryError::NotHandedOver)
            .and_then(|file| AttachedSegment::attach(file, offer, limit));
        match attached {
            Ok(seg) => {
                let seg = self.mapped.charge(peer, seg);
                tracing::debug!(%session, segment = offer.segment, bytes = offer.bytes, mapped = seg.mapped_bytes(), "shared memory attached");
                if let Some(entry) = self.sessions.get_mut(&session) {
                    entry.segments.insert(offer.segment, Arc::new(seg));
                }
                Reply::MemoryShared {
                    session,
                    segment: offer.segment,
                }
            }
            Err(e) => {
                tracing::debug!(%session, error = %e, "shared memory refused");
                Reply::error(
                    ErrorCode::SharedMemory,
                    format!("cannot attach the segment: {e}"),
                )
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn caps_hold_per_client_and_in_all() {
        let m = MappedSpace::new(100, 150);
        assert_eq!(m.check(b"a", 100), Ok(()));
        assert!(matches!(m.check(b"a", 101), Err(MapRefused::Client { .. })));
        // Charged by hand (no segment needed): a's 100, then b's 60 would
        // pass the service's 150.
        let a = Charge {
            client: Arc::new(AtomicU64::new(100)),
            total: Arc::clone(&m.total),
            bytes: 100,
        };
        m.total.fetch_add(100, Ordering::AcqRel);
        assert_eq!(m.total(), 100);
        assert!(matches!(
            m.check(b"b", 60),
            Err(MapRefused::Service { mapped: 100, .. })
        ));
        assert_eq!(m.check(b"b", 50), Ok(()));
        drop(a);
        assert_eq!(m.total(), 0);
        assert_eq!(m.check(b"b", 100), Ok(()));
    }
}
