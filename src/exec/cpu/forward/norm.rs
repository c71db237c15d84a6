//! Normalisation (batch norm inference form, layer norm) and embedding lookup.

use super::prod;
use crate::exec::{ExecError, TensorMut, TensorRef};

/// y = (x - mean[c]) / sqrt(var[c] + eps) * gamma[c] + beta[c] on [N, C, ...].
pub(super) fn batch_norm(
    eps: f32,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let d = inputs[0].dims();
    let (c, inner) = (d[1], prod(&d[2..]));
    let x = inputs[0].f32s()?;
    let (gamma, beta) = (inputs[1].f32s()?, inputs[2].f32s()?);
    let (mean, var) = (inputs[3].f32s()?, inputs[4].f32s()?);
    let y = outputs[0].f32s()?;
    if inner == 0 {
        return Ok(());
    }
    for (k, (yb, xb)) in y.chunks_mut(inner).zip(x.chunks(inner)).enumerate() {
        let ch = k % c;
        let s = gamma[ch] / (var[ch] + eps).sqrt();
        let b = beta[ch] - mean[ch] * s;
        for (y, &x) in yb.iter_mut().zip(xb) {
            *y = x * s + b;
        }
    }
    Ok(())
}

/// Normalises over the last axis with the biased variance.
pub(super) fn layer_norm(
    eps: f32,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let d = *inputs[0].dims().last().unwrap_or(&1);
    let x = inputs[0].f32s()?;
    let (gamma, beta) = (inputs[1].f32s()?, inputs[2].f32s()?);
    let y = outputs[0].f32s()?;
    if d == 0 {
        return Ok(());
    }
    for (yr, xr) in y.chunks_mut(d).zip(x.chunks(d)) {
        let mean = xr.iter().sum::<f32>() / d as f32;
        let var = xr.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for (j, (y, &x)) in yr.iter_mut().zip(xr).enumerate() {
            *y = (x - mean) * inv * gamma[j] + beta[j];
        }
    }
    Ok(())
}

/// Rows of `table` [V, D] picked by `indices`. The inner result reports an
/// index outside 0..V.
pub(super) fn embedding(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<Result<(), String>, ExecError> {
    let (v, d) = (inputs[0].dims()[0], inputs[0].dims()[1]);
    let table = inputs[0].f32s()?;
    let idx = inputs[1].i64s()?;
    let y = outputs[0].f32s()?;
    for (k, &i) in idx.iter().enumerate() {
        let Some(i) = usize::try_from(i).ok().filter(|&i| i < v) else {
            return Ok(Err(format!("index {i} at position {k} is outside 0..{v}")));
        };
        y[k * d..(k + 1) * d].copy_from_slice(&table[i * d..(i + 1) * d]);
    }
    Ok(Ok(()))
}
