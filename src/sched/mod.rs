//! The service's iteration scheduler: per-job queues of pending Run requests
//! in front of a [`Policy`].
//!
//! It is a plain struct with no sockets, threads or clocks: the caller (the
//! server's dispatch loop) owns it on one thread and hands in `now`, the time
//! since any fixed epoch (e.g. `start.elapsed()`). The flow per iteration:
//!
//! 1. [`Scheduler::add_job`] once, when a job is admitted into a lane
//!    ([`Scheduler::place`] asks the policy which lane);
//! 2. [`Scheduler::submit`] for each Run request (queued, FIFO per job);
//! 3. whenever a lane is idle, [`Scheduler::pick`] returns the request the
//!    policy chose for it, with how long it waited;
//! 4. when it has run, [`Scheduler::finish`] records the measured duration
//!    (the policy sees it; SRTF and fair depend on it);
//! 5. [`Scheduler::remove_job`] when the job leaves; its unserved requests
//!    come back so the caller can answer them.
//!
//! A job has at most one iteration running at a time; further requests wait
//! in its queue. Per-job queueing delay and service time are kept in
//! [`JobStats`].

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use lanes_policies::{
    Event, JobId, JobSpec, JobTable, JobView, LaneId, LaneView, Policy, PolicyError,
};

/// Why the scheduler refused a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// The job was never added or was removed.
    #[error("job {job} is not scheduled")]
    UnknownJob {
        /// The id.
        job: JobId,
    },
    /// `add_job` for an id that is already scheduled.
    #[error("job {job} is already scheduled")]
    DuplicateJob {
        /// The id.
        job: JobId,
    },
    /// `finish` for a job with no iteration running.
    #[error("job {job} has no iteration running")]
    NotRunning {
        /// The id.
        job: JobId,
    },
    /// The job's queue is full.
    #[error("job {job} already has {limit} requests queued")]
    QueueFull {
        /// The id.
        job: JobId,
        /// The per-job limit.
        limit: usize,
    },
    /// The job table refused an event.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl SchedError {
    /// A stable code for replies and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            SchedError::UnknownJob { .. } => "sched.unknown_job",
            SchedError::DuplicateJob { .. } => "sched.duplicate_job",
            SchedError::NotRunning { .. } => "sched.not_running",
            SchedError::QueueFull { .. } => "sched.queue_full",
            SchedError::Policy(_) => "sched.policy",
        }
    }
}

/// Queueing delay and service time of one job's iterations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct JobStats {
    /// Iterations finished.
    pub iterations: u64,
    /// Runs finished that were not iterations (evaluations between
    /// steps, Runs answered with an error): not in `iterations` or
    /// `service_total`.
    pub other_runs: u64,
    /// Requests dispatched (finished or running).
    pub dispatched: u64,
    /// Sum over dispatched requests of the time from `submit` to `pick`.
    pub queueing_total: Duration,
    /// Longest such wait.
    pub queueing_max: Duration,
    /// Sum of measured iteration durations.
    pub service_total: Duration,
    /// Longest iteration.
    pub service_max: Duration,
}

impl JobStats {
    /// Mean queueing delay per dispatched request.
    pub fn queueing_mean(&self) -> Duration {
        mean(self.queueing_total, self.dispatched)
    }
    /// Mean iteration duration.
    pub fn service_mean(&self) -> Duration {
        mean(self.service_total, self.iterations)
    }
}

fn mean(total: Duration, n: u64) -> Duration {
    match u32::try_from(n) {
        Ok(0) => Duration::ZERO,
        Ok(n) => total / n,
        Err(_) => Duration::from_secs_f64(total.as_secs_f64() / n as f64),
    }
}

/// A request the policy chose to run now.
#[derive(Debug)]
pub struct Dispatch<R> {
    /// Whose it is.
    pub job: JobId,
    /// The request as submitted.
    pub request: R,
    /// How long it waited between `submit` and this `pick`.
    pub queued_for: Duration,
}

#[derive(Debug)]
struct JobQueue<R> {
    pending: VecDeque<(R, Duration)>,
    running: bool,
    stats: JobStats,
}

/// The iteration scheduler. `R` is whatever the caller needs to run and
/// answer a request (e.g. the client identity and the decoded feeds).
#[derive(Debug)]
pub struct Scheduler<R> {
    policy: Box<dyn Policy>,
    table: JobTable,
    queues: HashMap<JobId, JobQueue<R>>,
    queue_limit: usize,
}

/// Requests one job may have queued by default: clients send one Run at a
/// time, a few pipelined ones are fine, an unbounded pile is not.
pub const DEFAULT_QUEUE_LIMIT: usize = 64;

impl<R> Scheduler<R> {
    /// A scheduler running `policy`.
    pub fn new(policy: Box<dyn Policy>) -> Self {
        Scheduler {
            policy,
            table: JobTable::new(),
            queues: HashMap::new(),
            queue_limit: DEFAULT_QUEUE_LIMIT,
        }
    }

    /// Change the per-job queue limit (at least 1).
    pub fn with_queue_limit(mut self, limit: usize) -> Self {
        self.queue_limit = limit.max(1);
        self
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// The snapshot the policy decides on.
    pub fn jobs(&self) -> &[JobView] {
        self.table.jobs()
    }

    /// Ask the policy where a new job should go; `None` when it fits in no lane.
    pub fn place(&mut self, spec: &JobSpec, lanes: &[LaneView], now: Duration) -> Option<LaneId> {
        self.policy
            .place(spec, lanes, now)
            .filter(|l| lanes.iter().any(|v| v.id == *l && v.fits(spec)))
    }

    /// The policy's rank for a job waiting for memory (smaller first).
    pub fn admission_rank(&self, spec: &JobSpec) -> lanes_policies::AdmissionRank {
        self.policy.admission_rank(spec)
    }

    fn event(&mut self, ev: Event, now: Duration) -> Result<(), SchedError> {
        self.table.apply(&ev, now)?;
        self.policy.observe(&ev, now);
        Ok(())
    }

    /// Register a job admitted into `lane`.
    pub fn add_job(
        &mut self,
        spec: JobSpec,
        lane: LaneId,
        now: Duration,
    ) -> Result<(), SchedError> {
        let id = spec.id;
        if self.queues.contains_key(&id) {
            return Err(SchedError::DuplicateJob { job: id });
        }
        self.event(Event::Arrived { spec, lane }, now)?;
        self.queues.insert(
            id,
            JobQueue {
                pending: VecDeque::new(),
                running: false,
                stats: JobStats::default(),
            },
        );
        Ok(())
    }

    /// Queue one Run request of `job`.
    pub fn submit(&mut self, job: JobId, request: R, now: Duration) -> Result<(), SchedError> {
        let limit = self.queue_limit;
        let q = self
            .queues
            .get_mut(&job)
            .ok_or(SchedError::UnknownJob { job })?;
        if q.pending.len() >= limit {
            return Err(SchedError::QueueFull { job, limit });
        }
        q.pending.push_back((request, now));
        let becomes_waiting = q.pending.len() == 1 && !q.running;
        if becomes_waiting {
            self.event(Event::Queued { job }, now)?;
        }
        Ok(())
    }

    /// The request that runs next in `lane`, or `None` when no job of the lane
    /// is waiting. Call it whenever the lane is idle.
    ///
    /// Should a policy ever name a job that is not waiting in this lane (a
    /// policy bug), the lane's earliest-arrived waiting job runs instead, so
    /// that a lane never stalls.
    pub fn pick(&mut self, lane: LaneId, now: Duration) -> Option<Dispatch<R>> {
        self.pick_where(lane, now, |_| false)
    }

    /// Like [`Scheduler::pick`], but jobs for which `held` is true are not
    /// offered to the policy even if they are waiting (the service holds
    /// back jobs that wait for memory). When no waiting job is held the
    /// policy sees the table itself; otherwise it sees a copy in which the
    /// held jobs are not waiting.
    pub fn pick_where(
        &mut self,
        lane: LaneId,
        now: Duration,
        held: impl Fn(JobId) -> bool,
    ) -> Option<Dispatch<R>> {
        let any_held = self
            .table
            .jobs()
            .iter()
            .any(|v| v.lane == lane && v.waiting && held(v.id));
        let filtered: Vec<JobView>;
        let jobs: &[JobView] = if any_held {
            filtered = self
                .table
                .jobs()
                .iter()
                .map(|v| {
                    let mut v = v.clone();
                    v.waiting = v.waiting && !held(v.id);
                    v
                })
                .collect();
            &filtered
        } else {
            self.table.jobs()
        };
        let valid = |v: &JobView| v.lane == lane && v.waiting;
        let choice = self
            .policy
            .pick(lane, jobs, now)
            .filter(|id| jobs.iter().any(|v| v.id == *id && valid(v)))
            .or_else(|| {
                jobs.iter()
                    .filter(|v| valid(v))
                    .min_by_key(|v| v.seq)
                    .map(|v| v.id)
            })?;
        let q = self.queues.get_mut(&choice)?;
        let (request, enqueued) = q.pending.pop_front()?;
        q.running = true;
        let queued_for = now.saturating_sub(enqueued);
        q.stats.dispatched += 1;
        q.stats.queueing_total = q.stats.queueing_total.saturating_add(queued_for);
        q.stats.queueing_max = q.stats.queueing_max.max(queued_for);
        // The job was waiting (checked above), so `Started` is accepted.
        if self.event(Event::Started { job: choice }, now).is_err() {
            return None;
        }
        Some(Dispatch {
            job: choice,
            request,
            queued_for,
        })
    }

    /// Record that `job`'s running iteration took `duration`.
    pub fn finish(
        &mut self,
        job: JobId,
        duration: Duration,
        now: Duration,
    ) -> Result<(), SchedError> {
        self.finish_as(job, duration, now, true)
    }

    /// Record that `job`'s running request took `duration` and was not an
    /// iteration (an evaluation between steps, or a Run answered with an
    /// error): service, not progress.
    pub fn finish_other(
        &mut self,
        job: JobId,
        duration: Duration,
        now: Duration,
    ) -> Result<(), SchedError> {
        self.finish_as(job, duration, now, false)
    }

    fn finish_as(
        &mut self,
        job: JobId,
        duration: Duration,
        now: Duration,
        iteration: bool,
    ) -> Result<(), SchedError> {
        let q = self
            .queues
            .get_mut(&job)
            .ok_or(SchedError::UnknownJob { job })?;
        if !q.running {
            return Err(SchedError::NotRunning { job });
        }
        q.running = false;
        let event = if iteration {
            q.stats.iterations += 1;
            q.stats.service_total = q.stats.service_total.saturating_add(duration);
            q.stats.service_max = q.stats.service_max.max(duration);
            Event::IterationFinished { job, duration }
        } else {
            q.stats.other_runs += 1;
            Event::OtherRunFinished { job, duration }
        };
        let more = !q.pending.is_empty();
        self.event(event, now)?;
        if more {
            self.event(Event::Queued { job }, now)?;
        }
        Ok(())
    }

    /// Remove a job; returns its requests that never ran and its stats.
    pub fn remove_job(
        &mut self,
        job: JobId,
        now: Duration,
    ) -> Result<(Vec<R>, JobStats), SchedError> {
        let q = self
            .queues
            .remove(&job)
            .ok_or(SchedError::UnknownJob { job })?;
        self.event(Event::Finished { job }, now)?;
        Ok((q.pending.into_iter().map(|(r, _)| r).collect(), q.stats))
    }

    /// A job's stats so far.
    pub fn stats(&self, job: JobId) -> Option<&JobStats> {
        self.queues.get(&job).map(|q| &q.stats)
    }

    /// Requests waiting in `lane` (not counting running ones).
    pub fn queued_in(&self, lane: LaneId) -> usize {
        self.table
            .jobs()
            .iter()
            .filter(|v| v.lane == lane)
            .filter_map(|v| self.queues.get(&v.id))
            .map(|q| q.pending.len())
            .sum()
    }

    /// Requests of `job` waiting (not counting a running one).
    pub fn pending(&self, job: JobId) -> usize {
        self.queues.get(&job).map_or(0, |q| q.pending.len())
    }

    /// Is `job` scheduled (added and not removed)?
    pub fn contains(&self, job: JobId) -> bool {
        self.queues.contains_key(&job)
    }

    /// Is one of `job`'s iterations running?
    pub fn is_running(&self, job: JobId) -> bool {
        self.queues.get(&job).is_some_and(|q| q.running)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use lanes_policies::{by_name, JobKind};

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sched(policy: &str) -> Scheduler<&'static str> {
        Scheduler::new(by_name(policy).unwrap())
    }

    #[test]
    fn measures_queueing_and_service_per_job() {
        let mut s = sched("fifo");
        s.add_job(JobSpec::new(1, JobKind::Training, 2), 0, ms(0))
            .unwrap();
        s.add_job(JobSpec::new(2, JobKind::Training, 2), 0, ms(0))
            .unwrap();
        s.submit(1, "a1", ms(0)).unwrap();
        s.submit(2, "b1", ms(1)).unwrap();
        let d = s.pick(0, ms(2)).unwrap();
        assert_eq!((d.job, d.request, d.queued_for), (1, "a1", ms(2)));
        assert!(
            s.pick(0, ms(2)).is_some(),
            "lanes are the caller's business: job 2 may run"
        );
        s.finish(1, ms(10), ms(12)).unwrap();
        s.finish(2, ms(5), ms(12)).unwrap();
        let st = *s.stats(1).unwrap();
        assert_eq!(
            (st.iterations, st.queueing_total, st.service_total),
            (1, ms(2), ms(10))
        );
        assert_eq!(s.stats(2).unwrap().queueing_max, ms(1));
        assert_eq!(s.stats(2).unwrap().service_mean(), ms(5));
    }

    #[test]
    fn one_iteration_per_job_at_a_time_and_queue_order_kept() {
        let mut s = sched("fifo");
        s.add_job(JobSpec::new(1, JobKind::Training, 5), 0, ms(0))
            .unwrap();
        for r in ["x", "y", "z"] {
            s.submit(1, r, ms(0)).unwrap();
        }
        assert_eq!(s.pick(0, ms(0)).unwrap().request, "x");
        assert!(
            s.pick(0, ms(0)).is_none(),
            "second iteration must wait for the first"
        );
        assert_eq!(s.queued_in(0), 2);
        s.finish(1, ms(3), ms(3)).unwrap();
        assert_eq!(s.pick(0, ms(3)).unwrap().request, "y");
        assert_eq!(s.finish(1, ms(1), ms(4)), Ok(()));
        assert_eq!(
            s.finish(1, ms(1), ms(4)),
            Err(SchedError::NotRunning { job: 1 })
        );
    }

    #[test]
    fn srtf_prefers_the_job_with_less_measured_work_left() {
        let mut s = sched("srtf");
        s.add_job(JobSpec::new(1, JobKind::Training, 100), 0, ms(0))
            .unwrap();
        s.add_job(JobSpec::new(2, JobKind::Training, 10), 0, ms(0))
            .unwrap();
        // Measure one iteration of each: job 2's iterations are 20x longer.
        for (job, d) in [(1, 1), (2, 20)] {
            s.submit(job, "r", ms(0)).unwrap();
            let got = s.pick(0, ms(0)).unwrap();
            s.finish(got.job, ms(d), ms(0)).unwrap();
        }
        s.submit(1, "r1", ms(30)).unwrap();
        s.submit(2, "r2", ms(30)).unwrap();
        // Job 1: 99 x 1 ms left; job 2: 9 x 20 ms = 180 ms left.
        assert_eq!(s.pick(0, ms(30)).unwrap().job, 1);
    }

    #[test]
    fn priority_serves_inference_first_and_lanes_are_separate() {
        let mut s = sched("priority");
        s.add_job(JobSpec::new(1, JobKind::Training, 10), 0, ms(0))
            .unwrap();
        s.add_job(JobSpec::new(2, JobKind::Inference, 10), 0, ms(0))
            .unwrap();
        s.add_job(JobSpec::new(3, JobKind::Inference, 10), 1, ms(0))
            .unwrap();
        s.submit(1, "t", ms(0)).unwrap();
        s.submit(2, "i", ms(1)).unwrap();
        s.submit(3, "other lane", ms(0)).unwrap();
        assert_eq!(s.pick(0, ms(1)).unwrap().job, 2);
        assert_eq!(s.pick(1, ms(1)).unwrap().job, 3);
    }

    #[test]
    fn held_jobs_are_hidden_from_the_policy() {
        let mut s = sched("priority");
        s.add_job(JobSpec::new(1, JobKind::Training, 10), 0, ms(0))
            .unwrap();
        s.add_job(JobSpec::new(2, JobKind::Inference, 10), 0, ms(0))
            .unwrap();
        s.submit(1, "t", ms(0)).unwrap();
        s.submit(2, "i", ms(0)).unwrap();
        let d = s.pick_where(0, ms(1), |job| job == 2).unwrap();
        assert_eq!(d.request, "t");
        assert!(s.pick_where(0, ms(1), |job| job == 2).is_none());
        assert_eq!(s.pending(2), 1);
        assert_eq!(s.pick(0, ms(1)).unwrap().request, "i");
    }

    #[test]
    fn remove_returns_unserved_requests_and_errors_are_typed() {
        let mut s = sched("fair").with_queue_limit(2);
        s.add_job(JobSpec::new(1, JobKind::Training, 10), 0, ms(0))
            .unwrap();
        assert_eq!(
            s.add_job(JobSpec::new(1, JobKind::Training, 10), 0, ms(0)),
            Err(SchedError::DuplicateJob { job: 1 })
        );
        s.submit(1, "a", ms(0)).unwrap();
        s.submit(1, "b", ms(0)).unwrap();
        assert_eq!(
            s.submit(1, "c", ms(0)),
            Err(SchedError::QueueFull { job: 1, limit: 2 })
        );
        assert_eq!(
            s.submit(9, "c", ms(0)),
            Err(SchedError::UnknownJob { job: 9 })
        );
        let (left, stats) = s.remove_job(1, ms(1)).unwrap();
        assert_eq!((left, stats.dispatched), (vec!["a", "b"], 0));
        assert!(s.jobs().is_empty());
        assert_eq!(
            s.finish(1, ms(1), ms(1)).unwrap_err().kind(),
            "sched.unknown_job"
        );
    }

    #[test]
    fn place_never_returns_a_lane_where_the_job_does_not_fit() {
        let mut s = sched("pack");
        let lanes = [LaneView::empty(0, 100), LaneView::empty(1, 10)];
        let spec = JobSpec::new(1, JobKind::Training, 1).with_memory(50, 10);
        assert_eq!(s.place(&spec, &lanes, ms(0)), Some(0));
        assert_eq!(s.place(&spec, &lanes[1..], ms(0)), None);
    }
}
