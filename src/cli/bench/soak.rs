//! `lanes bench soak`: session churn against a real `lanes serve` (a child
//! process with `--metrics`), for minutes or hours.
//!
//! `--clients` threads each repeat, until `--duration` is over, one of:
//!
//! - **a full session**: connect, open a small training or inference session
//!   (the zoo MLP), load it, run a few iterations, close it, disconnect;
//! - **a dropped connection**: the same without the close (the connection
//!   goes away with the session open);
//! - **a killed client** (`--kill-share` of the rounds): this binary started
//!   in its hidden `bench soak-client` mode, which opens sessions and runs
//!   them until it is SIGKILLed after a random time; the sessions it
//!   printed are then watched in the service's status until they are gone.
//!
//! Meanwhile the service's resident memory (`/proc/PID/status`), open
//! sessions, reservation use, queued requests and error replies (its
//! metrics endpoint) are sampled every `--sample-every` seconds; resident
//! memory is split into the lanes' reservation (its pages, once touched,
//! stay resident: at most `--memory`) and the rest (the heap). Printed:
//! one JSON object with the counts, the samples and a verdict: every Run
//! answered, every killed client's sessions reclaimed within 5 s, and
//! memory flat: once every session is gone the heap is within 64 MiB of
//! where it started, and in runs of 300 s or more its slope after the
//! first fifth (fitted to the lowest sample of each tenth of that time, so
//! that it follows what stays, not how many sessions are open) is at most
//! `--max-slope`. The command fails when the verdict does.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes_adaptor::wire::{Reply, Request, SessionId};
use lanes_adaptor::{ClientError, Optimizer, SessionSpec, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::child::{connect, free_endpoint, open, ServeOpts, Service};
use super::paths::progress;
use super::workload::{self, Workload};

/// Runs shorter than this (seconds) are judged flat on the memory after
/// the end alone.
const SLOPE_FROM_S: f64 = 300.0;

/// How long after the last session went the memory is read as idle.
const SETTLE: Duration = Duration::from_secs(5);

/// Killed clients' sessions must be gone within this long.
const RECLAIM_WITHIN: Duration = Duration::from_secs(5);

#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// The service (`--device cpu` for a soak on the reference backend).
    #[command(flatten)]
    serve: ServeOpts,
    /// The service's `--memory`.
    #[arg(long, default_value = "1GiB")]
    memory: String,
    /// Seconds of churn (`3600` for an hour).
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Client threads churning sessions at once.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Share of the rounds run by a client process that is SIGKILLed.
    #[arg(long, default_value_t = 0.1)]
    kill_share: f64,
    /// Share of the rounds that drop their connection without closing.
    #[arg(long, default_value_t = 0.1)]
    drop_share: f64,
    /// Seconds between two samples of the service.
    #[arg(long, default_value_t = 1.0)]
    sample_every: f64,
    /// Largest growth of resident memory outside the reservation, in MiB
    /// per minute after the first fifth of the run, still flat.
    /// (The leak this watches for grew 30 MiB a minute; with sessions
    /// coming and going the fitted slope of a flat heap wanders by a
    /// few MiB a minute over minutes, less over an hour.)
    #[arg(long, default_value_t = 4.0)]
    max_slope: f64,
    /// Seed of the clients' choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// `bench soak-client`: opens sessions and runs them until killed.
#[derive(Debug, clap::Args)]
pub struct SoakClientArgs {
    #[arg(long)]
    endpoint: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// What the clients did, counted across threads.
#[derive(Debug, Default)]
struct Counts {
    rounds: AtomicU64,
    sessions: AtomicU64,
    closed: AtomicU64,
    dropped: AtomicU64,
    killed: AtomicU64,
    runs: AtomicU64,
    runs_ok: AtomicU64,
    /// Error replies to Runs (answered, but not as hoped).
    runs_refused: AtomicU64,
    /// Runs never answered (timeouts, transport errors).
    runs_unanswered: AtomicU64,
    /// Rounds that failed before their Runs (connect, open, load).
    setup_failures: AtomicU64,
}

fn add(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// The two graphs the clients load.
struct Graphs {
    infer: Workload,
    train: Workload,
}

fn graphs() -> anyhow::Result<Graphs> {
    Ok(Graphs {
        infer: workload::inference("mlp", 4, 8)?,
        train: workload::training("mlp", 4, 8, &Optimizer::sgd_momentum(0.01, 0.9, 0.0))?,
    })
}

fn feeds(w: &Workload, seed: u64) -> anyhow::Result<Vec<(String, Tensor)>> {
    Ok(w.random_feeds(seed)?.into_iter().collect())
}

/// One full or dropped session; Runs counted in `c`.
fn session_round(
    endpoint: &str,
    g: &Graphs,
    rng: &mut StdRng,
    c: &Counts,
    close: bool,
    errors: &Mutex<Vec<String>>,
) {
    let note = |e: String| {
        let mut v = errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if v.len() < 20 {
            v.push(e);
        }
    };
    let train = rng.gen_bool(0.5);
    let w = if train { &g.train } else { &g.infer };
    let name = if train { "soak-train" } else { "soak-infer" };
    let setup = || -> anyhow::Result<(lanes_adaptor::Client, SessionId)> {
        let mut client = connect(endpoint, name, Duration::from_secs(30))?;
        let spec = if train {
            SessionSpec::training(name)
        } else {
            SessionSpec::inference(name)
        };
        let id = open(&mut client, spec)?;
        client.load_in(id, &w.graph, w.vars.clone())?;
        Ok((client, id))
    };
    let (mut client, id) = match setup() {
        Ok(x) => x,
        Err(e) => {
            add(&c.setup_failures);
            note(format!("setup: {e:#}"));
            return;
        }
    };
    add(&c.sessions);
    let fetch = [w.fetch.as_str()];
    for i in 0..rng.gen_range(1..=8u64) {
        let f = match feeds(w, i) {
            Ok(f) => f,
            Err(e) => {
                note(format!("feeds: {e:#}"));
                break;
            }
        };
        add(&c.runs);
        match client.run_in(id, f, &fetch) {
            Ok(_) => add(&c.runs_ok),
            Err(ClientError::Service { code, message }) => {
                add(&c.runs_refused);
                note(format!("run refused: {code}: {message}"));
            }
            Err(e) => {
                add(&c.runs_unanswered);
                note(format!("run unanswered: {e}"));
            }
        }
    }
    if close {
        match client.close_in(id) {
            Ok(()) => add(&c.closed),
            Err(e) => note(format!("close: {e}")),
        }
    } else {
        add(&c.dropped);
    }
}

/// The session ids a killed client printed.
fn printed_sessions(child: &mut Child) -> Vec<SessionId> {
    let mut text = String::new();
    if let Some(out) = child.stdout.as_mut() {
        let _ = out.read_to_string(&mut text);
    }
    text.lines()
        .filter_map(|l| l.strip_prefix("session "))
        .filter_map(|n| n.trim().parse().ok())
        .map(SessionId)
        .collect()
}

/// Which of `ids` the service still has open (`None`: no status).
fn still_open(client: &mut lanes_adaptor::Client, ids: &[SessionId]) -> Option<usize> {
    match client.request(&Request::Status) {
        Ok(Reply::Status(r)) => Some(
            r.sessions
                .iter()
                .filter(|s| ids.contains(&s.session))
                .count(),
        ),
        _ => None,
    }
}

/// A client process killed after a random time; returns how long its
/// sessions took to go (`None` when it opened none).
fn killed_round(
    endpoint: &str,
    rng: &mut StdRng,
    c: &Counts,
    watcher: &mut lanes_adaptor::Client,
) -> anyhow::Result<Option<Duration>> {
    let exe = std::env::current_exe().context("locating the lanes binary")?;
    let mut child = Command::new(exe)
        .args(["bench", "soak-client", "--endpoint", endpoint, "--seed"])
        .arg(rng.gen::<u32>().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting a soak client")?;
    std::thread::sleep(Duration::from_millis(rng.gen_range(300..1500)));
    child.kill().context("killing a soak client")?; // SIGKILL
    let killed = Instant::now();
    let _ = child.wait();
    add(&c.killed);
    let ids = printed_sessions(&mut child);
    if ids.is_empty() {
        return Ok(None);
    }
    // Watched a while past the bound, so a slow reclaim is measured.
    let give_up = killed + RECLAIM_WITHIN * 3;
    loop {
        if still_open(watcher, &ids) == Some(0) {
            return Ok(Some(killed.elapsed()));
        }
        if Instant::now() > give_up {
            return Ok(Some(killed.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The hidden client mode: sessions opened (each printed as `session N`)
/// and run one after another, never closed, until the process is killed.
pub fn soak_client(a: SoakClientArgs) -> anyhow::Result<()> {
    let g = graphs()?;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut client = connect(&a.endpoint, "soak-killed", Duration::from_secs(30))?;
    loop {
        let train = rng.gen_bool(0.5);
        let (w, spec) = if train {
            (&g.train, SessionSpec::training("soak-killed"))
        } else {
            (&g.infer, SessionSpec::inference("soak-killed"))
        };
        let id = open(&mut client, spec)?;
        outln!("session {}", id.0)?;
        client.load_in(id, &w.graph, w.vars.clone())?;
        for i in 0..rng.gen_range(1..=20u64) {
            client.run_in(id, feeds(w, i)?, &[w.fetch.as_str()])?;
        }
    }
}

/// One sample of the service.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Sample {
    t_s: f64,
    rss_kib: Option<u64>,
    /// Of which in the lanes' reservation (its pages once touched).
    reservation_rss_kib: Option<u64>,
    /// The rest: the heap, stacks, code.
    heap_rss_kib: Option<u64>,
    sessions_open: Option<f64>,
    reservation_used_bytes: Option<f64>,
    requests_queued: Option<f64>,
    errors_total: Option<f64>,
}

/// `VmRSS` of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Error replies by code in a scrape.
fn errors_by_code(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("lanes_errors_total{code=\""))
        .filter_map(|rest| {
            let (code, value) = rest.split_once("\"} ")?;
            Some((code.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// Resident KiB of the anonymous mapping of exactly `bytes` in process
/// `pid` (the lanes' reservation on the CPU).
pub fn mapping_rss_kib(pid: u32, bytes: u64) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut in_it = false;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) {
                in_it = hi - lo == bytes;
                continue;
            }
        }
        if in_it {
            if let Some(v) = line.strip_prefix("Rss:") {
                return v.split_whitespace().next()?.parse().ok();
            }
        }
    }
    None
}

/// The sum of the samples of `series` (every label set) in a scrape.
fn metric_sum(text: &str, series: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(series) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            found = Some(found.unwrap_or(0.0) + v);
        }
    }
    found
}

fn sample(pid: u32, url: &str, t0: Instant, reservation: Option<u64>) -> Sample {
    let text = minreq::get(url)
        .with_timeout(5)
        .send()
        .ok()
        .filter(|r| r.status_code == 200)
        .and_then(|r| r.as_str().ok().map(str::to_string))
        .unwrap_or_default();
    let rss = rss_kib(pid);
    let in_reservation = reservation.and_then(|b| mapping_rss_kib(pid, b));
    Sample {
        t_s: t0.elapsed().as_secs_f64(),
        rss_kib: rss,
        reservation_rss_kib: in_reservation,
        heap_rss_kib: rss.map(|r| r.saturating_sub(in_reservation.unwrap_or(0))),
        sessions_open: metric_sum(&text, "lanes_sessions_open"),
        reservation_used_bytes: metric_sum(&text, "lanes_reservation_used_bytes"),
        requests_queued: metric_sum(&text, "lanes_requests_queued"),
        errors_total: metric_sum(&text, "lanes_errors_total"),
    }
}

/// Windows whose lowest heap sample the slope is fitted to.
const SLOPE_WINDOWS: usize = 10;

/// The lowest point of each of `n` equal runs of `points`: the memory with
/// the fewest sessions open in each stretch of time, so the slope follows
/// what stays rather than how many sessions happen to be open.
fn window_minima(points: &[(f64, f64)], n: usize) -> Vec<(f64, f64)> {
    let per = points.len().div_ceil(n.max(1)).max(1);
    points
        .chunks(per)
        .filter_map(|c| c.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1)))
        .collect()
}

/// Least-squares slope of `(t, y)`, per unit of `t`.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 3 {
        return None;
    }
    let n = points.len() as f64;
    let mt = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let num: f64 = points.iter().map(|p| (p.0 - mt) * (p.1 - my)).sum();
    let den: f64 = points.iter().map(|p| (p.0 - mt).powi(2)).sum();
    (den > 0.0).then(|| num / den)
}

pub fn soak(a: SoakArgs) -> anyhow::Result<()> {
    if !(a.duration.is_finite() && a.duration > 0.0) {
        bail!("--duration must be a positive number of seconds");
    }
    if a.clients == 0 {
        bail!("--clients must be at least 1");
    }
    if !(0.0..=1.0).contains(&a.kill_share)
        || !(0.0..=1.0).contains(&a.drop_share)
        || a.kill_share + a.drop_share > 1.0
    {
        bail!("--kill-share and --drop-share are shares from 0 to 1, together at most 1");
    }
    if !(a.sample_every.is_finite() && a.sample_every >= 0.05) {
        bail!("--sample-every must be at least 0.05 s");
    }
    let since = Instant::now();
    let g = graphs()?;
    let metrics_addr = free_endpoint()?
        .strip_prefix("tcp://")
        .map(str::to_string)
        .context("a loopback address")?;
    let mut serve = a.serve.clone();
    serve.args.extend([
        "--memory".to_string(),
        a.memory.clone(),
        "--metrics".to_string(),
        metrics_addr.clone(),
    ]);
    let reservation = lanes::size::parse_size(&a.memory).ok();
    let (service, endpoint) = Service::start(&serve, since)?;
    let pid = service.pid();
    let url = format!("http://{metrics_addr}/metrics");
    let t0 = Instant::now();
    let mut samples = vec![sample(pid, &url, t0, reservation)];
    progress(
        &format!(
            "{} clients churning sessions for {} s (service pid {pid})",
            a.clients, a.duration
        ),
        since,
    );
    let counts = Counts::default();
    let errors = Mutex::new(Vec::new());
    let reclaims = Mutex::new(Vec::<f64>::new());
    let stop = AtomicBool::new(false);
    let deadline = t0 + Duration::from_secs_f64(a.duration);
    let every = Duration::from_secs_f64(a.sample_every);
    std::thread::scope(|s| {
        for i in 0..a.clients {
            let (endpoint, g, counts, errors, reclaims, stop) =
                (endpoint.as_str(), &g, &counts, &errors, &reclaims, &stop);
            let (kill_share, drop_share, seed) = (a.kill_share, a.drop_share, a.seed);
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1000).wrapping_add(i as u64));
                let mut watcher = connect(endpoint, "soak-watcher", Duration::from_secs(30)).ok();
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    add(&counts.rounds);
                    let r: f64 = rng.gen();
                    if r < kill_share {
                        let Some(w) = watcher.as_mut() else {
                            continue;
                        };
                        match killed_round(endpoint, &mut rng, counts, w) {
                            Ok(Some(took)) => {
                                if let Ok(mut v) = reclaims.lock() {
                                    v.push(took.as_secs_f64());
                                }
                            }
                            Ok(None) => {}
                            Err(e) => {
                                if let Ok(mut v) = errors.lock() {
                                    v.push(format!("killed client: {e:#}"));
                                }
                                stop.store(true, Ordering::Relaxed);
                            }
                        }
                    } else {
                        let close = r >= kill_share + drop_share;
                        session_round(endpoint, g, &mut rng, counts, close, errors);
                    }
                }
            });
        }
        while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(every.min(deadline.saturating_duration_since(Instant::now())));
            samples.push(sample(pid, &url, t0, reservation));
        }
    });
    // Every client gone: the sessions (dropped and killed ones too) must go,
    // and their memory with them.
    let ended = Instant::now();
    let mut drained = None;
    while ended.elapsed() < RECLAIM_WITHIN * 4 {
        let s = sample(pid, &url, t0, reservation);
        samples.push(s);
        if s.sessions_open == Some(0.0) && s.reservation_used_bytes.unwrap_or(0.0) == 0.0 {
            drained = Some(ended.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // The service gives freed memory back a few seconds after sessions go.
    let settle = Instant::now();
    while settle.elapsed() < SETTLE {
        std::thread::sleep(Duration::from_millis(500));
        samples.push(sample(pid, &url, t0, reservation));
    }
    let idle = sample(pid, &url, t0, reservation);
    samples.push(idle);
    let error_codes = minreq::get(url.as_str())
        .with_timeout(5)
        .send()
        .ok()
        .and_then(|r| r.as_str().ok().map(errors_by_code))
        .unwrap_or_default();
    drop(service);

    // Memory: the slope after the first fifth (allocator and pools warm),
    // of what is not the reservation: its pages, once touched, stay
    // resident (at most --memory, reported apart).
    let warm_from = a.duration / 5.0;
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.t_s >= warm_from && s.t_s <= a.duration)
        .filter_map(|s| s.heap_rss_kib.map(|k| (s.t_s / 60.0, k as f64 / 1024.0)))
        .collect();
    let slope_mib_min = slope(&window_minima(&points, SLOPE_WINDOWS));
    let warm = samples.iter().find(|s| s.t_s >= warm_from).copied();
    let reclaims = reclaims.into_inner().unwrap_or_default();
    let worst_reclaim = reclaims.iter().copied().fold(0.0, f64::max);
    let unanswered = get(&counts.runs_unanswered);
    let runs_answered = unanswered == 0 && get(&counts.runs) > 0;
    let reclaimed =
        worst_reclaim <= RECLAIM_WITHIN.as_secs_f64() && drained.is_some_and(|d| d <= 10.0);
    // Once every session is gone the heap is back near where it started
    // (what the sessions held while open is theirs); over a long run the
    // heap's slope is flat too (shorter runs' slopes are noise from the
    // number of sessions open).
    let start_heap = samples.first().and_then(|s| s.heap_rss_kib);
    let idle_ok = match (start_heap, idle.heap_rss_kib) {
        (Some(w), Some(i)) => i <= w + (64 << 10),
        _ => false,
    };
    let slope_ok = a.duration < SLOPE_FROM_S || slope_mib_min.is_some_and(|s| s <= a.max_slope);
    let flat = idle_ok && slope_ok;
    let ok = runs_answered && reclaimed && flat;
    let out = json!({
        "bench": "soak",
        "duration_s": a.duration,
        "clients": a.clients,
        "memory": a.memory,
        "counts": {
            "rounds": get(&counts.rounds),
            "sessions": get(&counts.sessions),
            "closed": get(&counts.closed),
            "dropped": get(&counts.dropped),
            "killed_clients": get(&counts.killed),
            "runs": get(&counts.runs),
            "runs_ok": get(&counts.runs_ok),
            "runs_refused": get(&counts.runs_refused),
            "runs_unanswered": unanswered,
            "setup_failures": get(&counts.setup_failures),
        },
        "reclaim_s": {
            "killed_clients_watched": reclaims.len(),
            "max": worst_reclaim,
            "mean": reclaims.iter().sum::<f64>() / reclaims.len().max(1) as f64,
            "all_sessions_gone_after_end": drained,
        },
        "rss_kib": {
            "start": samples.first().and_then(|s| s.rss_kib),
            "warm": warm.and_then(|s| s.rss_kib),
            "peak": samples.iter().filter_map(|s| s.rss_kib).max(),
            "idle_after_end": idle.rss_kib,
            "reservation_idle_after_end": idle.reservation_rss_kib,
            "heap_start": samples.first().and_then(|s| s.heap_rss_kib),
            "heap_warm": warm.and_then(|s| s.heap_rss_kib),
            "heap_peak": samples.iter().filter_map(|s| s.heap_rss_kib).max(),
            "heap_idle_after_end": idle.heap_rss_kib,
            "heap_slope_mib_per_min": slope_mib_min,
        },
        "service_errors_by_code": error_codes,
        "errors": errors.into_inner().unwrap_or_default(),
        "verdict": {
            "every_run_answered": runs_answered,
            "killed_clients_reclaimed_within_5s": reclaimed,
            "memory_flat": flat,
            "ok": ok,
        },
        "samples": samples,
    });
    outln!("{}", serde_json::to_string_pretty(&out)?)?;
    if !ok {
        bail!("soak verdict: not ok (see \"verdict\" above)");
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn slopes_and_sums() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 + 2.0 * i as f64)).collect();
        assert!((slope(&pts).unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(slope(&pts[..2]), None);
        let text = "# HELP x\nlanes_errors_total{code=\"A\"} 2\nlanes_errors_total{code=\"B\"} 3\nlanes_errors_totalx 9\n";
        assert_eq!(metric_sum(text, "lanes_errors_total"), Some(5.0));
        assert_eq!(metric_sum(text, "lanes_sessions_open"), None);
        let codes = errors_by_code(text);
        assert_eq!(codes.get("A"), Some(&2.0));
        assert_eq!(codes.len(), 2);
        let pts = [(0.0, 5.0), (1.0, 1.0), (2.0, 6.0), (3.0, 2.0)];
        assert_eq!(window_minima(&pts, 2), vec![(1.0, 1.0), (3.0, 2.0)]);
    }

    #[test]
    fn own_rss_is_read() {
        assert!(rss_kib(std::process::id()).is_some_and(|k| k > 0));
    }
}
