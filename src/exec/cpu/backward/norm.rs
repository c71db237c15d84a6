//! Batch-norm in its training form (batch statistics, running statistics
//! updated in place) and the gradients of batch-norm and layer-norm.

use super::{dims, fin, fout, put, R};
use crate::exec::{TensorMut, TensorRef};

/// `(N, C, S)` of an `[N, C, ...]` tensor: batch, channels, spatial size.
fn ncs(d: &[usize]) -> R<(usize, usize, usize)> {
    match d {
        [n, c, rest @ ..] => Ok((*n, *c, rest.iter().product())),
        _ => Err(format!("expected [N, C, ...], got {d:?}")),
    }
}

/// Values of channel `c`: `n` runs of `s` values.
fn channel((n, cs, s): (usize, usize, usize), c: usize) -> impl Iterator<Item = usize> {
    (0..n).flat_map(move |i| {
        let at = (i * cs + c) * s;
        at..at + s
    })
}

/// (x, gamma, beta, running_mean (mut), running_var (mut)) ->
/// (y, saved_mean, saved_invstd), PyTorch's conventions: biased variance to
/// normalise, unbiased for the running value, `running = (1-m) running + m batch`.
pub(super) fn batch_norm_train(
    eps: f32,
    momentum: f32,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (x, gamma, beta) = (fin(inputs, 0)?, fin(inputs, 1)?, fin(inputs, 2)?);
    let shape = ncs(dims(inputs, 0)?)?;
    let (n, c, s) = shape;
    let m = n * s;
    if gamma.len() != c || beta.len() != c || x.len() != n * c * s || m == 0 {
        return Err("gamma, beta or x do not match the channel count".into());
    }
    let mut mean = vec![0.0f32; c];
    let mut invstd = vec![0.0f32; c];
    let mut var_unbiased = vec![0.0f32; c];
    {
        let y = fout(outputs, 0)?;
        if y.len() != x.len() {
            return Err("y does not match x".into());
        }
        for ch in 0..c {
            let sum: f64 = channel(shape, ch).map(|i| f64::from(x[i])).sum();
            let mu = sum / m as f64;
            let sq: f64 = channel(shape, ch)
                .map(|i| (f64::from(x[i]) - mu).powi(2))
                .sum();
            let var = sq / m as f64;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            mean[ch] = mu as f32;
            invstd[ch] = inv as f32;
            var_unbiased[ch] = if m > 1 {
                (sq / (m - 1) as f64) as f32
            } else {
                var as f32
            };
            let (gm, bt) = (gamma[ch], beta[ch]);
            for i in channel(shape, ch) {
                y[i] = ((f64::from(x[i]) - mu) * inv) as f32 * gm + bt;
            }
        }
    }
    put(outputs, 1, &mean)?;
    put(outputs, 2, &invstd)?;
    for (k, batch) in [(0, &mean), (1, &var_unbiased)] {
        let run = fout(inplace, k)?;
        if run.len() != c {
            return Err("running statistics do not match the channel count".into());
        }
        for (r, b) in run.iter_mut().zip(batch.iter()) {
            *r = (1.0 - momentum) * *r + momentum * b;
        }
    }
    Ok(())
}

/// (x, gamma, saved_mean, saved_invstd, dy) -> (dx, dgamma, dbeta).
pub(super) fn batch_norm_grad(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    let (x, gamma) = (fin(inputs, 0)?, fin(inputs, 1)?);
    let (mean, invstd, dy) = (fin(inputs, 2)?, fin(inputs, 3)?, fin(inputs, 4)?);
    let shape = ncs(dims(inputs, 0)?)?;
    let (n, c, s) = shape;
    let m = (n * s) as f32;
    if [gamma.len(), mean.len(), invstd.len()] != [c; 3] || dy.len() != x.len() {
        return Err("operands do not match the channel count".into());
    }
    let mut dgamma = vec![0.0f32; c];
    let mut dbeta = vec![0.0f32; c];
    for ch in 0..c {
        for i in channel(shape, ch) {
            dbeta[ch] += dy[i];
            dgamma[ch] += dy[i] * (x[i] - mean[ch]) * invstd[ch];
        }
    }
    let dx = fout(outputs, 0)?;
    if dx.len() != x.len() {
        return Err("dx does not match x".into());
    }
    for ch in 0..c {
        let k = gamma[ch] * invstd[ch] / m;
        for i in channel(shape, ch) {
            let xhat = (x[i] - mean[ch]) * invstd[ch];
            dx[i] = k * (m * dy[i] - dbeta[ch] - xhat * dgamma[ch]);
        }
    }
    put(outputs, 1, &dgamma)?;
    put(outputs, 2, &dbeta)?;
    Ok(())
}

/// (x [..., D], gamma [D], dy) -> (dx, dgamma, dbeta); statistics recomputed.
pub(super) fn layer_norm_grad(
    eps: f32,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (x, gamma, dy) = (fin(inputs, 0)?, fin(inputs, 1)?, fin(inputs, 2)?);
    let d = gamma.len();
    if d == 0 || x.len() % d != 0 || dy.len() != x.len() {
        return Err("gamma does not match the last axis of x".into());
    }
    let mut dgamma = vec![0.0f32; d];
    let mut dbeta = vec![0.0f32; d];
    let mut xhat = vec![0.0f32; d];
    let mut g = vec![0.0f32; d];
    let dx = fout(outputs, 0)?;
    if dx.len() != x.len() {
        return Err("dx does not match x".into());
    }
    for ((xr, dyr), dxr) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
        let mu = xr.iter().sum::<f32>() / d as f32;
        let var = xr.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for k in 0..d {
            xhat[k] = (xr[k] - mu) * inv;
            g[k] = dyr[k] * gamma[k];
            dgamma[k] += dyr[k] * xhat[k];
            dbeta[k] += dyr[k];
        }
        let sg: f32 = g.iter().sum();
        let sgx: f32 = g.iter().zip(&xhat).map(|(a, b)| a * b).sum();
        for k in 0..d {
            dxr[k] = inv / d as f32 * (d as f32 * g[k] - sg - xhat[k] * sgx);
        }
    }
    put(outputs, 1, &dgamma)?;
    put(outputs, 2, &dbeta)?;
    Ok(())
}
