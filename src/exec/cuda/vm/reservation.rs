//! The service's device reservation (`--memory`, taken at start-up as
//! whole chunks in allocations of three sizes) from which, while it is
//! held, every arena block is made (see the parent module).

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::{min_granularity, prop, round_up};
use crate::exec::cuda::program::dev_err;
use crate::exec::ExecError;

/// Smallest chunk of a device reservation: larger chunks waste more (a
/// block is whole chunks), smaller ones cost more map calls per switch
/// (2 MiB chunks doubled a ResNet-50 switch on the H100). Blocks are made
/// of allocations of up to [`FANOUT`]² chunks ([`CLASSES`]).
pub const RESERVE_CHUNK: u64 = 16 << 20;

/// Most chunks a reservation is cut into before its chunks grow
/// (8192 × 16 MiB = 128 GiB).
pub const MAX_RESERVE_CHUNKS: usize = 8192;

/// The chunk of a reservation of `bytes`: [`RESERVE_CHUNK`], or the power
/// of two that keeps it within [`MAX_RESERVE_CHUNKS`] chunks.
pub fn reserve_chunk(bytes: usize) -> usize {
    (bytes.div_ceil(MAX_RESERVE_CHUNKS))
        .max(RESERVE_CHUNK as usize)
        .checked_next_power_of_two()
        .unwrap_or(RESERVE_CHUNK as usize)
}

/// Size classes of a reservation's allocations: the chunk, and chunks of
/// [`FANOUT`] and [`FANOUT`]² of them (16, 64 and 256 MiB). Every
/// allocation in an arena's range costs one more step of `cuMemSetAccess`
/// on each mapping (about 22 µs on an H200, whatever its size), so a block
/// is made of the largest allocations that fit it; the small ones come
/// from splitting a large one when none is free (docs/switching.md).
pub(super) const CLASSES: usize = 3;

/// Chunks of class k-1 in one allocation of class k.
pub(super) const FANOUT: usize = 4;

/// Chunks in one allocation of class `k`.
fn class_chunks(k: usize) -> usize {
    FANOUT.pow(k as u32)
}

/// The free allocations of the device reservation (see
/// [`DeviceReservation`]), by size class: `free[k]` holds allocations of
/// `chunk × FANOUT^k` bytes.
pub(super) struct Pool {
    pub(super) device: sys::CUdevice,
    pub(super) chunk: usize,
    pub(super) free: [Vec<sys::CUmemGenericAllocationHandle>; CLASSES],
}

impl Pool {
    /// Bytes of an allocation of class `k`.
    pub(super) fn class_bytes(&self, k: usize) -> usize {
        self.chunk * class_chunks(k)
    }

    /// The class of an allocation of `bytes` (one this pool made).
    pub(super) fn class_of(&self, bytes: usize) -> Option<usize> {
        (0..CLASSES).find(|&k| self.class_bytes(k) == bytes)
    }

    /// Bytes free.
    pub(super) fn free_bytes(&self) -> usize {
        (0..CLASSES)
            .map(|k| self.free[k].len() * self.class_bytes(k))
            .sum()
    }

    /// Takes allocations that together hold exactly `units` chunks, the
    /// largest first (each one fewer step for `cuMemSetAccess`), splitting a
    /// larger free allocation when only such ones are left. `None` (and
    /// nothing taken) when the pool holds fewer free chunks.
    pub(super) fn take_units(
        &mut self,
        units: usize,
    ) -> Option<Vec<(sys::CUmemGenericAllocationHandle, usize)>> {
        if self.free_bytes() / self.chunk < units {
            return None;
        }
        let mut pieces = Vec::new();
        let mut want = units;
        while want > 0 {
            let fits = (0..CLASSES)
                .rev()
                .find(|&k| class_chunks(k) <= want && !self.free[k].is_empty());
            if let Some(k) = fits {
                if let Some(h) = self.free[k].pop() {
                    pieces.push((h, self.class_bytes(k)));
                    want -= class_chunks(k);
                }
                continue;
            }
            // Only allocations larger than what is left are free: split the
            // smallest of them.
            let Some(k) = (1..CLASSES).find(|&k| !self.free[k].is_empty()) else {
                break;
            };
            if !self.split(k) {
                break;
            }
        }
        if want > 0 {
            // A split failed (the driver refused memory just given back):
            // give back what was taken.
            for (h, bytes) in pieces {
                if let Some(k) = self.class_of(bytes) {
                    self.free[k].push(h);
                }
            }
            return None;
        }
        Some(pieces)
    }

    /// Replaces one free allocation of class `k` (≥ 1) by [`FANOUT`] of
    /// class `k - 1`: released, then made again (the memory goes back to
    /// the driver between the two). False when the driver refused; the
    /// reservation is then smaller by what it refused.
    fn split(&mut self, k: usize) -> bool {
        let Some(h) = self.free[k].pop() else {
            return false;
        };
        // SAFETY: a free allocation is mapped nowhere.
        let _ = unsafe { sys::cuMemRelease(h) };
        let bytes = self.class_bytes(k - 1);
        let p = prop(self.device);
        let mut made = 0;
        for _ in 0..FANOUT {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out-pointer and property struct.
            match unsafe { sys::cuMemCreate(&mut h, bytes, &p, 0) }.result() {
                Ok(()) => {
                    self.free[k - 1].push(h);
                    made += 1;
                }
                Err(e) => {
                    tracing::warn!(error = ?e, bytes, "splitting a reservation allocation: the driver refused; the reservation is smaller");
                    break;
                }
            }
        }
        made > 0
    }
}

/// The device reservation's chunks while one is held (one per process).
pub(super) static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// The service's device memory (`--memory`), taken at start-up as whole
/// chunks, made as allocations of the largest class first: while it is
/// held every block a program maps (persistent region, lane block) is made
/// of its allocations, mapped side by side under the program's fixed
/// address. Dropping it releases the free allocations; those still mapped
/// go back to the driver when their program lets go.
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
    /// must be a power of two), rounded down to whole chunks, as
    /// allocations of [`FANOUT`]² chunks, then [`FANOUT`], then one. One
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
        // The n chunks as the largest allocations first.
        let mut free: [Vec<sys::CUmemGenericAllocationHandle>; CLASSES] = Default::default();
        let mut left = n;
        for k in (0..CLASSES).rev() {
            let units = class_chunks(k);
            for _ in 0..left / units {
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: valid out-pointer and property struct.
                if let Err(e) = unsafe { sys::cuMemCreate(&mut h, chunk * units, &p, 0) }.result() {
                    for h in free.iter().flatten() {
                        // SAFETY: ours, mapped nowhere.
                        let _ = unsafe { sys::cuMemRelease(*h) };
                    }
                    return Err(dev_err(&format!("reserving {} bytes", n * chunk), e));
                }
                free[k].push(h);
            }
            left %= units;
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
            .map_or(0, |p| p.free_bytes() as u64)
    }
}

impl Drop for DeviceReservation {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if let Some(p) = POOL.lock().unwrap_or_else(PoisonError::into_inner).take() {
            for h in p.free.into_iter().flatten() {
                // SAFETY: free chunks are mapped nowhere.
                let _ = unsafe { sys::cuMemRelease(h) };
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// A pool of made-up handles (no driver call is made unless a split
    /// is needed, which these cases never need).
    fn pool(counts: [usize; CLASSES]) -> Pool {
        let mut next = 0u64;
        let mut free: [Vec<sys::CUmemGenericAllocationHandle>; CLASSES] = Default::default();
        for (k, &n) in counts.iter().enumerate() {
            for _ in 0..n {
                next += 1;
                free[k].push(next);
            }
        }
        Pool {
            device: 0,
            chunk: 16 << 20,
            free,
        }
    }

    fn mib(pieces: &[(sys::CUmemGenericAllocationHandle, usize)]) -> Vec<usize> {
        pieces.iter().map(|&(_, b)| b >> 20).collect()
    }

    #[test]
    fn blocks_take_the_largest_allocations_that_fit() {
        let mut p = pool([3, 2, 1]);
        assert_eq!(p.free_bytes(), (3 * 16 + 2 * 64 + 256) << 20);
        // 21 chunks: one of 16, one of 4, one chunk.
        let got = p.take_units(21).unwrap();
        assert_eq!(mib(&got), vec![256, 64, 16]);
        assert_eq!(p.free_bytes(), (2 * 16 + 64) << 20);
        // 6 chunks, with one 64 MiB allocation and two chunks left.
        let got = p.take_units(6).unwrap();
        assert_eq!(mib(&got), vec![64, 16, 16]);
        // More than is free: nothing is taken.
        assert_eq!(p.take_units(1), None);
        assert_eq!(p.free_bytes(), 0);
        // Given back (as `Block::drop` does), the same sizes come again.
        for (h, b) in got {
            let k = p.class_of(b).unwrap();
            p.free[k].push(h);
        }
        assert_eq!(mib(&p.take_units(6).unwrap()), vec![64, 16, 16]);
    }

    #[test]
    fn a_block_short_of_large_allocations_takes_small_ones() {
        // 8 chunks, no 64 MiB allocation free: eight 16 MiB ones.
        let mut p = pool([10, 0, 0]);
        assert_eq!(mib(&p.take_units(8).unwrap()), vec![16; 8]);
        assert_eq!(p.free[0].len(), 2);
        assert_eq!(p.take_units(3), None);
        assert_eq!(
            p.free[0].len(),
            2,
            "a refused take leaves the pool as it was"
        );
    }

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
