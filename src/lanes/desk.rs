//! The admission desk: what a service's request loop needs from memory
//! planning and lanes, per session, in four calls.
//!
//! - [`AdmissionDesk::load`] at LoadGraph: plans the graph (exact P and T),
//!   admits the session's job or queues it, and says which.
//! - [`AdmissionDesk::gate`] at each Run: the request goes ahead when the
//!   job is admitted; otherwise it is parked until it is.
//! - [`AdmissionDesk::close`] when a session closes or is reaped: its memory
//!   goes back, and the Runs of jobs this admitted come back to be run (and
//!   the closed session's own parked Runs, to be answered with an error).
//! - [`AdmissionDesk::snapshot`] for `lanes status`.
//!
//! The desk never blocks: it suits a single-threaded ZeroMQ loop.

use std::collections::HashMap;

use lanes_adaptor::ValidGraph;

use super::manager::{Admission, AdmitError, JobId, LanesConfig, Placement, QueueReason};
use super::parked::{ParkFull, Parked};
use super::shared::{Lease, SharedError, SharedLanes};
use super::snapshot::LanesSnapshot;
use crate::compile::{self, MemoryPlan, PlanError};

/// Why a graph could not be loaded into memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Admit(#[from] AdmitError),
}

impl LoadError {
    /// Stable code for wire replies and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            LoadError::Plan(e) => e.kind(),
            LoadError::Admit(e) => e.kind(),
        }
    }
}

/// The outcome of a LoadGraph, for its reply.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// P: persistent bytes.
    pub persistent: u64,
    /// T: ephemeral bytes of one iteration.
    pub ephemeral: u64,
    /// Where the job is, when admitted now.
    pub placement: Option<Placement>,
    /// Why the job waits, when queued.
    pub waiting: Option<QueueReason>,
}

/// What to do with a Run.
#[derive(Debug, PartialEq, Eq)]
pub enum Gate<R> {
    /// Admitted: run it.
    Go(R),
    /// Parked until the job is admitted.
    Parked,
    /// Too many Runs already wait for this job: answer with an error.
    Full(ParkFull, R),
}

/// What closing a session gave back.
#[derive(Debug)]
pub struct Closed<R> {
    /// Runs the closed session had parked: answer them with an error.
    pub orphaned: Vec<R>,
    /// Jobs admitted by the release, with their parked Runs, to run now.
    pub admitted: Vec<(JobId, Vec<R>)>,
}

/// Memory plans, lanes and parked Runs of every session.
#[derive(Debug)]
pub struct AdmissionDesk<R> {
    lanes: SharedLanes,
    leases: HashMap<JobId, (Lease, MemoryPlan)>,
    parked: Parked<R>,
}

impl<R> AdmissionDesk<R> {
    /// A desk over a fresh reservation; at most `park_limit` Runs wait per job.
    pub fn new(cfg: LanesConfig, park_limit: usize) -> Result<Self, SharedError> {
        Ok(Self::with_lanes(SharedLanes::new(cfg)?, park_limit))
    }

    pub fn with_lanes(lanes: SharedLanes, park_limit: usize) -> Self {
        AdmissionDesk {
            lanes,
            leases: HashMap::new(),
            parked: Parked::new(park_limit),
        }
    }

    pub fn lanes(&self) -> &SharedLanes {
        &self.lanes
    }

    /// Plans `graph` and admits or queues `job`.
    pub fn load(&mut self, job: JobId, graph: &ValidGraph) -> Result<Loaded, LoadError> {
        let plan = compile::plan(graph)?;
        let (lease, adm) = self.lanes.admit_plan(job, &plan)?;
        let out = Loaded {
            persistent: plan.persistent,
            ephemeral: plan.ephemeral,
            placement: match &adm {
                Admission::Admitted { placement, .. } => Some(*placement),
                Admission::Queued { .. } => None,
            },
            waiting: match adm {
                Admission::Queued { reason, .. } => Some(reason),
                Admission::Admitted { .. } => None,
            },
        };
        self.leases.insert(job, (lease, plan));
        Ok(out)
    }

    /// The memory plan of a loaded job.
    pub fn plan(&self, job: JobId) -> Option<&MemoryPlan> {
        self.leases.get(&job).map(|(_, p)| p)
    }

    /// Current placement of an admitted job.
    pub fn placement(&self, job: JobId) -> Option<Placement> {
        self.leases.get(&job).and_then(|(l, _)| l.placement())
    }

    /// Lets a Run of `job` go ahead, or parks it until the job is admitted.
    /// A job the desk does not know goes ahead (it has no graph; the caller
    /// answers that).
    pub fn gate(&mut self, job: JobId, req: R) -> Gate<R> {
        if !self.leases.contains_key(&job) || self.placement(job).is_some() {
            return Gate::Go(req);
        }
        match self.parked.park(job, req) {
            Ok(()) => Gate::Parked,
            Err((full, req)) => Gate::Full(full, req),
        }
    }

    /// Frees `job`'s memory (or its place in the queue).
    pub fn close(&mut self, job: JobId) -> Closed<R> {
        let orphaned = self.parked.take(job);
        let admitted = match self.leases.remove(&job) {
            Some((lease, _)) => match lease.release() {
                Ok(r) => self.parked.admitted(&r),
                Err(_) => Vec::new(),
            },
            None => Vec::new(),
        };
        Closed { orphaned, admitted }
    }

    pub fn snapshot(&self) -> LanesSnapshot {
        self.lanes.snapshot()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Tensor, TensorType};

    fn graph(width: usize) -> ValidGraph {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", TensorType::f32([4, width]));
        let w = b.variable("w", Tensor::full([width, width], 0.5));
        let y = b.matmul(x, w);
        b.set_name(y, "y");
        validate(b.finish().unwrap().0, &GraphLimits::default()).unwrap()
    }

    #[test]
    fn runs_wait_for_admission_and_go_after_a_close() {
        let g = graph(64); // P = 16 KiB, T = 2 KiB
        let need = {
            let p = compile::plan(&g).unwrap();
            p.persistent + p.ephemeral
        };
        let mut desk = AdmissionDesk::new(LanesConfig::new(need + need / 2), 4).unwrap();
        let a = desk.load(JobId(1), &g).unwrap();
        assert!(a.placement.is_some() && a.waiting.is_none());
        assert_eq!(a.persistent, 64 * 64 * 4);
        let b = desk.load(JobId(2), &g).unwrap();
        assert!(b.placement.is_none());
        assert!(b
            .waiting
            .unwrap()
            .to_string()
            .contains("free after re-partitioning"));
        assert_eq!(desk.gate(JobId(1), "a1"), Gate::Go("a1"));
        assert_eq!(desk.gate(JobId(2), "b1"), Gate::Parked);
        assert_eq!(desk.gate(JobId(2), "b2"), Gate::Parked);
        assert_eq!(desk.snapshot().queue.len(), 1);
        let closed = desk.close(JobId(1));
        assert!(closed.orphaned.is_empty());
        assert_eq!(closed.admitted, vec![(JobId(2), vec!["b1", "b2"])]);
        assert_eq!(desk.gate(JobId(2), "b3"), Gate::Go("b3"));
        // Closing a waiting job hands back its parked Runs.
        let c = desk.load(JobId(3), &g).unwrap();
        assert!(c.waiting.is_some());
        assert_eq!(desk.gate(JobId(3), "c1"), Gate::Parked);
        let closed = desk.close(JobId(3));
        assert_eq!(closed.orphaned, vec!["c1"]);
        assert!(closed.admitted.is_empty());
    }

    #[test]
    fn too_large_is_a_typed_error() {
        let g = graph(64);
        let mut desk: AdmissionDesk<()> = AdmissionDesk::new(LanesConfig::new(4096), 4).unwrap();
        let e = desk.load(JobId(1), &g).unwrap_err();
        assert_eq!(e.kind(), "too_large");
        assert!(matches!(
            e,
            LoadError::Admit(AdmitError::TooLarge {
                available: 4096,
                ..
            })
        ));
        assert!(desk.snapshot().lanes.is_empty());
    }
}
