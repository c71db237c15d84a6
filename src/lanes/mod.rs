//! Memory lanes: one reservation made at start-up, divided into lanes; jobs
//! admitted under the safety condition `sum P + max T <= C_lane`.
//!
//! - [`Reservation`]: the one block of memory (on the CPU backend an
//!   anonymous host mapping standing in for device memory, touched lazily);
//!   never grown.
//! - [`LaneManager`]: the decisions — which lane, when to open, grow,
//!   re-partition, and who waits (see its module docs for the rules).
//! - [`SharedLanes`]: the manager and the reservation behind one lock, with
//!   RAII [`Lease`]s that release their job's memory on drop and let a
//!   waiting job block until it is admitted, and [`LaneTurn`]s: a lane runs
//!   one iteration at a time, and during its turn a job uses its
//!   persistent region and its lane's arena ([`LaneTurn::memory`] →
//!   [`JobMemory`]) without the lock; layout epochs hold relocations back
//!   until the turns of the old layout have ended.
//! - [`LaneWorkers`]: one worker thread per lane (the CPU backend's
//!   execution context): in order within a lane, concurrent across lanes.
//! - [`Parked`]: Runs of jobs that wait for admission, handed back when a
//!   release admits them.
//! - [`AdmissionDesk`]: per session, what a non-blocking service loop needs:
//!   plan and admit at LoadGraph, gate each Run, release on close.
//! - [`parse_size`] / [`format_size`]: re-exported from [`crate::size`].

mod desk;
mod manager;
mod parked;
mod reservation;
mod shared;
mod snapshot;
mod turn;
mod workers;

pub use crate::size::{format_size, parse_size, ByteSize, SizeError};
pub use desk::{AdmissionDesk, Closed, Gate, LoadError, Loaded};
pub use manager::{
    Admission, AdmissionRank, AdmitError, Ask, JobId, LaneClass, LaneId, LaneManager, LanesConfig,
    Move, Placement, QueueReason, Released, MAX_CAPACITY,
};
pub use parked::{ParkFull, Parked};
pub use reservation::{Reservation, ReserveError};
pub use shared::{Lease, SharedError, SharedLanes};
pub use snapshot::{JobSnapshot, LaneSnapshot, LanesSnapshot, QueuedSnapshot};
pub use turn::{JobMemory, LaneTurn};
pub use workers::{LaneWorkers, WorkerError, LANE_QUEUE};
