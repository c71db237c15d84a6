//! Shape ops: reshape, transpose, concat, slice, broadcast. Reshape,
//! transpose, concat and slice move any dtype.

use super::{broadcast_strides, gather, prod, split};
use crate::exec::{DataMut, DataRef, ExecError, TensorMut, TensorRef};

/// Applies `f` to the typed input slices and the output slice of one dtype.
fn typed(
    inputs: &[TensorRef<'_>],
    out: &mut TensorMut<'_>,
    f32s: impl FnOnce(Vec<&[f32]>, &mut [f32]),
    i64s: impl FnOnce(Vec<&[i64]>, &mut [i64]),
) -> Result<(), ExecError> {
    match &mut out.data {
        DataMut::F32(y) => {
            let xs = inputs.iter().map(|t| t.f32s()).collect::<Result<_, _>>()?;
            f32s(xs, y);
        }
        DataMut::I64(y) => {
            let xs = inputs.iter().map(|t| t.i64s()).collect::<Result<_, _>>()?;
            i64s(xs, y);
        }
    }
    Ok(())
}

/// Reshape: the same values.
pub(super) fn copy(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    match (&inputs[0].data, &mut outputs[0].data) {
        (DataRef::F32(x), DataMut::F32(y)) => y.copy_from_slice(x),
        (DataRef::I64(x), DataMut::I64(y)) => y.copy_from_slice(x),
        (DataRef::F32(_), DataMut::I64(_)) => {
            return Err(ExecError::dtype(
                lanes_adaptor::DType::I64,
                lanes_adaptor::DType::F32,
            ))
        }
        (DataRef::I64(_), DataMut::F32(_)) => {
            return Err(ExecError::dtype(
                lanes_adaptor::DType::F32,
                lanes_adaptor::DType::I64,
            ))
        }
    }
    Ok(())
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
    )
}

/// Numpy broadcast to the output shape.
pub(super) fn broadcast_to(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let dims = outputs[0].dims().to_vec();
    let strides = broadcast_strides(inputs[0].dims(), &dims);
    gather(inputs[0].f32s()?, &dims, &strides, outputs[0].f32s()?);
    Ok(())
}
