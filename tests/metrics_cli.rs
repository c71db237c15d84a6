//! `lanes serve --metrics` and `lanes status --json`, as a user runs them:
//! a real `lanes serve` child process, a job through the adaptor, the
//! metrics scraped twice with an HTTP client, the status parsed as JSON.
//! Whole file: a few seconds on the 2-core development VM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lanes_adaptor::zoo::seeded_feeds;
use lanes_adaptor::{Arch, Client, SessionSpec};

/// `lanes serve` with metrics on free ports; killed when dropped.
struct Serve {
    child: Child,
    endpoint: String,
    metrics: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Serve {
    let mut child = Command::new(util::lanes_bin())
        .args([
            "serve",
            "--device",
            "cpu",
            "--workers",
            "1",
            "--memory",
            "1GiB",
        ])
        .args([
            "--endpoint",
            "tcp://127.0.0.1:*",
            "--metrics",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("lanes runs");
    let line = util::serve::serving_line(&mut child);
    let endpoint =
        util::serve::endpoint_of(&line).unwrap_or_else(|| panic!("a serving line: {line:?}"));
    let metrics =
        util::serve::metrics_of(&line).unwrap_or_else(|| panic!("a metrics address: {line:?}"));
    Serve {
        child,
        endpoint,
        metrics,
    }
}

/// One scrape: the body of `GET /metrics`.
fn scrape(url: &str) -> String {
    let r = minreq::get(url).with_timeout(5).send().expect("scrape");
    assert_eq!(r.status_code, 200);
    r.as_str().unwrap().to_string()
}

/// The value of the first sample whose line starts with `series`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Scrapes until `ok` holds (the socket thread publishes twice a second).
fn scrape_until(url: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = scrape(url);
        if ok(&text) || Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn metrics_move_as_a_job_runs_and_status_reads_as_json() {
    let s = serve();
    let url = s.metrics.clone();
    // The first publication (twice a second) sets the reservation.
    let before = scrape_until(&url, |t| {
        value(t, "lanes_reservation_bytes").is_some_and(|b| b > 0.0)
    });
    assert!(
        before.contains("# TYPE lanes_request_duration_seconds histogram"),
        "{before}"
    );
    assert_eq!(value(&before, "lanes_sessions_open"), Some(0.0), "{before}");
    assert_eq!(
        value(&before, "lanes_reservation_bytes"),
        Some(1073741824.0),
        "{before}"
    );

    let mut client = Client::connect(&s.endpoint).unwrap();
    let m = Arch::Mlp {
        inputs: 16,
        hidden: vec![32],
        classes: 4,
    }
    .inference(2, 1)
    .unwrap();
    let feeds = seeded_feeds(&m.inputs, 3, 4).unwrap();
    let mut session = client
        .open_session(SessionSpec::inference("scraped"))
        .unwrap();
    session.load(&m.graph, m.vars.clone()).unwrap();
    for _ in 0..3 {
        let f: Vec<(String, _)> = feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
        session.run(f, &[m.output.as_str()]).unwrap();
    }
    // A bad fetch: an error reply, counted by code.
    let f: Vec<(String, _)> = feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    assert!(session.run(f, &["no_such_node"]).is_err());
    // A feed of the wrong shape: refused as BadFeed when the Run is
    // decoded, on the socket thread, and counted too.
    let bad: Vec<(String, _)> = feeds
        .keys()
        .map(|n| {
            (
                n.clone(),
                lanes_adaptor::Tensor::from_f32(vec![1, 1], vec![0.0]).unwrap(),
            )
        })
        .collect();
    match session.run(bad, &[m.output.as_str()]) {
        Err(lanes_adaptor::ClientError::Service { code, .. }) => {
            assert_eq!(code, lanes_adaptor::wire::ErrorCode::BadFeed)
        }
        other => panic!("a BadFeed reply: {other:?}"),
    }
    let sid = session.id().0;

    let after = scrape_until(&url, |t| t.contains("lanes_sessions_open 1"));
    let iters = format!("lanes_iterations_total{{session=\"{sid}\"}}");
    assert_eq!(value(&after, &iters), Some(3.0), "{after}");
    assert_eq!(value(&after, "lanes_sessions_open"), Some(1.0), "{after}");
    let runs = format!("lanes_request_duration_seconds_count{{session=\"{sid}\",request=\"run\"}}");
    assert_eq!(value(&after, &runs), Some(4.0), "{after}");
    let queued = format!("lanes_request_queue_seconds_count{{session=\"{sid}\"}}");
    assert_eq!(
        value(&after, &queued),
        Some(5.0),
        "load and four runs: {after}"
    );
    assert!(
        after
            .lines()
            .any(|l| l.starts_with("lanes_errors_total{code=") && l.ends_with(" 1")),
        "{after}"
    );
    assert_eq!(
        value(&after, "lanes_errors_total{code=\"BadFeed\"}"),
        Some(1.0),
        "{after}"
    );
    assert!(after.contains("name=\"scraped\""), "{after}");
    let used = value(&after, "lanes_lane_used_bytes{lane=\"0\"}").unwrap_or(0.0);
    assert!(used > 0.0, "the job's lane holds its memory: {after}");
    assert!(value(&after, "lanes_reservation_used_bytes").unwrap_or(0.0) >= used);
    // Not found elsewhere.
    let other = url.replace("/metrics", "/other");
    assert_eq!(minreq::get(other).send().unwrap().status_code, 404);

    // `lanes status --json` sees the same session.
    let out = Command::new(util::lanes_bin())
        .args(["status", "--json", "--endpoint", &s.endpoint])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["endpoint"], s.endpoint.as_str());
    assert_eq!(v["policy"], "fifo");
    let sessions = v["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 1, "{v}");
    assert_eq!(sessions[0]["spec"]["name"], "scraped");
    // The lanes as structured JSON: the session's job in lane 0.
    let lanes = &v["lanes"];
    assert_eq!(lanes["capacity"], 1073741824u64, "{v}");
    let lane = &lanes["lanes"][0];
    assert!(lane["used"].as_u64().unwrap() > 0, "{lanes}");
    assert_eq!(lane["jobs"].as_array().unwrap().len(), 1, "{lanes}");
    assert!(lane["jobs"][0]["p"].as_u64().unwrap() > 0, "{lanes}");
    assert!(lanes["queue"].as_array().unwrap().is_empty(), "{lanes}");
    assert!(v.get("lanes_json").is_none(), "{v}");
    // The scheduler's count includes the Run that failed.
    assert!(sessions[0]["iterations"].as_u64().unwrap() >= 3, "{v}");

    // `--watch` off a terminal: one report after another.
    let mut watch = Command::new(util::lanes_bin())
        .args(["status", "--watch", "0.2", "--endpoint", &s.endpoint])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reports = 0;
    for line in BufReader::new(watch.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.starts_with("lanes/") {
            reports += 1;
            if reports == 2 {
                break;
            }
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    assert_eq!(reports, 2, "two reports from --watch");

    // The session closes: its series go.
    session.close().unwrap();
    let closed = scrape_until(&url, |t| t.contains("lanes_sessions_open 0"));
    assert!(!closed.contains(&iters), "{closed}");
}

#[test]
fn a_busy_metrics_port_is_refused_with_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(util::lanes_bin())
        .args([
            "serve",
            "--device",
            "cpu",
            "--endpoint",
            "tcp://127.0.0.1:*",
        ])
        .args(["--metrics", &addr])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("cannot serve metrics on {addr}")),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let out = Command::new(util::lanes_bin())
        .args([
            "serve",
            "--device",
            "cpu",
            "--endpoint",
            "tcp://127.0.0.1:*",
        ])
        .args(["--metrics", "localhost"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("give HOST:PORT"), "{err}");
}
