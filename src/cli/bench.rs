//! `lanes bench infer`: median latency of one inference iteration of a
//! reference architecture (ResNet-50/152, Inception-v3, BERT-base) through
//! the executor alone (no service, no sockets), printed as JSON.
//!
//! The timed region is `Program::run`: feeds copied host → device, every op,
//! the fetched logits copied device → host. The architectures are built here
//! with the graph builder to match torchvision / transformers layer for layer
//! (see `benches/torch_ref.py`, which times PyTorch on the same shapes).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{bail, Context};
use lanes::exec::cpu::CpuProgram;
use lanes::exec::cuda::{CudaOptions, CudaProgram};
use lanes_adaptor::{validate, GraphLimits, Tensor, TensorType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub mod models;
pub mod switch;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, clap::Subcommand)]
enum What {
    /// Inference latency of one model.
    Infer(InferArgs),
    /// First-inference latency of a model that is not resident, per
    /// switching strategy (pipelined, per layer, load-then-run).
    Switch(switch::SwitchArgs),
}

#[derive(Debug, clap::Args)]
struct InferArgs {
    /// resnet50 | resnet152 | inception_v3 | bert_base
    #[arg(long)]
    model: String,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// cuda | cpu
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Timed iterations (after warm-up).
    #[arg(long, default_value_t = 30)]
    iters: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Sequence length for BERT.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Launch op by op instead of replaying a recorded CUDA graph.
    #[arg(long)]
    no_graph: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.what {
        What::Infer(a) => infer(a),
        What::Switch(a) => switch::switch(a),
    }
}

enum Prog {
    Cpu(CpuProgram),
    Cuda(Box<CudaProgram>),
}

impl Prog {
    fn run(
        &mut self,
        feeds: &BTreeMap<String, Tensor>,
        fetches: &[String],
    ) -> anyhow::Result<Vec<Tensor>> {
        Ok(match self {
            Prog::Cpu(p) => p.run(feeds, fetches)?,
            Prog::Cuda(p) => p.run(feeds, fetches)?,
        })
    }
}

fn infer(a: InferArgs) -> anyhow::Result<()> {
    if a.batch == 0 || a.iters == 0 {
        bail!("--batch and --iters must be positive");
    }
    let built = models::build(&a.model, a.batch, a.seq)?;
    let params: usize = built.vars.values().map(|t| t.numel()).sum();
    let nodes = built.graph.nodes.len();
    let graph = validate(
        built.graph,
        &GraphLimits {
            max_nodes: 1 << 20,
            ..GraphLimits::default()
        },
    )
    .context("model graph does not validate")?;
    let mut rng = StdRng::seed_from_u64(7);
    let feeds: BTreeMap<String, Tensor> = built
        .inputs
        .iter()
        .map(|(name, ty)| Ok((name.clone(), random_input(ty, built.vocab, &mut rng)?)))
        .collect::<anyhow::Result<_>>()?;
    let t0 = Instant::now();
    let (mut prog, gpu) = match a.device.as_str() {
        "cuda" => {
            let opts = CudaOptions {
                cuda_graph: !a.no_graph,
                ..CudaOptions::default()
            };
            let p = CudaProgram::with_options(graph, built.vars, opts)?;
            let name = p.device_name().to_string();
            (Prog::Cuda(Box::new(p)), Some(name))
        }
        "cpu" => (Prog::Cpu(CpuProgram::new(graph, built.vars)?), None),
        d => bail!("unknown device `{d}` (cuda or cpu)"),
    };
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let fetch = vec![built.output.clone()];
    for _ in 0..a.warmup {
        prog.run(&feeds, &fetch)?;
    }
    let mut times = Vec::with_capacity(a.iters);
    let mut checksum = 0f64;
    for _ in 0..a.iters {
        let t = Instant::now();
        let out = prog.run(&feeds, &fetch)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        checksum = out[0].f32s()?.iter().map(|&v| v as f64).sum();
    }
    times.sort_by(f64::total_cmp);
    let q = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
    let json = serde_json::json!({
        "bench": "infer",
        "path": "executor",
        "model": a.model,
        "batch": a.batch,
        "seq": if a.model == "bert_base" { Some(a.seq) } else { None },
        "device": a.device,
        "gpu": gpu,
        "precision": "fp32; conv TF32 allowed, matmul full FP32 (PyTorch defaults)",
        "cuda_graph": matches!(&prog, Prog::Cuda(p) if p.uses_cuda_graph()),
        "device_bytes": match &prog {
            Prog::Cuda(p) => Some(p.device_bytes()),
            Prog::Cpu(_) => None,
        },
        "iters": a.iters,
        "warmup": a.warmup,
        "median_ms": q(0.5),
        "p10_ms": q(0.1),
        "p90_ms": q(0.9),
        "min_ms": times[0],
        "load_ms": load_ms,
        "params": params,
        "nodes": nodes,
        "output_checksum": checksum,
    });
    println!("{json}");
    Ok(())
}

fn random_input(ty: &TensorType, vocab: usize, rng: &mut StdRng) -> anyhow::Result<Tensor> {
    let n = ty.shape.numel();
    Ok(match ty.dtype {
        lanes_adaptor::DType::F32 => Tensor::from_f32(
            ty.shape.clone(),
            (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect(),
        )?,
        lanes_adaptor::DType::I64 => Tensor::from_i64(
            ty.shape.clone(),
            (0..n)
                .map(|_| rng.gen_range(0..vocab.max(1) as i64))
                .collect(),
        )?,
    })
}
