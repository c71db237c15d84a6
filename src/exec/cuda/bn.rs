//! Batch normalisation with batch statistics (training), forward, through
//! cuDNN: `cudnnBatchNormalizationForwardTraining` in spatial mode, the
//! kernels PyTorch runs for an NCHW `BatchNorm2d` in `train()`. Where a
//! channel fits on chip they read the input once (holding it across a
//! grid-wide barrier) where our kernels (`kernels/nn.cu`: plane sums, then
//! a normalising pass) read it twice: on the ResNet-50 training step 2.07
//! against 3.07 ms. The gradient stays on our kernels, which took 3.49 ms
//! where cuDNN's `cudnnBatchNormalizationBackward` took 4.19 (H100,
//! `lanes bench train --op-profile`, docs/benchmarks.md).
//!
//! The same quantities as our kernels: the batch mean and 1/sqrt(var + eps)
//! (biased variance) are saved for the gradient, the running statistics are
//! updated with the unbiased variance. No workspace, so the memory plan is
//! the same with or without cuDNN. A tensor of any rank >= 2 is viewed as
//! [N, C, inner, 1].
//!
//! cuDNN is used where it is defined exactly as our op: eps >= 1e-5 (cuDNN's
//! historical minimum) and more than one value per channel. Elsewhere, and
//! with [`CudaOptions::cudnn_batch_norm`] off (a job that yields to more
//! urgent lanes: those grid-resident kernels hold SMs that stream
//! priorities cannot take back), our kernels run.
//!
//! [`CudaOptions::cudnn_batch_norm`]: super::CudaOptions::cudnn_batch_norm

use std::collections::HashMap;

use cudarc::cudnn::result::CudnnError;
use cudarc::cudnn::sys::{cudnnBatchNormMode_t, cudnnDataType_t, cudnnHandle_t};
use lanes_adaptor::{DType, Op, ValidGraph};

use super::conv::{bad_param, TensorDesc};

/// Smallest eps handed to cuDNN (its `CUDNN_BN_MIN_EPSILON` was 1e-5; a
/// graph's f32 1e-5 counts as that).
const MIN_EPS: f32 = 1e-5;

/// The descriptors and constants of one batch-norm node run by cuDNN.
#[derive(Debug)]
pub(super) struct BnPlan {
    /// x and y: [N, C, inner, 1].
    x: TensorDesc,
    /// Scale, bias, means and variances: [1, C, 1, 1].
    per_channel: TensorDesc,
    eps: f64,
    /// The running statistics' update factor.
    momentum: f64,
}

/// `dims` viewed as (N, C, inner), when it has rank >= 2.
fn ncx(dims: &[usize]) -> Option<(usize, usize, usize)> {
    match dims {
        [n, c, rest @ ..] => Some((*n, *c, rest.iter().product())),
        _ => None,
    }
}

/// Whether cuDNN computes a `BatchNormTrain` of these attributes and input
/// dims exactly as our op.
fn forward_fits(eps: f32, dims: &[usize]) -> bool {
    eps >= MIN_EPS && ncx(dims).is_some_and(|(n, _, inner)| n * inner >= 2)
}

fn plan(dims: &[usize], eps: f32, momentum: f32) -> Result<BnPlan, CudnnError> {
    let (n, c, inner) = ncx(dims).ok_or_else(bad_param)?;
    Ok(BnPlan {
        x: TensorDesc::nchw(F32, &[n, c, inner, 1])?,
        per_channel: TensorDesc::nchw(F32, &[1, c, 1, 1])?,
        // f64::from(1e-5f32) is just below 1e-5.
        eps: f64::from(eps).max(1e-5),
        momentum: f64::from(momentum),
    })
}

/// The cuDNN plan of every batch-norm forward that cuDNN runs exactly as
/// our op, keyed by node index; empty when `on` is false.
pub(super) fn plan_batch_norms(
    graph: &ValidGraph,
    on: bool,
) -> Result<HashMap<usize, BnPlan>, (usize, CudnnError)> {
    let g = graph.graph();
    let mut plans = HashMap::new();
    if !on {
        return Ok(plans);
    }
    for &id in graph.order() {
        let node = &g.nodes[id.index()];
        let Op::BatchNormTrain { eps, momentum } = node.op else {
            continue;
        };
        let x = node
            .inputs
            .first()
            .and_then(|o| g.nodes.get(o.node.index())?.outputs.get(o.slot as usize));
        match x {
            Some(ty) if ty.dtype == DType::F32 && forward_fits(eps, ty.shape.dims()) => {
                let p = plan(ty.shape.dims(), eps, momentum).map_err(|e| (id.index(), e))?;
                plans.insert(id.index(), p);
            }
            _ => {}
        }
    }
    Ok(plans)
}

const F32: cudnnDataType_t = cudnnDataType_t::CUDNN_DATA_FLOAT;
const ONE: f32 = 1.0;
const ZERO: f32 = 0.0;

impl BnPlan {
    /// y = batch norm of x with its batch statistics; saves mean and 1/std,
    /// updates the running statistics in place.
    ///
    /// # Safety
    /// Every address is an arena range of the type the plan was made from:
    /// x and y [N, C, ...], the others [C], all f32; `h` is the process's
    /// cuDNN handle, bound to the program's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward(
        &self,
        h: cudnnHandle_t,
        x: u64,
        y: u64,
        (scale, bias): (u64, u64),
        (running_mean, running_var): (u64, u64),
        (save_mean, save_invstd): (u64, u64),
    ) -> Result<(), CudnnError> {
        let p = |a: u64| a as *const std::ffi::c_void;
        let m = |a: u64| a as *mut std::ffi::c_void;
        // SAFETY: the caller's contract; alpha and beta are host f32s as
        // cuDNN expects for float data.
        unsafe {
            cudarc::cudnn::sys::cudnnBatchNormalizationForwardTraining(
                h,
                cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL,
                (&ONE as *const f32).cast(),
                (&ZERO as *const f32).cast(),
                self.x.0,
                p(x),
                self.x.0,
                m(y),
                self.per_channel.0,
                p(scale),
                p(bias),
                self.momentum,
                m(running_mean),
                m(running_var),
                self.eps,
                m(save_mean),
                m(save_invstd),
            )
        }
        .result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_batch_norms_cudnn_takes() {
        assert!(forward_fits(1e-5, &[32, 64, 112, 112]));
        assert!(forward_fits(1e-3, &[8, 16]));
        assert!(forward_fits(1e-5, &[2, 3, 1]));
        // Below cuDNN's minimum eps, one value per channel, rank 1.
        assert!(!forward_fits(1e-6, &[32, 64, 7, 7]));
        assert!(!forward_fits(1e-5, &[1, 64, 1, 1]));
        assert!(!forward_fits(1e-5, &[1, 64]));
        assert!(!forward_fits(1e-5, &[64]));
        assert_eq!(ncx(&[2, 3, 4, 5]), Some((2, 3, 20)));
        assert_eq!(ncx(&[2, 3]), Some((2, 3, 1)));
        assert_eq!(ncx(&[3]), None);
    }
}
