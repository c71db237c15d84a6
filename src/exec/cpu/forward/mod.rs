//! Forward kernels of the CPU backend (op families one file each).
//!
//! [`run`] first re-infers the output types from the input types and checks
//! every buffer's length, so the kernels can index without further checks
//! and a call with inconsistent views is an error, never a panic.

mod conv;
mod elementwise;
mod linalg;
mod loss;
mod norm;
mod pool;
mod reduce;
mod shape;

use lanes_adaptor::graph::infer::infer;
use lanes_adaptor::{DType, Op, TensorType};

use crate::exec::{DataMut, DataRef, ExecError, TensorMut, TensorRef};

/// Runs a forward op. `inputs` are all of the node's inputs in order.
pub(super) fn run(
    node: &str,
    op: &Op,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let fail = |reason: String| ExecError::Op {
        node: node.into(),
        op: op.name(),
        reason,
    };
    check_views(op, inputs, outputs).map_err(fail)?;
    match op {
        Op::Add | Op::Sub | Op::Mul | Op::Div => elementwise::binary(op, inputs, outputs),
        Op::Relu
        | Op::Gelu
        | Op::Sigmoid
        | Op::Tanh
        | Op::Exp
        | Op::Log
        | Op::Sqrt
        | Op::Scale(_)
        | Op::Erf
        | Op::IsNan
        | Op::HardSigmoid
        | Op::HardSwish
        | Op::Clip { .. } => elementwise::unary(op, inputs, outputs),
        Op::Where => elementwise::select(inputs, outputs),
        Op::Cast { .. } => elementwise::cast(inputs, outputs),
        Op::DropoutMask { p, salt, .. } => elementwise::dropout_mask(*p, *salt, inputs, outputs),
        Op::Softmax { axis } => elementwise::softmax(*axis, false, inputs, outputs),
        Op::LogSoftmax { axis } => elementwise::softmax(*axis, true, inputs, outputs),
        Op::Reshape { .. } => shape::copy(inputs, outputs),
        Op::Transpose { perm } => shape::transpose(perm, inputs, outputs),
        Op::Concat { axis } => shape::concat(*axis, inputs, outputs),
        Op::Slice { axis, start, .. } => shape::slice(*axis, *start, inputs, outputs),
        Op::BroadcastTo { .. } => shape::broadcast_to(inputs, outputs),
        Op::SumTo { .. } => reduce::sum_to(inputs, outputs),
        Op::ReduceSum { axes, .. } => reduce::reduce(reduce::Kind::Sum, axes, inputs, outputs),
        Op::ReduceMean { axes, .. } => reduce::reduce(reduce::Kind::Mean, axes, inputs, outputs),
        Op::ReduceMax { axes, .. } => reduce::reduce(reduce::Kind::Max, axes, inputs, outputs),
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => linalg::matmul(*transpose_a, *transpose_b, inputs, outputs),
        Op::Conv2d(a) => conv::conv2d(a, inputs, outputs),
        Op::MaxPool2d(p) => pool::max_pool(p, inputs, outputs),
        Op::AvgPool2d {
            pool,
            count_include_pad,
        } => pool::avg_pool(pool, *count_include_pad, inputs, outputs),
        Op::GlobalAvgPool => pool::global_avg(inputs, outputs),
        Op::BatchNorm { eps } => norm::batch_norm(*eps, inputs, outputs),
        Op::LayerNorm { eps } => norm::layer_norm(*eps, inputs, outputs),
        Op::Embedding => norm::embedding(inputs, outputs)?.map_err(fail),
        Op::CrossEntropy => loss::cross_entropy(inputs, outputs)?.map_err(fail),
        Op::MseLoss => loss::mse(inputs, outputs),
        Op::Placeholder(_) | Op::Variable(_) | Op::Constant(_) => Err(fail(
            "sources are provided by the program, not run as kernels".into(),
        )),
        _ => Err(fail("not a forward op".into())),
    }
}

/// Inputs and outputs agree with shape inference and their buffers' lengths.
fn check_views(op: &Op, inputs: &[TensorRef<'_>], outputs: &[TensorMut<'_>]) -> Result<(), String> {
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty.clone()).collect();
    let inferred = infer(op, &types)?;
    if inferred.len() != outputs.len() {
        return Err(format!(
            "op has {} outputs, {} buffers given",
            inferred.len(),
            outputs.len()
        ));
    }
    for (i, (want, got)) in inferred.iter().zip(outputs).enumerate() {
        if want != got.ty {
            return Err(format!("output {i} must be {want}, buffer is {}", got.ty));
        }
        let (dt, len) = match &got.data {
            DataMut::F32(v) => (DType::F32, v.len()),
            DataMut::I64(v) => (DType::I64, v.len()),
            DataMut::F16(v) => (DType::F16, v.len()),
            DataMut::BF16(v) => (DType::BF16, v.len()),
        };
        check_buf(got.ty, dt, len).map_err(|r| format!("output {i}: {r}"))?;
    }
    for (i, t) in inputs.iter().enumerate() {
        let (dt, len) = match t.data {
            DataRef::F32(v) => (DType::F32, v.len()),
            DataRef::I64(v) => (DType::I64, v.len()),
            DataRef::F16(v) => (DType::F16, v.len()),
            DataRef::BF16(v) => (DType::BF16, v.len()),
        };
        check_buf(t.ty, dt, len).map_err(|r| format!("input {i}: {r}"))?;
    }
    Ok(())
}

fn check_buf(ty: &TensorType, dt: DType, len: usize) -> Result<(), String> {
    if ty.dtype != dt {
        return Err(format!("type {ty} but {dt} data"));
    }
    if ty.shape.checked_numel() != Some(len) {
        return Err(format!("type {ty} but {len} elements"));
    }
    Ok(())
}

/// Product of dimensions.
pub(crate) fn prod(d: &[usize]) -> usize {
    d.iter().product()
}

/// Strides of `dims` seen from an output of rank `out.len()` it broadcasts
/// to: 0 on broadcast (added or stretched) axes.
pub(crate) fn broadcast_strides(dims: &[usize], out: &[usize]) -> Vec<usize> {
    let off = out.len() - dims.len().min(out.len());
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    for i in (0..dims.len()).rev() {
        let o = i + off;
        if o < out.len() && dims[i] == out[o] && dims[i] != 1 {
            strides[o] = s;
        }
        s *= dims[i];
    }
    strides
}

/// Calls `f(linear, offset)` for every index of `dims` in row-major order,
/// where `offset` is the index dotted with `strides`.
pub(crate) fn walk(dims: &[usize], strides: &[usize], mut f: impl FnMut(usize, usize)) {
    let total = prod(dims);
    if total == 0 {
        return;
    }
    if dims.is_empty() {
        f(0, 0);
        return;
    }
    let r = dims.len();
    let (last, ls) = (dims[r - 1], strides[r - 1]);
    let mut idx = vec![0usize; r];
    let mut base = 0usize;
    let mut lin = 0usize;
    loop {
        for j in 0..last {
            f(lin + j, base + j * ls);
        }
        lin += last;
        // Advance the outer axes.
        let mut ax = r - 1;
        loop {
            if ax == 0 {
                return;
            }
            ax -= 1;
            idx[ax] += 1;
            base += strides[ax];
            if idx[ax] < dims[ax] {
                break;
            }
            base -= strides[ax] * dims[ax];
            idx[ax] = 0;
        }
    }
}

/// Copies `src` seen through `strides` into `dst` laid out as `dims`.
pub(crate) fn gather<T: Copy>(src: &[T], dims: &[usize], strides: &[usize], dst: &mut [T]) {
    walk(dims, strides, |l, o| dst[l] = src[o]);
}

/// (outer, len, inner) split of `dims` around `axis`.
pub(crate) fn split(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (prod(&dims[..axis]), dims[axis], prod(&dims[axis + 1..]))
}
