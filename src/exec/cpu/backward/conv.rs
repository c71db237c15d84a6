//! Gradients of Conv2d (NCHW input, OIHW filter, groups) by im2col / col2im
//! around ndarray's GEMM; images of a batch in parallel with rayon.

use lanes_adaptor::Conv2dAttrs;
use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};
use rayon::prelude::*;

use super::{dims, fin, fout, R};
use crate::exec::{TensorMut, TensorRef};

/// Geometry of one convolution.
#[derive(Debug, Clone, Copy)]
struct Geom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    groups: usize,
    a: Conv2dAttrs,
}

impl Geom {
    fn new(x: &[usize], w: &[usize], y: &[usize], a: &Conv2dAttrs) -> R<Self> {
        let g = match (x, w, y) {
            ([n, c, h, wd], [o, _, kh, kw], [n2, o2, oh, ow]) if n == n2 && o == o2 => Geom {
                n: *n,
                c: *c,
                h: *h,
                w: *wd,
                o: *o,
                kh: *kh,
                kw: *kw,
                oh: *oh,
                ow: *ow,
                groups: a.groups,
                a: *a,
            },
            _ => {
                return Err(format!(
                    "x {x:?}, w {w:?}, dy {y:?} do not fit a convolution"
                ))
            }
        };
        if g.groups == 0 || g.c % g.groups != 0 || g.o % g.groups != 0 {
            return Err(format!("groups {} do not divide channels", g.groups));
        }
        Ok(g)
    }
    fn cg(&self) -> usize {
        self.c / self.groups
    }
    fn og(&self) -> usize {
        self.o / self.groups
    }
    fn p(&self) -> usize {
        self.oh * self.ow
    }
    fn k(&self) -> usize {
        self.cg() * self.kh * self.kw
    }
    /// Input coordinate under output `o` and kernel tap `t` along axis `ax`.
    fn src(&self, ax: usize, o: usize, t: usize) -> Option<usize> {
        let len = if ax == 0 { self.h } else { self.w };
        let v =
            (o * self.a.stride[ax] + t * self.a.dilation[ax]).checked_sub(self.a.padding[ax])?;
        (v < len).then_some(v)
    }
    /// Visits (index into the im2col matrix, input offset within one image)
    /// for every tap that falls inside the input.
    fn taps(&self, group: usize, mut f: impl FnMut(usize, usize)) {
        let (p, hw) = (self.p(), self.h * self.w);
        for ci in 0..self.cg() {
            let plane = (group * self.cg() + ci) * hw;
            for i in 0..self.kh {
                for j in 0..self.kw {
                    let row = (ci * self.kh + i) * self.kw + j;
                    for oy in 0..self.oh {
                        let Some(iy) = self.src(0, oy, i) else {
                            continue;
                        };
                        for ox in 0..self.ow {
                            if let Some(ix) = self.src(1, ox, j) {
                                f(row * p + oy * self.ow + ox, plane + iy * self.w + ix);
                            }
                        }
                    }
                }
            }
        }
    }
}

fn view(v: &[f32], r: usize, c: usize) -> R<ArrayView2<'_, f32>> {
    ArrayView2::from_shape((r, c), v).map_err(|e| e.to_string())
}

fn view_mut(v: &mut [f32], r: usize, c: usize) -> R<ArrayViewMut2<'_, f32>> {
    ArrayViewMut2::from_shape((r, c), v).map_err(|e| e.to_string())
}

/// (dy, w) -> dx = col2im(Wᵀ · dy) per image and group.
pub(super) fn grad_input(
    a: &Conv2dAttrs,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (dy, w) = (fin(inputs, 0)?, fin(inputs, 1)?);
    let xd = outputs
        .first()
        .map(|t| t.dims().to_vec())
        .ok_or("missing output")?;
    let g = Geom::new(&xd, dims(inputs, 1)?, dims(inputs, 0)?, a)?;
    let dx = fout(outputs, 0)?;
    let img = g.c * g.h * g.w;
    if dx.len() != g.n * img || dy.len() != g.n * g.o * g.p() || w.len() != g.o * g.k() {
        return Err("tensor lengths do not match their types".into());
    }
    dx.par_chunks_mut(img.max(1))
        .enumerate()
        .try_for_each(|(ni, dxi)| -> R {
            dxi.fill(0.0);
            let mut col = vec![0.0f32; g.k() * g.p()];
            for grp in 0..g.groups {
                let wg = view(
                    &w[grp * g.og() * g.k()..(grp + 1) * g.og() * g.k()],
                    g.og(),
                    g.k(),
                )?;
                let at = (ni * g.o + grp * g.og()) * g.p();
                let dyg = view(&dy[at..at + g.og() * g.p()], g.og(), g.p())?;
                let mut cm = view_mut(&mut col, g.k(), g.p())?;
                general_mat_mul(1.0, &wg.t(), &dyg, 0.0, &mut cm);
                g.taps(grp, |ci, xi| dxi[xi] += col[ci]);
            }
            Ok(())
        })
}

/// (x, dy) -> dw = Σ over images of dy · im2col(x)ᵀ per group.
pub(super) fn grad_filter(
    a: &Conv2dAttrs,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (x, dy) = (fin(inputs, 0)?, fin(inputs, 1)?);
    let wd = outputs
        .first()
        .map(|t| t.dims().to_vec())
        .ok_or("missing output")?;
    let g = Geom::new(dims(inputs, 0)?, &wd, dims(inputs, 1)?, a)?;
    let dw = fout(outputs, 0)?;
    let img = g.c * g.h * g.w;
    if x.len() != g.n * img || dy.len() != g.n * g.o * g.p() || dw.len() != g.o * g.k() {
        return Err("tensor lengths do not match their types".into());
    }
    let total = (0..g.n)
        .into_par_iter()
        .try_fold(
            || vec![0.0f32; g.o * g.k()],
            |mut acc, ni| -> R<Vec<f32>> {
                let xi = &x[ni * img..(ni + 1) * img];
                let mut col = vec![0.0f32; g.k() * g.p()];
                for grp in 0..g.groups {
                    col.fill(0.0);
                    g.taps(grp, |ci, xo| col[ci] = xi[xo]);
                    let at = (ni * g.o + grp * g.og()) * g.p();
                    let dyg = view(&dy[at..at + g.og() * g.p()], g.og(), g.p())?;
                    let cv = view(&col, g.k(), g.p())?;
                    let span = grp * g.og() * g.k()..(grp + 1) * g.og() * g.k();
                    let mut am = view_mut(&mut acc[span], g.og(), g.k())?;
                    general_mat_mul(1.0, &dyg, &cv.t(), 1.0, &mut am);
                }
                Ok(acc)
            },
        )
        .try_reduce(
            || vec![0.0f32; g.o * g.k()],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                Ok(a)
            },
        )?;
    dw.copy_from_slice(&total);
    Ok(())
}
