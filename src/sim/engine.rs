//! The discrete-event simulator: jobs from a trace, lanes with memory, and a
//! [`Policy`] making every placement and every iteration decision — the same
//! code the service runs.
//!
//! Model (documented in `docs/scheduling.md`):
//! - `lanes` equal lanes share `memory` bytes; a job is admitted into a lane
//!   chosen by [`Policy::place`] only if the safety condition holds; jobs
//!   that fit nowhere wait and are retried whenever a job leaves, in the
//!   policy's admission order ([`Policy::admission_rank`], ties in
//!   submission order).
//! - Inside a lane one iteration runs at a time; lanes run in parallel without
//!   slowing each other down.
//! - A job's next iteration is ready as soon as its previous one finished (the
//!   client is instantaneous), so a job is waiting whenever it is not running.
//! - At every instant, iteration completions are handled first (lane order),
//!   then submissions (trace order), then admission, then every idle lane
//!   asks the policy for its next iteration (lane order).

use std::collections::HashMap;
use std::time::Duration;

use lanes_policies::{
    AdmissionRank, Event, JobId, JobTable, LaneId, LaneView, Policy, PolicyError,
};

use super::trace::TraceJob;

/// Lane layout of a simulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Device memory in bytes, split equally among the lanes.
    pub memory: u64,
    /// Number of lanes (at least 1).
    pub lanes: usize,
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Zero lanes.
    #[error("a simulation needs at least one lane")]
    NoLanes,
    /// A job needs more than one whole lane.
    #[error("job {job} needs {need} bytes (P + T) but a lane holds {capacity}")]
    JobNeverFits {
        /// The job.
        job: JobId,
        /// P + T.
        need: u64,
        /// Capacity of one lane.
        capacity: u64,
    },
    /// The policy answered something it may not (a lane where the job does not
    /// fit, or a job that is not waiting in that lane).
    #[error("policy {policy} broke its contract: {detail}")]
    PolicyContract {
        /// Policy name.
        policy: &'static str,
        /// What it did.
        detail: String,
    },
    /// Jobs are left that no lane will ever run.
    #[error("policy {policy} left {jobs} jobs unscheduled with every lane idle")]
    Stalled {
        /// Policy name.
        policy: &'static str,
        /// How many.
        jobs: usize,
    },
    /// The job table refused an event (a simulator bug).
    #[error(transparent)]
    Table(#[from] PolicyError),
}

/// What happened to one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobOutcome {
    /// The job.
    pub id: JobId,
    /// Training or inference.
    pub kind: lanes_policies::JobKind,
    /// Submission time.
    pub submit: Duration,
    /// Admission into a lane.
    pub admitted: Duration,
    /// The lane.
    pub lane: LaneId,
    /// When its last iteration finished.
    pub finish: Duration,
    /// Time it spent running (iterations × iteration duration).
    pub service: Duration,
}

impl JobOutcome {
    /// Job completion time: finish − submit.
    pub fn jct(&self) -> Duration {
        self.finish.saturating_sub(self.submit)
    }
    /// Time spent waiting (for admission or for its lane): JCT − service.
    pub fn queueing(&self) -> Duration {
        self.jct().saturating_sub(self.service)
    }
}

/// A run of consecutive iterations of one job in one lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Lane.
    pub lane: LaneId,
    /// Job.
    pub job: JobId,
    /// Start of the first iteration.
    pub start: Duration,
    /// End of the last iteration.
    pub end: Duration,
    /// Number of iterations.
    pub iterations: u64,
}

/// The full result of one simulation.
#[derive(Debug, Clone)]
pub struct SimRun {
    /// Policy name.
    pub policy: &'static str,
    /// Number of lanes.
    pub lanes: usize,
    /// Per job, in trace order.
    pub outcomes: Vec<JobOutcome>,
    /// Every iteration, merged into runs, in start order.
    pub schedule: Vec<Segment>,
    /// Busy time summed over lanes.
    pub busy: Duration,
}

struct LaneState {
    capacity: u64,
    members: Vec<usize>,
    running: Option<(usize, Duration)>,
}

/// Run `trace` under `policy`.
pub fn simulate(
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

/// Apply an event to the table, then show it to the policy.
fn apply(
    table: &mut JobTable,
    policy: &mut dyn Policy,
    ev: Event,
    now: Duration,
) -> Result<(), SimError> {
    table.apply(&ev, now)?;
    policy.observe(&ev, now);
    Ok(())
}

fn fmt_ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if (ms - ms.round()).abs() < 1e-9 {
        format!("{}", ms.round() as u64)
    } else {
        format!("{ms:.3}")
    }
}

impl SimRun {
    /// The schedule as golden-file lines, times in milliseconds:
    /// `t=0..30 lane=0 job=1 iters=3`.
    pub fn schedule_lines(&self) -> Vec<String> {
        self.schedule
            .iter()
            .map(|s| {
                format!(
                    "t={}..{} lane={} job={} iters={}",
                    fmt_ms(s.start),
                    fmt_ms(s.end),
                    s.lane,
                    s.job,
                    s.iterations
                )
            })
            .collect()
    }

    /// Job completion times as golden-file lines, in trace order: `jct job=1 ms=30`.
    pub fn jct_lines(&self) -> Vec<String> {
        self.outcomes
            .iter()
            .map(|o| format!("jct job={} ms={}", o.id, fmt_ms(o.jct())))
            .collect()
    }
}
