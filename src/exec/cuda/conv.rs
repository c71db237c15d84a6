//! Convolutions through cuDNN: descriptors and algorithm chosen once when a
//! program is built (cuDNN's heuristics, as PyTorch with
//! `cudnn.benchmark = False`, kept per shape and element type for the
//! process in `algos.rs`), run on raw arena addresses with the process's
//! one cuDNN handle (`handles.rs`).
//!
//! Tensors and filters in f32, fp16 or bf16 (all three of one convolution
//! of one type), always with FLOAT compute: cuDNN's FLOAT_CONFIG,
//! PSEUDO_HALF_CONFIG and PSEUDO_BFLOAT16_CONFIG, which forward, backward
//! data and backward filter all support (bf16 from sm_80).

use cudarc::cudnn::result::{self as dnn, CudnnError};
use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t,
    cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t,
    cudnnConvolutionDescriptor_t, cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t,
    cudnnConvolutionMode_t, cudnnDataType_t, cudnnFilterDescriptor_t, cudnnHandle_t,
    cudnnMathType_t, cudnnStatus_t, cudnnTensorDescriptor_t, cudnnTensorFormat_t,
};
use lanes_adaptor::Conv2dAttrs;

use super::algos;
use super::elem::Elem;

#[derive(Debug, Clone, Copy)]
pub(super) enum Algo {
    Fwd(cudnnConvolutionFwdAlgo_t),
    BwdData(cudnnConvolutionBwdDataAlgo_t),
    BwdFilter(cudnnConvolutionBwdFilterAlgo_t),
}

/// What a dimension cuDNN cannot take answers.
pub(super) fn bad_param() -> CudnnError {
    CudnnError(cudnnStatus_t::CUDNN_STATUS_BAD_PARAM)
}

fn dims4(d: &[usize]) -> Result<[i32; 4], CudnnError> {
    let v = |x: usize| i32::try_from(x).map_err(|_| bad_param());
    match d {
        &[a, b, c, e] => Ok([v(a)?, v(b)?, v(c)?, v(e)?]),
        _ => Err(bad_param()),
    }
}

/// cuDNN's type for tensors of `elem`.
fn data_type(elem: Elem) -> cudnnDataType_t {
    match elem {
        Elem::F32 => cudnnDataType_t::CUDNN_DATA_FLOAT,
        Elem::F16 => cudnnDataType_t::CUDNN_DATA_HALF,
        Elem::Bf16 => cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// One NCHW tensor descriptor, destroyed on drop.
#[derive(Debug)]
pub(super) struct TensorDesc(pub cudnnTensorDescriptor_t);

impl TensorDesc {
    pub fn nchw(dt: cudnnDataType_t, dims: &[usize]) -> Result<Self, CudnnError> {
        let dims = dims4(dims)?;
        let d = TensorDesc(dnn::create_tensor_descriptor()?);
        // SAFETY: `d.0` is a live descriptor.
        unsafe {
            dnn::set_tensor4d_descriptor(d.0, cudnnTensorFormat_t::CUDNN_TENSOR_NCHW, dt, dims)
        }?;
        Ok(d)
    }
}

impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created in `nchw`, destroyed once; nothing to do about a
        // failure while dropping.
        let _ = unsafe { dnn::destroy_tensor_descriptor(self.0) };
    }
}

/// One KCRS filter descriptor, destroyed on drop.
#[derive(Debug)]
struct FilterDesc(cudnnFilterDescriptor_t);

impl FilterDesc {
    fn kcrs(dt: cudnnDataType_t, dims: &[usize]) -> Result<Self, CudnnError> {
        let dims = dims4(dims)?;
        let d = FilterDesc(dnn::create_filter_descriptor()?);
        // SAFETY: `d.0` is a live descriptor.
        unsafe {
            dnn::set_filter4d_descriptor(d.0, dt, cudnnTensorFormat_t::CUDNN_TENSOR_NCHW, dims)
        }?;
        Ok(d)
    }
}

impl Drop for FilterDesc {
    fn drop(&mut self) {
        // SAFETY: created in `kcrs`, destroyed once.
        let _ = unsafe { dnn::destroy_filter_descriptor(self.0) };
    }
}

/// One 2-d convolution descriptor (FLOAT compute), destroyed on drop.
#[derive(Debug)]
struct ConvDesc(cudnnConvolutionDescriptor_t);

impl ConvDesc {
    fn new(a: &Conv2dAttrs, math: cudnnMathType_t) -> Result<Self, CudnnError> {
        let v = |x: usize| i32::try_from(x).map_err(|_| bad_param());
        let d = ConvDesc(dnn::create_convolution_descriptor()?);
        // SAFETY: `d.0` is a live descriptor.
        unsafe {
            dnn::set_convolution2d_descriptor(
                d.0,
                v(a.padding[0])?,
                v(a.padding[1])?,
                v(a.stride[0])?,
                v(a.stride[1])?,
                v(a.dilation[0])?,
                v(a.dilation[1])?,
                cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                cudnnDataType_t::CUDNN_DATA_FLOAT,
            )?;
            dnn::set_convolution_math_type(d.0, math)?;
            dnn::set_convolution_group_count(d.0, v(a.groups)?)?;
        }
        Ok(d)
    }
}

impl Drop for ConvDesc {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { dnn::destroy_convolution_descriptor(self.0) };
    }
}

/// The math type of a convolution in `elem`. f32: as PyTorch,
/// CUDNN_DEFAULT_MATH when TF32 is allowed, CUDNN_FMA_MATH when not.
/// fp16 and bf16: CUDNN_TENSOR_OP_MATH (tensor cores, f32 accumulation;
/// what PyTorch sets for half convolutions), whatever the TF32 switch.
fn math_type(elem: Elem, tf32: bool) -> cudnnMathType_t {
    match elem {
        Elem::F16 | Elem::Bf16 => cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        Elem::F32 if tf32 => cudnnMathType_t::CUDNN_DEFAULT_MATH,
        Elem::F32 => cudnnMathType_t::CUDNN_FMA_MATH,
    }
}

/// cuDNN's heuristics' first choice among up to `N` results written by
/// `query` (count asked, count returned, results), checked for success.
fn first_choice<P, const N: usize>(
    query: impl FnOnce(i32, *mut i32, *mut P) -> Result<(), CudnnError>,
    status: impl Fn(&P) -> cudnnStatus_t,
) -> Result<P, CudnnError> {
    let mut results: Vec<P> = Vec::with_capacity(N);
    let mut returned = 0i32;
    query(N as i32, &mut returned, results.as_mut_ptr())?;
    let returned = usize::try_from(returned).map_err(|_| bad_param())?.min(N);
    // SAFETY: cuDNN wrote `returned` (at most the `N` asked) results.
    unsafe { results.set_len(returned) };
    let first = results.into_iter().next().ok_or_else(bad_param)?;
    status(&first).result()?;
    Ok(first)
}

/// A convolution's plan: descriptors of x [N,C,H,W], w [O,C/g,kh,kw],
/// y [N,O,OH,OW] in one element type, computed in f32, the algorithm of
/// its pass and the workspace that algorithm needs.
#[derive(Debug)]
pub(super) struct ConvPlan {
    conv: ConvDesc,
    x: TensorDesc,
    w: FilterDesc,
    y: TensorDesc,
    algo: Algo,
    pub workspace_bytes: usize,
}

// SAFETY: the descriptors are plain cuDNN objects this plan alone owns and
// only reads after creation (any thread may pass a descriptor to cuDNN).
unsafe impl Send for ConvPlan {}

impl ConvPlan {
    /// The plan of `pass` with the process's cuDNN handle `h` (its
    /// heuristics and workspace sizes; nothing is launched). The shapes are
    /// the forward convolution's: x [N,C,H,W], w [O,C/g,kh,kw], y
    /// [N,O,OH,OW], in `elem`, whatever the pass.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::exec::cuda) fn new(
        h: cudnnHandle_t,
        pass: algos::Pass,
        elem: Elem,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        let dt = data_type(elem);
        let conv = ConvDesc::new(a, math_type(elem, tf32))?;
        let x_d = TensorDesc::nchw(dt, x)?;
        let w_d = FilterDesc::kcrs(dt, w)?;
        let y_d = TensorDesc::nchw(dt, y)?;
        let key = algos::Key::new(pass, elem, a, x, w, y, tf32);
        let (c, xd, wd, yd) = (conv.0, x_d.0, w_d.0, y_d.0);
        // SAFETY (each query): the handle and the four descriptors are live.
        let (algo, workspace_bytes) = algos::choose(key, || match pass {
            algos::Pass::Forward => {
                const N: usize =
                    cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize;
                let p = first_choice::<cudnnConvolutionFwdAlgoPerf_t, N>(
                    |n, r, out| unsafe {
                        dnn::get_convolution_forward_algorithm(h, xd, wd, c, yd, n, r, out)
                    },
                    |p| p.status,
                )?;
                let ws = unsafe {
                    dnn::get_convolution_forward_workspace_size(h, xd, wd, c, yd, p.algo)
                }?;
                Ok((Algo::Fwd(p.algo), ws))
            }
            algos::Pass::BackwardData => {
                const N: usize =
                    cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as usize;
                let p = first_choice::<cudnnConvolutionBwdDataAlgoPerf_t, N>(
                    |n, r, out| unsafe {
                        dnn::get_convolution_backward_data_algorithm(h, wd, yd, c, xd, n, r, out)
                    },
                    |p| p.status,
                )?;
                let ws = unsafe {
                    dnn::get_convolution_backward_data_workspace_size(h, wd, yd, c, xd, p.algo)
                }?;
                Ok((Algo::BwdData(p.algo), ws))
            }
            algos::Pass::BackwardFilter => {
                const N: usize =
                    cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT
                        as usize;
                let p = first_choice::<cudnnConvolutionBwdFilterAlgoPerf_t, N>(
                    |n, r, out| unsafe {
                        dnn::get_convolution_backward_filter_algorithm(h, xd, yd, c, wd, n, r, out)
                    },
                    |p| p.status,
                )?;
                let ws = unsafe {
                    dnn::get_convolution_backward_filter_workspace_size(h, xd, yd, c, wd, p.algo)
                }?;
                Ok((Algo::BwdFilter(p.algo), ws))
            }
        })?;
        Ok(ConvPlan {
            conv,
            x: x_d,
            w: w_d,
            y: y_d,
            algo,
            workspace_bytes,
        })
    }

    /// Runs the convolution with handle `h` (bound to the program's
    /// stream). For the forward plan `a` is x, `b` is w and `out` is y;
    /// for backward-data `a` is dy, `b` is w, `out` is dx; for
    /// backward-filter `a` is x, `b` is dy, `out` is dw.
    ///
    /// # Safety
    /// The addresses must point to live device ranges of the sizes given by
    /// the descriptors, in the plan's element type, and the workspace to at
    /// least `workspace_bytes`.
    pub unsafe fn run(
        &self,
        h: cudnnHandle_t,
        a: u64,
        b: u64,
        out: u64,
        workspace: u64,
        workspace_bytes: usize,
    ) -> Result<(), CudnnError> {
        // FLOAT compute: the scaling factors are f32 for every data type.
        let (one, zero) = (1.0f32, 0.0f32);
        let alpha = (&one as *const f32).cast();
        let beta = (&zero as *const f32).cast();
        let p = |a: u64| a as *const std::ffi::c_void;
        let m = |a: u64| a as *mut std::ffi::c_void;
        let ws = if workspace_bytes > 0 {
            m(workspace)
        } else {
            std::ptr::null_mut()
        };
        let (c, x, w, y) = (self.conv.0, self.x.0, self.w.0, self.y.0);
        // SAFETY: the caller's contract; the descriptors are live.
        unsafe {
            match self.algo {
                Algo::Fwd(algo) => dnn::convolution_forward(
                    h,
                    alpha,
                    x,
                    p(a),
                    w,
                    p(b),
                    c,
                    algo,
                    ws,
                    workspace_bytes,
                    beta,
                    y,
                    m(out),
                ),
                Algo::BwdData(algo) => dnn::convolution_backward_data(
                    h,
                    alpha,
                    w,
                    p(b),
                    y,
                    p(a),
                    c,
                    algo,
                    ws,
                    workspace_bytes,
                    beta,
                    x,
                    m(out),
                ),
                Algo::BwdFilter(algo) => dnn::convolution_backward_filter(
                    h,
                    alpha,
                    x,
                    p(a),
                    y,
                    p(b),
                    c,
                    algo,
                    ws,
                    workspace_bytes,
                    beta,
                    w,
                    m(out),
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 follows the TF32 switch as PyTorch; fp16 and bf16 always take
    /// the tensor cores.
    #[test]
    fn math_types() {
        use cudnnMathType_t::{CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH, CUDNN_TENSOR_OP_MATH};
        assert_eq!(math_type(Elem::F32, true), CUDNN_DEFAULT_MATH);
        assert_eq!(math_type(Elem::F32, false), CUDNN_FMA_MATH);
        for e in [Elem::F16, Elem::Bf16] {
            for tf32 in [true, false] {
                assert_eq!(math_type(e, tf32), CUDNN_TENSOR_OP_MATH);
            }
        }
    }
}
