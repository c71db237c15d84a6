//! In-place updates: PyTorch's SGD and Adam/AdamW, and assign.

use super::{fin, fout, R};
use crate::exec::{DataMut, DataRef, TensorMut, TensorRef};

/// (param (mut), grad, momentum_buf (mut), lr_scale, skip): PyTorch's SGD
/// with dampening 0. A zero-initialised buffer makes the first step's
/// `buf = grad`, as in PyTorch. A non-zero skip flag changes nothing.
pub(super) fn sgd(
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
) -> R {
    if skipped(inputs, 4)? {
        return Ok(());
    }
    let grad = fin(inputs, 1)?;
    let lr = lr * lr_scale(inputs, 3)?;
    let [p, buf] = inplace else {
        return Err("SGD updates a parameter and a momentum buffer".into());
    };
    let (p, buf) = (
        fout(std::slice::from_mut(p), 0)?,
        fout(std::slice::from_mut(buf), 0)?,
    );
    if p.len() != grad.len() || buf.len() != grad.len() {
        return Err("parameter, gradient and buffer lengths differ".into());
    }
    for ((w, &g), b) in p.iter_mut().zip(grad).zip(buf.iter_mut()) {
        let mut d = g + weight_decay * *w;
        if momentum != 0.0 {
            *b = momentum * *b + d;
            d = if nesterov { d + momentum * *b } else { *b };
        }
        *w -= lr * d;
    }
    Ok(())
}

/// The optional learning-rate scale at input `k` (1 when absent).
fn lr_scale(inputs: &[TensorRef<'_>], k: usize) -> Result<f32, String> {
    if inputs.len() <= k {
        return Ok(1.0);
    }
    fin(inputs, k)?
        .first()
        .copied()
        .ok_or_else(|| "the learning-rate scale is empty".to_string())
}

/// Whether the optional skip flag at input `k` is set (non-zero; a NaN
/// flag skips too).
fn skipped(inputs: &[TensorRef<'_>], k: usize) -> Result<bool, String> {
    if inputs.len() <= k {
        return Ok(false);
    }
    let flag = fin(inputs, k)?
        .first()
        .copied()
        .ok_or_else(|| "the skip flag is empty".to_string())?;
    Ok(flag != 0.0)
}

/// Hyper-parameters of one Adam step.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdamParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub decoupled: bool,
}

/// (param (mut), grad, m (mut), v (mut), step (mut), lr_scale, skip):
/// PyTorch's Adam, or AdamW when `decoupled` (weight decay applied to the
/// parameter directly). A non-zero skip flag changes nothing, the step
/// count included.
pub(super) fn adam(h: AdamParams, inputs: &[TensorRef<'_>], inplace: &mut [TensorMut<'_>]) -> R {
    if skipped(inputs, 6)? {
        return Ok(());
    }
    let grad = fin(inputs, 1)?;
    let h = AdamParams {
        lr: h.lr * lr_scale(inputs, 5)?,
        ..h
    };
    let [p, m, v, step] = inplace else {
        return Err("Adam updates a parameter, two moments and a step".into());
    };
    let step = fout(std::slice::from_mut(step), 0)?;
    let t = step.first_mut().ok_or("step is empty")?;
    *t += 1.0;
    let t = *t;
    let p = fout(std::slice::from_mut(p), 0)?;
    let m = fout(std::slice::from_mut(m), 0)?;
    let v = fout(std::slice::from_mut(v), 0)?;
    if p.len() != grad.len() || m.len() != grad.len() || v.len() != grad.len() {
        return Err("parameter, gradient and moment lengths differ".into());
    }
    let bc1 = 1.0 - h.beta1.powf(t);
    let bc2_sqrt = (1.0 - h.beta2.powf(t)).sqrt();
    let step_size = h.lr / bc1;
    for (((w, &g), m), v) in p.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = if h.decoupled {
            *w *= 1.0 - h.lr * h.weight_decay;
            g
        } else {
            g + h.weight_decay * *w
        };
        *m = h.beta1 * *m + (1.0 - h.beta1) * g;
        *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
        let denom = v.sqrt() / bc2_sqrt + h.eps;
        *w -= step_size * *m / denom;
    }
    Ok(())
}

/// (target (mut), value): copies value into the variable.
pub(super) fn assign(inputs: &[TensorRef<'_>], inplace: &mut [TensorMut<'_>]) -> R {
    let value = inputs.get(1).ok_or("assign needs a value")?;
    let target = inplace.first_mut().ok_or("assign needs a target")?;
    match (&mut target.data, value.data) {
        (DataMut::F32(t), DataRef::F32(v)) if t.len() == v.len() => t.copy_from_slice(v),
        (DataMut::I64(t), DataRef::I64(v)) if t.len() == v.len() => t.copy_from_slice(v),
        _ => return Err("value does not match the target's type".into()),
    }
    Ok(())
}
