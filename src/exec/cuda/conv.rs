//! Convolutions through cuDNN: descriptors and algorithm chosen once when a
//! program is built (cuDNN's heuristics, as PyTorch with
//! `cudnn.benchmark = False`, kept per shape for the process in
//! `algos.rs`), run on raw arena addresses.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdFilterAlgo_t, cudnnConvolutionFwdAlgo_t,
    cudnnConvolutionMode_t, cudnnMathType_t, cudnnTensorFormat_t,
};
use cudarc::cudnn::{
    ConvBackwardData, ConvBackwardFilter, ConvDescriptor, ConvForward, Cudnn, CudnnError,
    FilterDescriptor, TensorDescriptor,
};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use lanes_adaptor::Conv2dAttrs;

use super::algos;

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

/// Descriptors of one convolution: x [N,C,H,W], w [O,C/g,kh,kw], y [N,O,OH,OW].
#[derive(Debug)]
pub(super) struct ConvPlan {
    pub conv: ConvDescriptor<f32>,
    pub x: TensorDescriptor<f32>,
    pub w: FilterDescriptor<f32>,
    pub y: TensorDescriptor<f32>,
    pub algo: Algo,
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

/// Convolution, x, w and y descriptors.
type Descriptors = (
    ConvDescriptor<f32>,
    TensorDescriptor<f32>,
    FilterDescriptor<f32>,
    TensorDescriptor<f32>,
);

fn descriptors(
    cudnn: &Arc<Cudnn>,
    a: &Conv2dAttrs,
    x: &[usize],
    w: &[usize],
    y: &[usize],
    tf32: bool,
) -> Result<Descriptors, CudnnError> {
    let nchw = cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
    let mut conv = cudnn.create_conv2d::<f32>(
        [a.padding[0] as i32, a.padding[1] as i32],
        [a.stride[0] as i32, a.stride[1] as i32],
        [a.dilation[0] as i32, a.dilation[1] as i32],
        cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
    )?;
    // PyTorch: CUDNN_DEFAULT_MATH when TF32 is allowed, CUDNN_FMA_MATH when not.
    conv.set_math_type(if tf32 {
        cudnnMathType_t::CUDNN_DEFAULT_MATH
    } else {
        cudnnMathType_t::CUDNN_FMA_MATH
    })?;
    conv.set_group_count(a.groups as i32)?;
    let xd = cudnn.create_4d_tensor::<f32>(nchw, dims4(x)?)?;
    let wd = cudnn.create_4d_filter::<f32>(nchw, dims4(w)?)?;
    let yd = cudnn.create_4d_tensor::<f32>(nchw, dims4(y)?)?;
    Ok((conv, xd, wd, yd))
}

impl ConvPlan {
    pub fn forward(
        cudnn: &Arc<Cudnn>,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        let key = algos::Key::new(algos::Pass::Forward, a, x, w, y, tf32);
        let (conv, x, w, y) = descriptors(cudnn, a, x, w, y, tf32)?;
        let op = ConvForward {
            conv: &conv,
            x: &x,
            w: &w,
            y: &y,
        };
        let (algo, workspace_bytes) = algos::choose(key, || {
            let algo = op.pick_algorithm()?;
            Ok((Algo::Fwd(algo), op.get_workspace_size(algo)?))
        })?;
        Ok(ConvPlan {
            algo,
            workspace_bytes,
            conv,
            x,
            w,
            y,
        })
    }

    pub fn backward_data(
        cudnn: &Arc<Cudnn>,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        let key = algos::Key::new(algos::Pass::BackwardData, a, x, w, y, tf32);
        let (conv, x, w, y) = descriptors(cudnn, a, x, w, y, tf32)?;
        let op = ConvBackwardData {
            conv: &conv,
            dx: &x,
            w: &w,
            dy: &y,
        };
        let (algo, workspace_bytes) = algos::choose(key, || {
            let algo = op.pick_algorithm()?;
            Ok((Algo::BwdData(algo), op.get_workspace_size(algo)?))
        })?;
        Ok(ConvPlan {
            algo,
            workspace_bytes,
            conv,
            x,
            w,
            y,
        })
    }

    pub fn backward_filter(
        cudnn: &Arc<Cudnn>,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Result<Self, CudnnError> {
        let key = algos::Key::new(algos::Pass::BackwardFilter, a, x, w, y, tf32);
        let (conv, x, w, y) = descriptors(cudnn, a, x, w, y, tf32)?;
        let op = ConvBackwardFilter {
            conv: &conv,
            x: &x,
            dw: &w,
            dy: &y,
        };
        let (algo, workspace_bytes) = algos::choose(key, || {
            let algo = op.pick_algorithm()?;
            Ok((Algo::BwdFilter(algo), op.get_workspace_size(algo)?))
        })?;
        Ok(ConvPlan {
            algo,
            workspace_bytes,
            conv,
            x,
            w,
            y,
        })
    }

    /// Runs the convolution. For the forward plan `a` is x, `b` is w and
    /// `out` is y; for backward-data `a` is dy, `b` is w, `out` is dx; for
    /// backward-filter `a` is x, `b` is dy, `out` is dw.
    ///
    /// # Safety
    /// The addresses must point to live device ranges of the sizes given by
    /// the descriptors, and the workspace to at least `workspace_bytes`.
    pub unsafe fn run(
        &self,
        stream: &Arc<CudaStream>,
        a: (u64, usize),
        b: (u64, usize),
        out: (u64, usize),
        workspace: u64,
        workspace_bytes: usize,
    ) -> Result<(), CudnnError> {
        let ra = Raw::<f32>::new(a.0, a.1, stream);
        let rb = Raw::<f32>::new(b.0, b.1, stream);
        let mut ro = Raw::<f32>::new(out.0, out.1, stream);
        let mut ws = Raw::<u8>::new(workspace, workspace_bytes, stream);
        let ws = if workspace_bytes > 0 {
            Some(&mut ws)
        } else {
            None
        };
        match self.algo {
            Algo::Fwd(algo) => {
                let op = ConvForward {
                    conv: &self.conv,
                    x: &self.x,
                    w: &self.w,
                    y: &self.y,
                };
                // SAFETY: forwarded to the caller.
                unsafe { op.launch(algo, ws, (1.0, 0.0), &ra, &rb, &mut ro) }
            }
            Algo::BwdData(algo) => {
                let op = ConvBackwardData {
                    conv: &self.conv,
                    dx: &self.x,
                    w: &self.w,
                    dy: &self.y,
                };
                // SAFETY: forwarded to the caller.
                unsafe { op.launch(algo, ws, (1.0, 0.0), &mut ro, &rb, &ra) }
            }
            Algo::BwdFilter(algo) => {
                let op = ConvBackwardFilter {
                    conv: &self.conv,
                    x: &self.x,
                    dw: &self.w,
                    dy: &self.y,
                };
                // SAFETY: forwarded to the caller.
                unsafe { op.launch(algo, ws, (1.0, 0.0), &ra, &mut ro, &rb) }
            }
        }
    }
}
