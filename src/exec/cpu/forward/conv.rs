//! 2-D convolution (NCHW, OIHW weights, stride, padding, dilation, groups)
//! by im2col and GEMM, images in parallel with rayon.

use lanes_adaptor::Conv2dAttrs;
use rayon::prelude::*;

use super::linalg::gemm;
use crate::exec::{ExecError, TensorMut, TensorRef};

/// Geometry of one convolution, shared with the backward kernels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geom {
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub oh: usize,
    pub ow: usize,
    pub a: Conv2dAttrs,
}

impl Geom {
    /// Input row/column read by output `o` and kernel tap `k` on axis `ax`
    /// (0 = height, 1 = width), `None` in the padding.
    fn src(&self, ax: usize, o: usize, k: usize) -> Option<usize> {
        let lim = if ax == 0 { self.h } else { self.w };
        let p =
            (o * self.a.stride[ax] + k * self.a.dilation[ax]).checked_sub(self.a.padding[ax])?;
        (p < lim).then_some(p)
    }

    /// Fills `col` [cg*kh*kw, oh*ow] from channels `c0..c0+cg` of one image `x` [C, H, W].
    pub(crate) fn im2col(&self, x: &[f32], c0: usize, cg: usize, col: &mut [f32]) {
        let p = self.oh * self.ow;
        for ci in 0..cg {
            let plane = &x[(c0 + ci) * self.h * self.w..(c0 + ci + 1) * self.h * self.w];
            for i in 0..self.kh {
                for j in 0..self.kw {
                    let row = ((ci * self.kh + i) * self.kw + j) * p;
                    for oy in 0..self.oh {
                        let dst = &mut col[row + oy * self.ow..row + (oy + 1) * self.ow];
                        match self.src(0, oy, i) {
                            None => dst.fill(0.0),
                            Some(y) => {
                                for (ox, d) in dst.iter_mut().enumerate() {
                                    *d =
                                        self.src(1, ox, j).map_or(0.0, |xx| plane[y * self.w + xx]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Conv2d: (x [N,C,H,W], w [O,C/g,kh,kw], bias [O] optional).
pub(super) fn conv2d(
    a: &Conv2dAttrs,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let xd = inputs[0].dims();
    let wd = inputs[1].dims();
    let od = outputs[0].dims().to_vec();
    let g = Geom {
        c: xd[1],
        h: xd[2],
        w: xd[3],
        kh: wd[2],
        kw: wd[3],
        oh: od[2],
        ow: od[3],
        a: *a,
    };
    let (o, groups) = (wd[0], a.groups);
    let (og, cg) = (o / groups, g.c / groups);
    let k = cg * g.kh * g.kw;
    let p = g.oh * g.ow;
    let x = inputs[0].f32s()?;
    let w = inputs[1].f32s()?;
    let bias = match inputs.get(2) {
        Some(b) => Some(b.f32s()?),
        None => None,
    };
    let y = outputs[0].f32s()?;
    let (img_in, img_out) = (g.c * g.h * g.w, o * p);
    if img_out == 0 || img_in == 0 {
        return Ok(());
    }
    y.par_chunks_mut(img_out)
        .zip(x.par_chunks(img_in))
        .try_for_each(|(yi, xi)| {
            let mut col = vec![0.0f32; k * p];
            for gi in 0..groups {
                g.im2col(xi, gi * cg, cg, &mut col);
                gemm(
                    &w[gi * og * k..(gi + 1) * og * k],
                    (og, k),
                    false,
                    &col,
                    (k, p),
                    false,
                    &mut yi[gi * og * p..(gi + 1) * og * p],
                    0.0,
                )?;
            }
            if let Some(b) = bias {
                for (plane, &bv) in yi.chunks_mut(p).zip(b) {
                    plane.iter_mut().for_each(|v| *v += bv);
                }
            }
            Ok(())
        })
}
