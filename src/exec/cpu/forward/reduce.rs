//! Reductions: sum, mean and max over axes, and SumTo (the adjoint of
//! broadcasting).

use super::{broadcast_strides, prod, walk};
use crate::exec::{ExecError, TensorMut, TensorRef};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Sum,
    Mean,
    Max,
}

/// Strides into the kept-dims reduced tensor, 0 on the reduced axes.
fn reduced_strides(dims: &[usize], axes: &[usize]) -> Vec<usize> {
    let kept: Vec<usize> = dims
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let mut strides = vec![0; dims.len()];
    let mut s = 1;
    for i in (0..dims.len()).rev() {
        if !axes.contains(&i) {
            strides[i] = s;
        }
        s *= kept[i];
    }
    strides
}

/// ReduceSum / ReduceMean / ReduceMax over `axes` (output layout is the
/// same with or without kept dims).
pub(super) fn reduce(
    kind: Kind,
    axes: &[usize],
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let dims = inputs[0].dims();
    let x = inputs[0].f32s()?;
    let y = outputs[0].f32s()?;
    let strides = reduced_strides(dims, axes);
    match kind {
        Kind::Max => {
            y.fill(f32::NEG_INFINITY);
            walk(dims, &strides, |l, o| {
                // NaN propagates, as in PyTorch.
                if x[l] > y[o] || x[l].is_nan() {
                    y[o] = x[l];
                }
            });
        }
        Kind::Sum | Kind::Mean => {
            y.fill(0.0);
            walk(dims, &strides, |l, o| y[o] += x[l]);
            if kind == Kind::Mean {
                let count: usize = axes.iter().map(|&a| dims[a]).product();
                let inv = 1.0 / count as f32;
                y.iter_mut().for_each(|v| *v *= inv);
            }
        }
    }
    Ok(())
}

/// Sums the input down to the output shape.
pub(super) fn sum_to(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let dims = inputs[0].dims();
    let strides = broadcast_strides(outputs[0].dims(), dims);
    let x = inputs[0].f32s()?;
    let y = outputs[0].f32s()?;
    y.fill(0.0);
    if prod(dims) == y.len() {
        y.copy_from_slice(x);
        return Ok(());
    }
    walk(dims, &strides, |l, o| y[o] += x[l]);
    Ok(())
}
