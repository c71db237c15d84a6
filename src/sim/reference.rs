//! The simulator as it was before it became event-driven: every iteration
//! of every job is one step, and every step asks the policy. Kept for the
//! tests only, as the reference the event-driven engine
//! ([`super::engine::simulate`]) must match exactly.

use std::collections::HashMap;
use std::time::Duration;

use lanes_policies::{AdmissionRank, Event, JobId, JobTable, LaneId, LaneView, Policy};

use super::engine::{apply, JobOutcome, Segment, SimConfig, SimError, SimRun};
use super::trace::TraceJob;

struct LaneState {
    capacity: u64,
    members: Vec<usize>,
    running: Option<(usize, Duration)>,
}

/// Run `trace` under `policy`, one iteration at a time.
pub fn simulate_reference(
    trace: &[TraceJob],
    policy: &mut dyn Policy,
    cfg: SimConfig,
) -> Result<SimRun, SimError> {
    if cfg.lanes == 0 {
        return Err(SimError::NoLanes);
    }
    let capacity = cfg.memory / cfg.lanes as u64;
    for j in trace {
        let need = j.persistent_bytes.saturating_add(j.ephemeral_bytes);
        if need > capacity {
            return Err(SimError::JobNeverFits {
                job: j.id,
                need,
                capacity,
            });
        }
    }
    let name = policy.name();
    let contract = |detail: String| SimError::PolicyContract {
        policy: name,
        detail,
    };

    // Submission order: by time, then trace order.
    let mut order: Vec<usize> = (0..trace.len()).collect();
    order.sort_by_key(|&i| (trace[i].submit, i));
    let by_id: HashMap<JobId, usize> = trace.iter().enumerate().map(|(i, j)| (j.id, i)).collect();

    let mut lanes: Vec<LaneState> = (0..cfg.lanes)
        .map(|_| LaneState {
            capacity,
            members: Vec::new(),
            running: None,
        })
        .collect();
    let mut table = JobTable::new();
    let mut done = vec![0u64; trace.len()];
    let mut outcome: Vec<Option<JobOutcome>> = vec![None; trace.len()];
    let mut admitted_at: Vec<(Duration, LaneId)> = vec![(Duration::ZERO, 0); trace.len()];
    // Jobs waiting for memory: (admission rank, submission position, index),
    // kept sorted (the policy's admission order, ties by submission).
    let mut pending: Vec<(AdmissionRank, usize, usize)> = Vec::new();
    let mut schedule: Vec<Segment> = Vec::new();
    let mut open_segment: Vec<Option<usize>> = vec![None; cfg.lanes];
    let mut busy = Duration::ZERO;
    let mut next = 0usize;
    let mut finished = 0usize;

    while finished < trace.len() {
        let t_arrival = order.get(next).map(|&i| trace[i].submit);
        let t_done = lanes
            .iter()
            .filter_map(|l| l.running.map(|(_, end)| end))
            .min();
        let now = match (t_arrival, t_done) {
            (Some(a), Some(d)) => a.min(d),
            (Some(a), None) => a,
            (None, Some(d)) => d,
            (None, None) => {
                return Err(SimError::Stalled {
                    policy: name,
                    jobs: trace.len() - finished,
                });
            }
        };

        // 1. Completions, lane order.
        for lane in lanes.iter_mut() {
            let Some((i, end)) = lane.running else {
                continue;
            };
            if end != now {
                continue;
            }
            lane.running = None;
            let job = &trace[i];
            apply(
                &mut table,
                policy,
                Event::IterationFinished {
                    job: job.id,
                    duration: job.iteration,
                },
                now,
            )?;
            done[i] += 1;
            if done[i] == job.iterations {
                apply(&mut table, policy, Event::Finished { job: job.id }, now)?;
                lane.members.retain(|&m| m != i);
                let (admitted, lane_id) = admitted_at[i];
                outcome[i] = Some(JobOutcome {
                    id: job.id,
                    kind: job.kind,
                    submit: job.submit,
                    admitted,
                    lane: lane_id,
                    finish: now,
                    service: job.service(),
                });
                finished += 1;
            } else {
                apply(&mut table, policy, Event::Queued { job: job.id }, now)?;
            }
        }

        // 2. Submissions.
        let before = pending.len();
        while let Some(&i) = order.get(next) {
            if trace[i].submit != now {
                break;
            }
            pending.push((policy.admission_rank(&trace[i].spec()), next, i));
            next += 1;
        }
        if pending.len() > before {
            pending.sort_unstable_by_key(|&(rank, seq, _)| (rank, seq));
        }

        // 3. Admission, in the policy's admission order.
        let mut still = Vec::with_capacity(pending.len());
        for &(rank, seq, i) in &pending {
            let spec = trace[i].spec();
            let views: Vec<LaneView> = lanes
                .iter()
                .enumerate()
                .map(|(id, l)| LaneView {
                    id,
                    capacity: l.capacity,
                    persistent_sum: l.members.iter().map(|&m| trace[m].persistent_bytes).sum(),
                    max_ephemeral: l
                        .members
                        .iter()
                        .map(|&m| trace[m].ephemeral_bytes)
                        .max()
                        .unwrap_or(0),
                    jobs: l.members.len(),
                })
                .collect();
            match policy.place(&spec, &views, now) {
                None => still.push((rank, seq, i)),
                Some(l) => {
                    let view = views.get(l).ok_or_else(|| {
                        contract(format!(
                            "placed job {} in lane {l} of {}",
                            spec.id,
                            views.len()
                        ))
                    })?;
                    if !view.fits(&spec) {
                        return Err(contract(format!(
                            "placed job {} in lane {l} where it does not fit",
                            spec.id
                        )));
                    }
                    lanes[l].members.push(i);
                    admitted_at[i] = (now, l);
                    apply(&mut table, policy, Event::Arrived { spec, lane: l }, now)?;
                    apply(&mut table, policy, Event::Queued { job: trace[i].id }, now)?;
                }
            }
        }
        pending = still;

        // 4. Dispatch on idle lanes, lane order.
        for (l, lane) in lanes.iter_mut().enumerate() {
            if lane.running.is_some() {
                continue;
            }
            let Some(id) = policy.pick(l, table.jobs(), now) else {
                open_segment[l] = None;
                continue;
            };
            let ok = table.get(id).is_some_and(|v| v.lane == l && v.waiting);
            let i = match by_id.get(&id) {
                Some(&i) if ok => i,
                _ => {
                    return Err(contract(format!(
                        "picked job {id} for lane {l}, which is not waiting there"
                    )))
                }
            };
            apply(&mut table, policy, Event::Started { job: id }, now)?;
            let d = trace[i].iteration;
            lane.running = Some((i, now + d));
            busy += d;
            match open_segment[l].map(|s| &mut schedule[s]) {
                Some(seg) if seg.job == id && seg.end == now => {
                    seg.end = now + d;
                    seg.iterations += 1;
                }
                _ => {
                    open_segment[l] = Some(schedule.len());
                    schedule.push(Segment {
                        lane: l,
                        job: id,
                        start: now,
                        end: now + d,
                        iterations: 1,
                    });
                }
            }
        }
    }

    Ok(SimRun {
        policy: name,
        lanes: cfg.lanes,
        outcomes: outcome.into_iter().flatten().collect(),
        schedule,
        busy,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::sim::contention::Contention;
    use crate::sim::engine::{simulate, simulate_with, SimOptions, Startup};
    use lanes_policies::{by_name, JobId, JobKind, JobSpec, JobView, POLICY_NAMES};
    use proptest::prelude::*;

    /// A built-in policy that makes no promise about its picks, so the
    /// engine asks it at every iteration boundary.
    #[derive(Debug)]
    struct NoPromise(Box<dyn Policy>);

    impl Policy for NoPromise {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn pick(&mut self, lane: LaneId, jobs: &[JobView], now: Duration) -> Option<JobId> {
            self.0.pick(lane, jobs, now)
        }
        fn place(&mut self, job: &JobSpec, lanes: &[LaneView], now: Duration) -> Option<LaneId> {
            self.0.place(job, lanes, now)
        }
        fn admission_rank(&self, job: &JobSpec) -> AdmissionRank {
            self.0.admission_rank(job)
        }
    }

    /// Random small traces whose times often coincide (submissions on a
    /// 5 ms grid, iterations of whole milliseconds), with microsecond
    /// iteration times in some.
    fn traces(max_jobs: usize) -> impl Strategy<Value = Vec<TraceJob>> {
        prop::collection::vec(
            (
                0u64..40,
                any::<bool>(),
                1u64..12,
                1u64..20,
                any::<bool>(),
                0i32..3,
                0u64..60,
                0u64..60,
            ),
            1..=max_jobs,
        )
        .prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(
                    |(i, (submit, inference, iterations, iter, odd, priority, p, t))| TraceJob {
                        id: i as u64 + 1,
                        submit: Duration::from_millis(submit * 5),
                        kind: if inference {
                            JobKind::Inference
                        } else {
                            JobKind::Training
                        },
                        iterations,
                        iteration: if odd {
                            Duration::from_micros(iter * 1_371)
                        } else {
                            Duration::from_millis(iter)
                        },
                        persistent_bytes: p,
                        ephemeral_bytes: t,
                        priority,
                    },
                )
                .collect()
        })
    }

    fn same(old: &SimRun, new: &SimRun) -> Result<(), TestCaseError> {
        prop_assert_eq!(new.schedule_lines(), old.schedule_lines());
        prop_assert_eq!(&new.outcomes, &old.outcomes);
        prop_assert_eq!(new.busy, old.busy);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256),
            ..ProptestConfig::default()
        })]

        #[test]
        fn the_event_driven_engine_matches_the_reference(
            trace in traces(14), lanes in 1usize..4, tight in any::<bool>(),
        ) {
            let per_lane: u64 = if tight { 120 } else { 1 << 40 };
            let cfg = SimConfig { memory: per_lane * lanes as u64, lanes };
            for name in POLICY_NAMES {
                let old = simulate_reference(&trace, by_name(name).unwrap().as_mut(), cfg).unwrap();
                let new = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, SimOptions { schedule: true, ..SimOptions::default() }).unwrap();
                same(&old, &new)?;
                let quiet = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, SimOptions { schedule: false, ..SimOptions::default() }).unwrap();
                prop_assert_eq!(&quiet.outcomes, &old.outcomes, "{} without schedule", name);
                prop_assert!(quiet.schedule.is_empty());
                let mut plain = NoPromise(by_name(name).unwrap());
                let asked = simulate_with(&trace, &mut plain, cfg, SimOptions { schedule: true, ..SimOptions::default() }).unwrap();
                same(&old, &asked)?;
                // A contention model where nothing slows down is the
                // every-iteration path, with the same result.
                let unit = Contention {
                    training_beside_inference: 1.0,
                    priority_training_beside_inference: 1.0,
                    inference_beside_training: 1.0,
                    training_beside_training: 1.0,
                    inference_beside_inference: 1.0,
                };
                let free = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, SimOptions { schedule: true, contention: Some(unit), ..SimOptions::default() }).unwrap();
                same(&old, &free)?;
            }
        }
    }

    /// Fair sharing among many jobs of different iteration times, with
    /// arrivals cutting runs: the closed-form order matches iteration by
    /// iteration.
    #[test]
    fn fair_in_closed_form_matches_on_a_busy_lane() {
        let trace: Vec<TraceJob> = (0..60u64)
            .map(|i| TraceJob {
                id: i + 1,
                submit: Duration::from_micros(i * 7_919),
                kind: JobKind::Training,
                iterations: 5 + (i * 37) % 90,
                iteration: Duration::from_micros(300 + (i * 1_231) % 4_000),
                persistent_bytes: (i * 13) % 50,
                ephemeral_bytes: (i * 29) % 50,
                priority: 0,
            })
            .collect();
        for (lanes, per_lane) in [(1usize, 1u64 << 40), (1, 200), (3, 120)] {
            let cfg = SimConfig {
                memory: per_lane * lanes as u64,
                lanes,
            };
            let old = simulate_reference(&trace, by_name("fair").unwrap().as_mut(), cfg).unwrap();
            let new = simulate_with(
                &trace,
                by_name("fair").unwrap().as_mut(),
                cfg,
                SimOptions::default(),
            )
            .unwrap();
            assert_eq!(
                new.schedule_lines(),
                old.schedule_lines(),
                "{lanes} lanes of {per_lane}"
            );
            assert_eq!(new.outcomes, old.outcomes);
        }
    }

    /// Two training jobs in two lanes: alone each takes 10 iterations of
    /// 10 ms; side by side under the H100 table (0.5 each) every iteration
    /// takes 20 ms while both run. A training lane beside an inference lane
    /// runs at 0.84, or 0.68 under the priority policy.
    #[test]
    fn contention_slows_lanes_that_run_at_once() {
        let job = |id, kind, submit_ms| TraceJob {
            id,
            submit: Duration::from_millis(submit_ms),
            kind,
            iterations: 10,
            iteration: Duration::from_millis(10),
            persistent_bytes: 60,
            ephemeral_bytes: 0,
            priority: 0,
        };
        let cfg = SimConfig {
            memory: 200,
            lanes: 2,
        };
        let opts = SimOptions {
            schedule: true,
            contention: Some(Contention::h100()),
            ..SimOptions::default()
        };
        let two = [job(1, JobKind::Training, 0), job(2, JobKind::Training, 0)];
        let alone = simulate_with(
            &two,
            by_name("fifo").unwrap().as_mut(),
            SimConfig {
                memory: 100,
                lanes: 1,
            },
            opts,
        )
        .unwrap();
        // One lane: one after the other at full speed.
        let jct: Vec<u128> = alone.outcomes.iter().map(|o| o.jct().as_millis()).collect();
        assert_eq!(jct, vec![100, 200]);
        let side = simulate_with(&two, by_name("fifo").unwrap().as_mut(), cfg, opts).unwrap();
        let jct: Vec<u128> = side.outcomes.iter().map(|o| o.jct().as_millis()).collect();
        assert_eq!(jct, vec![200, 200]);
        assert_eq!(side.busy, Duration::from_millis(400));
        // Training beside inference.
        let mixed = [job(1, JobKind::Training, 0), job(2, JobKind::Inference, 0)];
        // Under fifo training (0.84) ends at 119 ms, during inference's 9th
        // iteration (13.3 ms each at 0.75): its 10th runs alone, 10 ms.
        // Under priority training (0.68) outlasts inference.
        for (policy, train_s, infer_s) in [
            ("fifo", 0.1 / 0.84, 0.09 / 0.75 + 0.01),
            ("priority", 0.1 / 0.68, 0.1 / 0.75),
        ] {
            let r = simulate_with(&mixed, by_name(policy).unwrap().as_mut(), cfg, opts).unwrap();
            let train = r.outcomes[0].jct().as_secs_f64();
            let infer = r.outcomes[1].jct().as_secs_f64();
            assert!((train - train_s).abs() < 1e-6, "{policy}: {train}");
            assert!((infer - infer_s).abs() < 1e-6, "{policy}: {infer}");
        }
        // Without the model the lanes run at full speed side by side.
        let free = simulate(&two, by_name("fifo").unwrap().as_mut(), cfg).unwrap();
        assert!(free
            .outcomes
            .iter()
            .all(|o| o.jct() == Duration::from_millis(100)));
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(64),
            ..ProptestConfig::default()
        })]

        /// Start-up is a later entry into admission: the same as the trace
        /// with shifted submissions, JCTs counted from the real ones.
        #[test]
        fn startup_is_a_shifted_submission(
            trace in traces(10), lanes in 1usize..3, train_ms in 0u64..50, infer_ms in 0u64..50,
        ) {
            let startup = Startup {
                training: Duration::from_millis(train_ms),
                inference: Duration::from_millis(infer_ms),
            };
            let cfg = SimConfig { memory: 120 * lanes as u64, lanes };
            let shifted: Vec<TraceJob> = trace
                .iter()
                .map(|j| TraceJob { submit: j.submit + startup.of(j.kind), ..j.clone() })
                .collect();
            for name in POLICY_NAMES {
                let opts = SimOptions { startup, ..SimOptions::default() };
                let with = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, opts).unwrap();
                let plain = simulate(&shifted, by_name(name).unwrap().as_mut(), cfg).unwrap();
                prop_assert_eq!(with.schedule_lines(), plain.schedule_lines());
                for ((w, p), j) in with.outcomes.iter().zip(&plain.outcomes).zip(&trace) {
                    prop_assert_eq!(w.submit, j.submit);
                    prop_assert_eq!(w.finish, p.finish);
                    prop_assert_eq!(w.jct(), p.jct() + startup.of(j.kind));
                }
            }
        }

        /// With loads holding lanes, the event-driven runs (cut at the
        /// boundary where a load starts) give the result of asking the
        /// policy at every iteration boundary, with and without a
        /// contention model; a zero load is the plain start-up.
        #[test]
        fn loads_event_driven_match_per_iteration(
            trace in traces(12), lanes in 1usize..4, tight in any::<bool>(),
            load_ms in (1u64..30, 0u64..30), after_ms in (0u64..5, 0u64..5), contended in any::<bool>(),
        ) {
            let per_lane: u64 = if tight { 120 } else { 1 << 40 };
            let cfg = SimConfig { memory: per_lane * lanes as u64, lanes };
            let ms = |(t, i): (u64, u64)| Startup {
                training: Duration::from_millis(t),
                inference: Duration::from_millis(i),
            };
            let load = ms(load_ms);
            let after_load = ms(after_ms);
            let startup = ms((load_ms.0 + after_ms.0 + 7, load_ms.1 + after_ms.1 + 3));
            let contention = contended.then(Contention::h100);
            let opts = SimOptions { startup, load, after_load, contention, ..SimOptions::default() };
            let close = |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_micros(1);
            for name in POLICY_NAMES {
                let fast = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, opts).unwrap();
                let mut plain = NoPromise(by_name(name).unwrap());
                let step = simulate_with(&trace, &mut plain, cfg, opts).unwrap();
                prop_assert_eq!(fast.outcomes.len(), trace.len());
                for (f, s) in fast.outcomes.iter().zip(&step.outcomes) {
                    prop_assert_eq!(f.lane, s.lane, "{}", name);
                    prop_assert!(close(f.admitted, s.admitted), "{}: {:?} vs {:?}", name, f, s);
                    prop_assert!(close(f.finish, s.finish), "{}: {:?} vs {:?}", name, f, s);
                }
                prop_assert!(close(fast.busy, step.busy), "{}", name);
                if contention.is_none() {
                    prop_assert_eq!(fast.schedule_lines(), step.schedule_lines(), "{}", name);
                    // The lanes' work is the same; only the waits differ.
                    let shifted = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, SimOptions { startup, ..SimOptions::default() }).unwrap();
                    prop_assert_eq!(fast.busy, shifted.busy);
                }
            }
        }

        /// Without hints the engine asks at every boundary; with a policy
        /// that ignores hints (fifo, fair, pack, priority) the result is
        /// the reference's.
        #[test]
        fn no_hints_changes_nothing_for_policies_that_ignore_them(
            trace in traces(10), lanes in 1usize..3,
        ) {
            let cfg = SimConfig { memory: 120 * lanes as u64, lanes };
            for name in ["fifo", "fair", "pack", "priority"] {
                let old = simulate_reference(&trace, by_name(name).unwrap().as_mut(), cfg).unwrap();
                let opts = SimOptions { hints: false, ..SimOptions::default() };
                let new = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, opts).unwrap();
                same(&old, &new)?;
            }
        }
    }

    /// A job of `n` iterations of `iter_us` taking 60 of a lane's 100
    /// bytes.
    fn solo(id: u64, kind: JobKind, submit_ms: u64, n: u64, iter_us: u64) -> TraceJob {
        TraceJob {
            id,
            submit: Duration::from_millis(submit_ms),
            kind,
            iterations: n,
            iteration: Duration::from_micros(iter_us),
            persistent_bytes: 60,
            ephemeral_bytes: 0,
            priority: 0,
        }
    }

    /// Training jobs start up in 50 ms, of which the load takes 20 ms and
    /// 5 ms follow it; inference jobs start at once.
    fn with_load() -> SimOptions {
        let ms = |m| Startup {
            training: Duration::from_millis(m),
            inference: Duration::ZERO,
        };
        SimOptions {
            startup: ms(50),
            load: ms(20),
            after_load: ms(5),
            ..SimOptions::default()
        }
    }

    /// One lane: a training job submitted at 28 ms asks for the worker at
    /// 53 ms; the running job reaches its boundary at 60 ms, the load
    /// holds the lane until 80 ms, so the running job ends exactly the
    /// load later; the newcomer enters admission at 85 ms.
    #[test]
    fn a_load_holds_the_lane_of_the_running_job() {
        use JobKind::{Inference, Training};
        let trace = [
            solo(1, Inference, 0, 10, 10_000),
            solo(2, Training, 28, 3, 10_000),
        ];
        let cfg = SimConfig {
            memory: 1 << 20,
            lanes: 1,
        };
        for name in POLICY_NAMES {
            let startup_only = SimOptions {
                startup: with_load().startup,
                ..SimOptions::default()
            };
            let plain =
                simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, startup_only).unwrap();
            let held =
                simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, with_load()).unwrap();
            // The lane never idles: the last job ends the load later.
            assert_eq!(
                held.outcomes[0].finish,
                plain.outcomes[0].finish + Duration::from_millis(20),
                "{name}"
            );
            assert_eq!(plain.outcomes[1].admitted, Duration::from_millis(78));
            assert_eq!(
                held.outcomes[1].admitted,
                Duration::from_millis(85),
                "{name}"
            );
            // The load is not busy time.
            assert_eq!(held.busy, plain.busy, "{name}");
        }
        let fifo =
            simulate_with(&trace, by_name("fifo").unwrap().as_mut(), cfg, with_load()).unwrap();
        assert_eq!(
            fifo.schedule_lines(),
            [
                "t=0..60 lane=0 job=1 iters=6",
                "t=80..120 lane=0 job=1 iters=4",
                "t=120..150 lane=0 job=2 iters=3"
            ]
        );
        // The load asks for the worker when the lane is idle: no wait, the
        // job enters admission its start-up after its submission.
        let late = [
            solo(1, Inference, 0, 10, 10_000),
            solo(2, Training, 100, 3, 10_000),
        ];
        let r = simulate_with(&late, by_name("fifo").unwrap().as_mut(), cfg, with_load()).unwrap();
        assert_eq!(r.outcomes[0].finish, Duration::from_millis(100));
        assert_eq!(r.outcomes[1].admitted, Duration::from_millis(150));
        assert_eq!(r.outcomes[1].finish, Duration::from_millis(180));
    }

    /// Two lanes (one job each): with one idle, the load runs there and
    /// the busy lane's job is not delayed; with both busy, the lane whose
    /// iteration boundary comes first holds the load, and only its job is
    /// delayed.
    #[test]
    fn a_load_takes_an_idle_lane_else_the_first_boundary() {
        use JobKind::{Inference, Training};
        let cfg = SimConfig {
            memory: 200,
            lanes: 2,
        };
        let trace = [
            solo(1, Inference, 0, 10, 10_000),
            solo(3, Training, 28, 3, 10_000),
        ];
        let r = simulate_with(&trace, by_name("fifo").unwrap().as_mut(), cfg, with_load()).unwrap();
        assert_eq!(r.outcomes[0].finish, Duration::from_millis(100));
        assert_eq!(r.outcomes[1].admitted, Duration::from_millis(78));
        assert_eq!(r.outcomes[1].lane, 1);
        // Job 2 (7 ms iterations) in lane 1 reaches its boundary at 56 ms,
        // before job 1 (60 ms): lane 1 holds the load from 56 to 76 ms.
        let trace = [
            solo(1, Inference, 0, 10, 10_000),
            solo(2, Inference, 0, 10, 7_000),
            solo(3, Training, 28, 3, 10_000),
        ];
        let r = simulate_with(&trace, by_name("fifo").unwrap().as_mut(), cfg, with_load()).unwrap();
        assert_eq!((r.outcomes[0].lane, r.outcomes[1].lane), (0, 1));
        assert_eq!(r.outcomes[0].finish, Duration::from_millis(100));
        assert_eq!(r.outcomes[1].finish, Duration::from_millis(90));
        // Job 3 entered admission at 81 ms and waited for job 2's memory.
        assert_eq!(r.outcomes[2].admitted, Duration::from_millis(90));
        assert_eq!(r.outcomes[2].finish, Duration::from_millis(120));
    }

    /// SRTF without hints (as the service runs it): an unmeasured job
    /// counts as no work, runs one iteration, then ranks by what it
    /// measured.
    #[test]
    fn srtf_without_hints_measures_before_it_ranks() {
        let job = |id, iterations, ms| TraceJob {
            id,
            submit: Duration::ZERO,
            kind: JobKind::Training,
            iterations,
            iteration: Duration::from_millis(ms),
            persistent_bytes: 1,
            ephemeral_bytes: 0,
            priority: 0,
        };
        // A: 10 x 100 ms (1 s of work); B: 100 x 1 ms (0.1 s).
        let trace = [job(1, 10, 100), job(2, 100, 1)];
        let cfg = SimConfig {
            memory: 100,
            lanes: 1,
        };
        let hinted = simulate(&trace, by_name("srtf").unwrap().as_mut(), cfg).unwrap();
        assert_eq!(
            hinted.jct_lines(),
            vec!["jct job=1 ms=1100", "jct job=2 ms=100"]
        );
        let opts = SimOptions {
            hints: false,
            ..SimOptions::default()
        };
        let blind = simulate_with(&trace, by_name("srtf").unwrap().as_mut(), cfg, opts).unwrap();
        // A's first iteration (0..100), B's first (100..101): B then ranks
        // 99 ms against A's 900 ms and runs to its end (200), then A.
        assert_eq!(
            blind.jct_lines(),
            vec!["jct job=1 ms=1100", "jct job=2 ms=200"]
        );
        assert_eq!(
            blind.schedule_lines(),
            vec![
                "t=0..100 lane=0 job=1 iters=1",
                "t=100..200 lane=0 job=2 iters=100",
                "t=200..1100 lane=0 job=1 iters=9",
            ]
        );
    }

    /// Two lanes under fifo, three small jobs at once: equal lanes with
    /// first fit put all three in lane 0, one after the other; the
    /// service's lane manager opens a lane for each of the first two (a
    /// lane is sized to its first job) and the third joins one of them.
    #[test]
    fn service_placement_differs_from_equal_lanes() {
        use crate::sim::placement::LanePlacement;
        const MIB: u64 = 1 << 20;
        let trace: Vec<TraceJob> = (1..=3)
            .map(|id| TraceJob {
                id,
                submit: Duration::ZERO,
                kind: JobKind::Training,
                iterations: 10,
                iteration: Duration::from_millis(10),
                persistent_bytes: 10 * MIB,
                ephemeral_bytes: MIB,
                priority: 0,
            })
            .collect();
        let cfg = SimConfig {
            memory: 100 * MIB,
            lanes: 2,
        };
        let equal = simulate(&trace, by_name("fifo").unwrap().as_mut(), cfg).unwrap();
        assert_eq!(
            equal.jct_lines(),
            vec!["jct job=1 ms=100", "jct job=2 ms=200", "jct job=3 ms=300"]
        );
        assert!(equal.outcomes.iter().all(|o| o.lane == 0));
        let opts = SimOptions {
            placement: LanePlacement::Service,
            ..SimOptions::default()
        };
        let service = simulate_with(&trace, by_name("fifo").unwrap().as_mut(), cfg, opts).unwrap();
        assert_eq!(service.outcomes[0].lane, 0);
        assert_eq!(service.outcomes[1].lane, 1);
        let third = &service.outcomes[2];
        assert_eq!(third.jct(), Duration::from_millis(200), "{third:?}");
        // One lane and memory for one job at a time: the service's manager
        // admits the next job when the previous one leaves.
        let one = SimConfig {
            memory: 12 * MIB,
            lanes: 1,
        };
        let serial = simulate_with(&trace, by_name("fifo").unwrap().as_mut(), one, opts).unwrap();
        assert_eq!(
            serial.jct_lines(),
            vec!["jct job=1 ms=100", "jct job=2 ms=200", "jct job=3 ms=300"]
        );
    }

    /// On generated traces (hundreds of iterations per job, mixed kinds,
    /// queues for memory) every policy's event-driven contention matches
    /// the per-iteration path: SRTF's runs that end on a lost pick and
    /// fair's that end on a change of kind are exercised at length.
    #[test]
    fn event_driven_contention_matches_on_generated_traces() {
        let close = |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_micros(1);
        for (seed, lanes, gib) in [(1u64, 2usize, 24u64), (2, 3, 40), (3, 2, 64)] {
            let trace = crate::sim::gen::generate(&crate::sim::gen::GenConfig {
                jobs: 300,
                seed,
                mean_interarrival_s: 1.0,
                ..Default::default()
            });
            let cfg = SimConfig {
                memory: gib << 30,
                lanes,
            };
            let opts = SimOptions {
                contention: Some(Contention::h100()),
                schedule: false,
                ..SimOptions::default()
            };
            for name in POLICY_NAMES {
                let fast =
                    simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, opts).unwrap();
                let mut plain = NoPromise(by_name(name).unwrap());
                let step = simulate_with(&trace, &mut plain, cfg, opts).unwrap();
                assert_eq!(fast.outcomes.len(), step.outcomes.len());
                for (f, s) in fast.outcomes.iter().zip(&step.outcomes) {
                    assert_eq!(f.lane, s.lane, "{name} seed {seed}");
                    assert!(
                        close(f.admitted, s.admitted),
                        "{name} seed {seed}: {f:?} vs {s:?}"
                    );
                    assert!(
                        close(f.finish, s.finish),
                        "{name} seed {seed}: {f:?} vs {s:?}"
                    );
                }
                assert!(close(fast.busy, step.busy), "{name} seed {seed}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256),
            ..ProptestConfig::default()
        })]

        /// Event-driven contention (a run re-rated only when the lanes
        /// busy change) gives the per-iteration result, to 1 µs.
        #[test]
        fn event_driven_contention_matches_per_iteration(
            trace in traces(14), lanes in 1usize..4, tight in any::<bool>(), fitted in any::<bool>(),
        ) {
            let per_lane: u64 = if tight { 120 } else { 1 << 40 };
            let cfg = SimConfig { memory: per_lane * lanes as u64, lanes };
            let model = if fitted {
                Contention::h100_resnet18_cifar().unwrap()
            } else {
                Contention::h100()
            };
            let opts = SimOptions { contention: Some(model), ..SimOptions::default() };
            let close = |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_micros(1);
            for name in POLICY_NAMES {
                let fast = simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg, opts).unwrap();
                let mut plain = NoPromise(by_name(name).unwrap());
                let step = simulate_with(&trace, &mut plain, cfg, opts).unwrap();
                prop_assert_eq!(fast.outcomes.len(), step.outcomes.len());
                for (f, s) in fast.outcomes.iter().zip(&step.outcomes) {
                    prop_assert_eq!(f.lane, s.lane, "{}", name);
                    prop_assert!(close(f.admitted, s.admitted), "{}: {:?} vs {:?}", name, f, s);
                    prop_assert!(close(f.finish, s.finish), "{}: {:?} vs {:?}", name, f, s);
                }
                prop_assert!(close(fast.busy, step.busy), "{}: busy {:?} vs {:?}", name, fast.busy, step.busy);
            }
        }
    }
}
