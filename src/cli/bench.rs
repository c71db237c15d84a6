//! `lanes bench`: latency of reference models, printed as one JSON object on
//! stdout (progress on stderr).
//!
//! - `lanes bench infer`: one inference iteration (ResNet-50/152,
//!   Inception-v3, BERT-base built layer for layer like torchvision /
//!   transformers, or a small zoo model);
//! - `lanes bench train`: one training step — forward, loss, backward and
//!   the SGD-momentum update of every parameter in one Run, exactly the
//!   training graph the adaptor's autodiff builds ([`lanes_adaptor::Arch::training`]).
//!
//! Each is timed on up to two paths (`--path executor|service|both`): the
//! executor alone (`CudaProgram::run` / `CpuProgram::run`) and the full
//! service path (client → ZeroMQ → dispatcher → worker → executor → reply)
//! through an embedded service. `benches/torch_ref.py` times PyTorch on the
//! same shapes.

use std::time::Instant;

use anyhow::bail;
use lanes_adaptor::Optimizer;
use serde_json::{json, Value};

mod child;
pub mod colocate;
pub mod deploy;
mod doorbell;
pub mod gpus;
mod isolate;
pub mod load;
pub mod models;
pub mod pack;
pub mod parallel;
pub(crate) mod paths;
pub mod preempt;
pub mod sim;
mod soak;
pub mod sweep;
pub mod switch;
mod workload;

use lanes::server::DeviceChoice;
use paths::{progress, Device, Timing};
use workload::Workload;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, clap::Subcommand)]
enum What {
    /// Inference latency of one model.
    Infer(InferArgs),
    /// Latency of one training step (forward, loss, backward, SGD update).
    Train(TrainArgs),
    /// First-inference latency of a model that is not resident, per
    /// switching strategy (pipelined, per layer, load-then-run).
    Switch(switch::SwitchArgs),
    /// Inference packing: more models than fit, requests across them;
    /// latency p50/p99 and how often a request hit an evicted model.
    Pack(pack::PackArgs),
    /// Issue 32's deployment: a mix of many models (each its own weights)
    /// served to concurrent clients, Zipf popularity, open-loop Poisson
    /// requests; a baseline with every model resident, then with memory
    /// for a fraction; hits and misses per kind against their goals.
    Deploy(deploy::DeployArgs),
    /// Where a LoadGraph's time goes: decode, validate, plan, program
    /// build, warm-up; per-phase medians of cold loads (load cache empty)
    /// and warm ones (the architecture loaded before).
    Load(load::LoadArgs),
    /// Lanes in parallel: one job alone, two jobs in one lane (shared
    /// ephemeral memory, taking turns), two jobs in two lanes; throughput
    /// and device memory.
    Lanes(parallel::LanesArgs),
    /// Inference beside training through a real `lanes serve` (a child
    /// process): latency alone and beside training, training throughput,
    /// and how soon a job that arrives while training runs answers.
    Colocate(colocate::ColocateArgs),
    /// PipeSwitch's case: a training job runs back to back while an
    /// inference model's requests arrive, through a real `lanes serve` with
    /// `--evict-training`: memory for both (the model resident) and memory
    /// for one (each request preempts training at an iteration boundary);
    /// latency of each, training's it/s and how soon it resumes.
    Preempt(preempt::PreemptArgs),
    /// A hyper-parameter sweep: N training jobs of one model with
    /// different learning rates through a real `lanes serve`, together and
    /// one after another; makespan and per-job completion times.
    Sweep(sweep::SweepArgs),
    /// The same jobs (2 training, 4 inference by default) on one GPU and
    /// spread over two, one `lanes serve` per GPU; total throughput of
    /// each and the ratio (issue 34's goal: at least 1.9).
    Gpus(gpus::GpusArgs),
    /// Speed of the trace simulator: a large (generated or given) trace
    /// under every policy; seconds per policy and peak memory.
    Sim(sim::SimArgs),
    /// A bystander's Run latency through a real `lanes serve` alone,
    /// beside a peer ringing garbage in its doorbell as fast as it can,
    /// and beside one ringing a huge doorbell; the service's own counts
    /// of the rings it examined and the bytes it copied.
    Doorbell(doorbell::DoorbellArgs),
    /// Session churn against a real `lanes serve` for `--duration` seconds:
    /// clients open, run, close, drop and are killed at random while the
    /// service's memory, sessions and errors are sampled; JSON samples and
    /// a verdict (every Run answered, killed clients reclaimed within 5 s,
    /// memory flat).
    Soak(soak::SoakArgs),
    /// A client `bench soak` starts and kills (opens and runs sessions
    /// until killed).
    #[command(hide = true)]
    SoakClient(soak::SoakClientArgs),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // `RUST_LOG=lanes=trace,lanes_adaptor=trace` shows where a Run's time
    // goes (client encode/send/wait, service decode/run/encode).
    crate::cli::serve::init_tracing("warn");
    match args.what {
        What::Infer(a) => infer(a),
        What::Train(a) => train(a),
        What::Switch(a) => switch::switch(a),
        What::Pack(a) => pack::pack(a),
        What::Deploy(a) => deploy::deploy(a),
        What::Load(a) => load::load(a),
        What::Lanes(a) => parallel::lanes(a),
        What::Colocate(a) => colocate::colocate(a),
        What::Preempt(a) => preempt::preempt(a),
        What::Sweep(a) => sweep::sweep(a),
        What::Gpus(a) => gpus::gpus(a),
        What::Sim(a) => sim::sim(a),
        What::Doorbell(a) => doorbell::doorbell(a),
        What::Soak(a) => soak::soak(a),
        What::SoakClient(a) => soak::soak_client(a),
    }
}

/// Which paths to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PathChoice {
    /// The executor alone (no sockets).
    Executor,
    /// Client → ZeroMQ → embedded service → executor → reply.
    Service,
    Both,
}

/// Options shared by every `bench` subcommand that times a graph.
#[derive(Debug, clap::Args)]
struct RunOpts {
    /// Where to time: `auto` (the GPU when one is usable, else the CPU,
    /// as `lanes serve`), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Timed iterations (after warm-up), per path.
    #[arg(long, default_value_t = 30)]
    iters: usize,
    /// Untimed iterations before timing, per path.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Which paths to time.
    #[arg(long, value_enum, default_value_t = PathChoice::Both)]
    path: PathChoice,
    /// Endpoint the embedded service binds (service path).
    #[arg(long, default_value = "tcp://127.0.0.1:*")]
    endpoint: String,
    /// Executor path: launch op by op instead of replaying a recorded CUDA
    /// graph (the service always uses the default, graph replay).
    #[arg(long)]
    no_graph: bool,
    /// Executor path on CUDA: one more iteration op by op, GPU time per op
    /// kind (stderr and `executor.op_profile` in the JSON).
    #[arg(long)]
    op_profile: bool,
    /// With `--path both`: time both paths in this process, one after the
    /// other, instead of each in a fresh child process.
    #[arg(long)]
    same_process: bool,
    /// Service path: feeds always over the socket (by default a client on
    /// the service's host sends large feeds through shared memory).
    #[arg(long)]
    no_shared_memory: bool,
    /// Executor path on CUDA: feeds in ordinary (pageable) host memory. By
    /// default they are registered page-locked, as a PyTorch user's pinned
    /// input tensor, so their copy to the device is one DMA.
    #[arg(long)]
    pageable_feeds: bool,
    /// Service path: the feeds are written once into feed buffers (a
    /// segment shared with the service, `Session::feed_buffers`) and each
    /// Run sends only a header, as a job that writes its inputs in place.
    #[arg(long)]
    feed_buffers: bool,
    /// Service path with feed buffers: no reply slot, so the outputs come
    /// in the socket reply (by default the service writes them into the
    /// buffers' segment, where a busy-polling client takes them at once).
    #[arg(long)]
    no_reply_slot: bool,
    /// Service path with feed buffers and busy polling: no doorbell, so
    /// each Run reaches the service through the socket only.
    #[arg(long)]
    no_doorbell: bool,
    /// Service path: busy polling for this many milliseconds in the
    /// embedded service (`lanes serve --busy-poll`) and the client
    /// (`ClientOptions::busy_poll`); 0 (the default) is off.
    #[arg(long, default_value_t = 0.0, value_name = "MS")]
    busy_poll: f64,
    /// Both paths on CUDA: FP32 matrix products on TF32 tensor cores
    /// (`lanes serve --tf32-matmul`); off by default, as PyTorch's.
    #[arg(long)]
    tf32_matmul: bool,
    /// fp32 | bf16-mixed (training or inference: products and convolutions
    /// in bf16, f32 weights) | bf16 | fp16 (inference: weights stored in
    /// half) | fp16-mixed (training with loss scaling, or inference); see
    /// docs/precision.md.
    #[arg(long, default_value = "fp32")]
    precision: lanes_adaptor::Precision,
}

impl RunOpts {
    /// The counts that must be positive.
    fn check(&self, batch: usize) -> anyhow::Result<()> {
        if batch == 0 {
            bail!("--batch must be positive");
        }
        if self.iters == 0 {
            bail!("--iters must be positive");
        }
        Ok(())
    }

    /// `--path both` in child processes: this process builds nothing.
    fn isolated(&self) -> bool {
        self.path == PathChoice::Both && !self.same_process
    }
}

#[derive(Debug, clap::Args)]
struct InferArgs {
    /// resnet50 | resnet152 | inception_v3 | bert_base | resnet18_cifar |
    /// lenet | mlp | transformer
    #[arg(long)]
    model: String,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length for BERT and the transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[command(flatten)]
    run: RunOpts,
}

#[derive(Debug, clap::Args)]
struct TrainArgs {
    /// resnet50 | resnet152 | inception_v3 | bert_base | resnet18_cifar |
    /// lenet | mlp | transformer
    #[arg(long, default_value = "resnet50")]
    model: String,
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Sequence length for BERT and the transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// SGD momentum (PyTorch's reference uses 0.9).
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Time a saved job instead of a zoo model: a directory written by
    /// `lanes.torch.training_job(..., save_to=DIR)` (its own graph, optimizer
    /// and example batch; --model, --batch, --seq, --lr and --momentum are
    /// not used).
    #[arg(long)]
    job: Option<std::path::PathBuf>,
    #[command(flatten)]
    run: RunOpts,
}

fn infer(a: InferArgs) -> anyhow::Result<()> {
    // Everything the user typed is checked before a graph is built or a
    // child process started.
    workload::check_model(&a.model, a.seq)?;
    a.run.check(a.batch)?;
    // The children check the device: a probe here would hold a CUDA
    // context in this process while they run.
    if a.run.isolated() {
        outln!("{}", isolate::both()?)?;
        return Ok(());
    }
    let device = paths::resolve(a.run.device)?;
    let since = Instant::now();
    progress(
        &format!("building {} inference graph (batch {})", a.model, a.batch),
        since,
    );
    let w = workload::inference(&a.model, a.batch, a.seq)?.at_precision(a.run.precision)?;
    let seq = uses_seq(&a.model).then_some(a.seq);
    let out = bench(&w, a.batch, &a.run, device, seq, json!(null), since)?;
    outln!("{out}")?;
    Ok(())
}

fn train(a: TrainArgs) -> anyhow::Result<()> {
    if let Some(dir) = &a.job {
        return saved_job(dir, &a.run);
    }
    if !(a.lr.is_finite() && a.lr > 0.0 && (0.0..1.0).contains(&a.momentum)) {
        bail!("--lr must be positive and --momentum in [0, 1)");
    }
    workload::check_model(&a.model, a.seq)?;
    a.run.check(a.batch)?;
    // The children check the device: a probe here would hold a CUDA
    // context in this process while they run.
    if a.run.isolated() {
        outln!("{}", isolate::both()?)?;
        return Ok(());
    }
    let device = paths::resolve(a.run.device)?;
    let since = Instant::now();
    progress(
        &format!("building {} training graph (batch {})", a.model, a.batch),
        since,
    );
    let opt = Optimizer::sgd_momentum(a.lr as f32, a.momentum as f32, 0.0);
    let w = workload::training_at(&a.model, a.batch, a.seq, &opt, a.run.precision)?;
    let seq = uses_seq(&a.model).then_some(a.seq);
    let optimizer = json!({
        "kind": "sgd",
        "lr": a.lr,
        "momentum": a.momentum,
        "weight_decay": 0.0,
        "nesterov": false,
    });
    let out = bench(&w, a.batch, &a.run, device, seq, optimizer, since)?;
    outln!("{out}")?;
    Ok(())
}

/// `bench train --job DIR`: a saved job timed as it was captured.
fn saved_job(dir: &std::path::Path, run: &RunOpts) -> anyhow::Result<()> {
    let (w, batch) = workload::saved(dir)?;
    run.check(batch)?;
    if run.isolated() {
        outln!("{}", isolate::both()?)?;
        return Ok(());
    }
    let device = paths::resolve(run.device)?;
    let since = Instant::now();
    progress(
        &format!("saved job {} (batch {batch})", dir.display()),
        since,
    );
    let out = bench(&w, batch, run, device, None, json!("saved"), since)?;
    outln!("{out}")?;
    Ok(())
}

fn uses_seq(model: &str) -> bool {
    matches!(model, "bert_base" | "transformer")
}

/// Times `w` on the chosen paths and assembles the JSON report.
fn bench(
    w: &Workload,
    batch: usize,
    o: &RunOpts,
    device: Device,
    seq: Option<usize>,
    optimizer: Value,
    since: Instant,
) -> anyhow::Result<Value> {
    if o.iters == 0 {
        bail!("--iters must be positive");
    }
    lanes::exec::cuda::set_matmul_tf32(o.tf32_matmul);
    let timing = Timing {
        device,
        iters: o.iters,
        warmup: o.warmup,
        cuda_graph: !o.no_graph,
        op_profile: o.op_profile,
        shared_memory: !o.no_shared_memory,
        pinned_feeds: !o.pageable_feeds,
        feed_buffers: o.feed_buffers,
        reply_slot: !o.no_reply_slot,
        doorbell: !o.no_doorbell,
        busy_poll: super::busy_poll_window(o.busy_poll)?,
    };
    let feeds = w.random_feeds(7)?;
    let want_exec = matches!(o.path, PathChoice::Executor | PathChoice::Both);
    let want_service = matches!(o.path, PathChoice::Service | PathChoice::Both);
    let mut gpu = None;
    let mut service_device = None;
    // One path at a time, so the two never hold device memory together
    // (`--same-process`; by default `--path both` runs each in its own
    // process, see `isolate`).
    let exec = if want_exec {
        let (r, g) = paths::executor(w, w.vars.clone(), &feeds, &timing, since)?;
        gpu = g;
        Some(r)
    } else {
        None
    };
    let service = if want_service {
        let (r, d) = paths::service(w, w.vars.clone(), &feeds, &timing, &o.endpoint, since)?;
        service_device = Some(d);
        Some(r)
    } else {
        None
    };
    let ratio = match (&exec, &service) {
        (Some(e), Some(s)) if e.stats.median > 0.0 => Some(s.stats.median / e.stats.median),
        _ => None,
    };
    // Both paths build their CUDA programs with these defaults (the executor
    // path changes only `cuda_graph`).
    let d = lanes::exec::cuda::CudaOptions::default();
    // The dtype products compute in, and the precision as the job chose it.
    let dtype = o
        .precision
        .half()
        .map_or("f32".to_string(), |d| d.to_string());
    let precision = match device {
        Device::Cuda => json!({
            "dtype": dtype,
            "amp": o.precision.to_string(),
            "conv_tf32": d.conv_tf32,
            "matmul_tf32": d.matmul_tf32,
            "pytorch_equivalent": format!(
                "cudnn.allow_tf32={}, matmul.allow_tf32={}",
                py_bool(d.conv_tf32),
                py_bool(d.matmul_tf32)
            ),
        }),
        Device::Cpu => json!({ "dtype": dtype, "amp": o.precision.to_string() }),
    };
    Ok(json!({
        "bench": w.kind.name(),
        "model": w.model,
        "batch": batch,
        "seq": seq,
        "device": device.name(),
        "gpu": gpu,
        "service_device": service_device,
        "precision": precision,
        "optimizer": optimizer,
        "fetch": w.fetch,
        "iters": o.iters,
        "warmup": o.warmup,
        "params": w.params,
        "nodes": w.graph.nodes.len(),
        "executor": exec.map(|r| r.json),
        "service": service.map(|r| r.json),
        "service_over_executor": ratio,
        "isolation": if o.path == PathChoice::Both { "one process" } else { "one path" },
    }))
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}
