//! The series of sessions that stated a latency objective
//! (`SessionSpec::slo_ms`), labelled by session, published from the status
//! report's `SloAttainment` (the socket thread's count, see
//! `server::frontend::slo`).

use std::sync::atomic::AtomicU64;

use lanes_adaptor::wire::SloAttainment;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::SessionLabels;

/// A gauge holding a float (ratios, seconds).
type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Debug, Default)]
pub(super) struct SloMetrics {
    seconds: Family<SessionLabels, FloatGauge>,
    runs: Family<SessionLabels, Counter>,
    within: Family<SessionLabels, Counter>,
    attainment: Family<SessionLabels, FloatGauge>,
    recent_p99_seconds: Family<SessionLabels, FloatGauge>,
}

impl SloMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "session_slo_seconds",
            "The latency objective a session stated (slo_ms), per session that stated one",
            self.seconds.clone(),
        );
        registry.register(
            "session_slo_runs",
            "Runs of a session with an objective answered with their outputs",
            self.runs.clone(),
        );
        registry.register(
            "session_slo_within",
            "Of them, answered within the objective (latency from the Run queued to its reply sent, in the service)",
            self.within.clone(),
        );
        registry.register(
            "session_slo_attainment",
            "Fraction of a session's Runs answered within its objective (within / runs; absent before its first Run)",
            self.attainment.clone(),
        );
        registry.register(
            "session_slo_recent_p99_seconds",
            "99th percentile of a session's latest Runs' latencies (up to 1000), per session with an objective",
            self.recent_p99_seconds.clone(),
        );
    }

    /// Session `session`'s count now; `last` is (runs, within) as last
    /// published, which the counters advance from.
    pub(super) fn publish(&self, session: u64, a: &SloAttainment, last: &mut (u64, u64)) {
        let l = SessionLabels { session };
        self.seconds.get_or_create(&l).set(a.slo_ms / 1e3);
        self.runs
            .get_or_create(&l)
            .inc_by(a.runs.saturating_sub(last.0));
        self.within
            .get_or_create(&l)
            .inc_by(a.within.saturating_sub(last.1));
        *last = (last.0.max(a.runs), last.1.max(a.within));
        if let Some(f) = a.attainment() {
            self.attainment.get_or_create(&l).set(f);
        }
        if let Some(p99) = a.recent_p99_ms {
            self.recent_p99_seconds.get_or_create(&l).set(p99 / 1e3);
        }
    }

    /// A closed session's series go.
    pub(super) fn remove(&self, session: u64) {
        let l = SessionLabels { session };
        self.seconds.remove(&l);
        self.runs.remove(&l);
        self.within.remove(&l);
        self.attainment.remove(&l);
        self.recent_p99_seconds.remove(&l);
    }
}
