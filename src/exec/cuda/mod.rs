//! The CUDA backend (cudarc, dynamic loading). Until it lands, [`probe`]
//! reports that no GPU backend is available, so `--device auto` falls back
//! to the CPU and `--device cuda` is a clear error.

use super::ExecError;

/// What the service logs about the GPU it found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    pub name: String,
    pub total_memory: u64,
}

/// Looks for a usable GPU without panicking (cudarc panics when it cannot
/// load libcuda, so the library is probed first).
pub fn probe() -> Result<CudaInfo, ExecError> {
    Err(ExecError::NoDevice {
        reason: "this build has no CUDA backend yet".into(),
    })
}
