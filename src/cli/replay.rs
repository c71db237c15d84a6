//! `lanes replay`: run a trace live and compare with the simulator's
//! prediction for the same trace and policy.
//!
//! `--endpoint` picks what runs it:
//! - `embedded` (default): the in-process live replay of `lanes::sim::live`,
//!   a scheduler thread with the service's `sched::Scheduler`, one worker
//!   thread per lane and one client thread per job, on the real clock, with
//!   time scaled by `--time-scale`; each iteration sleeps for its scaled
//!   duration (a host thread waiting on its device);
//! - `serve`: starts a real `lanes serve` in this process (loopback TCP, one
//!   worker, `--policy`; `all` starts one per policy) and replays against it
//!   as below;
//! - a ZeroMQ address (`tcp://…`, `ipc://…`): a running `lanes serve`;
//!   `lanes::sim::remote` opens one session per trace job with a zoo MLP
//!   sized so an iteration takes the scaled trace time, and the policy is
//!   the service's own (`--policy`, if given, must match it).
//!
//! Against a service the simulator is run twice: on the trace as given, and
//! on the trace "as run" (each job's iteration time replaced by the mean the
//! service measured), which separates model-sizing error from scheduling
//! error. Both runs are without iteration-time hints, as the service's
//! sessions declare none; the as-run one also pays each kind's start-up
//! (OpenSession to the first Run's reply, less that Run's service time),
//! measured on the idle service before the replay, of which the
//! LoadGraph holds a lane's worker (the service's own timing of it from
//! its metrics endpoint, `--metrics`, else its round trip): the as-run
//! simulation runs each job's load on a lane, delaying that lane's jobs,
//! and is reported without loads too. `--lanes N` simulates N lanes
//! (start the service with `--workers N --max-lanes N`) under
//! `--contention`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lanes::server::{self, PolicyChoice, ServerConfig};
use lanes::sim::{
    calibrate, load_trace, measure_idle, replay_live, replay_remote, service_policy, simulate_with,
    table, Calibration, Contention, CostCurve, JobTimeline, LanePlacement, LiveConfig,
    RemoteConfig, SimConfig, SimOptions, SleepWork, Startup, Summary, TraceJob,
};
use lanes::size::{format_size, ByteSize};
use lanes_policies::{by_name, JobKind, POLICY_NAMES};

/// Rounds `lanes replay` measures each kind's start-up and solo iteration
/// on the idle service (the first is not counted; the rest's median is).
const IDLE_ROUNDS: usize = 4;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Trace file (CSV, see docs/scheduling.md).
    #[arg(long)]
    pub trace: PathBuf,
    /// `embedded` (in-process threads that sleep), `serve` (a real service
    /// started in this process), or the address of a running `lanes serve`.
    #[arg(long, default_value = "embedded")]
    pub endpoint: String,
    /// fifo, srtf, fair, pack, priority, or all (default: srtf; against a
    /// running service, the service's policy).
    #[arg(long)]
    pub policy: Option<String>,
    /// Wall-clock seconds per trace second.
    #[arg(long, default_value_t = 0.1)]
    pub time_scale: f64,
    /// Device memory shared by the lanes (embedded replay and simulator):
    /// a size such as 16GiB (= 16G; a bare K/M/G/T is binary) or 16GB.
    #[arg(long, default_value = "16GiB")]
    pub memory: ByteSize,
    /// Number of equal lanes the simulator (and the embedded replay) runs.
    /// Against a service it should match its `--workers N --max-lanes N`
    /// (`--endpoint serve` starts one so).
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// GPU contention between the simulated lanes: off, h100,
    /// h100-resnet18-cifar or a TOML file (as `lanes simulate`).
    #[arg(long, default_value = "off")]
    pub contention: String,
    /// Runs each job keeps outstanding against a service (enough that its
    /// next Run is always queued when one finishes).
    #[arg(long, default_value_t = 4)]
    pub pipeline: usize,
    /// Width of the replayed MLPs' layers.
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// Batch of the replayed MLPs (or zoo models).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Against a service: run every job as this zoo model instead of an MLP
    /// calibrated to the trace's iteration time (mlp, lenet,
    /// resnet18_cifar, resnet50, resnet152, transformer). The iteration
    /// time is then the model's own; compare with *sim as-run*.
    #[arg(long)]
    pub zoo: Option<String>,
    /// Against a running service: its metrics endpoint (`lanes serve
    /// --metrics ADDR`, `host:port`), where the replay reads the
    /// service's own timing of each LoadGraph on the idle service (the
    /// time a load holds a worker). Without it the load is timed by its
    /// round trip, which also counts the graph's transfer.
    /// `--endpoint serve` serves metrics on a free port itself.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
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
    /// Against a service: the simulator on the trace as it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    simulated_as_run: Option<Summary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    live_over_sim_as_run_avg_jct: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration: Option<Calibration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    depths: Option<Vec<usize>>,
    /// Against a service: per job, the trace's iteration time, the
    /// service's measured mean and the as-run simulation's (ms of trace
    /// time).
    #[serde(skip_serializing_if = "Option::is_none")]
    iteration_ms: Option<Vec<JobIteration>>,
    /// Against a service: each kind's start-up measured on the idle
    /// service (trace ms), given to the simulator as run.
    #[serde(skip_serializing_if = "Option::is_none")]
    startup_ms: Option<StartupMs>,
    /// Against a service: the part of each kind's start-up during which
    /// its LoadGraph held a worker (trace ms; measured as
    /// `load_measured_by` says), a lane's worker in the as-run simulation.
    #[serde(skip_serializing_if = "Option::is_none")]
    load_ms: Option<StartupMs>,
    /// Against a service: the LoadGraph's round trip on the idle service
    /// (trace ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    load_round_trip_ms: Option<StartupMs>,
    /// Against a service: the part of the start-up after the LoadGraph's
    /// reply (the first Run's trips; trace ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    after_load_ms: Option<StartupMs>,
    /// `service metrics` (the service's own timing of the LoadGraph) or
    /// `round trip`.
    #[serde(skip_serializing_if = "Option::is_none")]
    load_measured_by: Option<&'static str>,
    /// Against a service: the as-run simulation with the start-up only
    /// delaying each job itself (no load on a lane), as before loads were
    /// modelled, for comparison.
    #[serde(skip_serializing_if = "Option::is_none")]
    simulated_as_run_without_loads: Option<Summary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    live_over_sim_as_run_without_loads_avg_jct: Option<f64>,
    /// Against a service: each kind's iteration alone on the idle service
    /// (trace ms, the mean of a few Runs after the first).
    #[serde(skip_serializing_if = "Option::is_none")]
    solo_iteration_ms: Option<StartupMs>,
    /// Against a service: each kind's warm-up on the idle service, the
    /// service time of a session's first Runs beyond as many solo
    /// iterations (trace ms); the as-run simulation from solo times
    /// spreads it over each job's iterations.
    #[serde(skip_serializing_if = "Option::is_none")]
    warmup_ms: Option<StartupMs>,
    /// Against a service: which iteration times the as-run simulation
    /// took: `measured` (each job's mean during the replay) or `solo`
    /// (its iteration alone, with its kind's warm-up spread over its
    /// iterations: several lanes under a contention model).
    #[serde(skip_serializing_if = "Option::is_none")]
    as_run_iterations: Option<&'static str>,
    /// Against a service: per job, arrival, admission, first reply and end.
    #[serde(skip_serializing_if = "Option::is_none")]
    timelines: Option<Vec<JobTimeline>>,
    /// Lanes simulated.
    lanes: usize,
    /// Contention model of the simulation.
    contention: String,
}

#[derive(Debug, serde::Serialize)]
struct StartupMs {
    training: f64,
    inference: f64,
}

impl StartupMs {
    fn of(s: &Startup) -> Self {
        StartupMs {
            training: s.training.as_secs_f64() * 1e3,
            inference: s.inference.as_secs_f64() * 1e3,
        }
    }
}

#[derive(Debug, serde::Serialize)]
struct JobIteration {
    job: u64,
    trace_ms: f64,
    measured_ms: f64,
    /// What the as-run simulation took.
    simulated_ms: f64,
}

fn ratio(live: &Summary, sim: &Summary) -> f64 {
    if sim.avg_jct_s > 0.0 {
        live.avg_jct_s / sim.avg_jct_s
    } else {
        0.0
    }
}

fn policy_names(arg: Option<&str>, default: &'static str) -> Vec<String> {
    match arg {
        Some("all") => POLICY_NAMES.iter().map(|s| s.to_string()).collect(),
        Some(p) => vec![p.to_string()],
        None => vec![default.to_string()],
    }
}

fn sim_summary(
    trace: &[TraceJob],
    name: &str,
    memory: u64,
    lanes: usize,
    opts: SimOptions,
) -> anyhow::Result<Summary> {
    let run = simulate_with(
        trace,
        by_name(name)?.as_mut(),
        SimConfig { memory, lanes },
        SimOptions {
            schedule: false,
            ..opts
        },
    )?;
    Ok(Summary::of(&run))
}

/// Replays against the service at `endpoint`, which runs `policy`.
fn against_service(
    args: &Args,
    trace: &[TraceJob],
    endpoint: &str,
    policy: &'static str,
    memory: u64,
    contention: Option<Contention>,
    metrics: Option<&str>,
) -> anyhow::Result<Comparison> {
    let cfg = RemoteConfig {
        time_scale: args.time_scale,
        pipeline: args.pipeline,
        width: args.width,
        batch: args.batch,
        zoo: args.zoo.clone(),
        metrics: metrics.map(str::to_string),
        ..RemoteConfig::new(endpoint)
    };
    let spin = crate::cli::spinner("calibrating the models on the service");
    let calibration = if cfg.zoo.is_some() {
        // Zoo models run as they are: nothing to size.
        Calibration {
            training: CostCurve { points: Vec::new() },
            inference: CostCurve { points: Vec::new() },
        }
    } else {
        calibrate(&cfg).context("calibrating the models on the service")?
    };
    spin.set_prefix(format!(
        "replaying {} jobs under {policy} on {endpoint}",
        trace.len()
    ));
    spin.set_prefix("measuring each kind's start-up on the service");
    // The replay's MLPs vary in depth; their start-up is measured at the
    // median depth the trace asks for.
    let depth = {
        let fit = &calibration.training;
        let mut d: Vec<usize> = trace
            .iter()
            .map(|j| fit.depth_for(j.iteration.mul_f64(args.time_scale), cfg.max_depth))
            .collect();
        d.sort_unstable();
        d.get(d.len() / 2).copied().unwrap_or(1)
    };
    let idle =
        measure_idle(&cfg, depth, IDLE_ROUNDS).context("measuring start-up on the service")?;
    let startup = idle.startup;
    spin.set_prefix(format!(
        "replaying {} jobs under {policy} on {endpoint}",
        trace.len()
    ));
    let r = replay_remote(trace, policy, &cfg, &calibration)?;
    spin.finish_and_clear();
    // The replay's sessions declare their iterations but no iteration
    // time, so the service's policies have no hints: neither has the
    // simulation. The as-run simulation also pays the measured start-up,
    // of which the load holds a lane's worker.
    let opts = SimOptions {
        hints: false,
        contention,
        placement: LanePlacement::Service,
        ..SimOptions::default()
    };
    let simulated = sim_summary(trace, policy, memory, args.lanes, opts)?;
    // With several lanes, a job's mean measured during the replay carries
    // the slowdown of the lanes beside it, which the contention model
    // applies again: the as-run simulation then takes each job's
    // iteration alone (its kind's solo time for zoo models, plus its
    // warm-up spread over the job's iterations; the calibration at its
    // depth for MLPs).
    let solo_as_run = args.lanes > 1 && contention.is_some();
    let mut as_run_trace = r.as_run.clone();
    if solo_as_run {
        for (a, depth) in as_run_trace.iter_mut().zip(&r.depths) {
            let fit = match a.kind {
                JobKind::Training => &calibration.training,
                JobKind::Inference => &calibration.inference,
            };
            a.iteration = match (&cfg.zoo, fit.cost_at(*depth)) {
                (None, Some(s)) => Duration::from_secs_f64(s / args.time_scale),
                // The kind's solo iteration, with the first Runs' warm-up
                // spread over the job's iterations (its mean alone).
                _ => {
                    idle.solo.of(a.kind)
                        + idle
                            .warmup
                            .of(a.kind)
                            .checked_div(u32::try_from(a.iterations.max(1)).unwrap_or(u32::MAX))
                            .unwrap_or_default()
                }
            };
        }
    }
    // Each job's LoadGraph holds a lane's worker for the measured load.
    let as_run = sim_summary(
        &as_run_trace,
        policy,
        memory,
        args.lanes,
        SimOptions {
            startup,
            load: idle.load,
            after_load: idle.after_load,
            ..opts
        },
    )?;
    let without_loads = sim_summary(
        &as_run_trace,
        policy,
        memory,
        args.lanes,
        SimOptions { startup, ..opts },
    )?;
    let live = Summary::of(&r.run);
    Ok(Comparison {
        policy: policy.to_string(),
        live_over_sim_avg_jct: ratio(&live, &simulated),
        live_over_sim_as_run_avg_jct: Some(ratio(&live, &as_run)),
        live_over_sim_as_run_without_loads_avg_jct: Some(ratio(&live, &without_loads)),
        simulated_as_run_without_loads: Some(without_loads),
        load_ms: Some(StartupMs::of(&idle.load)),
        load_round_trip_ms: Some(StartupMs::of(&idle.load_round_trip)),
        after_load_ms: Some(StartupMs::of(&idle.after_load)),
        load_measured_by: Some(if idle.load_from_metrics {
            "service metrics"
        } else {
            "round trip"
        }),
        simulated,
        simulated_as_run: Some(as_run),
        live,
        iteration_ms: Some(
            trace
                .iter()
                .zip(&r.as_run)
                .zip(&as_run_trace)
                .map(|((t, a), s)| JobIteration {
                    job: t.id,
                    trace_ms: t.iteration.as_secs_f64() * 1e3,
                    measured_ms: a.iteration.as_secs_f64() * 1e3,
                    simulated_ms: s.iteration.as_secs_f64() * 1e3,
                })
                .collect(),
        ),
        calibration: Some(r.calibration),
        depths: Some(r.depths),
        startup_ms: Some(StartupMs::of(&startup)),
        solo_iteration_ms: Some(StartupMs::of(&idle.solo)),
        warmup_ms: Some(StartupMs::of(&idle.warmup)),
        as_run_iterations: Some(if solo_as_run { "solo" } else { "measured" }),
        timelines: Some(r.timelines),
        lanes: args.lanes,
        contention: args.contention.clone(),
    })
}

/// How the service at `endpoint` differs from what the simulator models
/// against it (one worker, so one iteration at a time; `memory` bytes):
/// each a sentence that says how to make them match. Empty when they
/// match or the service does not answer (the replay then reports that).
fn mismatches(endpoint: &str, memory: u64, lanes: usize) -> Vec<String> {
    let options = lanes_adaptor::ClientOptions {
        timeout: Duration::from_secs(5),
        name: "lanes replay".into(),
        ..lanes_adaptor::ClientOptions::default()
    };
    let Ok(status) =
        lanes_adaptor::Client::connect_with(endpoint, options).and_then(|mut c| c.status())
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if status.workers as usize != lanes {
        out.push(format!(
            "the service at {endpoint} runs {} workers, the simulation {lanes} lane(s) (one iteration at a time each): \
             live times will not be comparable; restart it with `lanes serve --workers {lanes} --max-lanes {lanes}`, \
             replay with `--lanes {}`, or replay with `--endpoint serve`",
            status.workers, status.workers
        ));
    }
    if status.memory_bytes.is_some() && status.max_lanes as usize != lanes {
        out.push(format!(
            "the service at {endpoint} may split its memory into up to {} lanes, the simulation {lanes}: \
             admission will differ; restart it with `--max-lanes {lanes}`",
            status.max_lanes
        ));
    }
    if let Some(m) = status.memory_bytes.filter(|&m| m != memory) {
        out.push(format!(
            "the service's lanes share {}, the simulation {}: pass `--memory {m}` to simulate the service's",
            format_size(m),
            format_size(memory)
        ));
    }
    out
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let trace = load_trace(&args.trace)?;
    let memory = args.memory.0;
    anyhow::ensure!(args.lanes >= 1, "--lanes must be at least 1");
    let contention = crate::cli::simulate::contention_model(&args.contention)?;
    anyhow::ensure!(
        args.endpoint != "embedded" || args.zoo.is_none(),
        "--zoo runs real models and needs a service: --endpoint serve or an address"
    );
    let mut out = Vec::new();
    match args.endpoint.as_str() {
        "embedded" => {
            for name in policy_names(args.policy.as_deref(), "srtf") {
                let opts = SimOptions {
                    contention,
                    ..SimOptions::default()
                };
                let simulated = sim_summary(&trace, &name, memory, args.lanes, opts)?;
                let spin = crate::cli::spinner(&format!(
                    "replaying {} jobs under {name} (embedded)",
                    trace.len()
                ));
                let cfg = LiveConfig {
                    memory,
                    lanes: args.lanes,
                    time_scale: args.time_scale,
                };
                let live = Summary::of(&replay_live(
                    &trace,
                    by_name(&name)?,
                    cfg,
                    Arc::new(SleepWork),
                )?);
                spin.finish_and_clear();
                out.push(Comparison {
                    policy: name,
                    live_over_sim_avg_jct: ratio(&live, &simulated),
                    simulated,
                    live,
                    simulated_as_run: None,
                    live_over_sim_as_run_avg_jct: None,
                    calibration: None,
                    depths: None,
                    iteration_ms: None,
                    startup_ms: None,
                    load_ms: None,
                    load_round_trip_ms: None,
                    after_load_ms: None,
                    load_measured_by: None,
                    simulated_as_run_without_loads: None,
                    live_over_sim_as_run_without_loads_avg_jct: None,
                    solo_iteration_ms: None,
                    warmup_ms: None,
                    as_run_iterations: None,
                    timelines: None,
                    lanes: args.lanes,
                    contention: args.contention.clone(),
                });
            }
        }
        "serve" => {
            for name in policy_names(args.policy.as_deref(), "srtf") {
                let choice: PolicyChoice = name.parse()?;
                // Metrics on a free port: the replay reads the service's
                // timing of each LoadGraph there.
                let metrics = Arc::new(server::metrics::Metrics::new());
                let http = server::metrics::serve_http("127.0.0.1:0", Arc::clone(&metrics))?;
                let service = server::start(ServerConfig {
                    endpoint: "tcp://127.0.0.1:*".into(),
                    workers: args.lanes,
                    max_lanes: args.lanes,
                    policy: choice,
                    metrics: Some(metrics),
                    ..ServerConfig::default()
                })?;
                let endpoint = service.endpoint().to_string();
                let addr = http.addr().to_string();
                out.push(against_service(
                    &args,
                    &trace,
                    &endpoint,
                    choice.name(),
                    memory,
                    contention,
                    Some(&addr),
                )?);
                service.shutdown()?;
                drop(http);
            }
        }
        endpoint => {
            lanes_adaptor::check_endpoint(endpoint)
                .context("--endpoint takes `embedded`, `serve`, or a running service's address")?;
            let wait = Duration::from_secs(10);
            let policy = service_policy(endpoint, wait).map_err(|e| match e {
                lanes::sim::RemoteError::Timeout { .. } => anyhow::anyhow!(
                    "no reply from {endpoint} within {wait:?}: is `lanes serve` running there? \
                     (start one with `lanes serve --endpoint {endpoint}`, or replay with \
                     `--endpoint serve` to start one in this process)"
                ),
                e => anyhow::Error::new(e).context(format!("asking {endpoint} for its policy")),
            })?;
            for w in mismatches(endpoint, memory, args.lanes) {
                eprintln!("warning: {w}");
            }
            if let Some(p) = &args.policy {
                anyhow::ensure!(
                    p == policy,
                    "the service at {endpoint} runs policy {policy}, not {p}; restart it with `lanes serve --policy {p}`"
                );
            }
            out.push(against_service(
                &args,
                &trace,
                endpoint,
                policy,
                memory,
                contention,
                args.metrics.as_deref(),
            )?);
        }
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    outln!(
        "{} jobs, time scale {} (times below in trace seconds), endpoint {}",
        trace.len(),
        args.time_scale,
        args.endpoint
    )?;
    for c in &out {
        let mut rows = Vec::new();
        let mut sim = c.simulated.clone();
        sim.policy = format!("{} sim", c.policy);
        rows.push(sim);
        if let Some(a) = &c.simulated_as_run {
            let mut a = a.clone();
            a.policy = format!("{} sim as-run", c.policy);
            rows.push(a);
        }
        let mut live = c.live.clone();
        live.policy = format!("{} live", c.policy);
        rows.push(live);
        out!("{}", table(&rows))?;
        out!(
            "live / simulated average JCT: {:.3}",
            c.live_over_sim_avg_jct
        )?;
        if let Some(r) = c.live_over_sim_as_run_avg_jct {
            out!(" (vs the as-run trace: {r:.3})")?;
        }
        outln!()?;
        if let Some(s) = &c.startup_ms {
            outln!(
                "start-up measured on the service (trace ms): training {:.1}, inference {:.1}",
                s.training,
                s.inference
            )?;
        }
        if let (Some(l), Some(by)) = (&c.load_ms, c.load_measured_by) {
            outln!(
                "of which the load held a worker (trace ms, {by}): training {:.1}, inference {:.1}",
                l.training,
                l.inference
            )?;
        }
        if let Some(r) = c.live_over_sim_as_run_without_loads_avg_jct {
            outln!("live / as-run simulated average JCT without loads on the lanes: {r:.3}")?;
        }
        if let (Some(cal), Some(d)) = (&c.calibration, &c.depths) {
            let ms = |c: &lanes::sim::CostCurve| {
                c.points
                    .iter()
                    .map(|(d, s)| format!("{d}:{:.2}", s * 1e3))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            outln!(
                "iteration ms by depth: training {}; inference {}\nhidden layers per job: {d:?}",
                ms(&cal.training),
                ms(&cal.inference),
            )?;
        }
        outln!()?;
    }
    Ok(())
}
