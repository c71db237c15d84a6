//! `lanes replay`: run a trace live and compare with the simulator's
//! prediction for the same trace and policy.
//!
//! `--endpoint embedded` starts the in-process live replay of
//! `lanes::sim::live`: a scheduler thread with the service's
//! `sched::Scheduler`, one worker thread per lane and one client thread per
//! job, on the real clock, with time scaled by `--time-scale`. Each iteration
//! sleeps for its scaled duration (a host thread waiting on its device).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use lanes::sim::{
    load_trace, parse_size, replay_live, simulate, table, LiveConfig, SimConfig, SleepWork, Summary,
};
use lanes_policies::{by_name, POLICY_NAMES};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Trace file (CSV, see docs/scheduling.md).
    #[arg(long)]
    pub trace: PathBuf,
    /// Where to run it; `embedded` runs an in-process service.
    #[arg(long, default_value = "embedded")]
    pub endpoint: String,
    /// fifo, srtf, fair, pack, priority, or all.
    #[arg(long, default_value = "srtf")]
    pub policy: String,
    /// Wall-clock seconds per trace second.
    #[arg(long, default_value_t = 0.1)]
    pub time_scale: f64,
    /// Device memory shared by the lanes.
    #[arg(long, default_value = "16G")]
    pub memory: String,
    /// Number of equal lanes.
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, serde::Serialize)]
struct Comparison {
    policy: String,
    simulated: Summary,
    live: Summary,
    /// live average JCT / simulated average JCT.
    live_over_sim_avg_jct: f64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.endpoint == "embedded",
        "only --endpoint embedded is supported: `lanes serve` has no policy-driven scheduler to replay against yet"
    );
    let trace = load_trace(&args.trace)?;
    let memory = parse_size(&args.memory).with_context(|| format!("--memory {}", args.memory))?;
    let names: Vec<&str> = if args.policy == "all" {
        POLICY_NAMES.to_vec()
    } else {
        vec![args.policy.as_str()]
    };
    let mut out = Vec::new();
    for name in names {
        let sim = simulate(
            &trace,
            by_name(name)?.as_mut(),
            SimConfig {
                memory,
                lanes: args.lanes,
            },
        )?;
        let cfg = LiveConfig {
            memory,
            lanes: args.lanes,
            time_scale: args.time_scale,
        };
        let live = replay_live(&trace, by_name(name)?, cfg, Arc::new(SleepWork))?;
        let (simulated, live) = (Summary::of(&sim), Summary::of(&live));
        let ratio = if simulated.avg_jct_s > 0.0 {
            live.avg_jct_s / simulated.avg_jct_s
        } else {
            0.0
        };
        out.push(Comparison {
            policy: name.to_string(),
            simulated,
            live,
            live_over_sim_avg_jct: ratio,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} jobs, {} lane(s), time scale {} (times below in trace seconds)",
        trace.len(),
        args.lanes,
        args.time_scale
    );
    for c in &out {
        let mut sim = c.simulated.clone();
        sim.policy = format!("{} sim", c.policy);
        let mut live = c.live.clone();
        live.policy = format!("{} live", c.policy);
        print!("{}", table(&[sim, live]));
        println!(
            "live / simulated average JCT: {:.3}\n",
            c.live_over_sim_avg_jct
        );
    }
    Ok(())
}
