//! Backward kernels (the `*Grad` ops) and in-place updates (optimizers,
//! batch-norm training statistics, assign, loss scaling) of the CPU backend.
//!
//! Kernels return `Err(reason)`; [`run`] wraps it into [`ExecError::Op`]
//! with the node and op names. No kernel indexes past a slice: lengths are
//! checked against the declared types first, so bad data is an error, never
//! a panic.

mod act;
mod amp;
mod conv;
mod norm;
mod optim;
mod pool;
mod select;

use lanes_adaptor::Op;

use crate::exec::{ExecError, TensorMut, TensorRef};

type R<T = ()> = Result<T, String>;

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
    let r = match op {
        Op::ReluGrad => act::relu(inputs, outputs),
        Op::HardSigmoidGrad => act::hard_sigmoid(inputs, outputs),
        Op::HardSwishGrad => act::hard_swish(inputs, outputs),
        Op::GeluGrad => act::gelu(inputs, outputs),
        Op::SigmoidGrad => act::sigmoid(inputs, outputs),
        Op::TanhGrad => act::tanh(inputs, outputs),
        Op::SoftmaxGrad { axis } => act::softmax(*axis, false, inputs, outputs),
        Op::LogSoftmaxGrad { axis } => act::softmax(*axis, true, inputs, outputs),
        Op::ReduceMaxGrad { axes, .. } => select::reduce_max(axes, inputs, outputs),
        Op::SliceGrad {
            axis,
            start,
            input_dim,
        } => select::slice(*axis, *start, *input_dim, inputs, outputs),
        Op::EmbeddingGrad { num_embeddings } => select::embedding(*num_embeddings, inputs, outputs),
        Op::CrossEntropyGrad => select::cross_entropy(inputs, outputs),
        Op::Conv2dGradInput { attrs, .. } => conv::grad_input(attrs, inputs, outputs),
        Op::Conv2dGradFilter { attrs, .. } => conv::grad_filter(attrs, inputs, outputs),
        Op::MaxPool2dGrad(p) => pool::max_grad(p, inputs, outputs),
        Op::AvgPool2dGrad {
            pool,
            count_include_pad,
        } => pool::avg_grad(pool, *count_include_pad, inputs, outputs),
        Op::BatchNormTrain { eps, momentum } => {
            norm::batch_norm_train(*eps, *momentum, inputs, inplace, outputs)
        }
        Op::BatchNormTrainGrad => norm::batch_norm_grad(inputs, outputs),
        Op::LayerNormGrad { eps } => norm::layer_norm_grad(*eps, inputs, outputs),
        Op::SgdUpdate {
            lr,
            momentum,
            weight_decay,
            nesterov,
        } => optim::sgd(*lr, *momentum, *weight_decay, *nesterov, inputs, inplace),
        Op::AdamUpdate {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        } => optim::adam(
            optim::AdamParams {
                lr: *lr,
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
                decoupled: *decoupled,
            },
            inputs,
            inplace,
        ),
        Op::Assign => optim::assign(inputs, inplace),
        Op::AmpUnscale => amp::unscale(inputs, outputs),
        Op::AmpScaleUpdate {
            growth_factor,
            backoff_factor,
            growth_interval,
        } => amp::update_scale(
            amp::Growth {
                growth_factor: *growth_factor,
                backoff_factor: *backoff_factor,
                growth_interval: *growth_interval,
            },
            inputs,
            inplace,
        ),
        _ => return None,
    };
    Some(r.map_err(|reason| ExecError::Op {
        node: node.into(),
        op: op.name(),
        reason,
    }))
}

/// The `i`th input as f32 values, checked against its declared type.
fn fin<'a>(inputs: &[TensorRef<'a>], i: usize) -> R<&'a [f32]> {
    let t = inputs.get(i).ok_or_else(|| format!("missing input {i}"))?;
    let v = t.f32s().map_err(|e| e.to_string())?;
    check_len(v.len(), t.dims(), i)?;
    Ok(v)
}

/// The `i`th input as i64 values, checked against its declared type.
fn iin<'a>(inputs: &[TensorRef<'a>], i: usize) -> R<&'a [i64]> {
    let t = inputs.get(i).ok_or_else(|| format!("missing input {i}"))?;
    let v = t.i64s().map_err(|e| e.to_string())?;
    check_len(v.len(), t.dims(), i)?;
    Ok(v)
}

fn dims<'a>(inputs: &[TensorRef<'a>], i: usize) -> R<&'a [usize]> {
    inputs
        .get(i)
        .map(|t| t.dims())
        .ok_or_else(|| format!("missing input {i}"))
}

/// The `i`th output (or in-place tensor) as writable f32 values.
fn fout<'b>(outs: &'b mut [TensorMut<'_>], i: usize) -> R<&'b mut [f32]> {
    let t = outs
        .get_mut(i)
        .ok_or_else(|| format!("missing output {i}"))?;
    let n: usize = t.dims().iter().product();
    let v = t.f32s().map_err(|e| e.to_string())?;
    check_len(v.len(), &[n], i)?;
    Ok(v)
}

/// Copies `src` into the `i`th output, whose length must match.
fn put(outs: &mut [TensorMut<'_>], i: usize, src: &[f32]) -> R {
    let dst = fout(outs, i)?;
    if dst.len() != src.len() {
        return Err(format!(
            "output {i} holds {} values, expected {}",
            dst.len(),
            src.len()
        ));
    }
    dst.copy_from_slice(src);
    Ok(())
}

fn check_len(len: usize, dims: &[usize], i: usize) -> R {
    let n: usize = dims.iter().product();
    if len == n {
        Ok(())
    } else {
        Err(format!("tensor {i} holds {len} values, its type {n}"))
    }
}

/// `(outer, len, inner)` of `dims` around `axis`.
fn split(dims: &[usize], axis: usize) -> R<(usize, usize, usize)> {
    if axis >= dims.len() {
        return Err(format!("axis {axis} out of range for rank {}", dims.len()));
    }
    Ok((
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    ))
}
