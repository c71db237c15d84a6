//! The cuBLAS and cuDNN handles every program of the process shares.
//!
//! A handle costs device memory that no lane counts: on an H200 a cuBLAS
//! handle took 64 MiB and a cuDNN handle 8.8 MiB (`overhead.rs` in the GPU
//! conformance suite). With a handle of each per program, a packed
//! deployment ran out of device memory near 700 small models while its
//! lanes had room. So there is one handle of each for the process, each
//! behind a mutex: a program binds it to its own stream (and, for cuBLAS,
//! to the workspace in its own arena) for the calls it makes, which cost a
//! lock and, when another program called last, two or three host calls.
//! A recorded iteration (a CUDA graph) calls neither library, so replays
//! take no lock.
//!
//! `cublasSetStream` resets the workspace to cuBLAS's own pool, so the
//! workspace is bound again after every change of stream.

use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::cublas::sys::{cublasHandle_t, cublasMath_t};
use cudarc::cublas::CudaBlas;
use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys::cudnnHandle_t;
use cudarc::driver::CudaStream;

use super::device::gpu;
use super::program::dev_err;
use crate::exec::ExecError;

/// What the cuBLAS handle is bound to now.
struct BlasState {
    blas: CudaBlas,
    stream: usize,
    workspace: (u64, usize),
    math: Option<cublasMath_t>,
}

/// The process's cuBLAS handle.
pub(super) struct Blas(Mutex<BlasState>);

/// The process's cuDNN handle and the stream it is bound to now.
struct DnnState {
    handle: cudnnHandle_t,
    stream: usize,
}

// SAFETY: the handle is only used while the mutex around this state is
// held, so never from two threads at once; cuDNN allows a handle to be
// used from another thread than the one that made it when calls do not
// overlap.
unsafe impl Send for DnnState {}

/// The process's cuDNN handle.
pub(super) struct Dnn(Mutex<DnnState>);

/// Held by a thread while it records a CUDA graph: no other thread uses
/// or rebinds the handles until the recording ends, so a handle is never
/// moved off a stream in the middle of its capture. Without it, lanes
/// serve crashed inside libcuda when an inference job's load (which runs
/// and records its iteration) met a training job cutting and recording
/// its gated segments, and never did with the gate off.
static RECORDING: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread holds [`RECORDING`].
    static HOLDS_RECORDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, a recording of a CUDA graph on this thread, with the handles
/// kept from every other thread (see [`RECORDING`]).
pub(super) fn recording<R>(f: impl FnOnce() -> R) -> R {
    if HOLDS_RECORDING.with(std::cell::Cell::get) {
        return f();
    }
    let _held = lock(&RECORDING);
    HOLDS_RECORDING.with(|h| h.set(true));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            HOLDS_RECORDING.with(|h| h.set(false));
        }
    }
    let _reset = Reset;
    f()
}

/// Waits for another thread's recording to end (nothing when this thread
/// is the one recording). Taken before a handle's own lock, never while
/// holding one.
fn no_recording_elsewhere() -> Option<MutexGuard<'static, ()>> {
    if HOLDS_RECORDING.with(std::cell::Cell::get) {
        None
    } else {
        Some(lock(&RECORDING))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while the lock was held left the binding as it was: the
    // next caller binds again if it differs.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

static BLAS: OnceLock<Result<Blas, ExecError>> = OnceLock::new();
static DNN: OnceLock<Result<Dnn, ExecError>> = OnceLock::new();

/// The shared cuBLAS handle, made on first use.
pub(super) fn blas() -> Result<&'static Blas, ExecError> {
    BLAS.get_or_init(|| {
        let gpu = gpu()?;
        gpu.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let blas = CudaBlas::new(gpu.ctx.default_stream()).map_err(|e| dev_err("cuBLAS", e))?;
        Ok(Blas(Mutex::new(BlasState {
            blas,
            stream: 0,
            workspace: (0, 0),
            math: None,
        })))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The shared cuDNN handle, made on first use.
pub(super) fn dnn() -> Result<&'static Dnn, ExecError> {
    DNN.get_or_init(|| {
        let gpu = gpu()?;
        gpu.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let handle = dnn::create_handle().map_err(|e| dev_err("cuDNN", e))?;
        // Bound to the legacy default stream (0) until a program binds it.
        Ok(Dnn(Mutex::new(DnnState { handle, stream: 0 })))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The stream a handle is bound to while no program holds it: a stream of
/// its own, which no program captures or destroys (made on first use).
fn idle_stream() -> Result<&'static CudaStream, ExecError> {
    static IDLE: OnceLock<Result<std::sync::Arc<CudaStream>, ExecError>> = OnceLock::new();
    IDLE.get_or_init(|| {
        let gpu = gpu()?;
        gpu.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        gpu.ctx.new_stream().map_err(|e| dev_err("stream", e))
    })
    .as_ref()
    .map(|s| &**s)
    .map_err(Clone::clone)
}

/// Called before `stream` is destroyed (a program's drop): a handle still
/// bound to it is bound to the idle stream instead, and cuBLAS back to its
/// own workspace pool (the program's arena, where its workspace was, goes
/// too). A handle left bound to a destroyed stream is used at the next
/// call of another program before that call binds it (cuDNN's heuristics
/// for a new program's convolutions bind nothing): a training job's
/// recorded iterations call neither library, so such a binding could
/// outlive its program for as long as training ran.
pub(super) fn release(stream: &CudaStream) {
    let cu = stream.cu_stream() as usize;
    let Ok(idle) = idle_stream() else {
        return;
    };
    let _recording = no_recording_elsewhere();
    if let Some(Ok(b)) = BLAS.get() {
        let mut s = lock(&b.0);
        if s.stream == cu {
            if let Err(e) = s.bind(idle) {
                tracing::warn!(error = %e, "cuBLAS: unbinding a stream that goes");
            }
        }
    }
    if let Some(Ok(d)) = DNN.get() {
        let mut s = lock(&d.0);
        if s.stream == cu {
            if let Err(e) = s.bind(idle) {
                tracing::warn!(error = %e, "cuDNN: unbinding a stream that goes");
            }
        }
    }
}

impl BlasState {
    /// Binds the handle to `stream` (which puts cuBLAS's own workspace
    /// pool back).
    fn bind(&mut self, stream: &CudaStream) -> Result<(), ExecError> {
        let h = *self.blas.handle();
        // SAFETY: the handle is live and ours while the lock is held; the
        // stream outlives the calls made on it (the caller's, or the idle
        // stream, which lives as long as the process).
        unsafe { cudarc::cublas::sys::cublasSetStream_v2(h, stream.cu_stream() as _) }
            .result()
            .map_err(|e| dev_err("cuBLAS stream", e))?;
        self.stream = stream.cu_stream() as usize;
        self.workspace = (0, 0);
        Ok(())
    }
}

impl DnnState {
    /// Binds the handle to `stream`.
    fn bind(&mut self, stream: &CudaStream) -> Result<(), ExecError> {
        // SAFETY: the handle is live and ours while the lock is held; the
        // stream outlives the calls made on it (as for cuBLAS).
        unsafe { dnn::set_stream(self.handle, stream.cu_stream() as _) }
            .map_err(|e| dev_err("cuDNN stream", e))?;
        self.stream = stream.cu_stream() as usize;
        Ok(())
    }
}

impl Blas {
    /// Runs `f` with the handle bound to `stream`, `workspace` (address,
    /// bytes) and the math mode of `tf32`.
    pub fn with<R>(
        &self,
        stream: &CudaStream,
        workspace: (u64, usize),
        tf32: bool,
        f: impl FnOnce(cublasHandle_t) -> R,
    ) -> Result<R, ExecError> {
        let _recording = no_recording_elsewhere();
        let mut s = lock(&self.0);
        let h = *s.blas.handle();
        if s.stream != stream.cu_stream() as usize {
            s.bind(stream)?;
        }
        if s.workspace != workspace {
            // SAFETY: the caller's workspace is device memory of that many
            // bytes that stays mapped while its program lives; it is bound
            // again before any other program's call.
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    h,
                    workspace.0 as *mut std::ffi::c_void,
                    workspace.1,
                )
            }
            .result()
            .map_err(|e| dev_err("cuBLAS workspace", e))?;
            s.workspace = workspace;
        }
        let math = if tf32 {
            cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        if s.math != Some(math) {
            // SAFETY: the handle is live; the math mode has no memory effects.
            unsafe { cudarc::cublas::sys::cublasSetMathMode(h, math) }
                .result()
                .map_err(|e| dev_err("cuBLAS math mode", e))?;
            s.math = Some(math);
        }
        Ok(f(h))
    }
}

impl Dnn {
    /// Runs `f` with the handle bound to `stream`.
    pub fn with<R>(
        &self,
        stream: &CudaStream,
        f: impl FnOnce(cudnnHandle_t) -> R,
    ) -> Result<R, ExecError> {
        let _recording = no_recording_elsewhere();
        let mut s = lock(&self.0);
        if s.stream != stream.cu_stream() as usize {
            s.bind(stream)?;
        }
        Ok(f(s.handle))
    }

    /// Runs `f` with the handle bound to the idle stream, for calls that
    /// should launch nothing (descriptor queries, algorithm heuristics,
    /// workspace sizes): whatever they might enqueue stays off every
    /// program's stream, one of which may be recording a CUDA graph.
    pub fn planning<R>(&self, f: impl FnOnce(cudnnHandle_t) -> R) -> Result<R, ExecError> {
        self.with(idle_stream()?, f)
    }
}
