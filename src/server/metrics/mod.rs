//! Prometheus metrics of a running service (`lanes serve --metrics ADDR`).
//!
//! The service feeds a [`Metrics`] from two places: each worker, as it
//! answers a request (latency, queueing delay, iterations, errors,
//! switch-in latency), and the socket thread, about twice a second (open
//! sessions, the lanes' capacity and use, the reservation, evictions).
//! [`serve_http`] answers `GET /metrics` with the text exposition format
//! on a thread of its own, holding a bounded number of connections
//! (http.rs); nothing on the request path waits for it.
//! Series of a session are removed when the session closes.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lanes_adaptor::wire::{ErrorCode, SessionId, StatusReport};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::lanes::LanesSnapshot;

mod gate;
mod http;
pub use http::{serve_http, MetricsError, MetricsServer, MAX_CONNECTIONS, REQUEST_WITHIN};
mod slo;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    session: u64,
    request: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SessionLabels {
    session: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InfoLabels {
    session: u64,
    name: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabels {
    cache: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RingLabels {
    outcome: RingOutcome,
}

/// What became of a doorbell's ring (`lanes_doorbell_rings_total`).
#[derive(
    Clone, Copy, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelValue,
)]
pub enum RingOutcome {
    /// A Run taken from the doorbell and handled.
    Taken,
    /// Anything else (garbage, another id, a request that is not a Run
    /// naming that doorbell): nothing copied unless it looked like one.
    Garbage,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneLabels {
    lane: u64,
}

/// The request kinds workers answer (`Work::name`), the values of the
/// `request` label.
const REQUEST_KINDS: [&str; 4] = ["load_graph", "run", "read_variables", "write_variables"];

fn seconds_histogram() -> Histogram {
    // 100 µs … about 52 s.
    Histogram::new(exponential_buckets(1e-4, 2.0, 20))
}

/// What the socket thread remembers between two publications.
#[derive(Debug, Default)]
struct Seen {
    /// Sessions open at the last publication, or with series since.
    sessions: HashSet<u64>,
    infos: HashMap<u64, InfoLabels>,
    lanes: HashSet<u64>,
    /// Per session, (evictions, returns) as last published.
    switches: HashMap<u64, (u64, u64)>,
    /// The load cache's (hits, misses) as last published.
    load_cache: (u64, u64),
    /// Per session with an `slo_ms`, (runs, within) as last published.
    slo: HashMap<u64, (u64, u64)>,
}

/// The service's metrics; shared by the workers, the socket thread and
/// the HTTP thread.
pub struct Metrics {
    registry: Registry,
    request_seconds: Family<RequestLabels, Histogram, fn() -> Histogram>,
    queue_seconds: Family<SessionLabels, Histogram, fn() -> Histogram>,
    iterations: Family<SessionLabels, Counter>,
    errors: Family<CodeLabels, Counter>,
    switch_in_seconds: Histogram,
    evictions: Counter,
    returns: Counter,
    sessions_open: Gauge,
    session_info: Family<InfoLabels, Gauge>,
    device_info: Family<DeviceLabels, Gauge>,
    queued: Gauge,
    lane_capacity: Family<LaneLabels, Gauge>,
    lane_used: Family<LaneLabels, Gauge>,
    lane_jobs: Family<LaneLabels, Gauge>,
    lanes_waiting: Gauge,
    reservation_bytes: Gauge,
    reservation_used_bytes: Gauge,
    doorbell_rings: Family<RingLabels, Counter>,
    doorbell_bytes: Counter,
    doorbells_closed: Counter,
    shared_mapped_bytes: Gauge,
    slo: slo::SloMetrics,
    load_phase_seconds: Family<PhaseLabels, Histogram, fn() -> Histogram>,
    loads: Family<CacheLabels, Counter>,
    load_cache_lookups: Family<CacheLabels, Counter>,
    load_cache_bytes: Gauge,
    load_cache_entries: Gauge,
    gate: gate::GateMetrics,
    seen: Mutex<Seen>,
    /// Sessions a worker created series for since the last publication: a
    /// session opened and closed between two publications is never in a
    /// report, and its series would stay for good.
    answered_for: Mutex<HashSet<u64>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn gauge_bytes(g: &Gauge, bytes: u64) {
    g.set(i64::try_from(bytes).unwrap_or(i64::MAX));
}

impl Metrics {
    /// Every series registered, under the prefix `lanes_`.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("lanes");
        let m = Metrics {
            request_seconds: Family::new_with_constructor(seconds_histogram),
            queue_seconds: Family::new_with_constructor(seconds_histogram),
            iterations: Family::default(),
            errors: Family::default(),
            switch_in_seconds: seconds_histogram(),
            evictions: Counter::default(),
            returns: Counter::default(),
            sessions_open: Gauge::default(),
            session_info: Family::default(),
            device_info: Family::default(),
            queued: Gauge::default(),
            lane_capacity: Family::default(),
            lane_used: Family::default(),
            lane_jobs: Family::default(),
            lanes_waiting: Gauge::default(),
            reservation_bytes: Gauge::default(),
            reservation_used_bytes: Gauge::default(),
            doorbell_rings: Family::default(),
            doorbell_bytes: Counter::default(),
            doorbells_closed: Counter::default(),
            shared_mapped_bytes: Gauge::default(),
            slo: slo::SloMetrics::default(),
            load_phase_seconds: Family::new_with_constructor(seconds_histogram),
            loads: Family::default(),
            load_cache_lookups: Family::default(),
            load_cache_bytes: Gauge::default(),
            load_cache_entries: Gauge::default(),
            gate: gate::GateMetrics::default(),
            seen: Mutex::new(Seen::default()),
            answered_for: Mutex::new(HashSet::new()),
            registry: Registry::default(),
        };
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival at the scheduler to its reply, per session and request kind",
            m.request_seconds.clone(),
        );
        registry.register(
            "request_queue_seconds",
            "Time a request waited for a worker (arrival to dispatch), per session",
            m.queue_seconds.clone(),
        );
        registry.register(
            "iterations",
            "Run requests answered without error, per session",
            m.iterations.clone(),
        );
        registry.register("errors", "Error replies, by error code", m.errors.clone());
        registry.register(
            "switch_in_duration_seconds",
            "Duration of Runs that began with the job's weights on the host (switch-in pipelined with the run)",
            m.switch_in_seconds.clone(),
        );
        registry.register(
            "evictions",
            "Jobs evicted to host memory",
            m.evictions.clone(),
        );
        registry.register(
            "returns",
            "Evicted jobs brought back to the device",
            m.returns.clone(),
        );
        registry.register("sessions_open", "Open sessions", m.sessions_open.clone());
        registry.register(
            "device_info",
            "1, with the device this service serves (one service per GPU: cuda:N (NAME), or cpu)",
            m.device_info.clone(),
        );
        registry.register(
            "session_info",
            "1 per open session, with its job name and kind",
            m.session_info.clone(),
        );
        registry.register(
            "requests_queued",
            "Requests waiting for a worker",
            m.queued.clone(),
        );
        registry.register(
            "lane_capacity_bytes",
            "Capacity of each open lane",
            m.lane_capacity.clone(),
        );
        registry.register(
            "lane_used_bytes",
            "Memory each lane's jobs take (sum P + max T)",
            m.lane_used.clone(),
        );
        registry.register("lane_jobs", "Jobs in each lane", m.lane_jobs.clone());
        registry.register(
            "admission_waiting",
            "Jobs waiting for room in a lane",
            m.lanes_waiting.clone(),
        );
        registry.register(
            "reservation_bytes",
            "Memory the lanes share (--memory)",
            m.reservation_bytes.clone(),
        );
        registry.register(
            "reservation_used_bytes",
            "Memory of the reservation the lanes' jobs take",
            m.reservation_used_bytes.clone(),
        );
        registry.register(
            "doorbell_rings",
            "Doorbell rings the socket thread examined, by outcome (taken: a Run handled; garbage: anything else)",
            m.doorbell_rings.clone(),
        );
        registry.register(
            "doorbell_copied_bytes",
            "Bytes copied out of doorbells (only rings that held a Run's header under the doorbell's id)",
            m.doorbell_bytes.clone(),
        );
        registry.register(
            "doorbells_closed",
            "Connections whose doorbells were closed for ringing garbage",
            m.doorbells_closed.clone(),
        );
        registry.register(
            "shared_mapped_bytes",
            "Address space the mappings of clients' shared-memory segments take (--max-shared)",
            m.shared_mapped_bytes.clone(),
        );
        m.slo.register(&mut registry);
        registry.register(
            "load_phase_duration_seconds",
            "Time of each phase of a LoadGraph that succeeded: decode (arrival to decoded), validate, variables, plan, admit, build (the executor's program and the variables' upload), warm",
            m.load_phase_seconds.clone(),
        );
        registry.register(
            "loads",
            "Graphs loaded, by whether their validated graph came from the load cache (hit) or not (miss)",
            m.loads.clone(),
        );
        registry.register(
            "load_cache_lookups",
            "Lookups in the load cache (validated graphs and memory plans), by outcome",
            m.load_cache_lookups.clone(),
        );
        registry.register(
            "load_cache_bytes",
            "Estimated bytes the load cache holds (--load-cache bounds them)",
            m.load_cache_bytes.clone(),
        );
        registry.register(
            "load_cache_entries",
            "Entries the load cache holds",
            m.load_cache_entries.clone(),
        );
        m.gate.register(&mut registry);
        Metrics { registry, ..m }
    }

    /// Publishes the device gate's counters (`exec::gate`) from now on.
    pub fn watch_gate(&self, gate: std::sync::Arc<crate::exec::gate::Gate>) {
        self.gate.watch(gate);
    }

    /// A LoadGraph succeeded: `decoded` from its arrival to its decoded
    /// form, then the session's phases.
    pub fn loaded(&self, decoded: Duration, times: &crate::session::LoadTimes) {
        self.load_phase_seconds
            .get_or_create(&PhaseLabels { phase: "decode" })
            .observe(decoded.as_secs_f64());
        for (phase, d) in times.phases() {
            self.load_phase_seconds
                .get_or_create(&PhaseLabels { phase })
                .observe(d.as_secs_f64());
        }
        let cache = if times.cached { "hit" } else { "miss" };
        self.loads.get_or_create(&CacheLabels { cache }).inc();
    }

    /// A doorbell's ring was examined: `outcome`, and the bytes copied out
    /// of the doorbell for it.
    pub fn doorbell_ring(&self, outcome: RingOutcome, copied: u64) {
        self.doorbell_rings
            .get_or_create(&RingLabels { outcome })
            .inc();
        self.doorbell_bytes.inc_by(copied);
    }

    /// A connection's doorbells were closed.
    pub fn doorbells_closed(&self) {
        self.doorbells_closed.inc();
    }

    /// The address space clients' segments take now.
    pub fn shared_mapped(&self, bytes: u64) {
        gauge_bytes(&self.shared_mapped_bytes, bytes);
    }

    /// A worker answered `request` of `session`: it waited `queued` for a
    /// worker and took `ran`; `error` is the code of an error reply;
    /// `switched_in` when a Run began with the job's weights on the host.
    pub fn answered(
        &self,
        session: SessionId,
        request: &str,
        queued: Duration,
        ran: Duration,
        error: Option<ErrorCode>,
        switched_in: bool,
    ) {
        let s = SessionLabels { session: session.0 };
        {
            let mut with_series = self
                .answered_for
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            with_series.insert(session.0);
        }
        self.request_seconds
            .get_or_create(&RequestLabels {
                session: session.0,
                request: request.to_string(),
            })
            .observe((queued + ran).as_secs_f64());
        self.queue_seconds
            .get_or_create(&s)
            .observe(queued.as_secs_f64());
        match error {
            Some(code) => self.error(code),
            None if request == "run" => {
                self.iterations.get_or_create(&s).inc();
                if switched_in {
                    self.switch_in_seconds.observe(ran.as_secs_f64());
                }
            }
            None => {}
        }
    }

    /// An error reply with `code` (from a worker or the socket thread).
    pub fn error(&self, code: ErrorCode) {
        self.errors
            .get_or_create(&CodeLabels {
                code: format!("{code:?}"),
            })
            .inc();
    }

    /// The socket thread's view: open sessions, queue, lanes, evictions.
    pub fn publish(&self, report: &StatusReport, lanes: Option<&LanesSnapshot>) {
        self.device_info
            .get_or_create(&DeviceLabels {
                device: report.device.clone(),
            })
            .set(1);
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let answered = std::mem::take(
            &mut *self
                .answered_for
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        seen.sessions.extend(answered);
        self.gate.publish();
        let c = crate::compile::cache::stats();
        let (hits, misses) = seen.load_cache;
        self.load_cache_lookups
            .get_or_create(&CacheLabels { cache: "hit" })
            .inc_by(c.hits().saturating_sub(hits));
        self.load_cache_lookups
            .get_or_create(&CacheLabels { cache: "miss" })
            .inc_by(c.misses().saturating_sub(misses));
        seen.load_cache = (c.hits(), c.misses());
        gauge_bytes(&self.load_cache_bytes, c.bytes);
        gauge_bytes(&self.load_cache_entries, c.entries);
        self.sessions_open
            .set(i64::try_from(report.sessions.len()).unwrap_or(i64::MAX));
        self.queued
            .set(i64::try_from(report.queued).unwrap_or(i64::MAX));
        let mut open = HashSet::new();
        for s in &report.sessions {
            let id = s.session.0;
            open.insert(id);
            let info = InfoLabels {
                session: id,
                name: s.spec.name.clone(),
                kind: s.spec.kind.to_string(),
            };
            self.session_info.get_or_create(&info).set(1);
            seen.infos.insert(id, info);
            let last = seen.switches.entry(id).or_default();
            self.evictions.inc_by(s.evictions.saturating_sub(last.0));
            self.returns.inc_by(s.returns.saturating_sub(last.1));
            *last = (last.0.max(s.evictions), last.1.max(s.returns));
            if let Some(a) = &s.slo {
                self.slo.publish(id, a, seen.slo.entry(id).or_default());
            }
        }
        // Closed sessions' series go.
        for gone in seen.sessions.difference(&open).copied().collect::<Vec<_>>() {
            let s = SessionLabels { session: gone };
            self.queue_seconds.remove(&s);
            self.iterations.remove(&s);
            for request in REQUEST_KINDS {
                self.request_seconds.remove(&RequestLabels {
                    session: gone,
                    request: request.to_string(),
                });
            }
            if let Some(info) = seen.infos.remove(&gone) {
                self.session_info.remove(&info);
            }
            seen.switches.remove(&gone);
            if seen.slo.remove(&gone).is_some() {
                self.slo.remove(gone);
            }
        }
        seen.sessions = open;
        let Some(snap) = lanes else {
            return;
        };
        gauge_bytes(&self.reservation_bytes, snap.capacity);
        gauge_bytes(
            &self.reservation_used_bytes,
            snap.lanes.iter().map(|l| l.used).sum(),
        );
        self.lanes_waiting
            .set(i64::try_from(snap.queue.len()).unwrap_or(i64::MAX));
        let mut lanes = HashSet::new();
        for l in &snap.lanes {
            let id = LaneLabels {
                lane: l.id.0 as u64,
            };
            lanes.insert(id.lane);
            gauge_bytes(&self.lane_capacity.get_or_create(&id), l.capacity);
            gauge_bytes(&self.lane_used.get_or_create(&id), l.used);
            self.lane_jobs
                .get_or_create(&id)
                .set(i64::try_from(l.jobs.len()).unwrap_or(i64::MAX));
        }
        for gone in seen.lanes.difference(&lanes) {
            let id = LaneLabels { lane: *gone };
            self.lane_capacity.remove(&id);
            self.lane_used.remove(&id);
            self.lane_jobs.remove(&id);
        }
        seen.lanes = lanes;
    }

    /// The text exposition of every series.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn answered_requests_show_up_and_closed_sessions_go() {
        let m = Metrics::new();
        let s = SessionId(7);
        m.answered(
            s,
            "run",
            Duration::from_millis(2),
            Duration::from_millis(5),
            None,
            true,
        );
        m.answered(
            s,
            "run",
            Duration::ZERO,
            Duration::ZERO,
            Some(ErrorCode::Internal),
            false,
        );
        m.answered(
            s,
            "read_variables",
            Duration::ZERO,
            Duration::ZERO,
            None,
            false,
        );
        let text = m.encode().unwrap();
        assert!(
            text.contains("lanes_iterations_total{session=\"7\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("lanes_errors_total{code=\"Internal\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("lanes_request_duration_seconds_count{session=\"7\",request=\"run\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("lanes_switch_in_duration_seconds_count 1"),
            "{text}"
        );
        // A report without session 7 (after one with it) removes its series.
        let mut report = StatusReport {
            server: String::new(),
            version: 0,
            device: "cpu".into(),
            policy: "fifo".into(),
            memory_bytes: None,
            lanes: None,
            lanes_json: None,
            max_lanes: 1,
            workers: 1,
            uptime_ms: 0,
            queued: 0,
            sessions: Vec::new(),
        };
        m.seen.lock().unwrap().sessions.insert(7);
        m.publish(&report, None);
        let text = m.encode().unwrap();
        assert!(!text.contains("session=\"7\""), "{text}");
        assert!(
            text.contains("lanes_device_info{device=\"cpu\"} 1"),
            "{text}"
        );
        assert!(text.contains("lanes_sessions_open 0"), "{text}");
        report.queued = 3;
        m.publish(&report, None);
        assert!(m.encode().unwrap().contains("lanes_requests_queued 3"));
    }

    #[test]
    fn a_session_closed_between_two_publications_leaves_no_series() {
        let m = Metrics::new();
        let report = StatusReport {
            server: String::new(),
            version: 0,
            device: "cpu".into(),
            policy: "fifo".into(),
            memory_bytes: None,
            lanes: None,
            lanes_json: None,
            max_lanes: 1,
            workers: 1,
            uptime_ms: 0,
            queued: 0,
            sessions: Vec::new(),
        };
        m.publish(&report, None);
        // Session 9 opens, runs and closes before the next publication: no
        // report ever lists it.
        for request in ["load_graph", "run", "run"] {
            m.answered(
                SessionId(9),
                request,
                Duration::ZERO,
                Duration::from_millis(1),
                None,
                false,
            );
        }
        let text = m.encode().unwrap();
        assert!(
            text.contains("lanes_iterations_total{session=\"9\"} 2"),
            "{text}"
        );
        m.publish(&report, None);
        let text = m.encode().unwrap();
        assert!(!text.contains("session=\"9\""), "{text}");
        // A late answer (a Run that finished after its session closed) goes
        // at the publication after it.
        m.answered(
            SessionId(9),
            "run",
            Duration::ZERO,
            Duration::ZERO,
            None,
            false,
        );
        m.publish(&report, None);
        assert!(!m.encode().unwrap().contains("session=\"9\""));
    }

    /// A session with an `slo_ms` has its attainment, counts, objective
    /// and recent p99 as series labelled by session; they go with it.
    #[test]
    fn slo_attainment_is_published_per_session() {
        use lanes_adaptor::wire::{SessionSpec, SessionState, SessionStatus, SloAttainment};
        let m = Metrics::new();
        let session = |runs, within| SessionStatus {
            session: SessionId(3),
            spec: SessionSpec::inference("r").with_slo_ms(5.0).unwrap(),
            state: SessionState::Ready,
            iterations: runs,
            idle_ms: 0,
            queueing_mean_us: 0,
            service_mean_us: 0,
            resident: true,
            evictions: 0,
            returns: 0,
            shared_bytes: 0,
            slo: Some(SloAttainment {
                slo_ms: 5.0,
                runs,
                within,
                recent_p99_ms: Some(7.5),
            }),
        };
        let mut report = StatusReport {
            server: String::new(),
            version: 0,
            device: "cpu".into(),
            policy: "priority".into(),
            memory_bytes: None,
            lanes: None,
            lanes_json: None,
            max_lanes: 1,
            workers: 1,
            uptime_ms: 0,
            queued: 0,
            sessions: vec![session(4, 3)],
        };
        m.publish(&report, None);
        report.sessions = vec![session(8, 6)];
        m.publish(&report, None);
        let text = m.encode().unwrap();
        for line in [
            "lanes_session_slo_runs_total{session=\"3\"} 8",
            "lanes_session_slo_within_total{session=\"3\"} 6",
            "lanes_session_slo_attainment{session=\"3\"} 0.75",
            "lanes_session_slo_seconds{session=\"3\"} 0.005",
            "lanes_session_slo_recent_p99_seconds{session=\"3\"} 0.0075",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        report.sessions.clear();
        m.publish(&report, None);
        let text = m.encode().unwrap();
        assert!(
            !text.contains("session=\"3\""),
            "series go with the session: {text}"
        );
    }
}
