//! `lanes bench sweep`: a hyper-parameter sweep sharing one device (Salus's
//! second case). `--jobs` training jobs of one model, each with its own
//! learning rate (geometric from `--lr-min` to `--lr-max`) and `--steps`
//! iterations, go to a real `lanes serve` (a child process, `--policy`):
//!
//! - **together**: all submitted at once, each on its own connection and
//!   thread with one Run in flight ahead; the service runs them in its lanes;
//! - **one after another**: the same jobs through the same service, each
//!   started when the previous one finished (as a queue of jobs on a GPU
//!   that runs one at a time).
//!
//! Reported per mode: the makespan and each job's completion time (JCT)
//! from the common submission instant, and each job's final loss (the
//! learning rates differ, so the losses do). `benches/sweep_torch.py` runs
//! the same sweep as N PyTorch processes started together on one GPU.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes_adaptor::{Optimizer, SessionSpec, Tensor};
use serde_json::{json, Value};

use super::child::{connect, open, ServeOpts, Service};
use super::paths::progress;
use super::workload::{self, Workload};

#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// The service (`--policy` defaults to `priority`; a sweep of training
    /// jobs is usually run under `fair`, `srtf` or `fifo`).
    #[command(flatten)]
    serve: ServeOpts,
    /// Model of every job (see `bench train --help`).
    #[arg(long, default_value = "resnet18_cifar")]
    model: String,
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Training jobs in the sweep.
    #[arg(long, default_value_t = 8)]
    jobs: usize,
    /// Iterations of each job.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Smallest learning rate (SGD, momentum 0.9).
    #[arg(long, default_value_t = 0.001)]
    lr_min: f64,
    /// Largest learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr_max: f64,
    /// Skip the one-after-another run.
    #[arg(long)]
    together_only: bool,
}

/// The learning rates, geometric from `min` to `max`.
fn learning_rates(n: usize, min: f64, max: f64) -> Vec<f64> {
    if n == 1 {
        return vec![min];
    }
    (0..n)
        .map(|i| min * (max / min).powf(i as f64 / (n - 1) as f64))
        .collect()
}

/// One job's result: seconds from the common start to its last step, and
/// its last loss.
struct Finished {
    jct: f64,
    loss: f64,
}

/// Runs one job to the end through its own connection.
fn run_job(
    endpoint: &str,
    w: &Workload,
    name: &str,
    steps: usize,
    start: Instant,
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Finished> {
    let mut client = connect(endpoint, name, Duration::from_secs(900))?;
    let spec = SessionSpec::training(name).with_expected_iterations(steps as u64);
    let id = open(&mut client, spec)?;
    client.load_in(id, &w.graph, w.vars.clone())?;
    let feeds = w.random_feeds(13)?;
    let feeds_of =
        || -> Vec<(String, Tensor)> { feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect() };
    let fetch = [w.fetch.as_str()];
    let mut pending = Some(client.submit_run_in(id, feeds_of(), &fetch)?);
    let mut last = Vec::new();
    for step in 1..=steps {
        let next = if step < steps {
            Some(client.submit_run_in(id, feeds_of(), &fetch)?)
        } else {
            None
        };
        if let Some(p) = pending.take() {
            last = client.wait_run(p)?;
            progress.inc(1);
        }
        pending = next;
    }
    let jct = start.elapsed().as_secs_f64();
    client.close_in(id)?;
    let loss = last
        .first()
        .context("the run returned no loss")?
        .f32s()?
        .first()
        .copied()
        .map(f64::from)
        .unwrap_or(f64::NAN);
    Ok(Finished { jct, loss })
}

fn summary(mode: &str, lrs: &[f64], done: &[Finished]) -> Value {
    let jcts: Vec<f64> = done.iter().map(|f| f.jct).collect();
    let makespan = jcts.iter().copied().fold(0.0, f64::max);
    let mean = jcts.iter().sum::<f64>() / jcts.len().max(1) as f64;
    json!({
        "mode": mode,
        "makespan_s": makespan,
        "mean_jct_s": mean,
        "jobs": lrs.iter().zip(done).map(|(lr, f)| json!({
            "lr": lr, "jct_s": f.jct, "final_loss": f.loss,
        })).collect::<Vec<_>>(),
    })
}

pub fn sweep(a: SweepArgs) -> anyhow::Result<()> {
    if a.jobs == 0 || a.steps == 0 {
        bail!("--jobs and --steps must be positive");
    }
    if !(a.lr_min > 0.0 && a.lr_max >= a.lr_min && a.lr_max.is_finite()) {
        bail!("need 0 < --lr-min <= --lr-max");
    }
    let since = Instant::now();
    let lrs = learning_rates(a.jobs, a.lr_min, a.lr_max);
    progress(
        &format!(
            "building {} {} training graphs (batch {})",
            a.jobs, a.model, a.batch
        ),
        since,
    );
    let jobs: Vec<Workload> = lrs
        .iter()
        .map(|&lr| {
            workload::training(
                &a.model,
                a.batch,
                a.seq,
                &Optimizer::sgd_momentum(lr as f32, 0.9, 0.0),
            )
        })
        .collect::<anyhow::Result<_>>()?;
    let (_service, endpoint) = Service::start(&a.serve, since)?;

    progress(
        &format!("{} jobs together, {} steps each", a.jobs, a.steps),
        since,
    );
    let start = Instant::now();
    let bar = crate::cli::bar(a.jobs * a.steps, "steps");
    let together: Vec<Finished> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let endpoint = endpoint.as_str();
                let steps = a.steps;
                let bar = &bar;
                s.spawn(move || run_job(endpoint, w, &format!("sweep-{i}"), steps, start, bar))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a sweep job's thread panicked"))?
            })
            .collect::<anyhow::Result<_>>()
    })?;
    bar.finish_and_clear();
    let t = summary("together", &lrs, &together);
    progress(
        &format!(
            "together: makespan {:.2} s, mean JCT {:.2} s",
            t["makespan_s"].as_f64().unwrap_or(f64::NAN),
            t["mean_jct_s"].as_f64().unwrap_or(f64::NAN)
        ),
        since,
    );

    let sequential = if a.together_only {
        None
    } else {
        progress("the same jobs one after another", since);
        let start = Instant::now();
        let bar = crate::cli::bar(a.jobs * a.steps, "steps");
        let done: Vec<Finished> = jobs
            .iter()
            .enumerate()
            .map(|(i, w)| run_job(&endpoint, w, &format!("seq-{i}"), a.steps, start, &bar))
            .collect::<anyhow::Result<_>>()?;
        bar.finish_and_clear();
        let v = summary("one after another", &lrs, &done);
        progress(
            &format!(
                "one after another: makespan {:.2} s, mean JCT {:.2} s",
                v["makespan_s"].as_f64().unwrap_or(f64::NAN),
                v["mean_jct_s"].as_f64().unwrap_or(f64::NAN)
            ),
            since,
        );
        Some(v)
    };
    let ratio = |k: &str| {
        sequential
            .as_ref()
            .and_then(|s| Some(s[k].as_f64()? / t[k].as_f64()?))
    };
    let out = json!({
        "bench": "sweep",
        "device": super::child::device_arg(a.serve.device),
        "policy": a.serve.policy.name(),
        "serve_args": a.serve.args,
        "model": a.model,
        "batch": a.batch,
        "jobs": a.jobs,
        "steps": a.steps,
        "together": t,
        "one_after_another": sequential,
        "makespan_speedup": ratio("makespan_s"),
        "mean_jct_speedup": ratio("mean_jct_s"),
    });
    outln!("{out}")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::learning_rates;

    #[test]
    fn learning_rates_are_geometric_between_the_bounds() {
        let l = learning_rates(3, 0.001, 0.1);
        assert_eq!(l.len(), 3);
        assert!((l[0] - 0.001).abs() < 1e-12);
        assert!((l[1] - 0.01).abs() < 1e-12);
        assert!((l[2] - 0.1).abs() < 1e-12);
        assert_eq!(learning_rates(1, 0.5, 1.0), vec![0.5]);
    }
}
