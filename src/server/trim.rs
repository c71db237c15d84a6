//! Gives the allocator's free memory back to the system after sessions go.
//!
//! The service keeps glibc's thresholds raised (`wire::keep_freed_blocks_mapped`:
//! blocks up to 32 MiB come from the heap, and a heap keeps up to 64 MiB
//! free at its top), so that the large frames of every Run land on pages
//! already mapped. The price is that memory freed when sessions go stays
//! with the process: a soak of session churn grew the service's resident
//! memory to hundreds of MiB that no session held. So after sessions close
//! a thread of its own calls `malloc_trim(0)` (at most once per
//! [`EVERY`], never on the socket thread), which returns every whole free
//! page of every arena; the next Runs' frames fault pages in again, once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Least time between two trims; also how long a request waits, so the
/// frees of a burst of closing sessions are trimmed together.
pub(crate) const EVERY: Duration = Duration::from_secs(2);

/// Returns the allocator's free memory to the system now; whether any was
/// (always `false` where the allocator is not glibc's).
pub(crate) fn release_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` takes a byte count, reads and writes only
        // the allocator's own state under the allocator's locks, and
        // releases only pages no allocation uses; no Rust-visible memory or
        // pointer is involved.
        #[allow(unsafe_code)]
        let released = unsafe { libc::malloc_trim(0) };
        released != 0
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// The trimming thread; stops when dropped.
#[derive(Debug)]
pub(crate) struct Trimmer {
    wanted: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Trimmer {
    /// Starts the thread (`None` if it cannot be started: nothing is
    /// trimmed then).
    pub(crate) fn start() -> Option<Trimmer> {
        let wanted = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s) = (Arc::clone(&wanted), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("lanes-trim".into())
            .spawn(move || {
                while !s.load(Ordering::SeqCst) {
                    std::thread::park_timeout(EVERY);
                    if !w.swap(false, Ordering::SeqCst) {
                        continue;
                    }
                    let t0 = Instant::now();
                    let released = release_free_memory();
                    tracing::debug!(
                        released,
                        ms = t0.elapsed().as_secs_f64() * 1e3,
                        "free memory given back"
                    );
                    // At most one trim per EVERY (a stop wakes it).
                    let until = Instant::now() + EVERY;
                    while !s.load(Ordering::SeqCst) {
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        std::thread::park_timeout(left);
                    }
                }
            })
            .ok()?;
        Some(Trimmer {
            wanted,
            stop,
            thread: Some(thread),
        })
    }

    /// Sessions went: trim within about [`EVERY`].
    pub(crate) fn soon(&self) {
        self.wanted.store(true, Ordering::SeqCst);
    }
}

impl Drop for Trimmer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_trimmer_starts_trims_and_stops() {
        let t = Trimmer::start().unwrap();
        // Freed memory to give back.
        drop(std::hint::black_box(vec![vec![1u8; 1 << 16]; 64]));
        t.soon();
        drop(t); // joins without waiting for a tick
                 // Callable directly, any number of times.
        release_free_memory();
        release_free_memory();
    }
}
