//! Host-side gating of lower-urgency GPU work while urgent work runs.
//!
//! Stream priorities order the block scheduler's choices but never pre-empt
//! blocks in flight, and a training iteration queued on the GPU as one
//! graph keeps its kernels running beside an urgent lane's: inference beside
//! training took 1.6–1.7× its time alone (docs/benchmarks.md). The gate
//! keeps lower-urgency work off the GPU instead:
//!
//! - An urgent Run *enters* the gate while it runs ([`Gate::enter`]); the
//!   gate is closed while any is inside and for [`GateConfig::release`]
//!   after the last left (a request that follows closely finds the GPU
//!   still free).
//! - A program that yields runs its iteration as short segments (recorded
//!   CUDA graphs of about [`GateConfig::segment`] GPU time each, cut by
//!   [`cut`]) and asks [`Gate::try_launch`] before each: with the gate open
//!   it launches; closed, it waits ([`GateMode::Hold`]), or launches only
//!   while no other yielding segment is in flight ([`GateMode::Trickle`]).
//!   It waits for each segment to finish before asking for the next, so at
//!   most one of its segments is on the GPU when an urgent Run arrives;
//!   and with several yielding programs at most
//!   [`GateConfig::max_in_flight`] segments of all of them are (each more
//!   is more work an urgent Run finds running beside it).
//! - With no urgent session [`armed`](Gate::arm), yielding programs replay
//!   their whole iteration as before (no cost without urgent work).
//!
//! The gate knows nothing of CUDA: the decisions are here, tested on the
//! CPU; `exec::cuda` launches the segments.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What a yielding program may launch while the gate is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GateMode {
    /// Nothing new until the gate opens (the urgent lane has the GPU alone,
    /// but for the one segment that was in flight when it arrived).
    #[default]
    Hold,
    /// One yielding segment at a time on the whole device, beside the
    /// urgent work (training goes on slowly; the urgent lane shares the
    /// GPU with at most one short segment).
    Trickle,
}

/// How the gate behaves (`lanes serve --gate-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateConfig {
    pub mode: GateMode,
    /// How long the gate stays closed after the last urgent Run left.
    pub release: Duration,
    /// The GPU time a yielding program's segment aims at.
    pub segment: Duration,
    /// Once the gate has stayed closed this long without a break (urgent
    /// work back to back), yielding work is let through anyway, one
    /// segment at a time, for [`min_share`](Self::min_share) of the time:
    /// training is slowed, never starved.
    pub starve_after: Duration,
    /// The share of the device's time yielding work keeps while the gate
    /// stays closed past `starve_after` (one segment every `segment /
    /// min_share`).
    pub min_share: f64,
    /// Under [`GateMode::Trickle`], the most segments let through beside
    /// urgent work in one closed period of the gate (from the first urgent
    /// Run to the gate's opening again); 0: no limit.
    pub trickle_segments: u32,
    /// The most yielding segments in flight on the device at once, all
    /// yielding programs together, while an urgent session is armed (the
    /// gate open or not); 0: no limit (one per program).
    pub max_in_flight: u32,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            mode: GateMode::Hold,
            release: Duration::from_micros(100),
            segment: Duration::from_micros(300),
            starve_after: Duration::from_millis(50),
            min_share: 0.1,
            trickle_segments: 0,
            max_in_flight: 0,
        }
    }
}

impl GateConfig {
    /// The least time between two segments let through a gate closed past
    /// `starve_after` (none with `min_share` 0).
    fn forced_every(&self) -> Option<Duration> {
        (self.min_share > 0.0 && self.min_share.is_finite())
            .then(|| self.segment.div_f64(self.min_share.min(1.0)))
    }
}

#[derive(Debug)]
struct State {
    /// Urgent Runs inside.
    active: usize,
    /// When the last urgent Run left.
    left_at: Option<Instant>,
    /// Yielding segments launched and not yet reported finished.
    in_flight: usize,
    /// Segments launched so far.
    launches: u64,
    /// Since when a yielding program has found the gate closed without a
    /// break (`None` while it is open).
    closed_since: Option<Instant>,
    /// When a segment was last let through a gate closed too long.
    forced_at: Option<Instant>,
    /// Segments trickled through in the gate's current closed period.
    trickled: u32,
}

/// What the gate has seen (for `/metrics` and the GPU tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GateStats {
    /// Urgent Runs that entered.
    pub urgent_runs: u64,
    /// Yielding segments launched.
    pub launches: u64,
    /// Launches refused because the gate was closed (each refusal is one
    /// poll of a waiting program, so this counts polls, not segments).
    pub refusals: u64,
    /// Segments let through a gate closed past `starve_after`.
    pub forced: u64,
    /// Segments launched while an urgent Run was inside (trickle mode).
    pub launched_beside_urgent: u64,
    /// The most yielding segments in flight when an urgent Run entered.
    pub max_in_flight_at_entry: u64,
    /// Time yielding programs spent waiting at the gate, nanoseconds.
    pub waited_ns: u64,
}

/// One per device (a service's lanes share it).
#[derive(Debug)]
pub struct Gate {
    config: GateConfig,
    state: Mutex<State>,
    /// Urgent sessions alive (yielding programs segment only while > 0).
    armed: AtomicUsize,
    refusals: AtomicU64,
    urgent_runs: AtomicU64,
    beside: AtomicU64,
    forced: AtomicU64,
    max_in_flight: AtomicU64,
    waited_ns: AtomicU64,
}

impl Gate {
    pub fn new(config: GateConfig) -> Arc<Gate> {
        Arc::new(Gate {
            config,
            state: Mutex::new(State {
                active: 0,
                left_at: None,
                in_flight: 0,
                launches: 0,
                closed_since: None,
                forced_at: None,
                trickled: 0,
            }),
            armed: AtomicUsize::new(0),
            refusals: AtomicU64::new(0),
            urgent_runs: AtomicU64::new(0),
            beside: AtomicU64::new(0),
            forced: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            waited_ns: AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> GateConfig {
        self.config
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An urgent session exists while the returned guard lives.
    pub fn arm(self: &Arc<Self>) -> Armed {
        self.armed.fetch_add(1, Ordering::SeqCst);
        Armed {
            gate: Arc::clone(self),
        }
    }

    /// Whether any urgent session exists (yielding programs then segment).
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::SeqCst) > 0
    }

    /// An urgent Run starts; the gate is closed until the guard drops (and
    /// [`GateConfig::release`] after the last one).
    pub fn enter(self: &Arc<Self>) -> Inside {
        let mut s = self.state();
        if open(&s, self.config.release, Instant::now()) {
            // The gate closes anew: a new trickle allowance.
            s.trickled = 0;
        }
        s.active += 1;
        self.urgent_runs.fetch_add(1, Ordering::Relaxed);
        self.max_in_flight
            .fetch_max(s.in_flight as u64, Ordering::Relaxed);
        Inside {
            gate: Arc::clone(self),
        }
    }

    fn leave(&self, now: Instant) {
        let mut s = self.state();
        s.active = s.active.saturating_sub(1);
        if s.active == 0 {
            s.left_at = Some(now);
        }
    }

    /// Whether the gate is open at `now`: no urgent Run inside, and the
    /// last left at least the release time ago.
    pub fn is_open_at(&self, now: Instant) -> bool {
        open(&self.state(), self.config.release, now)
    }

    /// Asks to launch one yielding segment at `now`; on `true` the caller
    /// launches it and calls [`Gate::finished`] once it has completed.
    pub fn try_launch_at(&self, now: Instant) -> bool {
        let mut s = self.state();
        let cap = self.config.max_in_flight;
        let ok = if cap > 0 && s.in_flight >= cap as usize {
            false
        } else if open(&s, self.config.release, now) {
            s.closed_since = None;
            true
        } else if self.config.mode == GateMode::Trickle
            && s.in_flight == 0
            && (self.config.trickle_segments == 0 || s.trickled < self.config.trickle_segments)
        {
            s.trickled += 1;
            true
        } else {
            let since = *s.closed_since.get_or_insert(now);
            let starved = now.saturating_duration_since(since) >= self.config.starve_after;
            let due = match (self.config.forced_every(), s.forced_at) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(every), Some(t)) => now.saturating_duration_since(t) >= every,
            };
            let force = starved && due && s.in_flight == 0;
            if force {
                s.forced_at = Some(now);
                self.forced.fetch_add(1, Ordering::Relaxed);
            }
            force
        };
        if ok {
            if s.active > 0 {
                self.beside.fetch_add(1, Ordering::Relaxed);
            }
            s.in_flight += 1;
            s.launches += 1;
        } else {
            self.refusals.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// [`Gate::try_launch_at`] now.
    pub fn try_launch(&self) -> bool {
        self.try_launch_at(Instant::now())
    }

    /// Waits until a segment may launch (polling: spinning briefly, then
    /// with short sleeps) and counts it launched. The caller launches it
    /// and calls [`Gate::finished`] once it has completed.
    pub fn acquire(&self) {
        let t0 = Instant::now();
        let mut polls = 0u32;
        while !self.try_launch() {
            polls += 1;
            if polls < 200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        if polls > 0 {
            let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// A launched segment has completed on the GPU.
    pub fn finished(&self) {
        let mut s = self.state();
        s.in_flight = s.in_flight.saturating_sub(1);
    }

    pub fn stats(&self) -> GateStats {
        let launches = self.state().launches;
        GateStats {
            urgent_runs: self.urgent_runs.load(Ordering::Relaxed),
            launches,
            refusals: self.refusals.load(Ordering::Relaxed),
            forced: self.forced.load(Ordering::Relaxed),
            launched_beside_urgent: self.beside.load(Ordering::Relaxed),
            max_in_flight_at_entry: self.max_in_flight.load(Ordering::Relaxed),
            waited_ns: self.waited_ns.load(Ordering::Relaxed),
        }
    }
}

fn open(s: &State, release: Duration, now: Instant) -> bool {
    s.active == 0
        && s.left_at
            .is_none_or(|t| now.saturating_duration_since(t) >= release)
}

/// Keeps the gate armed (an urgent session alive).
#[derive(Debug)]
pub struct Armed {
    gate: Arc<Gate>,
}

impl Drop for Armed {
    fn drop(&mut self) {
        self.gate.armed.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An urgent Run inside the gate.
#[derive(Debug)]
pub struct Inside {
    gate: Arc<Gate>,
}

impl Drop for Inside {
    fn drop(&mut self) {
        self.gate.leave(Instant::now());
    }
}

/// Where to cut an iteration of `times.len()` launches (each's GPU time,
/// seconds) into segments of about `target` seconds: the start positions
/// after 0, increasing, each segment at least `target` long but the last,
/// and at most `max_segments` segments (the target grows to fit).
pub fn cut(times: &[f64], target: f64, max_segments: usize) -> Vec<usize> {
    let total: f64 = times.iter().sum();
    let max_segments = max_segments.max(1);
    let target = if target > 0.0 {
        target.max(total / max_segments as f64)
    } else {
        total / max_segments as f64
    };
    let mut bounds = Vec::new();
    let mut acc = 0.0;
    for (i, t) in times.iter().enumerate() {
        if acc >= target && acc > 0.0 {
            bounds.push(i);
            acc = 0.0;
        }
        acc += t.max(0.0);
    }
    // A short tail joins the segment before it.
    if acc < target / 2.0 {
        bounds.pop();
    }
    bounds
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn gate(mode: GateMode) -> Arc<Gate> {
        Gate::new(GateConfig {
            mode,
            ..GateConfig::default()
        })
    }

    #[test]
    fn a_gate_closed_too_long_lets_yielding_work_through_at_its_share() {
        let g = gate(GateMode::Hold);
        let _inside = g.enter();
        let t0 = Instant::now();
        assert!(!g.try_launch_at(t0), "closed");
        // Still within starve_after (50 ms): refused.
        assert!(!g.try_launch_at(t0 + Duration::from_millis(49)));
        // Past it: one segment...
        let t1 = t0 + Duration::from_millis(50);
        assert!(g.try_launch_at(t1));
        // ...not a second while it is in flight, nor before 300 µs / 0.1.
        assert!(!g.try_launch_at(t1 + Duration::from_millis(1)));
        g.finished();
        assert!(!g.try_launch_at(t1 + Duration::from_micros(2_999)));
        assert!(g.try_launch_at(t1 + Duration::from_millis(3)));
        g.finished();
        let s = g.stats();
        assert_eq!((s.forced, s.launched_beside_urgent), (2, 2));
        // With no share, never.
        let none = Gate::new(GateConfig {
            min_share: 0.0,
            ..GateConfig::default()
        });
        let _inside = none.enter();
        assert!(!none.try_launch_at(t0));
        assert!(!none.try_launch_at(t0 + Duration::from_secs(10)));
    }

    #[test]
    fn max_in_flight_bounds_the_segments_of_all_yielding_programs() {
        let g = Gate::new(GateConfig {
            max_in_flight: 2,
            ..GateConfig::default()
        });
        let t0 = Instant::now();
        // Three programs ask with the gate open: two go, the third waits
        // for one of them to finish.
        assert!(g.try_launch_at(t0));
        assert!(g.try_launch_at(t0));
        assert!(!g.try_launch_at(t0), "a third in flight");
        g.finished();
        assert!(g.try_launch_at(t0));
        // No limit: one per program, as many programs as ask.
        let free = gate(GateMode::Hold);
        for _ in 0..8 {
            assert!(free.try_launch_at(t0));
        }
    }

    #[test]
    fn hold_refuses_while_urgent_work_runs_and_for_the_release_time() {
        let g = gate(GateMode::Hold);
        let t0 = Instant::now();
        assert!(g.try_launch_at(t0), "open with nothing urgent");
        g.finished();
        let inside = g.enter();
        assert!(!g.try_launch_at(t0), "closed while inside");
        let inside2 = g.enter();
        drop(inside);
        assert!(!g.is_open_at(Instant::now() + Duration::from_secs(1)));
        drop(inside2);
        let left = Instant::now();
        assert!(!g.try_launch_at(left), "closed for the release time");
        assert!(g.try_launch_at(left + Duration::from_micros(100)));
        let s = g.stats();
        assert_eq!(s.launches, 2);
        assert_eq!(s.refusals, 2);
        assert_eq!(s.urgent_runs, 2);
        assert_eq!(s.launched_beside_urgent, 0);
    }

    #[test]
    fn trickle_lets_one_segment_at_a_time_beside_urgent_work() {
        let g = gate(GateMode::Trickle);
        let _inside = g.enter();
        let now = Instant::now();
        assert!(g.try_launch_at(now));
        assert!(!g.try_launch_at(now), "one in flight already");
        g.finished();
        assert!(g.try_launch_at(now));
        assert_eq!(g.stats().launched_beside_urgent, 2);
    }

    #[test]
    fn trickle_stops_at_its_allowance_until_the_gate_opens_again() {
        let g = Gate::new(GateConfig {
            mode: GateMode::Trickle,
            trickle_segments: 2,
            ..GateConfig::default()
        });
        let inside = g.enter();
        let now = Instant::now();
        for _ in 0..2 {
            assert!(g.try_launch_at(now));
            g.finished();
        }
        assert!(!g.try_launch_at(now), "the allowance of 2 is spent");
        // A second urgent Run in the same closed period: no new allowance.
        let inside2 = g.enter();
        assert!(!g.try_launch_at(now));
        drop((inside, inside2));
        let left = Instant::now();
        assert!(!g.try_launch_at(left), "closed for the release time");
        // Open: launches as usual, and the next closed period trickles again.
        let later = left + Duration::from_micros(100);
        assert!(g.try_launch_at(later));
        g.finished();
        std::thread::sleep(Duration::from_micros(150));
        let _inside = g.enter();
        assert!(g.try_launch_at(Instant::now()));
        assert_eq!(g.stats().launched_beside_urgent, 3);
    }

    #[test]
    fn an_urgent_run_records_what_was_in_flight_when_it_entered() {
        let g = gate(GateMode::Hold);
        assert!(g.try_launch());
        let a = g.enter();
        drop(a);
        g.finished();
        let _b = g.enter();
        assert_eq!(g.stats().max_in_flight_at_entry, 1);
    }

    #[test]
    fn arming_counts_urgent_sessions() {
        let g = gate(GateMode::Hold);
        assert!(!g.armed());
        let a = g.arm();
        let b = g.arm();
        drop(a);
        assert!(g.armed());
        drop(b);
        assert!(!g.armed());
    }

    #[test]
    fn acquire_waits_for_the_gate_to_open() {
        let g = gate(GateMode::Hold);
        let inside = g.enter();
        let g2 = Arc::clone(&g);
        let waiter = std::thread::spawn(move || {
            g2.acquire();
            g2.finished();
        });
        while g.stats().refusals == 0 {
            std::thread::yield_now();
        }
        assert_eq!(g.stats().launches, 0, "nothing launched while inside");
        drop(inside);
        waiter.join().unwrap();
        assert_eq!(g.stats().launches, 1);
        assert!(g.stats().waited_ns > 0);
    }

    #[test]
    fn cuts_at_the_target_and_folds_a_short_tail() {
        let t = [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05];
        // 0.2 each: [0,1] [2,3] [4,5] [6,7] (the tail 0.15 ≥ 0.1 stays).
        assert_eq!(cut(&t, 0.2, 100), vec![2, 4, 6]);
        // A tail under half the target joins the last segment.
        assert_eq!(cut(&[0.3, 0.3, 0.1], 0.3, 100), vec![1]);
        // Capped: at most 2 segments.
        assert_eq!(cut(&t, 0.05, 2).len(), 1);
        // Nothing to cut.
        assert!(cut(&[0.1], 1.0, 10).is_empty());
        assert!(cut(&[], 1.0, 10).is_empty());
        // Zero-time launches (fused nodes) never make a segment alone.
        assert_eq!(cut(&[0.0, 0.0, 0.2, 0.0, 0.2], 0.2, 10), vec![3]);
    }
}
