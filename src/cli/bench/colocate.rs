//! `lanes bench colocate`: inference beside training on one device, as a
//! user runs it. A real `lanes serve` is started as a child process (this
//! binary, the chosen `--policy`); a training job and an inference job
//! connect through `lanes-adaptor`, each on its own connection and thread.
//!
//! 1. **Training alone**: the training job loads and iterates with one Run
//!    in flight ahead (`submit_run` / `wait_run`); its solo throughput is
//!    taken over `--train-window` seconds.
//! 2. **An inference job arrives** while training keeps iterating: the time
//!    from its OpenSession to its first reply is measured (the load, then
//!    the first Run), with the load time alone beside it.
//! 3. **Inference beside training**: `--requests` requests, one started
//!    every `--interval-ms` (or as soon as the previous one answered when
//!    it took longer); latency p50/p99/max, and the training throughput in
//!    the same window (completions inside it).
//! 4. **Inference alone**: training closes its session; the same requests
//!    again on the same (warm) inference session.
//!
//! The result is one JSON object on stdout (progress on stderr), with the
//! issue's goals evaluated: p99 beside ≤ 1.2 × p99 alone, max beside ≤
//! 2 × max alone, training inside the window ≥ 80 % of alone.
//! `benches/colocate_torch.py` is the PyTorch twin (time-slicing and MPS).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes_adaptor::wire::SessionId;
use lanes_adaptor::{Client, Optimizer, SessionSpec, Tensor};
use serde_json::{json, Value};

use super::child::{connect, open, ServeOpts, Service};
use super::paths::progress;
use super::workload::{self, Workload};

#[derive(Debug, clap::Args)]
pub struct ColocateArgs {
    #[command(flatten)]
    serve: ServeOpts,
    /// Training model (see `bench train --help`).
    #[arg(long, default_value = "resnet50")]
    train_model: String,
    #[arg(long, default_value_t = 32)]
    train_batch: usize,
    /// Inference model (see `bench infer --help`).
    #[arg(long, default_value = "resnet152")]
    infer_model: String,
    #[arg(long, default_value_t = 8)]
    infer_batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Inference requests timed beside training, and again alone.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// A request is started every this many milliseconds (or when the
    /// previous one answered, if later).
    #[arg(long, default_value_t = 5.0)]
    interval_ms: f64,
    /// Untimed inference requests after the first reply.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Seconds over which training's solo throughput is measured.
    #[arg(long, default_value_t = 5.0)]
    train_window: f64,
}

fn feeds_of(feeds: &BTreeMap<String, Tensor>) -> Vec<(String, Tensor)> {
    feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Latency summary (nearest rank), milliseconds.
fn latency(times: &[f64]) -> Value {
    let mut s = times.to_vec();
    s.sort_by(f64::total_cmp);
    let q = |p: f64| s.get(((s.len().saturating_sub(1)) as f64 * p).round() as usize);
    json!({
        "n": s.len(),
        "p50_ms": q(0.5),
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "max_ms": s.last(),
        "mean_ms": if s.is_empty() { None } else { Some(s.iter().sum::<f64>() / s.len() as f64) },
    })
}

fn get(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

/// The training job on its own thread: iterates with one Run ahead until
/// told to stop, recording when each step completed.
struct Trainer {
    stop: Arc<AtomicBool>,
    done: Arc<Mutex<Vec<Instant>>>,
    thread: std::thread::JoinHandle<anyhow::Result<f64>>,
}

impl Trainer {
    fn start(endpoint: String, w: Workload, since: Instant) -> anyhow::Result<Trainer> {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
        let (s, d) = (Arc::clone(&stop), Arc::clone(&done));
        let thread = std::thread::Builder::new()
            .name("colocate-train".into())
            .spawn(move || -> anyhow::Result<f64> {
                let r = (|| {
                    let mut client =
                        connect(&endpoint, "colocate-train", Duration::from_secs(900))?;
                    let id = open(
                        &mut client,
                        SessionSpec::training(format!("train-{}", w.model)),
                    )?;
                    let t0 = Instant::now();
                    client.load_in(id, &w.graph, w.vars.clone())?;
                    let load_ms = ms(t0.elapsed());
                    let feeds = w.random_feeds(11)?;
                    let fetch = [w.fetch.as_str()];
                    for _ in 0..3 {
                        client.run_in(id, feeds_of(&feeds), &fetch)?;
                    }
                    Ok::<_, anyhow::Error>((client, id, load_ms, feeds, fetch))
                })();
                let (mut client, id, load_ms, feeds, fetch) = match r {
                    Ok(x) => {
                        let _ = ready_tx.send(Ok(()));
                        x
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow::anyhow!("{e:#}")));
                        return Err(e);
                    }
                };
                let mut pending = client.submit_run_in(id, feeds_of(&feeds), &fetch)?;
                while !s.load(Ordering::SeqCst) {
                    let next = client.submit_run_in(id, feeds_of(&feeds), &fetch)?;
                    client.wait_run(pending)?;
                    d.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(Instant::now());
                    pending = next;
                }
                client.wait_run(pending)?;
                client.close_in(id)?;
                Ok(load_ms)
            })?;
        progress("training: loading and warming up", since);
        ready_rx
            .recv()
            .context("the training thread stopped before it was ready")??;
        Ok(Trainer { stop, done, thread })
    }

    /// Completions at or after `from` and at or before `to`.
    fn steps_between(&self, from: Instant, to: Instant) -> usize {
        self.done
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|t| **t >= from && **t <= to)
            .count()
    }

    /// Median time between completions at or after `from`, milliseconds.
    fn median_step_ms(&self, from: Instant) -> f64 {
        let done = self
            .done
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut gaps: Vec<f64> = done
            .windows(2)
            .filter(|w| w[0] >= from)
            .map(|w| ms(w[1] - w[0]))
            .collect();
        gaps.sort_by(f64::total_cmp);
        gaps.get(gaps.len() / 2).copied().unwrap_or(f64::NAN)
    }

    fn finish(self) -> anyhow::Result<f64> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the training thread panicked"))?
    }
}

/// `requests` requests, one started every `interval` (or right after the
/// previous reply when it took longer). Latencies in milliseconds, and the
/// window they span.
fn paced(
    client: &mut Client,
    id: SessionId,
    feeds: &BTreeMap<String, Tensor>,
    fetch: &[&str],
    requests: usize,
    interval: Duration,
) -> anyhow::Result<(Vec<f64>, Instant, Instant)> {
    let mut times = Vec::with_capacity(requests);
    let bar = crate::cli::bar(requests, "requests");
    let start = Instant::now();
    let mut next = start;
    for _ in 0..requests {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        let f = feeds_of(feeds);
        let t0 = Instant::now();
        client.run_in(id, f, fetch)?;
        times.push(ms(t0.elapsed()));
        bar.inc(1);
        next += interval;
    }
    bar.finish_and_clear();
    Ok((times, start, Instant::now()))
}

pub fn colocate(a: ColocateArgs) -> anyhow::Result<()> {
    if a.requests == 0 || !(a.interval_ms.is_finite() && a.interval_ms >= 0.0) {
        bail!("--requests must be positive and --interval-ms a non-negative number");
    }
    if !(a.train_window.is_finite() && a.train_window > 0.0) {
        bail!("--train-window must be a positive number of seconds");
    }
    let since = Instant::now();
    progress(
        &format!(
            "building {} training (batch {}) and {} inference (batch {})",
            a.train_model, a.train_batch, a.infer_model, a.infer_batch
        ),
        since,
    );
    let opt = Optimizer::sgd_momentum(0.01, 0.9, 0.0);
    let train = workload::training(&a.train_model, a.train_batch, a.seq, &opt)?;
    let infer = workload::inference(&a.infer_model, a.infer_batch, a.seq)?;
    let (_service, endpoint) = Service::start(&a.serve, since)?;

    // 1. Training alone.
    let trainer = Trainer::start(endpoint.clone(), train, since)?;
    progress(
        &format!("training alone for {:.1} s", a.train_window),
        since,
    );
    let w0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(a.train_window));
    let w1 = Instant::now();
    let alone_steps = trainer.steps_between(w0, w1);
    let train_alone = alone_steps as f64 / (w1 - w0).as_secs_f64();
    let train_step_ms = trainer.median_step_ms(w0);
    progress(
        &format!("training alone: {train_alone:.2} it/s (median step {train_step_ms:.2} ms)"),
        since,
    );

    // 2. The inference job arrives while training runs.
    progress("inference arrives: open, load, first Run", since);
    let mut client = connect(&endpoint, "colocate-infer", Duration::from_secs(900))?;
    let feeds = infer.random_feeds(7)?;
    let fetch = [infer.fetch.as_str()];
    let t_open = Instant::now();
    let id = open(
        &mut client,
        SessionSpec::inference(format!("infer-{}", infer.model)),
    )?;
    let t_load = Instant::now();
    client.load_in(id, &infer.graph, infer.vars.clone())?;
    let load_ms = ms(t_load.elapsed());
    let t_run = Instant::now();
    client.run_in(id, feeds_of(&feeds), &fetch)?;
    let first_run_ms = ms(t_run.elapsed());
    let arrival_ms = ms(t_open.elapsed());
    progress(
        &format!(
            "first reply {arrival_ms:.0} ms after OpenSession (load {load_ms:.0} ms, first Run {first_run_ms:.1} ms)"
        ),
        since,
    );
    for _ in 0..a.warmup {
        client.run_in(id, feeds_of(&feeds), &fetch)?;
    }

    // 3. Inference beside training.
    let interval = Duration::from_secs_f64(a.interval_ms / 1e3);
    progress(&format!("{} requests beside training", a.requests), since);
    let (beside_times, b0, b1) = paced(&mut client, id, &feeds, &fetch, a.requests, interval)?;
    let beside_steps = trainer.steps_between(b0, b1);
    let train_beside = beside_steps as f64 / (b1 - b0).as_secs_f64();
    let beside = latency(&beside_times);
    progress(
        &format!(
            "beside training: p50 {:.2} p99 {:.2} max {:.2} ms; training {train_beside:.2} it/s",
            get(&beside, "p50_ms"),
            get(&beside, "p99_ms"),
            get(&beside, "max_ms")
        ),
        since,
    );

    // 4. Inference alone.
    let train_load_ms = trainer.finish()?;
    // The training job's memory goes back as its session closes: let that
    // settle before timing alone.
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..a.warmup {
        client.run_in(id, feeds_of(&feeds), &fetch)?;
    }
    progress(&format!("{} requests alone", a.requests), since);
    let (alone_times, _, _) = paced(&mut client, id, &feeds, &fetch, a.requests, interval)?;
    let alone = latency(&alone_times);
    progress(
        &format!(
            "alone: p50 {:.2} p99 {:.2} max {:.2} ms",
            get(&alone, "p50_ms"),
            get(&alone, "p99_ms"),
            get(&alone, "max_ms")
        ),
        since,
    );
    client.close_in(id)?;

    let p99_ratio = get(&beside, "p99_ms") / get(&alone, "p99_ms");
    let max_ratio = get(&beside, "max_ms") / get(&alone, "max_ms");
    let train_ratio = train_beside / train_alone;
    // Goal 1: loaded and answered within its own load time plus one
    // iteration of the running job (its first Run included).
    let arrival_bound_ms = load_ms + train_step_ms + first_run_ms;
    let out = json!({
        "bench": "colocate",
        "device": super::child::device_arg(a.serve.device),
        "policy": a.serve.policy.name(),
        "endpoint": endpoint,
        "serve_args": a.serve.args,
        "training": {
            "model": a.train_model,
            "batch": a.train_batch,
            "load_ms": train_load_ms,
            "alone_it_per_s": train_alone,
            "alone_step_ms": train_step_ms,
            "beside_it_per_s": train_beside,
            "beside_over_alone": train_ratio,
        },
        "inference": {
            "model": a.infer_model,
            "batch": a.infer_batch,
            "interval_ms": a.interval_ms,
            "alone": alone,
            "beside_training": beside,
            "p99_beside_over_alone": p99_ratio,
            "max_beside_over_alone": max_ratio,
        },
        "arrival": {
            "open_to_first_reply_ms": arrival_ms,
            "load_ms": load_ms,
            "first_run_ms": first_run_ms,
        },
        "goals": {
            "arrival_within_load_plus_one_iteration": arrival_ms <= arrival_bound_ms,
            "p99_within_1_2x": p99_ratio <= 1.2,
            "max_within_2x": max_ratio <= 2.0,
            "training_at_least_80_percent": train_ratio >= 0.8,
        },
    });
    outln!("{out}")?;
    Ok(())
}
