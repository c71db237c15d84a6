//! The inference side of `bench colocate`: arrival processes (fixed
//! pacing, or Poisson with a seeded generator), an inference job on its own
//! connection, its requests driven open-loop, and latency summaries.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lanes_adaptor::wire::SessionId;
use lanes_adaptor::{Client, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::{feeds_of, ms};

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Arrivals {
    /// One every interval.
    Fixed,
    /// Exponential gaps with the interval as their mean (a Poisson process).
    Poisson,
}

impl Arrivals {
    pub fn name(self) -> &'static str {
        match self {
            Arrivals::Fixed => "fixed",
            Arrivals::Poisson => "poisson",
        }
    }

    /// When each of `n` requests is due, from the start: fixed at
    /// `interval` apart (the first at 0), or Poisson with mean gap
    /// `interval` drawn from `seed` (the first after one gap).
    pub fn schedule(self, n: usize, interval: Duration, seed: u64) -> Vec<Duration> {
        let mean = interval.as_secs_f64();
        match self {
            Arrivals::Fixed => (0..n)
                .map(|i| Duration::from_secs_f64(mean * i as f64))
                .collect(),
            Arrivals::Poisson => {
                let mut rng = StdRng::seed_from_u64(seed);
                let mut t = 0.0;
                (0..n)
                    .map(|_| {
                        // Inverse CDF of the exponential; 1 - u is in (0, 1].
                        let u: f64 = rng.gen_range(0.0..1.0);
                        t += -(1.0 - u).ln() * mean;
                        Duration::from_secs_f64(t)
                    })
                    .collect()
            }
        }
    }
}

/// An inference job: its own connection and session, its feeds.
pub(in crate::cli::bench) struct InferJob {
    pub(in crate::cli::bench) client: Client,
    pub(in crate::cli::bench) id: SessionId,
    pub(in crate::cli::bench) feeds: BTreeMap<String, Tensor>,
    pub(in crate::cli::bench) fetch: String,
}

impl InferJob {
    pub(in crate::cli::bench) fn run(&mut self) -> anyhow::Result<()> {
        let fetch = [self.fetch.as_str()];
        self.client.run_in(self.id, feeds_of(&self.feeds), &fetch)?;
        Ok(())
    }

    /// `n` requests one after the other; each one's latency, milliseconds.
    pub(in crate::cli::bench) fn closed_loop(&mut self, n: usize) -> anyhow::Result<Vec<f64>> {
        (0..n)
            .map(|_| {
                let t0 = Instant::now();
                self.run()?;
                Ok(ms(t0.elapsed()))
            })
            .collect()
    }

    /// Open loop: request `i` is due at `start + due[i]` whatever the
    /// previous ones did; it is sent then (or as soon as the previous one
    /// answered, when later: one Run of a session runs at a time in the
    /// service anyway) and its latency counts from its due time, so
    /// queueing behind a slow request shows. Latencies in milliseconds.
    pub(in crate::cli::bench) fn open_loop(
        &mut self,
        due: &[Duration],
        start: Instant,
    ) -> anyhow::Result<Vec<f64>> {
        let mut times = Vec::with_capacity(due.len());
        for d in due {
            let at = start + *d;
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            self.run()?;
            times.push(ms(Instant::now().saturating_duration_since(at)));
        }
        Ok(times)
    }
}

/// The value at fraction `p` (nearest rank) of sorted `s`.
fn rank(s: &[f64], p: f64) -> Option<f64> {
    let r = (s.len() as f64 * p).ceil() as usize;
    s.get(r.saturating_sub(1).min(s.len().saturating_sub(1)))
        .copied()
}

/// Latency summary (nearest rank), milliseconds.
pub(in crate::cli::bench) fn latency(times: &[f64]) -> Value {
    let mut s = times.to_vec();
    s.sort_by(f64::total_cmp);
    json!({
        "n": s.len(),
        "p50_ms": rank(&s, 0.5),
        "p90_ms": rank(&s, 0.9),
        "p99_ms": rank(&s, 0.99),
        "max_ms": s.last(),
        "mean_ms": if s.is_empty() { None } else { Some(s.iter().sum::<f64>() / s.len() as f64) },
    })
}

/// The median of `v` (the lower middle), NaN when empty.
pub(in crate::cli::bench) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(f64::NAN)
}

/// `{min, median, max}` of the repetitions' values.
pub(in crate::cli::bench) fn spread(v: &[f64]) -> Value {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({ "min": min, "median": median(v), "max": max })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn schedules_are_paced_or_poisson_with_the_mean_gap() {
        let ms = Duration::from_millis;
        let f = Arrivals::Fixed.schedule(3, ms(5), 1);
        assert_eq!(f, vec![ms(0), ms(5), ms(10)]);
        let n = 20_000;
        let p = Arrivals::Poisson.schedule(n, ms(5), 7);
        assert_eq!(p, Arrivals::Poisson.schedule(n, ms(5), 7), "seeded");
        assert_ne!(p, Arrivals::Poisson.schedule(n, ms(5), 8));
        assert!(p.windows(2).all(|w| w[0] <= w[1]));
        let mean = p[n - 1].as_secs_f64() / n as f64;
        assert!((mean - 0.005).abs() < 0.0003, "{mean}");
        // Exponential gaps: about 1/e of them exceed the mean.
        let long = p.windows(2).filter(|w| w[1] - w[0] > ms(5)).count();
        let frac = long as f64 / n as f64;
        assert!((frac - (-1.0f64).exp()).abs() < 0.02, "{frac}");
    }

    #[test]
    fn nearest_rank_summaries() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = latency(&v);
        assert_eq!(l["p50_ms"], 50.0);
        assert_eq!(l["p99_ms"], 99.0);
        assert_eq!(l["max_ms"], 100.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        let s = spread(&[3.0, 1.0, 2.0]);
        assert_eq!(
            (s["min"].as_f64(), s["max"].as_f64()),
            (Some(1.0), Some(3.0))
        );
    }
}
