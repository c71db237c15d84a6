//! `lanes simulate`: run a trace through one or every scheduling policy in the
//! discrete-event simulator and report JCT, makespan, queueing, utilisation.

use std::path::PathBuf;

use anyhow::Context;
use lanes::sim::{
    load_trace, plot_jct_cdf, simulate_with, table, Contention, SimConfig, SimOptions, Summary,
};
use lanes::size::ByteSize;
use lanes_policies::{by_name, POLICY_NAMES};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Trace file (CSV, see docs/scheduling.md).
    #[arg(long)]
    pub trace: PathBuf,
    /// fifo, srtf, fair, pack, priority, or all (side by side).
    #[arg(long, default_value = "all")]
    pub policy: String,
    /// Device memory shared by the lanes: a size such as 16GiB (= 16G;
    /// a bare K/M/G/T is binary) or 16GB (powers of 1000).
    #[arg(long, default_value = "16GiB")]
    pub memory: ByteSize,
    /// Number of equal lanes the memory is split into.
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// GPU contention between lanes that run at once: `off` (full speed
    /// side by side), `h100` (the table measured on an H100) or a TOML
    /// file with the same keys (docs/scheduling.md).
    #[arg(long, default_value = "off")]
    pub contention: String,
    /// Also draw the JCT distribution per policy into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let trace = load_trace(&args.trace)?;
    let memory = args.memory.0;
    let cfg = SimConfig {
        memory,
        lanes: args.lanes,
    };
    let contention = contention_model(&args.contention)?;
    let names: Vec<&str> = if args.policy == "all" {
        POLICY_NAMES.to_vec()
    } else {
        vec![args.policy.as_str()]
    };
    let mut runs = Vec::new();
    let bar = crate::cli::bar(names.len(), &format!("simulating {} jobs", trace.len()));
    for name in names {
        let mut policy = by_name(name)?;
        // Only the outcomes are reported: no schedule, so memory stays O(jobs).
        runs.push(simulate_with(
            &trace,
            policy.as_mut(),
            cfg,
            SimOptions {
                schedule: false,
                contention,
            },
        )?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let rows: Vec<Summary> = runs.iter().map(Summary::of).collect();
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?)?;
    } else {
        outln!(
            "{} jobs, {} lane(s) of {} each",
            trace.len(),
            cfg.lanes,
            lanes::size::format_size(cfg.memory / cfg.lanes.max(1) as u64)
        )?;
        out!("{}", table(&rows))?;
    }
    if let Some(path) = &args.plot {
        plot_jct_cdf(&runs, path)?;
        if !args.json {
            outln!("JCT distribution written to {}", path.display())?;
        }
    }
    Ok(())
}

/// `--contention off|h100|FILE`.
pub fn contention_model(arg: &str) -> anyhow::Result<Option<Contention>> {
    Ok(match arg {
        "off" => None,
        "h100" => Some(Contention::h100()),
        path => {
            let text = std::fs::read_to_string(path).with_context(|| {
                format!("--contention {path}: not off, h100 or a readable file")
            })?;
            Some(Contention::from_toml(&text).with_context(|| format!("--contention {path}"))?)
        }
    })
}
