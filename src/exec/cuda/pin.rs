//! Host memory registered page-locked (`cuMemHostRegister`): copies from it
//! to the device are DMA transfers that run on the stream, instead of the
//! driver staging pageable bytes through a bounce buffer while the host
//! waits.
//!
//! Two uses: a job's shared-memory segment, registered once by the program
//! that runs its Runs (the feeds are copied to the device straight from
//! where the job wrote them, see [`SegmentPins`]), and a caller's own host
//! buffers ([`pin_host`], e.g. a benchmark's feeds, as a PyTorch user's
//! pinned input tensor).

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaContext;
use lanes_adaptor::wire::shm::AttachedSegment;

use super::device::gpu;
use crate::exec::ExecError;

/// A registered host range; unregistered when dropped (the range must stay
/// mapped until then: `'a` borrows it, or the pin keeps its segment).
#[derive(Debug)]
pub struct HostPin<'a> {
    ptr: usize,
    len: usize,
    ctx: Arc<CudaContext>,
    _segment: Option<Arc<AttachedSegment>>,
    _borrow: PhantomData<&'a [u8]>,
}

/// `cuMemHostRegister` of `[ptr, ptr + len)` with `flags`.
///
/// # Safety
/// The range must be mapped and stay mapped until it is unregistered.
unsafe fn register(
    ctx: &Arc<CudaContext>,
    ptr: *const u8,
    len: usize,
    flags: u32,
) -> Result<(), ExecError> {
    ctx.bind_to_thread().map_err(|e| ExecError::NoDevice {
        reason: format!("bind: {e:?}"),
    })?;
    // SAFETY: the caller keeps the range mapped while it is registered;
    // the driver only pins its pages (read-only when the flags say so).
    let r = unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) };
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(ExecError::NoDevice {
            reason: format!("cuMemHostRegister of {len} bytes: {e:?}"),
        }),
    }
}

impl HostPin<'static> {
    /// Registers `range` of a job's segment (read-only: the service maps it
    /// so), keeping the segment mapped for as long as the pin lives.
    pub fn segment(
        segment: &Arc<AttachedSegment>,
        range: std::ops::Range<usize>,
    ) -> Result<Self, ExecError> {
        let gpu = gpu()?;
        let bytes = segment
            .bytes()
            .get(range.clone())
            .ok_or_else(|| ExecError::NoDevice {
                reason: format!("{range:?} is outside the segment"),
            })?;
        // SAFETY: the pin holds the segment (its mapping) until after it
        // unregisters it (Drop runs before the fields are dropped).
        unsafe {
            register(
                &gpu.ctx,
                bytes.as_ptr(),
                bytes.len(),
                sys::CU_MEMHOSTREGISTER_READ_ONLY,
            )?
        };
        Ok(HostPin {
            ptr: bytes.as_ptr() as usize,
            len: bytes.len(),
            ctx: gpu.ctx.clone(),
            _segment: Some(segment.clone()),
            _borrow: PhantomData,
        })
    }
}

/// Registers the caller's `bytes` page-locked for as long as the pin lives
/// (it borrows them). Copies from them to the device then run as DMA on
/// the stream, like copies from a PyTorch tensor in pinned memory.
pub fn pin_host(bytes: &[u8]) -> Result<HostPin<'_>, ExecError> {
    let gpu = gpu()?;
    // SAFETY: the pin borrows `bytes` for its whole life, so they stay
    // mapped until it unregisters them.
    unsafe { register(&gpu.ctx, bytes.as_ptr(), bytes.len(), 0)? };
    Ok(HostPin {
        ptr: bytes.as_ptr() as usize,
        len: bytes.len(),
        ctx: gpu.ctx.clone(),
        _segment: None,
        _borrow: PhantomData,
    })
}

impl HostPin<'_> {
    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostPin<'_> {
    fn drop(&mut self) {
        // Every copy from the range was awaited before its Run returned.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` is the start of a range this pin registered and
            // that is still mapped (borrowed, or its segment held).
            let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) };
            if r != CUresult::CUDA_SUCCESS {
                tracing::warn!(error = ?r, bytes = self.len, "cuMemHostUnregister failed");
            }
        }
    }
}

/// Most segments a program keeps registered; a client uses one per Run in
/// flight, and replaces a segment that became too small under its id.
const MAX_PINNED_SEGMENTS: usize = 8;

/// Registration granule: ranges are widened to whole pages.
const PAGE: usize = 4096;

/// The parts of a job's shared segments its Runs' feeds came from,
/// registered the first time. Only the pages the feeds occupy are
/// registered (their bytes are bounded by the graph's placeholders, which
/// the service checked): registering a whole segment would make the service
/// populate and lock pages a client never wrote. A segment the service no
/// longer holds (its session replaced or detached it) is unregistered
/// before another is registered. If registering fails, copies from that
/// range stay pageable copies (correct, only slower), and it is not tried
/// again.
#[derive(Debug, Default)]
pub(super) struct SegmentPins {
    pinned: Vec<Pinned>,
}

#[derive(Debug)]
struct Pinned {
    segment: Arc<AttachedSegment>,
    range: std::ops::Range<usize>,
    pin: Option<HostPin<'static>>,
}

impl SegmentPins {
    /// Makes sure the pages of `range` of `segment` are registered (or were
    /// tried).
    pub fn pin(&mut self, segment: &Arc<AttachedSegment>, range: std::ops::Range<usize>) {
        let len = segment.bytes().len();
        let range = (range.start / PAGE * PAGE)..range.end.next_multiple_of(PAGE).min(len);
        if let Some(i) = self
            .pinned
            .iter()
            .position(|p| Arc::ptr_eq(&p.segment, segment))
        {
            let p = &self.pinned[i];
            if p.range.start <= range.start && range.end <= p.range.end {
                return;
            }
            // Other feeds of the same segment: registered anew.
            self.pinned.remove(i);
        }
        // Held by nobody but this table (its entry, and its pin): the
        // service let go of it.
        self.pinned
            .retain(|p| Arc::strong_count(&p.segment) > 1 + usize::from(p.pin.is_some()));
        if self.pinned.len() >= MAX_PINNED_SEGMENTS {
            self.pinned.remove(0);
        }
        let pin = match HostPin::segment(segment, range.clone()) {
            Ok(p) => {
                tracing::debug!(bytes = p.len(), "shared segment registered page-locked");
                Some(p)
            }
            Err(e) => {
                tracing::warn!(error = %e, "feeds from this shared segment are copied from pageable memory");
                None
            }
        };
        self.pinned.push(Pinned {
            segment: segment.clone(),
            range,
            pin,
        });
    }
}
