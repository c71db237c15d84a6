//! `lanes demo`: an embedded service on a free loopback port and several
//! jobs running through real sockets at once, then a table per job.
//!
//! To add a kind of job, write a function returning a [`DemoJob`] and push
//! it in [`jobs`]; [`run_job`] drives any of them the same way.

use std::time::{Duration, Instant};

use anyhow::Context;
use lanes::server::{self, ServerConfig};
use lanes_adaptor::{
    Client, Conv2dAttrs, Graph, GraphBuilder, Pool2dAttrs, SessionSpec, Tensor, TensorType,
    VarValues,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Iterations per job.
    #[arg(long, default_value_t = 200)]
    pub iterations: u64,
    /// Concurrent MLP inference jobs.
    #[arg(long, default_value_t = 3)]
    pub mlp: usize,
    /// Concurrent CNN inference jobs.
    #[arg(long, default_value_t = 2)]
    pub cnn: usize,
    /// Worker threads of the embedded service (default: one per core).
    #[arg(long)]
    pub workers: Option<usize>,
}

/// Feeds for iteration `i`.
pub type FeedFn = Box<dyn FnMut(u64) -> Vec<(String, Tensor)> + Send>;

/// One job of the demo: its session spec, graph, feeds and fetches.
pub struct DemoJob {
    pub spec: SessionSpec,
    pub graph: Graph,
    pub variables: VarValues,
    pub feeds: FeedFn,
    pub fetches: Vec<String>,
    pub iterations: u64,
}

/// What a job reports when it is done.
#[derive(Debug, Clone)]
pub struct JobReport {
    pub name: String,
    pub kind: String,
    pub iterations: u64,
    pub p50: Duration,
    pub p99: Duration,
    pub wall: Duration,
    /// A short description of the last fetched value (e.g. its first row's sum).
    pub last: String,
}

fn random(rng: &mut StdRng, shape: &[usize], scale: f32) -> anyhow::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    Ok(Tensor::from_f32(shape.to_vec(), v)?)
}

/// A 3-layer MLP classifier (784 → 256 → 128 → 10, softmax), batch 16.
pub fn mlp_job(name: &str, seed: u64, iterations: u64) -> anyhow::Result<DemoJob> {
    let mut rng = StdRng::seed_from_u64(seed);
    let batch = 16;
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([batch, 784]));
    let mut h = x;
    let dims = [784, 256, 128, 10];
    for (i, w) in dims.windows(2).enumerate() {
        let wv = g.variable(&format!("w{i}"), random(&mut rng, &[w[0], w[1]], 0.05)?);
        let bv = g.variable(&format!("b{i}"), random(&mut rng, &[w[1]], 0.01)?);
        h = g.matmul(h, wv);
        h = g.add(h, bv);
        if i + 2 < dims.len() {
            h = g.relu(h);
        }
    }
    let y = g.softmax(h, 1);
    g.set_name(y, "probs");
    let (graph, variables) = g.finish()?;
    let mut feed_rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    Ok(DemoJob {
        spec: SessionSpec::inference(name).with_expected_iterations(iterations),
        graph,
        variables,
        feeds: Box::new(move |_| {
            let v = (0..batch * 784)
                .map(|_| feed_rng.gen_range(0.0..1.0))
                .collect();
            Tensor::from_f32([batch, 784], v)
                .map(|t| vec![("x".to_string(), t)])
                .unwrap_or_default()
        }),
        fetches: vec!["probs".into()],
        iterations,
    })
}

/// A small CNN (conv 3→16, pool, conv 16→32, global pool, linear → 10), batch 8 of 3×32×32.
pub fn cnn_job(name: &str, seed: u64, iterations: u64) -> anyhow::Result<DemoJob> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (batch, hw) = (8, 32);
    let mut g = GraphBuilder::new();
    let x = g.placeholder("image", TensorType::f32([batch, 3, hw, hw]));
    let pad1 = Conv2dAttrs {
        padding: [1, 1],
        ..Conv2dAttrs::default()
    };
    let w1 = g.variable("conv1/w", random(&mut rng, &[16, 3, 3, 3], 0.2)?);
    let b1 = g.variable("conv1/b", random(&mut rng, &[16], 0.01)?);
    let h = g.conv2d(x, w1, Some(b1), pad1);
    let h = g.relu(h);
    let h = g.max_pool2d(
        h,
        Pool2dAttrs {
            kernel: [2, 2],
            stride: [2, 2],
            padding: [0, 0],
        },
    );
    let w2 = g.variable("conv2/w", random(&mut rng, &[32, 16, 3, 3], 0.1)?);
    let b2 = g.variable("conv2/b", random(&mut rng, &[32], 0.01)?);
    let h = g.conv2d(h, w2, Some(b2), pad1);
    let h = g.relu(h);
    let h = g.global_avg_pool(h);
    let wf = g.variable("fc/w", random(&mut rng, &[32, 10], 0.1)?);
    let h = g.matmul(h, wf);
    let y = g.softmax(h, 1);
    g.set_name(y, "probs");
    let (graph, variables) = g.finish()?;
    let mut feed_rng = StdRng::seed_from_u64(seed ^ 0xc0ffee);
    Ok(DemoJob {
        spec: SessionSpec::inference(name).with_expected_iterations(iterations),
        graph,
        variables,
        feeds: Box::new(move |_| {
            let n = batch * 3 * hw * hw;
            let v = (0..n).map(|_| feed_rng.gen_range(0.0..1.0)).collect();
            Tensor::from_f32([batch, 3, hw, hw], v)
                .map(|t| vec![("image".to_string(), t)])
                .unwrap_or_default()
        }),
        fetches: vec!["probs".into()],
        iterations,
    })
}

/// The demo's jobs. Add new kinds here.
pub fn jobs(args: &Args) -> anyhow::Result<Vec<DemoJob>> {
    let mut out = Vec::new();
    for i in 0..args.mlp {
        out.push(mlp_job(
            &format!("mlp-{i}"),
            10 + i as u64,
            args.iterations,
        )?);
    }
    for i in 0..args.cnn {
        out.push(cnn_job(
            &format!("cnn-{i}"),
            100 + i as u64,
            args.iterations,
        )?);
    }
    Ok(out)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Runs one job through its own connection: open, load, iterate, close.
/// Runs one demo job to the end, counting each iteration on `progress`.
pub fn run_job(
    endpoint: &str,
    mut job: DemoJob,
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<JobReport> {
    let start = Instant::now();
    let name = job.spec.name.clone();
    let kind = job.spec.kind.to_string();
    let mut client = Client::connect(endpoint).with_context(|| format!("{name}: connect"))?;
    let mut session = client.open_session(job.spec)?;
    session
        .load(&job.graph, job.variables)
        .with_context(|| format!("{name}: load"))?;
    let fetches: Vec<&str> = job.fetches.iter().map(String::as_str).collect();
    let mut lat = Vec::with_capacity(job.iterations as usize);
    let mut last = Vec::new();
    for i in 0..job.iterations {
        let feeds = (job.feeds)(i);
        let t = Instant::now();
        last = session
            .run(feeds, &fetches)
            .with_context(|| format!("{name}: iteration {i}"))?;
        lat.push(t.elapsed());
        progress.inc(1);
    }
    session.close()?;
    lat.sort();
    let last = match last.first().map(|t| t.f32s()) {
        Some(Ok(v)) => {
            let row: f32 = v.iter().take(10).sum();
            format!("row 0 sums to {row:.4}")
        }
        _ => "-".into(),
    };
    Ok(JobReport {
        name,
        kind,
        iterations: lat.len() as u64,
        p50: percentile(&lat, 0.50),
        p99: percentile(&lat, 0.99),
        wall: start.elapsed(),
        last,
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // Quiet by default so the table stands out; RUST_LOG=info shows the service's log.
    super::serve::init_tracing("warn");
    let config = ServerConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        workers: args.workers.unwrap_or(ServerConfig::default().workers),
        ..ServerConfig::default()
    };
    let service = server::start(config)?;
    let endpoint = service.endpoint().to_string();
    let jobs = jobs(&args)?;
    outln!(
        "embedded lanes service on {endpoint}; {} jobs × {} iterations",
        jobs.len(),
        args.iterations
    )?;
    let start = Instant::now();
    let total: u64 = jobs.iter().map(|j| j.iterations).sum();
    let progress = super::bar(usize::try_from(total).unwrap_or(usize::MAX), "iterations");
    let handles: Vec<_> = jobs
        .into_iter()
        .map(|job| {
            let ep = endpoint.clone();
            let progress = progress.clone();
            std::thread::spawn(move || run_job(&ep, job, &progress))
        })
        .collect();
    let mut reports = Vec::new();
    for h in handles {
        match h.join() {
            Ok(r) => reports.push(r?),
            Err(_) => anyhow::bail!("a demo job thread panicked"),
        }
    }
    progress.finish_and_clear();
    let wall = start.elapsed();
    outln!(
        "{:<10} {:<10} {:>10} {:>10} {:>10} {:>9}  last output",
        "job",
        "kind",
        "iterations",
        "p50 (ms)",
        "p99 (ms)",
        "wall (s)"
    )?;
    for r in &reports {
        outln!(
            "{:<10} {:<10} {:>10} {:>10.3} {:>10.3} {:>9.2}  {}",
            r.name,
            r.kind,
            r.iterations,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.wall.as_secs_f64(),
            r.last
        )?;
    }
    let total: u64 = reports.iter().map(|r| r.iterations).sum();
    outln!(
        "{total} iterations in {:.2}s ({:.0} iterations/s)",
        wall.as_secs_f64(),
        total as f64 / wall.as_secs_f64().max(1e-9)
    )?;
    super::demo_train::run(&endpoint, args.iterations as usize)?;
    service.shutdown()?;
    Ok(())
}
