//! Loss scaling's ops (fp16 training, docs/precision.md): unscaling a
//! gradient while noting whether it overflowed, and `GradScaler.update`.

use super::{fin, fout, R};
use crate::exec::{TensorMut, TensorRef};

/// (grad, scale [1], found_in [1] optional) -> (grad · (1 / scale), found
/// [1]): found is 1 when found_in is non-zero or an element of grad is NaN
/// or infinite. The reciprocal is rounded once and multiplied, as on CUDA
/// (exact for the powers of two a scaler holds).
pub(super) fn unscale(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    let grad = fin(inputs, 0)?;
    let scale = one(fin(inputs, 1)?, "the loss scale")?;
    let found_in = match inputs.len() > 2 {
        true => one(fin(inputs, 2)?, "the found flag")? != 0.0,
        false => false,
    };
    let inv = 1.0f32 / scale;
    let out = fout(outputs, 0)?;
    if out.len() != grad.len() {
        return Err("the gradient and its unscaled output differ in length".into());
    }
    let mut bad = false;
    for (o, &g) in out.iter_mut().zip(grad) {
        bad |= !g.is_finite();
        *o = g * inv;
    }
    let found = fout(outputs, 1)?;
    *found.first_mut().ok_or("the found flag is empty")? = f32::from(u8::from(found_in || bad));
    Ok(())
}

/// `GradScaler.update`'s factors.
#[derive(Debug, Clone, Copy)]
pub(super) struct Growth {
    pub growth_factor: f32,
    pub backoff_factor: f32,
    pub growth_interval: u32,
}

/// (scale (mut), growth_tracker (mut), found): backs the scale off and
/// zeroes the tracker after an overflow; otherwise counts the step and
/// grows the scale (when the product is finite) every `growth_interval`
/// clean steps.
pub(super) fn update_scale(
    h: Growth,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
) -> R {
    let found = one(fin(inputs, 2)?, "the found flag")? != 0.0;
    let [scale, tracker] = inplace else {
        return Err("the scale update takes a scale and a growth tracker".into());
    };
    let scale = fout(std::slice::from_mut(scale), 0)?
        .first_mut()
        .ok_or("the loss scale is empty")?;
    let tracker = fout(std::slice::from_mut(tracker), 0)?
        .first_mut()
        .ok_or("the growth tracker is empty")?;
    if found {
        *scale *= h.backoff_factor;
        *tracker = 0.0;
        return Ok(());
    }
    let clean = *tracker + 1.0;
    if clean >= h.growth_interval as f32 {
        let grown = *scale * h.growth_factor;
        if grown.is_finite() {
            *scale = grown;
        }
        *tracker = 0.0;
    } else {
        *tracker = clean;
    }
    Ok(())
}

/// The one value of a one-element tensor.
fn one(v: &[f32], what: &str) -> Result<f32, String> {
    v.first().copied().ok_or_else(|| format!("{what} is empty"))
}
