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
//!
//! `--keep auto|BYTES` (default `auto`) adds the row `pipelined_keep`: the
//! pipelined switch of a program evicted *partially*, its first units kept
//! on the device (`Program::evict_keeping`), with the bytes kept and its
//! ratio to both bounds; `--keep none` leaves it out. `--reserve BYTES`
//! maps every arena from a device reservation's chunks, as the service
//! does with `--memory`. On CUDA, `feeds_staging` times the pipelined
//! switch with its feeds staged (the default) and without, alternated.

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
    /// Partial eviction for the `pipelined_keep` row: `auto` (the bytes
    /// `Program::auto_keep_bytes` picks from the measured costs), a byte
    /// count (`16MiB`), or `none` (no such row).
    #[arg(long, default_value = "auto", value_parser = parse_keep)]
    keep: Keep,
    /// Take a device reservation of this size first (`4GiB`), as `lanes
    /// serve --memory` does: every arena is then mapped from its 16 MiB
    /// chunks, piece by piece, as in the service (CUDA only).
    #[arg(long, value_parser = parse_reserve)]
    reserve: Option<u64>,
}

fn parse_reserve(s: &str) -> Result<u64, String> {
    lanes::size::parse_size(s).map_err(|e| e.to_string())
}

/// What `--keep` asks a partial eviction to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    None,
    Auto,
    Bytes(u64),
}

fn parse_keep(s: &str) -> Result<Keep, String> {
    match s {
        "none" => Ok(Keep::None),
        "auto" => Ok(Keep::Auto),
        _ => lanes::size::parse_size(s)
            .map(Keep::Bytes)
            .map_err(|e| format!("{e} (or auto, none)")),
    }
}

/// One strategy's timed switches.
struct Timed {
    times: Vec<f64>,
    groups: usize,
    replayed: bool,
    /// Every timed switch staged its feeds (docs/switching.md).
    staged: bool,
    identical: bool,
    traces: Vec<Option<lanes::residency::SwitchTrace>>,
    kept_bytes: u64,
    copied_bytes: u64,
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
    let reservation = match (a.reserve, device) {
        (None, _) => None,
        (Some(bytes), super::paths::Device::Cuda) => Some(
            lanes::exec::cuda::DeviceReservation::new(bytes)
                .context("taking the device reservation (--reserve)")?,
        ),
        (Some(_), super::paths::Device::Cpu) => bail!("--reserve is for --device cuda"),
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
        let t = timed(&mut prog, &feeds, &fetch, &want, s, 0, a.iters)?;
        identical &= t.identical;
        let plan = prog.plan(s);
        medians.insert(s.name(), median(t.times.clone()));
        rows.insert(s.name().into(), row(&t, plan.predicted));
    }
    // The pipelined switch with its feeds staged and without, alternated
    // switch by switch (CUDA: docs/switching.md, *Feeds staged*).
    let staging = match device {
        super::paths::Device::Cuda => {
            eprintln!("switching with pipelined, feeds staged and not, alternated …");
            let ab = staging_ab(&mut prog, &feeds, &fetch, &want, a.iters);
            lanes::exec::cuda::set_stage_feeds(true);
            let (staged, unstaged) = ab?;
            identical &= staged.identical && unstaged.identical;
            Some((staged, unstaged))
        }
        super::paths::Device::Cpu => None,
    };
    // A partial eviction: the first units stay, the rest is switched in
    // pipelined.
    let keep = match a.keep {
        Keep::None => None,
        Keep::Auto => Some(prog.auto_keep_bytes().unwrap_or(0)),
        Keep::Bytes(b) => Some(b),
    };
    let mut kept = None;
    if let Some(keep) = keep {
        eprintln!("switching with pipelined, keeping {keep} bytes …");
        let t = timed(
            &mut prog,
            &feeds,
            &fetch,
            &want,
            Strategy::Pipelined,
            keep,
            a.iters,
        )?;
        identical &= t.identical;
        prog.evict_keeping(keep)?;
        let plan = prog.plan(Strategy::Pipelined);
        let units = prog.kept_units();
        let kept_device = prog.kept_bytes();
        prog.evict()?;
        let mut r = row(&t, plan.predicted);
        if let Some(o) = r.as_object_mut() {
            o.insert("keep_requested_bytes".into(), keep.into());
            o.insert("kept_bytes".into(), kept_device.into());
            o.insert("kept_units".into(), units.into());
            o.insert("kept_persistent_bytes".into(), t.kept_bytes.into());
            o.insert("copied_bytes".into(), t.copied_bytes.into());
            o.insert(
                "kept_percent_of_p".into(),
                (100.0 * kept_device as f64 / bytes.max(1) as f64).into(),
            );
        }
        medians.insert("pipelined_keep", median(t.times.clone()));
        rows.insert("pipelined_keep".into(), r);
        kept = Some(t.copied_bytes);
    }
    let copy_ms = bandwidth.map(|bw| bytes as f64 / bw * 1e3);
    let bound_ms = copy_ms.map_or(resident_ms, |c| c.max(resident_ms));
    // A switch also copies the Run's feeds over the same link before its
    // first kernel (a resident Run copies them too, inside resident_ms):
    // the bound when the link carries both.
    let feed_bytes: usize = feeds.values().map(|t| t.ty().bytes()).sum();
    let copy_with_feeds_ms = bandwidth.map(|bw| (bytes + feed_bytes as u64) as f64 / bw * 1e3);
    let bound_with_feeds_ms = copy_with_feeds_ms.map_or(resident_ms, |c| c.max(resident_ms));
    let pipelined = medians["pipelined"];
    // With the kept prefix resident the bound is max(copy of the rest,
    // compute).
    let copy_rest_ms = kept.and_then(|c| bandwidth.map(|bw| c as f64 / bw * 1e3));
    let rest_bound_ms = kept.map(|_| copy_rest_ms.map_or(resident_ms, |c| c.max(resident_ms)));
    let keep_ratio = |b: f64| medians.get("pipelined_keep").map(|m| m / b);
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
        "planned_compute_ms": prog.planned_compute_secs().map(|s| s * 1e3),
        "lower_bound_ms": bound_ms,
        "strategies": rows,
        "pipelined_over_bound": pipelined / bound_ms,
        "feed_bytes": feed_bytes,
        "bound_with_feeds_ms": bound_with_feeds_ms,
        "pipelined_over_bound_with_feeds": pipelined / bound_with_feeds_ms,
        "copy_rest_ms": copy_rest_ms,
        "rest_bound_ms": rest_bound_ms,
        "pipelined_keep_over_bound": keep_ratio(bound_ms),
        "pipelined_keep_over_rest_bound": rest_bound_ms.and_then(keep_ratio),
        "load_then_run_over_pipelined": medians["single"] / pipelined,
        "per_layer_over_pipelined": medians["per_layer"] / pipelined,
        "outputs_identical_to_resident": identical,
        "iters": a.iters,
        "feeds": if pins.is_empty() { "pageable host memory" } else { "page-locked host memory" },
        "reserved_bytes": a.reserve,
        "feeds_staging": staging.as_ref().map(|(on, off)| {
            let (on_ms, off_ms) = (median(on.times.clone()), median(off.times.clone()));
            serde_json::json!({
                "staged_ms": on_ms,
                "unstaged_ms": off_ms,
                "staged_over_bound": on_ms / bound_ms,
                "unstaged_over_bound": off_ms / bound_ms,
                "every_switch_staged": on.staged,
            })
        }),
        "staging_bytes": lanes::exec::cuda::staging_bytes(),
    });
    drop(pins);
    // The program's blocks go back to the reservation before it goes.
    drop(prog);
    drop(reservation);
    outln!("{json}")?;
    if !identical {
        bail!("a switched run's output differs from the resident run");
    }
    Ok(())
}

/// `iters` timed switches with `strategy` after one untimed one (which
/// records its segments on CUDA), each after an eviction keeping `keep`
/// bytes (0: whole); outputs compared with `want`.
fn timed(
    prog: &mut Program,
    feeds: &BTreeMap<String, Tensor>,
    fetch: &[String],
    want: &[u32],
    strategy: Strategy,
    keep: u64,
    iters: usize,
) -> anyhow::Result<Timed> {
    prog.evict_keeping(keep)?;
    prog.run_switching(feeds, fetch, strategy)?;
    let mut t = Timed {
        times: Vec::with_capacity(iters),
        groups: 0,
        replayed: true,
        staged: true,
        identical: true,
        traces: Vec::with_capacity(iters),
        kept_bytes: 0,
        copied_bytes: 0,
    };
    let bar = crate::cli::bar(iters, &format!("switches with {strategy}"));
    for _ in 0..iters {
        prog.evict_keeping(keep)?;
        let t0 = Instant::now();
        let (out, rep) = prog.run_switching(feeds, fetch, strategy)?;
        t.times.push(t0.elapsed().as_secs_f64() * 1e3);
        if let Some(r) = &rep {
            t.groups = r.groups;
            t.kept_bytes = r.kept_bytes;
            t.copied_bytes = r.bytes;
        }
        t.traces.push(rep.as_ref().and_then(|r| r.trace.clone()));
        t.replayed &= rep.as_ref().is_some_and(|r| r.replayed);
        t.staged &= rep.as_ref().is_some_and(|r| r.feeds_staged);
        t.identical &= bits(&out)? == want;
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(t)
}

/// `iters` pipelined switches with the feeds staged and `iters` without,
/// alternated (so that both meet the same machine); outputs compared with
/// `want`. Leaves staging off: the caller turns it back on.
fn staging_ab(
    prog: &mut Program,
    feeds: &BTreeMap<String, Tensor>,
    fetch: &[String],
    want: &[u32],
    iters: usize,
) -> anyhow::Result<(Timed, Timed)> {
    let mut on = timed(prog, feeds, fetch, want, Strategy::Pipelined, 0, 1)?;
    lanes::exec::cuda::set_stage_feeds(false);
    let mut off = timed(prog, feeds, fetch, want, Strategy::Pipelined, 0, 1)?;
    on.times.clear();
    off.times.clear();
    let bar = crate::cli::bar(iters, "switches, staged and not");
    for _ in 0..iters {
        for (stage, t) in [(true, &mut on), (false, &mut off)] {
            lanes::exec::cuda::set_stage_feeds(stage);
            prog.evict()?;
            let t0 = Instant::now();
            let (out, rep) = prog.run_switching(feeds, fetch, Strategy::Pipelined)?;
            t.times.push(t0.elapsed().as_secs_f64() * 1e3);
            t.staged &= rep.as_ref().is_some_and(|r| r.feeds_staged);
            t.identical &= bits(&out)? == want;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((on, off))
}

/// A strategy's row of the report.
fn row(t: &Timed, predicted: f64) -> serde_json::Value {
    // The trace of the switch whose time is the median
    // (LANES_SWITCH_TRACE=1).
    let mut by_time: Vec<usize> = (0..t.times.len()).collect();
    by_time.sort_by(|&i, &j| t.times[i].total_cmp(&t.times[j]));
    let trace = by_time
        .get(by_time.len() / 2)
        .and_then(|&i| t.traces.get(i).cloned().flatten());
    serde_json::json!({
        "median_ms": median(t.times.clone()),
        "min_ms": t.times.iter().copied().fold(f64::INFINITY, f64::min),
        "groups": t.groups,
        "replayed_segments": t.replayed,
        "feeds_staged": t.staged,
        "predicted_ms": predicted * 1e3,
        "trace": trace,
    })
}
