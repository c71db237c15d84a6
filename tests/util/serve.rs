//! `lanes serve` as a child process, started as a user starts it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};

/// The device the child services run on (`LANES_TEST_DEVICE`).
pub fn serve_device() -> &'static str {
    match std::env::var("LANES_TEST_DEVICE").as_deref() {
        Ok("cuda") => "cuda",
        _ => "cpu",
    }
}

/// The first line a `lanes serve` child prints on its (piped) stdout:
/// `lanes serving on ENDPOINT (device …, policy …)[, metrics at http://ADDR/metrics]`
/// once it listens, anything else when it did not start.
pub fn serving_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("stdout readable");
    line
}

/// The endpoint a serving line names.
pub fn endpoint_of(line: &str) -> Option<String> {
    line.strip_prefix("lanes serving on ")
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_string)
}

/// The metrics address a serving line names (`--metrics`).
pub fn metrics_of(line: &str) -> Option<String> {
    line.split("metrics at ")
        .nth(1)
        .map(|m| m.trim().to_string())
}

/// `lanes serve` with `args` (on [`serve_device`] and a free loopback port
/// unless `args` name them), which must refuse to start: its exit code and
/// stderr.
pub fn refusal(args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(super::lanes_bin());
    cmd.arg("serve");
    if !args.contains(&"--device") {
        cmd.args(["--device", serve_device()]);
    }
    if !args.contains(&"--endpoint") {
        cmd.args(["--endpoint", "tcp://127.0.0.1:*"]);
    }
    let out = cmd.args(args).output().expect("lanes runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "lanes serve {args:?} started:\n{stderr}"
    );
    (out.status.code(), stderr)
}

/// A `lanes serve` child process, killed when dropped.
pub struct Serve {
    pub child: Child,
    pub endpoint: String,
    /// The whole "lanes serving on" line (it names the other addresses).
    pub line: String,
}

impl Serve {
    /// Starts `lanes serve` with `args` (by default on a free loopback
    /// port, with one worker) and waits for its "serving on" line.
    pub fn start(args: &[&str]) -> Serve {
        let mut cmd = Command::new(super::lanes_bin());
        cmd.arg("serve");
        if !args.contains(&"--device") {
            cmd.args(["--device", serve_device()]);
        }
        if !args.contains(&"--workers") {
            cmd.args(["--workers", "1"]);
        }
        if !args.contains(&"--endpoint") {
            cmd.args(["--endpoint", "tcp://127.0.0.1:*"]);
        }
        let mut child = cmd
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("lanes runs");
        let line = serving_line(&mut child);
        let Some(endpoint) = endpoint_of(&line) else {
            let _ = child.kill();
            let out = child.wait_with_output().expect("lanes exits");
            panic!(
                "lanes serve {args:?} did not start: {line:?}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        Serve {
            endpoint,
            line: line.trim_end().to_string(),
            child,
        }
    }

    /// `lanes status` against it: stdout.
    pub fn status(&self) -> String {
        let out = Command::new(super::lanes_bin())
            .args(["status", "--endpoint", &self.endpoint])
            .output()
            .expect("lanes runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "lanes status failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    /// A field of the child's `/proc/PID/status` in bytes (`VmRSS`, the
    /// resident memory now; `VmHWM`, its peak so far).
    pub fn memory(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the service is running");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("no {field} in /proc/PID/status"))
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Stops it; its stderr (the log).
    pub fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut log = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut log);
        }
        log
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
