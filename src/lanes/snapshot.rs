//! What `lanes status` shows: a copy of the lane manager's state.

use serde::{Deserialize, Serialize};
use std::fmt;

use super::manager::{JobId, LaneClass, LaneId, LaneManager, QueueReason};
use crate::size::ByteSize;

impl LaneManager {
    /// A copy of the state for `lanes status`, tests and the scheduler.
    pub fn snapshot(&self) -> LanesSnapshot {
        let lanes: Vec<LaneSnapshot> = self
            .lanes
            .iter()
            .map(|l| LaneSnapshot {
                id: l.id,
                start: l.start,
                capacity: l.capacity,
                used: l.required(),
                arena_offset: l.start + l.p_sum(),
                arena_bytes: l.max_t(),
                class: l.class,
                jobs: (0..l.jobs.len())
                    .map(|k| {
                        let pl = l.placement(k);
                        JobSnapshot {
                            job: l.jobs[k].job,
                            p: l.jobs[k].p,
                            t: l.jobs[k].t,
                            p_offset: pl.p_offset,
                        }
                    })
                    .collect(),
            })
            .collect();
        let gaps = self.gaps();
        let free: u64 = gaps.iter().map(|g| g.1).sum();
        let largest_free = gaps.iter().map(|g| g.1).max().unwrap_or(0);
        let slack: u64 = lanes.iter().map(|l| l.capacity - l.used).sum();
        let reclaimable = free + slack;
        LanesSnapshot {
            capacity: self.cfg.capacity,
            alignment: self.cfg.alignment,
            max_lanes: self.cfg.max_lanes,
            lanes,
            queue: self
                .queue
                .iter()
                .map(|w| QueuedSnapshot {
                    job: w.job,
                    p: w.p,
                    t: w.t,
                    reason: self.reason(w.p, w.t, w.class),
                })
                .collect(),
            free,
            largest_free,
            slack,
            fragmentation: if reclaimable == 0 {
                0.0
            } else {
                1.0 - largest_free as f64 / reclaimable as f64
            },
        }
    }
}

/// One job in a lane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSnapshot {
    pub job: JobId,
    pub p: u64,
    pub t: u64,
    pub p_offset: u64,
}

/// One lane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneSnapshot {
    pub id: LaneId,
    pub start: u64,
    pub capacity: u64,
    /// `sum P + max T` of its jobs: the safety condition is `used <= capacity`.
    pub used: u64,
    pub arena_offset: u64,
    pub arena_bytes: u64,
    /// The class of its jobs (`lanes_policies::Policy::lane_class`; under
    /// `priority` 1 for inference jobs, else 0).
    #[serde(default)]
    pub class: LaneClass,
    pub jobs: Vec<JobSnapshot>,
}

/// One waiting job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedSnapshot {
    pub job: JobId,
    pub p: u64,
    pub t: u64,
    pub reason: QueueReason,
}

/// The whole state, as `lanes status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LanesSnapshot {
    pub capacity: u64,
    pub alignment: u64,
    pub max_lanes: usize,
    pub lanes: Vec<LaneSnapshot>,
    pub queue: Vec<QueuedSnapshot>,
    /// Bytes in no lane.
    pub free: u64,
    /// The largest free range: the biggest new lane possible without moves.
    pub largest_free: u64,
    /// Bytes inside lanes that their jobs do not need.
    pub slack: u64,
    /// `1 - largest_free / (free + slack)`: 0 when all reclaimable space is
    /// one range, near 1 when it is scattered.
    pub fragmentation: f64,
}

impl fmt::Display for LanesSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "reservation {}, {} lane(s) of at most {} a class; free {} (largest range {}), slack {}, fragmentation {:.2}",
            ByteSize(self.capacity),
            self.lanes.len(),
            self.max_lanes,
            ByteSize(self.free),
            ByteSize(self.largest_free),
            ByteSize(self.slack),
            self.fragmentation
        )?;
        for l in &self.lanes {
            write!(
                f,
                "{:<5} at {:>12}  capacity {:>12}  used {:>12}  arena {:>12}  {} job(s)",
                l.id.to_string(),
                l.start,
                ByteSize(l.capacity).to_string(),
                ByteSize(l.used).to_string(),
                ByteSize(l.arena_bytes).to_string(),
                l.jobs.len()
            )?;
            if l.class != 0 {
                write!(f, "  class {}", l.class)?;
            }
            writeln!(f)?;
            for j in &l.jobs {
                writeln!(
                    f,
                    "      {:<10} P {:>12}  T {:>12}  at {}",
                    j.job.to_string(),
                    ByteSize(j.p).to_string(),
                    ByteSize(j.t).to_string(),
                    j.p_offset
                )?;
            }
        }
        if self.queue.is_empty() {
            writeln!(f, "queue: empty")?;
        } else {
            writeln!(f, "queue: {} waiting", self.queue.len())?;
            for q in &self.queue {
                writeln!(f, "      {:<10} {}", q.job.to_string(), q.reason)?;
            }
        }
        Ok(())
    }
}
