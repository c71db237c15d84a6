//! `bench deploy`'s numbers: latency quantiles of hits and misses per
//! model kind and overall, their ratios to the goals' references, loads
//! per kind (the cold first against cached repeats) and throughput.

use serde_json::{json, Value};

use super::clients::{ClientOut, LoadRecord, RequestRecord};
use super::plan::Plan;

/// Nearest-rank quantile; `None` for no samples.
pub fn quantile(v: &[f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Some(s[((s.len() - 1) as f64 * q).round() as usize])
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.zip(b).filter(|(_, b)| *b > 0.0).map(|(a, b)| a / b)
}

/// The timed requests of a phase (the warm-up left out), in sequence order.
pub fn timed(outs: &[ClientOut], warmup: usize) -> Vec<RequestRecord> {
    let mut v: Vec<RequestRecord> = outs
        .iter()
        .flat_map(|o| o.requests.iter().cloned())
        .filter(|r| r.index >= warmup)
        .collect();
    v.sort_by_key(|r| r.index);
    v
}

/// Completed requests per second, from the first scheduled send to the
/// last reply.
pub fn throughput(reqs: &[RequestRecord]) -> Option<f64> {
    let from = reqs.iter().map(|r| r.scheduled_s).reduce(f64::min)?;
    let to = reqs.iter().map(|r| r.done_s).reduce(f64::max)?;
    (to > from).then(|| reqs.len() as f64 / (to - from))
}

/// Latencies of the baseline phase: overall and per kind.
pub struct Baseline {
    pub all: Vec<f64>,
    pub per_kind: Vec<Vec<f64>>,
}

impl Baseline {
    pub fn new(reqs: &[RequestRecord], plan: &Plan, kinds: usize) -> Baseline {
        let mut per_kind = vec![Vec::new(); kinds];
        for r in reqs {
            per_kind[plan.kind[r.model]].push(r.latency_ms);
        }
        Baseline {
            all: reqs.iter().map(|r| r.latency_ms).collect(),
            per_kind,
        }
    }

    pub fn json(&self, names: &[String]) -> Value {
        let per_kind: serde_json::Map<String, Value> = names
            .iter()
            .zip(&self.per_kind)
            .map(|(n, v)| {
                (
                    n.clone(),
                    json!({"requests": v.len(), "p50_ms": quantile(v, 0.5), "p99_ms": quantile(v, 0.99)}),
                )
            })
            .collect();
        json!({
            "requests": self.all.len(),
            "p50_ms": quantile(&self.all, 0.5),
            "p99_ms": quantile(&self.all, 0.99),
            "per_kind": per_kind,
        })
    }
}

/// Hits and misses of some requests, against the references: the
/// baseline's p99 and, per request, its kind's switching bound.
fn group(
    reqs: &[&RequestRecord],
    baseline_p99: Option<f64>,
    bound_of: &dyn Fn(usize) -> f64,
) -> Value {
    let hits: Vec<f64> = reqs
        .iter()
        .filter(|r| !r.miss)
        .map(|r| r.latency_ms)
        .collect();
    let misses: Vec<f64> = reqs
        .iter()
        .filter(|r| r.miss)
        .map(|r| r.latency_ms)
        .collect();
    // A miss against its own kind's bound (kinds differ in the mix).
    let over_bound: Vec<f64> = reqs
        .iter()
        .filter(|r| r.miss)
        .map(|r| r.latency_ms / bound_of(r.model))
        .collect();
    let all: Vec<f64> = reqs.iter().map(|r| r.latency_ms).collect();
    // The service's part: from the actual send to the reply.
    let served = |miss: bool| -> Vec<f64> {
        reqs.iter()
            .filter(|r| r.miss == miss)
            .map(|r| r.latency_ms - r.late_ms)
            .collect()
    };
    let late: Vec<f64> = reqs.iter().map(|r| r.late_ms).collect();
    let hit_p99 = quantile(&hits, 0.99);
    json!({
        "requests": reqs.len(),
        "hits": hits.len(),
        "misses": misses.len(),
        "miss_rate": if reqs.is_empty() { None } else { Some(misses.len() as f64 / reqs.len() as f64) },
        "p50_ms": quantile(&all, 0.5),
        "p99_ms": quantile(&all, 0.99),
        "hit_p50_ms": quantile(&hits, 0.5),
        "hit_p99_ms": hit_p99,
        "miss_p50_ms": quantile(&misses, 0.5),
        "miss_p99_ms": quantile(&misses, 0.99),
        "baseline_p99_ms": baseline_p99,
        "hit_p99_over_baseline_p99": ratio(hit_p99, baseline_p99),
        "miss_p99_over_bound": quantile(&over_bound, 0.99),
        "late_p99_ms": quantile(&late, 0.99),
        "hit_served_p99_ms": quantile(&served(false), 0.99),
        "miss_served_p99_ms": quantile(&served(true), 0.99),
    })
}

/// The constrained phase: per kind and overall.
pub fn constrained(
    reqs: &[RequestRecord],
    plan: &Plan,
    names: &[String],
    baseline: &Baseline,
    bounds_ms: &[f64],
) -> (Value, serde_json::Map<String, Value>) {
    let bound_of = |m: usize| bounds_ms[plan.kind[m]];
    let all: Vec<&RequestRecord> = reqs.iter().collect();
    let overall = group(&all, quantile(&baseline.all, 0.99), &bound_of);
    let per_kind = names
        .iter()
        .enumerate()
        .map(|(k, n)| {
            let of_kind: Vec<&RequestRecord> =
                reqs.iter().filter(|r| plan.kind[r.model] == k).collect();
            let mut g = group(&of_kind, quantile(&baseline.per_kind[k], 0.99), &bound_of);
            if let Some(o) = g.as_object_mut() {
                o.insert("switch_bound_ms".into(), bounds_ms[k].into());
            }
            (n.clone(), g)
        })
        .collect();
    (overall, per_kind)
}

/// Loads per kind: the first (cold: its architecture not seen before in
/// the process, unless an earlier phase loaded it) and the rest (found in
/// the load cache), milliseconds.
pub fn loads(outs: &[ClientOut], plan: &Plan, names: &[String], wall_ms: f64) -> Value {
    let all: Vec<&LoadRecord> = outs.iter().flat_map(|o| o.loads.iter()).collect();
    let per_kind: serde_json::Map<String, Value> = names
        .iter()
        .enumerate()
        .map(|(k, n)| {
            let of: Vec<&&LoadRecord> = all.iter().filter(|l| plan.kind[l.model] == k).collect();
            let first = of.iter().find(|l| l.first).map(|l| l.load_ms);
            let rest: Vec<f64> = of.iter().filter(|l| !l.first).map(|l| l.load_ms).collect();
            (
                n.clone(),
                json!({
                    "loads": of.len(),
                    "first_ms": first,
                    "repeat_p50_ms": quantile(&rest, 0.5),
                    "repeat_max_ms": quantile(&rest, 1.0),
                    "total_ms": of.iter().map(|l| l.load_ms).sum::<f64>(),
                }),
            )
        })
        .collect();
    json!({
        "models": all.len(),
        "wall_ms": wall_ms,
        "sum_ms": all.iter().map(|l| l.load_ms).sum::<f64>(),
        "per_kind": per_kind,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn rec(index: usize, model: usize, latency_ms: f64, miss: bool) -> RequestRecord {
        RequestRecord {
            index,
            model,
            scheduled_s: index as f64,
            done_s: index as f64 + latency_ms / 1e3,
            latency_ms,
            late_ms: 0.0,
            miss,
        }
    }

    #[test]
    fn hits_and_misses_add_up_and_ratios_use_each_kinds_bound() {
        let mix = vec![("mlp".to_string(), 1), ("lenet".to_string(), 1)];
        let plan = Plan::new(&mix, 1.0, 1, 1, 1).unwrap();
        let names: Vec<String> = mix.iter().map(|(n, _)| n.clone()).collect();
        let reqs = vec![
            rec(0, 0, 2.0, false),
            rec(1, 0, 10.0, true),
            rec(2, 1, 4.0, false),
            rec(3, 1, 30.0, true),
        ];
        let base = Baseline::new(&[rec(0, 0, 1.0, false), rec(1, 1, 4.0, false)], &plan, 2);
        let (overall, per_kind) = constrained(&reqs, &plan, &names, &base, &[5.0, 10.0]);
        assert_eq!(overall["requests"], 4);
        assert_eq!(overall["hits"], 2);
        assert_eq!(overall["misses"], 2);
        assert_eq!(overall["miss_rate"], 0.5);
        // 10/5 = 2 and 30/10 = 3: the p99 of the per-request ratios.
        assert_eq!(overall["miss_p99_over_bound"], 3.0);
        assert_eq!(overall["hit_p99_over_baseline_p99"], 1.0);
        assert_eq!(per_kind["mlp"]["hit_p99_over_baseline_p99"], 2.0);
        assert_eq!(per_kind["lenet"]["miss_p99_ms"], 30.0);
        assert_eq!(per_kind["lenet"]["switch_bound_ms"], 10.0);
        assert!(throughput(&reqs).unwrap() > 0.0);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[3.0, 1.0, 2.0], 0.5), Some(2.0));
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.99), Some(99.0));
    }
}
