//! `lanes bench sim`: how fast the trace simulator runs a large trace under
//! every policy, as one JSON object (times are wall-clock seconds of
//! `simulate_with` alone, without reading or generating the trace).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use lanes::sim::{generate, load_trace, simulate_with, GenConfig, SimConfig, SimOptions, Summary};
use lanes_policies::{by_name, POLICY_NAMES};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// Trace file; without it a synthetic trace (`lanes trace gen`'s
    /// distributions) of `--jobs` jobs is generated.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Jobs of the generated trace.
    #[arg(long, default_value_t = 10_000)]
    pub jobs: usize,
    /// Seed of the generated trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Device memory shared by the lanes, e.g. 16G.
    #[arg(long, default_value = "16G")]
    pub memory: String,
    /// Number of equal lanes.
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// GPU contention model: off, h100 or a TOML file (as `lanes simulate`).
    #[arg(long, default_value = "off")]
    pub contention: String,
    /// fifo, srtf, fair, pack, priority, or all.
    #[arg(long, default_value = "all")]
    pub policy: String,
}

pub fn sim(args: SimArgs) -> anyhow::Result<()> {
    let trace = match &args.trace {
        Some(path) => load_trace(path)?,
        None => generate(&GenConfig {
            jobs: args.jobs,
            seed: args.seed,
            ..GenConfig::default()
        }),
    };
    let memory = lanes::size::parse_size(&args.memory)
        .with_context(|| format!("--memory {}", args.memory))?;
    let cfg = SimConfig {
        memory,
        lanes: args.lanes,
    };
    let contention = crate::cli::simulate::contention_model(&args.contention)?;
    let names: Vec<&str> = if args.policy == "all" {
        POLICY_NAMES.to_vec()
    } else {
        vec![args.policy.as_str()]
    };
    let iterations: u64 = trace.iter().map(|j| j.iterations).sum();
    let mut runs = Vec::new();
    let mut total = 0.0;
    for name in names {
        let mut policy = by_name(name)?;
        let start = Instant::now();
        let opts = SimOptions {
            schedule: false,
            contention,
            ..SimOptions::default()
        };
        let run = simulate_with(&trace, policy.as_mut(), cfg, opts)?;
        let seconds = start.elapsed().as_secs_f64();
        total += seconds;
        let s = Summary::of(&run);
        eprintln!("{name}: {seconds:.3} s");
        runs.push(json!({
            "policy": name,
            "seconds": seconds,
            "avg_jct_s": s.avg_jct_s,
            "makespan_s": s.makespan_s,
        }));
    }
    let out = json!({
        "bench": "sim",
        "jobs": trace.len(),
        "iterations": iterations,
        "memory_bytes": memory,
        "lanes": args.lanes,
        "contention": args.contention,
        "runs": runs,
        "total_seconds": total,
        "peak_rss_bytes": peak_rss(),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// The process's peak resident memory (`VmHWM`), where Linux reports it.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
