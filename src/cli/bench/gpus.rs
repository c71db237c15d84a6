//! `lanes bench gpus`: the same jobs on one GPU and spread over two
//! (issue 34's case: 2 training jobs and 4 inference jobs). Each
//! arrangement starts its own `lanes serve` child processes, one per GPU
//! (`--device cuda:N`, as `lanes host` does), and every job, on its own
//! connection and thread, loads, warms up, waits for the others, then
//! iterates with one Run in flight ahead for `--seconds`:
//!
//! - **one**: every job on the first GPU's service;
//! - **spread**: job i of each kind on service i mod 2 (training 0 and
//!   inference 0, 2 on the first GPU; training 1 and inference 1, 3 on the
//!   second).
//!
//! Reported per arrangement: each job's samples per second, the training
//! and inference totals, and the ratios spread / one for each kind;
//! `ratio` is the smaller of the two (the goal: at least 1.9). With
//! `--device cpu` both services run on the CPU backend (a check that the
//! benchmark works, not a measurement).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::bail;
use lanes::server::DeviceChoice;
use lanes_adaptor::{Optimizer, SessionSpec, Tensor};
use serde_json::{json, Value};

use super::child::{connect, open, ServeOpts, Service};
use super::paths::progress;
use super::workload::{self, Kind, Workload};

#[derive(Debug, clap::Args)]
pub struct GpusArgs {
    /// The services (`--device` `auto` or `cuda`: GPUs `--gpus`; `cpu`:
    /// two CPU services, a check; the policy and `--serve-arg`s go to
    /// every service).
    #[command(flatten)]
    serve: ServeOpts,
    /// The two GPUs' ordinals.
    #[arg(long, default_value = "0,1")]
    gpus: String,
    /// Training model (see `bench train --help`).
    #[arg(long, default_value = "resnet18_cifar")]
    train_model: String,
    #[arg(long, default_value_t = 128)]
    train_batch: usize,
    /// Inference model (see `bench infer --help`).
    #[arg(long, default_value = "resnet50")]
    infer_model: String,
    #[arg(long, default_value_t = 8)]
    infer_batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Training jobs.
    #[arg(long, default_value_t = 2)]
    trainers: usize,
    /// Inference jobs.
    #[arg(long, default_value_t = 4)]
    inferers: usize,
    /// Untimed iterations of each job before the window.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Seconds each arrangement is timed.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
}

/// One job's measured window.
struct Measured {
    name: String,
    kind: Kind,
    service: usize,
    iterations: u64,
    seconds: f64,
    batch: usize,
}

impl Measured {
    fn samples_per_s(&self) -> f64 {
        self.iterations as f64 * self.batch as f64 / self.seconds.max(1e-9)
    }
}

/// Runs one job: load, warm up, wait at `start`, iterate for `window`.
fn run_job(
    endpoint: &str,
    w: &Workload,
    name: &str,
    warmup: usize,
    window: Duration,
    start: &Barrier,
) -> anyhow::Result<(u64, f64)> {
    // Whatever happens before the window, every job reaches the barrier
    // (a job that failed to load must not leave the others waiting).
    let prepared = (|| -> anyhow::Result<_> {
        let mut client = connect(endpoint, name, Duration::from_secs(900))?;
        let spec = match w.kind {
            Kind::Train => SessionSpec::training(name),
            Kind::Infer => SessionSpec::inference(name),
        };
        let id = open(&mut client, spec)?;
        client.load_in(id, &w.graph, w.vars.clone())?;
        let feeds = w.random_feeds(17)?;
        let list: Vec<(String, Tensor)> =
            feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
        for _ in 0..warmup {
            client.run_in(id, list.clone(), &[w.fetch.as_str()])?;
        }
        Ok((client, id, list))
    })();
    start.wait();
    let (mut client, id, list) = prepared?;
    let fetch = [w.fetch.as_str()];
    let t0 = Instant::now();
    let mut pending = client.submit_run_in(id, list.clone(), &fetch)?;
    let mut done = 0u64;
    loop {
        let more = t0.elapsed() < window;
        let next = if more {
            Some(client.submit_run_in(id, list.clone(), &fetch)?)
        } else {
            None
        };
        client.wait_run(pending)?;
        done += 1;
        match next {
            Some(n) => pending = n,
            None => break,
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    client.close_in(id)?;
    Ok((done, seconds))
}

/// Runs `jobs` (workload, service index) against `endpoints` together.
fn arrangement(
    endpoints: &[String],
    jobs: &[(&Workload, usize, usize)],
    a: &GpusArgs,
) -> anyhow::Result<Vec<Measured>> {
    let window = Duration::from_secs_f64(a.seconds);
    let start = Arc::new(Barrier::new(jobs.len()));
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(i, (w, service, batch))| {
                let endpoint = endpoints[*service].as_str();
                let start = Arc::clone(&start);
                let name = format!("{}-{i}", w.kind.name());
                s.spawn(move || {
                    let (iterations, seconds) =
                        run_job(endpoint, w, &name, a.warmup, window, &start)?;
                    Ok(Measured {
                        name,
                        kind: w.kind,
                        service: *service,
                        iterations,
                        seconds,
                        batch: *batch,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a job's thread panicked"))?
            })
            .collect()
    })
}

fn total(m: &[Measured], kind: Kind) -> f64 {
    m.iter()
        .filter(|j| j.kind == kind)
        .map(Measured::samples_per_s)
        .sum()
}

fn report(m: &[Measured]) -> Value {
    json!({
        "train_samples_per_s": total(m, Kind::Train),
        "infer_samples_per_s": total(m, Kind::Infer),
        "jobs": m.iter().map(|j| json!({
            "name": j.name,
            "service": j.service,
            "iterations": j.iterations,
            "seconds": j.seconds,
            "samples_per_s": j.samples_per_s(),
        })).collect::<Vec<_>>(),
    })
}

/// The services' `--device` values: `cuda:N` for the ordinals given, or
/// `cpu` twice.
fn devices(a: &GpusArgs) -> anyhow::Result<[String; 2]> {
    if a.serve.device == DeviceChoice::Cpu {
        return Ok(["cpu".into(), "cpu".into()]);
    }
    let list: Vec<usize> = a
        .gpus
        .split(',')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow::anyhow!("--gpus takes two ordinals, e.g. 0,1"))?;
    match list.as_slice() {
        [x, y] if x != y => Ok([format!("cuda:{x}"), format!("cuda:{y}")]),
        _ => bail!("--gpus takes two different ordinals, e.g. 0,1"),
    }
}

pub fn gpus(a: GpusArgs) -> anyhow::Result<()> {
    if a.trainers + a.inferers == 0 {
        bail!("no jobs: give --trainers or --inferers");
    }
    if !(a.seconds.is_finite() && a.seconds > 0.0) {
        bail!("--seconds must be positive");
    }
    if a.serve.endpoint.is_some() {
        bail!("bench gpus starts its services on free loopback ports: leave out --endpoint");
    }
    let devices = devices(&a)?;
    let since = Instant::now();
    progress(
        &format!(
            "building {} {} training and {} {} inference graphs",
            a.trainers, a.train_model, a.inferers, a.infer_model
        ),
        since,
    );
    let mut workloads = Vec::new();
    for i in 0..a.trainers {
        let opt = Optimizer::sgd_momentum(0.01, 0.9, 0.0);
        let w = workload::training(&a.train_model, a.train_batch, a.seq, &opt)?;
        workloads.push((w, i, a.train_batch));
    }
    for i in 0..a.inferers {
        let w = workload::inference(&a.infer_model, a.infer_batch, a.seq)?;
        workloads.push((w, i, a.infer_batch));
    }

    progress(&format!("one GPU ({}): every job", devices[0]), since);
    let one = {
        let (_service, endpoint) = Service::start_with_device(&a.serve, &devices[0], since)?;
        let jobs: Vec<_> = workloads.iter().map(|(w, _, b)| (w, 0, *b)).collect();
        arrangement(&[endpoint], &jobs, &a)?
    };
    progress(
        &format!("spread over {} and {}", devices[0], devices[1]),
        since,
    );
    let spread = {
        let (_s0, e0) = Service::start_with_device(&a.serve, &devices[0], since)?;
        let (_s1, e1) = Service::start_with_device(&a.serve, &devices[1], since)?;
        let jobs: Vec<_> = workloads.iter().map(|(w, i, b)| (w, i % 2, *b)).collect();
        arrangement(&[e0, e1], &jobs, &a)?
    };
    let ratio = |kind: Kind| {
        let (o, s) = (total(&one, kind), total(&spread, kind));
        (o > 0.0).then(|| s / o)
    };
    let (rt, ri) = (ratio(Kind::Train), ratio(Kind::Infer));
    let worst = [rt, ri].into_iter().flatten().reduce(f64::min);
    let out = json!({
        "bench": "gpus",
        "devices": devices,
        "policy": a.serve.policy.name(),
        "serve_args": a.serve.args,
        "train": {"model": a.train_model, "batch": a.train_batch, "jobs": a.trainers},
        "infer": {"model": a.infer_model, "batch": a.infer_batch, "jobs": a.inferers},
        "seconds": a.seconds,
        "one_gpu": report(&one),
        "spread": report(&spread),
        "train_ratio": rt,
        "infer_ratio": ri,
        "ratio": worst,
        "goal": 1.9,
        "goal_met": worst.map(|r| r >= 1.9),
    });
    outln!("{out}")?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn measured(kind: Kind, iterations: u64, seconds: f64, batch: usize) -> Measured {
        Measured {
            name: "j".into(),
            kind,
            service: 0,
            iterations,
            seconds,
            batch,
        }
    }

    #[test]
    fn totals_are_samples_per_second_by_kind() {
        let m = [
            measured(Kind::Train, 10, 2.0, 128),
            measured(Kind::Train, 5, 1.0, 128),
            measured(Kind::Infer, 100, 4.0, 8),
        ];
        assert_eq!(total(&m, Kind::Train), 1280.0);
        assert_eq!(total(&m, Kind::Infer), 200.0);
    }
}
