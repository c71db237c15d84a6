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
        let bytes = segment
            .bytes()
            .get(range.clone())
            .ok_or_else(|| ExecError::NoDevice {
                reason: format!("{range:?} is outside the segment"),
            })?;
        let (ptr, len) = (bytes.as_ptr() as usize, bytes.len());
        Self::in_segment(segment, ptr, len, sys::CU_MEMHOSTREGISTER_READ_ONLY)
    }

    /// Registers `addresses` of a job's segment's writable mapping (the
    /// device writes into it: a reply slot), keeping the segment mapped
    /// for as long as the pin lives.
    pub fn segment_writable(
        segment: &Arc<AttachedSegment>,
        addresses: std::ops::Range<usize>,
    ) -> Result<Self, ExecError> {
        let inside = segment
            .writable_addresses()
            .is_some_and(|m| m.start <= addresses.start && addresses.end <= m.end);
        if !inside || addresses.is_empty() {
            return Err(ExecError::NoDevice {
                reason: format!("{addresses:x?} is not inside the segment's writable mapping"),
            });
        }
        Self::in_segment(segment, addresses.start, addresses.len(), 0)
    }

    /// Registers `len` bytes at `ptr`, which the callers checked lie in
    /// one of `segment`'s mappings, holding the segment.
    fn in_segment(
        segment: &Arc<AttachedSegment>,
        ptr: usize,
        len: usize,
        flags: u32,
    ) -> Result<Self, ExecError> {
        let gpu = gpu()?;
        // SAFETY: the range lies inside a mapping of `segment` (checked by
        // the callers), which the pin keeps mapped by holding the segment
        // until after it unregisters the range (Drop runs before the
        // fields are dropped).
        unsafe { register(&gpu.ctx, ptr as *const u8, len, flags)? };
        Ok(HostPin {
            ptr,
            len,
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

/// Most ranges a program keeps registered: a client uses one segment per
/// Run in flight (its feeds, and its reply slot in the writable mapping),
/// and replaces a segment that became too small under its id.
const MAX_PINNED_SEGMENTS: usize = 16;

/// Registration granule: ranges are widened to whole pages.
const PAGE: usize = 4096;

/// The parts of a job's shared segments its Runs' feeds came from, and
/// the reply slots its Runs' outputs were written into (in the segment's
/// writable mapping), registered the first time. Only the pages used are
/// registered (the feeds' bytes are bounded by the graph's placeholders,
/// which the service checked; a slot's by the outputs written):
/// registering a whole segment would make the service populate and lock
/// pages a client never wrote. A segment the service no longer holds (its
/// session replaced or detached it) is unregistered before another is
/// registered. If registering fails, copies to or from that range stay
/// pageable copies (correct, only slower), and it is not tried again.
#[derive(Debug, Default)]
pub(super) struct SegmentPins {
    pinned: Vec<Pinned>,
}

#[derive(Debug)]
struct Pinned {
    segment: Arc<AttachedSegment>,
    /// The writable mapping's addresses, or the read-only one's offsets.
    writable: bool,
    range: std::ops::Range<usize>,
    pin: Option<HostPin<'static>>,
}

impl SegmentPins {
    /// Makes sure the pages of `range` of `segment` are registered (or were
    /// tried).
    pub fn pin(&mut self, segment: &Arc<AttachedSegment>, range: std::ops::Range<usize>) {
        let len = segment.bytes().len();
        let range = (range.start / PAGE * PAGE)..range.end.next_multiple_of(PAGE).min(len);
        self.ensure(segment, false, range, HostPin::segment);
    }

    /// Makes sure the pages of `addresses` in `segment`'s writable mapping
    /// are registered (or were tried).
    pub fn pin_writable(
        &mut self,
        segment: &Arc<AttachedSegment>,
        addresses: std::ops::Range<usize>,
    ) {
        let Some(map) = segment.writable_addresses() else {
            return;
        };
        // The mapping starts on a page.
        let range = (addresses.start / PAGE * PAGE).max(map.start)
            ..addresses.end.next_multiple_of(PAGE).min(map.end);
        self.ensure(segment, true, range, HostPin::segment_writable);
    }

    fn ensure(
        &mut self,
        segment: &Arc<AttachedSegment>,
        writable: bool,
        range: std::ops::Range<usize>,
        register: impl FnOnce(
            &Arc<AttachedSegment>,
            std::ops::Range<usize>,
        ) -> Result<HostPin<'static>, ExecError>,
    ) {
        if let Some(i) = self
            .pinned
            .iter()
            .position(|p| p.writable == writable && Arc::ptr_eq(&p.segment, segment))
        {
            let p = &self.pinned[i];
            if p.range.start <= range.start && range.end <= p.range.end {
                return;
            }
            // Other feeds (or outputs) of the same segment: registered anew.
            self.pinned.remove(i);
        }
        // Held by nobody but this table (its entries, and their pins): the
        // service let go of it.
        let held_here = |seg: &Arc<AttachedSegment>, pinned: &[Pinned]| {
            pinned
                .iter()
                .filter(|p| Arc::ptr_eq(&p.segment, seg))
                .map(|p| 1 + usize::from(p.pin.is_some()))
                .sum::<usize>()
        };
        let gone: Vec<bool> = self
            .pinned
            .iter()
            .map(|p| Arc::strong_count(&p.segment) <= held_here(&p.segment, &self.pinned))
            .collect();
        let mut gone = gone.into_iter();
        self.pinned.retain(|_| !gone.next().unwrap_or(false));
        if self.pinned.len() >= MAX_PINNED_SEGMENTS {
            self.pinned.remove(0);
        }
        let pin = match register(segment, range.clone()) {
            Ok(p) => {
                tracing::debug!(
                    bytes = p.len(),
                    writable,
                    "shared segment registered page-locked"
                );
                Some(p)
            }
            Err(e) => {
                tracing::warn!(error = %e, writable, "copies with this shared segment use pageable memory");
                None
            }
        };
        self.pinned.push(Pinned {
            segment: segment.clone(),
            writable,
            range,
            pin,
        });
    }
}
