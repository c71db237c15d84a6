//! Memory pressure: while a job waits in the lanes' admission queue, idle
//! jobs are evicted to host memory (inference first, least recently used
//! first; training only with `--evict-training`), and, with
//! `--evict-training`, a busy training job is asked to yield at its next
//! iteration boundary when an inference job still waits (docs/switching.md,
//! *Eviction*).

use std::collections::HashSet;
use std::time::Instant;

use lanes_adaptor::wire::{JobKind, SessionId};

use super::Frontend;

impl Frontend {
    /// Under memory pressure (a job waits in the admission queue) evicts idle
    /// resident jobs to host memory, least recently used first: inference
    /// jobs, then training jobs when `evict_training` allows. Evicting gives
    /// the job's lane memory back, which admits waiting jobs.
    pub(super) fn relieve_pressure(&mut self) {
        let Some(lanes) = self.lanes.clone() else {
            return;
        };
        if !self.config.evict_idle {
            return;
        }
        let waiting: HashSet<SessionId> = lanes
            .waiting_jobs()
            .into_iter()
            .map(|j| SessionId(j.0))
            .collect();
        if waiting.is_empty() {
            self.withdraw_yield();
            return;
        }
        let mut candidates: Vec<(bool, Instant, SessionId)> = self
            .sessions
            .iter()
            .filter(|(id, e)| {
                !waiting.contains(id)
                    && (e.spec.kind == JobKind::Inference || self.config.evict_training)
                    && self.dispatcher.is_idle(**id)
            })
            .map(|(id, e)| (e.spec.kind != JobKind::Inference, e.last_seen, *id))
            .collect();
        candidates.sort();
        let mut evicted = 0;
        for (_, _, id) in candidates {
            if lanes.waiting_jobs().is_empty() {
                break;
            }
            let Some(e) = self.sessions.get(&id) else {
                continue;
            };
            let Ok(mut s) = e.state.try_lock() else {
                continue;
            };
            if !s.is_loaded() || !s.is_resident() || !s.is_admitted() {
                continue;
            }
            let t0 = Instant::now();
            // Never waits for a lane's iteration (CPU jobs are read out of
            // the reservation in their lane's turn): a busy one is tried
            // again at the next pass.
            match s.try_evict() {
                Ok(Some(_)) => {
                    evicted += 1;
                    tracing::debug!(session = %id, ms = t0.elapsed().as_secs_f64() * 1e3, "evicted under pressure");
                }
                Ok(None) => {}
                Err(err) => tracing::warn!(session = %id, error = %err, "eviction failed"),
            }
        }
        if evicted > 0 {
            self.dispatcher.wake();
        }
        if self.config.evict_training {
            self.ask_training_to_yield(&lanes);
        }
    }

    /// Idle jobs were not enough and an inference job still waits for
    /// memory: asks the least recently seen busy training job (loaded, not
    /// itself waiting) to give its memory up at its next iteration boundary
    /// (its worker evicts it after the iteration in progress,
    /// `session/preempt.rs`). One job is asked at a time; the next pass
    /// asks another only once that one has answered and a job still waits.
    /// Training waiting for training never asks: only an inference job
    /// preempts.
    fn ask_training_to_yield(&mut self, lanes: &crate::lanes::SharedLanes) {
        let waiting: HashSet<SessionId> = lanes
            .waiting_jobs()
            .into_iter()
            .map(|j| SessionId(j.0))
            .collect();
        let inference_waits = waiting.iter().any(|id| {
            self.sessions
                .get(id)
                .is_some_and(|e| e.spec.kind == JobKind::Inference)
        });
        if !inference_waits {
            self.withdraw_yield();
            return;
        }
        if let Some(id) = self.asked {
            if let Some(e) = self.sessions.get(&id) {
                if e.yields.is_asked() && !self.dispatcher.is_idle(id) {
                    // It answers at the end of its iteration in progress.
                    return;
                }
                // It answered, or went idle (then the idle pass evicts it).
                e.yields.withdraw();
            }
            self.asked = None;
        }
        let pick = self
            .sessions
            .iter()
            .filter(|(id, e)| {
                e.spec.kind == JobKind::Training
                    && !waiting.contains(id)
                    && e.feed_types.get().is_some()
                    && !self.dispatcher.is_idle(**id)
            })
            .min_by_key(|(_, e)| e.last_seen)
            .map(|(id, e)| (*id, e.yields.clone()));
        if let Some((id, request)) = pick {
            request.ask();
            self.asked = Some(id);
            tracing::debug!(session = %id, "training job asked to yield at its iteration boundary");
        }
    }

    /// Takes back the request to yield, if one is out (nothing waits any
    /// more, or only training does).
    fn withdraw_yield(&mut self) {
        if let Some(id) = self.asked.take() {
            if let Some(e) = self.sessions.get(&id) {
                e.yields.withdraw();
            }
        }
    }
}
