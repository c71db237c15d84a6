//! Backward kernels (the `*Grad` ops) and in-place updates (optimizers,
//! batch-norm training statistics, assign) of the CPU backend.

use lanes_adaptor::Op;

use crate::exec::{ExecError, TensorMut, TensorRef};

/// Runs `op` if it is a backward or in-place op; `None` for forward ops.
/// `inputs` are all of the node's inputs in order (mutated ones read-only
/// too); `inplace` are the mutated inputs in [`Op::mutated_inputs`] order.
pub(super) fn run(
    node: &str,
    op: &Op,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Option<Result<(), ExecError>> {
    let _ = (node, op, inputs, inplace, outputs);
    None
}
