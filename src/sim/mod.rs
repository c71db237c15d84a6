//! The trace simulator: a discrete-event simulation of lanes that drives the
//! very same [`lanes_policies::Policy`] code as the service.
//!
//! - [`trace`]: the CSV trace format (read, write, validate) and sizes;
//! - [`gen`]: synthetic traces with documented distributions;
//! - [`import`]: public cluster traces' job tables turned into traces;
//! - [`engine`]: the event-driven simulation itself ([`simulate`]);
//! - [`devices`]: several GPUs, each job placed on one ([`simulate_devices`]);
//! - [`report`]: average / p99 JCT, makespan, queueing, utilisation, plots;
//! - [`live`]: an in-process live replay (threads, sleeps, `sched::Scheduler`);
//! - [`remote`]: a replay against a running `lanes serve` with zoo models.

pub mod contention;
pub mod devices;
pub mod engine;
pub mod gen;
pub mod import;
pub mod live;
pub mod placement;
#[cfg(test)]
mod reference;
pub mod remote;
pub mod report;
pub mod trace;
mod waiting;

pub use contention::{CoRun, Contention, ContentionError, FitError};
pub use devices::{devices_table, simulate_devices, DeviceSummary, DevicesRun, DevicesSummary};
pub use engine::{
    simulate, simulate_with, JobOutcome, Segment, SimConfig, SimError, SimOptions, SimRun, Startup,
};
pub use gen::{generate, GenConfig};
pub use import::{import_jobs, read_profiles, ImportError, ImportStats, Mapping, Profile};
pub use live::{replay_live, IterationWork, LiveConfig, LiveError, SleepWork};
pub use placement::{LanePlacement, ServicePlacement};
pub use remote::{
    calibrate, measure_idle, replay_remote, service_policy, Calibration, CostCurve, IdleMeasure,
    JobTimeline, RemoteConfig, RemoteError, RemoteRun,
};
pub use report::{plot_jct_cdf, table, Summary};
pub use trace::{load_trace, read_trace, write_trace, TraceError, TraceJob};
