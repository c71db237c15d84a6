//! `lanes import MODEL.onnx`: imports an ONNX model, prints the graph's
//! summary (inputs, outputs, ops by kind, parameters, exact P and T at the
//! batch size), and with `--check` / `--expect` runs it (on the CPU
//! backend, or the GPU with `--device cuda`) against reference outputs
//! saved as `.npy`, optionally timing it (`--time N`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use lanes::compile::{plan_with_fetches, PlanOptions};
use lanes::exec::Program;
use lanes::npy;
use lanes::server::{backend_of, resolve_device, DeviceChoice};
use lanes_adaptor::onnx::{import_file, ImportOptions, OnnxModel};
use lanes_adaptor::{validate, GraphLimits, Op, Tensor};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The `.onnx` file.
    pub model: PathBuf,
    /// Batch size: the size of every input's symbolic first dimension.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Size of another symbolic dimension, NAME=SIZE (repeatable).
    #[arg(long = "dim", value_name = "NAME=SIZE")]
    pub dims: Vec<String>,
    /// Directory of references: `<stem>.<input>.npy` for every input and
    /// `<stem>.<output>.npy` for every output, `<stem>` the model file's
    /// name without `.onnx`. Runs the model on the CPU backend and compares.
    #[arg(long, value_name = "DIR")]
    pub check: Option<PathBuf>,
    /// A feed, NAME=FILE.npy (repeatable; instead of `--check`).
    #[arg(long = "input", value_name = "NAME=FILE")]
    pub inputs: Vec<String>,
    /// An expected output, NAME=FILE.npy (repeatable; with `--input`).
    #[arg(long = "expect", value_name = "NAME=FILE")]
    pub expect: Vec<String>,
    /// Relative tolerance of the comparison.
    #[arg(long, default_value_t = 1e-4)]
    pub rtol: f64,
    /// Absolute tolerance of the comparison.
    #[arg(long, default_value_t = 1e-5)]
    pub atol: f64,
    /// Where the check runs: the CPU reference backend (default), or the
    /// GPU (`cuda`; `auto` takes it when there is one).
    #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    /// After the check, time this many more runs (feeds copied in, the
    /// outputs copied out) after 3 untimed ones and print their median.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub time: usize,
    /// On `cuda`: convolutions in plain FP32, no TF32 tensor cores (see
    /// `lanes serve --no-tf32`).
    #[arg(long)]
    pub no_tf32: bool,
    /// On `cuda`, after the check (and the timing): one more run op by op,
    /// GPU time per op kind and per signature on stderr (as `lanes bench
    /// infer --op-profile`): where an imported graph's time goes.
    #[arg(long)]
    pub op_profile: bool,
}

fn pair(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => bail!("`{s}` is not NAME=VALUE"),
    }
}

pub fn run(a: Args) -> Result<()> {
    lanes::exec::cuda::set_conv_tf32(!a.no_tf32);
    let mut dims = BTreeMap::new();
    for d in &a.dims {
        let (k, v) = pair(d)?;
        let v: usize = v.parse().with_context(|| format!("size in `{d}`"))?;
        dims.insert(k, v);
    }
    let opts = ImportOptions {
        batch: a.batch,
        dims,
        ..ImportOptions::default()
    };
    let model =
        import_file(&a.model, &opts).with_context(|| format!("importing {}", a.model.display()))?;
    summary(&a.model, a.batch, &model)?;

    let (feeds, expected) = if let Some(dir) = &a.check {
        if !a.inputs.is_empty() || !a.expect.is_empty() {
            bail!("give either --check DIR or --input/--expect, not both");
        }
        references(dir, &a.model, &model)?
    } else if !a.inputs.is_empty() || !a.expect.is_empty() {
        let mut feeds = BTreeMap::new();
        for s in &a.inputs {
            let (k, f) = pair(s)?;
            feeds.insert(k, npy::read(&f)?);
        }
        let mut expected = Vec::new();
        for s in &a.expect {
            let (k, f) = pair(s)?;
            expected.push((k, npy::read(&f)?));
        }
        (feeds, expected)
    } else {
        return Ok(());
    };
    let device = resolve_device(a.device)?;
    if a.op_profile && !device.starts_with("cuda") {
        bail!("--op-profile times kernels on the GPU: give --device cuda");
    }
    check(
        model,
        &feeds,
        &expected,
        &Check {
            rtol: a.rtol,
            atol: a.atol,
            device,
            time: a.time,
            op_profile: a.op_profile,
        },
    )
}

/// How [`check`] runs and compares.
struct Check {
    rtol: f64,
    atol: f64,
    /// `cpu` or `cuda…` (see `lanes::server::resolve_device`).
    device: String,
    /// Timed runs after the check (0: none).
    time: usize,
    /// An op profile after the check (CUDA only).
    op_profile: bool,
}

fn summary(path: &Path, batch: usize, m: &OnnxModel) -> Result<()> {
    println!(
        "{}: opset {}, produced by {}",
        path.display(),
        m.opset,
        if m.producer.is_empty() {
            "?"
        } else {
            &m.producer
        }
    );
    println!(
        "ONNX nodes: {} ({} folded at import)",
        m.onnx_nodes, m.folded
    );
    let c = m.simplified;
    println!(
        "simplified: {} repeated nodes merged, {} scaled products, {} dead nodes dropped",
        c.merged, c.scales, c.dead
    );
    println!("inputs:");
    for (n, t) in &m.inputs {
        println!("  {n}  {t}");
    }
    println!("outputs:");
    for (n, t) in &m.outputs {
        println!("  {n}  {t}");
    }
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for node in &m.graph.nodes {
        if !matches!(node.op, Op::Placeholder(_) | Op::Variable(_)) {
            *kinds.entry(node.op.name()).or_default() += 1;
        }
    }
    let ops: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!(
        "ops ({} nodes): {}",
        kinds.values().sum::<usize>(),
        ops.join(", ")
    );
    let params: usize = m.vars.values().map(Tensor::numel).sum();
    println!("parameters: {params} in {} variables", m.vars.len());
    let vg = validate(m.graph.clone(), &GraphLimits::default())
        .context("the imported graph does not validate")?;
    let fetches: Vec<&str> = m.outputs.iter().map(|(n, _)| n.as_str()).collect();
    let plan = plan_with_fetches(&vg, &fetches, PlanOptions::default())
        .context("planning the imported graph's memory")?;
    println!(
        "memory at batch {batch}: P = {} B, T = {} B",
        plan.persistent, plan.ephemeral
    );
    Ok(())
}

type Refs = (BTreeMap<String, Tensor>, Vec<(String, Tensor)>);

fn references(dir: &Path, model_path: &Path, m: &OnnxModel) -> Result<Refs> {
    let stem = model_path
        .file_stem()
        .and_then(|s| s.to_str())
        .context("the model's file name has no stem")?;
    let file = |name: &str| dir.join(format!("{stem}.{}.npy", name.replace('/', "_")));
    let mut feeds = BTreeMap::new();
    for (n, _) in &m.inputs {
        feeds.insert(n.clone(), npy::read(file(n))?);
    }
    let mut expected = Vec::new();
    for (n, _) in &m.outputs {
        expected.push((n.clone(), npy::read(file(n))?));
    }
    Ok((feeds, expected))
}

fn check(
    m: OnnxModel,
    feeds: &BTreeMap<String, Tensor>,
    expected: &[(String, Tensor)],
    how: &Check,
) -> Result<()> {
    let (rtol, atol) = (how.rtol, how.atol);
    if expected.is_empty() {
        bail!("nothing to compare: give --expect NAME=FILE.npy");
    }
    let vg = validate(m.graph, &GraphLimits::default())?;
    let mut p = Program::new(backend_of(&how.device), vg, m.vars)?;
    let fetches: Vec<String> = expected.iter().map(|(n, _)| n.clone()).collect();
    let t0 = std::time::Instant::now();
    let got = p.run(feeds, &fetches)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    println!(
        "check on {} ({ms:.1} ms), tolerance rtol {rtol:e} / atol {atol:e}:",
        how.device
    );
    let mut bad = 0;
    for ((name, want), g) in expected.iter().zip(&got) {
        let agreement =
            npy::compare(g, want, rtol, atol).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        let verdict = if agreement.ok() { "ok" } else { "MISMATCH" };
        println!(
            "  {name}: {verdict} (max abs {:.3e}, max rel {:.3e}, {} of {} outside)",
            agreement.max_abs, agreement.max_rel, agreement.outside, agreement.elements
        );
        if !agreement.ok() {
            bad += 1;
        }
    }
    if bad > 0 {
        bail!("{bad} output(s) differ from the reference");
    }
    if how.time > 0 {
        for _ in 0..3 {
            p.run(feeds, &fetches)?;
        }
        let mut ms: Vec<f64> = (0..how.time)
            .map(|_| {
                let t0 = std::time::Instant::now();
                p.run(feeds, &fetches)
                    .map(|_| t0.elapsed().as_secs_f64() * 1e3)
            })
            .collect::<Result<_, _>>()?;
        ms.sort_by(f64::total_cmp);
        println!(
            "time on {}: median {:.3} ms, min {:.3} ms over {} runs (feeds in, outputs out)",
            how.device,
            ms[ms.len() / 2],
            ms[0],
            ms.len()
        );
    }
    if how.op_profile {
        let Program::Cuda(c) = &mut p else {
            bail!("--op-profile needs --device cuda");
        };
        let prof = c.profile_ops(feeds, &fetches)?;
        let total: f64 = prof.by_op.iter().map(|x| x.2).sum();
        eprintln!(
            "op profile on {}: {total:.3} ms of GPU time op by op",
            how.device
        );
        super::bench::paths::print_op_profile(&prof.by_op, &prof.by_signature);
    }
    Ok(())
}
