//! LoadGraph on a session: validation, the memory plan, admission, the
//! program's build and warm-up, each phase timed ([`LoadTimes`]), and what
//! depends only on the graph's structure taken from the load cache
//! (`compile::cache`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lanes_adaptor::wire::{JobKind, NamedTensor};
use lanes_adaptor::{Graph, GraphLimits, TensorType, VarValues};
use serde::Serialize;

use super::{admission_sizes, ty_mismatch, Loaded, Session, SessionError};
use crate::compile;
use crate::exec::gate::Gate;
use crate::exec::Program;
use crate::lanes::{Admission, JobId, LaneTurn};

/// Where one LoadGraph's time went on the service, phase by phase (the
/// wire decode is timed by the socket thread, before the session sees
/// the request).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LoadTimes {
    /// Validation and shape inference (the structure's hash and the cache
    /// lookup included; a hit skips the rest).
    pub validate: Duration,
    /// Checking the variables against the graph's declarations.
    pub variables: Duration,
    /// The memory plan that admission counts (P, T).
    pub plan: Duration,
    /// Asking the lanes for P + T (never waits: a job that does not fit
    /// is queued and built all the same).
    pub admit: Duration,
    /// The executor's program: its own memory plan, on the GPU kernels,
    /// cuDNN's algorithm choices and epilogue fusion, and the variables'
    /// upload into its persistent memory.
    pub build: Duration,
    /// An inference job's warm-up in its lane (on the GPU: the standby
    /// copy of its weights and CUDA-graph capture; nothing on the CPU).
    pub warm: Duration,
    /// The validated graph came from the load cache.
    pub cached: bool,
    /// `warm`'s parts on the GPU.
    pub standby: crate::exec::StandbyTimes,
}

impl LoadTimes {
    /// The phases' names, in order (the metrics' `phase` label).
    pub const PHASES: [&'static str; 6] =
        ["validate", "variables", "plan", "admit", "build", "warm"];

    /// Each phase's time, in [`LoadTimes::PHASES`]' order.
    pub fn phases(&self) -> [(&'static str, Duration); 6] {
        let t = [
            self.validate,
            self.variables,
            self.plan,
            self.admit,
            self.build,
            self.warm,
        ];
        let mut out = [("", Duration::ZERO); 6];
        for (i, (name, d)) in Self::PHASES.iter().zip(t).enumerate() {
            out[i] = (name, d);
        }
        out
    }

    /// The phases together.
    pub fn total(&self) -> Duration {
        self.phases().iter().map(|(_, d)| *d).sum()
    }
}

/// Times phases one after another.
struct Stopwatch(Instant);

impl Stopwatch {
    fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let d = now.duration_since(self.0);
        self.0 = now;
        d
    }
}

impl Session {
    /// Validates `graph`, checks that `variables` holds exactly its
    /// variables with their declared types, and builds the program.
    /// Returns (nodes, variables); [`Session::load_times`] says where the
    /// time went.
    pub fn load(
        &mut self,
        graph: Graph,
        variables: Vec<NamedTensor>,
        limits: &GraphLimits,
    ) -> Result<(u64, u64), SessionError> {
        if self.loaded.is_some() {
            return Err(SessionError::AlreadyLoaded { session: self.id });
        }
        let mut times = LoadTimes::default();
        let mut clock = Stopwatch(Instant::now());
        let (valid, cached) = compile::cache::validate(graph, limits)?;
        times.cached = cached;
        times.validate = clock.lap();
        let g = valid.graph();
        let placeholders: BTreeMap<String, TensorType> = g
            .placeholders()
            .map(|(_, n, t)| (n.to_string(), t.clone()))
            .collect();
        let declared: BTreeMap<String, TensorType> = g
            .variables()
            .map(|(_, n, t)| (n.to_string(), t.clone()))
            .collect();
        let mut values = VarValues::new();
        for v in variables {
            let Some(ty) = declared.get(&v.name) else {
                return Err(SessionError::Variable {
                    name: v.name,
                    reason: "the graph has no such variable".into(),
                });
            };
            if *ty != v.tensor.ty() {
                return Err(SessionError::Variable {
                    reason: ty_mismatch(ty, &v.tensor.ty()),
                    name: v.name,
                });
            }
            if values.insert(v.name.clone(), v.tensor).is_some() {
                return Err(SessionError::Variable {
                    name: v.name,
                    reason: "given twice".into(),
                });
            }
        }
        if let Some(missing) = declared.keys().find(|n| !values.contains_key(*n)) {
            return Err(SessionError::Variable {
                name: missing.clone(),
                reason: "no initial value given".into(),
            });
        }
        let nodes = g.nodes.len() as u64;
        let nvars = declared.len() as u64;
        times.variables = clock.lap();
        // Exact P and T, then admission (or the queue) before any memory is used.
        let plan = compile::cache::plan(&valid)?;
        let (p, t) = admission_sizes(self.backend, &valid, &plan)?;
        times.plan = clock.lap();
        let lease = match &self.lanes {
            Some(lanes) => Some(lanes.admit_asking(JobId(self.id.0), p, t, self.ask)?),
            None => None,
        };
        if let Some((_, Admission::Queued { reason, .. })) = &lease {
            tracing::info!(session = %self.id, %reason, "waiting for memory");
        }
        times.admit = clock.lap();
        let mut program = Program::sharing(self.backend, valid, values, self.share.clone())?;
        self.armed = self.share.urgent_gate().map(Gate::arm);
        times.build = clock.lap();
        if self.spec.kind == JobKind::Inference {
            // Admitted: warm up in the lane's memory, in the lane's turn.
            let turn = lease.as_ref().and_then(|(l, _)| l.turn());
            program.bind_lane(turn.as_ref().map(LaneTurn::key))?;
            times.standby = program.prepare_standby()?;
        }
        times.warm = clock.lap();
        self.lease = lease.map(|(l, _)| l);
        self.memory = Some((p, t));
        if let Some(cell) = &self.feed_types {
            let _ = cell.set(placeholders.clone());
        }
        self.loaded = Some(Loaded {
            program,
            placeholders,
            variables: declared,
            nodes,
        });
        self.load_times = Some(times);
        Ok((nodes, nvars))
    }

    /// Where the time of this session's LoadGraph went, once it loaded.
    pub fn load_times(&self) -> Option<LoadTimes> {
        self.load_times
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_named_in_order_and_add_up() {
        let t = LoadTimes {
            validate: Duration::from_millis(1),
            variables: Duration::from_millis(2),
            plan: Duration::from_millis(3),
            admit: Duration::from_millis(4),
            build: Duration::from_millis(5),
            warm: Duration::from_millis(6),
            cached: false,
            standby: Default::default(),
        };
        let names: Vec<&str> = t.phases().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, LoadTimes::PHASES);
        assert_eq!(t.phases()[4].1, Duration::from_millis(5));
        assert_eq!(t.total(), Duration::from_millis(21));
    }
}
