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
//!   slowing each other down, unless a contention model
//!   ([`SimOptions::contention`]) says how they do.
//! - A job's next iteration is ready as soon as its previous one finished (the
//!   client is instantaneous), so a job is waiting whenever it is not running.
//! - At every instant, iteration completions are handled first (lane order),
//!   then submissions (trace order), then admission, then every idle lane
//!   asks the policy for its next iteration (lane order).
//!
//! The engine is event-driven: it gives the result of asking the policy at
//! every iteration boundary, but a lane's run between two decision points
//! (a job of the lane finishes, or one joins it) is one event, computed
//! from what the policy promises about its picks ([`PickDynamics`]): a
//! sticky pick runs to the next decision point, fair sharing's order is a
//! merge of arithmetic sequences in closed form. Under a contention model
//! a run also ends where the kinds the lanes run change, and SRTF's where
//! its pick changes as its measured mean drifts (found in closed form).
//! `super::reference` keeps the step-per-iteration engine the tests
//! compare it with.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use lanes_policies::{
    AdmissionRank, Event, JobId, JobSpec, JobTable, LaneId, LaneView, PickDynamics, Policy,
    PolicyError,
};

use super::contention::Contention;
use super::placement::{LanePlacement, ServicePlacement};
use super::trace::TraceJob;
use super::waiting::Waiting;

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
    /// A job's iterations take no time (the simulator needs time to pass).
    #[error("job {job} has a zero iteration time")]
    ZeroIteration {
        /// The job.
        job: JobId,
    },
    /// The job table refused an event (a simulator bug).
    #[error(transparent)]
    Table(#[from] PolicyError),
    /// The service's lane manager refused a request (a simulator bug, or
    /// memory it cannot divide).
    #[error(transparent)]
    Lanes(#[from] crate::lanes::AdmitError),
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

/// What a simulation records besides each job's outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimOptions {
    /// Record every run of iterations in [`SimRun::schedule`]. Its size
    /// grows with the number of runs (under fair sharing, with the number
    /// of iterations), so leave it off for cluster-scale traces.
    pub schedule: bool,
    /// Lanes that run at once slow each other down by this model
    /// ([`Contention`]); `None`: they run at full speed side by side. With
    /// a model an iteration's speed is fixed when it starts, from the
    /// lanes busy then. The built-in policies stay event-driven: a run is
    /// re-rated at its next boundary when the kinds the lanes run change,
    /// SRTF's run also ends where the job picked stops ranking first, and
    /// fair's where its lane's kind changes. Other policies step one
    /// iteration at a time.
    pub contention: Option<Contention>,
    /// Give the policy each job's iteration time as a hint
    /// ([`JobSpec::with_hint`]). The service's sessions declare no
    /// iteration time, so its SRTF ranks by iterations until it has
    /// measured one; `false` simulates that.
    pub hints: bool,
    /// Start-up of each job before it can be admitted (its graph's
    /// transfer and load): the job enters admission this long after its
    /// submission; its JCT still counts from the submission.
    pub startup: Startup,
    /// The part of [`SimOptions::startup`] during which the job's graph
    /// load holds a worker, and with it a lane: the service runs a
    /// LoadGraph on one of its workers, before any queued Run, so the lane
    /// whose worker takes it runs none of its jobs' iterations meanwhile.
    /// The load asks for a worker `startup − load − after_load` after the
    /// job's submission; it starts on a lane that is idle, else at the
    /// first iteration boundary of a busy one (the earliest), at most
    /// `max(1, lanes − 1)` loads at once (the service keeps a worker for
    /// Runs), first come first served. The job enters admission
    /// `after_load` after its load ends. Zero: start-up is only the
    /// job's own delay (the entry into admission is shifted by it).
    pub load: Startup,
    /// The part of [`SimOptions::startup`] after the load (the load's
    /// reply and the first Run's trip); used only with a load.
    pub after_load: Startup,
    /// Equal lanes and the policy's placement, or the service's lane
    /// manager over the whole memory ([`LanePlacement`]).
    pub placement: LanePlacement,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            schedule: true,
            contention: None,
            hints: true,
            startup: Startup::default(),
            load: Startup::default(),
            after_load: Startup::default(),
            placement: LanePlacement::Policy,
        }
    }
}

/// A job's start-up time per kind (see [`SimOptions::startup`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Startup {
    /// Training jobs.
    pub training: Duration,
    /// Inference jobs.
    pub inference: Duration,
}

impl Startup {
    /// The start-up of a job of `kind`.
    pub fn of(&self, kind: lanes_policies::JobKind) -> Duration {
        match kind {
            lanes_policies::JobKind::Training => self.training,
            lanes_policies::JobKind::Inference => self.inference,
        }
    }

    /// No start-up at all.
    pub fn is_zero(&self) -> bool {
        self.training.is_zero() && self.inference.is_zero()
    }
}

/// `job`'s declaration as the simulated policy sees it.
fn spec_of(job: &TraceJob, hints: bool) -> JobSpec {
    let spec = job.spec();
    if hints {
        spec
    } else {
        JobSpec {
            iteration_hint: None,
            ..spec
        }
    }
}

/// Run `trace` under `policy`, recording the schedule.
pub fn simulate(
    trace: &[TraceJob],
    policy: &mut dyn Policy,
    cfg: SimConfig,
) -> Result<SimRun, SimError> {
    simulate_with(trace, policy, cfg, SimOptions::default())
}

/// Run `trace` under `policy`.
///
/// Event-driven: a lane's run between two decisions is one event. When the
/// policy promises how its picks evolve ([`Policy::dynamics`]), a job runs
/// all its iterations up to the next decision point in one step (the
/// lane's next completion, or the first iteration boundary after a job
/// joins the lane); otherwise the policy is asked at every iteration
/// boundary. Either way the result is the one of asking at every boundary.
pub fn simulate_with(
    trace: &[TraceJob],
    policy: &mut dyn Policy,
    cfg: SimConfig,
    opts: SimOptions,
) -> Result<SimRun, SimError> {
    if opts.startup.is_zero() && opts.load.is_zero() {
        return simulate_from(trace, policy, cfg, opts);
    }
    // A job becomes admissible once started up: simulate the trace with
    // shifted submissions, then count JCTs from the real ones. With a
    // load, the shifted submission is when the load asks for a worker.
    let loads = !opts.load.is_zero();
    let shifted: Vec<TraceJob> = trace
        .iter()
        .map(|j| {
            let k = j.kind;
            let delay = if loads {
                opts.startup
                    .of(k)
                    .saturating_sub(opts.load.of(k).saturating_add(opts.after_load.of(k)))
            } else {
                opts.startup.of(k)
            };
            TraceJob {
                submit: j.submit.saturating_add(delay),
                ..j.clone()
            }
        })
        .collect();
    let mut run = simulate_from(&shifted, policy, cfg, opts)?;
    let submit: HashMap<JobId, Duration> = trace.iter().map(|j| (j.id, j.submit)).collect();
    for o in &mut run.outcomes {
        if let Some(&s) = submit.get(&o.id) {
            o.submit = s;
        }
    }
    Ok(run)
}

fn simulate_from(
    trace: &[TraceJob],
    policy: &mut dyn Policy,
    cfg: SimConfig,
    opts: SimOptions,
) -> Result<SimRun, SimError> {
    if cfg.lanes == 0 {
        return Err(SimError::NoLanes);
    }
    let service = match opts.placement {
        LanePlacement::Policy => None,
        LanePlacement::Service => Some(ServicePlacement::new(cfg.memory, cfg.lanes)?),
    };
    // Under the service's placement a lane may take the whole memory.
    let capacity = match service {
        Some(_) => cfg.memory,
        None => cfg.memory / cfg.lanes as u64,
    };
    for j in trace {
        let need = j.persistent_bytes.saturating_add(j.ephemeral_bytes);
        if need > capacity {
            return Err(SimError::JobNeverFits {
                job: j.id,
                need,
                capacity,
            });
        }
        if j.iteration.is_zero() {
            return Err(SimError::ZeroIteration { job: j.id });
        }
    }
    let mut order: Vec<usize> = (0..trace.len()).collect();
    order.sort_by_key(|&i| (trace[i].submit, i));
    let mut engine = Engine::new(trace, policy, cfg.lanes, capacity, opts);
    engine.service = service;
    // Under the service's placement a waiting job is a candidate whenever
    // it fits the whole memory; the manager decides.
    let whole: Vec<LaneView> = vec![LaneView {
        id: 0,
        capacity: cfg.memory,
        persistent_sum: 0,
        max_ephemeral: 0,
        jobs: 0,
    }];
    // Every job's place in the admission order: the policy's rank, ties in
    // submission order (the rank depends on the declaration alone).
    let mut ranked: Vec<(AdmissionRank, usize)> = order
        .iter()
        .enumerate()
        .map(|(pos, &i)| {
            (
                engine
                    .policy
                    .admission_rank(&spec_of(&trace[i], opts.hints)),
                pos,
            )
        })
        .collect();
    ranked.sort_unstable();
    let by_slot: Vec<usize> = ranked.iter().map(|&(_, pos)| order[pos]).collect();
    let mut slot_of = vec![0usize; trace.len()];
    for (slot, &i) in by_slot.iter().enumerate() {
        slot_of[i] = slot;
    }
    drop(ranked);
    let ephemeral: Vec<u64> = by_slot.iter().map(|&i| trace[i].ephemeral_bytes).collect();
    let mut waiting = Waiting::new(&ephemeral);
    drop(ephemeral);
    let mut next = 0usize;
    // With loads (`SimOptions::load`) the shifted submissions are the
    // loads' requests for a worker; jobs enter admission from `ready`.
    let loads = !opts.load.is_zero();
    while engine.finished < trace.len() {
        let t_arrival = order.get(next).map(|&i| trace[i].submit);
        let t_lane = engine.lanes.iter().filter_map(|l| l.end).min();
        let mut t_next = match (t_arrival, t_lane) {
            (Some(a), Some(d)) => Some(a.min(d)),
            (a, d) => a.or(d),
        };
        if loads {
            if let Some(&Reverse((t, _))) = engine.ready.peek() {
                t_next = Some(t_next.map_or(t, |n| n.min(t)));
            }
        }
        let Some(now) = t_next else {
            return Err(SimError::Stalled {
                policy: engine.name,
                jobs: trace.len() - engine.finished,
            });
        };

        // 1. Lanes whose run ends now (lane order): iterations and jobs
        //    that finish.
        let mut freed = false;
        for l in 0..engine.lanes.len() {
            if engine.lanes[l].end == Some(now) {
                freed |= engine.complete(l, now)?;
            }
        }

        // 2. Submissions (with loads: the loads' requests, then the jobs
        //    whose load and its aftermath are over).
        let mut fresh = Vec::new();
        while let Some(&i) = order.get(next) {
            if trace[i].submit != now {
                break;
            }
            next += 1;
            if loads {
                engine.request_load(i, now);
                continue;
            }
            waiting.insert(
                slot_of[i],
                trace[i].persistent_bytes,
                trace[i].ephemeral_bytes,
            );
            fresh.push(slot_of[i]);
        }
        while let Some(&Reverse((t, i))) = engine.ready.peek().filter(|_| loads) {
            if t != now {
                break;
            }
            engine.ready.pop();
            waiting.insert(
                slot_of[i],
                trace[i].persistent_bytes,
                trace[i].ephemeral_bytes,
            );
            fresh.push(slot_of[i]);
        }

        // 3. Admission in the policy's order. Lanes only fill up between
        //    two completions, so a job that did not fit still does not:
        //    everyone is tried after memory was freed, otherwise only the
        //    new submissions.
        if freed || !fresh.is_empty() {
            fresh.sort_unstable();
            let mut fresh = fresh.into_iter();
            let mut views: Vec<LaneView> = engine.views();
            let mut from = 0usize;
            loop {
                let slot = if freed {
                    let candidates = if engine.service.is_some() {
                        &whole
                    } else {
                        &views
                    };
                    waiting.next(from, candidates)
                } else {
                    fresh.next()
                };
                let Some(slot) = slot else {
                    break;
                };
                from = slot + 1;
                let i = by_slot[slot];
                let spec = spec_of(&trace[i], opts.hints);
                if let Some(service) = engine.service.as_mut() {
                    let job = &trace[i];
                    let Some(l) =
                        service.admit(job.id, job.persistent_bytes, job.ephemeral_bytes)?
                    else {
                        continue;
                    };
                    waiting.remove(slot);
                    engine.admit(i, spec, l, now)?;
                    continue;
                }
                if !views.iter().any(|v| v.fits(&spec)) {
                    continue;
                }
                let Some(l) = engine.policy.place(&spec, &views, now) else {
                    continue;
                };
                let view = views.get(l).ok_or_else(|| {
                    engine.contract(format!(
                        "placed job {} in lane {l} of {}",
                        spec.id,
                        views.len()
                    ))
                })?;
                if !view.fits(&spec) {
                    return Err(engine.contract(format!(
                        "placed job {} in lane {l} where it does not fit",
                        spec.id
                    )));
                }
                waiting.remove(slot);
                engine.admit(i, spec, l, now)?;
                views[l] = engine.lanes[l].view(l);
            }
        }

        // 3½. Loads waiting for a worker take a free lane, before any of
        //     its jobs' iterations (the service runs control items first).
        if loads {
            engine.start_loads(now)?;
        }

        // 4. Decisions on lanes that need one (lane order).
        let mut decided = Vec::new();
        for l in 0..engine.lanes.len() {
            if engine.lanes[l].decide || (engine.every && engine.lanes[l].end.is_none()) {
                engine.decide(l, now)?;
                decided.push(l);
            }
        }
        // 5. With contention, what started now runs at the speed the lanes
        //    busy now allow; event-driven, the others are re-rated at their
        //    next boundary when the lanes busy changed.
        if engine.contention.is_some() {
            if !engine.every {
                engine.rerate(now, &mut decided)?;
            }
            engine.slow_down(&decided)?;
        }
    }
    Ok(engine.finish(cfg.lanes))
}

fn nanos(d: Duration) -> u128 {
    d.as_nanos()
}

fn dur(n: u128) -> Duration {
    let secs = u64::try_from(n / 1_000_000_000).unwrap_or(u64::MAX);
    // The remainder is below 10^9.
    let sub = u32::try_from(n % 1_000_000_000).unwrap_or(0);
    Duration::new(secs, sub)
}

/// One job of a fair lane's run: its iterations have the keys
/// `(attained + k × iteration, seq)` for `k` in `0..remaining`, and the
/// lane runs the keys in increasing order (least attained service, ties
/// to the earlier arrival).
#[derive(Debug, Clone, Copy)]
struct FairEntry {
    job: usize,
    kind: lanes_policies::JobKind,
    attained: u128,
    seq: u64,
    iteration: u128,
    remaining: u64,
}

/// A key of the fair order: attained service before the iteration, then
/// the job's arrival sequence number.
type FairKey = (u128, u64);

impl FairEntry {
    /// Its iterations whose key is at most `key`.
    fn count(&self, key: FairKey) -> u64 {
        let (k, s) = key;
        if self.attained > k {
            return 0;
        }
        let mut last = (k - self.attained) / self.iteration;
        if self.attained + last * self.iteration == k && self.seq > s {
            if last == 0 {
                return 0;
            }
            last -= 1;
        }
        u64::try_from((last + 1).min(u128::from(self.remaining))).unwrap_or(self.remaining)
    }
    /// The key of its last iteration.
    fn last_key(&self) -> FairKey {
        (
            self.attained + u128::from(self.remaining.saturating_sub(1)) * self.iteration,
            self.seq,
        )
    }
}

/// The last key of a fair run that starts now, and the kind of job that
/// runs first. The first job to finish ends the run (its last key is the
/// least); with `by_kind` (a contention model) so does the first iteration
/// of a job of another kind than the first one's: the lane's kind, and
/// with it the other lanes' speeds, changes there, so the run ends on the
/// key before it.
fn fair_until(entries: &[FairEntry], by_kind: bool) -> Option<(FairKey, lanes_policies::JobKind)> {
    let first = entries
        .iter()
        .filter(|e| e.remaining > 0)
        .min_by_key(|e| (e.attained, e.seq))?;
    let kind = first.kind;
    let mut until = entries
        .iter()
        .filter(|e| e.remaining > 0 && (!by_kind || e.kind == kind))
        .map(FairEntry::last_key)
        .min()?;
    if by_kind {
        let other = entries
            .iter()
            .filter(|e| e.remaining > 0 && e.kind != kind)
            .map(|e| (e.attained, e.seq))
            .min();
        if let Some((a, s)) = other {
            // The key just before it (it is after the first key, so not
            // (0, 0)).
            let before = match s.checked_sub(1) {
                Some(s) => (a, s),
                None => (a.saturating_sub(1), u64::MAX),
            };
            until = until.min(before);
        }
    }
    Some((until, kind))
}

/// Time the lane has run once every key up to `key` ran.
fn fair_elapsed(entries: &[FairEntry], key: FairKey) -> u128 {
    entries
        .iter()
        .map(|e| u128::from(e.count(key)) * e.iteration)
        .sum()
}

/// The first key after which the lane has run at least `delta` (the
/// iteration boundary at or after `origin + delta`), no later than
/// `until`, and the time run by then.
fn fair_cut(entries: &[FairEntry], delta: u128, until: FairKey) -> (FairKey, u128) {
    // The smallest attained value `k` whose keys reach `delta`.
    let (mut lo, mut hi) = (0u128, until.0);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fair_elapsed(entries, (mid, u64::MAX)) >= delta {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let k = lo;
    let mut ran = if k == 0 {
        0
    } else {
        fair_elapsed(entries, (k - 1, u64::MAX))
    };
    // Iterations whose key has exactly the value `k`, in seq order.
    let mut at_k: Vec<(u64, u128)> = entries
        .iter()
        .filter(|e| {
            e.attained <= k
                && (k - e.attained) % e.iteration == 0
                && (k - e.attained) / e.iteration < u128::from(e.remaining)
        })
        .map(|e| (e.seq, e.iteration))
        .collect();
    at_k.sort_unstable();
    for (seq, iteration) in at_k {
        if (k, seq) > until {
            break;
        }
        ran += iteration;
        if ran >= delta {
            return ((k, seq), ran);
        }
    }
    (until, fair_elapsed(entries, until))
}

/// An SRTF job that runs on at a constant iteration time: how its key
/// (`JobView::remaining_work_nanos`) evolves.
#[derive(Debug, Clone, Copy)]
struct SrtfRun {
    /// Measured service so far, in nanoseconds (`A`).
    attained: u128,
    /// Iterations done so far (`D`).
    done: u64,
    /// Iterations expected (0: unknown).
    expected: u64,
    /// Its iteration time from now on (`d`).
    step: u128,
}

impl SrtfRun {
    /// Its key after `k ≥ 1` more iterations, exactly as the policy
    /// computes it: remaining iterations × the mean measured iteration
    /// time (rounded down, saturating at `u64::MAX` nanoseconds).
    fn key(&self, k: u64) -> u128 {
        let done = self.done.saturating_add(k);
        let remaining = if self.expected == 0 {
            u64::MAX / 2
        } else {
            self.expected.saturating_sub(done).max(1)
        };
        let mean = (self.attained + u128::from(k) * self.step) / u128::from(done.max(1));
        u128::from(remaining) * mean.min(u128::from(u64::MAX))
    }

    /// The first `k` in `1..=last` whose key is at least `threshold`.
    fn first_loss(&self, threshold: u128, last: u64) -> Option<u64> {
        match self.window(threshold, last) {
            Some(Some((from, to))) => (from..=to).find(|&k| self.key(k) >= threshold),
            Some(None) => None,
            // Numbers too large for the bound: look at every boundary.
            None => (1..=last).find(|&k| self.key(k) >= threshold),
        }
    }

    /// `q(k) = (R − k)(A + k d) − T (D + k)`: the key after `k` iterations
    /// is at most `(R − k)(A + k d) / (D + k)`, so it reaches `T` only
    /// where `q(k) ≥ 0`. `None` when a number overflows.
    fn q(&self, threshold: i128, k: u64) -> Option<i128> {
        let r = i128::from(self.expected.checked_sub(self.done)?);
        let k = i128::from(k);
        let a = i128::try_from(self.attained).ok()?;
        let d = i128::try_from(self.step).ok()?;
        let work = a.checked_add(k.checked_mul(d)?)?;
        let lhs = (r - k).checked_mul(work)?;
        let rhs = threshold.checked_mul(i128::from(self.done).checked_add(k)?)?;
        lhs.checked_sub(rhs)
    }

    /// The `k` in `1..=last` where `q(k) ≥ 0`: an interval, as `q` is a
    /// parabola opening downwards (`Some(None)`: empty; `None`: a number
    /// overflows, or the total is unknown).
    fn window(&self, threshold: u128, last: u64) -> Option<Option<(u64, u64)>> {
        if self.expected == 0 || last == 0 {
            return if last == 0 { Some(None) } else { None };
        }
        let t = i128::try_from(threshold).ok()?;
        // The first k where q is non-negative or past its peak (a
        // predicate that stays true once true).
        let (mut lo, mut hi) = (1u64, last);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let here = self.q(t, mid)?;
            if here >= 0 || self.q(t, mid + 1)? < here {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let from = lo;
        if self.q(t, from)? < 0 {
            return Some(None);
        }
        // From there q ≥ 0 holds on a prefix.
        let (mut lo, mut hi) = (from, last);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.q(t, mid)? >= 0 {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Some(Some((from, lo)))
    }
}

/// What a lane is doing from `origin` until its `end`.
#[derive(Debug, Clone)]
enum Plan {
    /// Nothing.
    Idle,
    /// A job runs this many iterations back to back, each `step` long (its
    /// solo time, or slowed down by other lanes under contention).
    Run {
        job: usize,
        iterations: u64,
        step: Duration,
    },
    /// Fair sharing among these jobs, every key up to `until`; the
    /// iterations of the run are all of one kind (under a contention
    /// model; otherwise the first one's kind).
    Fair {
        entries: Vec<FairEntry>,
        until: FairKey,
        kind: lanes_policies::JobKind,
    },
    /// The graph load of this job holds the lane's worker: none of the
    /// lane's jobs runs an iteration.
    Load { job: usize },
}

struct Lane {
    capacity: u64,
    members: Vec<usize>,
    persistent_sum: u64,
    max_ephemeral: u64,
    plan: Plan,
    origin: Duration,
    /// When the plan ends (its last iteration finishes), if running.
    end: Option<Duration>,
    /// A decision is due at the current instant.
    decide: bool,
    /// The lane's last schedule segment (recording only).
    open: Option<usize>,
}

impl Lane {
    fn view(&self, id: LaneId) -> LaneView {
        LaneView {
            id,
            capacity: self.capacity,
            persistent_sum: self.persistent_sum,
            max_ephemeral: self.max_ephemeral,
            jobs: self.members.len(),
        }
    }
}

struct Engine<'a> {
    trace: &'a [TraceJob],
    policy: &'a mut dyn Policy,
    name: &'static str,
    mode: PickDynamics,
    /// Ask the policy at every iteration boundary, with every event.
    every: bool,
    table: JobTable,
    by_id: HashMap<JobId, usize>,
    lanes: Vec<Lane>,
    done: Vec<u64>,
    admitted_at: Vec<(Duration, LaneId)>,
    outcome: Vec<Option<JobOutcome>>,
    finished: usize,
    record: bool,
    schedule: Vec<Segment>,
    contention: Option<Contention>,
    /// The priority policy runs (its inference streams outrank training).
    priority: bool,
    /// Lane time spent running, in nanoseconds.
    busy: u128,
    /// The service's lane manager, when it places jobs.
    service: Option<ServicePlacement>,
    /// Under event-driven contention: the kinds the lanes ran when the
    /// running lanes were last rated.
    rated: Vec<Option<lanes_policies::JobKind>>,
    /// SRTF under a contention model: a run ends where the job picked
    /// stops ranking first ([`Engine::srtf_limit`]).
    srtf: bool,
    /// Loads' durations and what follows them, per kind
    /// ([`SimOptions::load`]).
    load: Startup,
    after_load: Startup,
    /// Loads waiting for a worker, first come first served (trace index).
    pending_loads: VecDeque<usize>,
    /// Loads running now, and how many may at once.
    loading: usize,
    max_loads: usize,
    /// Jobs whose load is over, by when they enter admission.
    ready: BinaryHeap<Reverse<(Duration, usize)>>,
}

/// Whether the engine computes `name`'s runs in closed form under a
/// contention model (a built-in policy with the dynamics it declares).
fn contended_in_closed_form(mode: PickDynamics, name: &str) -> bool {
    match mode {
        PickDynamics::Sticky => matches!(name, "fifo" | "pack" | "priority" | "srtf"),
        PickDynamics::LeastAttained => name == "fair",
        PickDynamics::EveryIteration => false,
    }
}

impl<'a> Engine<'a> {
    fn new(
        trace: &'a [TraceJob],
        policy: &'a mut dyn Policy,
        lanes: usize,
        capacity: u64,
        opts: SimOptions,
    ) -> Self {
        let mode = policy.dynamics();
        // Without hints SRTF ranks a job by what it measured, which changes
        // after its first iteration: not sticky, so ask at every boundary.
        // Under contention a job's measured iteration time changes with
        // the lanes beside it: the built-in policies' runs are then
        // computed in closed form from their keys (fifo, pack and
        // priority ignore measurements; SRTF's and fair's keys follow
        // them, see `srtf_limit` and `fair_until`); any other policy
        // is asked at every boundary.
        let every = mode == PickDynamics::EveryIteration
            || !opts.hints
            || (opts.contention.is_some() && !contended_in_closed_form(mode, policy.name()));
        Engine {
            trace,
            name: policy.name(),
            every,
            srtf: opts.contention.is_some() && !every && policy.name() == "srtf",
            rated: vec![None; lanes],
            contention: opts.contention,
            priority: policy.name() == "priority",
            busy: 0,
            service: None,
            mode,
            policy,
            table: JobTable::new(),
            by_id: trace.iter().enumerate().map(|(i, j)| (j.id, i)).collect(),
            lanes: (0..lanes)
                .map(|_| Lane {
                    capacity,
                    members: Vec::new(),
                    persistent_sum: 0,
                    max_ephemeral: 0,
                    plan: Plan::Idle,
                    origin: Duration::ZERO,
                    end: None,
                    decide: false,
                    open: None,
                })
                .collect(),
            done: vec![0; trace.len()],
            admitted_at: vec![(Duration::ZERO, 0); trace.len()],
            outcome: vec![None; trace.len()],
            finished: 0,
            record: opts.schedule,
            schedule: Vec::new(),
            load: opts.load,
            after_load: opts.after_load,
            pending_loads: VecDeque::new(),
            loading: 0,
            // The service runs at most `workers − 1` loads at once (at
            // least one), so a worker stays for Runs.
            max_loads: lanes.saturating_sub(1).max(1),
            ready: BinaryHeap::new(),
        }
    }

    /// Job `i`'s load asks for a worker at `now` (a kind without a load
    /// time goes straight to its aftermath).
    fn request_load(&mut self, i: usize, now: Duration) {
        let kind = self.trace[i].kind;
        if self.load.of(kind).is_zero() {
            self.ready
                .push(Reverse((now.saturating_add(self.after_load.of(kind)), i)));
        } else {
            self.pending_loads.push_back(i);
        }
    }

    /// Starts the waiting loads that may start at `now` on free lanes
    /// (one without jobs first: its worker is idle, then the lowest), after
    /// moving running loads off lanes with jobs onto free lanes without.
    /// Busy lanes stop at their next iteration boundary, where the first
    /// to get there takes the load.
    fn start_loads(&mut self, now: Duration) -> Result<(), SimError> {
        // A load holds a worker, not a lane: a lane holding one whose jobs
        // could run hands it to a free lane without jobs (its idle worker
        // would serve them).
        for h in 0..self.lanes.len() {
            if !matches!(self.lanes[h].plan, Plan::Load { .. }) || self.lanes[h].members.is_empty()
            {
                continue;
            }
            let Some(m) = self.lanes.iter().position(|l| {
                l.end.is_none() && matches!(l.plan, Plan::Idle) && l.members.is_empty()
            }) else {
                break;
            };
            let plan = std::mem::replace(&mut self.lanes[h].plan, Plan::Idle);
            let (origin, end) = (self.lanes[h].origin, self.lanes[h].end.take());
            self.lanes[h].decide = true;
            let lane = &mut self.lanes[m];
            lane.plan = plan;
            lane.origin = origin;
            lane.end = end;
            lane.decide = false;
            lane.open = None;
        }
        if self.loading >= self.max_loads || self.pending_loads.is_empty() {
            return Ok(());
        }
        // Every busy lane stops at its next iteration boundary (those at
        // one now are free at once), where the first to get there takes
        // the load; the others decide again, as at any boundary.
        for l in 0..self.lanes.len() {
            if matches!(self.lanes[l].plan, Plan::Run { .. } | Plan::Fair { .. }) {
                self.cut(l, now)?;
            }
        }
        while self.loading < self.max_loads {
            let Some(&i) = self.pending_loads.front() else {
                break;
            };
            let free = |l: &Lane| l.end.is_none() && matches!(l.plan, Plan::Idle);
            let Some(l) = self
                .lanes
                .iter()
                .position(|l| free(l) && l.members.is_empty())
                .or_else(|| self.lanes.iter().position(free))
            else {
                break;
            };
            self.pending_loads.pop_front();
            let took = self.load.of(self.trace[i].kind);
            let lane = &mut self.lanes[l];
            lane.plan = Plan::Load { job: i };
            lane.origin = now;
            lane.end = Some(now.saturating_add(took));
            lane.decide = false;
            lane.open = None;
            self.loading += 1;
        }
        Ok(())
    }

    fn contract(&self, detail: String) -> SimError {
        SimError::PolicyContract {
            policy: self.name,
            detail,
        }
    }

    fn views(&self) -> Vec<LaneView> {
        self.lanes
            .iter()
            .enumerate()
            .map(|(id, l)| l.view(id))
            .collect()
    }

    fn event(&mut self, ev: Event, now: Duration) -> Result<(), SimError> {
        apply(&mut self.table, self.policy, ev, now)
    }

    /// Admit job `i` into lane `l` at `now`; the lane's run is cut at its
    /// next iteration boundary so that the policy sees the newcomer there.
    fn admit(&mut self, i: usize, spec: JobSpec, l: LaneId, now: Duration) -> Result<(), SimError> {
        let trace = self.trace;
        let job = &trace[i];
        let lane = &mut self.lanes[l];
        lane.members.push(i);
        lane.persistent_sum = lane.persistent_sum.saturating_add(job.persistent_bytes);
        lane.max_ephemeral = lane.max_ephemeral.max(job.ephemeral_bytes);
        self.admitted_at[i] = (now, l);
        self.event(Event::Arrived { spec, lane: l }, now)?;
        self.event(Event::Queued { job: job.id }, now)?;
        self.cut(l, now)
    }

    /// End lane `l`'s run at its first iteration boundary at or after
    /// `now` (the run is in progress and ends after `now`).
    fn cut(&mut self, l: LaneId, now: Duration) -> Result<(), SimError> {
        let lane = &mut self.lanes[l];
        let Some(end) = lane.end else {
            lane.decide = true;
            return Ok(());
        };
        if lane.decide || end <= now || self.every {
            // Deciding now anyway, or every boundary is a decision already.
            return Ok(());
        }
        let delta = nanos(now - lane.origin);
        let boundary = match &mut lane.plan {
            Plan::Idle | Plan::Load { .. } => return Ok(()),
            Plan::Run {
                iterations, step, ..
            } => {
                let d = nanos(*step).max(1);
                let k = delta.div_ceil(d);
                *iterations = u64::try_from(k).unwrap_or(*iterations).min(*iterations);
                lane.origin + dur(u128::from(*iterations) * d)
            }
            Plan::Fair { entries, until, .. } => {
                let (key, ran) = fair_cut(entries, delta, *until);
                *until = key;
                lane.origin + dur(ran)
            }
        };
        lane.end = Some(boundary);
        if boundary == now {
            // The boundary is now: the iterations up to it are over and the
            // lane decides with the newcomer at this instant.
            self.complete(l, now)?;
        }
        Ok(())
    }

    /// Lane `l`'s run ended at `now`: account for its iterations, retire
    /// the jobs that are done. Returns whether one finished.
    fn complete(&mut self, l: LaneId, now: Duration) -> Result<bool, SimError> {
        let plan = std::mem::replace(&mut self.lanes[l].plan, Plan::Idle);
        let origin = self.lanes[l].origin;
        // A load is not an iteration: the lane is held, not busy.
        if !matches!(plan, Plan::Idle | Plan::Load { .. }) {
            self.busy += nanos(now.saturating_sub(origin));
        }
        self.lanes[l].end = None;
        self.lanes[l].decide = true;
        let trace = self.trace;
        let mut ran: Vec<usize> = Vec::new();
        match plan {
            Plan::Idle => {}
            Plan::Load { job } => {
                self.loading = self.loading.saturating_sub(1);
                let after = self.after_load.of(trace[job].kind);
                self.ready.push(Reverse((now.saturating_add(after), job)));
            }
            Plan::Run {
                job,
                iterations,
                step,
            } => {
                let t = &trace[job];
                let id = t.id;
                if self.every {
                    // One iteration, as long as it took (slowed down by
                    // other lanes under a contention model).
                    self.event(
                        Event::IterationFinished {
                            job: id,
                            duration: now.saturating_sub(origin),
                        },
                        now,
                    )?;
                } else {
                    let total = dur(nanos(step) * u128::from(iterations));
                    self.table.record_iterations(id, iterations, total)?;
                }
                self.done[job] += iterations;
                self.emit(l, job, origin, now, iterations);
                ran.push(job);
            }
            Plan::Fair { entries, until, .. } => {
                if self.record {
                    self.emit_fair(l, origin, &entries, until);
                }
                for e in &entries {
                    let c = e.count(until);
                    if c == 0 {
                        continue;
                    }
                    let total = dur(e.iteration * u128::from(c));
                    self.table.record_iterations(trace[e.job].id, c, total)?;
                    self.done[e.job] += c;
                    ran.push(e.job);
                }
            }
        }
        let mut freed = false;
        for i in ran {
            let job = &trace[i];
            if self.done[i] < job.iterations {
                if self.every {
                    self.event(Event::Queued { job: job.id }, now)?;
                }
                continue;
            }
            self.event(Event::Finished { job: job.id }, now)?;
            if let Some(service) = self.service.as_mut() {
                service.release(job.id)?;
            }
            let lane = &mut self.lanes[l];
            lane.members.retain(|&m| m != i);
            lane.persistent_sum = lane.persistent_sum.saturating_sub(job.persistent_bytes);
            lane.max_ephemeral = lane
                .members
                .iter()
                .map(|&m| trace[m].ephemeral_bytes)
                .max()
                .unwrap_or(0);
            let (admitted, lane_id) = self.admitted_at[i];
            self.outcome[i] = Some(JobOutcome {
                id: job.id,
                kind: job.kind,
                submit: job.submit,
                admitted,
                lane: lane_id,
                finish: now,
                service: job.service(),
            });
            self.finished += 1;
            freed = true;
        }
        Ok(freed)
    }

    /// Decide what lane `l` runs from `now`.
    fn decide(&mut self, l: LaneId, now: Duration) -> Result<(), SimError> {
        self.lanes[l].decide = false;
        self.lanes[l].origin = now;
        if self.lanes[l].members.is_empty() {
            self.lanes[l].open = None;
            return Ok(());
        }
        if self.mode == PickDynamics::LeastAttained && !self.every {
            let mut entries = Vec::with_capacity(self.lanes[l].members.len());
            for &i in &self.lanes[l].members {
                let job = &self.trace[i];
                let (seq, v_attained) = self
                    .table
                    .get(job.id)
                    .map(|v| (v.seq, v.attained))
                    .ok_or(PolicyError::UnknownJob { job: job.id })?;
                entries.push(FairEntry {
                    job: i,
                    kind: job.kind,
                    // The durations measured so far (slowed down by other
                    // lanes under contention).
                    attained: nanos(v_attained),
                    seq,
                    iteration: nanos(job.iteration),
                    remaining: job.iterations - self.done[i],
                });
            }
            // The run lasts until the first job finishes: the one whose last
            // key comes first (or, under contention beside other lanes,
            // until the lane's kind changes).
            let by_kind = self.contention.is_some() && self.lanes.len() > 1;
            let Some((until, kind)) = fair_until(&entries, by_kind) else {
                self.lanes[l].open = None;
                return Ok(());
            };
            let end = now + dur(fair_elapsed(&entries, until));
            let lane = &mut self.lanes[l];
            lane.plan = Plan::Fair {
                entries,
                until,
                kind,
            };
            lane.end = Some(end);
            return Ok(());
        }
        let Some(id) = self.policy.pick(l, self.table.jobs(), now) else {
            self.lanes[l].open = None;
            return Ok(());
        };
        let ok = self.table.get(id).is_some_and(|v| v.lane == l && v.waiting);
        let i = match self.by_id.get(&id) {
            Some(&i) if ok => i,
            _ => {
                return Err(self.contract(format!(
                    "picked job {id} for lane {l}, which is not waiting there"
                )))
            }
        };
        let iterations = if self.every {
            self.event(Event::Started { job: id }, now)?;
            1
        } else {
            self.trace[i].iterations - self.done[i]
        };
        let step = self.trace[i].iteration;
        let end = now + dur(nanos(step) * u128::from(iterations));
        let lane = &mut self.lanes[l];
        lane.plan = Plan::Run {
            job: i,
            iterations,
            step,
        };
        lane.end = Some(end);
        Ok(())
    }

    /// The kind of job each lane runs now (`None`: idle).
    fn kinds(&self) -> Vec<Option<lanes_policies::JobKind>> {
        self.lanes
            .iter()
            .map(|lane| match lane.plan {
                Plan::Run { job, .. } => Some(self.trace[job].kind),
                Plan::Fair { kind, .. } => Some(kind),
                Plan::Idle | Plan::Load { .. } => None,
            })
            .collect()
    }

    /// The runs that started now in `lanes` take their solo iteration time
    /// divided by the speed the other busy lanes leave them, per iteration.
    fn slow_down(&mut self, lanes: &[LaneId]) -> Result<(), SimError> {
        let Some(model) = self.contention else {
            return Ok(());
        };
        let kinds = self.kinds();
        for &l in lanes {
            let Some(me) = kinds[l] else {
                continue;
            };
            let others = kinds
                .iter()
                .enumerate()
                .filter(|&(o, _)| o != l)
                .filter_map(|(_, k)| *k);
            let speed = model.speed(me, others, self.priority);
            if speed >= 1.0 {
                continue;
            }
            let slowed = |solo: Duration| {
                Duration::from_secs_f64(solo.as_secs_f64() / speed).max(Duration::from_nanos(1))
            };
            let trace = self.trace;
            let lane = &mut self.lanes[l];
            match &mut lane.plan {
                Plan::Idle | Plan::Load { .. } => {}
                Plan::Run {
                    iterations, step, ..
                } => {
                    *step = slowed(*step);
                    lane.end = Some(lane.origin + dur(nanos(*step) * u128::from(*iterations)));
                }
                Plan::Fair {
                    entries,
                    until,
                    kind,
                } => {
                    // Every iteration of the run is of the lane's kind, so
                    // at this speed; the keys, and with them the run's
                    // end, move.
                    for e in entries.iter_mut() {
                        e.iteration = nanos(slowed(trace[e.job].iteration));
                    }
                    if let Some((u, k)) = fair_until(entries, true) {
                        *until = u;
                        *kind = k;
                    }
                    lane.end = Some(lane.origin + dur(fair_elapsed(entries, *until)));
                }
            }
        }
        if self.srtf {
            for &l in lanes {
                self.srtf_limit(l)?;
            }
        }
        Ok(())
    }

    /// SRTF under a contention model: the job picked in lane `l` runs at
    /// a slowed iteration time `d` that differs from the mean `A / D` of
    /// the durations measured so far, so its key after `k` more
    /// iterations, `(R − k) × ⌊(A + k d) / (D + k)⌋`, need not shrink:
    /// the run ends at the first boundary where it ranks after another
    /// waiting job of the lane (whose keys do not change meanwhile), where
    /// the policy picks again, as it would when asked at every boundary.
    fn srtf_limit(&mut self, l: LaneId) -> Result<(), SimError> {
        let Plan::Run {
            job,
            iterations,
            step,
        } = self.lanes[l].plan
        else {
            return Ok(());
        };
        if iterations <= 1 {
            return Ok(());
        }
        let trace = self.trace;
        let me = self
            .table
            .get(trace[job].id)
            .ok_or(PolicyError::UnknownJob { job: trace[job].id })?;
        let mut rival: Option<(u128, u64)> = None;
        for &m in &self.lanes[l].members {
            if m == job {
                continue;
            }
            let v = self
                .table
                .get(trace[m].id)
                .ok_or(PolicyError::UnknownJob { job: trace[m].id })?;
            if v.waiting {
                let key = (v.remaining_work_nanos(), v.seq);
                if rival.is_none_or(|r| key < r) {
                    rival = Some(key);
                }
            }
        }
        let Some((work, seq)) = rival else {
            return Ok(());
        };
        // It loses once its key reaches `threshold` (ties go to the
        // earlier arrival).
        let threshold = if me.seq > seq { work } else { work + 1 };
        let run = SrtfRun {
            attained: nanos(me.attained),
            done: me.done_iterations,
            expected: me.expected_iterations,
            step: nanos(step),
        };
        if let Some(k) = run.first_loss(threshold, iterations - 1) {
            let lane = &mut self.lanes[l];
            lane.plan = Plan::Run {
                job,
                iterations: k,
                step,
            };
            lane.end = Some(lane.origin + dur(nanos(step) * u128::from(k)));
        }
        Ok(())
    }

    /// Event-driven contention: when the kinds the lanes run changed at
    /// `now`, every other running lane is cut at its next iteration
    /// boundary, where it decides again (the same job: its pick is sticky)
    /// and is re-rated from the lanes busy then, as the per-iteration path
    /// would rate that iteration. Lanes whose boundary is `now` decide now
    /// and join `decided`.
    fn rerate(&mut self, now: Duration, decided: &mut Vec<LaneId>) -> Result<(), SimError> {
        let kinds = self.kinds();
        if kinds == self.rated {
            return Ok(());
        }
        for l in 0..self.lanes.len() {
            if decided.contains(&l) || matches!(self.lanes[l].plan, Plan::Idle | Plan::Load { .. })
            {
                continue;
            }
            self.cut(l, now)?;
            if self.lanes[l].decide && self.lanes[l].end.is_none() {
                self.decide(l, now)?;
                decided.push(l);
            }
        }
        self.rated = self.kinds();
        Ok(())
    }

    /// Record `iterations` of job `i` in lane `l` from `start` to `end`.
    fn emit(&mut self, l: LaneId, i: usize, start: Duration, end: Duration, iterations: u64) {
        if !self.record || iterations == 0 {
            return;
        }
        let id = self.trace[i].id;
        match self.lanes[l].open.and_then(|s| self.schedule.get_mut(s)) {
            Some(seg) if seg.job == id && seg.end == start => {
                seg.end = end;
                seg.iterations += iterations;
            }
            _ => {
                self.lanes[l].open = Some(self.schedule.len());
                self.schedule.push(Segment {
                    lane: l,
                    job: id,
                    start,
                    end,
                    iterations,
                });
            }
        }
    }

    /// Record a fair run iteration by iteration (in key order).
    fn emit_fair(&mut self, l: LaneId, origin: Duration, entries: &[FairEntry], until: FairKey) {
        let mut heap: BinaryHeap<Reverse<(FairKey, usize, u64)>> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.remaining > 0)
            .map(|(n, e)| Reverse(((e.attained, e.seq), n, 0)))
            .collect();
        let mut t = nanos(origin);
        while let Some(Reverse((key, n, k))) = heap.pop() {
            if key > until {
                break;
            }
            let e = entries[n];
            self.emit(l, e.job, dur(t), dur(t + e.iteration), 1);
            t += e.iteration;
            if k + 1 < e.remaining {
                heap.push(Reverse(((key.0 + e.iteration, e.seq), n, k + 1)));
            }
        }
    }

    fn finish(mut self, lanes: usize) -> SimRun {
        if self.record {
            self.schedule.sort_by_key(|s| (s.start, s.lane));
        }
        let busy = self.busy;
        SimRun {
            policy: self.name,
            lanes,
            outcomes: self.outcome.into_iter().flatten().collect(),
            schedule: self.schedule,
            busy: dur(busy),
        }
    }
}

/// Apply an event to the table, then show it to the policy.
pub(super) fn apply(
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// The bound of SRTF's key finds the same first loss as looking at
    /// every boundary, over many random runs (a job slowed down or sped
    /// up against its mean so far, thresholds near its keys).
    #[test]
    fn srtf_first_loss_matches_a_scan() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut losses = 0;
        for _ in 0..20_000 {
            let done = rnd(6);
            let expected = done + 2 + rnd(300);
            let step = 1 + u128::from(rnd(40_000));
            let attained = if done == 0 {
                0
            } else {
                u128::from(done) * (1 + u128::from(rnd(40_000)))
            };
            let run = SrtfRun {
                attained,
                done,
                expected,
                step,
            };
            let last = expected - done - 1;
            let probe = 1 + rnd(last.max(1));
            let threshold = match rnd(3) {
                0 => run.key(probe),
                1 => run.key(probe) + 1,
                _ => u128::from(rnd(40_000)) * u128::from(expected),
            };
            let scan = (1..=last).find(|&k| run.key(k) >= threshold);
            assert_eq!(run.first_loss(threshold, last), scan, "{run:?} {threshold}");
            losses += usize::from(scan.is_some());
        }
        // Both outcomes are exercised.
        assert!(losses > 1_000 && losses < 19_000, "{losses}");
    }
}
