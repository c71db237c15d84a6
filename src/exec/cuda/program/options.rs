//! Precision and execution switches of a program, and their process-wide
//! defaults.

/// Precision switches. The defaults equal PyTorch's: matrix products in plain
/// FP32 (`torch.backends.cuda.matmul.allow_tf32 = False`), convolutions may
/// use TF32 tensor cores (`torch.backends.cudnn.allow_tf32 = True`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Let cuDNN use TF32 tensor cores for FP32 convolutions. Default: on,
    /// unless [`set_conv_tf32`] turned it off.
    pub conv_tf32: bool,
    /// Let cuBLAS use TF32 tensor cores for FP32 matrix products.
    pub matmul_tf32: bool,
    /// Record the iteration's launches once as a CUDA graph and replay it
    /// (addresses never change, so the graph stays valid); falls back to
    /// launching op by op if capture fails.
    pub cuda_graph: bool,
    /// How urgent the program's work is to the GPU: its streams get the
    /// device's least priority raised by this many levels (clamped to the
    /// greatest), so that when lanes run at once the block scheduler
    /// starts an urgent lane's blocks before a less urgent lane's waiting
    /// ones. 0 (the default) is CUDA's default priority.
    pub urgency: u8,
    /// Run chains of per-channel elementwise ops after a convolution (its
    /// bias, inference batch norm, a residual Add, Relu) as one kernel
    /// (see `fuse.rs`). Default: on unless the environment variable
    /// `LANES_NO_FUSION` is `1`.
    pub fuse: bool,
    /// Batch norm with batch statistics (training), forward, through
    /// cuDNN's kernels, as PyTorch (see `bn.rs`; the gradient always runs on
    /// ours); our own kernels where cuDNN's definition differs. Default: on
    /// unless the environment variable `LANES_NO_CUDNN_BN` is `1`.
    pub cudnn_batch_norm: bool,
}

/// Process-wide default of [`CudaOptions::conv_tf32`] (`--no-tf32`).
static CONV_TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Process-wide: whether programs made from [`CudaOptions::default`] let
/// cuDNN use TF32 for FP32 convolutions (on by default, as PyTorch's
/// `cudnn.allow_tf32`; `lanes serve --no-tf32` turns it off, for results
/// that match an FP32 reference at FP32 tolerances).
pub fn set_conv_tf32(on: bool) {
    CONV_TF32.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Process-wide default of [`CudaOptions::matmul_tf32`] (`--tf32-matmul`).
static MATMUL_TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Process-wide: whether programs made from [`CudaOptions::default`] let
/// cuBLAS use TF32 tensor cores for FP32 matrix products (off by default,
/// as PyTorch's `torch.backends.cuda.matmul.allow_tf32`; `lanes serve
/// --tf32-matmul` turns it on, as `torch.set_float32_matmul_precision
/// ("high")` does).
pub fn set_matmul_tf32(on: bool) {
    MATMUL_TF32.store(on, std::sync::atomic::Ordering::Relaxed);
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            conv_tf32: CONV_TF32.load(std::sync::atomic::Ordering::Relaxed),
            matmul_tf32: MATMUL_TF32.load(std::sync::atomic::Ordering::Relaxed),
            cuda_graph: true,
            urgency: 0,
            fuse: std::env::var("LANES_NO_FUSION").as_deref() != Ok("1"),
            cudnn_batch_norm: std::env::var("LANES_NO_CUDNN_BN").as_deref() != Ok("1"),
        }
    }
}
