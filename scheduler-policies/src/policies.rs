//! The five policies. Each `pick` is one linear scan over the snapshot with
//! a small integer key, so a decision over 1,000 active jobs stays in the low
//! microseconds (see `benches/policy.rs`). Ties always go to the job that
//! arrived first (`seq`), which makes every decision deterministic.

use std::cmp::Reverse;
use std::time::Duration;

use crate::job::{JobId, JobKind, JobSpec, JobView, LaneId};
use crate::placement::{best_fit, LaneView};
use crate::{AdmissionRank, LaneClass, PickDynamics, Policy};

/// The waiting job of `lane` with the smallest key.
fn pick_min<K: Ord>(lane: LaneId, jobs: &[JobView], key: impl Fn(&JobView) -> K) -> Option<JobId> {
    let mut best: Option<(K, JobId)> = None;
    for j in jobs {
        if j.lane != lane || !j.waiting {
            continue;
        }
        let k = key(j);
        match &best {
            Some((bk, _)) if *bk <= k => {}
            _ => best = Some((k, j.id)),
        }
    }
    best.map(|(_, id)| id)
}

/// First in, first out: the job that arrived first runs until it finishes or
/// stops waiting (job-level FIFO, as in Salus's baseline).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fifo;

impl Policy for Fifo {
    fn dynamics(&self) -> PickDynamics {
        PickDynamics::Sticky
    }
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn pick(&mut self, lane: LaneId, jobs: &[JobView], _now: Duration) -> Option<JobId> {
        pick_min(lane, jobs, |j| j.seq)
    }
}

/// Shortest remaining time first: remaining iterations × mean measured
/// iteration time (the job's hint until its first iteration is measured).
/// Re-decided at every iteration boundary, so a shorter job that arrives
/// preempts a longer one at its next boundary.
#[derive(Debug, Clone, Copy, Default)]
pub struct Srtf;

impl Policy for Srtf {
    fn dynamics(&self) -> PickDynamics {
        PickDynamics::Sticky
    }
    fn name(&self) -> &'static str {
        "srtf"
    }
    fn pick(&mut self, lane: LaneId, jobs: &[JobView], _now: Duration) -> Option<JobId> {
        pick_min(lane, jobs, |j| (j.remaining_work_nanos(), j.seq))
    }
    /// The least work first (iterations × hint); jobs without a hint after
    /// those with one, fewest iterations first (unknown counts last).
    fn admission_rank(&self, job: &JobSpec) -> AdmissionRank {
        let work = match job.iteration_hint {
            Some(_) => job.work_nanos(),
            None => u128::MAX,
        };
        (work, job.total_iterations())
    }
}

/// Fair sharing as least attained service: the waiting job that has had the
/// least GPU time so far runs next. Among jobs that stay active their
/// attained service never drifts more than one iteration apart; a newcomer
/// catches up first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fair;

impl Policy for Fair {
    fn dynamics(&self) -> PickDynamics {
        PickDynamics::LeastAttained
    }
    fn name(&self) -> &'static str {
        "fair"
    }
    fn pick(&mut self, lane: LaneId, jobs: &[JobView], _now: Duration) -> Option<JobId> {
        pick_min(lane, jobs, |j| (j.attained, j.seq))
    }
}

/// Packing: places jobs with [`best_fit`] (an empty lane first, so lanes run
/// concurrently, then the tightest fit, so large holes stay free); inside a
/// lane it runs jobs in arrival order like [`Fifo`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Pack;

impl Policy for Pack {
    fn dynamics(&self) -> PickDynamics {
        PickDynamics::Sticky
    }
    fn name(&self) -> &'static str {
        "pack"
    }
    fn pick(&mut self, lane: LaneId, jobs: &[JobView], _now: Duration) -> Option<JobId> {
        pick_min(lane, jobs, |j| j.seq)
    }
    fn place(&mut self, job: &JobSpec, lanes: &[LaneView], _now: Duration) -> Option<LaneId> {
        best_fit(job, lanes)
    }
}

/// Priority: inference before training, then higher `priority` first, then
/// arrival order. Decisions happen only at iteration boundaries, so a
/// training iteration that is running finishes before an inference request
/// that arrived meanwhile runs (preemption never cuts an iteration).
#[derive(Debug, Clone, Copy, Default)]
pub struct PriorityPolicy;

impl Policy for PriorityPolicy {
    fn dynamics(&self) -> PickDynamics {
        PickDynamics::Sticky
    }
    fn name(&self) -> &'static str {
        "priority"
    }
    fn pick(&mut self, lane: LaneId, jobs: &[JobView], _now: Duration) -> Option<JobId> {
        pick_min(lane, jobs, |j| {
            (j.kind != JobKind::Inference, Reverse(j.priority), j.seq)
        })
    }
    /// Inference first, then higher `priority`.
    fn admission_rank(&self, job: &JobSpec) -> AdmissionRank {
        let below = i64::from(i32::MAX) - i64::from(job.priority);
        (
            u128::from(job.kind != JobKind::Inference),
            u64::try_from(below).unwrap_or(0),
        )
    }
    /// Inference jobs in lanes of their own: an inference Run never waits
    /// for a training iteration of its lane.
    fn lane_class(&self, job: &JobSpec) -> LaneClass {
        LaneClass::from(job.kind == JobKind::Inference)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::by_name;
    use crate::job::{Event, JobTable};

    const Z: Duration = Duration::ZERO;

    fn table(specs: &[(JobSpec, LaneId, bool)]) -> JobTable {
        let mut t = JobTable::new();
        for (spec, lane, waiting) in specs {
            let id = spec.id;
            t.apply(
                &Event::Arrived {
                    spec: spec.clone(),
                    lane: *lane,
                },
                Z,
            )
            .unwrap();
            if *waiting {
                t.apply(&Event::Queued { job: id }, Z).unwrap();
            }
        }
        t
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
    #[test]
    fn admission_order_follows_the_policy() {
        let train = |id, n| JobSpec::new(id, JobKind::Training, n);
        let infer = |id, n| JobSpec::new(id, JobKind::Inference, n);
        let order = |name: &str, jobs: &[JobSpec]| -> Vec<JobId> {
            let p = by_name(name).unwrap();
            let mut v: Vec<_> = jobs.iter().collect();
            v.sort_by_key(|j| p.admission_rank(j));
            v.iter().map(|j| j.id).collect()
        };
        let jobs = [
            train(1, 100).with_hint(ms(10)),
            train(2, 5).with_hint(ms(10)),
            infer(3, 0),
            train(4, 50).with_hint(ms(1)).with_priority(3),
        ];
        // Arrival order (a stable sort over equal ranks).
        for name in ["fifo", "fair", "pack"] {
            assert_eq!(order(name, &jobs), vec![1, 2, 3, 4], "{name}");
        }
        // Least work: 50 ms each for 2 and 4 (fewer iterations first),
        // then 1 s (1); no hint last (3).
        assert_eq!(order("srtf", &jobs), vec![2, 4, 1, 3]);
        // Inference first, then higher priority.
        assert_eq!(order("priority", &jobs), vec![3, 4, 1, 2]);
        // Without hints (as in the service): fewest iterations first.
        let plain = [train(1, 100), train(2, 5), train(3, 0)];
        assert_eq!(order("srtf", &plain), vec![2, 1, 3]);
    }

    fn run_iter(t: &mut JobTable, id: JobId, d: Duration) {
        t.apply(&Event::Started { job: id }, Z).unwrap();
        t.apply(
            &Event::IterationFinished {
                job: id,
                duration: d,
            },
            Z,
        )
        .unwrap();
        t.apply(&Event::Queued { job: id }, Z).unwrap();
    }

    #[test]
    fn dynamics_are_declared_for_every_built_in_policy() {
        for name in crate::POLICY_NAMES {
            let expected = if name == "fair" {
                PickDynamics::LeastAttained
            } else {
                PickDynamics::Sticky
            };
            assert_eq!(by_name(name).unwrap().dynamics(), expected, "{name}");
        }
    }

    #[test]
    fn every_policy_picks_only_waiting_jobs_of_the_lane() {
        let t = table(&[
            (JobSpec::new(1, JobKind::Training, 5), 0, false),
            (JobSpec::new(2, JobKind::Inference, 5), 1, true),
            (JobSpec::new(3, JobKind::Training, 5), 0, true),
        ]);
        for name in crate::POLICY_NAMES {
            let mut p = by_name(name).unwrap();
            assert_eq!(p.pick(0, t.jobs(), Z), Some(3), "{name}");
            assert_eq!(p.pick(1, t.jobs(), Z), Some(2), "{name}");
            assert_eq!(p.pick(2, t.jobs(), Z), None, "{name}");
        }
    }

    #[test]
    fn fifo_takes_the_earliest_arrival() {
        let t = table(&[
            (JobSpec::new(9, JobKind::Training, 100), 0, true),
            (
                JobSpec::new(1, JobKind::Inference, 1).with_priority(9),
                0,
                true,
            ),
        ]);
        assert_eq!(Fifo.pick(0, t.jobs(), Z), Some(9));
    }

    #[test]
    fn srtf_uses_measured_time_over_the_hint() {
        let mut t = table(&[
            (
                JobSpec::new(1, JobKind::Training, 11).with_hint(ms(1)),
                0,
                true,
            ),
            (
                JobSpec::new(2, JobKind::Training, 5).with_hint(ms(3)),
                0,
                true,
            ),
        ]);
        // Hints: job 1 has 11 ms left, job 2 has 15 ms.
        assert_eq!(Srtf.pick(0, t.jobs(), Z), Some(1));
        // Measured: job 1's iteration takes 10 ms → 100 ms left.
        run_iter(&mut t, 1, ms(10));
        assert_eq!(Srtf.pick(0, t.jobs(), Z), Some(2));
    }

    #[test]
    fn srtf_treats_unknown_length_as_long() {
        let t = table(&[
            (
                JobSpec::new(1, JobKind::Training, 0).with_hint(ms(1)),
                0,
                true,
            ),
            (
                JobSpec::new(2, JobKind::Training, 1_000_000).with_hint(ms(100)),
                0,
                true,
            ),
        ]);
        assert_eq!(Srtf.pick(0, t.jobs(), Z), Some(2));
    }

    #[test]
    fn fair_takes_least_attained_service() {
        let mut t = table(&[
            (JobSpec::new(1, JobKind::Training, 10), 0, true),
            (JobSpec::new(2, JobKind::Training, 10), 0, true),
        ]);
        assert_eq!(Fair.pick(0, t.jobs(), Z), Some(1));
        run_iter(&mut t, 1, ms(5));
        assert_eq!(Fair.pick(0, t.jobs(), Z), Some(2));
        run_iter(&mut t, 2, ms(20));
        assert_eq!(Fair.pick(0, t.jobs(), Z), Some(1));
    }

    #[test]
    fn priority_puts_inference_first_then_higher_priority() {
        let t = table(&[
            (
                JobSpec::new(1, JobKind::Training, 1).with_priority(100),
                0,
                true,
            ),
            (
                JobSpec::new(2, JobKind::Inference, 1).with_priority(1),
                0,
                true,
            ),
            (
                JobSpec::new(3, JobKind::Inference, 1).with_priority(5),
                0,
                true,
            ),
        ]);
        assert_eq!(PriorityPolicy.pick(0, t.jobs(), Z), Some(3));
        let t = table(&[
            (
                JobSpec::new(1, JobKind::Training, 1).with_priority(1),
                0,
                true,
            ),
            (
                JobSpec::new(2, JobKind::Training, 1).with_priority(3),
                0,
                true,
            ),
        ]);
        assert_eq!(PriorityPolicy.pick(0, t.jobs(), Z), Some(2));
    }

    #[test]
    fn pack_places_best_fit_others_first_fit() {
        let lanes = [
            LaneView {
                id: 0,
                capacity: 100,
                persistent_sum: 10,
                max_ephemeral: 0,
                jobs: 1,
            },
            LaneView {
                id: 1,
                capacity: 100,
                persistent_sum: 70,
                max_ephemeral: 0,
                jobs: 1,
            },
        ];
        let j = JobSpec::new(5, JobKind::Training, 1).with_memory(20, 0);
        assert_eq!(Pack.place(&j, &lanes, Z), Some(1));
        assert_eq!(Fifo.place(&j, &lanes, Z), Some(0));
    }
}
