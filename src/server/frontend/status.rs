//! What the socket thread reports: the Status reply, and the metrics'
//! view of it (`--metrics`).

use lanes_adaptor::wire::{self, SessionId, SessionState, SessionStatus, StatusReport};

use super::Frontend;

impl Frontend {
    /// Hands the metrics (`--metrics`) what `status` sees and the lanes.
    pub(super) fn publish_metrics(&mut self) {
        let Some(m) = self.config.metrics.clone() else {
            return;
        };
        let report = self.status();
        let snapshot = self.lanes.as_ref().map(|l| l.snapshot());
        m.publish(&report, snapshot.as_ref());
        m.shared_mapped(self.mapped.total());
    }

    pub(super) fn status(&mut self) -> StatusReport {
        let mut ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        ids.sort();
        let mut sessions = Vec::with_capacity(ids.len());
        for id in ids {
            let (queued, running) = self.dispatcher.session_load(id);
            let Some(e) = self.sessions.get_mut(&id) else {
                continue;
            };
            if !running {
                if let Ok(s) = e.state.try_lock() {
                    e.loaded = s.is_loaded();
                    e.iterations = s.iterations();
                    e.resident = s.is_resident();
                }
            }
            let state = if running {
                SessionState::Running
            } else if queued > 0 {
                SessionState::Queued
            } else if e.loaded {
                SessionState::Ready
            } else {
                SessionState::Open
            };
            let stats = self.dispatcher.stats(id).unwrap_or_default();
            // Current even while the session runs.
            let switches = e.switches.get();
            sessions.push(SessionStatus {
                session: id,
                spec: e.spec.clone(),
                state,
                // The session's own count is read only while it is not
                // running; the scheduler's is current.
                iterations: e.iterations.max(stats.iterations),
                idle_ms: e.last_seen.elapsed().as_millis() as u64,
                queueing_mean_us: stats.queueing_mean().as_micros() as u64,
                service_mean_us: stats.service_mean().as_micros() as u64,
                resident: e.resident,
                evictions: switches.0,
                returns: switches.1,
                shared_bytes: e.segments.values().map(|s| s.bytes().len() as u64).sum(),
                slo: e.slo.as_ref().map(|t| t.attainment()),
            });
        }
        let snapshot = self.lanes.as_ref().map(|l| l.snapshot());
        StatusReport {
            server: format!("lanes/{}", env!("CARGO_PKG_VERSION")),
            version: wire::PROTOCOL_VERSION,
            device: self.config.device.clone(),
            policy: self.dispatcher.policy().to_string(),
            memory_bytes: self.config.memory_bytes,
            lanes: snapshot.as_ref().map(|l| Box::new(l.to_string())),
            lanes_json: snapshot
                .as_ref()
                .and_then(|l| serde_json::to_string(l).ok())
                .map(Box::new),
            max_lanes: u32::try_from(self.config.max_lanes).unwrap_or(u32::MAX),
            workers: self.workers.len() as u32,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            queued: self.dispatcher.queued() as u64,
            sessions,
        }
    }
}
