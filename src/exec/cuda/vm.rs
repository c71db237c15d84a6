//! A program's arena at a fixed virtual address whose physical memory is
//! given up on eviction and taken again on return (CUDA virtual memory
//! management). The address never changes, so the CUDA graphs recorded for
//! the program (the whole iteration, the switch segments) stay valid across
//! any number of evictions.
//!
//! Physical memory given up goes to a process-wide free list keyed by size
//! (the role the stream-ordered pool played before): the next program of the
//! same size that comes back maps it without asking the driver for new
//! memory. The list keeps at most [`FREE_KEPT_BYTES`]; more is released to
//! the driver, as is the memory of a program that is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::program::dev_err;
use crate::exec::ExecError;

/// Bytes of given-up physical memory kept for reuse, process-wide.
const FREE_KEPT_BYTES: usize = 8 << 30;

/// Handles of unmapped physical memory by (device, size).
#[allow(clippy::type_complexity)]
static FREE: Mutex<Option<HashMap<(i32, usize), Vec<sys::CUmemGenericAllocationHandle>>>> =
    Mutex::new(None);

fn location(device: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

fn prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero bytes are valid (null
    // pointer, zero enums and flags); the fields that matter are set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    p
}

/// A reserved virtual range with physical memory mapped while resident.
pub(super) struct VmArena {
    ctx: Arc<CudaContext>,
    device: sys::CUdevice,
    va: u64,
    size: usize,
    handle: Option<sys::CUmemGenericAllocationHandle>,
}

// SAFETY: the range and the handle are plain driver identifiers owned by
// this value; every call on them binds the context first.
unsafe impl Send for VmArena {}

impl VmArena {
    /// Reserves at least `bytes` of address space and maps memory into it.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, ExecError> {
        ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let device = ctx.cu_device();
        let p = prop(device);
        let mut gran = 0usize;
        // SAFETY: valid out-pointer and property struct.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(|e| dev_err("allocation granularity", e))?;
        let gran = gran.max(1);
        let size = bytes
            .max(1)
            .checked_next_multiple_of(gran)
            .ok_or_else(|| dev_err("arena size", "overflows"))?;
        let mut va = 0u64;
        // SAFETY: valid out-pointer; the range is freed in `Drop`.
        unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) }
            .result()
            .map_err(|e| dev_err(&format!("reserving {size} bytes of address space"), e))?;
        let mut a = VmArena {
            ctx: ctx.clone(),
            device,
            va,
            size,
            handle: None,
        };
        a.map()?;
        Ok(a)
    }

    /// The arena's device address (fixed for its lifetime).
    pub fn base(&self) -> u64 {
        self.va
    }

    /// Bytes of the range (a multiple of the granularity).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Maps physical memory into the range (a free handle of this size if
    /// one is kept, else new memory). Its contents are undefined.
    pub fn map(&mut self) -> Result<(), ExecError> {
        if self.handle.is_some() {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let key = (self.device, self.size);
        let reused = FREE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(HashMap::new)
            .get_mut(&key)
            .and_then(Vec::pop);
        let h = match reused {
            Some(h) => h,
            None => {
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                let p = prop(self.device);
                // SAFETY: valid out-pointer and property struct.
                unsafe { sys::cuMemCreate(&mut h, self.size, &p, 0) }
                    .result()
                    .map_err(|e| dev_err(&format!("allocating {} bytes", self.size), e))?;
                h
            }
        };
        // SAFETY: the range was reserved with this size and is unmapped; the
        // handle holds `size` bytes.
        if let Err(e) = unsafe { sys::cuMemMap(self.va, self.size, 0, h, 0) }.result() {
            // SAFETY: the handle is ours and not mapped anywhere.
            let _ = unsafe { sys::cuMemRelease(h) };
            return Err(dev_err("mapping the arena", e));
        }
        let access = sys::CUmemAccessDesc {
            location: location(self.device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped (just above).
        if let Err(e) = unsafe { sys::cuMemSetAccess(self.va, self.size, &access, 1) }.result() {
            // SAFETY: undo the mapping made above; the handle is ours.
            unsafe {
                let _ = sys::cuMemUnmap(self.va, self.size);
                let _ = sys::cuMemRelease(h);
            }
            return Err(dev_err("arena access", e));
        }
        self.handle = Some(h);
        tracing::trace!(
            ms = t0.elapsed().as_secs_f64() * 1e3,
            bytes = self.size,
            reused = reused.is_some(),
            "mapped"
        );
        Ok(())
    }

    /// Gives the physical memory up (to the free list). The caller has
    /// synchronised every stream that used the range.
    pub fn unmap(&mut self) -> Result<(), ExecError> {
        let Some(h) = self.handle.take() else {
            return Ok(());
        };
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let t0 = std::time::Instant::now();
        // SAFETY: the range is mapped to `h` and no work uses it any more.
        let r = unsafe { sys::cuMemUnmap(self.va, self.size) };
        tracing::trace!(
            ms = t0.elapsed().as_secs_f64() * 1e3,
            bytes = self.size,
            "cuMemUnmap"
        );
        r.result().map_err(|e| dev_err("unmapping the arena", e))?;
        let mut free = FREE.lock().unwrap_or_else(PoisonError::into_inner);
        let lists = free.get_or_insert_with(HashMap::new);
        let kept: usize = lists.iter().map(|((_, size), v)| size * v.len()).sum();
        if kept + self.size <= FREE_KEPT_BYTES {
            lists.entry((self.device, self.size)).or_default().push(h);
        } else {
            // SAFETY: the handle is ours and no longer mapped.
            let _ = unsafe { sys::cuMemRelease(h) };
        }
        Ok(())
    }
}

impl Drop for VmArena {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if let Some(h) = self.handle.take() {
            // SAFETY: the program owning the range is gone; its memory goes
            // back to the driver.
            unsafe {
                let _ = sys::cuMemUnmap(self.va, self.size);
                let _ = sys::cuMemRelease(h);
            }
        }
        // SAFETY: the range was reserved by `new` and is unmapped now.
        let _ = unsafe { sys::cuMemAddressFree(self.va, self.size) };
    }
}
