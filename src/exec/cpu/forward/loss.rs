//! Losses: mean cross-entropy of logits against labels, mean squared error.

use crate::exec::{ExecError, TensorMut, TensorRef};

/// Mean over rows of `logsumexp(row) - row[label]`. The outer result is a
/// kernel error; the inner one a bad label (mapped to the node by the caller).
pub(super) fn cross_entropy(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<Result<(), String>, ExecError> {
    let d = inputs[0].dims();
    let (n, c) = (d[0], d[1]);
    let x = inputs[0].f32s()?;
    let labels = inputs[1].i64s()?;
    let mut total = 0.0f64;
    for (i, &l) in labels.iter().enumerate() {
        let Some(l) = usize::try_from(l).ok().filter(|&l| l < c) else {
            return Ok(Err(format!("label {l} at row {i} is outside 0..{c}")));
        };
        let row = &x[i * c..(i + 1) * c];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m = if m.is_finite() { m } else { 0.0 };
        let lse = row.iter().map(|&v| (v - m).exp()).sum::<f32>().ln() + m;
        total += f64::from(lse - row[l]);
    }
    outputs[0].f32s()?[0] = if n == 0 {
        f32::NAN
    } else {
        (total / n as f64) as f32
    };
    Ok(Ok(()))
}

/// Mean of squared differences.
pub(super) fn mse(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let (p, t) = (inputs[0].f32s()?, inputs[1].f32s()?);
    let s: f64 = p
        .iter()
        .zip(t)
        .map(|(&a, &b)| f64::from((a - b) * (a - b)))
        .sum();
    outputs[0].f32s()?[0] = if p.is_empty() {
        f32::NAN
    } else {
        (s / p.len() as f64) as f32
    };
    Ok(())
}
