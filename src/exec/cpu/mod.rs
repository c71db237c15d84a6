//! The CPU reference backend: every op, forward and backward, plus the
//! in-place optimizer updates. The CUDA backend is tested against it.
//!
//! Contract (used by the service and the tests):
//! - [`CpuProgram::new`] takes a validated graph and the initial values of
//!   its variables and checks every variable is present with its declared type.
//! - [`CpuProgram::run`] runs one iteration: feeds by placeholder name,
//!   fetches by `"node"` or `"node:slot"`, returns fetched tensors in order.
//!   In-place ops (optimizer updates, batch-norm running stats, assign)
//!   update the program's variables.
//! - [`run_op`] runs one op on typed slices: the kernel entry point.
//!
//! Memory: every op output of an iteration lives at the offset the compile
//! stage's memory plan gives it in one buffer of T bytes (the T the
//! service reports; see `arena.rs`): the program's own, or under the
//! service its lane's, shared by the lane's programs
//! ([`CpuProgram::bind_lane`]). Allocated at the first iteration, not per
//! iteration.

mod arena;
mod backward;
mod forward;
mod program;

pub use arena::lane_buffer_bytes;

use std::collections::BTreeMap;

use lanes_adaptor::{Op, Tensor, ValidGraph, VarValues};

use self::arena::Arena;
use super::{ExecError, TensorMut, TensorRef};
use crate::residency::{
    Costs, GroupPlan, Layout, PlanCache, Profile, Strategy, SwitchReport, UnitTimer,
};

/// A validated graph and its variables, ready to run iterations on the CPU.
///
/// Residency: [`CpuProgram::evict`] moves the variables out of the program
/// (the stand-in for device memory) into a host copy (the stand-in for
/// pinned host memory); the next run brings them back in groups on a copier
/// thread while the iteration already computes ([`CpuProgram::run_switching`]).
/// Eviction also gives up the ephemeral arena; the next run takes it again.
#[derive(Debug)]
pub struct CpuProgram {
    graph: ValidGraph,
    vars: VarValues,
    /// The ephemeral tensors, at their memory plan's offsets.
    arena: Box<Arena>,
    res: Box<Residency>,
}

/// Residency state of a [`CpuProgram`].
#[derive(Debug)]
struct Residency {
    layout: Layout,
    resident: bool,
    /// The host copy; current unless `dirty`.
    host: Option<VarValues>,
    /// The resident variables changed since the host copy was taken.
    dirty: bool,
    /// Iterations change variables (in-place ops).
    updates: bool,
    /// Per-unit copy seconds, measured when the host copy was taken.
    copy: Option<Vec<f64>>,
    profile: Option<Profile>,
    plans: PlanCache,
}

/// Per-group cost of the copier (a channel send and wake-up), seconds.
const GROUP_OVERHEAD: f64 = 10e-6;

impl CpuProgram {
    /// Checks that every variable of `graph` has a value of its declared
    /// type and plans its memory (the ephemeral arena, T bytes, comes at
    /// the first iteration).
    pub fn new(graph: ValidGraph, vars: VarValues) -> Result<Self, ExecError> {
        program::check_vars(&graph, &vars)?;
        let arena = Box::new(Arena::new(&graph)?);
        let layout = Layout::of(&graph);
        let updates = graph
            .graph()
            .nodes
            .iter()
            .any(|n| !n.op.mutated_inputs().is_empty());
        Ok(CpuProgram {
            graph,
            vars,
            arena,
            res: Box::new(Residency {
                layout,
                resident: true,
                host: None,
                dirty: true,
                updates,
                copy: None,
                profile: None,
                plans: PlanCache::default(),
            }),
        })
    }

    pub fn graph(&self) -> &ValidGraph {
        &self.graph
    }

    /// Runs one iteration (bringing the variables back first if evicted).
    pub fn run(
        &mut self,
        feeds: &BTreeMap<String, Tensor>,
        fetches: &[String],
    ) -> Result<Vec<Tensor>, ExecError> {
        self.run_switching(feeds, fetches, Strategy::Pipelined)
            .map(|(out, _)| out)
    }

    /// Whether the variables are in the program (not only in the host copy).
    pub fn is_resident(&self) -> bool {
        self.res.resident
    }

    /// Persistent bytes (variables and constants).
    pub fn persistent_bytes(&self) -> u64 {
        self.res.layout.bytes()
    }

    /// The unit layout (persistent tensors by first use).
    pub fn layout(&self) -> &Layout {
        &self.res.layout
    }

    /// T of the memory plan the ephemeral tensors follow, bytes (the
    /// graph's sinks kept to the end, plus any output a Run fetched).
    pub fn ephemeral_bytes(&self) -> u64 {
        self.arena.planned() as u64
    }

    /// Bytes of the program's own ephemeral buffer held now: T once it
    /// ran alone; 0 before, while evicted and while it runs in its lane's
    /// buffer.
    pub fn arena_bytes(&self) -> u64 {
        self.arena.bytes() as u64
    }

    /// Runs the next iterations in the ephemeral buffer of `lane` (a key
    /// unique in the process, shared by the lane's programs, as large as
    /// the largest T among them; `None`: the program's own buffer). The
    /// caller runs one iteration of a lane at a time.
    pub fn bind_lane(&mut self, lane: Option<u64>) {
        self.arena.bind_lane(lane);
    }

    /// The lane whose buffer the next iterations use.
    pub fn lane(&self) -> Option<u64> {
        self.arena.lane()
    }

    /// Host copy bandwidth in bytes/s, measured when the host copy was taken.
    pub fn bandwidth(&self) -> Option<f64> {
        let secs: f64 = self.res.copy.as_ref()?.iter().sum();
        (secs > 0.0).then(|| self.res.layout.bytes() as f64 / secs)
    }

    /// The per-unit compute profile of a resident iteration, once one ran.
    pub fn profile(&self) -> Option<&Profile> {
        self.res.profile.as_ref()
    }

    /// Moves the variables out to the host copy, copying them only when the
    /// host copy is stale (training state; never for an inference graph
    /// evicted twice). Returns the bytes copied.
    pub fn evict(&mut self) -> Result<u64, ExecError> {
        let res = &mut self.res;
        if !res.resident {
            return Ok(0);
        }
        let mut copied = 0;
        if res.dirty || res.host.is_none() {
            let g = self.graph.graph();
            let mut host = VarValues::new();
            let mut copy = Vec::with_capacity(res.layout.units.len());
            for unit in &res.layout.units {
                let t0 = std::time::Instant::now();
                for id in &unit.tensors {
                    let name = &g.nodes[id.index()].name;
                    if let Some(t) = self.vars.get(name) {
                        host.insert(name.clone(), t.clone());
                        copied += t.ty().bytes() as u64;
                    }
                }
                copy.push(t0.elapsed().as_secs_f64());
            }
            res.host = Some(host);
            res.copy = Some(copy);
            res.plans.invalidate();
            res.dirty = false;
        }
        self.vars.clear();
        self.arena.release();
        res.resident = false;
        let costs = self.costs();
        self.res.plans.fill(&costs);
        Ok(copied)
    }

    /// The group plan `strategy` would use now (copy costs are known once
    /// the program was evicted; compute costs once it ran resident).
    pub fn plan(&self, strategy: Strategy) -> GroupPlan {
        self.res.plans.get(strategy, || self.costs())
    }

    /// The measured costs (zeros where nothing was measured yet).
    fn costs(&self) -> Costs {
        let res = &self.res;
        let n = res.layout.units.len();
        let profile = res.profile.clone().unwrap_or_else(|| Profile::zeros(n));
        Costs {
            copy: res.copy.clone().unwrap_or_else(|| vec![0.0; n]),
            compute: profile.compute,
            prefix: profile.prefix,
            copy_overhead: GROUP_OVERHEAD,
            compute_overhead: GROUP_OVERHEAD,
        }
    }

    /// Runs one iteration; when the program is not resident, its variables
    /// come back in the groups of `strategy` while the iteration computes.
    /// The report says how (`None` when it was resident).
    pub fn run_switching(
        &mut self,
        feeds: &BTreeMap<String, Tensor>,
        fetches: &[String],
        strategy: Strategy,
    ) -> Result<(Vec<Tensor>, Option<SwitchReport>), ExecError> {
        if self.res.resident {
            let out = if self.res.profile.is_none() {
                let mut timer = UnitTimer::new(&self.res.layout);
                let out = program::run_iteration(
                    &self.graph,
                    &mut self.vars,
                    &mut self.arena,
                    feeds,
                    fetches,
                    &mut |pos, _| {
                        timer.at(pos);
                        Ok(())
                    },
                );
                if out.is_ok() {
                    self.res.profile = Some(timer.finish());
                    self.res.plans.invalidate();
                }
                out
            } else {
                program::run_iteration(
                    &self.graph,
                    &mut self.vars,
                    &mut self.arena,
                    feeds,
                    fetches,
                    &mut |_, _| Ok(()),
                )
            };
            if self.res.updates {
                self.res.dirty = true;
            }
            return out.map(|o| (o, None));
        }
        let plan = self.plan(strategy);
        let CpuProgram {
            graph,
            vars,
            arena,
            res,
        } = self;
        let host = res
            .host
            .as_ref()
            .ok_or_else(|| ExecError::MissingVariable {
                name: "(the evicted program has no host copy)".into(),
            })?;
        let g = graph.graph();
        let units = &res.layout.units;
        let groups: Vec<(usize, Vec<&str>)> = (0..plan.groups())
            .map(|k| {
                let r = plan.range(k, units.len());
                let first = units[r.start].first_use;
                let names = units[r]
                    .iter()
                    .flat_map(|u| &u.tensors)
                    .map(|id| g.nodes[id.index()].name.as_str())
                    .filter(|n| host.contains_key(*n))
                    .collect();
                (first, names)
            })
            .collect();
        let out = if groups.len() <= 1 {
            // One group: copy, then run (no copier thread to start).
            for (_, names) in &groups {
                for n in names {
                    if let Some(t) = host.get(*n) {
                        vars.insert(n.to_string(), t.clone());
                    }
                }
            }
            program::run_iteration(graph, vars, arena, feeds, fetches, &mut |_, _| Ok(()))
        } else {
            std::thread::scope(|s| {
                let (tx, rx) = crossbeam_channel::unbounded::<Vec<(String, Tensor)>>();
                let copier_groups = &groups;
                s.spawn(move || {
                    for (_, names) in copier_groups {
                        let batch = names
                            .iter()
                            .filter_map(|n| host.get(*n).map(|t| (n.to_string(), t.clone())))
                            .collect();
                        if tx.send(batch).is_err() {
                            break;
                        }
                    }
                });
                let mut next = 0;
                let mut install = |pos: usize, vars: &mut VarValues| -> Result<(), ExecError> {
                    while next < groups.len() && groups[next].0 <= pos {
                        let batch = rx.recv().map_err(|_| ExecError::MissingVariable {
                            name: "(the copier stopped early)".into(),
                        })?;
                        vars.extend(batch);
                        next += 1;
                    }
                    Ok(())
                };
                let out = program::run_iteration(graph, vars, arena, feeds, fetches, &mut install);
                // Whatever happened, the program ends resident.
                let drained = install(usize::MAX, vars);
                out.and_then(|o| drained.map(|()| o))
            })
        };
        res.resident = true;
        res.dirty = res.updates;
        let report = SwitchReport {
            strategy,
            replayed: false,
            groups: plan.groups(),
            bytes: res.layout.bytes(),
            predicted: plan.predicted,
        };
        out.map(|o| (o, Some(report)))
    }

    /// Current values of the named variables (all variables when `names` is empty).
    pub fn read_variables(&self, names: &[String]) -> Result<VarValues, ExecError> {
        let vars = match (&self.res.host, self.res.resident) {
            (Some(host), false) => host,
            _ => &self.vars,
        };
        let mut out = VarValues::new();
        for n in names {
            let t = vars
                .get(n)
                .ok_or_else(|| ExecError::MissingVariable { name: n.clone() })?;
            out.insert(n.clone(), t.clone());
        }
        if names.is_empty() {
            out = vars.clone();
        }
        Ok(out)
    }

    /// Overwrites variables; each must exist and keep its type.
    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ExecError> {
        let vars = match (&mut self.res.host, self.res.resident) {
            (Some(host), false) => host,
            _ => {
                self.res.dirty = true;
                &mut self.vars
            }
        };
        for (name, t) in &values {
            let cur = vars
                .get(name)
                .ok_or_else(|| ExecError::MissingVariable { name: name.clone() })?;
            if cur.ty() != t.ty() {
                return Err(ExecError::VariableType {
                    name: name.clone(),
                    expected: cur.ty(),
                    got: t.ty(),
                });
            }
        }
        vars.extend(values);
        Ok(())
    }
}

/// Runs one op. `inputs` are all of the node's inputs in order (for in-place
/// ops, the mutated ones too, read-only); `inplace` are the mutated inputs in
/// the order of [`Op::mutated_inputs`]; `outputs` are preallocated to their
/// inferred types.
pub fn run_op(
    node: &str,
    op: &Op,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    match backward::run(node, op, inputs, inplace, outputs) {
        Some(result) => result,
        None => forward::run(node, op, inputs, outputs),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
