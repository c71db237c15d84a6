//! Per-model statistics in the form of Triton's statistics extension
//! (`GET v2/models/NAME/stats`): counts, and summed durations in
//! nanoseconds.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

#[derive(Debug, Default, Clone, Copy)]
struct Sum {
    count: u64,
    ns: u64,
}

impl Sum {
    fn add(&mut self, d: Duration) {
        self.count += 1;
        self.ns = self
            .ns
            .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }
    fn json(&self) -> Value {
        json!({ "count": self.count, "ns": self.ns })
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Milliseconds since the epoch of the last request's end.
    last_inference_ms: u64,
    /// Requests served (Triton counts one per batch row; so does this).
    inference_count: u64,
    /// Runs of the model (one per gathered batch).
    execution_count: u64,
    success: Sum,
    fail: Sum,
    queue: Sum,
    compute_input: Sum,
    compute_infer: Sum,
    compute_output: Sum,
    /// Runs by batch size: compute (infer) time.
    batches: BTreeMap<usize, Sum>,
}

/// What one request's way through the model took.
#[derive(Debug, Clone, Copy)]
pub struct RequestTimes {
    /// From its arrival at the model's thread to the start of its Run.
    pub queue: Duration,
    /// Importing and loading a session for a new batch size, if needed.
    pub input: Duration,
    /// The Run, as the client waited for it.
    pub infer: Duration,
    /// From the request's arrival to its answer.
    pub total: Duration,
}

/// A model's statistics.
#[derive(Debug, Default)]
pub struct Stats {
    inner: Mutex<Inner>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Stats {
    fn with(&self, f: impl FnOnce(&mut Inner)) {
        // A poisoned lock only means another thread panicked mid-update:
        // the counters are still numbers.
        let mut g = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g);
    }

    /// One Run of `batch` rows serving `requests` requests, each with
    /// its times.
    pub fn record_run(&self, batch: usize, rows: &[(usize, RequestTimes)], run: Duration) {
        self.with(|s| {
            s.execution_count += 1;
            s.batches.entry(batch).or_default().add(run);
            for (r, t) in rows {
                s.inference_count += *r as u64;
                s.success.add(t.total);
                s.queue.add(t.queue);
                s.compute_input.add(t.input);
                s.compute_infer.add(t.infer);
                s.compute_output.add(Duration::ZERO);
            }
            s.last_inference_ms = now_ms();
        })
    }

    /// A request that failed after `total`.
    pub fn record_failure(&self, total: Duration) {
        self.with(|s| {
            s.fail.add(total);
            s.last_inference_ms = now_ms();
        })
    }

    /// The entry of `model_stats` for this model.
    pub fn json(&self, name: &str, version: &str) -> Value {
        let mut out = Value::Null;
        self.with(|s| {
            let batches: Vec<Value> = s
                .batches
                .iter()
                .map(|(b, sum)| {
                    json!({
                        "batch_size": b,
                        "compute_input": { "count": sum.count, "ns": 0 },
                        "compute_infer": sum.json(),
                        "compute_output": { "count": sum.count, "ns": 0 },
                    })
                })
                .collect();
            out = json!({
                "name": name,
                "version": version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": s.success.json(),
                    "fail": s.fail.json(),
                    "queue": s.queue.json(),
                    "compute_input": s.compute_input.json(),
                    "compute_infer": s.compute_infer.json(),
                    "compute_output": s.compute_output.json(),
                    "cache_hit": { "count": 0, "ns": 0 },
                    "cache_miss": { "count": 0, "ns": 0 },
                },
                "batch_stats": batches,
            });
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_requests_are_counted_apart() {
        let s = Stats::default();
        let t = RequestTimes {
            queue: Duration::from_nanos(5),
            input: Duration::ZERO,
            infer: Duration::from_nanos(10),
            total: Duration::from_nanos(20),
        };
        s.record_run(3, &[(1, t), (2, t)], Duration::from_nanos(10));
        s.record_failure(Duration::from_nanos(7));
        let j = s.json("m", "1");
        assert_eq!(j["inference_count"], 3);
        assert_eq!(j["execution_count"], 1);
        assert_eq!(j["inference_stats"]["success"]["count"], 2);
        assert_eq!(j["inference_stats"]["success"]["ns"], 40);
        assert_eq!(j["inference_stats"]["fail"]["ns"], 7);
        assert_eq!(j["batch_stats"][0]["batch_size"], 3);
    }
}
