//! The device gate's series (`exec::gate`), read from its counters each
//! time the socket thread publishes.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::exec::gate::{Gate, GateStats};

#[derive(Default)]
pub(super) struct GateMetrics {
    urgent_runs: Counter,
    launches: Counter,
    beside: Counter,
    forced: Counter,
    waited: Counter<f64, AtomicU64>,
    max_in_flight: Gauge,
    /// The gate watched, and its counters as last published.
    watched: Mutex<Option<(Arc<Gate>, GateStats)>>,
}

impl GateMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "gate_urgent_runs",
            "Urgent (inference) Runs that closed the device gate while they ran",
            self.urgent_runs.clone(),
        );
        registry.register(
            "gate_segments",
            "Segments of yielding (training) iterations the gate let through",
            self.launches.clone(),
        );
        registry.register(
            "gate_segments_beside_urgent",
            "Yielding segments launched while an urgent Run ran (--gate-mode trickle)",
            self.beside.clone(),
        );
        registry.register(
            "gate_forced",
            "Yielding segments let through a gate kept closed past --gate-starve-ms",
            self.forced.clone(),
        );
        registry.register(
            "gate_wait_seconds",
            "Time yielding programs waited at the closed gate",
            self.waited.clone(),
        );
        registry.register(
            "gate_max_in_flight_at_entry",
            "Most yielding segments on the GPU when an urgent Run entered the gate",
            self.max_in_flight.clone(),
        );
    }

    pub(super) fn watch(&self, gate: Arc<Gate>) {
        let stats = gate.stats();
        *self.watched.lock().unwrap_or_else(PoisonError::into_inner) = Some((gate, stats));
        self.max_in_flight
            .set(i64::try_from(stats.max_in_flight_at_entry).unwrap_or(i64::MAX));
    }

    /// Adds what the gate counted since the last call.
    pub(super) fn publish(&self) {
        let mut watched = self.watched.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((gate, last)) = watched.as_mut() else {
            return;
        };
        let now = gate.stats();
        self.urgent_runs
            .inc_by(now.urgent_runs.saturating_sub(last.urgent_runs));
        self.launches
            .inc_by(now.launches.saturating_sub(last.launches));
        self.beside.inc_by(
            now.launched_beside_urgent
                .saturating_sub(last.launched_beside_urgent),
        );
        self.forced.inc_by(now.forced.saturating_sub(last.forced));
        self.waited
            .inc_by(now.waited_ns.saturating_sub(last.waited_ns) as f64 / 1e9);
        self.max_in_flight
            .set(i64::try_from(now.max_in_flight_at_entry).unwrap_or(i64::MAX));
        *last = now;
    }
}
