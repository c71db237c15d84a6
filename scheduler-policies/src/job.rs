//! Jobs as the policies see them: their static description ([`JobSpec`]),
//! the events that change them ([`Event`]) and the snapshot ([`JobTable`]).

use std::collections::HashMap;
use std::time::Duration;

/// A job's identifier, unique among the jobs of one table.
pub type JobId = u64;
/// A lane's index.
pub type LaneId = usize;

/// What kind of work a job does. Inference requests are latency-sensitive;
/// the priority policy serves them before training iterations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// A training job: many iterations, throughput matters.
    Training,
    /// An inference job: each iteration answers a request, latency matters.
    Inference,
}

impl JobKind {
    /// The lower-case name used in traces and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Training => "training",
            JobKind::Inference => "inference",
        }
    }
}

impl std::str::FromStr for JobKind {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "training" | "train" => Ok(JobKind::Training),
            "inference" | "infer" => Ok(JobKind::Inference),
            other => Err(PolicyError::UnknownKind {
                kind: other.to_string(),
            }),
        }
    }
}

/// What a job declares when it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    /// Unique id.
    pub id: JobId,
    /// Training or inference.
    pub kind: JobKind,
    /// Larger is more urgent (priority policy only).
    pub priority: i32,
    /// Iterations the job expects to run (0 when unknown: SRTF then treats
    /// its remaining work as unknown and large).
    pub expected_iterations: u64,
    /// Persistent bytes P (weights, optimizer state).
    pub persistent_bytes: u64,
    /// Ephemeral bytes T of one iteration.
    pub ephemeral_bytes: u64,
    /// Expected duration of one iteration before any was measured (SRTF uses
    /// it until the first measurement; `None` counts as zero, so an unknown
    /// job gets one iteration early and is then measured).
    pub iteration_hint: Option<Duration>,
}

impl JobSpec {
    /// A job with no memory, priority 0 and no iteration hint.
    pub fn new(id: JobId, kind: JobKind, expected_iterations: u64) -> Self {
        JobSpec {
            id,
            kind,
            priority: 0,
            expected_iterations,
            persistent_bytes: 0,
            ephemeral_bytes: 0,
            iteration_hint: None,
        }
    }
    /// Set the priority.
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
    /// Set P and T.
    pub fn with_memory(mut self, persistent: u64, ephemeral: u64) -> Self {
        self.persistent_bytes = persistent;
        self.ephemeral_bytes = ephemeral;
        self
    }
    /// Set the expected iteration duration.
    pub fn with_hint(mut self, hint: Duration) -> Self {
        self.iteration_hint = Some(hint);
        self
    }

    /// Its iterations, as a job that has run none: unknown totals count as
    /// `u64::MAX / 2` (as [`JobView::remaining_iterations`]).
    pub fn total_iterations(&self) -> u64 {
        if self.expected_iterations == 0 {
            u64::MAX / 2
        } else {
            self.expected_iterations
        }
    }

    /// SRTF's estimate of its whole work in nanoseconds: iterations ×
    /// hinted iteration time (zero without a hint), saturating.
    pub fn work_nanos(&self) -> u128 {
        u128::from(self.total_iterations())
            * self.iteration_hint.unwrap_or(Duration::ZERO).as_nanos()
    }
}

/// One job in the snapshot handed to [`crate::Policy::pick`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobView {
    /// Unique id.
    pub id: JobId,
    /// Training or inference.
    pub kind: JobKind,
    /// Larger is more urgent.
    pub priority: i32,
    /// Arrival order: 0 for the first job the table saw, then 1, 2, …
    pub seq: u64,
    /// When it arrived.
    pub arrival: Duration,
    /// The lane it was admitted into.
    pub lane: LaneId,
    /// Iterations it expects to run (0 = unknown).
    pub expected_iterations: u64,
    /// Iterations finished so far.
    pub done_iterations: u64,
    /// Sum of the measured durations of its finished Runs: its
    /// iterations and its other Runs ([`Event::OtherRunFinished`]).
    pub attained: Duration,
    /// The part of `attained` that was not iterations
    /// ([`Event::OtherRunFinished`]).
    pub other_service: Duration,
    /// Expected iteration duration before any measurement.
    pub iteration_hint: Option<Duration>,
    /// Persistent bytes P.
    pub persistent_bytes: u64,
    /// Ephemeral bytes T.
    pub ephemeral_bytes: u64,
    /// It has a request waiting to run (and no iteration running).
    pub waiting: bool,
    /// One of its iterations is running now.
    pub running: bool,
}

impl JobView {
    /// The mean measured iteration duration (other Runs left out), or the
    /// hint before the first measurement, or zero.
    pub fn iteration_estimate(&self) -> Duration {
        if self.done_iterations > 0 {
            let iterations = self.attained.saturating_sub(self.other_service);
            let nanos = iterations.as_nanos() / u128::from(self.done_iterations);
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        } else {
            self.iteration_hint.unwrap_or(Duration::ZERO)
        }
    }

    /// Remaining iterations; unknown totals count as `u64::MAX / 2`, and a
    /// job past its expected count has one left.
    pub fn remaining_iterations(&self) -> u64 {
        if self.expected_iterations == 0 {
            u64::MAX / 2
        } else {
            self.expected_iterations
                .saturating_sub(self.done_iterations)
                .max(1)
        }
    }

    /// SRTF's estimate of remaining work in nanoseconds: remaining iterations
    /// × measured (or hinted) iteration time, saturating.
    pub fn remaining_work_nanos(&self) -> u128 {
        u128::from(self.remaining_iterations()) * self.iteration_estimate().as_nanos()
    }
}

/// Something that happened to a job; applied to a [`JobTable`] and shown to
/// the policy through [`crate::Policy::observe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A job was admitted into `lane`.
    Arrived {
        /// What it declared.
        spec: JobSpec,
        /// Where it was placed.
        lane: LaneId,
    },
    /// The job has a request waiting (its next iteration may run).
    Queued {
        /// The job.
        job: JobId,
    },
    /// The job's iteration was dispatched to its lane.
    Started {
        /// The job.
        job: JobId,
    },
    /// The job's running iteration finished after `duration`.
    IterationFinished {
        /// The job.
        job: JobId,
        /// Measured duration.
        duration: Duration,
    },
    /// The job's running request finished after `duration` and was not an
    /// iteration (an evaluation between steps, or a Run answered with an
    /// error): it counts as service attained, not toward the iterations
    /// or their mean time.
    OtherRunFinished {
        /// The job.
        job: JobId,
        /// Measured duration.
        duration: Duration,
    },
    /// The job left (finished or disconnected).
    Finished {
        /// The job.
        job: JobId,
    },
}

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// `by_name` was given a name it does not know.
    #[error("unknown policy {name:?} (expected fifo, srtf, fair, pack or priority)")]
    UnknownPolicy {
        /// The name given.
        name: String,
    },
    /// A job kind other than training or inference.
    #[error("unknown job kind {kind:?} (expected training or inference)")]
    UnknownKind {
        /// The kind given.
        kind: String,
    },
    /// An event named a job the table does not hold.
    #[error("unknown job {job}")]
    UnknownJob {
        /// The id.
        job: JobId,
    },
    /// A job arrived twice.
    #[error("job {job} arrived twice")]
    DuplicateJob {
        /// The id.
        job: JobId,
    },
    /// An event that does not fit the job's state (e.g. `Started` while not
    /// waiting, `IterationFinished` while not running).
    #[error("job {job}: event {event} while {state}")]
    BadTransition {
        /// The id.
        job: JobId,
        /// The event's name.
        event: &'static str,
        /// The state it was in.
        state: &'static str,
    },
}

/// The snapshot: every active job, kept in one contiguous slice so a policy
/// decision is one linear scan without pointer chasing.
#[derive(Debug, Clone, Default)]
pub struct JobTable {
    jobs: Vec<JobView>,
    index: HashMap<JobId, usize>,
    next_seq: u64,
}

impl JobTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// All active jobs, in no particular order.
    pub fn jobs(&self) -> &[JobView] {
        &self.jobs
    }

    /// One job.
    pub fn get(&self, job: JobId) -> Option<&JobView> {
        self.index.get(&job).map(|&i| &self.jobs[i])
    }

    /// Number of active jobs.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// No active jobs.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    fn slot(&mut self, job: JobId) -> Result<&mut JobView, PolicyError> {
        match self.index.get(&job) {
            Some(&i) => Ok(&mut self.jobs[i]),
            None => Err(PolicyError::UnknownJob { job }),
        }
    }

    /// Apply one event. On error the table is unchanged.
    pub fn apply(&mut self, event: &Event, now: Duration) -> Result<(), PolicyError> {
        match event {
            Event::Arrived { spec, lane } => {
                if self.index.contains_key(&spec.id) {
                    return Err(PolicyError::DuplicateJob { job: spec.id });
                }
                self.index.insert(spec.id, self.jobs.len());
                self.jobs.push(JobView {
                    id: spec.id,
                    kind: spec.kind,
                    priority: spec.priority,
                    seq: self.next_seq,
                    arrival: now,
                    lane: *lane,
                    expected_iterations: spec.expected_iterations,
                    done_iterations: 0,
                    attained: Duration::ZERO,
                    other_service: Duration::ZERO,
                    iteration_hint: spec.iteration_hint,
                    persistent_bytes: spec.persistent_bytes,
                    ephemeral_bytes: spec.ephemeral_bytes,
                    waiting: false,
                    running: false,
                });
                self.next_seq += 1;
            }
            Event::Queued { job } => {
                let j = self.slot(*job)?;
                if j.running {
                    return Err(bad(*job, "queued", "running"));
                }
                j.waiting = true;
            }
            Event::Started { job } => {
                let j = self.slot(*job)?;
                if !j.waiting {
                    return Err(bad(*job, "started", "not waiting"));
                }
                j.waiting = false;
                j.running = true;
            }
            Event::IterationFinished { job, duration } => {
                let j = self.slot(*job)?;
                if !j.running {
                    return Err(bad(*job, "iteration finished", "not running"));
                }
                j.running = false;
                j.done_iterations += 1;
                j.attained = j.attained.saturating_add(*duration);
            }
            Event::OtherRunFinished { job, duration } => {
                let j = self.slot(*job)?;
                if !j.running {
                    return Err(bad(*job, "run finished", "not running"));
                }
                j.running = false;
                j.attained = j.attained.saturating_add(*duration);
                j.other_service = j.other_service.saturating_add(*duration);
            }
            Event::Finished { job } => {
                let i = self
                    .index
                    .remove(job)
                    .ok_or(PolicyError::UnknownJob { job: *job })?;
                self.jobs.swap_remove(i);
                if let Some(moved) = self.jobs.get(i) {
                    self.index.insert(moved.id, i);
                }
            }
        }
        Ok(())
    }
}

impl JobTable {
    /// Record `iterations` finished iterations of `job` that took
    /// `duration` in all, as if each had been `Started` and
    /// `IterationFinished` in turn; the job's waiting and running flags are
    /// left as they were. For a simulator that skips decisions whose answer
    /// is known ([`crate::PickDynamics`]); the policy is not shown these
    /// iterations one by one.
    pub fn record_iterations(
        &mut self,
        job: JobId,
        iterations: u64,
        duration: Duration,
    ) -> Result<(), PolicyError> {
        let j = self.slot(job)?;
        j.done_iterations = j.done_iterations.saturating_add(iterations);
        j.attained = j.attained.saturating_add(duration);
        Ok(())
    }
}

fn bad(job: JobId, event: &'static str, state: &'static str) -> PolicyError {
    PolicyError::BadTransition { job, event, state }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn arrive(t: &mut JobTable, id: JobId) {
        let spec = JobSpec::new(id, JobKind::Training, 4);
        t.apply(&Event::Arrived { spec, lane: 0 }, Duration::ZERO)
            .unwrap();
    }

    #[test]
    fn lifecycle_updates_the_view() {
        let mut t = JobTable::new();
        arrive(&mut t, 7);
        t.apply(&Event::Queued { job: 7 }, Duration::ZERO).unwrap();
        assert!(t.get(7).unwrap().waiting);
        t.apply(&Event::Started { job: 7 }, Duration::ZERO).unwrap();
        let d = Duration::from_millis(30);
        t.apply(
            &Event::IterationFinished {
                job: 7,
                duration: d,
            },
            d,
        )
        .unwrap();
        let v = t.get(7).unwrap();
        assert_eq!(
            (v.done_iterations, v.attained, v.waiting, v.running),
            (1, d, false, false)
        );
        assert_eq!(v.iteration_estimate(), d);
        assert_eq!(v.remaining_work_nanos(), 3 * d.as_nanos());
    }

    #[test]
    fn other_runs_count_as_service_not_as_iterations() {
        let mut t = JobTable::new();
        arrive(&mut t, 7);
        let z = Duration::ZERO;
        let step = Duration::from_millis(10);
        for (other, d) in [
            (false, step),
            (true, Duration::from_millis(90)),
            (false, step),
        ] {
            t.apply(&Event::Queued { job: 7 }, z).unwrap();
            t.apply(&Event::Started { job: 7 }, z).unwrap();
            let e = if other {
                Event::OtherRunFinished {
                    job: 7,
                    duration: d,
                }
            } else {
                Event::IterationFinished {
                    job: 7,
                    duration: d,
                }
            };
            t.apply(&e, z).unwrap();
        }
        let v = t.get(7).unwrap();
        // Fair sharing sees all 110 ms; SRTF two iterations of 10 ms, two left.
        assert_eq!(v.attained, Duration::from_millis(110));
        assert_eq!((v.done_iterations, v.running), (2, false));
        assert_eq!(v.iteration_estimate(), step);
        assert_eq!(v.remaining_work_nanos(), 2 * step.as_nanos());
        assert!(matches!(
            t.apply(
                &Event::OtherRunFinished {
                    job: 7,
                    duration: z
                },
                z
            ),
            Err(PolicyError::BadTransition { job: 7, .. })
        ));
    }

    #[test]
    fn recorded_iterations_count_like_single_ones() {
        let d = Duration::from_millis(7);
        let mut one_by_one = JobTable::new();
        let mut at_once = JobTable::new();
        for t in [&mut one_by_one, &mut at_once] {
            arrive(t, 3);
            t.apply(&Event::Queued { job: 3 }, Duration::ZERO).unwrap();
        }
        for _ in 0..3 {
            one_by_one
                .apply(&Event::Started { job: 3 }, Duration::ZERO)
                .unwrap();
            one_by_one
                .apply(
                    &Event::IterationFinished {
                        job: 3,
                        duration: d,
                    },
                    Duration::ZERO,
                )
                .unwrap();
            one_by_one
                .apply(&Event::Queued { job: 3 }, Duration::ZERO)
                .unwrap();
        }
        at_once.record_iterations(3, 3, d * 3).unwrap();
        assert_eq!(one_by_one.get(3), at_once.get(3));
        assert!(matches!(
            at_once.record_iterations(9, 1, d),
            Err(PolicyError::UnknownJob { job: 9 })
        ));
    }

    #[test]
    fn bad_transitions_and_unknown_jobs_are_typed_errors() {
        let mut t = JobTable::new();
        arrive(&mut t, 1);
        let z = Duration::ZERO;
        assert!(matches!(
            t.apply(&Event::Started { job: 1 }, z),
            Err(PolicyError::BadTransition { job: 1, .. })
        ));
        assert!(matches!(
            t.apply(&Event::Queued { job: 9 }, z),
            Err(PolicyError::UnknownJob { job: 9 })
        ));
        let spec = JobSpec::new(1, JobKind::Inference, 1);
        assert!(matches!(
            t.apply(&Event::Arrived { spec, lane: 0 }, z),
            Err(PolicyError::DuplicateJob { job: 1 })
        ));
    }

    #[test]
    fn finished_removes_and_keeps_index_consistent() {
        let mut t = JobTable::new();
        for id in 0..5 {
            arrive(&mut t, id);
        }
        t.apply(&Event::Finished { job: 1 }, Duration::ZERO)
            .unwrap();
        assert_eq!(t.len(), 4);
        assert!(t.get(1).is_none());
        for id in [0, 2, 3, 4] {
            assert_eq!(t.get(id).unwrap().id, id);
        }
        assert_eq!(t.get(4).unwrap().seq, 4);
    }
}
