//! How a client waits for the reply to a Run from feed buffers: when it
//! sleeps (blocked on the socket, woken by the reply's arrival) and when it
//! polls the reply slot without sleeping. A sleeping thread takes a reply
//! tens to hundreds of microseconds after it is written (the socket's two
//! ZeroMQ I/O threads, then the scheduler's wake-up); a polling one takes
//! it at once but keeps a core busy.
//!
//! - [`ClientOptions::busy_poll`](super::ClientOptions::busy_poll) set: it
//!   polls for that window from the send, or, when the buffers' last Run
//!   took longer than the window, sleeps until [`SPIN_FROM`] of that time
//!   and polls for the window from there.
//! - Otherwise, with [`ClientOptions::adaptive_wait`](super::ClientOptions::adaptive_wait)
//!   on (the default): from the shortest of the buffers' last
//!   [`HISTORY`] round trips (the expected one), it sleeps until shortly
//!   before that and polls for a window of a quarter of it, at least
//!   [`ADAPTIVE_MIN_SPIN`] and at most [`ADAPTIVE_MAX_SPIN`], centred on
//!   the expected arrival; then it sleeps on the socket again. The first Run
//!   of new buffers sleeps throughout.
//! - With both off, it sleeps throughout.
//!
//! [`plan`] is the decision, a pure function of the options and the
//! recorded round trips.

use std::time::Duration;

/// Where, as a fraction of the last Run's round trip, a busy-polling wait
/// for a longer Run from the same feed buffers starts to spin (it sleeps on
/// the socket before): early enough for the step-to-step jitter of a GPU
/// iteration (about 1 %) and a sleeping thread's wake-up.
pub const SPIN_FROM: f64 = 0.9;

/// The adaptive wait's polling window as a fraction of the expected round
/// trip (before [`ADAPTIVE_MIN_SPIN`] and [`ADAPTIVE_MAX_SPIN`]).
pub const ADAPTIVE_SPIN_FRACTION: f64 = 0.25;

/// The adaptive wait's shortest polling window: about a sleeping thread's
/// wake-up (timer slack and scheduling), so that a sleep that overshoots
/// still lands in the window.
pub const ADAPTIVE_MIN_SPIN: Duration = Duration::from_micros(100);

/// The adaptive wait's longest polling window: the most a Run's wait keeps
/// a core busy.
pub const ADAPTIVE_MAX_SPIN: Duration = Duration::from_micros(500);

/// How many of the buffers' last round trips the adaptive wait remembers.
pub const HISTORY: usize = 8;

/// The last [`HISTORY`] round trips (send to outputs) of Runs from one set
/// of feed buffers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundTrips {
    /// Oldest first.
    recent: Vec<Duration>,
}

impl RoundTrips {
    /// Records a Run's round trip, forgetting the oldest past [`HISTORY`].
    pub fn record(&mut self, t: Duration) {
        if self.recent.len() == HISTORY {
            self.recent.remove(0);
        }
        self.recent.push(t);
    }

    /// The latest round trip.
    pub fn last(&self) -> Option<Duration> {
        self.recent.last().copied()
    }

    /// The expected round trip: the shortest recent one. A Run is rarely
    /// faster than that; a slower one costs at most the polling window
    /// before the wait sleeps again.
    pub fn expected(&self) -> Option<Duration> {
        self.recent.iter().min().copied()
    }
}

/// How to wait for one reply: sleep (on the socket) until `spin_from` after
/// the send, then poll the reply slot without sleeping for `spin`, then
/// sleep on the socket until the reply or the timeout. A zero `spin` sleeps
/// throughout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPlan {
    pub spin_from: Duration,
    pub spin: Duration,
}

impl WaitPlan {
    /// Sleep until the reply.
    pub const SLEEP: WaitPlan = WaitPlan {
        spin_from: Duration::ZERO,
        spin: Duration::ZERO,
    };

    /// Whether the wait polls at all.
    pub fn spins(&self) -> bool {
        !self.spin.is_zero()
    }
}

/// The wait for a Run's reply given the client's `busy_poll` window and
/// `adaptive` setting and the buffers' recorded round trips (see the
/// module docs).
pub fn plan(busy_poll: Duration, adaptive: bool, trips: &RoundTrips) -> WaitPlan {
    if !busy_poll.is_zero() {
        return match trips.last() {
            Some(last) if last > busy_poll => WaitPlan {
                spin_from: last.mul_f64(SPIN_FROM),
                spin: busy_poll,
            },
            _ => WaitPlan {
                spin_from: Duration::ZERO,
                spin: busy_poll,
            },
        };
    }
    let Some(expected) = trips.expected().filter(|_| adaptive) else {
        return WaitPlan::SLEEP;
    };
    let spin = expected
        .mul_f64(ADAPTIVE_SPIN_FRACTION)
        .clamp(ADAPTIVE_MIN_SPIN, ADAPTIVE_MAX_SPIN);
    WaitPlan {
        spin_from: expected.saturating_sub(spin / 2),
        spin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(v: u64) -> Duration {
        Duration::from_micros(v)
    }

    fn trips(us_each: &[u64]) -> RoundTrips {
        let mut t = RoundTrips::default();
        for &v in us_each {
            t.record(us(v));
        }
        t
    }

    #[test]
    fn nothing_set_or_nothing_known_sleeps() {
        assert_eq!(
            plan(Duration::ZERO, false, &trips(&[2000])),
            WaitPlan::SLEEP
        );
        assert_eq!(plan(Duration::ZERO, true, &trips(&[])), WaitPlan::SLEEP);
        assert!(!WaitPlan::SLEEP.spins());
    }

    #[test]
    fn adaptive_polls_a_quarter_around_the_expected_reply() {
        // 1.2 ms: a window of 0.3 ms from 1.05 ms.
        let p = plan(Duration::ZERO, true, &trips(&[1200]));
        assert_eq!(p.spin, us(300));
        assert_eq!(p.spin_from, us(1050));
        assert!(p.spins());
    }

    #[test]
    fn adaptive_window_is_bounded() {
        // BERT's 8 ms: at most 0.5 ms, from 7.75 ms.
        let p = plan(Duration::ZERO, true, &trips(&[8000]));
        assert_eq!(p.spin, ADAPTIVE_MAX_SPIN);
        assert_eq!(p.spin_from, us(7750));
        // A training step of a second polls no longer.
        let p = plan(Duration::ZERO, true, &trips(&[1000000]));
        assert_eq!(p.spin, ADAPTIVE_MAX_SPIN);
        // A 0.2 ms Run: at least 0.1 ms, from 0.15 ms.
        let p = plan(Duration::ZERO, true, &trips(&[200]));
        assert_eq!(p.spin, ADAPTIVE_MIN_SPIN);
        assert_eq!(p.spin_from, us(150));
        // Shorter than the window: it polls from the send.
        let p = plan(Duration::ZERO, true, &trips(&[40]));
        assert_eq!(p.spin_from, Duration::ZERO);
        assert_eq!(p.spin, ADAPTIVE_MIN_SPIN);
    }

    #[test]
    fn adaptive_expects_the_shortest_recent_round_trip() {
        // A slow first Run (loading, a cold cache) is outweighed at once.
        let p = plan(Duration::ZERO, true, &trips(&[30000, 2000, 2400]));
        assert_eq!(p.spin_from, us(1750));
        // …and forgotten after HISTORY more.
        let mut t = trips(&[1000]);
        for _ in 0..HISTORY {
            t.record(us(4000));
        }
        assert_eq!(t.expected(), Some(us(4000)));
        assert_eq!(t.last(), Some(us(4000)));
    }

    #[test]
    fn busy_poll_keeps_its_meaning() {
        let busy = us(10000);
        // Shorter Runs (or none yet): poll the whole window from the send.
        for t in [trips(&[]), trips(&[2000]), trips(&[30000, 2000])] {
            let p = plan(busy, true, &t);
            assert_eq!((p.spin_from, p.spin), (Duration::ZERO, busy), "{t:?}");
            assert_eq!(plan(busy, false, &t), p);
        }
        // The last Run longer than the window: sleep to 0.9 of it first,
        // whatever the shortest was.
        let p = plan(busy, true, &trips(&[2000, 40000]));
        assert_eq!(p.spin_from, us(40000).mul_f64(SPIN_FROM));
        assert_eq!(p.spin, busy);
    }
}
