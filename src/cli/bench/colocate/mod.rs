//! `lanes bench colocate`: inference beside training on one device, as a
//! user runs it (issue 31's protocol). A real `lanes serve` is started as a
//! child process (this binary, the chosen `--policy`); `--train-jobs`
//! training jobs and `--inference-jobs` inference jobs connect through
//! `lanes-adaptor`, each on its own connection and thread.
//!
//! 1. **Training starts**: each training job loads and iterates with one
//!    Run in flight ahead ([`trainer`]).
//! 2. **The inference jobs arrive** while training runs: the first one's
//!    time from OpenSession to its first reply is measured (the load, then
//!    the first Run), with the load time alone beside it.
//! 3. **Calibration**: training paused, each inference job's median latency
//!    alone over `--calibrate` warm requests, one after the other. The
//!    interval of load L is `K × alone / L` per job (K = `--inference-jobs`:
//!    L is the inference load of all of them together, alone latency /
//!    mean interval), or `--interval-ms` as given.
//! 4. **For each L, `--repeat` times**: (a) inference alone, training
//!    paused: `--requests` requests per job, open-loop at their arrival
//!    times ([`requests::Arrivals`]: fixed pacing or Poisson, seeded by
//!    `--seed`, the job, L and the repetition); (b) training alone for
//!    `--train-window` seconds (its it/s, all jobs together); (c) the same
//!    requests, same arrival times, beside training, and training's it/s
//!    inside that window. Open loop: a request is due at its arrival time
//!    whatever the previous one did, and its latency counts from its due
//!    time, so queueing shows (both with fixed and Poisson arrivals).
//!
//! The result is one JSON object on stdout (progress on stderr): per (L,
//! repetition) each job's alone and beside p50/p99/max, the ratios, the
//! training kept (beside / alone), and issue 31's goals (p99 beside ≤ 1.10 ×
//! alone at L ≤ 0.5 and ≤ 1.25 × above, max ≤ 1.5 ×, kept ≥ 1 − L + 0.1;
//! with several inference jobs the worst job's ratio counts); per L the
//! spread (min / median / max) over the repetitions.
//! `benches/colocate_torch.py` is the PyTorch twin (time-slicing, MPS, MPS
//! with a high-priority stream), with the same arguments and JSON keys.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes_adaptor::{Optimizer, SessionSpec, Tensor};
use serde_json::{json, Value};

use super::child::{connect, open, ServeOpts, Service};
use super::paths::progress;
use super::workload;

pub(super) mod requests;
pub(super) mod trainer;

use requests::{latency, median, spread, Arrivals, InferJob};
use trainer::Trainer;

#[derive(Debug, clap::Args)]
pub struct ColocateArgs {
    #[command(flatten)]
    serve: ServeOpts,
    /// Training model (see `bench train --help`).
    #[arg(long, default_value = "resnet50")]
    train_model: String,
    #[arg(long, default_value_t = 32)]
    train_batch: usize,
    /// Training jobs beside the inference (e.g. 8 with a small model:
    /// `--train-model resnet18_cifar`).
    #[arg(long, default_value_t = 1)]
    train_jobs: usize,
    /// Inference model (see `bench infer --help`).
    #[arg(long, default_value = "resnet152")]
    infer_model: String,
    #[arg(long, default_value_t = 8)]
    infer_batch: usize,
    /// Inference jobs, each on its own connection and session, with its
    /// own arrival process.
    #[arg(long, default_value_t = 1)]
    inference_jobs: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// How requests arrive: `fixed` (one every interval) or `poisson`
    /// (exponential gaps with the interval as their mean).
    #[arg(long, value_enum, default_value_t = Arrivals::Fixed)]
    arrivals: Arrivals,
    /// Inference loads L to run (all inference jobs together: alone
    /// latency / mean interval), e.g. `0.1,0.3,0.5,0.7`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.5",
        conflicts_with = "interval_ms"
    )]
    load: Vec<f64>,
    /// A fixed mean interval between one job's requests instead of `--load`.
    #[arg(long)]
    interval_ms: Option<f64>,
    /// Requests per job timed alone, and again beside training, for each
    /// L and repetition.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Repetitions of each L.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Seed of the Poisson arrivals.
    #[arg(long, default_value_t = 31)]
    seed: u64,
    /// Untimed inference requests after the first reply.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Warm requests whose median is a job's latency alone, from which
    /// the intervals of `--load` are derived.
    #[arg(long, default_value_t = 100)]
    calibrate: usize,
    /// Seconds over which training's throughput alone is measured.
    #[arg(long, default_value_t = 5.0)]
    train_window: f64,
    /// A latency objective the inference sessions state (`slo_ms`,
    /// docs/scheduling.md); the service's count of it, over the whole
    /// bench (calibration, alone and beside), is reported.
    #[arg(long)]
    slo_ms: Option<f64>,
}

pub(super) fn feeds_of(feeds: &BTreeMap<String, Tensor>) -> Vec<(String, Tensor)> {
    feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn get(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

fn check(a: &ColocateArgs) -> anyhow::Result<()> {
    if a.requests == 0 || a.repeat == 0 || a.calibrate == 0 {
        bail!("--requests, --repeat and --calibrate must be positive");
    }
    if a.train_jobs == 0 || a.inference_jobs == 0 {
        bail!("--train-jobs and --inference-jobs must be positive");
    }
    if let Some(i) = a.interval_ms {
        if !(i.is_finite() && i >= 0.0) {
            bail!("--interval-ms must be a non-negative number");
        }
    } else if a.load.is_empty() || a.load.iter().any(|l| !(l.is_finite() && *l > 0.0)) {
        bail!("--load takes positive numbers, e.g. 0.1,0.3,0.5,0.7");
    }
    if !(a.train_window.is_finite() && a.train_window > 0.0) {
        bail!("--train-window must be a positive number of seconds");
    }
    if let Some(slo) = a.slo_ms {
        SessionSpec::inference("check")
            .with_slo_ms(slo)
            .context("--slo-ms")?;
    }
    Ok(())
}

/// Issue 31's goals for one (L, repetition).
fn goals(load: f64, p99_ratio: f64, max_ratio: f64, kept: f64) -> Value {
    let p99_bound = if load <= 0.5 { 1.10 } else { 1.25 };
    let kept_bound = 1.0 - load + 0.1;
    let p99 = p99_ratio <= p99_bound;
    let max = max_ratio <= 1.5;
    let kept_ok = kept >= kept_bound;
    json!({
        "p99_bound": p99_bound,
        "p99_within": p99,
        "max_within_1_5x": max,
        "kept_bound": kept_bound,
        "kept_at_least": kept_ok,
        "all": p99 && max && kept_ok,
    })
}

/// Training's it/s, all jobs together, completions in `[from, to]`.
fn train_rate(trainers: &[Trainer], from: Instant, to: Instant) -> f64 {
    let steps: usize = trainers.iter().map(|t| t.steps_between(from, to)).sum();
    steps as f64 / (to - from).as_secs_f64()
}

/// Every inference job's requests at once, each on its own thread and
/// arrival schedule, from one common start; their latencies and the
/// window they span.
fn drive(
    jobs: &mut [InferJob],
    schedules: &[Vec<Duration>],
) -> anyhow::Result<(Vec<Vec<f64>>, Instant, Instant)> {
    // Threads start a little ahead of the first arrival.
    let start = Instant::now() + Duration::from_millis(20);
    let times = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter_mut()
            .zip(schedules)
            .map(|(job, due)| s.spawn(move || job.open_loop(due, start)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("an inference thread panicked"))?
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    Ok((times, start, Instant::now()))
}

fn pause_all(trainers: &[Trainer]) -> anyhow::Result<()> {
    for t in trainers {
        t.pause();
        if t.is_finished() {
            bail!("a training job stopped (its error follows when the bench ends)");
        }
    }
    Ok(())
}

fn resume_all(trainers: &[Trainer]) {
    for t in trainers {
        t.resume();
    }
}

pub fn colocate(a: ColocateArgs) -> anyhow::Result<()> {
    check(&a)?;
    let since = Instant::now();
    progress(
        &format!(
            "building {} × {} training (batch {}) and {} × {} inference (batch {})",
            a.train_jobs,
            a.train_model,
            a.train_batch,
            a.inference_jobs,
            a.infer_model,
            a.infer_batch
        ),
        since,
    );
    let opt = Optimizer::sgd_momentum(0.01, 0.9, 0.0);
    let (_service, endpoint) = Service::start(&a.serve, since)?;

    // 1. Training starts.
    let mut trainers = Vec::with_capacity(a.train_jobs);
    for i in 0..a.train_jobs {
        progress(&format!("training job {i}: loading and warming up"), since);
        let w = workload::training(&a.train_model, a.train_batch, a.seq, &opt)?;
        trainers.push(Trainer::start(endpoint.clone(), w, i)?);
    }

    // 2. The inference jobs arrive while training runs.
    let mut jobs = Vec::with_capacity(a.inference_jobs);
    let mut arrival = Value::Null;
    for j in 0..a.inference_jobs {
        progress(
            &format!("inference job {j} arrives: open, load, first Run"),
            since,
        );
        let w = workload::inference(&a.infer_model, a.infer_batch, a.seq)?;
        let mut client = connect(
            &endpoint,
            &format!("colocate-infer-{j}"),
            Duration::from_secs(900),
        )?;
        let mut spec = SessionSpec::inference(format!("infer-{}-{j}", w.model));
        if let Some(slo) = a.slo_ms {
            spec = spec.with_slo_ms(slo).context("--slo-ms")?;
        }
        let t_open = Instant::now();
        let id = open(&mut client, spec)?;
        let t_load = Instant::now();
        client.load_in(id, &w.graph, w.vars.clone())?;
        let load_ms = ms(t_load.elapsed());
        let mut job = InferJob {
            client,
            id,
            feeds: w.random_feeds(7 + j as u64)?,
            fetch: w.fetch.clone(),
        };
        let t_run = Instant::now();
        job.run()?;
        let first_run_ms = ms(t_run.elapsed());
        let arrival_ms = ms(t_open.elapsed());
        if j == 0 {
            arrival = json!({
                "open_to_first_reply_ms": arrival_ms,
                "load_ms": load_ms,
                "first_run_ms": first_run_ms,
            });
        }
        progress(
            &format!("first reply {arrival_ms:.0} ms after OpenSession (load {load_ms:.0} ms, first Run {first_run_ms:.1} ms)"),
            since,
        );
        job.closed_loop(a.warmup)?;
        jobs.push(job);
    }

    // 3. Calibration: each job alone, training paused.
    pause_all(&trainers)?;
    let mut alone_ms = Vec::with_capacity(jobs.len());
    for (j, job) in jobs.iter_mut().enumerate() {
        let m = median(&job.closed_loop(a.calibrate)?);
        progress(&format!("inference job {j} alone: median {m:.3} ms"), since);
        alone_ms.push(m);
    }
    let k = jobs.len() as f64;
    let loads: Vec<Option<f64>> = match a.interval_ms {
        Some(_) => vec![None],
        None => a.load.iter().copied().map(Some).collect(),
    };

    // 4. Each L, each repetition.
    let mut runs = Vec::new();
    let mut summary = Vec::new();
    for (li, load) in loads.iter().enumerate() {
        let intervals: Vec<f64> = alone_ms
            .iter()
            .map(|m| match (load, a.interval_ms) {
                (Some(l), _) => k * m / l,
                (None, Some(i)) => i,
                (None, None) => f64::NAN,
            })
            .collect();
        if intervals.iter().any(|i| !i.is_finite()) {
            bail!("an inference job's latency alone could not be measured");
        }
        // The load as run: from the given interval when there is one.
        let l = load.unwrap_or_else(|| {
            alone_ms
                .iter()
                .zip(&intervals)
                .map(|(m, i)| m / i)
                .sum::<f64>()
        });
        let (mut p99s, mut maxes, mut kepts, mut met) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for rep in 0..a.repeat {
            let schedules: Vec<Vec<Duration>> = intervals
                .iter()
                .enumerate()
                .map(|(j, i)| {
                    let seed = a.seed ^ ((j as u64) << 32) ^ ((li as u64) << 16) ^ rep as u64;
                    a.arrivals
                        .schedule(a.requests, Duration::from_secs_f64(i / 1e3), seed)
                })
                .collect();
            progress(
                &format!(
                    "L {l:.2} repetition {rep}: {} requests per job alone",
                    a.requests
                ),
                since,
            );
            let (alone, _, _) = drive(&mut jobs, &schedules)?;
            resume_all(&trainers);
            let w0 = Instant::now();
            std::thread::sleep(Duration::from_secs_f64(a.train_window));
            let w1 = Instant::now();
            let train_alone = train_rate(&trainers, w0, w1);
            let step_ms = trainers
                .first()
                .map_or(f64::NAN, |t| t.median_step_ms(w0, w1));
            progress(&format!("L {l:.2} repetition {rep}: training alone {train_alone:.2} it/s; the requests beside it"), since);
            let (beside, b0, b1) = drive(&mut jobs, &schedules)?;
            let train_beside = train_rate(&trainers, b0, b1);
            pause_all(&trainers)?;
            let kept = train_beside / train_alone;
            let mut per_job = Vec::with_capacity(jobs.len());
            let (mut p99_ratio, mut max_ratio) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
            for (j, (al, be)) in alone.iter().zip(&beside).enumerate() {
                let (al, be) = (latency(al), latency(be));
                let p = get(&be, "p99_ms") / get(&al, "p99_ms");
                let m = get(&be, "max_ms") / get(&al, "max_ms");
                p99_ratio = p99_ratio.max(p);
                max_ratio = max_ratio.max(m);
                per_job.push(json!({
                    "job": j,
                    "interval_ms": intervals[j],
                    "alone": al,
                    "beside_training": be,
                    "p99_beside_over_alone": p,
                    "max_beside_over_alone": m,
                }));
            }
            let g = goals(l, p99_ratio, max_ratio, kept);
            met += usize::from(g["all"] == true);
            progress(
                &format!("L {l:.2} repetition {rep}: p99 × {p99_ratio:.2}, max × {max_ratio:.2}, training kept {:.0} %", kept * 100.0),
                since,
            );
            p99s.push(p99_ratio);
            maxes.push(max_ratio);
            kepts.push(kept);
            runs.push(json!({
                "load": l,
                "repetition": rep,
                "inference": per_job,
                "p99_beside_over_alone": p99_ratio,
                "max_beside_over_alone": max_ratio,
                "training": {
                    "alone_it_per_s": train_alone,
                    "alone_step_ms": step_ms,
                    "beside_it_per_s": train_beside,
                    "kept": kept,
                },
                "goals": g,
            }));
        }
        summary.push(json!({
            "load": l,
            "repetitions": a.repeat,
            "p99_beside_over_alone": spread(&p99s),
            "max_beside_over_alone": spread(&maxes),
            "training_kept": spread(&kepts),
            "goals_met": met,
        }));
    }

    let load_ms: Vec<f64> = trainers.iter().map(|t| t.load_ms).collect();
    for (i, t) in trainers.into_iter().enumerate() {
        t.finish().with_context(|| format!("training job {i}"))?;
    }
    // The service's count against the objective, per inference job.
    let mut slo = Vec::new();
    if a.slo_ms.is_some() {
        if let Some(first) = jobs.first_mut() {
            let status = first.client.status()?;
            for job in &jobs {
                let s = status.sessions.iter().find(|s| s.session == job.id);
                slo.push(s.and_then(|s| s.slo).map(|x| {
                    json!({
                        "slo_ms": x.slo_ms,
                        "runs": x.runs,
                        "within": x.within,
                        "attainment": x.attainment(),
                        "recent_p99_ms": x.recent_p99_ms,
                    })
                }));
            }
        }
    }
    for job in &mut jobs {
        job.client.close_in(job.id)?;
    }

    let out = json!({
        "bench": "colocate",
        "system": "lanes",
        "device": super::child::device_arg(a.serve.device),
        "policy": a.serve.policy.name(),
        "endpoint": endpoint,
        "serve_args": a.serve.args,
        "arrivals": a.arrivals.name(),
        "seed": a.seed,
        "requests": a.requests,
        "repeat": a.repeat,
        "training": {
            "model": a.train_model,
            "batch": a.train_batch,
            "jobs": a.train_jobs,
            "load_ms": load_ms,
        },
        "inference": {
            "model": a.infer_model,
            "batch": a.infer_batch,
            "jobs": a.inference_jobs,
            "alone_median_ms": alone_ms,
            "slo": slo,
        },
        "arrival": arrival,
        "runs": runs,
        "summary": summary,
    });
    outln!("{out}")?;
    Ok(())
}
