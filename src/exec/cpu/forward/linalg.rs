//! Batched matrix product with broadcast batch dimensions, on ndarray's
//! `general_mat_mul` (matrixmultiply, threaded).

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};

use super::{broadcast_strides, prod, walk};
use crate::exec::{ExecError, TensorMut, TensorRef};

fn shape_err(e: ndarray::ShapeError) -> ExecError {
    ExecError::Op {
        node: String::new(),
        op: "matmul",
        reason: e.to_string(),
    }
}

/// A [rows, cols] matrix stored row-major in `v`, transposed when `t`.
fn mat(v: &[f32], rows: usize, cols: usize, t: bool) -> Result<ArrayView2<'_, f32>, ExecError> {
    let m = ArrayView2::from_shape((rows, cols), v).map_err(shape_err)?;
    Ok(if t { m.reversed_axes() } else { m })
}

/// `c = op(a) · op(b)` for one matrix each; `a` stored [ar, ac], `b` [br, bc].
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    a: &[f32],
    (ar, ac): (usize, usize),
    ta: bool,
    b: &[f32],
    (br, bc): (usize, usize),
    tb: bool,
    c: &mut [f32],
    beta: f32,
) -> Result<(), ExecError> {
    let a = mat(a, ar, ac, ta)?;
    let b = mat(b, br, bc, tb)?;
    let (m, n) = (a.nrows(), b.ncols());
    let mut cm = ArrayViewMut2::from_shape((m, n), c).map_err(shape_err)?;
    general_mat_mul(1.0, &a, &b, beta, &mut cm);
    Ok(())
}

/// MatMul { transpose_a, transpose_b }.
pub(super) fn matmul(
    ta: bool,
    tb: bool,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let (ad, bd) = (inputs[0].dims(), inputs[1].dims());
    let od = outputs[0].dims().to_vec();
    let (ar, ac) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (br, bc) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    let (m, n) = (od[od.len() - 2], od[od.len() - 1]);
    let batch = &od[..od.len() - 2];
    let a_strides = broadcast_strides(&ad[..ad.len() - 2], batch);
    let b_strides = broadcast_strides(&bd[..bd.len() - 2], batch);
    let (a, b) = (inputs[0].f32s()?, inputs[1].f32s()?);
    let y = outputs[0].f32s()?;
    let (asz, bsz, ysz) = (ar * ac, br * bc, m * n);
    if ysz == 0 {
        return Ok(());
    }
    let mut offsets = Vec::with_capacity(prod(batch));
    walk(batch, &a_strides, |_, o| offsets.push((o, 0)));
    let mut i = 0;
    walk(batch, &b_strides, |_, o| {
        offsets[i].1 = o;
        i += 1;
    });
    for (yi, (ao, bo)) in y.chunks_mut(ysz).zip(offsets) {
        gemm(
            &a[ao * asz..(ao + 1) * asz],
            (ar, ac),
            ta,
            &b[bo * bsz..(bo + 1) * bsz],
            (br, bc),
            tb,
            yi,
            0.0,
        )?;
    }
    Ok(())
}
