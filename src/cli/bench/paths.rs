//! The two timed paths of `lanes bench`:
//!
//! - **executor**: `CudaProgram::run` / `CpuProgram::run` called directly
//!   (feeds copied host → device, every op, the fetch copied back);
//! - **service**: an embedded service (`lanes::server::start`, one worker)
//!   on a loopback endpoint, a `Client`, one session with the graph and its
//!   variables loaded, and `Session::run(feeds, fetches)` round trips
//!   (client → ZeroMQ → frontend → dispatcher → worker → executor → reply).
//!
//! Both report the same statistics over the timed iterations, plus what the
//! fetched tensor looked like (the loss of the first and last timed step, or
//! a checksum of the output) so that a wrong or diverging run shows.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes::exec::cpu::CpuProgram;
use lanes::exec::cuda::{CudaOptions, CudaProgram};
use lanes::exec::{HostFeed, Program};
use lanes::server::{self, DeviceChoice, ServerConfig};
use lanes_adaptor::{
    validate, Client, ClientOptions, GraphLimits, Limits, SessionSpec, Tensor, VarValues,
};
use serde_json::{json, Value};

use super::workload::{Kind, Workload};

/// Where the executor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cuda,
    Cpu,
}

impl Device {
    /// As a `--device` of `lanes serve`.
    pub fn choice(self) -> DeviceChoice {
        match self {
            Device::Cuda => DeviceChoice::Cuda,
            Device::Cpu => DeviceChoice::Cpu,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Device::Cuda => "cuda",
            Device::Cpu => "cpu",
        }
    }
}

/// Resolves a bench `--device` as `lanes serve` does: `auto` (the default)
/// is the GPU when one is usable, else the CPU with a note on stderr;
/// `cuda` without a usable GPU is an error that says what to pass instead.
pub fn resolve(choice: DeviceChoice) -> anyhow::Result<Device> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda => match lanes::exec::cuda::probe() {
            Ok(_) => Ok(Device::Cuda),
            Err(e) => bail!(
                "--device cuda: no usable GPU ({e}); pass --device cpu, or --device auto to fall back to the CPU"
            ),
        },
        DeviceChoice::Auto => match lanes::exec::cuda::probe() {
            Ok(_) => Ok(Device::Cuda),
            Err(e) => {
                eprintln!("lanes bench: no usable GPU ({e}); timing on the CPU");
                Ok(Device::Cpu)
            }
        },
    }
}

/// Iteration counts and executor options shared by both paths.
#[derive(Debug, Clone)]
pub struct Timing {
    pub device: Device,
    pub iters: usize,
    pub warmup: usize,
    /// Executor path only: replay a recorded CUDA graph (the service always
    /// uses `CudaOptions::default()`, which does).
    pub cuda_graph: bool,
    /// Executor path on CUDA: after timing, one more iteration op by op
    /// with GPU time per op kind (in the JSON and on stderr).
    pub op_profile: bool,
    /// Service path: the client may send feeds through shared memory.
    pub shared_memory: bool,
    /// Executor path on CUDA: the feeds' host memory registered page-locked.
    pub pinned_feeds: bool,
    /// Service path: feeds written once into feed buffers, Runs send only a
    /// header.
    pub feed_buffers: bool,
    /// Feed buffers with a reply slot for the outputs.
    pub reply_slot: bool,
    /// Feed buffers' Runs also left in their doorbell (with busy polling).
    pub doorbell: bool,
    /// Service path: busy polling in the embedded service and the client.
    pub busy_poll: Duration,
}

/// Median and spread of the timed iterations, in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub min: f64,
    pub max: f64,
}

impl Stats {
    /// Nearest-rank quantiles of `times` (not empty).
    pub fn of(mut times: Vec<f64>) -> anyhow::Result<Stats> {
        if times.is_empty() {
            bail!("no timed iterations");
        }
        times.sort_by(f64::total_cmp);
        let q = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
        Ok(Stats {
            median: q(0.5),
            p10: q(0.1),
            p90: q(0.9),
            min: times[0],
            max: times[times.len() - 1],
        })
    }

    fn json(&self) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("median_ms".into(), json!(self.median));
        m.insert("p10_ms".into(), json!(self.p10));
        m.insert("p90_ms".into(), json!(self.p90));
        m.insert("min_ms".into(), json!(self.min));
        m.insert("max_ms".into(), json!(self.max));
        m
    }
}

/// Progress on stderr (stdout carries only the JSON).
/// Prints an op profile to stderr (`CudaProgram::profile_ops`'s answer):
/// the 15 op kinds and the 40 signatures that took the most GPU time.
pub fn print_op_profile(by_op: &[(String, usize, f64)], by_signature: &[(String, usize, f64)]) {
    let total: f64 = by_op.iter().map(|x| x.2).sum();
    for (op, n, ms) in by_op.iter().take(15) {
        eprintln!(
            "  {op:<32} {n:>5} nodes {ms:>9.3} ms {:>5.1} %",
            100.0 * ms / total
        );
    }
    eprintln!("  by signature (op, attributes, input shapes):");
    for (sig, n, ms) in by_signature.iter().take(40) {
        eprintln!("  {ms:>9.3} ms {n:>4}x  {sig}");
    }
}

pub fn progress(what: &str, since: Instant) {
    eprintln!(
        "lanes bench [{:7.1} s] {what}",
        since.elapsed().as_secs_f64()
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What the fetched tensors said over the timed iterations.
#[derive(Debug, Default)]
struct Observed {
    first: Option<f64>,
    last: Option<f64>,
}

impl Observed {
    /// Training: the loss. Inference: the sum of the output.
    fn see(&mut self, out: &[Tensor]) -> anyhow::Result<()> {
        let t = out.first().context("the run returned no output")?;
        let v: f64 = t.f32s()?.iter().map(|&x| f64::from(x)).sum();
        if self.first.is_none() {
            self.first = Some(v);
        }
        self.last = Some(v);
        Ok(())
    }

    fn json(&self, kind: Kind, m: &mut serde_json::Map<String, Value>) {
        match kind {
            Kind::Train => {
                m.insert("loss_first".into(), json!(self.first));
                m.insert("loss_last".into(), json!(self.last));
            }
            Kind::Infer => {
                m.insert("output_checksum".into(), json!(self.last));
            }
        }
    }
}

/// Result of one path: its JSON object and its statistics.
#[derive(Debug)]
pub struct PathResult {
    pub stats: Stats,
    pub json: Value,
}

/// Times the executor alone. Returns the device name when on a GPU too.
pub fn executor(
    w: &Workload,
    vars: VarValues,
    feeds: &BTreeMap<String, Tensor>,
    t: &Timing,
    since: Instant,
) -> anyhow::Result<(PathResult, Option<String>)> {
    let graph = validate(
        w.graph.clone(),
        &GraphLimits {
            max_nodes: 1 << 20,
            ..GraphLimits::default()
        },
    )
    .context("the benchmark graph does not validate")?;
    progress(
        &format!("executor: loading onto {}", t.device.name()),
        since,
    );
    let t0 = Instant::now();
    let mut prog = match t.device {
        Device::Cuda => {
            let opts = CudaOptions {
                cuda_graph: t.cuda_graph,
                ..CudaOptions::default()
            };
            Program::Cuda(Box::new(CudaProgram::with_options(graph, vars, opts)?))
        }
        Device::Cpu => Program::Cpu(CpuProgram::new(graph, vars)?),
    };
    let load_ms = ms(t0.elapsed());
    let fetch = vec![w.fetch.clone()];
    // Page-locked feeds (held until the timing is done): their copy to the
    // device is a DMA, as from a PyTorch user's pinned input tensor.
    let pins = match (t.device, t.pinned_feeds) {
        (Device::Cuda, true) => feeds
            .values()
            .map(|f| lanes::exec::cuda::pin_host(HostFeed::bytes(f)))
            .collect::<Result<Vec<_>, _>>()
            .context("registering the feeds page-locked")?,
        _ => Vec::new(),
    };
    progress(
        &format!(
            "executor: loaded in {load_ms:.0} ms; {} warm-up iterations",
            t.warmup
        ),
        since,
    );
    let bar = crate::cli::bar(t.warmup, "executor warm-up");
    for _ in 0..t.warmup {
        prog.run(feeds, &fetch)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    progress(&format!("executor: timing {} iterations", t.iters), since);
    let mut times = Vec::with_capacity(t.iters);
    let mut seen = Observed::default();
    let bar = crate::cli::bar(t.iters, "executor timing");
    for _ in 0..t.iters {
        let t0 = Instant::now();
        let out = prog.run(feeds, &fetch)?;
        times.push(ms(t0.elapsed()));
        seen.see(&out)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let stats = Stats::of(times)?;
    let mut m = stats.json();
    m.insert("load_ms".into(), json!(load_ms));
    m.insert(
        "feeds".into(),
        json!(if pins.is_empty() {
            "pageable host memory"
        } else {
            "page-locked host memory"
        }),
    );
    let gpu = match &prog {
        Program::Cuda(p) => {
            m.insert("cuda_graph".into(), json!(p.uses_cuda_graph()));
            // Chains of elementwise ops run as one kernel (LANES_NO_FUSION=1
            // turns fusion off) and the nodes they leave without a launch.
            let (chains, skipped) = p.fused_chains();
            m.insert(
                "fusion".into(),
                json!({"chains": chains, "nodes_skipped": skipped}),
            );
            progress(
                &format!("executor: {chains} fused chains ({skipped} nodes launch nothing)"),
                since,
            );
            // Reshapes planned as views of their inputs: no copy, no launch.
            let views = p.views();
            m.insert("reshape_views".into(), json!(views));
            progress(
                &format!("executor: {views} reshapes are views (launch nothing)"),
                since,
            );
            // Batch norms with batch statistics that run through cuDNN
            // (LANES_NO_CUDNN_BN=1 keeps them on Lanes' own kernels).
            m.insert("cudnn_batch_norms".into(), json!(p.cudnn_batch_norms()));
            m.insert("device_bytes".into(), json!(p.device_bytes()));
            let a = p.arena_parts();
            m.insert(
                "arena".into(),
                json!({
                    "persistent": a.persistent,
                    "ephemeral": a.ephemeral,
                    "workspaces": a.workspaces,
                    "ephemeral_lower_bound": a.lower_bound,
                    "ephemeral_no_reuse": a.no_reuse,
                }),
            );
            Some(p.device_name().to_string())
        }
        Program::Cpu(p) => {
            // The ephemeral buffer at the memory plan's offsets (T bytes).
            m.insert(
                "arena".into(),
                json!({
                    "persistent": p.persistent_bytes(),
                    "ephemeral": p.ephemeral_bytes(),
                    "buffer": p.arena_bytes(),
                }),
            );
            None
        }
    };
    seen.json(w.kind, &mut m);
    progress(&format!("executor: median {:.3} ms", stats.median), since);
    if let (true, Program::Cuda(p)) = (t.op_profile, &mut prog) {
        let prof = p.profile_ops(feeds, &fetch)?;
        let total: f64 = prof.by_op.iter().map(|x| x.2).sum();
        progress(
            &format!("executor: op profile, {total:.3} ms of GPU time op by op"),
            since,
        );
        print_op_profile(&prof.by_op, &prof.by_signature);
        let rows: Vec<Value> = prof
            .by_op
            .iter()
            .map(|(op, n, ms)| json!({"op": op, "nodes": n, "ms": ms}))
            .collect();
        m.insert(
            "op_signatures".into(),
            Value::Array(
                prof.by_signature
                    .iter()
                    .map(|(s, n, ms)| json!({"signature": s, "nodes": n, "ms": ms}))
                    .collect(),
            ),
        );
        m.insert("op_profile".into(), Value::Array(rows));
    }
    drop(pins);
    Ok((
        PathResult {
            stats,
            json: Value::Object(m),
        },
        gpu,
    ))
}

/// Times `Session::run` round trips through an embedded service on
/// `endpoint` (e.g. `tcp://127.0.0.1:*`). Returns the device name the
/// service reports.
pub fn service(
    w: &Workload,
    vars: VarValues,
    feeds: &BTreeMap<String, Tensor>,
    t: &Timing,
    endpoint: &str,
    since: Instant,
) -> anyhow::Result<(PathResult, String)> {
    let device = match t.device {
        Device::Cuda => server::resolve_device(DeviceChoice::Cuda)?,
        Device::Cpu => server::resolve_device(DeviceChoice::Cpu)?,
    };
    progress(
        &format!("service: starting on {endpoint} ({device})"),
        since,
    );
    // The graph crosses the wire in one header frame: allow the large ones.
    let limits = Limits {
        max_nodes: 1 << 20,
        ..Limits::default()
    };
    let handle = server::start(ServerConfig {
        endpoint: endpoint.into(),
        workers: 1,
        device: device.clone(),
        limits,
        busy_poll: t.busy_poll,
        ..ServerConfig::default()
    })
    .with_context(|| format!("starting the embedded service on {endpoint}"))?;
    let bound = handle.endpoint().to_string();
    let result = (|| -> anyhow::Result<PathResult> {
        let mut client = Client::connect_with(
            &bound,
            ClientOptions {
                // Loading a large model onto the GPU (kernel compilation,
                // cuDNN plans) can take a while.
                timeout: Duration::from_secs(900),
                limits,
                name: "lanes-bench".into(),
                shared_memory: t.shared_memory,
                busy_poll: t.busy_poll,
                doorbell: t.doorbell,
                ..ClientOptions::default()
            },
        )
        .with_context(|| format!("connecting to the embedded service at {bound}"))?;
        let spec = match w.kind {
            Kind::Infer => SessionSpec::inference(format!("bench-{}", w.model)),
            Kind::Train => SessionSpec::training(format!("bench-{}", w.model)),
        };
        let mut session = client.open_session(spec)?;
        progress("service: loading the graph and its variables", since);
        let t0 = Instant::now();
        session.load(&w.graph, vars)?;
        let load_ms = ms(t0.elapsed());
        let fetch = [w.fetch.as_str()];
        // Each Run consumes its feeds: clone them outside the timed region.
        let feeds_of = || -> Vec<(String, Tensor)> {
            feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect()
        };
        progress(
            &format!(
                "service: loaded in {load_ms:.0} ms; {} warm-up iterations",
                t.warmup
            ),
            since,
        );
        // Feed buffers: two (one Run ahead alternates between them), the
        // values written once, as a job that writes its inputs in place.
        let mut buffers = Vec::new();
        if t.feed_buffers {
            let types: Vec<(&str, lanes_adaptor::TensorType)> =
                feeds.iter().map(|(n, v)| (n.as_str(), v.ty())).collect();
            for _ in 0..2 {
                let reply = if t.reply_slot {
                    lanes_adaptor::client::DEFAULT_REPLY_BYTES
                } else {
                    0
                };
                let mut b = session
                    .feed_buffers_with_reply(&types, reply)
                    .context("feed buffers (a service on this host that shares memory)")?;
                for (n, v) in feeds {
                    b.write(n, v)?;
                }
                buffers.push(b);
            }
        }
        let bar = crate::cli::bar(t.warmup, "service warm-up");
        for _ in 0..t.warmup {
            match buffers.first_mut() {
                Some(b) => session.run_buffers(b, &fetch)?,
                None => session.run(feeds_of(), &fetch)?,
            };
            bar.inc(1);
        }
        bar.finish_and_clear();
        progress(&format!("service: timing {} iterations", t.iters), since);
        let mut times = Vec::with_capacity(t.iters);
        let mut seen = Observed::default();
        let bar = crate::cli::bar(t.iters, "service timing");
        for _ in 0..t.iters {
            let out = match buffers.first_mut() {
                Some(b) => {
                    let t0 = Instant::now();
                    let out = session.run_buffers(b, &fetch)?;
                    times.push(ms(t0.elapsed()));
                    out
                }
                None => {
                    let f = feeds_of();
                    let t0 = Instant::now();
                    let out = session.run(f, &fetch)?;
                    times.push(ms(t0.elapsed()));
                    out
                }
            };
            seen.see(&out)?;
            bar.inc(1);
        }
        bar.finish_and_clear();
        // One Run in flight ahead (`Session::submit_run`): the next
        // iteration's feeds cross the wire while this one runs. The time
        // between two completions is the step interval a job sees (it
        // includes the client cloning the next feeds, as a data loader
        // would produce them; with feed buffers, the two alternate).
        progress(
            &format!("service: {} iterations with one Run ahead", t.iters),
            since,
        );
        let mut intervals = Vec::with_capacity(t.iters);
        let bar = crate::cli::bar(t.iters, "service, one Run ahead");
        if let [a, b] = &mut buffers[..] {
            let mut pending = session.submit_run_buffers(a, &fetch)?;
            let mut last = Instant::now();
            for _ in 0..t.iters.div_ceil(2) {
                let next = session.submit_run_buffers(b, &fetch)?;
                session.wait_buffer_run(pending)?;
                let now = Instant::now();
                intervals.push(ms(now - last));
                last = now;
                pending = session.submit_run_buffers(a, &fetch)?;
                session.wait_buffer_run(next)?;
                let now = Instant::now();
                intervals.push(ms(now - last));
                last = now;
                bar.inc(2);
            }
            session.wait_buffer_run(pending)?;
        } else {
            let mut pending = session.submit_run(feeds_of(), &fetch)?;
            let mut last = Instant::now();
            for _ in 0..t.iters {
                let next = session.submit_run(feeds_of(), &fetch)?;
                session.wait_run(pending)?;
                let now = Instant::now();
                intervals.push(ms(now - last));
                last = now;
                pending = next;
                bar.inc(1);
            }
            session.wait_run(pending)?;
        }
        bar.finish_and_clear();
        drop(buffers);
        session.close()?;
        let ahead = Stats::of(intervals)?;
        let stats = Stats::of(times)?;
        let mut m = stats.json();
        m.insert("one_run_ahead".into(), Value::Object(ahead.json()));
        m.insert("load_ms".into(), json!(load_ms));
        m.insert("endpoint".into(), json!(bound));
        m.insert("workers".into(), json!(1));
        // Whether large feeds went through a shared segment (the client
        // falls back to the socket by itself).
        m.insert(
            "feeds_via".into(),
            json!(if t.feed_buffers {
                "feed buffers (shared memory, written once)"
            } else if client.shares_memory() {
                "shared memory"
            } else {
                "socket"
            }),
        );
        m.insert(
            "outputs_via".into(),
            json!(if t.feed_buffers && t.reply_slot {
                "reply slot (the buffers' segment)"
            } else {
                "socket reply"
            }),
        );
        m.insert(
            "requests_via".into(),
            json!(if t.feed_buffers && t.doorbell && !t.busy_poll.is_zero() {
                "doorbell and socket"
            } else {
                "socket"
            }),
        );
        m.insert("busy_poll_ms".into(), json!(ms(t.busy_poll)));
        m.insert(
            "executor_options".into(),
            json!(match t.device {
                Device::Cuda => "CudaOptions::default() (CUDA graph replay)",
                Device::Cpu => "CpuProgram",
            }),
        );
        seen.json(w.kind, &mut m);
        progress(
            &format!(
                "service: median {:.3} ms; with one Run ahead, {:.3} ms between completions",
                stats.median, ahead.median
            ),
            since,
        );
        Ok(PathResult {
            stats,
            json: Value::Object(m),
        })
    })();
    let stopped = handle.shutdown();
    let r = result?;
    stopped.context("stopping the embedded service")?;
    Ok((r, device))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn stats_are_nearest_rank_quantiles() {
        let s = Stats::of((1..=11).rev().map(f64::from).collect()).unwrap();
        assert_eq!(s.median, 6.0);
        assert_eq!(s.p10, 2.0);
        assert_eq!(s.p90, 10.0);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 11.0);
        let one = Stats::of(vec![3.5]).unwrap();
        assert_eq!((one.median, one.p10, one.p90), (3.5, 3.5, 3.5));
        assert!(Stats::of(Vec::new()).is_err());
    }
}
