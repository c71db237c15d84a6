//! Gradients of max and average pooling (NCHW, floor mode).

use lanes_adaptor::Pool2dAttrs;

use super::{dims, fin, fout, R};
use crate::exec::{TensorMut, TensorRef};

/// Pooling geometry of one (x, dy) pair.
struct Geom {
    planes: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
}

fn geom(inputs: &[TensorRef<'_>], x_len: usize, dy_len: usize) -> R<Geom> {
    let (xd, yd) = (dims(inputs, 0)?, dims(inputs, 1)?);
    match (xd, yd) {
        ([n, c, h, w], [n2, c2, oh, ow]) if n == n2 && c == c2 => {
            let g = Geom {
                planes: n * c,
                h: *h,
                w: *w,
                oh: *oh,
                ow: *ow,
            };
            if g.planes * g.h * g.w != x_len || g.planes * g.oh * g.ow != dy_len {
                return Err("tensor lengths do not match their types".into());
            }
            Ok(g)
        }
        _ => Err(format!("x {xd:?} and dy {yd:?} must be NCHW of one batch")),
    }
}

/// Input rows (or columns) under output position `o`: clipped to the input.
fn window(o: usize, k: usize, s: usize, p: usize, len: usize) -> (usize, usize) {
    let start = (o * s) as isize - p as isize;
    let end = start + k as isize;
    (start.max(0) as usize, (end.max(0) as usize).min(len))
}

/// (x, dy) -> dx: each window's dy goes to its (first) maximum.
pub(super) fn max_grad(
    p: &Pool2dAttrs,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (x, dy) = (fin(inputs, 0)?, fin(inputs, 1)?);
    let g = geom(inputs, x.len(), dy.len())?;
    let dx = fout(outputs, 0)?;
    dx.fill(0.0);
    for pl in 0..g.planes {
        let xp = &x[pl * g.h * g.w..(pl + 1) * g.h * g.w];
        let dxp = &mut dx[pl * g.h * g.w..(pl + 1) * g.h * g.w];
        for oy in 0..g.oh {
            let (y0, y1) = window(oy, p.kernel[0], p.stride[0], p.padding[0], g.h);
            for ox in 0..g.ow {
                let (x0, x1) = window(ox, p.kernel[1], p.stride[1], p.padding[1], g.w);
                let mut best: Option<(usize, f32)> = None;
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let v = xp[iy * g.w + ix];
                        if best.is_none_or(|(_, b)| v > b) {
                            best = Some((iy * g.w + ix, v));
                        }
                    }
                }
                if let Some((at, _)) = best {
                    dxp[at] += dy[(pl * g.oh + oy) * g.ow + ox];
                }
            }
        }
    }
    Ok(())
}

/// (x, dy) -> dx: each window's dy spread evenly over the cells it averaged.
pub(super) fn avg_grad(
    p: &Pool2dAttrs,
    count_include_pad: bool,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (x, dy) = (fin(inputs, 0)?, fin(inputs, 1)?);
    let g = geom(inputs, x.len(), dy.len())?;
    let dx = fout(outputs, 0)?;
    dx.fill(0.0);
    for pl in 0..g.planes {
        let dxp = &mut dx[pl * g.h * g.w..(pl + 1) * g.h * g.w];
        for oy in 0..g.oh {
            let (y0, y1) = window(oy, p.kernel[0], p.stride[0], p.padding[0], g.h);
            for ox in 0..g.ow {
                let (x0, x1) = window(ox, p.kernel[1], p.stride[1], p.padding[1], g.w);
                let cells = if count_include_pad {
                    p.kernel[0] * p.kernel[1]
                } else {
                    y1.saturating_sub(y0) * x1.saturating_sub(x0)
                };
                if cells == 0 {
                    continue;
                }
                let share = dy[(pl * g.oh + oy) * g.ow + ox] / cells as f32;
                for iy in y0..y1 {
                    for v in &mut dxp[iy * g.w + x0..iy * g.w + x1] {
                        *v += share;
                    }
                }
            }
        }
    }
    Ok(())
}
