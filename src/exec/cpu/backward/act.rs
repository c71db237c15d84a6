//! Gradients of the activations and of the softmax family.

use super::{dims, fin, fout, split, R};
use crate::exec::{TensorMut, TensorRef};

fn pointwise(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
    f: impl Fn(f32, f32) -> f32,
) -> R {
    let (a, dy) = (fin(inputs, 0)?, fin(inputs, 1)?);
    let dx = fout(outputs, 0)?;
    if a.len() != dy.len() || a.len() != dx.len() {
        return Err("operand lengths differ".into());
    }
    for ((d, &a), &g) in dx.iter_mut().zip(a).zip(dy) {
        *d = f(a, g);
    }
    Ok(())
}

/// (x, dy) -> dy where x > 0.
pub(super) fn relu(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    pointwise(inputs, outputs, |x, g| if x > 0.0 { g } else { 0.0 })
}

/// (x, dy) -> dy / 6 where -3 < x < 3, else 0 (PyTorch's hardsigmoid_backward).
pub(super) fn hard_sigmoid(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    pointwise(inputs, outputs, |x, g| {
        if x > -3.0 && x < 3.0 {
            g / 6.0
        } else {
            0.0
        }
    })
}

/// (x, dy) -> 0 below -3, dy · (x / 3 + 1/2) up to 3, dy above
/// (PyTorch's hardswish_backward).
pub(super) fn hard_swish(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    pointwise(inputs, outputs, |x, g| {
        if x < -3.0 {
            0.0
        } else if x <= 3.0 {
            g * (x / 3.0 + 0.5)
        } else {
            g
        }
    })
}

/// (x, dy) -> dy · (Φ(x) + x φ(x)), the exact (erf) GELU's derivative.
pub(super) fn gelu(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    const INV_SQRT2: f32 = std::f32::consts::FRAC_1_SQRT_2;
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    pointwise(inputs, outputs, |x, g| {
        let cdf = 0.5 * (1.0 + libm::erff(x * INV_SQRT2));
        let pdf = INV_SQRT_2PI * (-0.5 * x * x).exp();
        g * (cdf + x * pdf)
    })
}

/// (y, dy) -> dy · y (1 - y).
pub(super) fn sigmoid(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    pointwise(inputs, outputs, |y, g| g * y * (1.0 - y))
}

/// (y, dy) -> dy · (1 - y²).
pub(super) fn tanh(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    pointwise(inputs, outputs, |y, g| g * (1.0 - y * y))
}

/// Softmax: dx = y (dy - Σ dy·y); log-softmax: dx = dy - exp(y) Σ dy.
pub(super) fn softmax(
    axis: usize,
    log: bool,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (y, dy) = (fin(inputs, 0)?, fin(inputs, 1)?);
    let (outer, len, inner) = split(dims(inputs, 0)?, axis)?;
    let dx = fout(outputs, 0)?;
    if y.len() != dy.len() || y.len() != dx.len() {
        return Err("operand lengths differ".into());
    }
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * len + k) * inner + i;
            let s: f32 = (0..len)
                .map(|k| if log { dy[at(k)] } else { dy[at(k)] * y[at(k)] })
                .sum();
            for k in 0..len {
                let j = at(k);
                dx[j] = if log {
                    dy[j] - y[j].exp() * s
                } else {
                    y[j] * (dy[j] - s)
                };
            }
        }
    }
    Ok(())
}
