//! `lanes serve` started as a user starts it: lane admission is on by
//! default (`--memory auto`, a share of the device read at start-up, logged
//! with its derivation), `--memory none` turns it off, a size is taken as
//! given, and `--reserve` is refused without memory; on the GPU the memory
//! is one device reservation unless `--no-reserve`. CPU here;
//! `LANES_TEST_DEVICE=cuda` runs the same cases on the GPU machine (with
//! `LANES_BIN` pointing at the staged binary). Whole file: a few seconds on
//! the 2-core development VM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use util::serve::Serve;

use std::process::Command;
use std::sync::Mutex;

fn device() -> &'static str {
    util::serve::serve_device()
}

/// One service at a time: on the GPU each holds a context, and with
/// `--reserve` most of the device.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The GiB figure of `lanes status`'s `memory X GiB` (None for `unset`).
fn status_memory_gib(status: &str) -> Option<f64> {
    let after = status.split(" · memory ").nth(1)?;
    let figure = after.split(" · ").next()?;
    figure.strip_suffix(" GiB")?.parse().ok()
}

#[test]
fn memory_auto_is_the_default_and_admits() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let serve = Serve::start(&[]);
    let status = serve.status();
    let gib = status_memory_gib(&status).unwrap_or_else(|| panic!("a memory figure:\n{status}"));
    assert!(gib > 0.0, "{status}");
    // The lanes are there: admission is on.
    assert!(status.contains("\nreservation "), "{status}");
    let log = serve.stop();
    let rule = match device() {
        "cuda" => "memory: auto = 90% of ",
        _ => "memory: auto = 50% of ",
    };
    assert!(log.contains(rule), "{log}");
    let how = match device() {
        "cuda" => " free (of ",
        _ => " available host memory = ",
    };
    assert!(log.contains(how), "{log}");
}

#[test]
fn memory_none_turns_admission_off() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let serve = Serve::start(&["--memory", "none"]);
    let status = serve.status();
    assert!(status.contains(" · memory unset · "), "{status}");
    assert!(!status.contains("\nreservation "), "{status}");
    let log = serve.stop();
    assert!(log.contains("no lane admission"), "{log}");
}

#[test]
fn memory_size_is_taken_as_given() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let serve = Serve::start(&["--memory", "1.5GiB"]);
    let status = serve.status();
    assert_eq!(status_memory_gib(&status), Some(1.5), "{status}");
    assert!(status.contains("\nreservation 1.50 GiB"), "{status}");
}

#[test]
fn reserve_takes_the_auto_size_and_is_refused_without_memory() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let serve = Serve::start(&["--reserve"]);
    let status = serve.status();
    assert!(
        status_memory_gib(&status).is_some_and(|g| g > 0.0),
        "{status}"
    );
    drop(serve);

    let out = Command::new(util::lanes_bin())
        .args([
            "serve",
            "--device",
            device(),
            "--memory",
            "none",
            "--reserve",
        ])
        .args(["--endpoint", "tcp://127.0.0.1:*"])
        .output()
        .expect("lanes runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--reserve") && stderr.contains("not none"),
        "{stderr}"
    );
}

#[test]
fn memory_values_are_checked_by_the_parser() {
    let (code, stderr) = util::serve::refusal(&["--device", device(), "--memory", "lots"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("auto, none or a size"), "{stderr}");
}

/// On the GPU the lanes' memory is one device reservation by default;
/// `--no-reserve` leaves it to the driver. On the CPU there is nothing to
/// reserve either way.
#[test]
fn the_gpu_memory_is_reserved_unless_no_reserve() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let reserved = Serve::start(&[]).stop().contains("device memory reserved");
    assert_eq!(reserved, device() == "cuda");
    let log = Serve::start(&["--no-reserve"]).stop();
    assert!(!log.contains("device memory reserved"), "{log}");
    let log = Serve::start(&["--memory", "none"]).stop();
    assert!(!log.contains("device memory reserved"), "{log}");
    let out = Command::new(util::lanes_bin())
        .args(["serve", "--device", device(), "--reserve", "--no-reserve"])
        .args(["--endpoint", "tcp://127.0.0.1:*"])
        .output()
        .expect("lanes runs");
    assert_eq!(
        out.status.code(),
        Some(2),
        "conflicting flags are a usage error"
    );
}

/// Without authentication the service refuses to be reachable from other
/// hosts unless told so explicitly.
#[test]
fn a_remote_endpoint_needs_an_explicit_opt_in() {
    let (_, stderr) = util::serve::refusal(&[
        "--device",
        "cpu",
        "--memory",
        "none",
        "--endpoint",
        "tcp://0.0.0.0:0",
    ]);
    assert!(
        stderr.contains("does not authenticate")
            && stderr.contains("--allow-unauthenticated-remote"),
        "{stderr}"
    );
}

/// `--memory 0` would start a service on which every load fails: refused
/// at start, naming the flag.
#[test]
fn memory_zero_is_refused_at_start() {
    let (_, stderr) = util::serve::refusal(&["--device", "cpu", "--memory", "0"]);
    assert!(stderr.contains("--memory 0"), "{stderr}");
}

/// A log that is not a terminal (a file, a pipe) has no colour codes, even
/// without `NO_COLOR`.
#[test]
fn a_log_off_a_terminal_has_no_colour_codes() {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(util::lanes_bin())
        .args(["serve", "--device", "cpu", "--memory", "none"])
        .args(["--endpoint", "tcp://127.0.0.1:*"])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("lanes runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("lanes serving on"), "{line:?}");
    // The log up to the service's ready line (logged as its socket thread
    // starts, about when the serving line is printed).
    let mut log = String::new();
    for l in BufReader::new(child.stderr.take().unwrap()).lines() {
        let l = l.unwrap();
        log.push_str(&l);
        log.push('\n');
        if l.contains("lanes service ready") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(log.contains("lanes service ready"), "{log}");
    assert!(log.contains("WARN"), "{log}");
    assert!(!log.contains('\u{1b}'), "{log:?}");
}
