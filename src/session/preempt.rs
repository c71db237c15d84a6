//! A training job yielding its memory at an iteration boundary (PipeSwitch's
//! case: an inference Run waits for memory that a busy training job holds).
//!
//! The socket thread never waits for an iteration: it only marks the job
//! ([`YieldRequest::ask`]). The worker that ran the job's iteration, after
//! sending its reply, calls [`Session::yield_at_boundary`]: the job is
//! evicted (its state copied to host memory), which admits the waiting job,
//! and, when it has more Runs queued, it asks for its memory again at once,
//! so its Runs wait in the admission queue (held back by the dispatcher)
//! until memory lets it back in. See docs/switching.md, *Eviction*.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lanes_adaptor::wire::JobKind;

use super::{Session, SessionError};

/// Whether a job was asked to give its memory up after its iteration in
/// progress; shared by the socket thread (which asks or withdraws) and the
/// session (whose worker answers).
#[derive(Debug, Clone, Default)]
pub struct YieldRequest(Arc<AtomicBool>);

impl YieldRequest {
    /// Asks the job to yield at its next iteration boundary.
    pub fn ask(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Takes the request back (nothing waits for memory any more, or the
    /// job answered it).
    pub fn withdraw(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    pub fn is_asked(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl Session {
    /// The request the socket thread marks this job with.
    pub fn yield_request(&self) -> YieldRequest {
        self.yield_request.clone()
    }

    /// At an iteration boundary (after a Run, its reply sent): if the job
    /// was asked to yield, is a training job holding lane memory, and a job
    /// still waits for memory, evicts it (waiting, if need be, for a
    /// lane-mate's iteration: CPU state is read out of the reservation in
    /// the lane's turn) and, when `more_queued` says it has Runs queued
    /// (asked after the eviction), asks the lanes for its memory again so
    /// those Runs wait for it. Returns the bytes copied out when it
    /// yielded, `None` when it did not. The request is taken either way,
    /// once the job's memory is given up (until then the socket thread
    /// sees it still asked, and asks no other job).
    pub fn yield_at_boundary(
        &mut self,
        more_queued: impl FnOnce() -> bool,
    ) -> Result<Option<u64>, SessionError> {
        if !self.yield_request.is_asked() {
            return Ok(None);
        }
        let outcome = self.give_up_memory(more_queued);
        self.yield_request.withdraw();
        outcome
    }

    fn give_up_memory(
        &mut self,
        more_queued: impl FnOnce() -> bool,
    ) -> Result<Option<u64>, SessionError> {
        let someone_waits = self
            .lanes
            .as_ref()
            .is_some_and(|l| !l.waiting_jobs().is_empty());
        if self.spec.kind != JobKind::Training
            || !someone_waits
            || !self.is_loaded()
            || !self.is_resident()
            || self.lease.is_none()
            || !self.is_admitted()
        {
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        let copied = self.evict()?;
        self.yields += 1;
        let evict_ms = t0.elapsed().as_secs_f64() * 1e3;
        let waits = if more_queued() {
            self.prepare_return()?
        } else {
            false
        };
        tracing::info!(
            session = %self.id,
            copied,
            evict_ms,
            waits_for_memory = waits,
            yields = self.yields,
            "training job yielded its memory at an iteration boundary"
        );
        Ok(Some(copied))
    }

    /// Whether the socket thread asked this job to yield.
    pub fn is_asked_to_yield(&self) -> bool {
        self.yield_request.is_asked()
    }
}
