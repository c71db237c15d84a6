//! The lane manager and the reservation behind one lock, for a service
//! whose sessions live on several threads.
//!
//! A [`Lease`] stands for one job: admitted or waiting, its memory (or its
//! place in the queue) is given back when the lease is dropped, so a
//! session that closes or vanishes frees its memory by dropping its lease.
//! A waiting job blocks in [`Lease::wait`] until a release admits it.
//!
//! Relocations are applied to the reservation under the lock as soon as
//! the manager reports them. On the CPU backend executors keep tensors in
//! their own buffers and the reservation only stands in for device memory,
//! so moving its bytes at any time is safe; a device backend must instead
//! apply them at the moved lanes' next iteration boundary.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::manager::{
    Admission, AdmitError, JobId, LaneId, LaneManager, LanesConfig, Placement, Released,
};
use super::reservation::{Reservation, ReserveError};
use super::snapshot::LanesSnapshot;

#[derive(Debug)]
struct State {
    manager: LaneManager,
    memory: Option<Reservation>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// Notified after every release that admitted someone.
    admitted: Condvar,
    /// Lanes running an iteration now (see [`SharedLanes::turn`]).
    busy: Mutex<HashSet<LaneId>>,
    /// Notified when a lane's turn ends.
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
    /// Lanes over a fresh reservation of `cfg.capacity` bytes.
    pub fn new(cfg: LanesConfig) -> Result<Self, SharedError> {
        let manager = LaneManager::new(cfg)?;
        let memory = Reservation::new(cfg.capacity)?;
        Ok(Self::from_parts(manager, Some(memory)))
    }

    /// Lanes that only keep the books (no memory is reserved): for the
    /// simulator and tests.
    pub fn accounting_only(cfg: LanesConfig) -> Result<Self, AdmitError> {
        Ok(Self::from_parts(LaneManager::new(cfg)?, None))
    }

    fn from_parts(manager: LaneManager, memory: Option<Reservation>) -> Self {
        SharedLanes {
            inner: Arc::new(Inner {
                state: Mutex::new(State { manager, memory }),
                admitted: Condvar::new(),
                busy: Mutex::new(HashSet::new()),
                turn_over: Condvar::new(),
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the books consistent (every
        // mutation completes before returning), so a poisoned lock is used.
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits `job` now or queues it. The lease releases it on drop.
    pub fn admit(&self, job: JobId, p: u64, t: u64) -> Result<(Lease, Admission), AdmitError> {
        let mut st = self.lock();
        let a = st.manager.admit(job, p, t)?;
        if let (Admission::Admitted { moves, .. }, Some(mem)) = (&a, st.memory.as_mut()) {
            // Moves stay inside the reservation by construction.
            let _ = mem.apply_moves(moves);
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

    /// Releases `job` (admitted or waiting) and wakes jobs admitted as a result.
    pub fn release(&self, job: JobId) -> Result<Released, AdmitError> {
        let mut st = self.lock();
        let r = st.manager.release(job)?;
        if let Some(mem) = st.memory.as_mut() {
            let _ = mem.apply_moves(&r.moves);
        }
        drop(st);
        if !r.admitted.is_empty() {
            self.inner.admitted.notify_all();
        }
        Ok(r)
    }

    /// The size and division of the reservation.
    pub fn config(&self) -> LanesConfig {
        *self.lock().manager.config()
    }

    /// Current placement of `job`, if admitted.
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

    /// Waits until no other job of `job`'s lane runs an iteration, then
    /// holds the lane until the returned turn is dropped: a lane runs one
    /// iteration at a time (its jobs share one ephemeral arena), different
    /// lanes run at the same time. `None` when the job is not admitted.
    /// (Lock order: the lanes' turns, then the books.)
    pub fn turn(&self, job: JobId) -> Option<LaneTurn> {
        let mut busy = self
            .inner
            .busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loop {
            let lane = self.placement(job)?.lane;
            if busy.insert(lane) {
                return Some(LaneTurn {
                    lanes: self.clone(),
                    lane,
                });
            }
            busy = self
                .inner
                .turn_over
                .wait(busy)
                .unwrap_or_else(PoisonError::into_inner);
        }
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

    /// Runs `f` with `job`'s current placement and the reservation, under
    /// the lock (so no relocation happens meanwhile). `None` when the job is
    /// not admitted or no memory is reserved.
    pub fn with_memory<R>(
        &self,
        job: JobId,
        f: impl FnOnce(Placement, &mut Reservation) -> R,
    ) -> Option<R> {
        let mut st = self.lock();
        let p = st.manager.placement(job)?;
        st.memory.as_mut().map(|mem| f(p, mem))
    }

    /// Runs `f` on the reservation's bytes of `job`'s persistent region.
    pub fn with_persistent<R>(&self, job: JobId, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        let mut st = self.lock();
        let p = st.manager.placement(job)?;
        let mem = st.memory.as_mut()?;
        mem.region_mut(p.p_offset, p.p_bytes).ok().map(f)
    }
}

/// A job's turn on its lane (see [`SharedLanes::turn`]); ends on drop.
#[derive(Debug)]
pub struct LaneTurn {
    lanes: SharedLanes,
    lane: LaneId,
}

impl LaneTurn {
    pub fn lane(&self) -> LaneId {
        self.lane
    }

    /// The lane's key, unique in the process (for device memory shared by
    /// the lane's jobs).
    pub fn key(&self) -> u64 {
        (self.lanes.inner.id << 32) | u64::from(self.lane.0)
    }
}

impl Drop for LaneTurn {
    fn drop(&mut self) {
        let inner = &self.lanes.inner;
        inner
            .busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.lane);
        inner.turn_over.notify_all();
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
mod tests {
    use super::*;
    use std::thread;

    fn cfg(capacity: u64) -> LanesConfig {
        LanesConfig {
            capacity,
            alignment: 256,
            max_lanes: 4,
        }
    }

    /// Jobs of one lane take turns; jobs of different lanes do not wait
    /// for each other; a job that is not admitted gets no turn.
    #[test]
    fn a_lane_runs_one_iteration_at_a_time() {
        use std::sync::mpsc;
        // One lane: max_lanes 1 puts both jobs in it.
        let one = SharedLanes::accounting_only(LanesConfig {
            max_lanes: 1,
            ..cfg(1 << 20)
        })
        .unwrap();
        let (_a, _) = one.admit(JobId(1), 1024, 1024).unwrap();
        let (b, _) = one.admit(JobId(2), 1024, 1024).unwrap();
        assert_eq!(
            one.placement(JobId(1)).unwrap().lane,
            one.placement(JobId(2)).unwrap().lane
        );
        let first = one.turn(JobId(1)).unwrap();
        let (tx, rx) = mpsc::channel();
        let waiter = thread::spawn(move || {
            let t = b.turn().expect("admitted");
            tx.send(t.lane()).unwrap();
        });
        // The second job waits while the first holds the lane.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        drop(first);
        assert!(rx.recv_timeout(Duration::from_secs(20)).is_ok());
        waiter.join().unwrap();

        // Two lanes: each job gets its turn at once.
        let two = SharedLanes::accounting_only(cfg(1 << 20)).unwrap();
        let (_c, _) = two.admit(JobId(3), 1024, 1024).unwrap();
        let (_d, _) = two.admit(JobId(4), 1024, 1024).unwrap();
        let (l3, l4) = (
            two.placement(JobId(3)).unwrap().lane,
            two.placement(JobId(4)).unwrap().lane,
        );
        assert_ne!(l3, l4);
        let t3 = two.turn(JobId(3)).unwrap();
        let t4 = two.turn(JobId(4)).unwrap();
        assert_ne!(t3.key(), t4.key());
        // Keys differ between two sets of lanes too.
        assert_ne!(one.turn(JobId(1)).unwrap().key(), t3.key());
        assert!(two.turn(JobId(99)).is_none());
    }

    #[test]
    fn dropping_a_lease_admits_the_waiter() {
        // 3 KiB for the first job; the second would need 1 KiB more, 512 B are free.
        let lanes = SharedLanes::new(cfg(3584)).unwrap();
        let (a, adm) = lanes.admit(JobId(1), 1024, 2048).unwrap();
        assert!(matches!(adm, Admission::Admitted { .. }));
        let (b, adm) = lanes.admit(JobId(2), 1024, 2048).unwrap();
        assert!(matches!(adm, Admission::Queued { position: 0, .. }));
        assert_eq!(lanes.snapshot().queue.len(), 1);
        let waiter = {
            let lanes = lanes.clone();
            thread::spawn(move || lanes.wait_admitted(JobId(2), Duration::from_secs(20)))
        };
        drop(a);
        let placed = waiter.join().unwrap().expect("admitted after the drop");
        assert_eq!(placed.job, JobId(2));
        assert_eq!(b.placement(), Some(placed));
        drop(b);
        let s = lanes.snapshot();
        assert!(s.lanes.is_empty() && s.queue.is_empty());
        assert_eq!(s.free, 3584);
    }

    #[test]
    fn persistent_bytes_survive_repartitioning() {
        // Three 1 KiB lanes; free the middle one, then a 2 KiB job forces a compaction.
        let lanes = SharedLanes::new(cfg(3 * 1024 + 1024)).unwrap();
        let mut leases = Vec::new();
        for j in 0..4u64 {
            let (l, _) = lanes.admit(JobId(j), 512, 512).unwrap();
            lanes
                .with_persistent(JobId(j), |b| b.fill(j as u8 + 1))
                .unwrap();
            leases.push(l);
        }
        let gone = leases.remove(1);
        gone.release().unwrap();
        let gone = leases.remove(2);
        gone.release().unwrap();
        let (big, adm) = lanes.admit(JobId(9), 1024, 1024).unwrap();
        let Admission::Admitted { moves, .. } = adm else {
            panic!("should fit after re-partitioning: {adm:?}")
        };
        assert!(!moves.is_empty());
        for j in [0u64, 2] {
            let ok = lanes
                .with_persistent(JobId(j), |b| b.iter().all(|&x| x == j as u8 + 1))
                .unwrap();
            assert!(ok, "job {j} lost its bytes");
        }
        assert!(big.placement().is_some());
        assert!(lanes.wait_admitted(JobId(77), Duration::ZERO).is_none());
    }
}
