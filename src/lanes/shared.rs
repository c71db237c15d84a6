//! The lane manager and the reservation behind one lock, for a service
//! whose sessions live on several threads.
//!
//! A [`Lease`] stands for one job: admitted or waiting, its memory (or its
//! place in the queue) is given back when the lease is dropped, so a
//! session that closes or vanishes frees its memory by dropping its lease.
//! A waiting job blocks in [`Lease::wait`] until a release admits it.
//!
//! **Turns.** A lane runs one iteration at a time: [`SharedLanes::turn`]
//! holds the lane until the returned [`LaneTurn`] is dropped; different
//! lanes run at the same time.
//!
//! **Layout epochs** (only for lanes that own memory, [`SharedLanes::new`];
//! [`SharedLanes::accounting_only`] lanes keep the books and the turns
//! alone). While a turn runs, its job may read and write its persistent
//! region and its lane's arena ([`LaneTurn::memory`]) without the lock, so
//! those bytes must neither move nor be handed to someone else meanwhile:
//! - every admit or release that changes the books bumps the layout's
//!   *epoch*; a turn records the epoch it started in;
//! - a new turn starts only when its lane is free **and** no active turn
//!   started in an older epoch: after a layout change, new turns wait
//!   until the turns of the old layout have ended (one iteration at most;
//!   the change goes first, so a stream of turns cannot starve it);
//! - relocations ([`super::Move`]) are applied at once when no turn is
//!   active; otherwise they are queued, and the first turn to start after
//!   the old turns have ended (no turn is active then) applies them before
//!   it reads its placement. Admit and release never wait for turns: a
//!   thread holding a turn may drop a lease.
//! - [`SharedLanes::with_memory`] / [`SharedLanes::with_persistent`] lend
//!   the whole reservation: they wait until no turn is active (new turns
//!   wait for them meanwhile) and apply the queued moves first.
//!
//! So a turn sees its job's bytes at the placement read when it started,
//! for as long as it lasts. Calling `with_memory`, `with_persistent` or
//! `turn` from a thread that holds a turn of the same lanes can wait for
//! that very turn: don't.
//!
//! **Lock.** One mutex guards the books, the reservation and the table of
//! active turns (there is no other lock, so no lock order to keep); two
//! condition variables hang off it: `admitted` (a release admitted jobs)
//! and `turn_over` (a turn ended, or a lender of the reservation is done).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::manager::{
    Admission, AdmitError, Ask, JobId, LaneId, LaneManager, LanesConfig, Move, Placement, Released,
};
use super::reservation::{Reservation, ReserveError};
use super::snapshot::LanesSnapshot;
use super::turn::LaneTurn;

/// What the one lock guards.
#[derive(Debug)]
pub(super) struct State {
    pub(super) manager: LaneManager,
    pub(super) memory: Option<Reservation>,
    /// The layout's epoch: bumped by every admit/release that changes the
    /// books (lanes that own memory only).
    pub(super) epoch: u64,
    /// The active turns, by lane (a lane has at most one).
    pub(super) turns: HashMap<LaneId, ActiveTurn>,
    /// Relocations reported while turns were active, in order.
    pub(super) pending: Vec<Move>,
    /// Lenders of the reservation waiting for the turns to end.
    pub(super) lenders: usize,
}

/// An active turn, as the lock's table knows it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ActiveTurn {
    /// The epoch it started in.
    pub(super) epoch: u64,
    /// Its lane's byte range `[start, end)` when it started.
    pub(super) span: (u64, u64),
}

impl State {
    /// A layout change: a new epoch; `moves` applied now when no turn is
    /// active, queued otherwise.
    fn relayout(&mut self, moves: &[Move]) {
        if self.memory.is_none() {
            return;
        }
        self.epoch += 1;
        self.pending.extend_from_slice(moves);
        if self.turns.is_empty() {
            self.apply_pending();
        }
    }

    /// Applies the queued moves; does nothing while a turn is active (its
    /// slices may cover the bytes; callers only call it when none is).
    fn apply_pending(&mut self) {
        if !self.turns.is_empty() {
            return;
        }
        if let (Some(mem), false) = (self.memory.as_mut(), self.pending.is_empty()) {
            // Moves stay inside the reservation by construction.
            let _ = mem.apply_moves(&self.pending);
        }
        self.pending.clear();
    }

    /// Whether a turn of `lane` may start now.
    fn may_start(&self, lane: LaneId) -> bool {
        !self.turns.contains_key(&lane)
            && self.lenders == 0
            && self.turns.values().all(|t| t.epoch == self.epoch)
            // Implied by the epochs (moves queue only behind older turns); kept
            // so that a turn never starts over bytes still to be moved.
            && (self.pending.is_empty() || self.turns.is_empty())
    }
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// Notified after every release that admitted someone.
    admitted: Condvar,
    /// Notified when a turn ends or a lender of the reservation is done.
    turn_over: Condvar,
    /// Unique in the process: keys the lanes' device memory.
    id: u64,
}

/// Ids of [`SharedLanes`] instances.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A cloneable handle to the lanes of one reservation.
#[derive(Debug, Clone)]
pub struct SharedLanes {
    inner: Arc<Inner>,
}

/// Why shared lanes could not be created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedError {
    #[error(transparent)]
    Admit(#[from] AdmitError),
    #[error(transparent)]
    Reserve(#[from] ReserveError),
}

impl SharedLanes {
    /// Lanes over a fresh reservation of `cfg.capacity` bytes, with layout
    /// epochs (see the module docs).
    pub fn new(cfg: LanesConfig) -> Result<Self, SharedError> {
        let manager = LaneManager::new(cfg)?;
        let memory = Reservation::new(cfg.capacity)?;
        Ok(Self::from_parts(manager, Some(memory)))
    }

    /// Lanes that only keep the books (no memory is reserved, turns have no
    /// [`LaneTurn::memory`]): for the GPU service, the simulator and tests.
    pub fn accounting_only(cfg: LanesConfig) -> Result<Self, AdmitError> {
        Ok(Self::from_parts(LaneManager::new(cfg)?, None))
    }

    fn from_parts(manager: LaneManager, memory: Option<Reservation>) -> Self {
        SharedLanes {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    manager,
                    memory,
                    epoch: 0,
                    turns: HashMap::new(),
                    pending: Vec::new(),
                    lenders: 0,
                }),
                admitted: Condvar::new(),
                turn_over: Condvar::new(),
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            }),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the books consistent (every
        // mutation completes before returning), so a poisoned lock is used.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Unique in the process.
    pub(super) fn id(&self) -> u64 {
        self.inner.id
    }

    /// Admits `job` now or queues it. The lease releases it on drop.
    pub fn admit(&self, job: JobId, p: u64, t: u64) -> Result<(Lease, Admission), AdmitError> {
        self.admit_asking(job, p, t, Ask::default())
    }

    /// [`SharedLanes::admit`] at `ask.rank` in the queue if it has to wait,
    /// sharing a lane only with jobs of `ask.class` (see
    /// [`LaneManager::admit_asking`]).
    pub fn admit_asking(
        &self,
        job: JobId,
        p: u64,
        t: u64,
        ask: Ask,
    ) -> Result<(Lease, Admission), AdmitError> {
        let mut st = self.lock();
        let a = st.manager.admit_asking(job, p, t, ask)?;
        if let Admission::Admitted { moves, .. } = &a {
            st.relayout(moves);
        }
        drop(st);
        let lease = Lease {
            lanes: self.clone(),
            job,
            live: true,
        };
        Ok((lease, a))
    }

    /// Admits a job with the P and T of its memory plan.
    pub fn admit_plan(
        &self,
        job: JobId,
        plan: &crate::compile::MemoryPlan,
    ) -> Result<(Lease, Admission), AdmitError> {
        self.admit(job, plan.persistent, plan.ephemeral)
    }

    /// Releases `job` (admitted or waiting) and wakes jobs admitted as a
    /// result. Never waits for turns.
    pub fn release(&self, job: JobId) -> Result<Released, AdmitError> {
        let mut st = self.lock();
        let r = st.manager.release(job)?;
        if !r.was_queued {
            st.relayout(&r.moves);
        }
        drop(st);
        if !r.admitted.is_empty() {
            self.inner.admitted.notify_all();
        }
        Ok(r)
    }

    /// (P, T) as the lanes would hold them for `job`, or `TooLarge` when
    /// they could never fit (see `LaneManager::sizes`).
    pub fn sizes(&self, job: JobId, p: u64, t: u64) -> Result<(u64, u64), AdmitError> {
        self.lock().manager.sizes(job, p, t)
    }

    /// Current placement of `job` in the books, if admitted (its bytes may
    /// still wait for queued moves: a turn's placement is where they are).
    pub fn placement(&self, job: JobId) -> Option<Placement> {
        self.lock().manager.placement(job)
    }

    /// Blocks until `job` is admitted (its placement), it is no longer
    /// known (`None`), or `timeout` passes (`None`).
    pub fn wait_admitted(&self, job: JobId, timeout: Duration) -> Option<Placement> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if let Some(p) = st.manager.placement(job) {
                return Some(p);
            }
            if !st.manager.is_queued(job) {
                return None;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self
                .inner
                .admitted
                .wait_timeout(st, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Waits until `job`'s lane is free (and, for lanes that own memory,
    /// until no turn of an older layout is active, see the module docs),
    /// then holds the lane until the returned turn is dropped: a lane runs
    /// one iteration at a time (its jobs share one ephemeral arena),
    /// different lanes run at the same time. `None` when the job is not
    /// admitted.
    pub fn turn(&self, job: JobId) -> Option<LaneTurn> {
        self.take_turn(job, true)
    }

    /// [`SharedLanes::turn`] without waiting: `None` also when the turn
    /// cannot start now (the lane runs an iteration, or a layout change
    /// waits for older turns).
    pub fn try_turn(&self, job: JobId) -> Option<LaneTurn> {
        self.take_turn(job, false)
    }

    fn take_turn(&self, job: JobId, wait: bool) -> Option<LaneTurn> {
        let mut st = self.lock();
        loop {
            let placement = st.manager.placement(job)?;
            if st.may_start(placement.lane) {
                if st.turns.is_empty() {
                    st.apply_pending();
                }
                let span = st.manager.lane_span(placement.lane).unwrap_or((
                    placement.p_offset,
                    placement.arena_offset + placement.arena_bytes,
                ));
                let epoch = st.epoch;
                st.turns.insert(placement.lane, ActiveTurn { epoch, span });
                return Some(LaneTurn::new(self.clone(), placement, epoch));
            }
            if !wait {
                return None;
            }
            st = self.wait_turn_over(st);
        }
    }

    fn wait_turn_over<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.inner
            .turn_over
            .wait(st)
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the turn of `lane` (called when a [`LaneTurn`] drops).
    pub(super) fn end_turn(&self, lane: LaneId) {
        self.lock().turns.remove(&lane);
        self.inner.turn_over.notify_all();
    }

    /// Every job in a lane with one of `jobs` (those included): what a
    /// dispatcher holds back while `jobs` run, so that no worker waits for
    /// a lane's turn.
    pub fn lane_mates(&self, jobs: impl IntoIterator<Item = JobId>) -> Vec<JobId> {
        let busy: HashSet<JobId> = jobs.into_iter().collect();
        if busy.is_empty() {
            return Vec::new();
        }
        let st = self.lock();
        let lanes: HashSet<LaneId> = busy
            .iter()
            .filter_map(|&j| st.manager.placement(j).map(|p| p.lane))
            .collect();
        if lanes.is_empty() {
            return Vec::new();
        }
        st.manager
            .snapshot()
            .lanes
            .into_iter()
            .filter(|l| lanes.contains(&l.id))
            .flat_map(|l| l.jobs.into_iter().map(|j| j.job))
            .collect()
    }

    /// Jobs waiting in the admission queue.
    pub fn waiting_jobs(&self) -> Vec<JobId> {
        self.lock().manager.waiting_jobs()
    }

    /// A copy of the state for `lanes status`.
    pub fn snapshot(&self) -> LanesSnapshot {
        self.lock().manager.snapshot()
    }

    /// Runs `f` with the whole reservation under the lock, once no turn is
    /// active and the queued moves are applied (new turns wait meanwhile).
    /// `None` when no memory is reserved (at once) or `f` gives `None`.
    fn lend<R>(&self, f: impl FnOnce(&mut State) -> Option<R>) -> Option<R> {
        let mut st = self.lock();
        st.memory.as_ref()?;
        if !st.turns.is_empty() {
            st.lenders += 1;
            while !st.turns.is_empty() {
                st = self.wait_turn_over(st);
            }
            st.lenders -= 1;
        }
        st.apply_pending();
        let out = f(&mut st);
        drop(st);
        // Turns held back by this lender may start.
        self.inner.turn_over.notify_all();
        out
    }

    /// Runs `f` with `job`'s current placement and the reservation, under
    /// the lock, once no turn is active (so nothing moves or runs
    /// meanwhile). `None` when the job is not admitted or no memory is
    /// reserved. Must not be called while holding a turn of these lanes.
    pub fn with_memory<R>(
        &self,
        job: JobId,
        f: impl FnOnce(Placement, &mut Reservation) -> R,
    ) -> Option<R> {
        self.lend(|st| {
            let p = st.manager.placement(job)?;
            st.memory.as_mut().map(|mem| f(p, mem))
        })
    }

    /// Runs `f` on the reservation's bytes of `job`'s persistent region (as
    /// [`Self::with_memory`]).
    pub fn with_persistent<R>(&self, job: JobId, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        self.lend(|st| {
            let p = st.manager.placement(job)?;
            let mem = st.memory.as_mut()?;
            mem.region_mut(p.p_offset, p.p_bytes).ok().map(f)
        })
    }
}

/// One job's claim on the lanes; releases it when dropped.
#[derive(Debug)]
pub struct Lease {
    lanes: SharedLanes,
    job: JobId,
    live: bool,
}

impl Lease {
    pub fn job(&self) -> JobId {
        self.job
    }

    /// Current placement, if admitted.
    pub fn placement(&self) -> Option<Placement> {
        self.lanes.placement(self.job)
    }

    /// The job's turn on its lane (see [`SharedLanes::turn`]).
    pub fn turn(&self) -> Option<LaneTurn> {
        self.lanes.turn(self.job)
    }

    /// The job's turn if it can start now (see [`SharedLanes::try_turn`]).
    pub fn try_turn(&self) -> Option<LaneTurn> {
        self.lanes.try_turn(self.job)
    }

    /// Blocks until admitted or `timeout` passes.
    pub fn wait(&self, timeout: Duration) -> Option<Placement> {
        self.lanes.wait_admitted(self.job, timeout)
    }

    /// Releases now, reporting what the release did.
    pub fn release(mut self) -> Result<Released, AdmitError> {
        self.live = false;
        self.lanes.release(self.job)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.live {
            // Unknown only if released by hand through `SharedLanes::release`.
            let _ = self.lanes.release(self.job);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
