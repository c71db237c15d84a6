//! The device buffer into which a switch copies a Run's feeds before the
//! program's arena is mapped (docs/switching.md, *Feeds staged*).
//!
//! An evicted program's arena has no memory behind it: the feeds' place
//! (in the ephemeral part) exists only once the host has mapped it, which
//! costs one `cuMemSetAccess` per allocation (about 50 µs each on an
//! H100/H200). Copied into this buffer instead, which is always mapped,
//! the feeds cross the link while the host maps; a device-to-device copy
//! on the compute stream then moves them into the arena before the first
//! kernel.
//!
//! One buffer per process (the service drives one GPU), grown when a
//! program is evicted (never on a switch's path) to the largest feeds
//! seen, at most [`STAGE_MAX`] bytes: device memory outside the lanes'
//! accounting and outside a device reservation, as the CUDA context's
//! own. A switch whose feeds do not fit, or that finds the buffer in use
//! by another switch, copies its feeds after the mapping as before.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::program::dev_err;
use crate::exec::ExecError;

/// The largest staging buffer (the feeds of ResNet-50 at batch 8 are
/// 4.8 MB; larger feeds copy after the mapping, where their own copy is
/// long beside it anyway).
pub const STAGE_MAX: usize = 16 << 20;

/// Each feed starts at a multiple of this in the buffer.
const ALIGN: usize = 256;

struct Buffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
    /// Recorded after the last use's copies out of the buffer (or, for a
    /// use that never moved its feeds, after its copies in): the next
    /// use's copies in wait for it on the device.
    free_after: Option<CudaEvent>,
}

// SAFETY: the pointer is a plain driver address owned by this value;
// every call on it binds the context first.
unsafe impl Send for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if let Some(ev) = self.free_after.take() {
            let _ = ev.synchronize();
        }
        // SAFETY: allocated by `reserve`; no copy uses it any more (waited
        // for just above).
        let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
    }
}

static BUFFER: Mutex<Option<Buffer>> = Mutex::new(None);

/// Process-wide: whether switches stage their feeds (on unless
/// [`set_stage_feeds`] turned it off).
static STAGE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Process-wide: whether switches stage their feeds (default on). Off, a
/// switch maps the ephemeral part first and copies its feeds there, as
/// before staging; `lanes bench switch` times both.
pub fn set_stage_feeds(on: bool) {
    STAGE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Bytes the buffer needs for feeds of these sizes (each aligned).
pub fn bytes_for(sizes: impl IntoIterator<Item = usize>) -> usize {
    sizes.into_iter().fold(0usize, |at, n| {
        at.saturating_add(n.div_ceil(ALIGN).saturating_mul(ALIGN))
    })
}

/// Makes the buffer hold at least `bytes` when that is at most
/// [`STAGE_MAX`] (allocating now, so no switch does). The context is bound
/// by the caller. Bytes of the buffer afterwards.
pub fn reserve(ctx: &Arc<CudaContext>, bytes: usize) -> Result<usize, ExecError> {
    let mut b = BUFFER.lock().unwrap_or_else(PoisonError::into_inner);
    let have = b
        .as_ref()
        .filter(|b| Arc::ptr_eq(&b.ctx, ctx))
        .map_or(0, |b| b.bytes);
    if bytes <= have || bytes > STAGE_MAX || bytes == 0 {
        return Ok(have);
    }
    // The old buffer goes first (waiting for its last use).
    *b = None;
    // SAFETY: a plain allocation, freed in `Buffer::drop`.
    let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }
        .map_err(|e| dev_err(&format!("allocating {bytes} bytes to stage feeds"), e))?;
    *b = Some(Buffer {
        ctx: ctx.clone(),
        ptr,
        bytes,
        free_after: None,
    });
    tracing::debug!(bytes, "feed staging buffer");
    Ok(bytes)
}

/// Bytes of the staging buffer now (device memory outside the lanes).
pub fn staging_bytes() -> usize {
    BUFFER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .map_or(0, |b| b.bytes)
}

/// Feeds copied into the buffer on a copy stream, not yet moved into
/// their places; holds the buffer until [`Staged::land`] (or drop).
pub struct Staged<'a> {
    guard: MutexGuard<'a, Option<Buffer>>,
    copy: Arc<CudaStream>,
    /// Each feed's (address in the buffer, bytes).
    spans: Vec<(u64, usize)>,
    landed: bool,
}

/// Queues the copies of `feeds` (host bytes; page-locked ones copy
/// asynchronously) into the buffer on `copy`. `None` (nothing queued)
/// when there are no feeds, they do not fit, another switch holds the
/// buffer now, or staging is off ([`set_stage_feeds`]). The host bytes must stay alive until `copy` is
/// synchronised.
pub fn stage<'a>(
    ctx: &Arc<CudaContext>,
    feeds: &[&[u8]],
    copy: &Arc<CudaStream>,
) -> Result<Option<Staged<'a>>, ExecError> {
    if feeds.is_empty() || !STAGE.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(None);
    }
    let need = bytes_for(feeds.iter().map(|f| f.len()));
    let mut guard = match BUFFER.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return Ok(None),
    };
    let Some(b) = guard.as_mut().filter(|b| Arc::ptr_eq(&b.ctx, ctx)) else {
        return Ok(None);
    };
    if need > b.bytes {
        return Ok(None);
    }
    if let Some(ev) = b.free_after.take() {
        copy.wait(&ev).map_err(|e| dev_err("stream wait", e))?;
    }
    let base = b.ptr;
    let mut spans = Vec::with_capacity(feeds.len());
    let mut at = 0usize;
    let mut staged = Staged {
        guard,
        copy: copy.clone(),
        spans: Vec::new(),
        landed: false,
    };
    for f in feeds {
        let dst = base + at as u64;
        // SAFETY: [dst, dst + len) lies in the buffer (`need` bytes fit);
        // the host bytes outlive the copy (the caller synchronises `copy`),
        // and the buffer is not reused before this copy is done (the next
        // use waits for `free_after`, recorded after it).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, f, copy.cu_stream()) }
            .map_err(|e| dev_err("host to device copy", e))?;
        spans.push((dst, f.len()));
        at += f.len().div_ceil(ALIGN) * ALIGN;
    }
    staged.spans = spans;
    Ok(Some(staged))
}

impl Staged<'_> {
    /// Queues on `stream` (after it waits for the copies in) the moves of
    /// each feed into `dsts` (device addresses, in the order staged, each
    /// holding its feed's bytes) and frees the buffer for the next use
    /// once they are done.
    pub fn land(
        mut self,
        staged_in: &CudaEvent,
        dsts: &[u64],
        stream: &CudaStream,
    ) -> Result<(), ExecError> {
        if dsts.len() != self.spans.len() {
            return Err(dev_err("staged feeds", "one place per feed is needed"));
        }
        stream
            .wait(staged_in)
            .map_err(|e| dev_err("stream wait", e))?;
        let mut moved = Ok(());
        for (&dst, &(src, n)) in dsts.iter().zip(&self.spans) {
            // SAFETY: `src` holds the feed's `n` bytes once `staged_in` is
            // done (waited for above); `dst` holds `n` bytes (the caller's
            // contract).
            let r = unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, n, stream.cu_stream())
            };
            if let Err(e) = r {
                moved = Err(dev_err("device to device copy", e));
                break;
            }
        }
        // Whatever was queued reads the buffer until this event.
        let ev = stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| dev_err("record event", e))?;
        if let Some(b) = self.guard.as_mut() {
            b.free_after = Some(ev);
        }
        self.landed = true;
        moved
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        if self.landed {
            return;
        }
        // Never moved (an error on the way): the switch returns an error
        // and its feeds' host memory may go, so the copies in are waited
        // for here (polling, as a worker waits); the next use then finds
        // the buffer free.
        if super::program::wait_idle(&self.copy).is_err() {
            let _ = self.copy.synchronize();
        }
        if let Some(b) = self.guard.as_mut() {
            b.free_after = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feeds_are_laid_out_aligned() {
        assert_eq!(bytes_for([]), 0);
        assert_eq!(bytes_for([1]), ALIGN);
        assert_eq!(bytes_for([ALIGN, 1, ALIGN + 1]), 4 * ALIGN);
        assert_eq!(bytes_for([usize::MAX, 1]), usize::MAX);
    }
}
