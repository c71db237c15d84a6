//! Whether an urgent session's next Run closes the device gate
//! (`exec::gate`), from its latency objective and its recent Runs.
//!
//! Without an objective every Run closes the gate: the Run gets the GPU
//! alone (but for one short training segment), and training what is left.
//! With one (`slo_ms`), a Run lets training go on beside it while the
//! session has room under its objective: none of its last [`WINDOW`] Runs
//! took more than [`HEADROOM`] of the target. A Run beside training takes
//! longer (about 1.5× alone for ResNet-152 beside ResNet-50 training on an
//! H200), so a target that such Runs stay under leaves the gate open for
//! good, and one they exceed closes it again for the next [`WINDOW`] Runs.
//! The time measured is the Run's execution in the service (from its turn
//! in its lane to its outputs), not the client's round trip.

use std::collections::VecDeque;
use std::time::Duration;

/// Runs remembered.
pub(crate) const WINDOW: usize = 32;
/// The share of the target a remembered Run may take for the session to
/// have room.
pub(crate) const HEADROOM: f64 = 0.9;

#[derive(Debug, Default)]
pub(crate) struct SloGate {
    target: Option<Duration>,
    recent: VecDeque<Duration>,
}

impl SloGate {
    pub(crate) fn new(target: Option<Duration>) -> SloGate {
        SloGate {
            target,
            recent: VecDeque::with_capacity(WINDOW),
        }
    }

    /// Whether the next Run closes the gate.
    pub(crate) fn closes(&self) -> bool {
        let Some(target) = self.target else {
            return true;
        };
        let limit = target.mul_f64(HEADROOM);
        self.recent.len() < WINDOW || self.recent.iter().any(|d| *d > limit)
    }

    /// A Run of the session took `took`.
    pub(crate) fn record(&mut self, took: Duration) {
        if self.target.is_none() {
            return;
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn without_a_target_every_run_closes_the_gate() {
        let mut g = SloGate::new(None);
        for _ in 0..100 {
            g.record(MS);
        }
        assert!(g.closes());
    }

    #[test]
    fn with_room_under_the_target_the_gate_stays_open() {
        let mut g = SloGate::new(Some(10 * MS));
        // Until it has seen a window of Runs, it closes the gate.
        for _ in 0..WINDOW - 1 {
            assert!(g.closes());
            g.record(5 * MS);
        }
        g.record(5 * MS);
        assert!(!g.closes(), "every Run well under the target");
        // One Run near the target: closed for the next window of Runs.
        g.record(Duration::from_micros(9_500));
        for _ in 0..WINDOW - 1 {
            assert!(g.closes());
            g.record(5 * MS);
        }
        g.record(5 * MS);
        assert!(!g.closes());
    }
}
