//! `lanes bench switch`: latency of the first inference of a model whose
//! weights are not on the device, for each way of bringing them back
//! (pipelined groups, per layer, load-then-run), beside the resident latency
//! and the measured pinned host → device bandwidth. Prints one JSON object.
//!
//! Each timed switch: the program is evicted (its device arena released; an
//! inference model's pinned host image stays current, so eviction copies
//! nothing after the first), then one `run_switching` is timed from the call
//! to the fetched output on the host. Outputs of every switch are checked
//! bit-identical to the resident run. `--precision bf16` (or `fp16`) stores
//! the weights in half (`lanes_adaptor::amp`), so a switch copies about half
//! the bytes (docs/switching.md).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{bail, Context};
use lanes::exec::{Backend, Program};
use lanes::residency::Strategy;
use lanes_adaptor::{validate, GraphLimits, Tensor};

use super::workload;

#[derive(Debug, clap::Args)]
pub struct SwitchArgs {
    /// resnet50 | resnet152 | inception_v3 | bert_base, or a small zoo
    /// model (resnet18_cifar, lenet, mlp, transformer)
    #[arg(long)]
    model: String,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// `auto` (the GPU when one is usable, else the CPU), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value_t = lanes::server::DeviceChoice::Auto)]
    device: lanes::server::DeviceChoice,
    /// Timed switches per strategy (and timed resident runs).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Sequence length for BERT.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// fp32 | bf16 | fp16 (weights stored in half: half the bytes to copy)
    /// | bf16-mixed | fp16-mixed (f32 weights); docs/precision.md.
    #[arg(long, default_value = "fp32")]
    precision: lanes_adaptor::Precision,
    /// Feed from pageable host memory. By default the feeds are registered
    /// page-locked, as the service's feeds are (they are copied from the
    /// job's registered shared segment).
    #[arg(long)]
    pageable_feeds: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bits(t: &[Tensor]) -> anyhow::Result<Vec<u32>> {
    Ok(t[0].f32s()?.iter().map(|x| x.to_bits()).collect())
}

pub fn switch(a: SwitchArgs) -> anyhow::Result<()> {
    if a.batch == 0 || a.iters == 0 {
        bail!("--batch and --iters must be positive");
    }
    workload::check_model(&a.model, a.seq)?;
    let device = super::paths::resolve(a.device)?;
    eprintln!(
        "building {} at batch {} in {} …",
        a.model, a.batch, a.precision
    );
    let built = workload::inference(&a.model, a.batch, a.seq)?.at_precision(a.precision)?;
    let feeds: BTreeMap<String, Tensor> = built.random_feeds(7)?;
    let fetch = vec![built.fetch.clone()];
    let graph = validate(
        built.graph,
        &GraphLimits {
            max_nodes: 1 << 20,
            ..GraphLimits::default()
        },
    )
    .context("model graph does not validate")?;

    let backend = match device {
        super::paths::Device::Cuda => Backend::Cuda,
        super::paths::Device::Cpu => Backend::Cpu,
    };
    let mut prog = Program::new(backend, graph, built.vars)?;
    // Page-locked feeds (held until the timing is done): their copy is a
    // DMA on the stream, as the service's feeds from a job's segment.
    let pins = match (device, a.pageable_feeds) {
        (super::paths::Device::Cuda, false) => feeds
            .values()
            .map(|f| lanes::exec::cuda::pin_host(lanes::exec::HostFeed::bytes(f)))
            .collect::<Result<Vec<_>, _>>()
            .context("registering the feeds page-locked")?,
        _ => Vec::new(),
    };
    // Resident: the first run profiles per-unit compute, later ones replay.
    eprintln!("resident runs …");
    let (first, _) = prog.run_switching(&feeds, &fetch, Strategy::Pipelined)?;
    let want = bits(&first)?;
    for _ in 0..3 {
        prog.run_switching(&feeds, &fetch, Strategy::Pipelined)?;
    }
    let mut resident = Vec::with_capacity(a.iters);
    for _ in 0..a.iters {
        let t = Instant::now();
        prog.run_switching(&feeds, &fetch, Strategy::Pipelined)?;
        resident.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let resident_ms = median(resident);
    // The first eviction copies the weights out and measures the link.
    let t = Instant::now();
    let copied = prog.evict()?;
    let first_evict_ms = t.elapsed().as_secs_f64() * 1e3;
    let bandwidth = prog.bandwidth();
    let bytes = prog.persistent_bytes();
    let mut rows = serde_json::Map::new();
    let mut medians = BTreeMap::new();
    let mut identical = true;
    for s in Strategy::ALL {
        eprintln!("switching with {s} …");
        // One untimed switch records this cut's segments (CUDA).
        prog.evict()?;
        prog.run_switching(&feeds, &fetch, s)?;
        let mut times = Vec::with_capacity(a.iters);
        let mut groups = 0;
        let mut replayed = true;
        let mut traces = Vec::with_capacity(a.iters);
        let bar = crate::cli::bar(a.iters, &format!("switches with {s}"));
        for _ in 0..a.iters {
            prog.evict()?;
            let t = Instant::now();
            let (out, rep) = prog.run_switching(&feeds, &fetch, s)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            groups = rep.as_ref().map_or(0, |r| r.groups);
            traces.push(rep.as_ref().and_then(|r| r.trace.clone()));
            replayed &= rep.is_some_and(|r| r.replayed);
            identical &= bits(&out)? == want;
            bar.inc(1);
        }
        bar.finish_and_clear();
        let m = median(times.clone());
        // The trace of the switch whose time is the median
        // (LANES_SWITCH_TRACE=1).
        let mut by_time: Vec<usize> = (0..times.len()).collect();
        by_time.sort_by(|&i, &j| times[i].total_cmp(&times[j]));
        let trace = by_time
            .get(by_time.len() / 2)
            .and_then(|&i| traces.get(i).cloned().flatten());
        medians.insert(s.name(), m);
        let plan = prog.plan(s);
        rows.insert(
            s.name().into(),
            serde_json::json!({
                "median_ms": m,
                "min_ms": times.iter().copied().fold(f64::INFINITY, f64::min),
                "groups": groups,
                "replayed_segments": replayed,
                "predicted_ms": plan.predicted * 1e3,
                "trace": trace,
            }),
        );
    }
    let copy_ms = bandwidth.map(|bw| bytes as f64 / bw * 1e3);
    let bound_ms = copy_ms.map_or(resident_ms, |c| c.max(resident_ms));
    let pipelined = medians["pipelined"];
    let json = serde_json::json!({
        "bench": "switch",
        "model": a.model,
        "batch": a.batch,
        "seq": if a.model == "bert_base" { Some(a.seq) } else { None },
        "device": device.name(),
        "precision": a.precision.to_string(),
        "persistent_bytes": bytes,
        "units": prog.layout().units.len(),
        "first_evict_ms": first_evict_ms,
        "first_evict_copied_bytes": copied,
        "bandwidth_gb_s": bandwidth.map(|b| b / 1e9),
        "copy_all_ms": copy_ms,
        "resident_ms": resident_ms,
        "lower_bound_ms": bound_ms,
        "strategies": rows,
        "pipelined_over_bound": pipelined / bound_ms,
        "load_then_run_over_pipelined": medians["single"] / pipelined,
        "per_layer_over_pipelined": medians["per_layer"] / pipelined,
        "outputs_identical_to_resident": identical,
        "iters": a.iters,
        "feeds": if pins.is_empty() { "pageable host memory" } else { "page-locked host memory" },
    });
    drop(pins);
    outln!("{json}")?;
    if !identical {
        bail!("a switched run's output differs from the resident run");
    }
    Ok(())
}
