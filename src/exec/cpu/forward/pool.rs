//! Pooling on NCHW tensors: max, average (with or without padding in the
//! count), global average. Floor mode; padding never holds the maximum.

use lanes_adaptor::Pool2dAttrs;
use rayon::prelude::*;

use crate::exec::{ExecError, TensorMut, TensorRef};

/// Input range `start..end` covered by output `o` on one axis, clipped to 0..len.
pub(crate) fn window(o: usize, k: usize, s: usize, p: usize, len: usize) -> (usize, usize) {
    let lo = o * s;
    let start = lo.saturating_sub(p);
    let end = (lo + k).saturating_sub(p).min(len);
    (start, end.max(start))
}

fn planes(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
    f: impl Fn(&[f32], &mut [f32]) + Sync,
) -> Result<(), ExecError> {
    let d = inputs[0].dims();
    let od = outputs[0].dims().to_vec();
    let (hw, ohw) = (d[2] * d[3], od[2] * od[3]);
    let x = inputs[0].f32s()?;
    let y = outputs[0].f32s()?;
    if hw == 0 || ohw == 0 {
        return Ok(());
    }
    y.par_chunks_mut(ohw)
        .zip(x.par_chunks(hw))
        .for_each(|(yp, xp)| f(xp, yp));
    Ok(())
}

/// MaxPool2d.
pub(super) fn max_pool(
    p: &Pool2dAttrs,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let (h, w) = (inputs[0].dims()[2], inputs[0].dims()[3]);
    let (oh, ow) = (outputs[0].dims()[2], outputs[0].dims()[3]);
    planes(inputs, outputs, |x, y| {
        for oy in 0..oh {
            let (y0, y1) = window(oy, p.kernel[0], p.stride[0], p.padding[0], h);
            for ox in 0..ow {
                let (x0, x1) = window(ox, p.kernel[1], p.stride[1], p.padding[1], w);
                let mut m = f32::NEG_INFINITY;
                for iy in y0..y1 {
                    for &v in &x[iy * w + x0..iy * w + x1] {
                        if v > m || v.is_nan() {
                            m = v;
                        }
                    }
                }
                y[oy * ow + ox] = m;
            }
        }
    })
}

/// AvgPool2d; with `count_include_pad` the divisor is the full window.
pub(super) fn avg_pool(
    p: &Pool2dAttrs,
    count_include_pad: bool,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let (h, w) = (inputs[0].dims()[2], inputs[0].dims()[3]);
    let (oh, ow) = (outputs[0].dims()[2], outputs[0].dims()[3]);
    planes(inputs, outputs, |x, y| {
        for oy in 0..oh {
            let (y0, y1) = window(oy, p.kernel[0], p.stride[0], p.padding[0], h);
            for ox in 0..ow {
                let (x0, x1) = window(ox, p.kernel[1], p.stride[1], p.padding[1], w);
                let mut s = 0.0f32;
                for iy in y0..y1 {
                    s += x[iy * w + x0..iy * w + x1].iter().sum::<f32>();
                }
                let count = if count_include_pad {
                    p.kernel[0] * p.kernel[1]
                } else {
                    (y1 - y0) * (x1 - x0)
                };
                y[oy * ow + ox] = if count == 0 { 0.0 } else { s / count as f32 };
            }
        }
    })
}

/// GlobalAvgPool: [N, C, H, W] -> [N, C].
pub(super) fn global_avg(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let d = inputs[0].dims();
    let hw = d[2] * d[3];
    let x = inputs[0].f32s()?;
    let y = outputs[0].f32s()?;
    if hw == 0 {
        y.fill(f32::NAN);
        return Ok(());
    }
    for (v, plane) in y.iter_mut().zip(x.chunks(hw)) {
        *v = plane.iter().sum::<f32>() / hw as f32;
    }
    Ok(())
}
