//! `lanes bench preempt`: PipeSwitch's own case through a real `lanes
//! serve` child. A training job iterates back to back (one Run in flight
//! ahead, `bench colocate`'s [`Trainer`]) while an inference model's
//! requests arrive one every `--interval-ms`. Two services, one after the
//! other, both with `--evict-training`:
//!
//! - **resident** (the reference): `--memory` for both jobs; the model
//!   stays on the device and its requests run beside training;
//! - **preempting**: `--memory` for the training job or the model, not both
//!   (the larger's P + T and half the smaller P). Training's arrival evicts
//!   the idle model; each request finds it evicted, the training job yields
//!   at its next iteration boundary (evicted to host memory), the model
//!   switches in pipelined and answers, and once it is idle it is evicted
//!   for training, which switches back in and goes on: every request is a
//!   miss, by the service's own rule (docs/switching.md, *Eviction*).
//!
//! Per mode: the model's latency alone (resident, before training starts),
//! training's it/s alone (`--train-window` seconds, no requests) and while
//! the requests come, each request's latency (send to reply), whether its
//! model was evicted when it was sent, and from the training job's reply
//! times: how long the request waited for training's iteration boundary
//! (send to the first training reply after it, while the request was out)
//! and how long training took to resume (reply to training's next step
//! done, which includes that step). One JSON object on stdout.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes::server;
use lanes_adaptor::wire::JobKind;
use lanes_adaptor::{Optimizer, SessionSpec};
use serde_json::{json, Value};

use super::child::{connect, open, ServeOpts, Service};
use super::colocate::ms;
use super::colocate::requests::{latency, median, InferJob};
use super::colocate::trainer::Trainer;
use super::paths::{self, progress};
use super::workload;

#[derive(Debug, clap::Args)]
pub struct PreemptArgs {
    #[command(flatten)]
    serve: ServeOpts,
    /// Training model (see `bench train --help`).
    #[arg(long, default_value = "resnet50")]
    train_model: String,
    #[arg(long, default_value_t = 32)]
    train_batch: usize,
    /// Inference model (see `bench infer --help`).
    #[arg(long, default_value = "resnet152")]
    model: String,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Timed requests per mode.
    #[arg(long, default_value_t = 20)]
    requests: usize,
    /// Time between requests (fixed pacing), milliseconds.
    #[arg(long, default_value_t = 1000.0)]
    interval_ms: f64,
    /// Seconds over which training's throughput alone is measured.
    #[arg(long, default_value_t = 5.0)]
    train_window: f64,
    /// Untimed requests before the model's latency alone is measured
    /// (over as many more).
    #[arg(long, default_value_t = 10)]
    warmup: usize,
}

fn check(a: &PreemptArgs) -> anyhow::Result<()> {
    if a.requests == 0 || a.warmup == 0 {
        bail!("--requests and --warmup must be positive");
    }
    if !(a.interval_ms.is_finite() && a.interval_ms >= 0.0) {
        bail!("--interval-ms must be a non-negative number");
    }
    if !(a.train_window.is_finite() && a.train_window > 0.0) {
        bail!("--train-window must be a positive number of seconds");
    }
    let own = ["--memory", "--no-evict", "--evict-training"];
    if let Some(x) = a
        .serve
        .args
        .iter()
        .find(|x| own.iter().any(|o| x.split('=').next() == Some(*o)))
    {
        bail!("--serve-arg={x}: the bench sets --memory and --evict-training itself");
    }
    workload::check_model(&a.train_model, a.seq)?;
    workload::check_model(&a.model, a.seq)
}

/// One mode's service memory and what it is called in the report.
struct Mode {
    name: &'static str,
    memory: u64,
}

/// The first instant of `times` after `from` (and at or before `until`).
fn first_after(times: &[Instant], from: Instant, until: Option<Instant>) -> Option<Instant> {
    times
        .iter()
        .copied()
        .find(|t| *t > from && until.is_none_or(|u| *t <= u))
}

/// One request as the bench saw it.
struct Request {
    sent: Instant,
    answered: Instant,
    /// Its model was evicted when it was sent.
    miss: bool,
}

fn run_mode(a: &PreemptArgs, mode: &Mode, since: Instant) -> anyhow::Result<Value> {
    let mut opts = a.serve.clone();
    opts.args.extend([
        "--memory".to_string(),
        mode.memory.to_string(),
        "--evict-training".to_string(),
    ]);
    let (_service, endpoint) = Service::start(&opts, since)?;

    // The model, alone on the service.
    progress(&format!("{}: loading {}", mode.name, a.model), since);
    let w = workload::inference(&a.model, a.batch, a.seq)?;
    let mut client = connect(&endpoint, "preempt-infer", Duration::from_secs(900))?;
    let id = open(
        &mut client,
        SessionSpec::inference(format!("infer-{}", w.model)),
    )?;
    client.load_in(id, &w.graph, w.vars.clone())?;
    let mut job = InferJob {
        client,
        id,
        feeds: w.random_feeds(7)?,
        fetch: w.fetch.clone(),
    };
    job.closed_loop(a.warmup)?;
    let alone_ms = median(&job.closed_loop(a.warmup)?);

    // Training arrives (in the preempting mode the idle model is evicted
    // for it) and runs alone.
    progress(
        &format!(
            "{}: training {} (batch {}) starts",
            mode.name, a.train_model, a.train_batch
        ),
        since,
    );
    let opt = Optimizer::sgd_momentum(0.01, 0.9, 0.0);
    let tw = workload::training(&a.train_model, a.train_batch, a.seq, &opt)?;
    let trainer = Trainer::start(endpoint.clone(), tw, 0)?;
    let w0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(a.train_window));
    let w1 = Instant::now();
    let train_alone = trainer.steps_between(w0, w1) as f64 / (w1 - w0).as_secs_f64();
    let step_ms = trainer.median_step_ms(w0, w1);

    // The requests, one every interval.
    progress(
        &format!(
            "{}: {} requests, one every {} ms",
            mode.name, a.requests, a.interval_ms
        ),
        since,
    );
    let interval = Duration::from_secs_f64(a.interval_ms / 1e3);
    let start = Instant::now() + Duration::from_millis(20);
    let mut requests = Vec::with_capacity(a.requests);
    for i in 0..a.requests {
        let due = start + interval * u32::try_from(i).unwrap_or(u32::MAX);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if trainer.is_finished() {
            bail!("the training job stopped (its error follows when the bench ends)");
        }
        let miss = job
            .client
            .status()?
            .sessions
            .iter()
            .find(|s| s.session == job.id)
            .is_some_and(|s| !s.resident);
        let sent = Instant::now();
        job.run()?;
        requests.push(Request {
            sent,
            answered: Instant::now(),
            miss,
        });
    }
    // Training's rate over the requests' whole span, the last interval
    // included.
    let end = start + interval * u32::try_from(a.requests).unwrap_or(u32::MAX);
    let now = Instant::now();
    if end > now {
        std::thread::sleep(end - now);
    }
    let w2 = Instant::now();
    let train_during = trainer.steps_between(start, w2) as f64 / (w2 - start).as_secs_f64();
    // The service reads a session's counts only while it is not running:
    // training paused (its Run in flight done) for the status.
    trainer.pause();
    let status = job.client.status()?;
    let (train_evictions, train_returns) = status
        .sessions
        .iter()
        .filter(|s| s.spec.kind == JobKind::Training)
        .fold((0, 0), |(e, r), s| (e + s.evictions, r + s.returns));
    let (model_evictions, model_returns) = status
        .sessions
        .iter()
        .find(|s| s.session == job.id)
        .map_or((0, 0), |s| (s.evictions, s.returns));
    let done = trainer.completions();
    trainer.finish().context("the training job")?;
    job.client.close_in(job.id)?;

    let lat: Vec<f64> = requests.iter().map(|r| ms(r.answered - r.sent)).collect();
    // Send → training's first reply while the request was out: the wait for
    // its iteration boundary (as the training client saw it).
    let boundary: Vec<f64> = requests
        .iter()
        .filter_map(|r| first_after(&done, r.sent, Some(r.answered)).map(|t| ms(t - r.sent)))
        .collect();
    let after_boundary: Vec<f64> = requests
        .iter()
        .filter_map(|r| first_after(&done, r.sent, Some(r.answered)).map(|t| ms(r.answered - t)))
        .collect();
    let resume: Vec<f64> = requests
        .iter()
        .filter_map(|r| first_after(&done, r.answered, None).map(|t| ms(t - r.answered)))
        .collect();
    let misses = requests.iter().filter(|r| r.miss).count();
    progress(
        &format!(
            "{}: p50 {:.2} ms, {misses} of {} requests found the model evicted; training {train_alone:.2} it/s alone, {train_during:.2} it/s beside",
            mode.name,
            median(&lat),
            requests.len()
        ),
        since,
    );
    Ok(json!({
        "memory_bytes": mode.memory,
        "model_alone_median_ms": alone_ms,
        "latency": latency(&lat),
        "misses": misses,
        "boundary_wait": latency(&boundary),
        "after_boundary": latency(&after_boundary),
        "training_resume": latency(&resume),
        "training": {
            "alone_it_per_s": train_alone,
            "alone_step_ms": step_ms,
            "during_requests_it_per_s": train_during,
            "kept": train_during / train_alone,
            "evictions": train_evictions,
            "returns": train_returns,
        },
        "model_evictions": model_evictions,
        "model_returns": model_returns,
    }))
}

pub fn preempt(a: PreemptArgs) -> anyhow::Result<()> {
    check(&a)?;
    let since = Instant::now();
    let device = server::resolve_device(paths::resolve(a.serve.device)?.choice())?;
    // `lanes serve` carves jobs' memory from one reservation unless told
    // not to: sizes rounded as its lanes round them.
    let reserve = !a.serve.args.iter().any(|x| x == "--no-reserve");
    let opt = Optimizer::sgd_momentum(0.01, 0.9, 0.0);
    let train = workload::training(&a.train_model, a.train_batch, a.seq, &opt)?;
    let train_valid = lanes_adaptor::validate(
        train.graph,
        &lanes_adaptor::GraphLimits {
            max_nodes: 1 << 20,
            ..lanes_adaptor::GraphLimits::default()
        },
    )
    .context("training graph does not validate")?;
    let (pt, tt) = server::admission_sizes(&device, &train_valid, reserve)?;
    let (_, infer_valid) = workload::validated_inference(&a.model, a.batch, a.seq)?;
    let (pi, ti) = server::admission_sizes(&device, &infer_valid, reserve)?;
    let one = (pt + tt).max(pi + ti);
    let tight = one + pi.min(pt) / 2;
    if pt + pi + tt.max(ti) <= tight {
        bail!("the training job and the model fit together in {tight} bytes");
    }
    let both = (pt + tt) + (pi + ti) + one / 4;
    let modes = [
        Mode {
            name: "resident",
            memory: both,
        },
        Mode {
            name: "preempting",
            memory: tight,
        },
    ];
    let mut out = serde_json::Map::new();
    for m in &modes {
        out.insert(m.name.to_string(), run_mode(&a, m, since)?);
    }
    let ratio = |q: &str| {
        let p = |m: &str| out[m]["latency"][q].as_f64().unwrap_or(f64::NAN);
        p("preempting") / p("resident")
    };
    let (p50, p99) = (ratio("p50_ms"), ratio("p99_ms"));
    let json = json!({
        "bench": "preempt",
        "device": device,
        "policy": a.serve.policy.name(),
        "serve_args": a.serve.args,
        "requests": a.requests,
        "interval_ms": a.interval_ms,
        "training": {
            "model": a.train_model,
            "batch": a.train_batch,
            "persistent_bytes": pt,
            "ephemeral_bytes": tt,
        },
        "inference": {
            "model": a.model,
            "batch": a.batch,
            "persistent_bytes": pi,
            "ephemeral_bytes": ti,
        },
        "resident": out["resident"],
        "preempting": out["preempting"],
        "p50_preempting_over_resident": p50,
        "p99_preempting_over_resident": p99,
        // PipeSwitch's log on a V100 (OSDI'20): ResNet-152 inference while
        // training holds the GPU, against the model ready.
        "pipeswitch_v100_resnet152": {"switching_ms": 43.5, "ready_ms": 37.1, "ratio": 43.5 / 37.1},
    });
    outln!("{json}")?;
    Ok(())
}
