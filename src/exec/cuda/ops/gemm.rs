//! Matrix products through cuBLAS on the row-major operands:
//! `cublasGemmStridedBatchedEx` with the operands' element type (f32, fp16
//! or bf16; all three operands of one type) and f32 accumulation.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};

use super::geometry::{bcast_strides, prod};
use crate::exec::cuda::elem::Elem;
use crate::exec::cuda::program::CudaProgram;

/// cuBLAS's compute type for a product in `elem`: f32 accumulation always;
/// for f32 operands with the TF32 switch on (`CudaOptions::matmul_tf32`),
/// inputs rounded to TF32 on the tensor cores (`FAST_TF32`, what
/// `CUBLAS_TF32_TENSOR_OP_MATH` gave `sgemm`). 16-bit operands run on the
/// tensor cores with f32 accumulation either way.
pub(super) fn compute_type(elem: Elem, tf32: bool) -> cublasComputeType_t {
    if elem == Elem::F32 && tf32 {
        cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        cublasComputeType_t::CUBLAS_COMPUTE_32F
    }
}

impl CudaProgram {
    /// Row-major batched product through cuBLAS (column-major): C = A B is
    /// computed as Cᵀ = Bᵀ Aᵀ. Every operand holds `elem`s.
    pub(super) fn matmul(
        &self,
        elem: Elem,
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
        let f = elem.size() as u64;
        if k == 0 {
            self.fill_as(elem, pc, nc * m * n, 0.0)
                .map_err(|e| format!("{e:?}"))?;
            return Ok(());
        }
        // Fold a's batch into its rows when b is shared and a is not transposed.
        if nb == 1 && !ta && na == nc {
            return self.gemm(elem, ta, tb, na * m, n, k, pa, 0, pb, 0, pc, 0, 1);
        }
        let (sa, sb, sc) = (m * k, k * n, m * n);
        if (na == nc || na == 1) && (nb == nc || nb == 1) {
            let sa = if na == 1 { 0 } else { sa };
            let sb = if nb == 1 { 0 } else { sb };
            return self.gemm(elem, ta, tb, m, n, k, pa, sa, pb, sb, pc, sc, nc);
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
                elem,
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
        elem: Elem,
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
        // Scale factors in the compute type's scale type: f32 for both
        // compute types used here.
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ty = elem.blas();
        let compute = compute_type(elem, self.options.matmul_tf32);
        // SAFETY: the three addresses are arena ranges holding the row-major
        // operands of the inferred shapes (batch × m×k, k×n, m×n, or strides
        // 0 for a shared operand) in `elem`, the type named for all three,
        // which is exactly what these sizes, leading dimensions and strides
        // (in elements) make cuBLAS read and write; alpha and beta are f32,
        // the scale type of CUBLAS_COMPUTE_32F(_FAST_TF32).
        let gemm = |h| unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                h,
                op(tb),
                op(ta),
                n as i32,
                m as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                pb as *const std::ffi::c_void,
                ty,
                ldb as i32,
                sb as i64,
                pa as *const std::ffi::c_void,
                ty,
                lda as i32,
                sa as i64,
                (&beta as *const f32).cast(),
                pc as *mut std::ffi::c_void,
                ty,
                n as i32,
                sc as i64,
                batch as i32,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        // The process's handle, bound to this program's stream and the
        // workspace in its arena (`handles.rs`).
        crate::exec::cuda::handles::blas()
            .and_then(|b| {
                b.with(
                    &self.stream,
                    self.cublas_workspace(),
                    self.options.matmul_tf32,
                    gemm,
                )
            })
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("cuBLAS: {e:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TF32 only where asked and only for f32 operands; f32 accumulation
    /// for every element type.
    #[test]
    fn compute_types() {
        use cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
        assert_eq!(compute_type(Elem::F32, false), CUBLAS_COMPUTE_32F);
        assert_eq!(compute_type(Elem::F32, true), CUBLAS_COMPUTE_32F_FAST_TF32);
        for e in [Elem::F16, Elem::Bf16] {
            assert_eq!(compute_type(e, true), CUBLAS_COMPUTE_32F);
            assert_eq!(compute_type(e, false), CUBLAS_COMPUTE_32F);
        }
    }
}
