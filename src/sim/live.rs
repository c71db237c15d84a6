//! A live replay inside this process: real threads, the real clock and the
//! service's [`Scheduler`] driving the same policy as the simulator, so the
//! simulator's prediction can be checked against wall-clock behaviour.
//!
//! Threads (actors with channels, as in the service):
//! - one *scheduler* thread owns the [`Scheduler`], the lanes' memory state
//!   and the admission queue; it is the only one that decides;
//! - one *lane worker* per lane runs one iteration at a time;
//! - one *client* per job sleeps until its (scaled) submission time, asks
//!   for admission, then sends its Run requests, keeping two outstanding so
//!   that its next iteration is already queued when one finishes (the
//!   simulator assumes exactly that).
//!
//! An iteration's work is pluggable ([`IterationWork`]): the default sleeps
//! for the scaled iteration duration, standing in for a device the host waits
//! on; `lanes replay` can put real graph executions there.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use lanes_policies::{AdmissionRank, JobId, LaneId, LaneView, Policy};

use super::engine::{JobOutcome, SimRun};
use super::trace::TraceJob;
use crate::sched::Scheduler;

/// What one iteration does on its lane worker.
pub trait IterationWork: Send + Sync {
    /// Run one iteration of `job`, which the trace says takes `scaled`.
    fn run(&self, job: &TraceJob, scaled: Duration);
}

/// Sleep for the scaled iteration duration.
#[derive(Debug, Clone, Copy, Default)]
pub struct SleepWork;

impl IterationWork for SleepWork {
    fn run(&self, _job: &TraceJob, scaled: Duration) {
        thread::sleep(scaled);
    }
}

/// Settings of a live replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LiveConfig {
    /// Device memory split equally among the lanes.
    pub memory: u64,
    /// Number of lanes.
    pub lanes: usize,
    /// Wall-clock seconds per trace second (0.1 runs a trace ten times faster).
    pub time_scale: f64,
}

/// Why a live replay failed.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// Bad settings.
    #[error("live replay: {0}")]
    Config(String),
    /// A job needs more than a lane.
    #[error("job {job} needs {need} bytes (P + T) but a lane holds {capacity}")]
    JobNeverFits {
        /// The job.
        job: JobId,
        /// P + T.
        need: u64,
        /// Lane capacity.
        capacity: u64,
    },
    /// A thread stopped early (its channel closed).
    #[error("live replay: {0} stopped early")]
    Stopped(&'static str),
}

enum Msg {
    Arrive {
        index: usize,
        admitted: Sender<LaneId>,
    },
    Run {
        job: JobId,
        done: Sender<()>,
    },
    Leave {
        job: JobId,
    },
    Finished {
        lane: LaneId,
        job: JobId,
        took: Duration,
    },
}

struct LaneTask {
    index: usize,
    scaled: Duration,
    done: Sender<()>,
}

/// Replay `trace` live under `policy`; times in the result are trace time
/// (wall time divided by the scale).
pub fn replay_live(
    trace: &[TraceJob],
    policy: Box<dyn Policy>,
    cfg: LiveConfig,
    work: Arc<dyn IterationWork>,
) -> Result<SimRun, LiveError> {
    if cfg.lanes == 0 {
        return Err(LiveError::Config("at least one lane is needed".into()));
    }
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return Err(LiveError::Config("time scale must be positive".into()));
    }
    let capacity = cfg.memory / cfg.lanes as u64;
    for j in trace {
        let need = j.persistent_bytes.saturating_add(j.ephemeral_bytes);
        if need > capacity {
            return Err(LiveError::JobNeverFits {
                job: j.id,
                need,
                capacity,
            });
        }
    }
    let scale = |d: Duration| Duration::from_secs_f64(d.as_secs_f64() * cfg.time_scale);
    let unscale = |d: Duration| Duration::from_secs_f64(d.as_secs_f64() / cfg.time_scale);
    let trace: Arc<Vec<TraceJob>> = Arc::new(trace.to_vec());
    let name = policy.name();
    let start = Instant::now();

    // Capacity: every job has at most two Runs, one Arrive and one Leave in
    // flight, and each lane one Finished; the scheduler never blocks on it.
    let (to_sched, inbox) = bounded::<Msg>(4 * trace.len() + cfg.lanes + 16);
    let mut lane_tx = Vec::new();
    let mut workers = Vec::new();
    for lane in 0..cfg.lanes {
        // One task at a time per lane: the scheduler only dispatches to idle lanes.
        let (tx, rx) = bounded::<LaneTask>(1);
        lane_tx.push(tx);
        let (trace, work, back) = (Arc::clone(&trace), Arc::clone(&work), to_sched.clone());
        workers.push(thread::spawn(move || {
            for task in rx {
                let t0 = Instant::now();
                work.run(&trace[task.index], task.scaled);
                let took = t0.elapsed();
                let job = trace[task.index].id;
                if back.send(Msg::Finished { lane, job, took }).is_err() {
                    break;
                }
                let _ = task.done.send(());
            }
        }));
    }

    let sched_trace = Arc::clone(&trace);
    let scheduler = thread::spawn(move || {
        scheduler_loop(
            &sched_trace,
            policy,
            capacity,
            inbox,
            lane_tx,
            start,
            cfg.time_scale,
        )
    });

    let mut clients = Vec::new();
    for index in 0..trace.len() {
        let (trace, tx) = (Arc::clone(&trace), to_sched.clone());
        let submit = scale(trace[index].submit);
        clients.push(thread::spawn(
            move || -> Result<(Duration, LaneId, Duration), LiveError> {
                let job = &trace[index];
                if let Some(wait) = submit.checked_sub(start.elapsed()) {
                    thread::sleep(wait);
                }
                let (atx, arx) = bounded(1);
                tx.send(Msg::Arrive {
                    index,
                    admitted: atx,
                })
                .map_err(|_| LiveError::Stopped("scheduler"))?;
                let lane = arx.recv().map_err(|_| LiveError::Stopped("scheduler"))?;
                let admitted = start.elapsed();
                let mut outstanding = std::collections::VecDeque::new();
                let mut sent = 0u64;
                let mut finished = 0u64;
                while finished < job.iterations {
                    while sent < job.iterations && outstanding.len() < 2 {
                        let (dtx, drx) = bounded(1);
                        tx.send(Msg::Run {
                            job: job.id,
                            done: dtx,
                        })
                        .map_err(|_| LiveError::Stopped("scheduler"))?;
                        outstanding.push_back(drx);
                        sent += 1;
                    }
                    if let Some(rx) = outstanding.pop_front() {
                        rx.recv().map_err(|_| LiveError::Stopped("lane worker"))?;
                        finished += 1;
                    }
                }
                let end = start.elapsed();
                tx.send(Msg::Leave { job: job.id })
                    .map_err(|_| LiveError::Stopped("scheduler"))?;
                Ok((admitted, lane, end))
            },
        ));
    }
    drop(to_sched);

    let mut outcomes = Vec::new();
    let mut first_err = None;
    for (index, c) in clients.into_iter().enumerate() {
        match c.join() {
            Ok(Ok((admitted, lane, end))) => {
                let j = &trace[index];
                outcomes.push(JobOutcome {
                    id: j.id,
                    kind: j.kind,
                    submit: j.submit,
                    admitted: unscale(admitted),
                    lane,
                    finish: unscale(end).max(j.submit),
                    service: j.service(),
                });
            }
            Ok(Err(e)) => first_err = first_err.or(Some(e)),
            Err(_) => first_err = first_err.or(Some(LiveError::Stopped("client"))),
        }
    }
    let busy = scheduler
        .join()
        .map_err(|_| LiveError::Stopped("scheduler"))?;
    for w in workers {
        let _ = w.join();
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(SimRun {
        policy: name,
        lanes: cfg.lanes,
        outcomes,
        schedule: Vec::new(),
        busy: unscale(busy),
    })
}

/// The scheduler thread: admission, queues, dispatch. Returns the busy time
/// summed over lanes.
fn scheduler_loop(
    trace: &[TraceJob],
    policy: Box<dyn Policy>,
    capacity: u64,
    inbox: Receiver<Msg>,
    lanes: Vec<Sender<LaneTask>>,
    start: Instant,
    time_scale: f64,
) -> Duration {
    let index: std::collections::HashMap<JobId, usize> =
        trace.iter().enumerate().map(|(i, j)| (j.id, i)).collect();
    let mut sched: Scheduler<Sender<()>> = Scheduler::new(policy);
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); lanes.len()];
    let mut idle = vec![true; lanes.len()];
    // Jobs waiting for memory, in the policy's admission order (ties in
    // arrival order): (rank, arrival, trace index, reply).
    let mut waiting: Vec<(AdmissionRank, u64, usize, Sender<LaneId>)> = Vec::new();
    let mut arrivals = 0u64;
    let mut busy = Duration::ZERO;
    let scaled = |d: Duration| Duration::from_secs_f64(d.as_secs_f64() * time_scale);
    let mut left = 0usize;

    // Lane workers hold senders to `inbox` until their lane channel closes,
    // so the loop ends when every job has left, not when `inbox` closes.
    while left < trace.len() {
        let Ok(msg) = inbox.recv() else { break };
        let now = start.elapsed();
        match msg {
            Msg::Arrive { index, admitted } => {
                let key = (sched.admission_rank(&trace[index].spec()), arrivals);
                arrivals += 1;
                let at = waiting.partition_point(|w| (w.0, w.1) < key);
                waiting.insert(at, (key.0, key.1, index, admitted));
            }
            Msg::Run { job, done } => {
                if sched.submit(job, done, now).is_err() {
                    tracing::warn!(job, "run for a job that is not scheduled");
                }
            }
            Msg::Leave { job } => {
                left += 1;
                let _ = sched.remove_job(job, now);
                if let Some(&i) = index.get(&job) {
                    for m in &mut members {
                        m.retain(|&x| x != i);
                    }
                }
            }
            Msg::Finished { lane, job, took } => {
                idle[lane] = true;
                busy += took;
                let _ = sched.finish(job, took, now);
            }
        }
        // Admission, in the policy's admission order.
        let mut still = Vec::new();
        for (rank, seq, i, admitted) in waiting.drain(..) {
            let spec = trace[i].spec();
            let views: Vec<LaneView> = members
                .iter()
                .enumerate()
                .map(|(id, m)| LaneView {
                    id,
                    capacity,
                    persistent_sum: m.iter().map(|&x| trace[x].persistent_bytes).sum(),
                    max_ephemeral: m
                        .iter()
                        .map(|&x| trace[x].ephemeral_bytes)
                        .max()
                        .unwrap_or(0),
                    jobs: m.len(),
                })
                .collect();
            match sched.place(&spec, &views, now) {
                Some(lane) if sched.add_job(spec, lane, now).is_ok() => {
                    members[lane].push(i);
                    let _ = admitted.send(lane);
                }
                _ => still.push((rank, seq, i, admitted)),
            }
        }
        waiting = still;
        // Dispatch to idle lanes.
        for (lane, tx) in lanes.iter().enumerate() {
            if !idle[lane] {
                continue;
            }
            if let Some(d) = sched.pick(lane, now) {
                let Some(&i) = index.get(&d.job) else {
                    continue;
                };
                idle[lane] = false;
                let task = LaneTask {
                    index: i,
                    scaled: scaled(trace[i].iteration),
                    done: d.request,
                };
                if tx.send(task).is_err() {
                    return busy;
                }
            }
        }
    }
    busy
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::sim::{simulate, SimConfig, Summary};
    use lanes_policies::{by_name, JobKind};

    fn job(id: u64, submit_ms: u64, iterations: u64, iter_ms: u64) -> TraceJob {
        TraceJob {
            id,
            submit: Duration::from_millis(submit_ms),
            kind: JobKind::Training,
            iterations,
            iteration: Duration::from_millis(iter_ms),
            persistent_bytes: 0,
            ephemeral_bytes: 0,
            priority: 0,
        }
    }

    #[test]
    fn live_replay_runs_every_job_and_tracks_the_simulator() {
        // Trace time 1.6 s of work, run at scale 1 (about 1.6 s of wall time:
        // at scale 0.25 the delays of a loaded 2-core machine, which do not
        // shrink with the scale, made live twice the simulation).
        let trace = vec![
            job(1, 0, 8, 100),
            job(2, 50, 4, 50),
            job(3, 100, 2, 200),
            job(4, 120, 6, 20),
        ];
        let cfg = LiveConfig {
            memory: 1 << 30,
            lanes: 1,
            time_scale: 1.0,
        };
        let live = replay_live(&trace, by_name("srtf").unwrap(), cfg, Arc::new(SleepWork)).unwrap();
        assert_eq!(live.outcomes.len(), 4);
        let sim = simulate(
            &trace,
            by_name("srtf").unwrap().as_mut(),
            SimConfig {
                memory: 1 << 30,
                lanes: 1,
            },
        )
        .unwrap();
        let (l, s) = (Summary::of(&live), Summary::of(&sim));
        // Loose bound: the machine running tests is shared and sleeps overshoot.
        assert!(
            l.avg_jct_s >= s.avg_jct_s * 0.9,
            "live {} vs sim {}",
            l.avg_jct_s,
            s.avg_jct_s
        );
        assert!(
            l.avg_jct_s <= s.avg_jct_s * 1.6 + 0.05,
            "live {} vs sim {}",
            l.avg_jct_s,
            s.avg_jct_s
        );
    }

    #[test]
    fn refuses_jobs_that_fit_no_lane() {
        let mut big = job(1, 0, 1, 1);
        big.persistent_bytes = 100;
        let cfg = LiveConfig {
            memory: 50,
            lanes: 1,
            time_scale: 1.0,
        };
        let err =
            replay_live(&[big], by_name("fifo").unwrap(), cfg, Arc::new(SleepWork)).unwrap_err();
        assert!(matches!(
            err,
            LiveError::JobNeverFits {
                job: 1,
                need: 100,
                capacity: 50
            }
        ));
    }
}
