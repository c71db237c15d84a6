//! Forward kernels of the CPU backend (op families one file each).

use lanes_adaptor::Op;

use crate::exec::{ExecError, TensorMut, TensorRef};

/// Runs a forward op. `inputs` are all of the node's inputs in order.
pub(super) fn run(
    node: &str,
    op: &Op,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let _ = (inputs, outputs);
    Err(ExecError::Op {
        node: node.into(),
        op: op.name(),
        reason: "not implemented on the CPU backend".into(),
    })
}
