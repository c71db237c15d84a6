//! What `bench deploy` decides before anything runs: the mix of model
//! kinds, each model's popularity (Zipf over ranks shuffled across kinds),
//! the open-loop arrivals (Poisson, at unit rate until a rate is known)
//! and which client connection owns which models.

use anyhow::{bail, Context};
use rand::distributions::{Distribution, WeightedIndex};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_distr::Exp1;

use super::super::workload;

/// `--mix`: model kinds and how many models of each, in the order given.
pub fn parse_mix(text: &str, seq: usize) -> anyhow::Result<Vec<(String, usize)>> {
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((name, count)) = part.split_once(':') else {
            bail!("--mix: `{part}` is not name:count (e.g. resnet50:40,mlp:900)");
        };
        let name = name.trim();
        workload::check_model(name, seq).with_context(|| format!("--mix: `{part}`"))?;
        let count: usize = count
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("--mix: `{part}`: the count is not a whole number"))?;
        if count == 0 {
            bail!("--mix: `{part}`: a kind needs at least one model");
        }
        if kinds.iter().any(|(k, _)| k == name) {
            bail!("--mix: `{name}` is named twice");
        }
        kinds.push((name.to_string(), count));
    }
    if kinds.is_empty() {
        bail!("--mix names no model (e.g. resnet50:40,mlp:900)");
    }
    Ok(kinds)
}

/// One request of the sequence: when (seconds at unit rate, scaled by
/// 1 / rate when the phase starts) and to which model.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    /// Position in the sequence; the first `warmup` are not timed.
    pub index: usize,
    pub unit_time: f64,
    pub model: usize,
}

/// The models, their popularity, the request sequence and the owners.
#[derive(Debug)]
pub struct Plan {
    /// Kind (index into the mix) of each model.
    pub kind: Vec<usize>,
    /// Probability that a request is for each model.
    pub popularity: Vec<f64>,
    pub arrivals: Vec<Arrival>,
    /// Client (connection) that loads and serves each model.
    pub owner: Vec<usize>,
}

impl Plan {
    /// Models `1..=n` of Zipf(`s`) ranks, shuffled with `seed`; `total`
    /// arrivals of a unit-rate Poisson process; models given to `clients`
    /// owners, most popular first, each to the owner with the least
    /// popularity so far.
    pub fn new(
        mix: &[(String, usize)],
        zipf: f64,
        total: usize,
        clients: usize,
        seed: u64,
    ) -> anyhow::Result<Plan> {
        if !(zipf.is_finite() && zipf >= 0.0) {
            bail!("--zipf must be a finite number ≥ 0 (0: uniform)");
        }
        if clients == 0 {
            bail!("--clients must be at least 1");
        }
        let kind: Vec<usize> = mix
            .iter()
            .enumerate()
            .flat_map(|(k, (_, n))| std::iter::repeat_n(k, *n))
            .collect();
        let n = kind.len();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut rank: Vec<usize> = (1..=n).collect();
        rank.shuffle(&mut rng);
        let weight: Vec<f64> = rank.iter().map(|&r| (r as f64).powf(-zipf)).collect();
        let sum: f64 = weight.iter().sum();
        let popularity: Vec<f64> = weight.iter().map(|w| w / sum).collect();
        let pick = WeightedIndex::new(&popularity).context("the popularity weights")?;
        let mut t = 0.0;
        let arrivals = (0..total)
            .map(|index| {
                let gap: f64 = Exp1.sample(&mut rng);
                t += gap;
                Arrival {
                    index,
                    unit_time: t,
                    model: pick.sample(&mut rng),
                }
            })
            .collect();
        let mut by_rank: Vec<usize> = (0..n).collect();
        by_rank.sort_by_key(|&m| rank[m]);
        let mut owner = vec![0; n];
        let mut load = vec![0.0f64; clients];
        for m in by_rank {
            let c = (0..clients)
                .min_by(|&a, &b| load[a].total_cmp(&load[b]))
                .unwrap_or(0);
            owner[m] = c;
            load[c] += popularity[m];
        }
        Ok(Plan {
            kind,
            popularity,
            arrivals,
            owner,
        })
    }

    pub fn models(&self) -> usize {
        self.kind.len()
    }

    /// Models from the most popular down, as long as `fits` holds for the
    /// persistent bytes taken so far (`p_of` gives a model's).
    pub fn most_popular_fitting(&self, p_of: impl Fn(usize) -> u64, budget: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.models()).collect();
        order.sort_by(|&a, &b| self.popularity[b].total_cmp(&self.popularity[a]));
        let mut taken = 0u64;
        let mut out = Vec::new();
        for m in order {
            let p = p_of(m);
            if taken.saturating_add(p) > budget {
                break;
            }
            taken += p;
            out.push(m);
        }
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn mix() -> Vec<(String, usize)> {
        parse_mix("mlp:30, lenet:10", 8).unwrap()
    }

    #[test]
    fn mixes_parse_and_bad_ones_say_why() {
        assert_eq!(mix(), vec![("mlp".into(), 30), ("lenet".into(), 10)]);
        for (bad, why) in [
            ("", "names no model"),
            ("mlp", "not name:count"),
            ("mlp:x", "not a whole number"),
            ("mlp:0", "at least one"),
            ("vgg:3", "unknown model `vgg`"),
            ("mlp:2,mlp:3", "named twice"),
        ] {
            let e = format!("{:#}", parse_mix(bad, 8).unwrap_err());
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn popularity_is_zipf_over_shuffled_ranks_and_owners_balance_it() {
        let p = Plan::new(&mix(), 1.0, 5000, 4, 3).unwrap();
        assert_eq!(p.models(), 40);
        assert!((p.popularity.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        let mut sorted = p.popularity.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        // Rank r has weight 1/r: the top model twice the second.
        assert!((sorted[0] / sorted[1] - 2.0).abs() < 1e-9);
        // Shuffled: the top model is not simply model 0 for every seed.
        let tops: std::collections::BTreeSet<usize> = (0..8)
            .map(|s| {
                let q = Plan::new(&mix(), 1.0, 1, 4, s).unwrap();
                (0..40)
                    .max_by(|&a, &b| q.popularity[a].total_cmp(&q.popularity[b]))
                    .unwrap()
            })
            .collect();
        assert!(tops.len() > 1);
        // Arrivals increase; their models follow the popularity.
        assert!(p
            .arrivals
            .windows(2)
            .all(|w| w[1].unit_time > w[0].unit_time));
        let top = (0..40)
            .max_by(|&a, &b| p.popularity[a].total_cmp(&p.popularity[b]))
            .unwrap();
        let share = p.arrivals.iter().filter(|a| a.model == top).count() as f64 / 5000.0;
        assert!((share - p.popularity[top]).abs() < 0.03, "{share}");
        // Every client owns models, and their popularity is near a quarter.
        for c in 0..4 {
            let load: f64 = (0..40)
                .filter(|&m| p.owner[m] == c)
                .map(|m| p.popularity[m])
                .sum();
            assert!(load > 0.15 && load < 0.35, "client {c}: {load}");
        }
    }

    #[test]
    fn uniform_when_s_is_zero_and_bad_s_is_refused() {
        let p = Plan::new(&mix(), 0.0, 10, 2, 1).unwrap();
        assert!(p.popularity.iter().all(|&x| (x - 1.0 / 40.0).abs() < 1e-12));
        assert!(Plan::new(&mix(), -1.0, 10, 2, 1).is_err());
        assert!(Plan::new(&mix(), f64::NAN, 10, 2, 1).is_err());
        assert!(Plan::new(&mix(), 1.0, 10, 0, 1).is_err());
    }

    #[test]
    fn the_most_popular_that_fit_are_taken() {
        let p = Plan::new(&mix(), 1.0, 1, 2, 5).unwrap();
        let fit = p.most_popular_fitting(|_| 10, 95);
        assert_eq!(fit.len(), 9);
        let least_taken = fit
            .iter()
            .map(|&m| p.popularity[m])
            .fold(f64::INFINITY, f64::min);
        assert!((0..40)
            .filter(|m| !fit.contains(m))
            .all(|m| p.popularity[m] <= least_taken));
    }
}
