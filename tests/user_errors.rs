//! A user's mistakes, made as a user makes them (the `lanes` binary with
//! `RUST_BACKTRACE=1`, as on many developer machines): each is answered in
//! a line or two that says what to do, never with a panic or a stack trace.
//! Whole file: about 15 s on the 2-core development VM (most of it the
//! replay's 10 s wait for a service that is not there).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::Write;
use std::process::{Command, Output, Stdio};

/// `lanes <args>` with `RUST_BACKTRACE=1`; its output.
fn lanes(args: &[&str]) -> Output {
    Command::new(util::lanes_bin())
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("lanes runs")
}

/// It failed, said no more than `max_lines` lines, without a panic or a
/// backtrace; its stderr.
fn failed(out: &Output, max_lines: usize) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "it should fail:\n{stderr}");
    assert!(!stderr.contains("panicked"), "a panic:\n{stderr}");
    assert!(
        !stderr.contains("stack backtrace"),
        "a backtrace:\n{stderr}"
    );
    assert!(
        !stderr.contains("RUST_BACKTRACE"),
        "a backtrace hint:\n{stderr}"
    );
    let lines = stderr.lines().filter(|l| !l.trim().is_empty()).count();
    assert!(lines <= max_lines, "{lines} lines:\n{stderr}");
    stderr
}

/// A small valid trace in a temporary file.
fn trace_file(name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "lanes-user-errors-{}-{name}.csv",
        std::process::id()
    ));
    let mut f = std::fs::File::create(&path).unwrap();
    writeln!(
        f,
        "job_id,submit_s,kind,iterations,iter_ms,persistent_bytes,ephemeral_bytes,priority"
    )
    .unwrap();
    for i in 0..20 {
        writeln!(f, "{i},{}.0,training,5,10,256MiB,128MiB,0", i).unwrap();
    }
    path
}

/// A loopback port nothing listens on (just freed).
fn dead_endpoint() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    format!("tcp://127.0.0.1:{port}")
}

#[test]
fn a_bad_size_names_the_flag_and_the_forms() {
    let err = failed(&lanes(&["serve", "--device", "cpu", "--memory", "lots"]), 4);
    assert!(
        err.contains("--memory") && err.contains("auto, none or a size"),
        "{err}"
    );
    let trace = trace_file("size");
    let t = trace.to_str().unwrap();
    let err = failed(&lanes(&["simulate", "--trace", t, "--memory", "lots"]), 4);
    assert!(
        err.contains("--memory") && err.contains("`lots` is not a size"),
        "{err}"
    );
    assert!(err.contains("16GiB"), "an example of a size: {err}");
    assert!(
        !err.contains("trace line"),
        "not blamed on the trace: {err}"
    );
    let err = failed(&lanes(&["replay", "--trace", t, "--memory=-1G"]), 4);
    assert!(
        err.contains("--memory") && err.contains("negative"),
        "{err}"
    );
    let _ = std::fs::remove_file(trace);
}

#[test]
fn an_endpoint_without_a_scheme_gets_the_accepted_forms() {
    for cmd in [
        &["serve", "--device", "cpu", "--endpoint", "localhost:5599"][..],
        &["status", "--endpoint", "localhost:5599"][..],
    ] {
        let err = failed(&lanes(cmd), 2);
        assert!(
            err.contains("tcp://HOST:PORT")
                && err.contains("ipc://PATH")
                && err.contains("did you mean tcp://localhost:5599?"),
            "{cmd:?}: {err}"
        );
        assert!(!err.contains("Invalid argument"), "{err}");
    }
}

#[test]
fn an_unreachable_service_is_blamed_on_a_missing_lanes_serve() {
    let endpoint = dead_endpoint();
    let err = failed(
        &lanes(&["status", "--endpoint", &endpoint, "--timeout", "1"]),
        2,
    );
    assert!(
        err.contains(&format!("no reply from {endpoint}"))
            && err.contains("is `lanes serve` running there?"),
        "{err}"
    );
    let trace = trace_file("replay");
    let err = failed(
        &lanes(&[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--endpoint",
            &endpoint,
        ]),
        2,
    );
    assert!(
        err.contains("is `lanes serve` running there?") && err.contains("--endpoint serve"),
        "{err}"
    );
    let _ = std::fs::remove_file(trace);
}

#[test]
fn a_missing_file_is_reported_once() {
    let err = failed(
        &lanes(&["simulate", "--trace", "/nonexistent/trace.csv"]),
        2,
    );
    assert!(err.contains("/nonexistent/trace.csv"), "{err}");
    assert_eq!(err.matches("No such file").count(), 1, "{err}");
}

/// `lanes simulate … | head -1`, `lanes trace gen | head -1`: the reader
/// goes away; the command ends quietly and successfully.
#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    let trace = trace_file("pipe");
    let t = trace.to_str().unwrap();
    for args in [
        &["simulate", "--trace", t][..],
        &["simulate", "--trace", t, "--json"][..],
        &["trace", "gen", "--jobs", "100000"][..],
    ] {
        let mut child = Command::new(util::lanes_bin())
            .args(args)
            .env("RUST_BACKTRACE", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("lanes runs");
        // Close the read end before the command writes anything.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Error"),
            "{args:?}: {stderr}"
        );
    }
    let _ = std::fs::remove_file(trace);
}

#[test]
fn bench_checks_model_and_device_before_building() {
    // Unknown model: one error line, before any child process or graph.
    let start = std::time::Instant::now();
    let err = failed(&lanes(&["bench", "infer", "--model", "vgg"]), 1);
    assert!(
        err.contains("unknown model `vgg`") && err.contains("resnet50"),
        "{err}"
    );
    let err = failed(&lanes(&["bench", "train", "--model", "resnet5"]), 1);
    assert!(err.contains("unknown model `resnet5`"), "{err}");
    assert!(start.elapsed().as_secs() < 10, "refused before building");
    if lanes::exec::cuda::probe().is_err() {
        // `--device cuda` without a GPU: one line that says what to pass.
        let err = failed(
            &lanes(&[
                "bench", "infer", "--model", "mlp", "--device", "cuda", "--iters", "1",
            ]),
            2,
        );
        assert!(err.contains("--device cpu"), "{err}");
        assert_eq!(err.matches("Error").count(), 1, "{err}");
        // The default is `auto`, as for `lanes serve`: the CPU here.
        let out = lanes(&[
            "bench", "infer", "--model", "mlp", "--batch", "2", "--iters", "1", "--warmup", "0",
            "--path", "executor",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["device"], "cpu", "{v}");
        assert!(stderr.contains("no usable GPU"), "{stderr}");
    }
}

/// `lanes replay` against a service that runs several workers and other
/// memory than it simulates says so, with the flags that make them match.
#[test]
fn replay_warns_when_the_service_differs_from_the_simulation() {
    let mut serve = Command::new(util::lanes_bin())
        .args([
            "serve",
            "--device",
            "cpu",
            "--workers",
            "2",
            "--memory",
            "1GiB",
        ])
        .args(["--endpoint", "tcp://127.0.0.1:*"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("lanes runs");
    let line = util::serve::serving_line(&mut serve);
    let endpoint = util::serve::endpoint_of(&line).unwrap_or_else(|| panic!("{line:?}"));
    let trace = std::env::temp_dir().join(format!("lanes-replay-warn-{}.csv", std::process::id()));
    std::fs::write(
        &trace,
        "job_id,submit_s,kind,iterations,iter_ms,persistent_bytes,ephemeral_bytes,priority\n\
         1,0,training,2,10,1MiB,1MiB,0\n2,0.1,inference,2,5,1MiB,1MiB,0\n",
    )
    .unwrap();
    let out = lanes(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--endpoint",
        &endpoint,
        "--time-scale",
        "0.01",
    ]);
    let _ = serve.kill();
    let _ = serve.wait();
    let _ = std::fs::remove_file(trace);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("runs 2 workers, the simulation 1 lane(s)")
            && stderr.contains("--workers 1 --max-lanes 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("up to 8 lanes, the simulation 1:") && stderr.contains("--max-lanes 1`"),
        "{stderr}"
    );
    assert!(
        stderr.contains("share 1.00 GiB, the simulation 16.00 GiB")
            && stderr.contains("--memory 1073741824"),
        "{stderr}"
    );
}

#[test]
fn a_load_must_be_part_of_the_start_up() {
    let trace = trace_file("load");
    let t = trace.to_str().unwrap();
    let err = failed(&lanes(&["simulate", "--trace", t, "--load-ms", "5"]), 4);
    assert!(err.contains("--startup-ms"), "{err}");
    let err = failed(
        &lanes(&[
            "simulate",
            "--trace",
            t,
            "--startup-ms",
            "100,50",
            "--load-ms",
            "80,60",
        ]),
        2,
    );
    assert!(
        err.contains("more than --startup-ms for Inference jobs"),
        "{err}"
    );
    let ok = lanes(&[
        "simulate",
        "--trace",
        t,
        "--startup-ms",
        "100,50",
        "--load-ms",
        "80,40",
        "--after-load-ms",
        "10",
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let _ = std::fs::remove_file(trace);
}

/// `lanes replay --endpoint serve` serves its service's metrics and reads
/// each kind's load there; the as-run simulation is reported with and
/// without the loads on the lane.
#[test]
fn replay_against_its_own_service_reports_the_loads() {
    let trace = std::env::temp_dir().join(format!("lanes-replay-load-{}.csv", std::process::id()));
    std::fs::write(
        &trace,
        "job_id,submit_s,kind,iterations,iter_ms,persistent_bytes,ephemeral_bytes,priority\n\
         1,0,training,6,10,1MiB,1MiB,0\n2,0.05,inference,4,5,1MiB,1MiB,0\n",
    )
    .unwrap();
    let out = lanes(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--endpoint",
        "serve",
        "--policy",
        "fifo",
        "--zoo",
        "mlp",
        "--time-scale",
        "0.1",
        "--json",
    ]);
    let _ = std::fs::remove_file(trace);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = &v[0];
    assert_eq!(c["load_measured_by"], "service metrics", "{c}");
    for kind in ["training", "inference"] {
        let load = c["load_ms"][kind].as_f64().unwrap();
        let trip = c["load_round_trip_ms"][kind].as_f64().unwrap();
        let startup = c["startup_ms"][kind].as_f64().unwrap();
        assert!(load > 0.0 && load <= trip && trip <= startup, "{kind}: {c}");
    }
    assert!(
        c["simulated_as_run_without_loads"]["avg_jct_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(
        c["live_over_sim_as_run_without_loads_avg_jct"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

/// `lanes simulate --gpus 0` is refused by the flag's range; `--gpus 2
/// --json` reports the combined numbers and each GPU's, every job once.
#[test]
fn gpus_zero_is_refused_and_two_are_reported_each() {
    let trace = trace_file("gpus");
    let t = trace.to_str().unwrap();
    let err = failed(&lanes(&["simulate", "--trace", t, "--gpus", "0"]), 4);
    assert!(err.contains("--gpus"), "{err}");
    let out = lanes(&[
        "simulate", "--trace", t, "--policy", "fifo", "--gpus", "2", "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = &v[0];
    assert_eq!(row["jobs"], 20);
    assert_eq!(row["gpus"], 2);
    let devices = row["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let placed: u64 = devices.iter().map(|d| d["jobs"].as_u64().unwrap()).sum();
    assert_eq!(placed, 20);
}
