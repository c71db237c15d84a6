//! A job's turn on its lane, and the memory the turn may use.
//!
//! [`LaneTurn::memory`] lends the job's persistent region and its lane's
//! ephemeral arena as two slices of 8-byte words, for as long as the turn
//! is borrowed. The layout epochs of [`super::SharedLanes`] keep those bytes
//! in place and owned by this lane while the turn lasts; before building
//! the slices the turn checks, under the lock, everything their soundness
//! rests on (bounds, alignment, disjointness, and that no other active
//! turn's lane overlaps its own), so a broken invariant gives `None`, not
//! undefined behaviour. This file and `Reservation`'s two whole-mapping
//! accessors hold the only `unsafe` of the lanes.

use std::fmt;
use std::ops::Range;

use super::manager::{LaneId, Placement};
use super::shared::{SharedLanes, State};

/// A job's turn on its lane (see [`SharedLanes::turn`]); ends on drop.
#[derive(Debug)]
pub struct LaneTurn {
    lanes: SharedLanes,
    /// The job's placement when the turn started.
    placement: Placement,
    /// The layout epoch it started in.
    epoch: u64,
}

/// The memory of a job during its turn: its persistent region and its
/// lane's arena, as 8-byte words (see [`LaneTurn::memory`]).
pub struct JobMemory<'a> {
    /// Where the two ranges are in the reservation (read when the turn
    /// started).
    pub placement: Placement,
    /// `[p_offset, p_offset + p_bytes)`: the job's persistent bytes.
    pub persistent: &'a mut [u64],
    /// `[arena_offset, arena_offset + arena_bytes)`: the lane's ephemeral
    /// arena, shared with the lane's other jobs (its contents do not
    /// outlive an iteration).
    pub arena: &'a mut [u64],
}

impl fmt::Debug for JobMemory<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobMemory")
            .field("placement", &self.placement)
            .field("persistent_words", &self.persistent.len())
            .field("arena_words", &self.arena.len())
            .finish()
    }
}

impl LaneTurn {
    pub(super) fn new(lanes: SharedLanes, placement: Placement, epoch: u64) -> Self {
        LaneTurn {
            lanes,
            placement,
            epoch,
        }
    }

    pub fn lane(&self) -> LaneId {
        self.placement.lane
    }

    /// The job's placement when the turn started: where its bytes are for
    /// the whole turn (on lanes that own memory).
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The lane's key, unique in the process (for device memory shared by
    /// the lane's jobs).
    pub fn key(&self) -> u64 {
        (self.lanes.id() << 32) | u64::from(self.placement.lane.0)
    }

    /// The job's persistent region and its lane's arena in the
    /// reservation, usable until the borrow of the turn ends. `None` on
    /// [`SharedLanes::accounting_only`] lanes (no memory), or when a check
    /// fails: ranges outside the reservation or not word-aligned (a lanes
    /// `alignment` below 8), the two ranges overlapping or leaving the
    /// job's lane, or the lane overlapping another active turn's lane (the
    /// layout epochs exclude the last three).
    pub fn memory(&mut self) -> Option<JobMemory<'_>> {
        let (base, p, arena) = {
            let st = self.lanes.lock();
            checked_words(&st, self.placement, self.epoch)?
        };
        #[allow(unsafe_code)]
        // SAFETY: `base` is the first word of the reservation's mapping,
        // page-aligned, and `p` and `arena` are word ranges inside it
        // (checked by `checked_words` against its capacity). The mapping
        // stays in place for the whole borrow: it is owned by the lanes'
        // state, kept alive by `self.lanes`, and replaced or dropped only
        // through `&mut Reservation`, which the lanes lend only while no
        // turn is active (this one is, until it drops, after the borrow).
        // No other reference covers these words during the borrow:
        // - `p` and `arena` are disjoint (checked);
        // - another turn's slices lie in its lane's span, fixed for its
        //   life; of two concurrent turns, the one building its slices
        //   second checked that the two spans are disjoint, and ours lie
        //   in our span (checked);
        // - `Reservation::region`, `region_mut` and `apply_moves` are only
        //   reached through the lanes while no turn is active
        //   (`with_memory` / `with_persistent` wait; moves reported during
        //   a turn are queued until the turns have ended);
        // - the slices borrow `&mut self`: they end before this turn ends,
        //   and before `memory` is called again on it.
        let (persistent, arena) = unsafe {
            (
                std::slice::from_raw_parts_mut(base.add(p.start), p.len()),
                std::slice::from_raw_parts_mut(base.add(arena.start), arena.len()),
            )
        };
        Some(JobMemory {
            placement: self.placement,
            persistent,
            arena,
        })
    }
}

impl Drop for LaneTurn {
    fn drop(&mut self) {
        self.lanes.end_turn(self.placement.lane);
    }
}

/// `[offset, offset + len)` as a range of words, if it lies inside
/// `capacity` bytes and is word-aligned.
fn words(offset: u64, len: u64, capacity: u64) -> Option<Range<u64>> {
    let end = offset.checked_add(len)?;
    (end <= capacity && offset % 8 == 0 && len % 8 == 0).then_some(offset..end)
}

/// Whether two byte ranges share a byte.
fn overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// Whether `inner` lies inside `outer`.
fn within(inner: &Range<u64>, outer: &Range<u64>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

/// The checks `LaneTurn::memory` rests on, under the lock: the turn of
/// `placement.lane` that started in `epoch` is active, the reservation
/// exists, both ranges are inside it, word-aligned, disjoint and inside the
/// turn's lane span, and no other active turn's span overlaps that span.
/// Gives the mapping's base and the two ranges in words.
fn checked_words(
    st: &State,
    placement: Placement,
    epoch: u64,
) -> Option<(*mut u64, Range<usize>, Range<usize>)> {
    let mem = st.memory.as_ref()?;
    let me = st.turns.get(&placement.lane)?;
    if me.epoch != epoch {
        return None;
    }
    let cap = mem.capacity();
    let p = words(placement.p_offset, placement.p_bytes, cap)?;
    let arena = words(placement.arena_offset, placement.arena_bytes, cap)?;
    let span = me.span.0..me.span.1;
    if overlap(&p, &arena) || !within(&p, &span) || !within(&arena, &span) {
        return None;
    }
    let clash = st
        .turns
        .iter()
        .any(|(&lane, t)| lane != placement.lane && overlap(&(t.span.0..t.span.1), &span));
    if clash {
        return None;
    }
    // Inside a mapping of `cap` bytes, which fits in isize: no truncation.
    let w = |r: Range<u64>| (r.start / 8) as usize..(r.end / 8) as usize;
    Some((mem.base(), w(p), w(arena)))
}
