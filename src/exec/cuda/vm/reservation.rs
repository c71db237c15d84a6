//! The service's device reservation (`--memory`, taken at start-up as
//! equal chunks) from which, while it is held, every arena block is made
//! (see the parent module).

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::{min_granularity, prop, round_up};
use crate::exec::cuda::program::dev_err;
use crate::exec::ExecError;

/// Smallest chunk of a device reservation: larger chunks waste more (a
/// block is whole chunks), smaller ones cost more map calls per switch
/// (2 MiB chunks doubled a ResNet-50 switch on the H100).
pub const RESERVE_CHUNK: u64 = 16 << 20;

/// Most chunks a reservation is cut into before its chunks grow (each is
/// one `cuMemCreate` at start-up; 8192 × 16 MiB = 128 GiB).
pub const MAX_RESERVE_CHUNKS: usize = 8192;

/// The chunk of a reservation of `bytes`: [`RESERVE_CHUNK`], or the power
/// of two that keeps it within [`MAX_RESERVE_CHUNKS`] chunks.
pub fn reserve_chunk(bytes: usize) -> usize {
    (bytes.div_ceil(MAX_RESERVE_CHUNKS))
        .max(RESERVE_CHUNK as usize)
        .checked_next_power_of_two()
        .unwrap_or(RESERVE_CHUNK as usize)
}

/// The chunks of the device reservation (see [`DeviceReservation`]).
pub(super) struct Pool {
    pub(super) device: sys::CUdevice,
    pub(super) chunk: usize,
    pub(super) free: Vec<sys::CUmemGenericAllocationHandle>,
}

/// The device reservation's chunks while one is held (one per process).
pub(super) static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// The service's device memory (`--memory`), taken at start-up as equal
/// chunks: while it is held every block a program maps (persistent region,
/// lane block) is made of its chunks, mapped side by side under the
/// program's fixed address. Dropping it releases the free chunks; chunks
/// still mapped go back to the driver when their program lets go.
#[derive(Debug)]
pub struct DeviceReservation {
    ctx: Arc<CudaContext>,
    chunk: usize,
    chunks: usize,
}

impl DeviceReservation {
    /// Takes `bytes` of device memory now, in chunks of
    /// [`RESERVE_CHUNK`] (a larger power of two above
    /// [`MAX_RESERVE_CHUNKS`] chunks; the lanes align to the chunk, which
    /// must be a power of two), rounded down to whole chunks. One
    /// reservation per process.
    pub fn new(bytes: u64) -> Result<Self, ExecError> {
        let gpu = crate::exec::cuda::device::gpu()?;
        let ctx = gpu.ctx.clone();
        ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let gran = min_granularity(&ctx)?;
        let bytes = usize::try_from(bytes).map_err(|_| dev_err("reservation", "too large"))?;
        let chunk = round_up(reserve_chunk(bytes), gran)?;
        let n = bytes / chunk;
        if n == 0 {
            return Err(dev_err(
                "reservation",
                format!(
                    "{bytes} bytes is less than one reservation chunk ({chunk} bytes): \
                     give --memory at least that"
                ),
            ));
        }
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.is_some() {
            return Err(dev_err("reservation", "this process already holds one"));
        }
        let device = ctx.cu_device();
        let p = prop(device);
        let mut free = Vec::with_capacity(n);
        for _ in 0..n {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out-pointer and property struct.
            if let Err(e) = unsafe { sys::cuMemCreate(&mut h, chunk, &p, 0) }.result() {
                for h in free {
                    // SAFETY: ours, mapped nowhere.
                    let _ = unsafe { sys::cuMemRelease(h) };
                }
                return Err(dev_err(&format!("reserving {} bytes", n * chunk), e));
            }
            free.push(h);
        }
        *pool = Some(Pool {
            device,
            chunk,
            free,
        });
        Ok(DeviceReservation {
            ctx,
            chunk,
            chunks: n,
        })
    }

    /// Bytes reserved.
    pub fn size(&self) -> u64 {
        (self.chunk * self.chunks) as u64
    }

    /// Blocks are whole chunks of this size.
    pub fn chunk(&self) -> u64 {
        self.chunk as u64
    }

    /// Bytes of it not mapped by any program now.
    pub fn free_bytes(&self) -> u64 {
        POOL.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, |p| (p.free.len() * p.chunk) as u64)
    }
}

impl Drop for DeviceReservation {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if let Some(p) = POOL.lock().unwrap_or_else(PoisonError::into_inner).take() {
            for h in p.free {
                // SAFETY: free chunks are mapped nowhere.
                let _ = unsafe { sys::cuMemRelease(h) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservation_chunks_are_powers_of_two_and_few_enough() {
        const GIB: usize = 1 << 30;
        // `--memory auto` on the H100 (69.80 GiB): SIZE/512 was 140 MiB.
        assert_eq!(reserve_chunk(74_943_823_872), RESERVE_CHUNK as usize);
        assert_eq!(reserve_chunk(GIB), RESERVE_CHUNK as usize);
        assert_eq!(reserve_chunk(128 * GIB), RESERVE_CHUNK as usize);
        assert_eq!(reserve_chunk(128 * GIB + 1), 32 << 20);
        for bytes in [1, 3 * GIB, 500 * GIB, 1 << 50] {
            let c = reserve_chunk(bytes);
            assert!(c.is_power_of_two() && c >= RESERVE_CHUNK as usize);
            assert!(bytes / c <= MAX_RESERVE_CHUNKS, "{bytes}: {c}");
        }
    }
}
