//! Waiting for a stream without blocking inside the driver (see
//! docs/cuda.md, *Execution*): poll an event, spinning for a while, then
//! with short sleeps.

use cudarc::driver::CudaStream;

use crate::exec::ExecError;

use super::dev_err;

/// How long [`wait_idle`] polls without sleeping, at least.
const WAIT_SPIN: std::time::Duration = std::time::Duration::from_millis(2);
/// How long it polls without sleeping at most (see [`set_wait_spin`]), in
/// nanoseconds; 0: [`WAIT_SPIN`].
static WAIT_SPIN_MAX_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Process-wide: CUDA workers wait for their streams without sleeping for
/// up to `window` (a service's `--busy-poll`), instead of [`WAIT_SPIN`].
pub fn set_wait_spin(window: std::time::Duration) {
    let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
    WAIT_SPIN_MAX_NS.store(ns, std::sync::atomic::Ordering::Relaxed);
}

/// How long the wait for an iteration spins: [`WAIT_SPIN`], or 1.25 times
/// the program's last wait (its iterations' length) up to the busy-poll
/// window, so that the wait polls through the iteration's expected end
/// instead of sleeping past it.
pub(super) fn spin_for(last: std::time::Duration) -> std::time::Duration {
    let max = std::time::Duration::from_nanos(
        WAIT_SPIN_MAX_NS.load(std::sync::atomic::Ordering::Relaxed),
    );
    WAIT_SPIN.max((last * 5 / 4).min(max))
}
/// Its pause between polls after that.
const WAIT_POLL: std::time::Duration = std::time::Duration::from_micros(50);

/// Waits until the work queued on `stream` so far has finished, by polling
/// an event rather than blocking inside the driver. A thread that waits in
/// `cuStreamSynchronize` or in a copy to pageable memory holds a driver
/// lock (shared) that calls such as `cuCtxGetLimit` take exclusively; the
/// cuDNN and cuBLAS set-up of a job being loaded makes such calls, and a
/// training lane waiting in the driver back to back starved that load for
/// as long as the training ran (seen on the H100: 17 s and more). Polling
/// holds the lock only for each short query.
pub(in crate::exec::cuda) fn wait_idle(stream: &CudaStream) -> Result<(), ExecError> {
    wait_idle_spinning(stream, WAIT_SPIN).map(|_| ())
}

/// [`wait_idle`] that polls without sleeping for `spin`; returns how long
/// it waited.
pub(super) fn wait_idle_spinning(
    stream: &CudaStream,
    spin: std::time::Duration,
) -> Result<std::time::Duration, ExecError> {
    let done = stream
        .record_event(None)
        .map_err(|e| dev_err("record event", e))?;
    let t0 = std::time::Instant::now();
    while !done
        .try_is_complete()
        .map_err(|e| dev_err("stream synchronize", e))?
    {
        if t0.elapsed() < spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep(WAIT_POLL);
        }
    }
    Ok(t0.elapsed())
}
