//! The dispatch seam between the socket thread and the workers.
//!
//! The socket thread turns each session request that needs compute
//! (LoadGraph, Run, ReadVariables, WriteVariables) into a [`WorkItem`] and
//! [`Dispatcher::submit`]s it. Workers call [`Dispatcher::next`], which asks
//! the [`ReadyQueue`] for the next item whose session is not already being
//! served, so one session's requests run one at a time and in order.
//!
//! Two queues implement the seam:
//! - [`PolicyQueue`](super::policy_queue::PolicyQueue), what `lanes serve`
//!   runs: Run requests ordered by a `lanes-policies` policy through
//!   `sched::Scheduler` (`--policy fifo|srtf|fair|pack|priority`); each item
//!   carries what a policy needs (kind, priority, expected iterations,
//!   enqueue time), and workers report each item's measured duration through
//!   [`Dispatcher::done`] so SRTF and fair see real iteration times;
//! - [`FifoQueue`]: first come, first served per request (tests, and a
//!   baseline).
//!
//! Lane admission (`src/lanes`) decides which sessions may have items popped
//! at all: sessions whose job waits for memory are skipped exactly as busy
//! sessions are.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use lanes_adaptor::wire::{JobKind, NamedTensor, SessionId};
use lanes_adaptor::Graph;

use crate::sched::JobStats;
use crate::session::{RunFeeds, Session};

/// What a worker is asked to do for a session.
#[derive(Debug)]
pub enum Work {
    Load {
        graph: Graph,
        variables: Vec<NamedTensor>,
        /// From the request's arrival at the socket thread to its decoded
        /// form (waiting behind the peer's earlier request included).
        decoded: Duration,
    },
    Run {
        feeds: RunFeeds,
        fetches: Vec<String>,
        /// Where the client asked for the outputs in its segment as well.
        reply: Option<lanes_adaptor::wire::shm::ReplySlot>,
    },
    ReadVariables {
        names: Vec<String>,
    },
    WriteVariables {
        variables: Vec<NamedTensor>,
    },
}

impl Work {
    pub fn name(&self) -> &'static str {
        match self {
            Work::Load { .. } => "load_graph",
            Work::Run { .. } => "run",
            Work::ReadVariables { .. } => "read_variables",
            Work::WriteVariables { .. } => "write_variables",
        }
    }
}

/// One queued request of one session, with what a policy needs to order it.
pub struct WorkItem {
    pub session: SessionId,
    pub kind: JobKind,
    pub priority: i32,
    pub expected_iterations: Option<u64>,
    pub enqueued: Instant,
    /// ZeroMQ routing id of the peer that sent the request.
    pub peer: Vec<u8>,
    pub request_id: u64,
    pub work: Work,
    /// The session's state; a worker locks it while running the item.
    pub state: Arc<Mutex<Session>>,
}

impl fmt::Debug for WorkItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkItem")
            .field("session", &self.session)
            .field("work", &self.work.name())
            .field("request_id", &self.request_id)
            .finish()
    }
}

/// Orders queued work. Implementations decide which item runs next; they
/// must never return an item whose session is in `busy`.
pub trait ReadyQueue: Send + fmt::Debug {
    fn push(&mut self, item: WorkItem);
    /// Removes and returns the next item to run, if any is eligible; a
    /// LoadGraph only when `loads` (the dispatcher bounds how many run at
    /// once).
    fn pop(&mut self, busy: &HashSet<SessionId>, loads: bool) -> Option<WorkItem>;
    /// Removes every queued item of a session (closed or reclaimed).
    fn remove_session(&mut self, session: SessionId) -> Vec<WorkItem>;
    /// Items queued in all.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Items queued for one session.
    fn queued_for(&self, session: SessionId) -> usize;
    /// A session's item (the one [`ReadyQueue::pop`] returned last for it)
    /// finished after `took`; `iteration`: it was one of the job's
    /// iterations (every item but a Run that evaluates, updating nothing).
    /// Called for every popped item, unless the session was removed
    /// meanwhile (then it may be called or not).
    fn finished(&mut self, _session: SessionId, _took: Duration, _iteration: bool) {}
    /// The ordering's name, shown by `lanes status`.
    fn name(&self) -> &'static str;
    /// A session's queueing delay and service time so far, if measured.
    fn stats(&self, _session: SessionId) -> Option<JobStats> {
        None
    }
}

/// First come, first served across sessions.
#[derive(Debug, Default)]
pub struct FifoQueue {
    items: VecDeque<WorkItem>,
}

impl ReadyQueue for FifoQueue {
    fn push(&mut self, item: WorkItem) {
        self.items.push_back(item);
    }
    fn pop(&mut self, busy: &HashSet<SessionId>, loads: bool) -> Option<WorkItem> {
        let pos = self.items.iter().position(|i| {
            !busy.contains(&i.session) && (loads || !matches!(i.work, Work::Load { .. }))
        })?;
        self.items.remove(pos)
    }
    fn remove_session(&mut self, session: SessionId) -> Vec<WorkItem> {
        let (gone, keep) = std::mem::take(&mut self.items)
            .into_iter()
            .partition(|i| i.session == session);
        self.items = keep;
        gone.into()
    }
    fn len(&self) -> usize {
        self.items.len()
    }
    fn queued_for(&self, session: SessionId) -> usize {
        self.items.iter().filter(|i| i.session == session).count()
    }
    fn name(&self) -> &'static str {
        "fifo-requests"
    }
}

#[derive(Debug)]
struct State {
    queue: Box<dyn ReadyQueue>,
    busy: HashSet<SessionId>,
    shutdown: bool,
    /// Sessions whose job waits for memory here are skipped like busy ones.
    gate: Option<crate::lanes::SharedLanes>,
    /// Sessions running a LoadGraph now, and how many may at once: a few
    /// huge graphs being loaded never take every worker from the Runs of
    /// other sessions.
    loading: HashSet<SessionId>,
    max_loads: usize,
    /// The item each busy session runs now: its peer and request id (a
    /// stopping service answers those still running at the end of its
    /// grace period).
    running: HashMap<SessionId, (Vec<u8>, u64)>,
}

/// The queue shared by the socket thread and the workers (a mutex and a
/// condition variable; critical sections are a push or a pop).
#[derive(Debug)]
pub struct Dispatcher {
    state: Mutex<State>,
    ready: Condvar,
    /// How long a worker looks for its next item without sleeping
    /// (`ServerConfig::busy_poll`; zero: it waits on the condition
    /// variable at once), in nanoseconds.
    busy_ns: std::sync::atomic::AtomicU64,
}

impl Dispatcher {
    pub fn new(queue: Box<dyn ReadyQueue>) -> Arc<Self> {
        Arc::new(Dispatcher {
            state: Mutex::new(State {
                queue,
                busy: HashSet::new(),
                shutdown: false,
                gate: None,
                loading: HashSet::new(),
                max_loads: usize::MAX,
                running: HashMap::new(),
            }),
            ready: Condvar::new(),
            busy_ns: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Workers look for their next item without sleeping for `window`
    /// before waiting (see `ServerConfig::busy_poll`).
    pub fn busy_poll(&self, window: std::time::Duration) {
        let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        self.busy_ns.store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues an item and wakes a worker.
    pub fn submit(&self, item: WorkItem) {
        self.lock().queue.push(item);
        self.ready.notify_one();
    }

    /// Blocks until an item is eligible; `None` once shut down. The item's
    /// session stays busy until [`Dispatcher::done`].
    pub fn next(&self) -> Option<WorkItem> {
        let spin = std::time::Duration::from_nanos(
            self.busy_ns.load(std::sync::atomic::Ordering::Relaxed),
        );
        let since = std::time::Instant::now();
        let mut st = self.lock();
        loop {
            if st.shutdown {
                return None;
            }
            let State {
                queue,
                busy,
                gate,
                loading,
                max_loads,
                running,
                ..
            } = &mut *st;
            // Held back besides busy sessions: jobs waiting for memory, and
            // jobs whose lane runs an item now (a lane runs one iteration
            // at a time; a worker never waits for a lane's turn).
            let (waiting, mates) = gate.as_ref().map_or_else(Default::default, |g| {
                (
                    g.waiting_jobs(),
                    g.lane_mates(busy.iter().map(|s| crate::lanes::JobId(s.0))),
                )
            });
            let skip: HashSet<SessionId>;
            let busy_or_waiting = if waiting.is_empty() && mates.is_empty() {
                &*busy
            } else {
                skip = busy
                    .iter()
                    .copied()
                    .chain(waiting.into_iter().chain(mates).map(|j| SessionId(j.0)))
                    .collect();
                &skip
            };
            if let Some(item) = queue.pop(busy_or_waiting, loading.len() < *max_loads) {
                busy.insert(item.session);
                running.insert(item.session, (item.peer.clone(), item.request_id));
                if matches!(item.work, Work::Load { .. }) {
                    loading.insert(item.session);
                }
                return Some(item);
            }
            if since.elapsed() < spin {
                // Busy polling: look again without sleeping.
                drop(st);
                std::thread::yield_now();
                st = self.lock();
                continue;
            }
            st = self.ready.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// At most `n` (at least 1) LoadGraph requests run at once; the other
    /// workers stay for Runs (a service with `w` workers uses `w - 1`).
    pub fn limit_loads(&self, n: usize) {
        self.lock().max_loads = n.max(1);
    }

    /// Holds back the items of sessions whose job waits in `lanes`'
    /// admission queue (lock order: dispatcher, then lanes).
    pub fn gate_on(&self, lanes: crate::lanes::SharedLanes) {
        self.lock().gate = Some(lanes);
    }

    /// Wakes the workers to look again (after memory was released). Takes
    /// the lock first: a worker that found nothing runnable holds it from
    /// its look at the lanes until it waits, so the notification cannot
    /// fall between the two (a lost wake-up left a Run of a job admitted
    /// meanwhile queued with every worker asleep).
    pub fn wake(&self) {
        drop(self.lock());
        self.ready.notify_all();
    }

    /// Whether a job waits in the lanes' admission queue (lock order:
    /// dispatcher, then lanes).
    pub fn memory_wanted(&self) -> bool {
        self.lock()
            .gate
            .as_ref()
            .is_some_and(|g| !g.waiting_jobs().is_empty())
    }

    /// Marks a session's item finished after `took` (measured by the
    /// worker), so its next item may run; `iteration`: whether it was one
    /// of the job's iterations (not an evaluation Run).
    pub fn done(&self, session: SessionId, took: Duration, iteration: bool) {
        let mut st = self.lock();
        st.queue.finished(session, took, iteration);
        st.busy.remove(&session);
        st.loading.remove(&session);
        st.running.remove(&session);
        drop(st);
        self.ready.notify_all();
    }

    /// The queue's ordering (policy name).
    pub fn policy(&self) -> &'static str {
        self.lock().queue.name()
    }

    /// A session's queueing delay and service time, if the queue measures them.
    pub fn stats(&self, session: SessionId) -> Option<JobStats> {
        self.lock().queue.stats(session)
    }

    /// Drops a session's queued items (a running one finishes).
    pub fn cancel(&self, session: SessionId) -> usize {
        self.lock().queue.remove_session(session).len()
    }

    /// Takes a session's queued items out (a running one finishes).
    pub fn take_queued(&self, session: SessionId) -> Vec<WorkItem> {
        self.lock().queue.remove_session(session)
    }

    /// The items running now: (session, peer, request id).
    pub fn running(&self) -> Vec<(SessionId, Vec<u8>, u64)> {
        self.lock()
            .running
            .iter()
            .map(|(s, (p, r))| (*s, p.clone(), *r))
            .collect()
    }

    /// True when the session has nothing queued or running.
    pub fn is_idle(&self, session: SessionId) -> bool {
        let st = self.lock();
        !st.busy.contains(&session) && st.queue.queued_for(session) == 0
    }

    /// (queued for this session, running for this session).
    pub fn session_load(&self, session: SessionId) -> (usize, bool) {
        let st = self.lock();
        (st.queue.queued_for(session), st.busy.contains(&session))
    }

    /// Requests of `sessions` queued or running, all counted under one
    /// lock.
    pub fn requests_of(&self, sessions: impl Iterator<Item = SessionId>) -> usize {
        let st = self.lock();
        sessions
            .map(|s| st.queue.queued_for(s) + usize::from(st.busy.contains(&s)))
            .sum()
    }

    pub fn queued(&self) -> usize {
        self.lock().queue.len()
    }

    /// Wakes every worker and makes [`Dispatcher::next`] return `None`.
    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.ready.notify_all();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use lanes_adaptor::wire::SessionSpec;

    fn item(s: u64, id: u64) -> WorkItem {
        let sid = SessionId(s);
        WorkItem {
            session: sid,
            kind: JobKind::Inference,
            priority: 0,
            expected_iterations: None,
            enqueued: Instant::now(),
            peer: vec![],
            request_id: id,
            work: Work::ReadVariables { names: vec![] },
            state: Arc::new(Mutex::new(Session::new(sid, SessionSpec::inference("t")))),
        }
    }

    #[test]
    fn one_item_per_session_at_a_time_in_order() {
        let d = Dispatcher::new(Box::new(FifoQueue::default()));
        d.submit(item(1, 1));
        d.submit(item(1, 2));
        d.submit(item(2, 3));
        let a = d.next().unwrap();
        assert_eq!(a.request_id, 1);
        // Session 1 is busy: its second item waits, session 2 goes first.
        let b = d.next().unwrap();
        assert_eq!(b.request_id, 3);
        assert!(!d.is_idle(SessionId(1)));
        d.done(SessionId(1), Duration::ZERO, true);
        assert_eq!(d.next().unwrap().request_id, 2);
        d.done(SessionId(1), Duration::ZERO, true);
        d.done(SessionId(2), Duration::ZERO, true);
        assert!(d.is_idle(SessionId(1)));
        assert_eq!(d.queued(), 0);
    }

    #[test]
    fn sessions_waiting_for_memory_are_held_back() {
        use crate::lanes::{JobId, LanesConfig, SharedLanes};
        let lanes = SharedLanes::accounting_only(LanesConfig {
            capacity: 1000,
            alignment: 1,
            max_lanes: 1,
        })
        .unwrap();
        let (first, _) = lanes.admit(JobId(1), 500, 500).unwrap();
        let (_second, _) = lanes.admit(JobId(2), 500, 500).unwrap(); // queued
        let d = Dispatcher::new(Box::new(FifoQueue::default()));
        d.gate_on(lanes.clone());
        d.submit(item(2, 1));
        d.submit(item(1, 2));
        // Session 2 waits for memory: session 1's later item goes first.
        assert_eq!(d.next().unwrap().request_id, 2);
        d.done(SessionId(1), Duration::ZERO, true);
        let d2 = Arc::clone(&d);
        let t = std::thread::spawn(move || d2.next().map(|i| i.request_id));
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(first); // releases job 1: job 2 is admitted
        d.wake();
        assert_eq!(t.join().unwrap(), Some(1));
    }

    /// A lane runs one item at a time: while a job of a lane runs, the
    /// other jobs of that lane are held back (no worker blocks on the
    /// lane's turn); jobs of another lane are not.
    #[test]
    fn jobs_of_a_busy_lane_are_held_back() {
        use crate::lanes::{JobId, LanesConfig, SharedLanes};
        for max_lanes in [1, 2] {
            let lanes = SharedLanes::accounting_only(LanesConfig {
                capacity: 1 << 20,
                alignment: 1,
                max_lanes,
            })
            .unwrap();
            let (_a, _) = lanes.admit(JobId(1), 500, 500).unwrap();
            let (_b, _) = lanes.admit(JobId(2), 500, 500).unwrap();
            let same_lane =
                lanes.placement(JobId(1)).unwrap().lane == lanes.placement(JobId(2)).unwrap().lane;
            assert_eq!(same_lane, max_lanes == 1);
            let d = Dispatcher::new(Box::new(FifoQueue::default()));
            d.gate_on(lanes.clone());
            d.submit(item(1, 1));
            d.submit(item(2, 2));
            assert_eq!(d.next().unwrap().request_id, 1);
            let d2 = Arc::clone(&d);
            let t = std::thread::spawn(move || d2.next().map(|i| i.request_id));
            std::thread::sleep(std::time::Duration::from_millis(50));
            // One lane: job 2 waits for job 1's item; two lanes: it runs.
            assert_eq!(t.is_finished(), !same_lane);
            d.done(SessionId(1), Duration::ZERO, true);
            assert_eq!(t.join().unwrap(), Some(2));
        }
    }

    #[test]
    fn workers_report_durations_to_the_policy_queue() {
        use crate::server::policy_queue::{PolicyChoice, PolicyQueue};
        let d = Dispatcher::new(Box::new(PolicyQueue::of(PolicyChoice::Srtf)));
        assert_eq!(d.policy(), "srtf");
        let run = |s, id| {
            let mut i = item(s, id);
            i.work = Work::Run {
                feeds: RunFeeds::Frames(vec![]),
                reply: None,
                fetches: vec![],
            };
            i.expected_iterations = Some(10);
            i
        };
        d.submit(run(1, 1));
        let a = d.next().unwrap();
        d.done(a.session, Duration::from_millis(7), true);
        let st = d.stats(SessionId(1)).unwrap();
        assert_eq!(
            (st.iterations, st.service_total),
            (1, Duration::from_millis(7))
        );
        assert!(d.is_idle(SessionId(1)));
        // Cancelling a session takes its job out of the policy.
        d.submit(run(1, 2));
        assert_eq!(d.cancel(SessionId(1)), 1);
        assert!(d.stats(SessionId(1)).is_none());
        assert_eq!(
            Dispatcher::new(Box::new(FifoQueue::default())).policy(),
            "fifo-requests"
        );
    }

    /// With loads limited to one at a time, a second LoadGraph waits while
    /// another session's Run goes ahead of it.
    #[test]
    fn loads_leave_workers_for_runs() {
        for queue in [
            Box::new(FifoQueue::default()) as Box<dyn ReadyQueue>,
            Box::new(crate::server::policy_queue::PolicyQueue::of(
                crate::server::policy_queue::PolicyChoice::Fifo,
            )),
        ] {
            let d = Dispatcher::new(queue);
            d.limit_loads(1);
            let load = |s, id| {
                let mut i = item(s, id);
                i.work = Work::Load {
                    graph: lanes_adaptor::Graph::default(),
                    variables: vec![],
                    decoded: Duration::ZERO,
                };
                i
            };
            let run = |s, id| {
                let mut i = item(s, id);
                i.work = Work::Run {
                    feeds: RunFeeds::Frames(vec![]),
                    fetches: vec![],
                    reply: None,
                };
                i
            };
            d.submit(load(1, 1));
            d.submit(load(2, 2));
            d.submit(run(3, 3));
            assert_eq!(d.next().unwrap().request_id, 1);
            // Session 2's load waits for session 1's; session 3's Run goes.
            assert_eq!(d.next().unwrap().request_id, 3);
            d.done(SessionId(1), Duration::ZERO, true);
            assert_eq!(d.next().unwrap().request_id, 2);
        }
    }

    #[test]
    fn cancel_and_shutdown() {
        let d = Dispatcher::new(Box::new(FifoQueue::default()));
        d.submit(item(1, 1));
        d.submit(item(2, 2));
        d.submit(item(1, 3));
        assert_eq!(d.cancel(SessionId(1)), 2);
        assert_eq!(d.session_load(SessionId(2)), (1, false));
        let d2 = Arc::clone(&d);
        let t = std::thread::spawn(move || {
            let mut n = 0;
            while d2.next().is_some() {
                n += 1;
            }
            n
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        d.shutdown();
        let n = t.join().unwrap();
        assert!(n <= 1);
    }
}
