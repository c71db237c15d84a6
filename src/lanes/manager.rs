//! The lane manager: admission under the safety condition, lanes opened,
//! grown and re-partitioned inside one reservation, and the admission
//! queue. A plain struct: the service owns it on one thread (or behind
//! [`super::SharedLanes`]); it never touches memory itself, it decides
//! where things go and reports the relocations the owner must perform.
//!
//! **Layout of a lane** `[start, start + capacity)`: the persistent regions
//! of its jobs side by side from `start`, in admission order, then one
//! ephemeral arena of `max T` bytes shared by all its jobs (one iteration
//! runs at a time in a lane), then unused slack. The **safety condition**
//! `sum P + max T <= capacity` is exactly "this layout fits".
//!
//! **Admission** of a job (P, T), in order of preference:
//! 1. the best-fitting lane that holds it as it is (least capacity left over);
//! 2. a new lane of exactly `P + T` bytes in the best-fitting free range
//!    (unless `max_lanes` are open);
//! 3. growing a lane into the free range right after it (least growth);
//! 4. re-partitioning: every lane shrunk to what its jobs need and packed
//!    from offset 0, so all free space is one range; then 2 or 3;
//! 5. otherwise the job waits in the admission queue, with the reason.
//!
//! **Classes.** Every job comes with a [`LaneClass`] (the policy's
//! `lane_class`: under `priority`, inference jobs are one class and the
//! rest another; every other policy puts all jobs in one). Jobs of
//! different classes never share a lane (steps 1, 3 and 4 only consider
//! lanes of the job's class), and `max_lanes` bounds the lanes of each
//! class on its own, so an urgent job never waits for a lower-urgency
//! job's iteration in its own lane, however many of those are open.
//!
//! A job needing more than the whole reservation is refused at once.
//!
//! **Release** takes a job out of its lane; the persistent regions after
//! it slide down (relocations reported); an empty lane closes. Then the
//! queue is scanned in its order (the policy's admission rank, then
//! arrival; see [`LaneManager::admit_ranked`]) and every job that now fits (by
//! steps 1–4) is admitted. Hence the invariant the property tests check:
//! a queued job never fits even after re-partitioning.
//!
//! **Relocations** ([`Move`]) only ever concern persistent regions (arena
//! contents do not outlive an iteration). They are listed in an order in
//! which applying them one by one as `memmove`s is safe (see
//! [`super::Reservation::apply_moves`]); the owner applies them at an
//! iteration boundary, before any job of a moved lane runs again
//! ([`super::SharedLanes`] does so with layout epochs).

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::fmt;

use crate::size::ByteSize;
pub use lanes_policies::{AdmissionRank, LaneClass};

/// Largest reservation the manager accepts: sums of sizes it forms (at
/// most twice the capacity) then never overflow.
pub const MAX_CAPACITY: u64 = 1 << 62;

/// A job known to the manager (the service uses its session id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "job {}", self.0)
    }
}

/// A lane; ids are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LaneId(pub u32);

impl fmt::Display for LaneId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "L{}", self.0)
    }
}

/// Size of the reservation and how it may be divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LanesConfig {
    /// Bytes of the reservation.
    pub capacity: u64,
    /// P and T are rounded up to this (a power of two); lanes start on it.
    pub alignment: u64,
    /// Most lanes open at once (each runs on its own stream / worker).
    pub max_lanes: usize,
}

impl LanesConfig {
    pub fn new(capacity: u64) -> Self {
        LanesConfig {
            capacity,
            alignment: crate::compile::DEFAULT_ALIGNMENT,
            max_lanes: 8,
        }
    }
}

/// How a job asks for memory: its place in the admission queue if it has
/// to wait, and the class of lanes it may share (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ask {
    pub rank: AdmissionRank,
    pub class: LaneClass,
}

/// Why a request to the manager is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error(
        "{job} needs {needed} bytes (P + T), more than the whole reservation of {available} bytes"
    )]
    TooLarge {
        job: JobId,
        needed: u64,
        available: u64,
    },
    #[error("{job} is already admitted or queued")]
    Duplicate { job: JobId },
    #[error("{job} is not known to the lane manager")]
    Unknown { job: JobId },
    #[error("lanes config invalid: {reason}")]
    Config { reason: &'static str },
}

impl AdmitError {
    /// Stable code for wire replies and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            AdmitError::TooLarge { .. } => "too_large",
            AdmitError::Duplicate { .. } => "duplicate_job",
            AdmitError::Unknown { .. } => "unknown_job",
            AdmitError::Config { .. } => "lanes_config",
        }
    }
}

/// Where an admitted job's memory is (valid until the next relocation
/// that names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub job: JobId,
    pub lane: LaneId,
    /// Start of the job's persistent region (absolute, in the reservation).
    pub p_offset: u64,
    pub p_bytes: u64,
    /// Start of the lane's shared ephemeral arena.
    pub arena_offset: u64,
    /// Size of that arena (the lane's max T, at least this job's T).
    pub arena_bytes: u64,
}

/// A persistent region to relocate: copy `bytes` from `from` to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub job: JobId,
    pub lane: LaneId,
    pub from: u64,
    pub to: u64,
    pub bytes: u64,
}

/// Why a job waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueReason {
    /// The job's P + T (aligned).
    pub needed: u64,
    /// Bytes that re-partitioning could make free (reservation minus what
    /// the admitted jobs need).
    pub free_after_repartition: u64,
    /// Cheapest way in: the least extra bytes over that free space any
    /// lane (or a new lane) would need.
    pub cheapest: u64,
    /// Whether a new lane was ruled out by `max_lanes` (the lanes of the
    /// job's class).
    pub lanes_full: bool,
}

impl fmt::Display for QueueReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "needs {} (P + T); cheapest placement needs {}, only {} free after re-partitioning",
            ByteSize(self.needed),
            ByteSize(self.cheapest),
            ByteSize(self.free_after_repartition)
        )?;
        if self.lanes_full {
            write!(f, " (all lanes open)")?;
        }
        Ok(())
    }
}

/// What `admit` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// In a lane now. `moves` must be applied before the moved jobs run.
    Admitted {
        placement: Placement,
        moves: Vec<Move>,
    },
    /// Waiting; `position` is 0 for the head of the queue.
    Queued {
        position: usize,
        reason: QueueReason,
    },
}

/// What `release` did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Released {
    /// The job was still waiting (nothing was freed).
    pub was_queued: bool,
    /// Lanes closed because they became empty.
    pub closed: Vec<LaneId>,
    /// Relocations, in the order to apply them.
    pub moves: Vec<Move>,
    /// Waiting jobs admitted as a result, with their final placements.
    pub admitted: Vec<Placement>,
}

#[derive(Debug, Clone)]
pub(super) struct Resident {
    pub(super) job: JobId,
    pub(super) p: u64,
    pub(super) t: u64,
}

#[derive(Debug, Clone)]
pub(super) struct Lane {
    pub(super) id: LaneId,
    pub(super) start: u64,
    pub(super) capacity: u64,
    /// The class of every job in it.
    pub(super) class: LaneClass,
    pub(super) jobs: Vec<Resident>,
}

impl Lane {
    pub(super) fn p_sum(&self) -> u64 {
        self.jobs.iter().map(|r| r.p).sum()
    }
    pub(super) fn max_t(&self) -> u64 {
        self.jobs.iter().map(|r| r.t).max().unwrap_or(0)
    }
    pub(super) fn required(&self) -> u64 {
        self.p_sum() + self.max_t()
    }
    pub(super) fn required_with(&self, p: u64, t: u64) -> u64 {
        self.p_sum() + p + self.max_t().max(t)
    }
    pub(super) fn end(&self) -> u64 {
        self.start + self.capacity
    }
    pub(super) fn placement(&self, k: usize) -> Placement {
        let before: u64 = self.jobs[..k].iter().map(|r| r.p).sum();
        Placement {
            job: self.jobs[k].job,
            lane: self.id,
            p_offset: self.start + before,
            p_bytes: self.jobs[k].p,
            arena_offset: self.start + self.p_sum(),
            arena_bytes: self.max_t(),
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Waiting {
    pub(super) job: JobId,
    pub(super) p: u64,
    pub(super) t: u64,
    /// Its place in the queue (smaller first, then arrival).
    pub(super) rank: AdmissionRank,
    pub(super) class: LaneClass,
}

/// Lanes inside one reservation, and the admission queue.
#[derive(Debug, Clone)]
pub struct LaneManager {
    pub(super) cfg: LanesConfig,
    /// Sorted by `start`, pairwise disjoint.
    pub(super) lanes: Vec<Lane>,
    pub(super) queue: VecDeque<Waiting>,
    pub(super) next_lane: u32,
}

/// Where to put a job once space is found.
enum Target {
    Lane(usize),
    NewLane(u64, LaneClass),
}

impl LaneManager {
    pub fn new(cfg: LanesConfig) -> Result<Self, AdmitError> {
        if cfg.alignment == 0 || !cfg.alignment.is_power_of_two() {
            return Err(AdmitError::Config {
                reason: "alignment must be a power of two",
            });
        }
        if cfg.capacity > MAX_CAPACITY {
            return Err(AdmitError::Config {
                reason: "capacity above 2^62 bytes",
            });
        }
        if cfg.max_lanes == 0 {
            return Err(AdmitError::Config {
                reason: "max_lanes must be at least 1",
            });
        }
        Ok(LaneManager {
            cfg,
            lanes: Vec::new(),
            queue: VecDeque::new(),
            next_lane: 0,
        })
    }

    pub fn config(&self) -> &LanesConfig {
        &self.cfg
    }

    fn align(&self, bytes: u64) -> Option<u64> {
        let a = self.cfg.alignment;
        bytes.checked_add(a - 1).map(|b| b & !(a - 1))
    }

    fn knows(&self, job: JobId) -> bool {
        self.lanes
            .iter()
            .any(|l| l.jobs.iter().any(|r| r.job == job))
            || self.queue.iter().any(|w| w.job == job)
    }

    /// (P, T) of a job as the lanes hold them (rounded up to the
    /// alignment; a job of no bytes takes one unit), or `TooLarge` when
    /// they could never fit in the reservation.
    pub fn sizes(&self, job: JobId, p: u64, t: u64) -> Result<(u64, u64), AdmitError> {
        let too_large = |needed| AdmitError::TooLarge {
            job,
            needed,
            available: self.cfg.capacity,
        };
        let (p, mut t) = match (self.align(p), self.align(t)) {
            (Some(p), Some(t)) => (p, t),
            _ => return Err(too_large(u64::MAX)),
        };
        if p == 0 && t == 0 {
            t = self.cfg.alignment; // every job takes some room: lanes are never empty ranges
        }
        let need = p.checked_add(t).ok_or_else(|| too_large(u64::MAX))?;
        if need > self.cfg.capacity {
            return Err(too_large(need));
        }
        Ok((p, t))
    }

    /// Admits `job` with persistent bytes `p` and ephemeral bytes `t` now,
    /// or queues it until it fits. Refuses a job that could never fit.
    pub fn admit(&mut self, job: JobId, p: u64, t: u64) -> Result<Admission, AdmitError> {
        self.admit_ranked(job, p, t, AdmissionRank::default())
    }

    /// [`LaneManager::admit`] for a job that, if it has to wait, stands at
    /// `rank` in the queue: the queue is kept in (rank, arrival) order and
    /// tried in that order when memory is freed (the scheduling policy's
    /// admission order, `lanes_policies::Policy::admission_rank`).
    pub fn admit_ranked(
        &mut self,
        job: JobId,
        p: u64,
        t: u64,
        rank: AdmissionRank,
    ) -> Result<Admission, AdmitError> {
        self.admit_asking(job, p, t, Ask { rank, class: 0 })
    }

    /// [`LaneManager::admit_ranked`] at `ask.rank`, sharing a lane only
    /// with jobs of `ask.class`.
    pub fn admit_asking(
        &mut self,
        job: JobId,
        p: u64,
        t: u64,
        ask: Ask,
    ) -> Result<Admission, AdmitError> {
        if self.knows(job) {
            return Err(AdmitError::Duplicate { job });
        }
        let (p, t) = self.sizes(job, p, t)?;
        let Ask { rank, class } = ask;
        if let Some((placement, moves)) = self.try_place(job, p, t, class) {
            return Ok(Admission::Admitted { placement, moves });
        }
        let reason = self.reason(p, t, class);
        let position = self.queue.partition_point(|w| w.rank <= rank);
        self.queue.insert(
            position,
            Waiting {
                job,
                p,
                t,
                rank,
                class,
            },
        );
        Ok(Admission::Queued { position, reason })
    }

    /// Takes `job` out of its lane (or the queue) and admits every waiting
    /// job that now fits.
    pub fn release(&mut self, job: JobId) -> Result<Released, AdmitError> {
        if let Some(i) = self.queue.iter().position(|w| w.job == job) {
            self.queue.remove(i);
            return Ok(Released {
                was_queued: true,
                ..Released::default()
            });
        }
        let (li, k) = self
            .lanes
            .iter()
            .enumerate()
            .find_map(|(li, l)| l.jobs.iter().position(|r| r.job == job).map(|k| (li, k)))
            .ok_or(AdmitError::Unknown { job })?;
        let mut out = Released::default();
        let lane = &mut self.lanes[li];
        let before: u64 = lane.jobs[..k].iter().map(|r| r.p).sum();
        let gone = lane.jobs.remove(k);
        let mut from = lane.start + before + gone.p;
        for r in &lane.jobs[k..] {
            if gone.p > 0 && r.p > 0 {
                out.moves.push(Move {
                    job: r.job,
                    lane: lane.id,
                    from,
                    to: from - gone.p,
                    bytes: r.p,
                });
            }
            from += r.p;
        }
        if lane.jobs.is_empty() {
            out.closed.push(lane.id);
            self.lanes.remove(li);
        }
        let mut admitted = Vec::new();
        let mut i = 0;
        while i < self.queue.len() {
            let w = self.queue[i].clone();
            if let Some((_, moves)) = self.try_place(w.job, w.p, w.t, w.class) {
                out.moves.extend(moves);
                admitted.push(w.job);
                self.queue.remove(i);
            } else {
                i += 1;
            }
        }
        out.admitted = admitted
            .into_iter()
            .filter_map(|j| self.placement(j))
            .collect();
        Ok(out)
    }

    /// Current placement of an admitted job.
    pub fn placement(&self, job: JobId) -> Option<Placement> {
        self.lanes.iter().find_map(|l| {
            l.jobs
                .iter()
                .position(|r| r.job == job)
                .map(|k| l.placement(k))
        })
    }

    /// The byte range `[start, end)` of an open lane.
    pub fn lane_span(&self, lane: LaneId) -> Option<(u64, u64)> {
        self.lanes
            .iter()
            .find(|l| l.id == lane)
            .map(|l| (l.start, l.end()))
    }

    /// Jobs waiting in the admission queue, in queue order.
    pub fn waiting_jobs(&self) -> Vec<JobId> {
        self.queue.iter().map(|w| w.job).collect()
    }

    /// True while `job` waits in the admission queue.
    pub fn is_queued(&self, job: JobId) -> bool {
        self.queue.iter().any(|w| w.job == job)
    }

    /// Bytes that re-partitioning could free: the reservation minus what
    /// every lane's jobs need.
    pub fn free_after_repartition(&self) -> u64 {
        self.cfg.capacity - self.lanes.iter().map(Lane::required).sum::<u64>()
    }

    /// Free ranges between and after lanes: (start, len), len > 0.
    pub(super) fn gaps(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut cursor = 0;
        for l in &self.lanes {
            if l.start > cursor {
                out.push((cursor, l.start - cursor));
            }
            cursor = l.end();
        }
        if self.cfg.capacity > cursor {
            out.push((cursor, self.cfg.capacity - cursor));
        }
        out
    }

    /// Lanes open for jobs of `class`.
    fn lanes_of(&self, class: LaneClass) -> usize {
        self.lanes.iter().filter(|l| l.class == class).count()
    }

    pub(super) fn reason(&self, p: u64, t: u64, class: LaneClass) -> QueueReason {
        let lanes_full = self.lanes_of(class) >= self.cfg.max_lanes;
        let grow = self
            .lanes
            .iter()
            .filter(|l| l.class == class)
            .map(|l| l.required_with(p, t) - l.required())
            .min();
        let cheapest = match (lanes_full, grow) {
            (false, Some(g)) => g.min(p + t),
            (false, None) => p + t,
            (true, Some(g)) => g,
            (true, None) => p + t,
        };
        QueueReason {
            needed: p + t,
            free_after_repartition: self.free_after_repartition(),
            cheapest,
            lanes_full,
        }
    }

    /// Steps 1–4 of admission (see the module docs).
    fn try_place(
        &mut self,
        job: JobId,
        p: u64,
        t: u64,
        class: LaneClass,
    ) -> Option<(Placement, Vec<Move>)> {
        let need = p + t;
        let can_open = self.lanes_of(class) < self.cfg.max_lanes;
        // 1. Best-fitting lane of its class as it is.
        let fit = self
            .lanes
            .iter()
            .enumerate()
            .filter(|(_, l)| l.class == class && l.required_with(p, t) <= l.capacity)
            .min_by_key(|(_, l)| (l.capacity - l.required_with(p, t), l.start))
            .map(|(i, _)| i);
        if let Some(i) = fit {
            return Some((self.put(Target::Lane(i), job, p, t), Vec::new()));
        }
        // 2. A new lane in the best-fitting free range.
        if can_open {
            let gap = self
                .gaps()
                .into_iter()
                .filter(|&(_, len)| len >= need)
                .min_by_key(|&(start, len)| (len, start));
            if let Some((start, _)) = gap {
                return Some((
                    self.put(Target::NewLane(start, class), job, p, t),
                    Vec::new(),
                ));
            }
        }
        // 3. Grow a lane of its class into the free range right after it.
        let grow = (0..self.lanes.len())
            .filter_map(|i| {
                let l = &self.lanes[i];
                if l.class != class {
                    return None;
                }
                let next = self.lanes.get(i + 1).map_or(self.cfg.capacity, |n| n.start);
                let extra = l.required_with(p, t) - l.capacity;
                (extra <= next - l.end()).then_some((extra, i))
            })
            .min();
        if let Some((extra, i)) = grow {
            self.lanes[i].capacity += extra;
            return Some((self.put(Target::Lane(i), job, p, t), Vec::new()));
        }
        // 4. Re-partition, then a new lane or the cheapest growth.
        let free = self.free_after_repartition();
        if can_open && need <= free {
            let moves = self.compact(None);
            let start = self.lanes.last().map_or(0, Lane::end);
            return Some((self.put(Target::NewLane(start, class), job, p, t), moves));
        }
        let (extra, i) = self
            .lanes
            .iter()
            .enumerate()
            .filter(|(_, l)| l.class == class)
            .map(|(i, l)| (l.required_with(p, t) - l.required(), i))
            .min()?;
        if extra > free {
            return None;
        }
        let cap = self.lanes[i].required_with(p, t);
        let moves = self.compact(Some((i, cap)));
        Some((self.put(Target::Lane(i), job, p, t), moves))
    }

    fn put(&mut self, target: Target, job: JobId, p: u64, t: u64) -> Placement {
        let li = match target {
            Target::Lane(i) => i,
            Target::NewLane(start, class) => {
                let id = LaneId(self.next_lane);
                self.next_lane = self.next_lane.wrapping_add(1);
                let pos = self.lanes.partition_point(|l| l.start < start);
                self.lanes.insert(
                    pos,
                    Lane {
                        id,
                        start,
                        capacity: p + t,
                        class,
                        jobs: Vec::new(),
                    },
                );
                pos
            }
        };
        let lane = &mut self.lanes[li];
        lane.jobs.push(Resident { job, p, t });
        lane.placement(lane.jobs.len() - 1)
    }

    /// Packs every lane from offset 0 in address order, each shrunk to what
    /// its jobs need (lane `grow.0` sized `grow.1` instead). Returns the
    /// relocations in a safe order: leftward moves by ascending source, then
    /// rightward moves by descending source. Relative order is kept, so no
    /// move overwrites a region that has yet to move.
    fn compact(&mut self, grow: Option<(usize, u64)>) -> Vec<Move> {
        let mut left = Vec::new();
        let mut right = Vec::new();
        let mut cursor = 0u64;
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            let cap = match grow {
                Some((g, c)) if g == i => c,
                _ => lane.required(),
            };
            if lane.start != cursor {
                let mut off = 0;
                for r in &lane.jobs {
                    if r.p > 0 {
                        let m = Move {
                            job: r.job,
                            lane: lane.id,
                            from: lane.start + off,
                            to: cursor + off,
                            bytes: r.p,
                        };
                        if m.to < m.from {
                            left.push(m);
                        } else {
                            right.push(m);
                        }
                    }
                    off += r.p;
                }
            }
            lane.start = cursor;
            lane.capacity = cap;
            cursor += cap;
        }
        left.sort_by_key(|m| m.from);
        right.sort_by_key(|m| std::cmp::Reverse(m.from));
        left.extend(right);
        left
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
