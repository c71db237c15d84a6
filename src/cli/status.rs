//! `lanes status`: a running service's sessions.

use std::time::Duration;

use std::io::IsTerminal;

use lanes::size::format_size;
use lanes_adaptor::placement::Directory;
use lanes_adaptor::{Client, ClientOptions};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The service's endpoint; several (`--endpoint A --endpoint B`) show
    /// each service in turn.
    #[arg(long, default_value = "tcp://127.0.0.1:5555")]
    pub endpoint: Vec<String>,
    /// Every service `lanes host --directory FILE` listed, each under a
    /// heading with its device (`--json`: an array of reports).
    #[arg(long, value_name = "FILE", conflicts_with = "endpoint")]
    pub directory: Option<std::path::PathBuf>,
    /// Seconds to wait for the service.
    #[arg(long, default_value_t = 5.0)]
    pub timeout: f64,
    /// Print the report as one JSON object (the protocol's `StatusReport`
    /// with the endpoint asked).
    #[arg(long)]
    pub json: bool,
    /// Ask again every SECS seconds until Ctrl-C (on a terminal the screen
    /// is redrawn; otherwise one report after another).
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    pub watch: Option<f64>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let timeout = Duration::try_from_secs_f64(args.timeout)
        .map_err(|_| anyhow::anyhow!("--timeout must be a non-negative number of seconds"))?;
    let options = ClientOptions {
        timeout,
        name: "lanes status".into(),
        ..ClientOptions::default()
    };
    let services: Vec<(String, Option<String>)> = match &args.directory {
        Some(path) => Directory::read(path)?
            .services
            .into_iter()
            .map(|s| {
                let heading = format!(
                    "== {} {}: {}{} ==",
                    if s.device == "cpu" { "cpu" } else { "gpu" },
                    s.index,
                    s.device,
                    if s.running { "" } else { " (exited)" }
                );
                (s.endpoint, Some(heading))
            })
            .collect(),
        None if args.endpoint.len() > 1 => args
            .endpoint
            .iter()
            .map(|e| (e.clone(), Some(format!("== {e} =="))))
            .collect(),
        None => args.endpoint.iter().map(|e| (e.clone(), None)).collect(),
    };
    if services.len() != 1 || args.directory.is_some() {
        return several(&services, &options, &args);
    }
    let endpoint = &services[0].0;
    let mut client = Client::connect_with(endpoint, options)?;
    let Some(every) = args.watch else {
        return report(&mut client, endpoint, &args);
    };
    let every = Duration::try_from_secs_f64(every)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("--watch takes a positive number of seconds"))?;
    let terminal = std::io::stdout().is_terminal();
    loop {
        if terminal {
            // Clear the screen and go home.
            out!("\x1b[2J\x1b[H")?;
        }
        report(&mut client, endpoint, &args)?;
        if !terminal && !args.json {
            outln!()?;
        }
        std::thread::sleep(every);
    }
}

/// Several services, one after another (`--watch` is for one): a service
/// that does not answer is shown as such and the others still are; the
/// command fails only when none answers. `--json`: one array, a service
/// that did not answer as `{"endpoint", "error"}`.
fn several(
    services: &[(String, Option<String>)],
    options: &ClientOptions,
    args: &Args,
) -> anyhow::Result<()> {
    if args.watch.is_some() {
        anyhow::bail!("--watch shows one service: give one --endpoint");
    }
    let mut answered = 0;
    let mut array = Vec::new();
    for (i, (endpoint, heading)) in services.iter().enumerate() {
        let reply = Client::connect_with(endpoint, options.clone()).and_then(|mut c| c.status());
        if args.json {
            array.push(match reply {
                Ok(s) => {
                    answered += 1;
                    json_of(&s, endpoint)?
                }
                Err(e) => serde_json::json!({ "endpoint": endpoint, "error": e.to_string() }),
            });
            continue;
        }
        if i > 0 {
            outln!()?;
        }
        if let Some(h) = heading {
            outln!("{h}")?;
        }
        match reply {
            Ok(s) => {
                answered += 1;
                print_report(&s, endpoint)?;
            }
            Err(e) => outln!("{endpoint}: no answer: {e}")?,
        }
    }
    if args.json {
        outln!("{}", serde_json::to_string(&array)?)?;
    }
    if answered == 0 {
        anyhow::bail!("no service answered");
    }
    Ok(())
}

/// A report as JSON: the protocol's `StatusReport` with the endpoint asked
/// and the lanes as one structured object.
fn json_of(
    s: &lanes_adaptor::wire::StatusReport,
    endpoint: &str,
) -> anyhow::Result<serde_json::Value> {
    let mut v = serde_json::to_value(s)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("endpoint".into(), endpoint.into());
        // The lanes as one structured object, not the rendered text.
        let lanes = o
            .remove("lanes_json")
            .and_then(|j| j.as_str().and_then(|t| serde_json::from_str(t).ok()))
            .unwrap_or(serde_json::Value::Null);
        o.insert("lanes".into(), lanes);
        // Each objective's attainment as a fraction, beside its counts.
        if let Some(sessions) = o.get_mut("sessions").and_then(|v| v.as_array_mut()) {
            for (x, v) in s.sessions.iter().zip(sessions) {
                if let (Some(a), Some(slo)) =
                    (&x.slo, v.get_mut("slo").and_then(|o| o.as_object_mut()))
                {
                    slo.insert("attainment".into(), a.attainment().into());
                }
            }
        }
    }
    Ok(v)
}

/// One report. `queue (ms)` and `run (ms)` are the session's mean Run
/// queueing delay (arrival to dispatch) and mean measured Run duration.
/// A session's objective and how its Runs kept it, e.g.
/// `5ms: 982/1000 98.2%, p99 4.10ms`.
fn slo_cell(a: &lanes_adaptor::wire::SloAttainment) -> String {
    let pct = a
        .attainment()
        .map_or_else(|| "-".to_string(), |f| format!("{:.1}%", f * 100.0));
    let p99 = a
        .recent_p99_ms
        .map_or_else(|| "-".to_string(), |p| format!("{p:.2}ms"));
    format!("{}ms: {}/{} {pct}, p99 {p99}", a.slo_ms, a.within, a.runs)
}

fn report(client: &mut Client, endpoint: &str, args: &Args) -> anyhow::Result<()> {
    let s = client.status()?;
    if args.json {
        outln!("{}", serde_json::to_string(&json_of(&s, endpoint)?)?)?;
        return Ok(());
    }
    print_report(&s, endpoint)
}

fn print_report(s: &lanes_adaptor::wire::StatusReport, endpoint: &str) -> anyhow::Result<()> {
    outln!(
        "{} on {} · device {} · policy {} · memory {} · {} workers · up {:.1}s · {} request(s) waiting for a worker",
        s.server,
        endpoint,
        s.device,
        s.policy,
        s.memory_bytes.map_or_else(|| "unset".to_string(), format_size),
        s.workers,
        s.uptime_ms as f64 / 1000.0,
        s.queued
    )?;
    outln!(
        "{:<8} {:<24} {:<10} {:>8} {:>12} {:<8} {:>9} {:<8} {:>9} {:>11} {:>11} {:>10}  {}",
        "session",
        "name",
        "kind",
        "priority",
        "iterations",
        "state",
        "idle (s)",
        "weights",
        "evictions",
        "queue (ms)",
        "run (ms)",
        "feeds",
        "slo: within/runs, recent p99"
    )?;
    for x in &s.sessions {
        let iters = match x.spec.expected_iterations {
            Some(n) => format!("{}/{}", x.iterations, n),
            None => x.iterations.to_string(),
        };
        outln!(
            "{:<8} {:<24} {:<10} {:>8} {:>12} {:<8} {:>9.1} {:<8} {:>9} {:>11.3} {:>11.3} {:>10}  {}",
            x.session.to_string(),
            x.spec.name,
            x.spec.kind.to_string(),
            x.spec.priority,
            iters,
            x.state.to_string(),
            x.idle_ms as f64 / 1000.0,
            if x.resident { "device" } else { "host" },
            x.evictions,
            x.queueing_mean_us as f64 / 1000.0,
            x.service_mean_us as f64 / 1000.0,
            // Where its large feeds travel: shared segments (their size) or
            // the socket.
            if x.shared_bytes > 0 {
                format!("shm {:.0}M", x.shared_bytes as f64 / (1u64 << 20) as f64)
            } else {
                "socket".to_string()
            },
            x.slo.as_ref().map_or_else(|| "-".to_string(), slo_cell)
        )?;
    }
    if s.sessions.is_empty() {
        outln!("(no sessions)")?;
    }
    if let Some(lanes) = &s.lanes {
        outln!()?;
        out!("{lanes}")?;
    }
    Ok(())
}
