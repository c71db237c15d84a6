//! Matrix products through cuBLAS on the row-major operands.

use cudarc::cublas::sys::cublasOperation_t;

use super::geometry::{bcast_strides, prod};
use crate::exec::cuda::program::CudaProgram;

impl CudaProgram {
    /// Row-major batched product through cuBLAS (column-major): C = A B is
    /// computed as Cᵀ = Bᵀ Aᵀ.
    pub(super) fn matmul(
        &self,
        (pa, a): (u64, &[usize]),
        (pb, b): (u64, &[usize]),
        ta: bool,
        tb: bool,
        (pc, c): (u64, &[usize]),
    ) -> Result<(), String> {
        let (ra, rb, rc) = (a.len(), b.len(), c.len());
        let (m, n) = (c[rc - 2], c[rc - 1]);
        let k = if ta { a[ra - 2] } else { a[ra - 1] };
        let (ba, bb, bc) = (&a[..ra - 2], &b[..rb - 2], &c[..rc - 2]);
        let (na, nb, nc) = (prod(ba), prod(bb), prod(bc));
        if nc == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        let f = 4u64;
        if k == 0 {
            self.fill(pc, nc * m * n, 0.0)
                .map_err(|e| format!("{e:?}"))?;
            return Ok(());
        }
        // Fold a's batch into its rows when b is shared and a is not transposed.
        if nb == 1 && !ta && na == nc {
            return self.gemm(ta, tb, na * m, n, k, pa, 0, pb, 0, pc, 0, 1);
        }
        let (sa, sb, sc) = (m * k, k * n, m * n);
        if (na == nc || na == 1) && (nb == nc || nb == 1) {
            let sa = if na == 1 { 0 } else { sa };
            let sb = if nb == 1 { 0 } else { sb };
            return self.gemm(ta, tb, m, n, k, pa, sa, pb, sb, pc, sc, nc);
        }
        // General broadcasting of batch dimensions: one product per batch.
        let sta = bcast_strides(ba, bc);
        let stb = bcast_strides(bb, bc);
        for q in 0..nc {
            let (mut rem, mut oa, mut ob) = (q, 0usize, 0usize);
            for d in (0..bc.len()).rev() {
                let idx = rem % bc[d];
                rem /= bc[d];
                oa += idx * sta[d];
                ob += idx * stb[d];
            }
            self.gemm(
                ta,
                tb,
                m,
                n,
                k,
                pa + (oa * m * k) as u64 * f,
                0,
                pb + (ob * k * n) as u64 * f,
                0,
                pc + (q * m * n) as u64 * f,
                0,
                1,
            )?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        pa: u64,
        sa: usize,
        pb: u64,
        sb: usize,
        pc: u64,
        sc: usize,
        batch: usize,
    ) -> Result<(), String> {
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let lda = if ta { m } else { k };
        let ldb = if tb { k } else { n };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the three addresses are arena ranges holding the row-major
        // operands of the inferred shapes (batch × m×k, k×n, m×n, or strides
        // 0 for a shared operand), which is exactly what these sizes,
        // leading dimensions and strides make cuBLAS read and write.
        unsafe {
            cudarc::cublas::result::sgemm_strided_batched(
                *self.blas.handle(),
                op(tb),
                op(ta),
                n as i32,
                m as i32,
                k as i32,
                &alpha,
                pb as *const f32,
                ldb as i32,
                sb as i64,
                pa as *const f32,
                lda as i32,
                sa as i64,
                &beta,
                pc as *mut f32,
                n as i32,
                sc as i64,
                batch as i32,
            )
        }
        .map_err(|e| format!("cuBLAS: {e:?}"))
    }
}
