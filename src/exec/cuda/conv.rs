//! Convolutions through cuDNN: descriptors and algorithm chosen once when a
//! program is built (cuDNN's heuristics, as PyTorch with
//! `cudnn.benchmark = False`, kept per shape and element type for the
//! process in `algos.rs`), run on raw arena addresses.
//!
//! Tensors and filters in f32, fp16 or bf16 (all three of one convolution
//! of one type), always with FLOAT compute: cuDNN's FLOAT_CONFIG,
//! PSEUDO_HALF_CONFIG and PSEUDO_BFLOAT16_CONFIG, which forward, backward
//! data and backward filter all support (bf16 from sm_80).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdFilterAlgo_t, cudnnConvolutionFwdAlgo_t,
    cudnnConvolutionMode_t, cudnnDataType_t, cudnnMathType_t, cudnnTensorFormat_t,
};
use cudarc::cudnn::{
    ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, Cudnn, CudnnDataType,
    CudnnError, FilterDescriptor, TensorDescriptor,
};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use lanes_adaptor::Conv2dAttrs;

use super::algos;
use super::elem::Elem;

/// A device range given by address, for cuDNN's typed launch API.
pub(super) struct Raw<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _t: PhantomData<T>,
}

impl<T> Raw<T> {
    pub fn new(ptr: u64, len: usize, stream: &Arc<CudaStream>) -> Self {
        Raw {
            ptr,
            len,
            stream: stream.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> DeviceSlice<T> for Raw<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Raw<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Raw<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Algo {
    Fwd(cudnnConvolutionFwdAlgo_t),
    BwdData(cudnnConvolutionBwdDataAlgo_t),
    BwdFilter(cudnnConvolutionBwdFilterAlgo_t),
}

/// An element type of convolution tensors, with the scaling factors
/// (alpha 1, beta 0) in the type cuDNN takes them in for it (f32 for all
/// three: FLOAT compute).
pub(super) trait ConvElem: CudnnDataType + Copy {
    const ONE: Self;
    const ZERO: Self;
}

impl ConvElem for f32 {
    const ONE: Self = 1.0;
    const ZERO: Self = 0.0;
}

/// fp16 tensors to cuDNN (`CUDNN_DATA_HALF`). cuDNN reads and writes the
/// device memory itself; a value of this type is only a scaling factor,
/// which cuDNN takes as an f32 for 16-bit data.
#[derive(Debug, Clone, Copy)]
pub(super) struct F16(f32);

/// bf16 tensors to cuDNN (`CUDNN_DATA_BFLOAT16`); as [`F16`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Bf16(f32);

impl CudnnDataType for F16 {
    const DATA_TYPE: cudnnDataType_t = cudnnDataType_t::CUDNN_DATA_HALF;
    type Scalar = f32;
    fn into_scaling_parameter(self) -> f32 {
        self.0
    }
}

impl CudnnDataType for Bf16 {
    const DATA_TYPE: cudnnDataType_t = cudnnDataType_t::CUDNN_DATA_BFLOAT16;
    type Scalar = f32;
    fn into_scaling_parameter(self) -> f32 {
        self.0
    }
}

impl ConvElem for F16 {
    const ONE: Self = F16(1.0);
    const ZERO: Self = F16(0.0);
}

impl ConvElem for Bf16 {
    const ONE: Self = Bf16(1.0);
    const ZERO: Self = Bf16(0.0);
}

/// Descriptors of one convolution: x [N,C,H,W], w [O,C/g,kh,kw], y [N,O,OH,OW]
/// in `X`, computed in f32.
#[derive(Debug)]
pub(super) struct Typed<X: ConvElem> {
    conv: ConvDescriptor<f32>,
    x: TensorDescriptor<X>,
    w: FilterDescriptor<X>,
    y: TensorDescriptor<X>,
    algo: Algo,
}

/// One convolution's plan, in its element type.
#[derive(Debug)]
pub(super) enum Plan {
    F32(Typed<f32>),
    F16(Typed<F16>),
    Bf16(Typed<Bf16>),
}

/// A convolution's plan and the workspace its algorithm needs.
#[derive(Debug)]
pub(super) struct ConvPlan {
    pub plan: Plan,
    pub workspace_bytes: usize,
}

fn dims4(d: &[usize]) -> Result<[i32; 4], CudnnError> {
    match d {
        &[a, b, c, e] => Ok([a as i32, b as i32, c as i32, e as i32]),
        _ => Err(CudnnError(
            cudarc::cudnn::sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM,
        )),
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

impl<X: ConvElem> Typed<X> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        key: algos::Key,
        cudnn: &Arc<Cudnn>,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        math: cudnnMathType_t,
    ) -> Result<(Self, usize), CudnnError> {
        let nchw = cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        // f32: the compute type (CUDNN_DATA_FLOAT) for every element type.
        let mut conv = cudnn.create_conv2d::<f32>(
            [a.padding[0] as i32, a.padding[1] as i32],
            [a.stride[0] as i32, a.stride[1] as i32],
            [a.dilation[0] as i32, a.dilation[1] as i32],
            cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        )?;
        conv.set_math_type(math)?;
        conv.set_group_count(a.groups as i32)?;
        let x = cudnn.create_4d_tensor::<X>(nchw, dims4(x)?)?;
        let w = cudnn.create_4d_filter::<X>(nchw, dims4(w)?)?;
        let y = cudnn.create_4d_tensor::<X>(nchw, dims4(y)?)?;
        let (algo, workspace_bytes) = algos::choose(key.clone(), || match key.pass() {
            algos::Pass::Forward => {
                let op = ConvForward {
                    conv: &conv,
                    x: &x,
                    w: &w,
                    y: &y,
                };
                let algo = op.pick_algorithm()?;
                Ok((Algo::Fwd(algo), op.get_workspace_size(algo)?))
            }
            algos::Pass::BackwardData => {
                let op = ConvBackwardData {
                    conv: &conv,
                    dx: &x,
                    w: &w,
                    dy: &y,
                };
                let algo = op.pick_algorithm()?;
                Ok((Algo::BwdData(algo), op.get_workspace_size(algo)?))
            }
            algos::Pass::BackwardFilter => {
                let op = ConvBackwardFilter {
                    conv: &conv,
                    x: &x,
                    dw: &w,
                    dy: &y,
                };
                let algo = op.pick_algorithm()?;
                Ok((Algo::BwdFilter(algo), op.get_workspace_size(algo)?))
            }
        })?;
        Ok((
            Typed {
                conv,
                x,
                w,
                y,
                algo,
            },
            workspace_bytes,
        ))
    }

    /// See [`ConvPlan::run`].
    ///
    /// # Safety
    /// As [`ConvPlan::run`].
    unsafe fn run(
        &self,
        stream: &Arc<CudaStream>,
        a: (u64, usize),
        b: (u64, usize),
        out: (u64, usize),
        workspace: u64,
        workspace_bytes: usize,
    ) -> Result<(), CudnnError> {
        let ra = Raw::<X>::new(a.0, a.1, stream);
        let rb = Raw::<X>::new(b.0, b.1, stream);
        let mut ro = Raw::<X>::new(out.0, out.1, stream);
        let mut ws = Raw::<u8>::new(workspace, workspace_bytes, stream);
        let ws = if workspace_bytes > 0 {
            Some(&mut ws)
        } else {
            None
        };
        let scale = (X::ONE, X::ZERO);
        match self.algo {
            Algo::Fwd(algo) => {
                let op = ConvForward {
                    conv: &self.conv,
                    x: &self.x,
                    w: &self.w,
                    y: &self.y,
                };
                // SAFETY: forwarded to the caller.
                unsafe { op.launch(algo, ws, scale, &ra, &rb, &mut ro) }
            }
            Algo::BwdData(algo) => {
                let op = ConvBackwardData {
                    conv: &self.conv,
                    dx: &self.x,
                    w: &self.w,
                    dy: &self.y,
                };
                // SAFETY: forwarded to the caller.
                unsafe { op.launch(algo, ws, scale, &mut ro, &rb, &ra) }
            }
            Algo::BwdFilter(algo) => {
                let op = ConvBackwardFilter {
                    conv: &self.conv,
                    x: &self.x,
                    dw: &self.w,
                    dy: &self.y,
                };
                // SAFETY: forwarded to the caller.
                unsafe { op.launch(algo, ws, scale, &ra, &mut ro, &rb) }
            }
        }
    }
}

impl ConvPlan {
    #[allow(clippy::too_many_arguments)]
    fn new(
        pass: algos::Pass,
        elem: Elem,
        cudnn: &Arc<Cudnn>,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        let math = math_type(elem, tf32);
        let key = algos::Key::new(pass, elem, a, x, w, y, tf32);
        let (plan, workspace_bytes) = match elem {
            Elem::F32 => {
                let (t, ws) = Typed::<f32>::new(key, cudnn, a, x, w, y, math)?;
                (Plan::F32(t), ws)
            }
            Elem::F16 => {
                let (t, ws) = Typed::<F16>::new(key, cudnn, a, x, w, y, math)?;
                (Plan::F16(t), ws)
            }
            Elem::Bf16 => {
                let (t, ws) = Typed::<Bf16>::new(key, cudnn, a, x, w, y, math)?;
                (Plan::Bf16(t), ws)
            }
        };
        Ok(ConvPlan {
            plan,
            workspace_bytes,
        })
    }

    /// y = conv(x, w), x [N,C,H,W], w [O,C/g,kh,kw], y [N,O,OH,OW] in `elem`.
    pub fn forward(
        cudnn: &Arc<Cudnn>,
        elem: Elem,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        Self::new(algos::Pass::Forward, elem, cudnn, a, x, w, y, tf32)
    }

    /// dx from dy and w (shapes as [`ConvPlan::forward`]'s x, w, y).
    pub fn backward_data(
        cudnn: &Arc<Cudnn>,
        elem: Elem,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        Self::new(algos::Pass::BackwardData, elem, cudnn, a, x, w, y, tf32)
    }

    /// dw from x and dy (shapes as [`ConvPlan::forward`]'s x, w, y).
    pub fn backward_filter(
        cudnn: &Arc<Cudnn>,
        elem: Elem,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        Self::new(algos::Pass::BackwardFilter, elem, cudnn, a, x, w, y, tf32)
    }

    /// Runs the convolution. For the forward plan `a` is x, `b` is w and
    /// `out` is y; for backward-data `a` is dy, `b` is w, `out` is dx; for
    /// backward-filter `a` is x, `b` is dy, `out` is dw. Lengths are in
    /// elements of the plan's type.
    ///
    /// # Safety
    /// The addresses must point to live device ranges of the sizes given by
    /// the descriptors, in the plan's element type, and the workspace to at
    /// least `workspace_bytes`.
    pub unsafe fn run(
        &self,
        stream: &Arc<CudaStream>,
        a: (u64, usize),
        b: (u64, usize),
        out: (u64, usize),
        workspace: u64,
        workspace_bytes: usize,
    ) -> Result<(), CudnnError> {
        // SAFETY: forwarded to the caller.
        unsafe {
            match &self.plan {
                Plan::F32(t) => t.run(stream, a, b, out, workspace, workspace_bytes),
                Plan::F16(t) => t.run(stream, a, b, out, workspace, workspace_bytes),
                Plan::Bf16(t) => t.run(stream, a, b, out, workspace, workspace_bytes),
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
