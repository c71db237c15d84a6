//! Lanes scheduling policies: sans-IO, deterministic decisions over a snapshot.
//!
//! A [`Policy`] never reads a clock, opens a socket or spawns a thread. The
//! caller (the service's iteration scheduler in `lanes::sched`, or the trace
//! simulator in `lanes::sim`) keeps a [`JobTable`] up to date by applying
//! [`Event`]s, hands the policy the table's snapshot and the current time, and
//! asks it two questions:
//!
//! - [`Policy::pick`]: which waiting job's next iteration runs in a lane now
//!   (called only at iteration boundaries, so preemption never happens
//!   mid-iteration);
//! - [`Policy::place`]: into which lane a new job is admitted, among the lanes
//!   where the safety condition `sum P + max T <= C` holds;
//! - [`Policy::admission_rank`]: in which order jobs waiting for memory are
//!   admitted once memory is freed.
//!
//! ```
//! use lanes_policies::{by_name, Event, JobKind, JobSpec, JobTable};
//! use std::time::Duration;
//!
//! let mut policy = by_name("srtf").unwrap();
//! let mut table = JobTable::new();
//! let now = Duration::ZERO;
//! for (id, iters) in [(1, 10), (2, 3)] {
//!     let spec = JobSpec::new(id, JobKind::Training, iters).with_hint(Duration::from_millis(5));
//!     table.apply(&Event::Arrived { spec, lane: 0 }, now).unwrap();
//!     table.apply(&Event::Queued { job: id }, now).unwrap();
//! }
//! // Job 2 has 3 × 5 ms left, job 1 has 10 × 5 ms: SRTF runs job 2 first.
//! assert_eq!(policy.pick(0, table.jobs(), now), Some(2));
//! ```

mod job;
mod placement;
mod policies;

pub use job::{Event, JobId, JobKind, JobSpec, JobTable, JobView, LaneId, PolicyError};
pub use placement::{best_fit, first_fit, LaneView};
pub use policies::{Fair, Fifo, Pack, PriorityPolicy, Srtf};

use std::time::Duration;

/// A scheduling policy: pure decisions over a snapshot, with the time handed in.
///
/// Implementations must be deterministic: the same sequence of calls with the
/// same arguments gives the same answers.
pub trait Policy: std::fmt::Debug + Send {
    /// The stable name accepted by [`by_name`].
    fn name(&self) -> &'static str;

    /// Observe an event after it was applied to the caller's [`JobTable`].
    /// The built-in policies keep no state of their own and ignore it.
    fn observe(&mut self, _event: &Event, _now: Duration) {}

    /// Choose the waiting job whose next iteration runs in `lane`, or `None`
    /// when no job of that lane is waiting. `jobs` is the whole snapshot; only
    /// jobs with `lane == lane && waiting` may be returned.
    fn pick(&mut self, lane: LaneId, jobs: &[JobView], now: Duration) -> Option<JobId>;

    /// Choose the lane a new job is admitted into, or `None` when it fits in no
    /// lane right now (it waits for admission). Only lanes where
    /// [`LaneView::fits`] holds may be returned. Defaults to [`first_fit`].
    fn place(&mut self, job: &JobSpec, lanes: &[LaneView], _now: Duration) -> Option<LaneId> {
        first_fit(job, lanes)
    }

    /// Where a job that waits for memory stands in the admission queue:
    /// whenever memory is freed, the waiting jobs are tried smallest rank
    /// first (ties in arrival order) and each one that fits is admitted.
    /// The rank depends on the job's declaration alone, so the simulator
    /// and the service order their queues alike. Defaults to arrival order.
    fn admission_rank(&self, _job: &JobSpec) -> AdmissionRank {
        AdmissionRank::default()
    }

    /// Which jobs may share a lane: jobs of different classes never do, and
    /// a service's `--max-lanes` bounds each class's lanes on its own. A
    /// job waits for the iteration of every job in its lane, so a policy
    /// that must not keep one kind of job behind another gives them
    /// classes of their own. Defaults to one class for all jobs.
    fn lane_class(&self, _job: &JobSpec) -> LaneClass {
        0
    }

    /// How this policy's `pick` evolves while a lane runs, so that a
    /// simulator may skip the decisions whose answer is known in advance
    /// (see [`PickDynamics`]). Defaults to
    /// [`PickDynamics::EveryIteration`]: ask at every iteration boundary.
    fn dynamics(&self) -> PickDynamics {
        PickDynamics::EveryIteration
    }
}

/// What a caller may assume about a policy's successive `pick`s in one lane
/// while no job joins or leaves that lane and every iteration of a job
/// takes the same time. The trace simulator uses it to turn a job's whole
/// run between two decisions into one event; a policy that promises more
/// than it keeps makes the simulation differ from one that asks at every
/// iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickDynamics {
    /// No promise: the caller asks at every iteration boundary (and shows
    /// the policy every event through [`Policy::observe`]).
    EveryIteration,
    /// The pick in a lane depends only on that lane's waiting jobs, not on
    /// the time, and the job picked stays the pick after it ran any number
    /// of its iterations: it runs until it finishes or a job joins the
    /// lane (FIFO, SRTF with a constant iteration time, priority).
    Sticky,
    /// The pick in a lane is exactly the waiting job of that lane with the
    /// least `(attained, seq)` (fair sharing): the order of iterations is
    /// then known in closed form.
    LeastAttained,
}

/// A waiting job's place in the admission queue (see
/// [`Policy::admission_rank`]): compared as a tuple, smaller first.
pub type AdmissionRank = (u128, u64);

/// A job's class of lanes (see [`Policy::lane_class`]).
pub type LaneClass = u8;

/// Names accepted by [`by_name`], in the order `--policy all` reports them.
pub const POLICY_NAMES: [&str; 5] = ["fifo", "srtf", "fair", "pack", "priority"];

/// Build a policy from its name: `fifo`, `srtf`, `fair`, `pack` or `priority`.
pub fn by_name(name: &str) -> Result<Box<dyn Policy>, PolicyError> {
    match name {
        "fifo" => Ok(Box::new(Fifo)),
        "srtf" => Ok(Box::new(Srtf)),
        "fair" => Ok(Box::new(Fair)),
        "pack" | "packing" => Ok(Box::new(Pack)),
        "priority" => Ok(Box::new(PriorityPolicy)),
        other => Err(PolicyError::UnknownPolicy {
            name: other.to_string(),
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn by_name_knows_every_listed_policy_and_refuses_others() {
        for name in POLICY_NAMES {
            assert_eq!(by_name(name).unwrap().name(), name);
        }
        let err = by_name("lottery").unwrap_err();
        assert!(matches!(err, PolicyError::UnknownPolicy { ref name } if name == "lottery"));
    }
}
