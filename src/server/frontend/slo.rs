//! A session's latency objective (`SessionSpec::slo_ms`) as the socket
//! thread keeps count of it: a Run's latency runs from when its request,
//! decoded, is handed to the dispatcher ([`SloTrack::queued`]) to when its
//! reply is handed back to the socket ([`SloTrack::answered`]). Both ends
//! are on the socket thread, so the count needs no lock, and the latency
//! is the service's part of what the client sees (the wire's transfers and
//! the request's decode are left out). Only Runs answered with their
//! outputs count; an error reply is no completion. Sessions without an
//! objective keep nothing here.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use lanes_adaptor::wire::{SloAttainment, SLO_WINDOW};

/// Runs of one session queued and not yet answered that are remembered; a
/// connection's requests in flight are bounded far below this
/// (`--max-requests-per-client`), so it is only a guard.
const MAX_PENDING: usize = 4096;

/// One session's count against its `slo_ms`.
#[derive(Debug)]
pub(super) struct SloTrack {
    slo_ms: f64,
    /// When each queued Run (by request id) was handed to the dispatcher.
    pending: HashMap<u64, Instant>,
    runs: u64,
    within: u64,
    /// The latest Runs' latencies, milliseconds, at most [`SLO_WINDOW`].
    recent: VecDeque<f64>,
}

impl SloTrack {
    pub(super) fn new(slo_ms: f64) -> Self {
        SloTrack {
            slo_ms,
            pending: HashMap::new(),
            runs: 0,
            within: 0,
            recent: VecDeque::with_capacity(SLO_WINDOW),
        }
    }

    /// Run `request_id` was queued at `at`.
    pub(super) fn queued(&mut self, request_id: u64, at: Instant) {
        if self.pending.len() < MAX_PENDING {
            self.pending.insert(request_id, at);
        }
    }

    /// A reply to `request_id` left at `at`; `done`: it is a Run's outputs.
    /// Replies to requests that were not queued Runs are ignored.
    pub(super) fn answered(&mut self, request_id: u64, done: bool, at: Instant) {
        let Some(queued) = self.pending.remove(&request_id) else {
            return;
        };
        if done {
            self.record(at.saturating_duration_since(queued).as_secs_f64() * 1e3);
        }
    }

    fn record(&mut self, latency_ms: f64) {
        self.runs += 1;
        if latency_ms <= self.slo_ms {
            self.within += 1;
        }
        if self.recent.len() == SLO_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(latency_ms);
    }

    /// The count as `lanes status` reports it.
    pub(super) fn attainment(&self) -> SloAttainment {
        let mut recent: Vec<f64> = self.recent.iter().copied().collect();
        recent.sort_by(f64::total_cmp);
        // Nearest rank: the smallest value with at least 99 % at or below it.
        let rank = (recent.len() as f64 * 0.99).ceil() as usize;
        SloAttainment {
            slo_ms: self.slo_ms,
            runs: self.runs,
            within: self.within,
            recent_p99_ms: recent.get(rank.saturating_sub(1)).copied(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn counts_runs_answered_within_the_objective() {
        let mut t = SloTrack::new(5.0);
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        t.queued(1, t0);
        t.queued(2, t0);
        t.queued(3, ms(1));
        t.answered(1, true, ms(4)); // 4 ms: within
        t.answered(2, true, ms(9)); // 9 ms: missed
        t.answered(3, false, ms(2)); // an error: no completion
        t.answered(77, true, ms(3)); // never queued: ignored
        let a = t.attainment();
        assert_eq!((a.runs, a.within), (2, 1));
        assert_eq!(a.attainment(), Some(0.5));
        assert_eq!(a.recent_p99_ms, Some(9.0));
        assert!(t.pending.is_empty());
    }

    #[test]
    fn the_p99_is_over_the_latest_window() {
        let mut t = SloTrack::new(1.0);
        assert_eq!(t.attainment().recent_p99_ms, None);
        for _ in 0..SLO_WINDOW {
            t.record(100.0);
        }
        for i in 0..SLO_WINDOW {
            t.record(i as f64 / SLO_WINDOW as f64);
        }
        let a = t.attainment();
        assert_eq!(a.runs, 2 * SLO_WINDOW as u64);
        assert_eq!(a.within, SLO_WINDOW as u64);
        // The 100 ms Runs have left the window; rank 990 of 0.000..0.999.
        assert_eq!(a.recent_p99_ms, Some(989.0 / SLO_WINDOW as f64));
    }
}
