//! One execution context per lane. On the CPU backend a lane's context is a
//! worker thread: iterations submitted to the same lane run one at a time,
//! in submission order; iterations of different lanes run at the same time.
//!
//! Each worker reads a bounded channel of tasks. Capacity
//! [`LANE_QUEUE`]: the scheduler submits an iteration only when it has
//! picked it for an idle lane, so the queue normally holds at most one;
//! the bound only stops a runaway caller from growing memory without limit
//! (submission then blocks until the lane catches up).

use crossbeam_channel::{bounded, Receiver, Sender};
use std::collections::HashMap;
use std::thread::JoinHandle;

use super::manager::LaneId;

/// Pending tasks per lane before `submit` blocks.
pub const LANE_QUEUE: usize = 64;

type Task = Box<dyn FnOnce() + Send + 'static>;

#[derive(Debug)]
struct Worker {
    tx: Sender<Task>,
    handle: JoinHandle<()>,
}

/// Why a task could not be handed to its lane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot start a worker for lane {lane}: {reason}")]
    Spawn { lane: LaneId, reason: String },
    #[error("the worker of lane {lane} has stopped")]
    Stopped { lane: LaneId },
}

/// Worker threads, one per open lane.
#[derive(Debug, Default)]
pub struct LaneWorkers {
    workers: HashMap<LaneId, Worker>,
}

impl LaneWorkers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Lanes with a running worker.
    pub fn lanes(&self) -> Vec<LaneId> {
        let mut v: Vec<LaneId> = self.workers.keys().copied().collect();
        v.sort();
        v
    }

    fn ensure(&mut self, lane: LaneId) -> Result<&Worker, WorkerError> {
        use std::collections::hash_map::Entry;
        match self.workers.entry(lane) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(v) => {
                let (tx, rx) = bounded::<Task>(LANE_QUEUE);
                let handle = std::thread::Builder::new()
                    .name(format!("lane-{}", lane.0))
                    .spawn(move || {
                        for task in rx {
                            // A panicking task loses its result, not the lane.
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
                        }
                    })
                    .map_err(|e| WorkerError::Spawn {
                        lane,
                        reason: e.to_string(),
                    })?;
                Ok(v.insert(Worker { tx, handle }))
            }
        }
    }

    /// Runs `f` on `lane`'s worker (started on first use) after the tasks
    /// already submitted to that lane; the result arrives on the receiver.
    /// A panic in `f` drops the result sender, so the receiver reports a
    /// disconnection instead of hanging; the lane's worker carries on.
    pub fn submit<R, F>(&mut self, lane: LaneId, f: F) -> Result<Receiver<R>, WorkerError>
    where
        R: Send + 'static,
        F: FnOnce() -> R + Send + 'static,
    {
        let (rtx, rrx) = bounded(1);
        let task: Task = Box::new(move || {
            let _ = rtx.send(f());
        });
        let w = self.ensure(lane)?;
        if w.tx.send(task).is_err() {
            self.workers.remove(&lane);
            return Err(WorkerError::Stopped { lane });
        }
        Ok(rrx)
    }

    /// Stops `lane`'s worker after its pending tasks and waits for it.
    pub fn close(&mut self, lane: LaneId) {
        if let Some(w) = self.workers.remove(&lane) {
            drop(w.tx);
            let _ = w.handle.join();
        }
    }
}

impl Drop for LaneWorkers {
    fn drop(&mut self) {
        for lane in self.lanes() {
            self.close(lane);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    #[test]
    fn one_lane_runs_in_order_two_lanes_concurrently() {
        let mut w = LaneWorkers::new();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut rx = Vec::new();
        for i in 0..5 {
            let log = log.clone();
            rx.push(
                w.submit(LaneId(0), move || {
                    std::thread::sleep(Duration::from_millis(2));
                    log.lock().unwrap().push(i);
                    i
                })
                .unwrap(),
            );
        }
        let got: Vec<i32> = rx.into_iter().map(|r| r.recv().unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        assert_eq!(*log.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        // Lane 1 proceeds while lane 0 is blocked on a barrier lane 1 opens.
        let (open_tx, open_rx) = bounded::<()>(1);
        let blocked = w.submit(LaneId(0), move || open_rx.recv().is_ok()).unwrap();
        let opener = w
            .submit(LaneId(1), move || open_tx.send(()).is_ok())
            .unwrap();
        assert!(opener.recv_timeout(Duration::from_secs(10)).unwrap());
        assert!(blocked.recv_timeout(Duration::from_secs(10)).unwrap());
        assert_eq!(w.lanes(), vec![LaneId(0), LaneId(1)]);
        w.close(LaneId(0));
        assert_eq!(w.lanes(), vec![LaneId(1)]);
    }

    #[test]
    fn a_panicking_task_disconnects_its_receiver() {
        let mut w = LaneWorkers::new();
        let r = w.submit(LaneId(3), || -> u32 { panic!("boom") }).unwrap();
        assert!(r.recv_timeout(Duration::from_secs(10)).is_err());
        let r = w.submit(LaneId(3), || 7u32).unwrap();
        assert_eq!(r.recv_timeout(Duration::from_secs(10)).unwrap(), 7);
    }
}
