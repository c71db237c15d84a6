//! Shape ops: reshape, transpose, concat, slice, broadcast. Reshape,
//! transpose, concat and slice move any dtype.

use super::{broadcast_strides, gather, prod, split};
use crate::exec::{DataMut, ExecError, TensorMut, TensorRef};

/// Applies `f` to the typed input slices and the output slice of one dtype.
fn typed(
    inputs: &[TensorRef<'_>],
    out: &mut TensorMut<'_>,
    f32s: impl FnOnce(Vec<&[f32]>, &mut [f32]),
    i64s: impl FnOnce(Vec<&[i64]>, &mut [i64]),
    halves: impl FnOnce(Vec<&[u16]>, &mut [u16]),
) -> Result<(), ExecError> {
    let dtype = out.ty.dtype;
    if let Some(t) = inputs.iter().find(|t| t.ty.dtype != dtype) {
        return Err(ExecError::dtype(dtype, t.ty.dtype));
    }
    match &mut out.data {
        DataMut::F32(y) => {
            let xs = inputs.iter().map(|t| t.f32s()).collect::<Result<_, _>>()?;
            f32s(xs, y);
        }
        DataMut::I64(y) => {
            let xs = inputs.iter().map(|t| t.i64s()).collect::<Result<_, _>>()?;
            i64s(xs, y);
        }
        DataMut::F16(_) | DataMut::BF16(_) => {
            let xs = inputs
                .iter()
                .map(|t| t.half_bits())
                .collect::<Result<_, _>>()?;
            halves(xs, out.half_bits()?);
        }
    }
    Ok(())
}

/// Reshape: the same values.
pub(super) fn copy(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    typed(
        inputs,
        &mut outputs[0],
        |x, y| y.copy_from_slice(x[0]),
        |x, y| y.copy_from_slice(x[0]),
        |x, y| y.copy_from_slice(x[0]),
    )
}

/// Output axis i is input axis perm[i].
pub(super) fn transpose(
    perm: &[usize],
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let in_strides = inputs[0].ty.shape.strides();
    let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    let dims = outputs[0].dims().to_vec();
    typed(
        inputs,
        &mut outputs[0],
        |x, y| gather(x[0], &dims, &strides, y),
        |x, y| gather(x[0], &dims, &strides, y),
        |x, y| gather(x[0], &dims, &strides, y),
    )
}

fn concat_into<T: Copy>(xs: &[&[T]], inner_lens: &[usize], outer: usize, y: &mut [T]) {
    let mut pos = 0;
    for o in 0..outer {
        for (x, &l) in xs.iter().zip(inner_lens) {
            y[pos..pos + l].copy_from_slice(&x[o * l..(o + 1) * l]);
            pos += l;
        }
    }
}

/// Joins the inputs along `axis`.
pub(super) fn concat(
    axis: usize,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let outer = prod(&inputs[0].dims()[..axis]);
    let lens: Vec<usize> = inputs.iter().map(|t| prod(&t.dims()[axis..])).collect();
    typed(
        inputs,
        &mut outputs[0],
        |x, y| concat_into(&x, &lens, outer, y),
        |x, y| concat_into(&x, &lens, outer, y),
        |x, y| concat_into(&x, &lens, outer, y),
    )
}

fn slice_into<T: Copy>(
    x: &[T],
    (outer, len, inner): (usize, usize, usize),
    start: usize,
    y: &mut [T],
) {
    let out_block = y.len() / outer.max(1);
    for o in 0..outer {
        let src = o * len * inner + start * inner;
        y[o * out_block..(o + 1) * out_block].copy_from_slice(&x[src..src + out_block]);
    }
}

/// The range start..end of one axis.
pub(super) fn slice(
    axis: usize,
    start: usize,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let parts = split(inputs[0].dims(), axis);
    typed(
        inputs,
        &mut outputs[0],
        |x, y| slice_into(x[0], parts, start, y),
        |x, y| slice_into(x[0], parts, start, y),
        |x, y| slice_into(x[0], parts, start, y),
    )
}

/// Numpy broadcast to the output shape.
pub(super) fn broadcast_to(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let dims = outputs[0].dims().to_vec();
    let strides = broadcast_strides(inputs[0].dims(), &dims);
    typed(
        inputs,
        &mut outputs[0],
        |x, y| gather(x[0], &dims, &strides, y),
        |x, y| gather(x[0], &dims, &strides, y),
        |x, y| gather(x[0], &dims, &strides, y),
    )
}
