//! The CUDA backend on cudarc (dynamic loading: libcuda, cuBLAS, cuDNN and
//! NVRTC are opened at run time, so this builds and [`probe`]s cleanly on
//! machines without a GPU).
//!
//! - [`CudaProgram`] mirrors [`crate::exec::cpu::CpuProgram`]: a validated
//!   graph whose tensors all live in one device allocation made when it is
//!   built (no allocation on the iteration path), run on its own stream.
//! - Matrix products go to cuBLAS (strided batched), convolutions to cuDNN,
//!   everything else to CUDA C kernels in `kernels/*.cu`, compiled by NVRTC
//!   once per process.
//! - Precision defaults equal PyTorch's (see [`CudaOptions`]).
#![allow(unsafe_code)]

mod algos;
mod bn;
mod conv;
mod device;
mod elem;
mod epilogue;
pub mod fuse;
mod handles;
mod host_pool;
mod ops;
mod pin;
mod program;
mod staging;
mod vm;

/// (hits, misses) of the cuDNN algorithm choices kept by convolution shape.
pub use algos::stats as conv_algorithm_stats;

pub use host_pool::kept_bytes as kept_host_image_bytes;
pub use pin::{pin_host, HostPin};
pub use program::{
    ephemeral_need, set_conv_tf32, set_matmul_tf32, set_wait_spin, ArenaParts, CudaOptions,
    CudaProgram,
};

use super::ExecError;

/// What the service logs about the GPU it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    pub name: String,
    pub total_memory: u64,
}

/// Looks for a usable GPU without panicking: the CUDA libraries are probed
/// with `dlopen` first (cudarc panics when it cannot load them), then the
/// context is created and the kernels compiled (once per process) with any
/// panic contained.
pub fn probe() -> Result<CudaInfo, ExecError> {
    device::gpu().map(|g| g.info.clone())
}

/// Free and total memory of the GPU now, in bytes (`cuMemGetInfo`), asked
/// through the process's own context: the one [`probe`] and every program
/// use, opened (kernels compiled) on first use, so no second context is
/// created and what the context and kernels take is already not free.
/// Binds that context to the calling thread.
pub fn memory_info() -> Result<(u64, u64), ExecError> {
    let gpu = device::gpu()?;
    let (free, total) = gpu.ctx.mem_get_info().map_err(|e| ExecError::NoDevice {
        reason: format!("cuMemGetInfo: {e:?}"),
    })?;
    Ok((free as u64, total as u64))
}

pub use device::{device_count, select_device, selected_device};
pub use staging::{set_stage_feeds, staging_bytes, STAGE_MAX};
pub use vm::{lane_block_bytes, DeviceReservation, RESERVE_CHUNK};

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// On any machine: either a GPU is found with a name, or a clear error
    /// comes back; never a panic.
    #[test]
    fn probe_never_panics() {
        match probe() {
            Ok(info) => assert!(!info.name.is_empty()),
            Err(ExecError::NoDevice { reason }) => assert!(!reason.is_empty()),
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }

    /// The memory query agrees with the probe: free within total on a GPU,
    /// a clear `NoDevice` error without one.
    #[test]
    fn memory_info_agrees_with_probe() {
        match (probe(), memory_info()) {
            (Ok(_), Ok((free, total))) => {
                assert!(total > 0 && free <= total, "{free} free of {total}");
            }
            (Err(_), Err(ExecError::NoDevice { reason })) => assert!(!reason.is_empty()),
            (a, b) => panic!("probe {a:?} disagrees with memory_info {b:?}"),
        }
    }

    /// Building a program agrees with the probe: a clear `NoDevice` error
    /// without a GPU, a program with one.
    #[test]
    fn program_without_gpu_is_a_clear_error() {
        use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Tensor, TensorType};
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2]));
        let w = g.variable("w", Tensor::full([2], 1.0));
        let _ = g.add(x, w);
        let (graph, vars) = g.finish().expect("graph builds");
        let vg = validate(graph, &GraphLimits::default()).expect("graph validates");
        match (probe(), CudaProgram::new(vg, vars)) {
            (Ok(_), Ok(p)) => assert!(p.device_bytes() > 0),
            (Err(_), Err(ExecError::NoDevice { reason })) => assert!(!reason.is_empty()),
            (a, b) => panic!("probe {a:?} disagrees with program {b:?}"),
        }
    }
}
