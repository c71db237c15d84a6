//! Page-locked host images kept for reuse. A program's host image (the
//! copy of its weights that eviction and pipelined switching read) is
//! page-locked memory, and making it is most of an inference load's
//! standby: the driver touches and pins every page (about 156 ms for
//! ResNet-152's 241 MB on an H100, where the weights' upload took 47). A
//! program that ends gives its image here; the next program whose
//! persistent region has the same size (the same architecture: a model
//! loaded again, or another model of its kind) takes it instead of
//! pinning new memory. At most [`KEEP_BYTES`] are kept unused; beyond
//! that an image is freed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{CudaContext, PinnedHostSlice};

use super::program::dev_err;
use crate::exec::ExecError;

/// Most bytes of unused page-locked images kept.
const KEEP_BYTES: usize = 4 << 30;

#[derive(Default)]
struct Pool {
    by_size: HashMap<usize, Vec<PinnedHostSlice<u8>>>,
    bytes: usize,
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

/// A page-locked image of exactly `bytes` bytes: a kept one, or new. Its
/// contents are whatever it held: the caller writes all of it first.
pub(super) fn take(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedHostSlice<u8>, ExecError> {
    {
        let mut p = pool().lock().unwrap_or_else(PoisonError::into_inner);
        let found = p.by_size.get_mut(&bytes).and_then(Vec::pop);
        if let Some(img) = found {
            p.bytes -= bytes;
            return Ok(img);
        }
    }
    // SAFETY: the caller writes the whole buffer before reading it.
    unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }
        .map_err(|e| dev_err(&format!("allocating {bytes} pinned bytes"), e))
}

/// Keeps `img` for a later [`take`] of its size, unless that would keep
/// more than [`KEEP_BYTES`] unused. The caller has finished every copy
/// from or to it.
pub(super) fn give(img: PinnedHostSlice<u8>) {
    let bytes = img.len();
    let mut p = pool().lock().unwrap_or_else(PoisonError::into_inner);
    if bytes == 0 || p.bytes + bytes > KEEP_BYTES {
        drop(p);
        drop(img);
        return;
    }
    p.bytes += bytes;
    p.by_size.entry(bytes).or_default().push(img);
}

/// Bytes of unused images kept now.
pub fn kept_bytes() -> usize {
    pool().lock().unwrap_or_else(PoisonError::into_inner).bytes
}
