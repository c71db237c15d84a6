//! `lanes host`: every GPU of a host, one `lanes serve` child process per
//! GPU (`--device cuda:N`), each on its own endpoint and metrics port
//! derived from the ones given. One process per GPU, so that one GPU's
//! failure (a CUDA context error, a driver hang) or fullness touches no
//! other: each service's lanes, reservation, workers and streams are its
//! own (docs/multi-gpu.md). The launcher prints one line per service,
//! writes a directory file when asked (`lanes_adaptor::placement`
//! reads it), forwards SIGINT/SIGTERM to the services and exits once they
//! have; a service that dies is reported and the others keep serving.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lanes::server::DeviceChoice;
use lanes_adaptor::placement::{Directory, ServiceEntry};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The GPUs to serve: `all`, or ordinals (`0,1`). With `--device cpu`
    /// the list names CPU services instead (`0,1`: two), a test and demo
    /// aid: several services on one host without a GPU.
    #[arg(long, default_value = "all")]
    pub gpus: String,
    /// `cuda` (one service per GPU) or `cpu` (services on the CPU backend,
    /// for tests and demos).
    #[arg(long, value_enum, default_value_t = DeviceChoice::Cuda)]
    pub device: DeviceChoice,
    /// The first service's endpoint; GPU N's is derived from it: a TCP
    /// port plus N (`tcp://127.0.0.1:5555` → 5556 for GPU 1; port `*`
    /// stays a free port each), an `ipc://PATH` with `-gpuN` appended.
    #[arg(long, default_value = "tcp://127.0.0.1:5555")]
    pub endpoint: String,
    /// Serve each service's Prometheus metrics: GPU N's at this address's
    /// port plus N (port 0: a free port each).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Write the services (index, device, endpoint, metrics address, pid,
    /// running) to this JSON file, for `lanes status --directory` and the
    /// clients' placement (`placement::connect_best`, `lanes.connect_best`).
    #[arg(long, value_name = "FILE")]
    pub directory: Option<PathBuf>,
    /// Flags every `lanes serve` gets (after `--`), e.g. `-- --memory 8GiB
    /// --policy priority`; not `--endpoint`, `--device` or `--metrics`.
    #[arg(last = true, value_name = "SERVE_FLAGS")]
    pub serve: Vec<String>,
}

/// The services asked for: ordinals from `all` or a list.
pub fn service_list(
    gpus: &str,
    count: impl FnOnce() -> anyhow::Result<usize>,
) -> anyhow::Result<Vec<usize>> {
    let list: Vec<usize> = if gpus == "all" {
        (0..count()?).collect()
    } else {
        let mut v = Vec::new();
        for part in gpus.split(',') {
            let n = part.trim().parse::<usize>().map_err(|_| {
                anyhow::anyhow!("--gpus takes `all` or ordinals such as 0,1, not {gpus:?}")
            })?;
            if v.contains(&n) {
                anyhow::bail!("--gpus names {n} twice");
            }
            v.push(n);
        }
        v
    };
    if list.is_empty() {
        anyhow::bail!("no GPUs to serve on this host");
    }
    Ok(list)
}

/// Service N's endpoint: a TCP port plus N, or an ipc path with `-gpuN`.
pub fn endpoint_for(base: &str, n: usize) -> anyhow::Result<String> {
    if let Some(path) = base.strip_prefix("ipc://") {
        return Ok(format!("ipc://{path}-gpu{n}"));
    }
    let Some(rest) = base.strip_prefix("tcp://") else {
        anyhow::bail!("--endpoint must be tcp://HOST:PORT or ipc://PATH, not {base}");
    };
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| anyhow::anyhow!("--endpoint {base} has no port"))?;
    if port == "*" {
        return Ok(base.to_string());
    }
    Ok(format!(
        "tcp://{host}:{}",
        offset_port(port, n, "--endpoint")?
    ))
}

/// Service N's metrics address: the port plus N (0 stays 0).
pub fn metrics_for(base: &str, n: usize) -> anyhow::Result<String> {
    let (host, port) = base
        .rsplit_once(':')
        .ok_or_else(|| anyhow::anyhow!("--metrics {base} has no port (e.g. 127.0.0.1:9100)"))?;
    if port == "0" {
        return Ok(base.to_string());
    }
    Ok(format!("{host}:{}", offset_port(port, n, "--metrics")?))
}

fn offset_port(port: &str, n: usize, flag: &str) -> anyhow::Result<u16> {
    port.parse::<u16>()
        .ok()
        .and_then(|p| u16::try_from(usize::from(p) + n).ok())
        .ok_or_else(|| anyhow::anyhow!("{flag}: port {port} plus {n} is not a port"))
}

/// What a service's ready line (`lanes serving on EP (device D, policy P)[,
/// metrics at http://ADDR/metrics]…`) says: endpoint, device, metrics.
pub fn parse_ready(line: &str) -> Option<(String, String, Option<String>)> {
    let rest = line.trim_end().strip_prefix("lanes serving on ")?;
    let endpoint = rest.split_whitespace().next()?.to_string();
    let device = rest
        .split_once("(device ")
        .and_then(|(_, d)| d.split_once(", policy "))
        .map(|(d, _)| d.to_string())?;
    let metrics = rest
        .split_once("metrics at http://")
        .and_then(|(_, m)| m.split_once("/metrics"))
        .map(|(m, _)| m.to_string());
    Some((endpoint, device, metrics))
}

/// One service: its child process and its directory entry.
struct Service {
    child: Child,
    entry: ServiceEntry,
    exited: Option<ExitStatus>,
    /// It exited before any signal (already reported).
    died: bool,
}

fn label(device: DeviceChoice) -> &'static str {
    if device == DeviceChoice::Cpu {
        "cpu"
    } else {
        "gpu"
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let device = match args.device {
        DeviceChoice::Auto => anyhow::bail!("lanes host takes --device cuda or cpu"),
        d => d,
    };
    for flag in ["--endpoint", "--device", "--metrics"] {
        if args
            .serve
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
        {
            anyhow::bail!("{flag} is lanes host's own flag (each service's is derived from it): give it before `--`");
        }
    }
    let list = service_list(&args.gpus, || {
        if device == DeviceChoice::Cpu {
            anyhow::bail!(
                "--gpus all needs GPUs: with --device cpu give a list (0,1: two CPU services)"
            );
        }
        Ok(lanes::exec::cuda::device_count()?)
    })?;
    let exe = std::env::current_exe().context("finding the lanes binary")?;
    let mut services: Vec<Service> = Vec::new();
    // Ctrl-C and SIGTERM: counted; the loop below forwards them.
    let signals = Arc::new(AtomicUsize::new(0));
    let s = Arc::clone(&signals);
    ctrlc::set_handler(move || {
        s.fetch_add(1, Ordering::SeqCst);
    })
    .context("installing the SIGINT and SIGTERM handler")?;
    for &n in &list {
        let endpoint = endpoint_for(&args.endpoint, n)?;
        let mut cmd = Command::new(&exe);
        cmd.arg("serve").args(["--endpoint", &endpoint]);
        match device {
            DeviceChoice::Cpu => cmd.args(["--device", "cpu"]),
            _ => cmd.args(["--device", &format!("cuda:{n}")]),
        };
        if let Some(m) = &args.metrics {
            cmd.args(["--metrics", &metrics_for(m, n)?]);
        }
        cmd.args(&args.serve)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // Its own process group: a terminal's Ctrl-C reaches the
            // launcher only, which forwards one signal to each service.
            .process_group(0);
        let started = cmd
            .spawn()
            .with_context(|| format!("starting the service of {} {n}", label(device)));
        let mut child = match started {
            Ok(c) => c,
            Err(e) => {
                stop_and_wait(&mut services);
                return Err(e);
            }
        };
        let ready = child.stdout.take().map(BufReader::new).and_then(|mut out| {
            let mut line = String::new();
            out.read_line(&mut line).ok()?;
            // Drain the rest so the service never blocks on a full pipe.
            std::thread::spawn(move || {
                let mut sink = String::new();
                while matches!(out.read_line(&mut sink), Ok(n) if n > 0) {
                    sink.clear();
                }
            });
            parse_ready(&line)
        });
        let Some((endpoint, dev, metrics)) = ready else {
            let status = child.wait().ok();
            stop_and_wait(&mut services);
            anyhow::bail!(
                "the service of {} {n} did not start ({}; its error is above)",
                label(device),
                status.map_or_else(|| "exit status unknown".into(), |s| s.to_string())
            );
        };
        let mut line = format!("{} {n}: {endpoint} (device {dev}", label(device));
        if let Some(m) = &metrics {
            line.push_str(&format!(", metrics at http://{m}/metrics"));
        }
        line.push(')');
        outln!("{line}")?;
        services.push(Service {
            entry: ServiceEntry {
                index: n,
                device: dev,
                endpoint,
                metrics,
                pid: Some(child.id()),
                running: true,
            },
            child,
            exited: None,
            died: false,
        });
    }
    write_directory(args.directory.as_deref(), &services)?;
    outln!("lanes host: {} service(s) ready", services.len())?;
    supervise(&mut services, &signals, args.directory.as_deref())
}

/// Waits for the services: reports one that exits, forwards signals,
/// returns once every service has exited.
fn supervise(
    services: &mut [Service],
    signals: &AtomicUsize,
    directory: Option<&Path>,
) -> anyhow::Result<()> {
    let mut forwarded = 0;
    loop {
        let asked = signals.load(Ordering::SeqCst);
        if asked > forwarded {
            // The first signal stops the services gracefully, a second at once.
            let sig = if asked == 1 {
                signal::SIGTERM
            } else {
                signal::SIGKILL
            };
            stop_all(services, sig);
            forwarded = asked;
        }
        let mut changed = false;
        for s in services.iter_mut().filter(|s| s.exited.is_none()) {
            if let Ok(Some(status)) = s.child.try_wait() {
                s.exited = Some(status);
                s.entry.running = false;
                changed = true;
                if forwarded == 0 {
                    s.died = true;
                    eprintln!(
                        "lanes host: the service of {} {} ({}) exited: {status}; the others keep serving",
                        if s.entry.device == "cpu" { "cpu" } else { "gpu" },
                        s.entry.index,
                        s.entry.endpoint
                    );
                }
            }
        }
        if changed {
            write_directory(directory, services)?;
        }
        if services.iter().all(|s| s.exited.is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let failed: Vec<String> = services
        .iter()
        .filter(|s| !s.died)
        .filter_map(|s| {
            let status = s.exited?;
            (!status.success()).then(|| format!("{} ({status})", s.entry.index))
        })
        .collect();
    if forwarded == 0 {
        anyhow::bail!("every service has exited");
    }
    if !failed.is_empty() {
        anyhow::bail!("services that did not stop cleanly: {}", failed.join(", "));
    }
    Ok(())
}

mod signal {
    pub use nix::sys::signal::Signal;
    pub const SIGTERM: Signal = Signal::SIGTERM;
    pub const SIGKILL: Signal = Signal::SIGKILL;
}

fn stop_all(services: &mut [Service], sig: signal::Signal) {
    for s in services.iter_mut().filter(|s| s.exited.is_none()) {
        let Ok(pid) = i32::try_from(s.child.id()) else {
            continue;
        };
        if let Err(e) = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig) {
            eprintln!("lanes host: signalling service {}: {e}", s.entry.index);
        }
    }
}

/// On start-up's error paths: stops the services started so far and
/// waits for them.
fn stop_and_wait(services: &mut [Service]) {
    stop_all(services, signal::SIGTERM);
    for s in services.iter_mut() {
        s.exited = s.child.wait().ok();
    }
}

/// Writes the directory file (a temporary file renamed over it, so a
/// reader never sees half of one).
fn write_directory(path: Option<&Path>, services: &[Service]) -> anyhow::Result<()> {
    let Some(path) = path else { return Ok(()) };
    let dir = Directory {
        services: services.iter().map(|s| s.entry.clone()).collect(),
    };
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&dir)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_metrics_are_derived_per_service() {
        assert_eq!(
            endpoint_for("tcp://127.0.0.1:5555", 1).unwrap(),
            "tcp://127.0.0.1:5556"
        );
        assert_eq!(
            endpoint_for("tcp://127.0.0.1:*", 3).unwrap(),
            "tcp://127.0.0.1:*"
        );
        assert_eq!(
            endpoint_for("ipc:///tmp/lanes", 2).unwrap(),
            "ipc:///tmp/lanes-gpu2"
        );
        assert!(endpoint_for("tcp://127.0.0.1:65535", 1).is_err());
        assert!(endpoint_for("udp://x:1", 0).is_err());
        assert_eq!(metrics_for("127.0.0.1:9100", 2).unwrap(), "127.0.0.1:9102");
        assert_eq!(metrics_for("127.0.0.1:0", 2).unwrap(), "127.0.0.1:0");
        assert!(metrics_for("nowhere", 0).is_err());
    }

    #[test]
    fn the_gpu_list_is_all_or_distinct_ordinals() {
        assert_eq!(service_list("all", || Ok(2)).unwrap(), vec![0, 1]);
        assert_eq!(service_list("1,3", || Ok(0)).unwrap(), vec![1, 3]);
        assert!(service_list("0,0", || Ok(2)).is_err());
        assert!(service_list("zero", || Ok(2)).is_err());
        assert!(service_list("all", || Ok(0)).is_err());
    }

    #[test]
    fn a_ready_line_gives_endpoint_device_and_metrics() {
        let line = "lanes serving on tcp://127.0.0.1:5556 (device cuda:1 (NVIDIA H100 80GB HBM3), policy fifo), metrics at http://127.0.0.1:9101/metrics\n";
        let (e, d, m) = parse_ready(line).unwrap();
        assert_eq!(e, "tcp://127.0.0.1:5556");
        assert_eq!(d, "cuda:1 (NVIDIA H100 80GB HBM3)");
        assert_eq!(m.as_deref(), Some("127.0.0.1:9101"));
        let (_, d, m) = parse_ready("lanes serving on ipc:///x (device cpu, policy fifo)").unwrap();
        assert_eq!(d, "cpu");
        assert_eq!(m, None);
        assert!(parse_ready("Error: no usable GPU").is_none());
    }
}
