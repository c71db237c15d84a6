//! `lanes`: the execution service. One per GPU; jobs connect through the
//! adaptor, send their graph once and one request per iteration.
//!
//! Stages: [`server`] (ZeroMQ frontend) → [`session`] (per-job state) →
//! [`compile`] (validate, plan memory: exact P and T) → [`lanes`] (admission
//! under `sum P + max T <= C`) → [`sched`] (per-lane queues and the policy) →
//! [`exec`] (CPU reference backend, CUDA backend) ↔ [`residency`].

pub mod compile;
pub mod exec;
pub mod lanes;
pub mod npy;
pub mod oip;
pub mod residency;
pub mod sched;
pub mod server;
pub mod session;
pub mod sim;
pub mod size;
