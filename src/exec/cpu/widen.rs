//! Half-precision ops on the CPU reference: the inputs widened to f32
//! (exactly), the f32 kernel run, the results rounded to their dtype (to
//! nearest, ties to even), as a GPU kernel computes in f32 registers and
//! rounds once at the store (docs/precision.md). One path for every op
//! that takes half tensors, not a copy of each kernel; the copies (reshape,
//! transpose, concat, slice, broadcast) and casts move or convert the values
//! themselves and do not come here.

use lanes_adaptor::{DType, Op, TensorData, TensorType};

use crate::exec::{DataMut, ExecError, TensorMut, TensorRef};

/// Whether `op` runs through [`run`]: it touches a half tensor and is not
/// one of the ops that handle half values themselves.
pub(super) fn needed(
    op: &Op,
    inputs: &[TensorRef<'_>],
    inplace: &[TensorMut<'_>],
    outputs: &[TensorMut<'_>],
) -> bool {
    let own = matches!(
        op,
        Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::BroadcastTo { .. }
            | Op::Cast { .. }
    );
    !own && inputs
        .iter()
        .map(|t| t.ty.dtype)
        .chain(inplace.iter().chain(outputs).map(|t| t.ty.dtype))
        .any(DType::is_half)
}

/// The type `ty` with a half dtype replaced by f32.
fn wide(ty: &TensorType) -> TensorType {
    if ty.dtype.is_half() {
        TensorType::new(DType::F32, ty.shape.clone())
    } else {
        ty.clone()
    }
}

/// A half tensor's values as f32; others as they are.
fn widen_data(t: &TensorRef<'_>) -> Result<Option<TensorData>, ExecError> {
    if t.ty.dtype.is_half() {
        Ok(Some(TensorData::F32(t.to_f32_vec()?)))
    } else {
        Ok(None)
    }
}

/// Runs `op` on f32 copies of its half tensors with `kernel` (the backend's
/// op dispatch) and rounds what it wrote back into the half outputs and
/// in-place tensors.
pub(super) fn run(
    node: &str,
    op: &Op,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
    outputs: &mut [TensorMut<'_>],
    kernel: impl FnOnce(
        &[TensorRef<'_>],
        &mut [TensorMut<'_>],
        &mut [TensorMut<'_>],
    ) -> Result<(), ExecError>,
) -> Result<(), ExecError> {
    let in_types: Vec<TensorType> = inputs.iter().map(|t| wide(t.ty)).collect();
    let in_data = inputs
        .iter()
        .map(widen_data)
        .collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<TensorRef<'_>> = inputs
        .iter()
        .zip(&in_types)
        .zip(&in_data)
        .map(|((t, ty), d)| TensorRef {
            ty,
            data: d.as_ref().map_or(t.data, |d| d.into()),
        })
        .collect();
    // In-place tensors start from their values; outputs from zeros.
    let upd_types: Vec<TensorType> = inplace.iter().map(|t| wide(t.ty)).collect();
    let mut upd_data = inplace
        .iter()
        .map(|t| {
            let view = TensorRef {
                ty: t.ty,
                data: reborrow(&t.data),
            };
            widen_data(&view)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let out_types: Vec<TensorType> = outputs.iter().map(|t| wide(t.ty)).collect();
    let mut out_data: Vec<Option<TensorData>> = outputs
        .iter()
        .map(|t| {
            t.ty.dtype
                .is_half()
                .then(|| TensorData::zeros(DType::F32, t.ty.shape.numel()))
        })
        .collect();
    {
        let mut upd_views = views(inplace, &upd_types, &mut upd_data);
        let mut out_views = views(outputs, &out_types, &mut out_data);
        kernel(&refs, &mut upd_views, &mut out_views)?;
    }
    store(node, op, inplace, &upd_data)?;
    store(node, op, outputs, &out_data)
}

/// Rounds the f32 copies back into their half tensors.
fn store(
    node: &str,
    op: &Op,
    tensors: &mut [TensorMut<'_>],
    copies: &[Option<TensorData>],
) -> Result<(), ExecError> {
    for (t, d) in tensors.iter_mut().zip(copies) {
        if let Some(TensorData::F32(v)) = d {
            t.store_f32(v).map_err(|e| ExecError::Op {
                node: node.into(),
                op: op.name(),
                reason: e.to_string(),
            })?;
        }
    }
    Ok(())
}

/// Read-only view of a writable tensor's values.
fn reborrow<'a>(d: &'a DataMut<'_>) -> crate::exec::DataRef<'a> {
    use crate::exec::DataRef;
    match d {
        DataMut::F32(v) => DataRef::F32(v),
        DataMut::I64(v) => DataRef::I64(v),
        DataMut::F16(v) => DataRef::F16(v),
        DataMut::BF16(v) => DataRef::BF16(v),
    }
}

/// Writable views: the f32 copy where one was made, else the tensor itself.
fn views<'a>(
    tensors: &'a mut [TensorMut<'_>],
    types: &'a [TensorType],
    copies: &'a mut [Option<TensorData>],
) -> Vec<TensorMut<'a>> {
    tensors
        .iter_mut()
        .zip(types)
        .zip(copies.iter_mut())
        .map(|((t, ty), c)| TensorMut {
            ty,
            data: match c {
                Some(d) => d.into(),
                None => reborrow_mut(&mut t.data),
            },
        })
        .collect()
}

fn reborrow_mut<'a>(d: &'a mut DataMut<'_>) -> DataMut<'a> {
    match d {
        DataMut::F32(v) => DataMut::F32(v),
        DataMut::I64(v) => DataMut::I64(v),
        DataMut::F16(v) => DataMut::F16(v),
        DataMut::BF16(v) => DataMut::BF16(v),
    }
}
