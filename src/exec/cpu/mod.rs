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

mod backward;
mod forward;
mod program;

use std::collections::BTreeMap;

use lanes_adaptor::{Op, Tensor, ValidGraph, VarValues};

use super::{ExecError, TensorMut, TensorRef};

/// A validated graph and its variables, ready to run iterations on the CPU.
#[derive(Debug)]
pub struct CpuProgram {
    graph: ValidGraph,
    vars: VarValues,
}

impl CpuProgram {
    /// Checks that every variable of `graph` has a value of its declared type.
    pub fn new(graph: ValidGraph, vars: VarValues) -> Result<Self, ExecError> {
        program::check_vars(&graph, &vars)?;
        Ok(CpuProgram { graph, vars })
    }

    pub fn graph(&self) -> &ValidGraph {
        &self.graph
    }

    /// Runs one iteration.
    pub fn run(
        &mut self,
        feeds: &BTreeMap<String, Tensor>,
        fetches: &[String],
    ) -> Result<Vec<Tensor>, ExecError> {
        program::run_iteration(&self.graph, &mut self.vars, feeds, fetches)
    }

    /// Current values of the named variables (all variables when `names` is empty).
    pub fn read_variables(&self, names: &[String]) -> Result<VarValues, ExecError> {
        let mut out = VarValues::new();
        for n in names {
            let t = self
                .vars
                .get(n)
                .ok_or_else(|| ExecError::MissingVariable { name: n.clone() })?;
            out.insert(n.clone(), t.clone());
        }
        if names.is_empty() {
            out = self.vars.clone();
        }
        Ok(out)
    }

    /// Overwrites variables; each must exist and keep its type.
    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ExecError> {
        for (name, t) in values {
            let cur = self
                .vars
                .get_mut(&name)
                .ok_or_else(|| ExecError::MissingVariable { name: name.clone() })?;
            if cur.ty() != t.ty() {
                return Err(ExecError::VariableType {
                    name,
                    expected: cur.ty(),
                    got: t.ty(),
                });
            }
            *cur = t;
        }
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
