//! `lanes bench deploy`: issue 32's first goal as one run. An embedded
//! service serves `--models` inference sessions of a mix of zoo models
//! (each its own weights) to `--clients` connections; requests follow
//! Zipf(`--zipf`) popularity and open-loop Poisson arrivals. The same
//! request sequence runs twice: a baseline with every model resident
//! (memory for all, or for the most popular that fit the device), then
//! the constrained phase with `--memory` for a fraction of them. Reports
//! hits and misses per kind and overall against the goals' references
//! (hit p99 / baseline p99; miss p99 / the kind's switching bound,
//! measured once per kind in the run), throughput, memory and load times.
//! One JSON object on stdout, a summary on stderr.

mod clients;
mod plan;
mod report;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes::exec::{Backend, Program};
use lanes::residency::Strategy;
use lanes::server::{self, ByteSize, DeviceChoice, ServerConfig};
use lanes::size::format_size;
use lanes_adaptor::{Client, Limits};
use serde_json::{json, Value};

use super::paths::{self, progress};
use super::workload;
use clients::{KindModel, Phase};

/// The default mix: 1,000 models whose persistent memory (about 16 GiB
/// at fp32) fits the GPU for the baseline and a 128 GiB host for the
/// evicted images.
pub const DEFAULT_MIX: &str = "resnet50:40,bert_base:20,inception_v3:40,mlp:900";

#[derive(Debug, clap::Args)]
pub struct DeployArgs {
    /// Models as name:count, e.g. `resnet50:40,mlp:900` (see `bench infer
    /// --help` for the names); each model its own weights.
    #[arg(long, default_value = DEFAULT_MIX)]
    mix: String,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// `auto` (the GPU when one is usable, else the CPU), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Concurrent client threads, each with its own connection; each loads
    /// and serves the models it owns.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Service workers (and lanes: at most this many iterations at once).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Popularity: Zipf(s) over the models, ranks shuffled across kinds.
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Poisson arrivals per second; without it, `--load` times the
    /// capacity the baseline measures (its warm-up requests sent back to
    /// back by every client, all models resident).
    #[arg(long)]
    rate: Option<f64>,
    /// Offered load when `--rate` is not given.
    #[arg(long, default_value_t = 0.5)]
    load: f64,
    /// Timed requests per phase.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Untimed requests before them (the start of the same sequence; in
    /// the baseline sent back to back, measuring the capacity).
    #[arg(long, default_value_t = 500)]
    warmup: usize,
    /// Memory of the constrained phase; without it, room for
    /// `--fit-fraction` of the models' persistent bytes (plus each lane's
    /// ephemeral arena).
    #[arg(long)]
    memory: Option<ByteSize>,
    #[arg(long, default_value_t = 0.3)]
    fit_fraction: f64,
    /// Carve the models' memory from one device reservation (as `lanes
    /// serve --reserve`).
    #[arg(long)]
    reserve: bool,
    /// Seed of the ranks, arrivals and models' weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Timed resident runs and switches per kind for the switching bound.
    #[arg(long, default_value_t = 5)]
    bound_iters: usize,
}

/// A kind's sizes as the lanes count them and its switching bound.
struct KindFacts {
    p: u64,
    t: u64,
    resident_ms: f64,
    copy_ms: Option<f64>,
    bandwidth: Option<f64>,
    pipelined_ms: f64,
    bound_ms: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The switching bound of one kind, as `bench switch` takes it: max(copy
/// of P at the measured bandwidth, resident compute), with the executor
/// alone; and the pipelined switch's median beside it.
fn switch_bound(
    backend: Backend,
    valid: lanes_adaptor::ValidGraph,
    k: &KindModel,
    iters: usize,
) -> anyhow::Result<(f64, Option<f64>, Option<f64>, f64)> {
    let mut prog = Program::new(backend, valid, k.vars.clone())?;
    let fetch = vec![k.fetch.clone()];
    let timed = |prog: &mut Program, evict: bool| -> anyhow::Result<f64> {
        if evict {
            prog.evict()?;
        }
        let t = Instant::now();
        prog.run_switching(&k.feeds, &fetch, Strategy::Pipelined)?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    for _ in 0..3 {
        timed(&mut prog, false)?;
    }
    let resident = median(
        (0..iters)
            .map(|_| timed(&mut prog, false))
            .collect::<anyhow::Result<_>>()?,
    );
    // The first eviction copies the weights out and measures the link;
    // one untimed switch records the segments.
    timed(&mut prog, true)?;
    let bandwidth = prog.bandwidth();
    let pipelined = median(
        (0..iters)
            .map(|_| timed(&mut prog, true))
            .collect::<anyhow::Result<_>>()?,
    );
    let copy = bandwidth.map(|bw| prog.persistent_bytes() as f64 / bw * 1e3);
    Ok((resident, copy, bandwidth, pipelined))
}

fn service(
    device: &str,
    a: &DeployArgs,
    memory: u64,
    limits: Limits,
) -> anyhow::Result<server::ServerHandle> {
    server::start(ServerConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        workers: a.workers,
        max_lanes: a.workers,
        device: device.into(),
        limits,
        memory_bytes: Some(memory),
        reserve: a.reserve,
        // Unpopular models may see no request for minutes.
        idle_timeout: Duration::from_secs(24 * 3600),
        ..ServerConfig::default()
    })
    .context("starting the embedded service")
}

/// Evictions, returns and the host images of evicted models, read after
/// a phase (before its clients disconnect).
fn after_phase(
    client: &mut Client,
    p_of_model: &dyn Fn(usize) -> Option<u64>,
) -> anyhow::Result<Value> {
    let st = client.status()?;
    let mine: Vec<_> = st
        .sessions
        .iter()
        .filter_map(|s| {
            let m = s
                .spec
                .name
                .strip_prefix("deploy-")?
                .split('-')
                .next()?
                .parse()
                .ok()?;
            Some((m, s))
        })
        .collect();
    let host: u64 = mine
        .iter()
        .filter(|(_, s)| s.evictions > 0)
        .filter_map(|(m, _)| p_of_model(*m))
        .sum();
    Ok(json!({
        "sessions": mine.len(),
        "resident_at_end": mine.iter().filter(|(_, s)| s.resident).count(),
        "evictions": mine.iter().map(|(_, s)| s.evictions).sum::<u64>(),
        "returns": mine.iter().map(|(_, s)| s.returns).sum::<u64>(),
        "host_image_bytes": host,
    }))
}

pub fn deploy(a: DeployArgs) -> anyhow::Result<()> {
    if a.requests == 0 || a.workers == 0 || a.clients == 0 || a.bound_iters == 0 {
        bail!("--requests, --workers, --clients and --bound-iters must be at least 1");
    }
    if !(a.fit_fraction > 0.0 && a.fit_fraction <= 1.0) {
        bail!("--fit-fraction must be in (0, 1]");
    }
    if let Some(r) = a.rate {
        if !(r.is_finite() && r > 0.0) {
            bail!("--rate must be a positive number of requests per second");
        }
    }
    if !(a.load.is_finite() && a.load > 0.0) {
        bail!("--load must be positive");
    }
    if a.rate.is_none() && a.warmup == 0 {
        bail!("--load needs --warmup ≥ 1 (the baseline's warm-up measures the capacity); or give --rate");
    }
    let mix = plan::parse_mix(&a.mix, a.seq)?;
    let names: Vec<String> = mix.iter().map(|(n, _)| n.clone()).collect();
    let plan = plan::Plan::new(&mix, a.zipf, a.warmup + a.requests, a.clients, a.seed)?;
    let device = server::resolve_device(paths::resolve(a.device)?.choice())?;
    let backend = match server::backend_of(&device) {
        lanes::session::Backend::Cuda => Backend::Cuda,
        lanes::session::Backend::Cpu => Backend::Cpu,
    };
    let since = Instant::now();
    let limits = Limits {
        max_nodes: 1 << 20,
        ..Limits::default()
    };

    // Each kind once: its graph, sizes and switching bound.
    let mut kinds = Vec::with_capacity(mix.len());
    let mut facts = Vec::with_capacity(mix.len());
    for (name, count) in &mix {
        progress(
            &format!("building {name} (×{count}) and its switching bound"),
            since,
        );
        let (w, valid) = workload::validated_inference(name, a.batch, a.seq)?;
        let (p, t) = server::admission_sizes(&device, &valid, a.reserve)?;
        let k = KindModel {
            name: name.clone(),
            feeds: w.random_feeds(7)?,
            fetch: w.fetch,
            graph: w.graph,
            vars: w.vars,
        };
        let (resident_ms, copy_ms, bandwidth, pipelined_ms) =
            switch_bound(backend, valid, &k, a.bound_iters)
                .with_context(|| format!("the switching bound of {name}"))?;
        facts.push(KindFacts {
            p,
            t,
            resident_ms,
            copy_ms,
            bandwidth,
            pipelined_ms,
            bound_ms: copy_ms.map_or(resident_ms, |c| c.max(resident_ms)),
        });
        kinds.push(k);
    }
    let p_of = |m: usize| facts[plan.kind[m]].p;
    let sum_p: u64 = (0..plan.models()).map(p_of).sum();
    let max_p = facts.iter().map(|f| f.p).max().unwrap_or(0);
    let max_t = facts.iter().map(|f| f.t).max().unwrap_or(0);
    let arenas = a.workers as u64 * max_t;
    let largest = facts
        .iter()
        .zip(&names)
        .max_by_key(|(f, _)| f.p + f.t)
        .map(|(f, n)| (n.clone(), f.p + f.t))
        .unwrap_or_default();
    progress(
        &format!(
            "{} models, persistent memory {} in all (the host images of evicted models take up to as much host memory)",
            plan.models(),
            format_size(sum_p)
        ),
        since,
    );

    // Constrained memory: a fraction of the models' P, each lane's arena.
    let memory = match a.memory {
        Some(m) => m.0,
        None => ((a.fit_fraction * sum_p as f64) as u64).max(max_p) + arenas + max_p / 2,
    };
    if memory < largest.1 {
        bail!(
            "--memory {} is less than the mix's largest model alone needs ({}: {} for P + T)",
            format_size(memory),
            largest.0,
            format_size(largest.1)
        );
    }
    // Baseline: memory for every model, or for the most popular that fit.
    let want = sum_p + arenas + max_p / 2;
    let capacity = server::memory::auto_memory(server::backend_of(&device))?.bytes;
    let (base_memory, base_models) = if want <= capacity {
        (want, (0..plan.models()).collect::<Vec<_>>())
    } else {
        let budget = capacity.saturating_sub(arenas + max_p / 2);
        (capacity, plan.most_popular_fitting(p_of, budget))
    };
    if base_models.is_empty() {
        bail!(
            "not one model fits the device's memory ({}) for the baseline",
            format_size(capacity)
        );
    }
    let base_popularity: f64 = base_models.iter().map(|&m| plan.popularity[m]).sum();

    let model_kind_p = |m: usize| plan.kind.get(m).map(|&k| facts[k].p);
    let run = |label: &str, memory: u64, models: &[usize], rate: Option<f64>| {
        progress(
            &format!(
                "{label}: {} models in {}, loading from {} clients",
                models.len(),
                format_size(memory),
                a.clients
            ),
            since,
        );
        let handle = service(&device, &a, memory, limits)?;
        let phase = Phase {
            endpoint: handle.endpoint().to_string(),
            limits,
            plan: &plan,
            kinds: &kinds,
            models,
            clients: a.clients,
            seed: a.seed,
            firsts: Barrier::new(a.clients),
            loaded: Barrier::new(a.clients + 1),
            calibrated: Barrier::new(a.clients + 1),
            calibrate: rate.is_none(),
            warmup: a.warmup,
            failed: AtomicBool::new(false),
        };
        let r = clients::run_phase(
            &phase,
            |t| {
                let warm = if phase.calibrate {
                    "back to back"
                } else {
                    "at the rate"
                };
                progress(
                    &format!(
                        "{label}: loaded in {:.1} s; {} warm-up requests {warm}",
                        t.as_secs_f64(),
                        a.warmup
                    ),
                    since,
                )
            },
            |capacity| {
                let rate = match (rate, capacity) {
                    (Some(r), _) => r,
                    (None, Some(c)) => a.load * c,
                    (None, None) => bail!("no rate and no capacity measured"),
                };
                if !(rate.is_finite() && rate > 0.0) {
                    bail!("the measured capacity gives no usable rate ({rate})");
                }
                progress(
                    &format!("{label}: {} timed requests at {rate:.1}/s", a.requests),
                    since,
                );
                Ok(rate)
            },
            |c, _| after_phase(c, &model_kind_p),
        );
        handle.shutdown().context("stopping the embedded service")?;
        r
    };

    let base = run("baseline", base_memory, &base_models, a.rate)?;
    let rate = base.rate;
    let all_models: Vec<usize> = (0..plan.models()).collect();
    let con = run("constrained", memory, &all_models, Some(rate))?;
    let (base_outs, base_load_wall, base_after) = (&base.clients, base.load_wall, &base.after);
    let (outs, load_wall, after) = (&con.clients, con.load_wall, &con.after);
    let returns_counted: u64 = outs.iter().map(|o| o.returns_end - o.returns_start).sum();
    let misses_classified = outs
        .iter()
        .flat_map(|o| o.requests.iter())
        .filter(|r| r.miss)
        .count();

    // The baseline's sequence is the constrained one's, restricted to its
    // models when they are not all.
    let base_set: HashSet<usize> = base_models.iter().copied().collect();
    let base_timed = report::timed(base_outs, a.warmup);
    let baseline = report::Baseline::new(&base_timed, &plan, names.len());
    let mut timed = report::timed(outs, a.warmup);
    let timed_all = timed.len();
    if base_models.len() < plan.models() {
        timed.retain(|r| base_set.contains(&r.model));
    }
    let bounds: Vec<f64> = facts.iter().map(|f| f.bound_ms).collect();
    let (overall, per_kind) = report::constrained(&timed, &plan, &names, &baseline, &bounds);
    let status_ms: Vec<f64> = outs
        .iter()
        .flat_map(|o| o.status_ms.iter().copied())
        .collect();
    let kinds_json: serde_json::Map<String, Value> = names
        .iter()
        .zip(&facts)
        .zip(&mix)
        .map(|((n, f), (_, count))| {
            (
                n.clone(),
                json!({
                    "models": count,
                    "persistent_bytes": f.p,
                    "ephemeral_bytes": f.t,
                    "resident_ms": f.resident_ms,
                    "copy_ms": f.copy_ms,
                    "bandwidth_gb_s": f.bandwidth.map(|b| b / 1e9),
                    "pipelined_switch_ms": f.pipelined_ms,
                    "switch_bound_ms": f.bound_ms,
                }),
            )
        })
        .collect();
    let mix_json: BTreeMap<&str, usize> = mix.iter().map(|(n, c)| (n.as_str(), *c)).collect();
    let json = json!({
        "bench": "deploy",
        "device": device,
        "batch": a.batch,
        "seq": a.seq,
        "mix": mix_json,
        "models": plan.models(),
        "clients": a.clients,
        "workers": a.workers,
        "zipf": a.zipf,
        "seed": a.seed,
        "rate_rps": rate,
        "rate_given": a.rate.is_some(),
        "capacity_rps": base.capacity,
        "load": if a.rate.is_some() { None } else { Some(a.load) },
        "requests": a.requests,
        "warmup": a.warmup,
        "reserve": a.reserve,
        "kinds": kinds_json,
        "memory": {
            "constrained_bytes": memory,
            "memory_given": a.memory.is_some(),
            "fit_fraction": if a.memory.is_some() { None } else { Some(a.fit_fraction) },
            "sum_persistent_bytes": sum_p,
            "max_ephemeral_bytes": max_t,
            "baseline_bytes": base_memory,
            "device_capacity_bytes": capacity,
            "host_image_bound_bytes": sum_p,
            "host_image_bytes": after["host_image_bytes"],
        },
        "baseline": {
            "models": base_models.len(),
            "all_models": base_models.len() == plan.models(),
            "popularity_covered": base_popularity,
            "latency": baseline.json(&names),
            "throughput_rps": report::throughput(&base_timed),
            "misses": base_timed.iter().filter(|r| r.miss).count(),
            "service": base_after,
            "loads": report::loads(base_outs, &plan, &names, base_load_wall.as_secs_f64() * 1e3),
        },
        "constrained": {
            "requests": timed_all,
            "compared_requests": timed.len(),
            "overall": overall,
            "per_kind": per_kind,
            "throughput_rps": report::throughput(&report::timed(outs, a.warmup)),
            "service": after,
            "loads": report::loads(outs, &plan, &names, load_wall.as_secs_f64() * 1e3),
            "misses_with_warmup": misses_classified,
            "returns_during_requests": returns_counted,
            "status_calls": status_ms.len(),
            "status_p50_ms": report::quantile(&status_ms, 0.5),
            "status_p99_ms": report::quantile(&status_ms, 0.99),
            "status_max_ms": report::quantile(&status_ms, 1.0),
        },
        "goals": {
            "hit_p99_over_baseline_p99": overall["hit_p99_over_baseline_p99"],
            "hit_goal": 1.2,
            "miss_p99_over_bound": overall["miss_p99_over_bound"],
            "miss_goal": 1.1,
        },
    });
    summary(&json, &names);
    outln!("{json}")?;
    Ok(())
}

/// The readable part on stderr.
fn summary(v: &Value, names: &[String]) {
    let f = |x: &Value| x.as_f64().map_or("-".to_string(), |x| format!("{x:.2}"));
    let c = &v["constrained"];
    eprintln!(
        "deploy: {} models, {:.1} req/s; baseline p99 {} ms ({} models); constrained: miss rate {}, hit p99 {} ms (×{} baseline), miss p99 {} ms (×{} bound), {} req/s",
        v["models"],
        v["rate_rps"].as_f64().unwrap_or(0.0),
        f(&v["baseline"]["latency"]["p99_ms"]),
        v["baseline"]["models"],
        f(&c["overall"]["miss_rate"]),
        f(&c["overall"]["hit_p99_ms"]),
        f(&c["overall"]["hit_p99_over_baseline_p99"]),
        f(&c["overall"]["miss_p99_ms"]),
        f(&c["overall"]["miss_p99_over_bound"]),
        f(&c["throughput_rps"]),
    );
    eprintln!(
        "  constrained: sent late p99 {} ms; from the send, hit p99 {} ms, miss p99 {} ms; Status p99 {} ms, max {} ms",
        f(&c["overall"]["late_p99_ms"]),
        f(&c["overall"]["hit_served_p99_ms"]),
        f(&c["overall"]["miss_served_p99_ms"]),
        f(&c["status_p99_ms"]),
        f(&c["status_max_ms"]),
    );
    for n in names {
        let k = &c["per_kind"][n];
        eprintln!(
            "  {n:>14}: {} requests, miss rate {}, hit p99 {} ms (×{}), miss p99 {} ms (×{} of bound {} ms)",
            k["requests"],
            f(&k["miss_rate"]),
            f(&k["hit_p99_ms"]),
            f(&k["hit_p99_over_baseline_p99"]),
            f(&k["miss_p99_ms"]),
            f(&k["miss_p99_over_bound"]),
            f(&k["switch_bound_ms"]),
        );
    }
}
