//! Several GPUs (`lanes simulate --gpus N`): N devices, each with its own
//! lanes ([`SimConfig`] is per device) and its own instance of the policy,
//! and each job placed on one device when it is submitted.
//!
//! Placement follows the rule of `lanes-adaptor`'s `placement::choose` (a
//! job that names no GPU goes where it is admitted soonest), scored on the
//! devices' simulated state at the job's submission: among the devices
//! where the job fits now, the least loaded (memory in use over memory,
//! then fewer unfinished jobs, then the lower index); if it fits nowhere,
//! the one with the fewest jobs not yet admitted (then the same order).
//!
//! A device's state at time `t` is read from a simulation of the jobs
//! placed on it so far, all submitted at or before `t`: a job is admitted
//! at `t` if `admitted <= t < finish`, waiting if it was submitted but not
//! admitted yet (starting up or waiting for memory), finished otherwise.
//! Later submissions cannot change what happened before them, so this is
//! the state the device had. "Fits now" is the service's forecast: no job
//! waits there, and under equal lanes (`--placement policy`) one lane keeps
//! `sum P + max T <= C` with the job added; under the service's lane
//! manager (`--placement service`), `P + T` fits the memory its admitted
//! jobs leave (the lane manager is not replayed for the forecast).
//!
//! After each placement the chosen device is simulated again (its engine
//! cannot be stepped to a time), so the cost is one simulation of a
//! device's jobs per job: meant for traces of hundreds to a few thousand
//! jobs. With one GPU nothing is placed and the result is
//! [`simulate_with`]'s, bit for bit.

use std::collections::HashMap;
use std::time::Duration;

use lanes_policies::{JobId, Policy, PolicyError};

use super::engine::{simulate_with, JobOutcome, SimConfig, SimError, SimOptions, SimRun};
use super::placement::LanePlacement;
use super::report::Summary;
use super::trace::TraceJob;

/// The result of simulating a trace on several devices.
#[derive(Debug, Clone)]
pub struct DevicesRun {
    /// Every job, in trace order, as one run over all devices' lanes: a
    /// job's lane is `device × lanes + its lane on the device`, `lanes`
    /// and `busy` are summed over the devices.
    pub combined: SimRun,
    /// Each device's own run (its jobs, in trace order).
    pub devices: Vec<SimRun>,
    /// The device of each job, in trace order.
    pub device_of: Vec<usize>,
}

/// Run `trace` on `gpus` devices of `cfg` each, every device with a policy
/// from `policy`. `gpus == 1` is [`simulate_with`] itself.
pub fn simulate_devices(
    trace: &[TraceJob],
    policy: &dyn Fn() -> Result<Box<dyn Policy>, PolicyError>,
    cfg: SimConfig,
    opts: SimOptions,
    gpus: usize,
) -> Result<DevicesRun, SimError> {
    if gpus <= 1 {
        let run = simulate_with(trace, policy()?.as_mut(), cfg, opts)?;
        return Ok(DevicesRun {
            combined: run.clone(),
            device_of: vec![0; trace.len()],
            devices: vec![run],
        });
    }
    let name = policy()?.name();
    let empty = || SimRun {
        policy: name,
        lanes: cfg.lanes,
        outcomes: Vec::new(),
        schedule: Vec::new(),
        busy: Duration::ZERO,
    };
    // Submission order (trace order among equal times).
    let mut order: Vec<usize> = (0..trace.len()).collect();
    order.sort_by_key(|&i| (trace[i].submit, i));
    let mut device_of = vec![0usize; trace.len()];
    let mut jobs: Vec<Vec<usize>> = vec![Vec::new(); gpus];
    let mut runs: Vec<SimRun> = (0..gpus).map(|_| empty()).collect();
    let run_device = |ids: &[usize]| -> Result<SimRun, SimError> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        let sub: Vec<TraceJob> = ids.iter().map(|&i| trace[i].clone()).collect();
        simulate_with(&sub, policy()?.as_mut(), cfg, opts)
    };
    let sizes: HashMap<JobId, (u64, u64)> = trace
        .iter()
        .map(|j| (j.id, (j.persistent_bytes, j.ephemeral_bytes)))
        .collect();
    for &i in &order {
        let job = &trace[i];
        let states: Vec<DeviceState> = runs
            .iter()
            .map(|run| DeviceState::at(run, &sizes, job.submit, cfg, opts.placement))
            .collect();
        let d = choose(&states, job.persistent_bytes, job.ephemeral_bytes);
        device_of[i] = d;
        jobs[d].push(i);
        runs[d] = run_device(&jobs[d])?;
    }
    Ok(DevicesRun {
        combined: combine(trace, &runs, &jobs, cfg.lanes, name),
        devices: runs,
        device_of,
    })
}

/// One device at a job's submission, as placement sees it.
#[derive(Debug, Clone, PartialEq)]
struct DeviceState {
    /// Per lane: `(sum P, max T)` of its admitted jobs (under the service's
    /// lane manager, one entry for the whole memory).
    lanes: Vec<(u64, u64)>,
    /// What one lane holds.
    capacity: u64,
    /// Memory in use over the device's memory.
    load: f64,
    /// Jobs submitted and not yet admitted.
    waiting: usize,
    /// Jobs submitted and not finished.
    unfinished: usize,
}

impl DeviceState {
    fn at(
        run: &SimRun,
        sizes: &HashMap<JobId, (u64, u64)>,
        t: Duration,
        cfg: SimConfig,
        placement: LanePlacement,
    ) -> DeviceState {
        let whole = matches!(placement, LanePlacement::Service);
        let (slots, capacity) = if whole {
            (1, cfg.memory)
        } else {
            (cfg.lanes.max(1), cfg.memory / cfg.lanes.max(1) as u64)
        };
        let mut lanes = vec![(0u64, 0u64); slots];
        let (mut waiting, mut unfinished) = (0, 0);
        for o in &run.outcomes {
            if o.submit > t || o.finish <= t {
                continue;
            }
            unfinished += 1;
            if o.admitted > t {
                waiting += 1;
                continue;
            }
            let (p, e) = sizes.get(&o.id).copied().unwrap_or_default();
            let slot = if whole { 0 } else { o.lane.min(slots - 1) };
            let l = &mut lanes[slot];
            *l = (l.0.saturating_add(p), l.1.max(e));
        }
        let used: u64 = lanes.iter().map(|&(p, e)| p.saturating_add(e)).sum();
        let load = if cfg.memory == 0 {
            1.0
        } else {
            used as f64 / cfg.memory as f64
        };
        DeviceState {
            lanes,
            capacity,
            load,
            waiting,
            unfinished,
        }
    }

    /// Whether a job of `p` persistent and `t` ephemeral bytes is admitted
    /// here now, by the service's forecast.
    fn fits(&self, p: u64, t: u64) -> bool {
        self.waiting == 0
            && self.lanes.iter().any(|&(sum_p, max_t)| {
                sum_p.saturating_add(p).saturating_add(max_t.max(t)) <= self.capacity
            })
    }
}

/// `placement::choose`'s order over simulated devices: the least loaded
/// device the job fits now, else the shortest wait.
fn choose(states: &[DeviceState], p: u64, t: u64) -> usize {
    let by_load = |a: &(usize, &DeviceState), b: &(usize, &DeviceState)| {
        a.1.load
            .total_cmp(&b.1.load)
            .then(a.1.unfinished.cmp(&b.1.unfinished))
            .then(a.0.cmp(&b.0))
    };
    let fitting = states
        .iter()
        .enumerate()
        .filter(|(_, s)| s.fits(p, t))
        .min_by(by_load);
    fitting
        .or_else(|| {
            states
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.waiting.cmp(&b.1.waiting).then_with(|| by_load(a, b)))
        })
        .map_or(0, |(i, _)| i)
}

/// All devices' outcomes as one run, in trace order.
fn combine(
    trace: &[TraceJob],
    runs: &[SimRun],
    jobs: &[Vec<usize>],
    lanes: usize,
    name: &'static str,
) -> SimRun {
    let mut outcomes: Vec<(usize, JobOutcome)> = Vec::with_capacity(trace.len());
    for (d, (run, ids)) in runs.iter().zip(jobs).enumerate() {
        let mut ids = ids.clone();
        ids.sort_unstable();
        // A device's run lists its jobs in its trace's order: `ids` sorted.
        for (&i, o) in ids.iter().zip(&run.outcomes) {
            let mut o = o.clone();
            o.lane += d * lanes;
            outcomes.push((i, o));
        }
    }
    outcomes.sort_by_key(|(i, _)| *i);
    let mut schedule: Vec<_> = runs
        .iter()
        .enumerate()
        .flat_map(|(d, r)| {
            r.schedule.iter().map(move |s| {
                let mut s = *s;
                s.lane += d * lanes;
                s
            })
        })
        .collect();
    schedule.sort_by_key(|s| (s.start, s.lane));
    SimRun {
        policy: name,
        lanes: lanes * runs.len(),
        outcomes: outcomes.into_iter().map(|(_, o)| o).collect(),
        schedule,
        busy: runs.iter().map(|r| r.busy).sum(),
    }
}

/// One device's share of a [`DevicesRun`] (seconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeviceSummary {
    /// The device's index.
    pub device: usize,
    /// Jobs placed on it.
    pub jobs: usize,
    /// Its first submission to its last completion.
    pub makespan_s: f64,
    /// Its busy lane-time / (its lanes × its makespan).
    pub utilisation: f64,
}

/// What `lanes simulate --gpus N` reports for one policy: the combined
/// numbers (JCT over every job, makespan from the first submission to the
/// last completion on any device, utilisation over all lanes) and each
/// device's.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DevicesSummary {
    /// Over all devices.
    #[serde(flatten)]
    pub combined: Summary,
    /// Number of devices.
    pub gpus: usize,
    /// Per device.
    pub devices: Vec<DeviceSummary>,
}

impl DevicesSummary {
    /// Summarise one run.
    pub fn of(run: &DevicesRun) -> DevicesSummary {
        DevicesSummary {
            combined: Summary::of(&run.combined),
            gpus: run.devices.len(),
            devices: run
                .devices
                .iter()
                .enumerate()
                .map(|(device, r)| {
                    let s = Summary::of(r);
                    DeviceSummary {
                        device,
                        jobs: s.jobs,
                        makespan_s: s.makespan_s,
                        utilisation: s.utilisation,
                    }
                })
                .collect(),
        }
    }
}

/// A plain-text table of each policy's devices.
pub fn devices_table(rows: &[DevicesSummary]) -> String {
    let w = rows
        .iter()
        .map(|r| r.combined.policy.chars().count())
        .max()
        .unwrap_or(0)
        .max(14);
    let mut s = format!(
        "{:<w$} {:>6} {:>5} {:>12} {:>7}\n",
        "policy", "gpu", "jobs", "makespan s", "util"
    );
    for r in rows {
        for d in &r.devices {
            s.push_str(&format!(
                "{:<w$} {:>6} {:>5} {:>12.1} {:>7.3}\n",
                r.combined.policy, d.device, d.jobs, d.makespan_s, d.utilisation
            ));
        }
    }
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::sim::gen::{generate, GenConfig};
    use lanes_policies::{by_name, JobKind, POLICY_NAMES};
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    fn job(id: JobId, submit_s: u64, iterations: u64, p: u64, t: u64) -> TraceJob {
        TraceJob {
            id,
            submit: Duration::from_secs(submit_s),
            kind: JobKind::Training,
            iterations,
            iteration: Duration::from_millis(100),
            persistent_bytes: p,
            ephemeral_bytes: t,
            priority: 0,
        }
    }

    fn cfg(lanes: usize) -> SimConfig {
        SimConfig {
            memory: 16 * GIB,
            lanes,
        }
    }

    fn run(
        trace: &[TraceJob],
        name: &str,
        cfg: SimConfig,
        opts: SimOptions,
        gpus: usize,
    ) -> Result<DevicesRun, SimError> {
        simulate_devices(trace, &|| by_name(name), cfg, opts, gpus)
    }

    #[test]
    fn one_gpu_is_the_plain_simulation_for_every_policy() {
        let trace = generate(&GenConfig {
            jobs: 80,
            seed: 3,
            ..GenConfig::default()
        });
        for placement in [LanePlacement::Policy, LanePlacement::Service] {
            let opts = SimOptions {
                placement,
                ..SimOptions::default()
            };
            for name in POLICY_NAMES {
                let plain =
                    simulate_with(&trace, by_name(name).unwrap().as_mut(), cfg(2), opts).unwrap();
                let one = run(&trace, name, cfg(2), opts, 1).unwrap();
                assert_eq!(Summary::of(&one.combined), Summary::of(&plain), "{name}");
                assert_eq!(one.combined.outcomes, plain.outcomes, "{name}");
                assert_eq!(one.combined.schedule, plain.schedule, "{name}");
                assert_eq!(one.devices.len(), 1);
            }
        }
    }

    #[test]
    fn two_gpus_halve_the_makespan_of_jobs_that_fit_one_at_a_time() {
        // 12 jobs of 10 s, 10 GiB each on 16 GiB: one at a time per GPU.
        let trace: Vec<TraceJob> = (0..12).map(|i| job(i, 0, 100, 8 * GIB, 2 * GIB)).collect();
        for name in POLICY_NAMES {
            let one = run(&trace, name, cfg(1), SimOptions::default(), 1).unwrap();
            let two = run(&trace, name, cfg(1), SimOptions::default(), 2).unwrap();
            let (m1, m2) = (
                Summary::of(&one.combined).makespan_s,
                Summary::of(&two.combined).makespan_s,
            );
            assert!((m1 - 120.0).abs() < 1e-6, "{name}: {m1}");
            assert!((m2 - 60.0).abs() < 1e-6, "{name}: {m2}");
            // Six jobs each, and each device busy the whole time.
            for d in &two.devices {
                let s = Summary::of(d);
                assert_eq!(s.jobs, 6, "{name}");
                assert!((s.utilisation - 1.0).abs() < 1e-9, "{name}");
            }
        }
    }

    #[test]
    fn placement_prefers_room_then_load_then_the_shorter_queue() {
        // Job 0 (12 GiB) takes GPU 0 (both empty: the lower index); job 1
        // (12 GiB) does not fit beside it: GPU 1. Job 2 (1 GiB) fits both,
        // equally loaded with one job each: the lower index, GPU 0. Job 3
        // (12 GiB) fits nowhere, no queue anywhere: GPU 1, less loaded.
        let trace = vec![
            job(0, 0, 1000, 12 * GIB, 0),
            job(1, 1, 1000, 12 * GIB, 0),
            job(2, 2, 1000, GIB, 0),
            job(3, 3, 1000, 12 * GIB, 0),
            // Job 4 fits nowhere either; GPU 1 has job 3 waiting, GPU 0
            // has none: GPU 0.
            job(4, 4, 1000, 12 * GIB, 0),
        ];
        let r = run(&trace, "fifo", cfg(1), SimOptions::default(), 2).unwrap();
        assert_eq!(r.device_of, vec![0, 1, 0, 1, 0]);
    }

    #[test]
    fn no_device_takes_a_job_larger_than_its_lanes() {
        let trace = vec![job(0, 0, 10, 4 * GIB, 0), job(1, 0, 10, 9 * GIB, 0)];
        // 8 GiB lanes: job 1 fits no device's lane, whichever is chosen.
        let err = run(&trace, "fifo", cfg(2), SimOptions::default(), 3).unwrap_err();
        assert!(
            matches!(err, SimError::JobNeverFits { job: 1, .. }),
            "{err}"
        );
        // Every job of a generated trace sits in a lane that holds it.
        let trace = generate(&GenConfig {
            jobs: 60,
            seed: 9,
            ..GenConfig::default()
        });
        let r = run(&trace, "pack", cfg(2), SimOptions::default(), 3).unwrap();
        for (d, dev) in r.devices.iter().enumerate() {
            for o in &dev.outcomes {
                let j = trace.iter().find(|j| j.id == o.id).unwrap();
                assert!(j.persistent_bytes + j.ephemeral_bytes <= 8 * GIB);
                assert!(o.lane < 2);
                assert_eq!(
                    r.device_of[trace.iter().position(|x| x.id == o.id).unwrap()],
                    d
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn every_job_runs_exactly_once_on_its_device(
            seed in 0u64..1000,
            jobs in 1usize..40,
            gpus in 2usize..5,
            lanes in 1usize..3,
            policy in 0usize..POLICY_NAMES.len(),
            service in any::<bool>(),
        ) {
            let name = POLICY_NAMES[policy];
            let trace = generate(&GenConfig { jobs, seed, mean_interarrival_s: 2.0, ..GenConfig::default() });
            // The property is about jobs that fit a lane: the generator's
            // largest training job (P and T up to 8 GiB each) does not fit
            // the 8 GiB lanes of two (a run then answers JobNeverFits, as
            // `no_device_takes_a_job_larger_than_its_lanes` checks).
            let lane = cfg(lanes).memory / lanes as u64;
            prop_assume!(trace.iter().all(|j| j.persistent_bytes + j.ephemeral_bytes <= lane));
            let opts = SimOptions {
                placement: if service { LanePlacement::Service } else { LanePlacement::Policy },
                ..SimOptions::default()
            };
            let r = run(&trace, name, cfg(lanes), opts, gpus).unwrap();
            prop_assert_eq!(r.devices.len(), gpus);
            prop_assert_eq!(r.combined.outcomes.len(), trace.len());
            prop_assert_eq!(r.combined.lanes, lanes * gpus);
            let on_devices: usize = r.devices.iter().map(|d| d.outcomes.len()).sum();
            prop_assert_eq!(on_devices, trace.len());
            for (i, (j, o)) in trace.iter().zip(&r.combined.outcomes).enumerate() {
                prop_assert_eq!(j.id, o.id);
                let d = r.device_of[i];
                prop_assert_eq!(o.lane / lanes, d);
                let mine: Vec<_> = r.devices[d].outcomes.iter().filter(|x| x.id == j.id).collect();
                prop_assert_eq!(mine.len(), 1);
                prop_assert_eq!(mine[0].finish, o.finish);
                for (e, other) in r.devices.iter().enumerate() {
                    if e != d {
                        prop_assert!(other.outcomes.iter().all(|x| x.id != j.id));
                    }
                }
                // Its iterations, all of them, on its device's lanes.
                let ran: u64 = r.combined.schedule.iter()
                    .filter(|s| s.job == j.id)
                    .map(|s| { assert_eq!(s.lane / lanes, d); s.iterations })
                    .sum();
                prop_assert_eq!(ran, j.iterations);
            }
            // Each device is the plain simulation of its own jobs.
            for (d, dev) in r.devices.iter().enumerate() {
                let sub: Vec<TraceJob> = trace.iter().enumerate()
                    .filter(|(i, _)| r.device_of[*i] == d)
                    .map(|(_, j)| j.clone())
                    .collect();
                if sub.is_empty() {
                    prop_assert!(dev.outcomes.is_empty());
                    continue;
                }
                let plain = simulate_with(&sub, by_name(name).unwrap().as_mut(), cfg(lanes), opts).unwrap();
                prop_assert_eq!(&plain.outcomes, &dev.outcomes);
            }
        }
    }
}
