//! `lanes simulate`: run a trace through one or every scheduling policy in the
//! discrete-event simulator and report JCT, makespan, queueing, utilisation.

use std::path::PathBuf;

use anyhow::Context;
use lanes::sim::{
    devices_table, load_trace, plot_jct_cdf, simulate_devices, simulate_with, table, Contention,
    DevicesSummary, LanePlacement, SimConfig, SimOptions, Startup, Summary,
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
    /// Device memory shared by the lanes (per GPU): a size such as 16GiB
    /// (= 16G; a bare K/M/G/T is binary) or 16GB (powers of 1000).
    #[arg(long, default_value = "16GiB")]
    pub memory: ByteSize,
    /// Number of equal lanes the memory is split into (per GPU).
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// Number of GPUs, each with `--memory`, `--lanes` and its own policy
    /// instance; a job is placed on one when it is submitted, where it is
    /// admitted soonest (docs/scheduling.md). Reports each GPU and the
    /// whole.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub gpus: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// GPU contention between lanes that run at once: `off` (full speed
    /// side by side), `h100` (the table measured on an H100 with
    /// ResNet-50 training beside ResNet-152 inference),
    /// `h100-resnet18-cifar` (fitted to resnet18_cifar pair runs on an
    /// H100) or a TOML file with the same keys (docs/scheduling.md;
    /// `lanes trace contention` fits one).
    #[arg(long, default_value = "off")]
    pub contention: String,
    /// Give the policies no iteration-time hints, as the service's
    /// sessions declare none (its SRTF then ranks a job by iterations until
    /// it measured one).
    #[arg(long)]
    pub no_hints: bool,
    /// Start-up of each job before it can be admitted (the graph's transfer
    /// and load), in milliseconds: `MS` for every job, or `TRAIN,INFER`
    /// per kind (`lanes replay` measures them).
    #[arg(long, value_name = "MS[,MS]")]
    pub startup_ms: Option<String>,
    /// The part of the start-up during which the job's graph load holds a
    /// lane's worker, in milliseconds (`MS` or `TRAIN,INFER`): the load
    /// starts on an idle lane, else at the first iteration boundary of a
    /// busy one, whose jobs then wait for it (at most `max(1, lanes − 1)`
    /// loads at once, first come first served). It asks for the worker
    /// `startup − load − after-load` after the submission; the job enters
    /// admission `--after-load-ms` after the load ends. Default: no load
    /// (the start-up delays only the job itself).
    #[arg(long, value_name = "MS[,MS]", requires = "startup_ms")]
    pub load_ms: Option<String>,
    /// With `--load-ms`: the part of the start-up after the load (its
    /// reply and the first Run's trip), in milliseconds (`MS` or
    /// `TRAIN,INFER`; default 0).
    #[arg(long, value_name = "MS[,MS]", requires = "load_ms")]
    pub after_load_ms: Option<String>,
    /// Where admitted jobs go: `policy` (= `equal-lanes`: `--lanes` equal
    /// lanes, the policy's placement) or `service` (a copy of `lanes
    /// serve`'s lane manager over the whole memory, at most `--lanes`
    /// lanes open).
    #[arg(long, default_value = "policy")]
    pub placement: LanePlacement,
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
    let startup = match &args.startup_ms {
        Some(s) => ms_per_kind("--startup-ms", s)?,
        None => Startup::default(),
    };
    let load = match &args.load_ms {
        Some(s) => ms_per_kind("--load-ms", s)?,
        None => Startup::default(),
    };
    let after_load = match &args.after_load_ms {
        Some(s) => ms_per_kind("--after-load-ms", s)?,
        None => Startup::default(),
    };
    for kind in [
        lanes_policies::JobKind::Training,
        lanes_policies::JobKind::Inference,
    ] {
        anyhow::ensure!(
            load.of(kind) + after_load.of(kind) <= startup.of(kind),
            "--load-ms plus --after-load-ms is more than --startup-ms for {kind:?} jobs: \
             the load and what follows it are parts of the start-up"
        );
    }
    let names: Vec<&str> = if args.policy == "all" {
        POLICY_NAMES.to_vec()
    } else {
        vec![args.policy.as_str()]
    };
    let opts = SimOptions {
        schedule: false,
        contention,
        hints: !args.no_hints,
        startup,
        load,
        after_load,
        placement: args.placement,
    };
    let gpus = args.gpus as usize;
    let mut runs = Vec::new();
    let mut per_device = Vec::new();
    let bar = crate::cli::bar(names.len(), &format!("simulating {} jobs", trace.len()));
    for name in names {
        // Only the outcomes are reported: no schedule, so memory stays O(jobs).
        if gpus == 1 {
            let mut policy = by_name(name)?;
            runs.push(simulate_with(&trace, policy.as_mut(), cfg, opts)?);
        } else {
            let run = simulate_devices(&trace, &|| by_name(name), cfg, opts, gpus)?;
            per_device.push(DevicesSummary::of(&run));
            runs.push(run.combined);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let rows: Vec<Summary> = runs.iter().map(Summary::of).collect();
    let lane_size = lanes::size::format_size(cfg.memory / cfg.lanes.max(1) as u64);
    if args.json && gpus == 1 {
        outln!("{}", serde_json::to_string_pretty(&rows)?)?;
    } else if args.json {
        outln!("{}", serde_json::to_string_pretty(&per_device)?)?;
    } else if gpus == 1 {
        outln!(
            "{} jobs, {} lane(s) of {} each",
            trace.len(),
            cfg.lanes,
            lane_size
        )?;
        out!("{}", table(&rows))?;
    } else {
        outln!(
            "{} jobs, {} GPUs of {} lane(s) of {} each",
            trace.len(),
            gpus,
            cfg.lanes,
            lane_size
        )?;
        out!("{}", table(&rows))?;
        outln!("per GPU:")?;
        out!("{}", devices_table(&per_device))?;
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
        "h100-resnet18-cifar" => Some(Contention::h100_resnet18_cifar()?),
        path => {
            let text = std::fs::read_to_string(path).with_context(|| {
                format!(
                    "--contention {path}: not off, h100, h100-resnet18-cifar or a readable file"
                )
            })?;
            Some(Contention::from_toml(&text).with_context(|| format!("--contention {path}"))?)
        }
    })
}

/// `MS` or `TRAIN,INFER` given to `option` (milliseconds, finite, not
/// negative).
pub fn ms_per_kind(option: &str, arg: &str) -> anyhow::Result<Startup> {
    let ms = |s: &str| -> anyhow::Result<std::time::Duration> {
        let v: f64 = s
            .trim()
            .parse()
            .with_context(|| format!("{option} {arg}: {s:?} is not a number of ms"))?;
        anyhow::ensure!(
            v.is_finite() && v >= 0.0,
            "{option} {arg}: {v} is not a duration in ms"
        );
        Ok(std::time::Duration::from_secs_f64(v / 1e3))
    };
    match arg.split_once(',') {
        Some((t, i)) => Ok(Startup {
            training: ms(t)?,
            inference: ms(i)?,
        }),
        None => {
            let d = ms(arg)?;
            Ok(Startup {
                training: d,
                inference: d,
            })
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn startup_takes_one_or_two_figures() {
        let startup_ms = |s| ms_per_kind("--startup-ms", s);
        let s = startup_ms("250").unwrap();
        assert_eq!(s.training, Duration::from_millis(250));
        assert_eq!(s.inference, Duration::from_millis(250));
        let s = startup_ms("120,3000.5").unwrap();
        assert_eq!(s.training, Duration::from_millis(120));
        assert_eq!(s.inference, Duration::from_micros(3_000_500));
        for bad in ["", "x", "-1", "1,", "nan", "1,2,3", "inf"] {
            assert!(startup_ms(bad).is_err(), "{bad}");
        }
    }
}
