//! Stopping (`ServerHandle::shutdown`, or SIGINT / SIGTERM under `lanes
//! serve`): no new work is accepted (every request gets `ShuttingDown`),
//! the requests queued or running when the stop began have until the
//! grace period (`--shutdown-grace`) to finish, and whatever is left then
//! is answered `ShuttingDown`; then the sessions are closed and an
//! `ipc://` endpoint's socket file removed.

use std::time::Instant;

use lanes_adaptor::wire::{self, ErrorCode};

use super::Frontend;

/// How long a stop waits for workers to leave (and for its last replies
/// to be written) after the grace period.
const FLUSH: std::time::Duration = std::time::Duration::from_millis(500);

/// The text of the `ShuttingDown` replies.
const STOPPING: &str = "the service is stopping: no new work is accepted";

impl Frontend {
    /// Starts the stop: from now on requests are refused.
    pub(super) fn begin_stop(&mut self) {
        let grace = self.config.shutdown_grace;
        let running = self.dispatcher.running().len();
        let queued = self.dispatcher.queued();
        tracing::info!(
            grace_s = grace.as_secs_f64(),
            running,
            queued,
            sessions = self.sessions.len(),
            "stopping: no new work; requests in flight may finish within the grace period"
        );
        self.stopping = Some(Instant::now() + grace);
    }

    /// Whether the stop may end now: nothing queued, running or being
    /// decoded, or the grace period is over.
    pub(super) fn stop_done(&self) -> bool {
        let Some(deadline) = self.stopping else {
            return false;
        };
        Instant::now() >= deadline
            || (self.dispatcher.queued() == 0
                && self.dispatcher.running().is_empty()
                && self.decoding.is_empty())
    }

    /// Answers a request that came while stopping.
    pub(super) fn refuse_stopping(
        &mut self,
        peer: &[u8],
        request_id: u64,
    ) -> Result<(), zmq::Error> {
        self.send_error(peer, request_id, ErrorCode::ShuttingDown, STOPPING)
    }

    /// Ends the stop: replies that came are forwarded; every request still
    /// queued, running or waiting behind a decode is answered
    /// `ShuttingDown`; the workers that are done are joined (one still in
    /// an iteration is left to finish on its own: its reply goes nowhere);
    /// the sessions are closed; an `ipc://` socket file is removed.
    pub(super) fn finish_stop(&mut self) {
        self.dispatcher.shutdown();
        let _ = self.forward_replies();
        let mut failed = 0usize;
        let ids: Vec<_> = self.sessions.keys().copied().collect();
        for id in ids {
            for item in self.dispatcher.take_queued(id) {
                failed += 1;
                let _ = self.refuse_stopping(&item.peer, item.request_id);
            }
        }
        for (_, peer, request_id) in self.dispatcher.running() {
            failed += 1;
            let _ = self.refuse_stopping(&peer, request_id);
        }
        let held: Vec<_> = self.held.drain().collect();
        for (peer, messages) in held {
            for (frames, _) in messages {
                failed += 1;
                let id = frames
                    .first()
                    .and_then(|f| wire::peek_request_id(f))
                    .unwrap_or(0);
                let _ = self.refuse_stopping(&peer, id);
            }
        }
        // Workers leave once their item is done. While one is still in an
        // iteration, it keeps the ZeroMQ context (and so the process's
        // exit) from waiting for the replies above to be written: they are
        // given this long.
        let until = Instant::now() + FLUSH;
        while Instant::now() < until && self.workers.iter().any(|w| !w.is_finished()) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let mut left = 0usize;
        for w in std::mem::take(&mut self.workers) {
            if !w.is_finished() {
                left += 1;
                continue;
            }
            match w.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "worker stopped with an error"),
                Err(_) => tracing::error!("worker panicked"),
            }
        }
        let sessions = self.sessions.len();
        self.sessions.clear();
        self.bells.clear();
        let endpoint = self.config.endpoint.clone();
        if let Some(path) = endpoint.strip_prefix("ipc://") {
            let bound = self
                .router
                .get_last_endpoint()
                .ok()
                .and_then(|r| r.ok())
                .unwrap_or(endpoint.clone());
            let _ = self.router.unbind(&bound);
            if std::path::Path::new(path).exists() {
                if let Err(e) = std::fs::remove_file(path) {
                    tracing::warn!(path, error = %e, "could not remove the socket file");
                }
            }
        }
        tracing::info!(
            sessions,
            failed,
            workers_left_running = left,
            "lanes service stopped"
        );
    }
}
