//! A [`ReadyQueue`] that orders Run requests through a scheduling policy.
//!
//! Each session's items are kept in submission order. The item at the head
//! of a session decides how the session is served:
//!
//! - **Run** items are handed to a [`Scheduler`] (one job per session, all in
//!   policy lane 0, the device): consecutive Runs of a session all wait in
//!   its job queue, and whenever a worker asks for work the policy picks
//!   which waiting job's next Run goes. A job is *waiting* while it has a
//!   Run queued and none running, so a client that keeps its next Run queued
//!   (pipelining) keeps its job waiting across iterations, as the simulator
//!   assumes.
//! - **LoadGraph, ReadVariables and WriteVariables** (control items) are
//!   released only once every earlier Run of their session has finished, and
//!   then run first-come, *before* any Run: they happen once per job or
//!   rarely, and a job cannot iterate before its Load.
//!
//! Workers report each finished item's measured duration
//! ([`ReadyQueue::finished`]); for Runs it goes to the policy (SRTF and fair
//! depend on it) and into the job's [`JobStats`] (queueing delay from
//! submission to dispatch, service time). A job leaves the policy when its
//! session is removed (closed or reclaimed).
//!
//! Sessions the dispatcher holds back (busy, or waiting for memory in lane
//! admission) are never picked: held jobs are hidden from the policy for
//! that decision ([`Scheduler::pick_where`]).
//!
//! With several workers, up to that many Runs of different jobs run at once,
//! each picked by the policy when a worker frees up; with `workers: 1` the
//! service behaves like one lane of the simulator.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanes_adaptor::wire::{JobKind as WireKind, SessionId, SessionSpec};
use lanes_policies::{JobKind, JobSpec, Policy};

use super::dispatch::{ReadyQueue, Work, WorkItem};
use crate::exec::gate::Gate;
use crate::exec::GpuShare;
use crate::sched::{JobStats, Scheduler};

/// The policies `lanes serve --policy` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PolicyChoice {
    /// The job that arrived first runs while it has Runs queued.
    #[default]
    Fifo,
    /// Shortest remaining time (remaining iterations × measured iteration time).
    Srtf,
    /// Least attained service first.
    Fair,
    /// Best-fit placement; FIFO order inside a lane.
    Pack,
    /// Inference before training, then higher priority, then arrival.
    Priority,
}

impl PolicyChoice {
    /// Every choice, in `lanes_policies::POLICY_NAMES` order.
    pub const ALL: [PolicyChoice; 5] = [
        PolicyChoice::Fifo,
        PolicyChoice::Srtf,
        PolicyChoice::Fair,
        PolicyChoice::Pack,
        PolicyChoice::Priority,
    ];

    /// The policy's name (as `lanes_policies::by_name` spells it).
    pub fn name(self) -> &'static str {
        match self {
            PolicyChoice::Fifo => "fifo",
            PolicyChoice::Srtf => "srtf",
            PolicyChoice::Fair => "fair",
            PolicyChoice::Pack => "pack",
            PolicyChoice::Priority => "priority",
        }
    }

    /// How urgent a job's GPU work is under this policy, in levels above
    /// the least (the job's streams get that priority; see
    /// `CudaOptions::urgency`). Only `priority` ranks jobs across lanes
    /// this way: inference above every training job, and a training job
    /// of positive priority that many levels above the least (at most
    /// [`MAX_URGENCY`] − 1); under the other policies every lane has the
    /// same priority and the GPU shares its time between them.
    pub fn urgency(self, kind: WireKind, priority: i32) -> u8 {
        match (self, kind) {
            (PolicyChoice::Priority, WireKind::Inference) => MAX_URGENCY,
            (PolicyChoice::Priority, WireKind::Training) => {
                priority.clamp(0, i32::from(MAX_URGENCY) - 1) as u8
            }
            _ => 0,
        }
    }

    /// How a job's GPU work shares the device under this policy: its
    /// [`urgency`](Self::urgency) when stream priorities are on (else 0),
    /// whether a lane of greater urgency may run beside it (only under
    /// `priority`, for every job below inference's [`MAX_URGENCY`]), and
    /// under `priority` the device's `gate` (`exec::gate`), if the service
    /// gates.
    pub fn share(
        self,
        kind: WireKind,
        priority: i32,
        stream_priority: bool,
        gate: Option<&Arc<Gate>>,
    ) -> GpuShare {
        if !stream_priority {
            return GpuShare::default();
        }
        let urgency = self.urgency(kind, priority);
        GpuShare {
            urgency,
            yields: self == PolicyChoice::Priority && urgency < MAX_URGENCY,
            gate: gate.filter(|_| self == PolicyChoice::Priority).cloned(),
        }
    }

    /// How a job of `spec` asks the lanes for memory under this policy:
    /// where it waits in the admission queue (`Policy::admission_rank`, as
    /// the simulator ranks it) and which lanes it may share
    /// (`Policy::lane_class`).
    pub fn ask(self, spec: &SessionSpec) -> crate::lanes::Ask {
        let job = job_spec(0, spec.kind, spec.expected_iterations, spec.priority);
        let policy = self.build();
        crate::lanes::Ask {
            rank: policy.admission_rank(&job),
            class: policy.lane_class(&job),
        }
    }

    /// A fresh instance of the policy.
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyChoice::Fifo => Box::new(lanes_policies::Fifo),
            PolicyChoice::Srtf => Box::new(lanes_policies::Srtf),
            PolicyChoice::Fair => Box::new(lanes_policies::Fair),
            PolicyChoice::Pack => Box::new(lanes_policies::Pack),
            PolicyChoice::Priority => Box::new(lanes_policies::PriorityPolicy),
        }
    }
}

impl fmt::Display for PolicyChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Levels of stream priority the service uses above the least (a GPU has
/// 6 on Hopper: CUDA's priorities 0 to -5; higher levels are clamped to
/// the device's greatest).
pub const MAX_URGENCY: u8 = 5;

/// `--policy` names that are not a policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {name:?} (expected fifo, srtf, fair, pack or priority)")]
pub struct UnknownPolicy {
    pub name: String,
}

impl std::str::FromStr for PolicyChoice {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        PolicyChoice::ALL
            .into_iter()
            .find(|p| p.name() == s || (s == "packing" && *p == PolicyChoice::Pack))
            .ok_or_else(|| UnknownPolicy { name: s.into() })
    }
}

/// What a session's worker is running now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Running {
    Nothing,
    Run,
    Control,
}

/// One session's items.
#[derive(Debug)]
struct SessionQueue {
    /// Items not yet released, in submission order.
    backlog: VecDeque<WorkItem>,
    /// A released control item waiting for a worker.
    control: Option<WorkItem>,
    /// Runs released to the scheduler and not finished (queued or running).
    runs_out: usize,
    running: Running,
}

/// Policy-ordered work (see the module docs).
pub struct PolicyQueue {
    sched: Scheduler<WorkItem>,
    /// `now` for the scheduler is the time since this instant.
    epoch: Instant,
    sessions: HashMap<SessionId, SessionQueue>,
    /// Sessions with a released control item, in release order.
    control: VecDeque<SessionId>,
    len: usize,
}

impl fmt::Debug for PolicyQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyQueue")
            .field("policy", &self.sched.policy_name())
            .field("sessions", &self.sessions.len())
            .field("queued", &self.len)
            .finish()
    }
}

/// The policy lane every session's job is in (the dispatcher's workers are
/// not tied to memory lanes).
const LANE: usize = 0;

/// What a policy knows of a job: its kind, expected iterations and
/// priority as the session declared them.
fn job_spec(id: u64, kind: WireKind, expected: Option<u64>, priority: i32) -> JobSpec {
    let kind = match kind {
        WireKind::Training => JobKind::Training,
        WireKind::Inference => JobKind::Inference,
    };
    JobSpec::new(id, kind, expected.unwrap_or(0)).with_priority(priority)
}

impl PolicyQueue {
    /// A queue deciding with `policy`.
    pub fn new(policy: Box<dyn Policy>) -> Self {
        PolicyQueue {
            // The dispatcher has no per-session limit; neither does this.
            sched: Scheduler::new(policy).with_queue_limit(usize::MAX),
            epoch: Instant::now(),
            sessions: HashMap::new(),
            control: VecDeque::new(),
            len: 0,
        }
    }

    /// The queue for a `--policy` choice.
    pub fn of(choice: PolicyChoice) -> Self {
        Self::new(choice.build())
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn since_epoch(&self, t: Instant) -> Duration {
        t.saturating_duration_since(self.epoch)
    }

    /// Moves a session's backlog forward: Runs go to the scheduler unless a
    /// control item is ahead of them; a control item is released once every
    /// earlier Run has finished.
    fn release(&mut self, sid: SessionId) {
        let epoch = self.epoch;
        let Some(q) = self.sessions.get_mut(&sid) else {
            return;
        };
        loop {
            let control_ahead = q.control.is_some() || q.running == Running::Control;
            if control_ahead {
                return;
            }
            let head_is_run = match q.backlog.front() {
                None => return,
                Some(item) => matches!(item.work, Work::Run { .. }),
            };
            if head_is_run {
                let Some(item) = q.backlog.pop_front() else {
                    return;
                };
                let at = item.enqueued.saturating_duration_since(epoch);
                match self.sched.submit(sid.0, item, at) {
                    Ok(()) => q.runs_out += 1,
                    Err(e) => {
                        // Only reachable if the job was removed while its
                        // session is still here, which `remove_session` rules out.
                        tracing::error!(session = %sid, error = %e, "run could not be scheduled");
                        return;
                    }
                }
            } else {
                if q.runs_out > 0 {
                    return;
                }
                q.control = q.backlog.pop_front();
                self.control.push_back(sid);
                return;
            }
        }
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.sched.policy_name()
    }
}

impl ReadyQueue for PolicyQueue {
    fn push(&mut self, item: WorkItem) {
        let sid = item.session;
        if !self.sessions.contains_key(&sid) {
            let spec = job_spec(
                item.session.0,
                item.kind,
                item.expected_iterations,
                item.priority,
            );
            let at = self.since_epoch(item.enqueued);
            if let Err(e) = self.sched.add_job(spec, LANE, at) {
                tracing::error!(session = %sid, error = %e, "job could not join the policy");
            }
            self.sessions.insert(
                sid,
                SessionQueue {
                    backlog: VecDeque::new(),
                    control: None,
                    runs_out: 0,
                    running: Running::Nothing,
                },
            );
        }
        if let Some(q) = self.sessions.get_mut(&sid) {
            q.backlog.push_back(item);
            self.len += 1;
        }
        self.release(sid);
    }

    fn pop(&mut self, busy: &HashSet<SessionId>, loads: bool) -> Option<WorkItem> {
        // Control items first, first-come (a LoadGraph only when `loads`).
        let sessions = &self.sessions;
        let eligible = |s: &SessionId| {
            !busy.contains(s)
                && (loads
                    || !sessions
                        .get(s)
                        .and_then(|q| q.control.as_ref())
                        .is_some_and(|i| matches!(i.work, Work::Load { .. })))
        };
        if let Some(pos) = self.control.iter().position(eligible) {
            let sid = self.control.remove(pos)?;
            let q = self.sessions.get_mut(&sid)?;
            let item = q.control.take()?;
            q.running = Running::Control;
            self.len -= 1;
            return Some(item);
        }
        let now = self.now();
        let d = self
            .sched
            .pick_where(LANE, now, |job| busy.contains(&SessionId(job)))?;
        if let Some(q) = self.sessions.get_mut(&SessionId(d.job)) {
            q.running = Running::Run;
        }
        self.len -= 1;
        Some(d.request)
    }

    fn finished(&mut self, session: SessionId, took: Duration, iteration: bool) {
        let now = self.now();
        let Some(q) = self.sessions.get_mut(&session) else {
            return; // removed while its item ran
        };
        match std::mem::replace(&mut q.running, Running::Nothing) {
            Running::Run => {
                q.runs_out = q.runs_out.saturating_sub(1);
                let finished = if iteration {
                    self.sched.finish(session.0, took, now)
                } else {
                    self.sched.finish_other(session.0, took, now)
                };
                if let Err(e) = finished {
                    tracing::error!(%session, error = %e, "finished run unknown to the scheduler");
                }
            }
            Running::Control | Running::Nothing => {}
        }
        self.release(session);
    }

    fn remove_session(&mut self, session: SessionId) -> Vec<WorkItem> {
        let Some(q) = self.sessions.remove(&session) else {
            return Vec::new();
        };
        self.control.retain(|s| *s != session);
        let mut gone: Vec<WorkItem> = q.control.into_iter().collect();
        if let Ok((pending, _stats)) = self.sched.remove_job(session.0, self.now()) {
            gone.extend(pending);
        }
        gone.extend(q.backlog);
        self.len -= gone.len();
        gone
    }

    fn len(&self) -> usize {
        self.len
    }

    fn queued_for(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, |q| {
            q.backlog.len() + usize::from(q.control.is_some()) + self.sched.pending(session.0)
        })
    }

    fn name(&self) -> &'static str {
        self.sched.policy_name()
    }

    fn stats(&self, session: SessionId) -> Option<JobStats> {
        self.sched.stats(session.0).copied()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::session::{RunFeeds, Session};
    use lanes_adaptor::wire::SessionSpec;
    use std::sync::{Arc, Mutex};

    fn item(s: u64, id: u64, kind: WireKind, expected: u64, work: Work) -> WorkItem {
        let sid = SessionId(s);
        WorkItem {
            session: sid,
            kind,
            priority: 0,
            expected_iterations: Some(expected),
            enqueued: Instant::now(),
            peer: vec![],
            request_id: id,
            work,
            state: Arc::new(Mutex::new(Session::new(sid, SessionSpec::inference("t")))),
        }
    }

    fn run() -> Work {
        Work::Run {
            feeds: RunFeeds::Frames(vec![]),
            fetches: vec![],
            reply: None,
        }
    }

    fn read() -> Work {
        Work::ReadVariables { names: vec![] }
    }

    fn train(s: u64, id: u64, expected: u64) -> WorkItem {
        item(s, id, WireKind::Training, expected, run())
    }

    /// Pops one item, "runs" it for `took` and reports it finished.
    fn serve(q: &mut PolicyQueue, took: Duration) -> Option<(u64, u64)> {
        let it = q.pop(&HashSet::new(), true)?;
        q.finished(it.session, took, true);
        Some((it.session.0, it.request_id))
    }

    #[test]
    fn only_priority_ranks_streams_across_lanes() {
        use PolicyChoice::*;
        assert_eq!(Priority.urgency(WireKind::Inference, 0), MAX_URGENCY);
        assert_eq!(Priority.urgency(WireKind::Inference, -7), MAX_URGENCY);
        assert_eq!(Priority.urgency(WireKind::Training, 0), 0);
        assert_eq!(Priority.urgency(WireKind::Training, -3), 0);
        assert_eq!(Priority.urgency(WireKind::Training, 2), 2);
        // A training job never reaches inference's level.
        assert_eq!(Priority.urgency(WireKind::Training, 99), MAX_URGENCY - 1);
        for p in [Fifo, Srtf, Fair, Pack] {
            assert_eq!(p.urgency(WireKind::Inference, 5), 0, "{p}");
            assert_eq!(p.urgency(WireKind::Training, 5), 0, "{p}");
        }
        // Admission order: priority puts inference first, fifo arrival only.
        let inf = SessionSpec::inference("i");
        let train = SessionSpec::training("t");
        assert!(Priority.ask(&inf).rank < Priority.ask(&train).rank);
        assert_eq!(Fifo.ask(&inf).rank, Fifo.ask(&train).rank);
        // Lanes: only priority keeps inference out of training's lanes.
        assert_ne!(Priority.ask(&inf).class, Priority.ask(&train).class);
        let mut urgent = SessionSpec::training("u");
        urgent.priority = 5;
        assert_eq!(Priority.ask(&urgent).class, Priority.ask(&train).class);
        for p in [Fifo, Srtf, Fair, Pack] {
            assert_eq!(p.ask(&inf).class, p.ask(&train).class, "{p}");
        }
    }

    #[test]
    fn only_jobs_an_urgent_lane_may_outrank_yield() {
        use PolicyChoice::*;
        let share = |urgency, yields| GpuShare {
            urgency,
            yields,
            gate: None,
        };
        assert_eq!(
            Priority.share(WireKind::Training, 0, true, None),
            share(0, true)
        );
        assert_eq!(
            Priority.share(WireKind::Training, 3, true, None),
            share(3, true)
        );
        assert_eq!(
            Priority.share(WireKind::Inference, 0, true, None),
            share(MAX_URGENCY, false)
        );
        // Without stream priorities nobody outranks anybody.
        assert_eq!(
            Priority.share(WireKind::Training, 0, false, None),
            GpuShare::default()
        );
        for p in [Fifo, Srtf, Fair, Pack] {
            for kind in [WireKind::Training, WireKind::Inference] {
                assert_eq!(p.share(kind, 4, true, None), share(0, false), "{p}");
            }
        }
    }

    #[test]
    fn only_priority_gates_and_the_gate_knows_who_closes_it() {
        use PolicyChoice::*;
        let gate = crate::exec::gate::Gate::new(Default::default());
        let train = Priority.share(WireKind::Training, 0, true, Some(&gate));
        let infer = Priority.share(WireKind::Inference, 0, true, Some(&gate));
        assert!(train.yielding_gate().is_some() && train.urgent_gate().is_none());
        assert!(infer.urgent_gate().is_some() && infer.yielding_gate().is_none());
        // Without stream priorities, or under another policy: no gate.
        assert!(Priority
            .share(WireKind::Inference, 0, false, Some(&gate))
            .gate
            .is_none());
        for p in [Fifo, Srtf, Fair, Pack] {
            assert!(p
                .share(WireKind::Training, 0, true, Some(&gate))
                .gate
                .is_none());
        }
    }

    #[test]
    fn fifo_runs_the_first_job_while_it_keeps_runs_queued() {
        let mut q = PolicyQueue::of(PolicyChoice::Fifo);
        q.push(train(1, 1, 10));
        q.push(train(2, 2, 10));
        q.push(train(1, 3, 10));
        assert_eq!(q.len(), 3);
        assert_eq!(q.queued_for(SessionId(1)), 2);
        // Request-level FIFO would run 1, 2, 3; job-level FIFO runs job 1 first.
        let order: Vec<_> = std::iter::from_fn(|| serve(&mut q, Duration::from_millis(1)))
            .map(|(_, r)| r)
            .collect();
        assert_eq!(order, vec![1, 3, 2]);
        assert!(q.is_empty());
        let st = q.stats(SessionId(1)).unwrap();
        assert_eq!((st.iterations, st.dispatched), (2, 2));
        assert_eq!(st.service_total, Duration::from_millis(2));
        assert_eq!(q.name(), "fifo");
    }

    #[test]
    fn priority_serves_queued_inference_before_earlier_training() {
        let mut q = PolicyQueue::of(PolicyChoice::Priority);
        for r in 1..=3 {
            q.push(train(1, r, 10));
        }
        q.push(item(2, 10, WireKind::Inference, 5, run()));
        q.push(item(2, 11, WireKind::Inference, 5, run()));
        let order: Vec<_> = std::iter::from_fn(|| serve(&mut q, Duration::from_millis(1)))
            .map(|(_, r)| r)
            .collect();
        assert_eq!(order, vec![10, 11, 1, 2, 3]);
    }

    #[test]
    fn srtf_leaves_runs_that_are_not_iterations_out_of_a_jobs_progress() {
        let mut q = PolicyQueue::of(PolicyChoice::Srtf);
        let once = |q: &mut PolicyQueue, it: WorkItem, ms: u64, iteration: bool| {
            q.push(it);
            let it = q.pop(&HashSet::new(), true).unwrap();
            q.finished(it.session, Duration::from_millis(ms), iteration);
        };
        // Job 1 (4 iterations): a step of 5 ms, then an evaluation of 100 ms.
        once(&mut q, train(1, 1, 4), 5, true);
        once(&mut q, train(1, 2, 4), 100, false);
        let st = q.stats(SessionId(1)).unwrap();
        assert_eq!((st.iterations, st.other_runs), (1, 1));
        assert_eq!(st.service_mean(), Duration::from_millis(5));
        // Job 2 (3 iterations): a step of 20 ms.
        once(&mut q, train(2, 3, 3), 20, true);
        // Left: job 1 3 × 5 ms = 15 ms, job 2 2 × 20 ms = 40 ms. Had the
        // evaluation counted as an iteration, job 1 would have had 2 left
        // of 52.5 ms each (105 ms) and job 2 would go first.
        q.push(train(2, 4, 3));
        q.push(train(1, 5, 4));
        assert_eq!(serve(&mut q, Duration::from_millis(1)).unwrap().0, 1);
    }

    #[test]
    fn srtf_uses_the_measured_durations_the_workers_report() {
        let mut q = PolicyQueue::of(PolicyChoice::Srtf);
        // Job 1: 10 iterations, job 2: 4 iterations; one probe each.
        q.push(train(1, 1, 10));
        q.push(train(2, 2, 4));
        let first = serve(&mut q, Duration::from_millis(1)).unwrap(); // probe, estimate 0
        let second = serve(&mut q, Duration::from_millis(20)).unwrap();
        assert_ne!(first.0, second.0);
        // Whoever ran first measured 1 ms per iteration, the other 20 ms.
        q.push(train(1, 3, 10));
        q.push(train(2, 4, 4));
        let fast = first.0;
        // Remaining work: fast job 9 × 1 ms (or 3 × 1 ms) beats 20 ms × rest.
        assert_eq!(serve(&mut q, Duration::from_millis(1)).unwrap().0, fast);
    }

    #[test]
    fn session_order_is_kept_and_control_items_go_first() {
        let mut q = PolicyQueue::of(PolicyChoice::Priority);
        // Training session 1: Run, Read, Run. Inference session 2: Run.
        q.push(train(1, 1, 10));
        q.push(item(1, 2, WireKind::Training, 10, read()));
        q.push(train(1, 3, 10));
        q.push(item(2, 4, WireKind::Inference, 10, run()));
        // Nothing of session 1 may overtake its Run 1; the Read waits for it.
        assert_eq!(serve(&mut q, Duration::ZERO), Some((2, 4)));
        assert_eq!(serve(&mut q, Duration::ZERO), Some((1, 1)));
        // Run 1 finished: the Read is released and runs before Run 3.
        assert_eq!(serve(&mut q, Duration::ZERO), Some((1, 2)));
        // A Load of a new session goes before queued Runs.
        q.push(train(1, 5, 10));
        q.push(item(3, 6, WireKind::Training, 10, read()));
        assert_eq!(serve(&mut q, Duration::ZERO), Some((3, 6)));
        assert_eq!(serve(&mut q, Duration::ZERO), Some((1, 3)));
        assert_eq!(serve(&mut q, Duration::ZERO), Some((1, 5)));
        assert!(q.is_empty());
    }

    #[test]
    fn held_sessions_are_skipped_and_removed_jobs_leave_the_policy() {
        let mut q = PolicyQueue::of(PolicyChoice::Priority);
        q.push(train(1, 1, 10));
        q.push(item(2, 2, WireKind::Inference, 10, run()));
        q.push(item(2, 3, WireKind::Inference, 10, run()));
        // Session 2 waits for memory: training runs although inference waits.
        let held: HashSet<_> = [SessionId(2)].into();
        let it = q.pop(&held, true).unwrap();
        assert_eq!(it.request_id, 1);
        assert!(
            q.pop(&held, true).is_none(),
            "session 1 runs, session 2 is held"
        );
        // Session 2 closes: its queued items come back, its job is gone.
        let gone = q.remove_session(SessionId(2));
        assert_eq!(gone.len(), 2);
        assert_eq!(q.len(), 0);
        assert!(q.stats(SessionId(2)).is_none());
        q.finished(SessionId(1), Duration::from_millis(3), true);
        q.finished(SessionId(2), Duration::from_millis(3), true); // removed: ignored
        assert_eq!(q.stats(SessionId(1)).unwrap().iterations, 1);
        assert_eq!(q.queued_for(SessionId(2)), 0);
    }

    #[test]
    fn policy_names_parse_and_unknown_ones_are_typed_errors() {
        for (p, name) in PolicyChoice::ALL.iter().zip(lanes_policies::POLICY_NAMES) {
            assert_eq!(p.name(), name);
            assert_eq!(name.parse::<PolicyChoice>(), Ok(*p));
            assert_eq!(p.build().name(), name);
        }
        assert_eq!(
            "lottery".parse::<PolicyChoice>(),
            Err(UnknownPolicy {
                name: "lottery".into()
            })
        );
    }
}
