//! Synthetic traces (`lanes trace gen`). The distributions are documented in
//! `docs/scheduling.md`; the same seed always gives the same trace (with the
//! same `rand` version, which `Cargo.lock` pins).

use std::time::Duration;

use lanes_policies::JobKind;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

use super::trace::TraceJob;

const MIB: f64 = (1u64 << 20) as f64;

/// Parameters of the synthetic workload.
#[derive(Debug, Clone, PartialEq)]
pub struct GenConfig {
    /// Number of jobs.
    pub jobs: usize,
    /// RNG seed.
    pub seed: u64,
    /// Mean time between submissions in seconds (Poisson arrivals).
    pub mean_interarrival_s: f64,
    /// Fraction of inference jobs.
    pub inference_fraction: f64,
}

impl Default for GenConfig {
    fn default() -> Self {
        GenConfig {
            jobs: 100,
            seed: 1,
            mean_interarrival_s: 5.0,
            inference_fraction: 0.3,
        }
    }
}

/// A log-normal with the given median and shape, clamped.
#[derive(Debug, Clone, Copy)]
struct Ln {
    median: f64,
    sigma: f64,
    min: f64,
    max: f64,
}

impl Ln {
    fn sample(self, rng: &mut impl Rng) -> f64 {
        // The parameters are the constants below (sigma > 0), so `new`
        // cannot fail; the median is a harmless answer if it ever did.
        match LogNormal::new(self.median.ln(), self.sigma) {
            Ok(d) => d.sample(rng).clamp(self.min, self.max),
            Err(_) => self.median,
        }
    }
}

/// Training: iterations, iteration ms, P MiB, T MiB.
const TRAIN: [Ln; 4] = [
    Ln {
        median: 200.0,
        sigma: 1.0,
        min: 1.0,
        max: 20_000.0,
    },
    Ln {
        median: 20.0,
        sigma: 0.5,
        min: 1.0,
        max: 1_000.0,
    },
    Ln {
        median: 256.0,
        sigma: 0.8,
        min: 1.0,
        max: 8192.0,
    },
    Ln {
        median: 512.0,
        sigma: 0.8,
        min: 1.0,
        max: 8192.0,
    },
];
/// Inference: requests (iterations), ms per request, P MiB, T MiB.
const INFER: [Ln; 4] = [
    Ln {
        median: 20.0,
        sigma: 0.8,
        min: 1.0,
        max: 2_000.0,
    },
    Ln {
        median: 5.0,
        sigma: 0.4,
        min: 0.5,
        max: 100.0,
    },
    Ln {
        median: 128.0,
        sigma: 0.6,
        min: 1.0,
        max: 4096.0,
    },
    Ln {
        median: 32.0,
        sigma: 0.6,
        min: 1.0,
        max: 4096.0,
    },
];

/// Generate a trace. Job ids are 1..=jobs in submission order.
pub fn generate(cfg: &GenConfig) -> Vec<TraceJob> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let mean = if cfg.mean_interarrival_s.is_finite() && cfg.mean_interarrival_s > 0.0 {
        cfg.mean_interarrival_s
    } else {
        GenConfig::default().mean_interarrival_s
    };
    // `mean` is finite and positive, so the rate is valid.
    let gap = Exp::new(1.0 / mean).ok();
    let mut t = 0.0f64;
    let mut jobs = Vec::with_capacity(cfg.jobs);
    for i in 0..cfg.jobs {
        if i > 0 {
            t += gap.map_or(mean, |g| g.sample(&mut rng));
        }
        let inference = rng.gen_bool(cfg.inference_fraction.clamp(0.0, 1.0));
        let (kind, d) = if inference {
            (JobKind::Inference, INFER)
        } else {
            (JobKind::Training, TRAIN)
        };
        let iterations = d[0].sample(&mut rng).round().max(1.0) as u64;
        let iter_ms = (d[1].sample(&mut rng) * 1e3).round() / 1e3;
        let p = (d[2].sample(&mut rng) * MIB).round() as u64;
        let e = (d[3].sample(&mut rng) * MIB).round() as u64;
        let priority = if inference { rng.gen_range(1..=3) } else { 0 };
        // Microsecond submit times, as the CSV writes them.
        let submit_us = (t * 1e6).round() as u64;
        jobs.push(TraceJob {
            id: i as u64 + 1,
            submit: Duration::from_micros(submit_us),
            kind,
            iterations,
            iteration: Duration::from_micros((iter_ms * 1e3).round() as u64),
            persistent_bytes: p,
            ephemeral_bytes: e,
            priority,
        });
    }
    jobs
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::sim::trace::{read_trace, write_trace};

    #[test]
    fn deterministic_for_a_seed_and_round_trips_through_csv() {
        let cfg = GenConfig {
            jobs: 200,
            seed: 7,
            ..GenConfig::default()
        };
        let a = generate(&cfg);
        assert_eq!(a, generate(&cfg));
        assert_ne!(
            a,
            generate(&GenConfig {
                seed: 8,
                ..cfg.clone()
            })
        );
        let mut buf = Vec::new();
        write_trace(&mut buf, &a).unwrap();
        assert_eq!(read_trace(buf.as_slice()).unwrap(), a);
    }

    #[test]
    fn follows_the_documented_shape() {
        let cfg = GenConfig {
            jobs: 2000,
            seed: 3,
            ..GenConfig::default()
        };
        let jobs = generate(&cfg);
        assert!(jobs.windows(2).all(|w| w[0].submit <= w[1].submit));
        let inf = jobs.iter().filter(|j| j.kind == JobKind::Inference).count() as f64;
        let frac = inf / jobs.len() as f64;
        assert!((0.25..0.35).contains(&frac), "inference fraction {frac}");
        let span = jobs.last().unwrap().submit.as_secs_f64();
        let mean_gap = span / (jobs.len() - 1) as f64;
        assert!((4.5..5.5).contains(&mean_gap), "mean gap {mean_gap}");
        let mut train_iters: Vec<u64> = jobs
            .iter()
            .filter(|j| j.kind == JobKind::Training)
            .map(|j| j.iterations)
            .collect();
        train_iters.sort_unstable();
        let median = train_iters[train_iters.len() / 2];
        assert!(
            (170..235).contains(&median),
            "median training iterations {median}"
        );
        assert!(jobs
            .iter()
            .all(|j| j.kind == JobKind::Training || (1..=3).contains(&j.priority)));
    }
}
