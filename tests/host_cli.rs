//! `lanes host` started as a user starts it, with two CPU services (the
//! test aid of `--device cpu --gpus 0,1`): its directory file, placement
//! through `placement::connect_best` (a job that fills service 0's memory
//! sends the next one to service 1), `lanes status --directory`, one
//! service killed while the other keeps serving and the launcher says so,
//! and SIGTERM forwarded. No timing asserts: waits are for lines and
//! files, bounded only against a hang.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lanes_adaptor::placement::{connect_best, Directory, JobSize};
use lanes_adaptor::{Client, ClientOptions, GraphBuilder, SessionSpec, Tensor, TensorType};

/// Long enough never to be reached unless something hangs.
const PATIENCE: Duration = Duration::from_secs(60);

/// `x [1, N] @ w [N, N]`: w is N·N·4 bytes of persistent memory.
fn square(n: usize) -> (lanes_adaptor::Graph, lanes_adaptor::VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([1, n]));
    let w = g.variable("w", Tensor::from_f32([n, n], vec![0.5; n * n]).unwrap());
    let y = g.matmul(x, w);
    g.set_name(y, "y");
    g.finish().unwrap()
}

fn options() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    }
}

/// Loads `square(n)` in a fresh session and runs it once.
fn load_and_run(client: &mut Client, n: usize, name: &str) {
    let mut s = client.open_session(SessionSpec::inference(name)).unwrap();
    let (g, v) = square(n);
    s.load(&g, v).unwrap();
    let out = s
        .run(
            vec![("x", Tensor::from_f32([1, n], vec![1.0; n]).unwrap())],
            &["y"],
        )
        .unwrap();
    assert_eq!(out[0].to_f32_vec().unwrap()[0], 0.5 * n as f32);
    // The session stays open (its memory held) while the client lives.
    std::mem::forget(s);
}

struct Host {
    child: Child,
    lines: mpsc::Receiver<String>,
    errors: mpsc::Receiver<String>,
    directory: std::path::PathBuf,
}

impl Drop for Host {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            signal(self.child.id(), "TERM");
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.directory);
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("kill runs")
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

/// The lines of a child's pipe, as they come.
fn lines_of(pipe: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The first line from `rx` containing `needle` (panics after PATIENCE).
fn wait_for(rx: &mpsc::Receiver<String>, needle: &str) -> String {
    let until = Instant::now() + PATIENCE;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(needle) => return l,
            Ok(_) => {}
            Err(e) => panic!("no line with {needle:?}: {e}"),
        }
    }
}

fn start_host(memory: &str) -> Host {
    let directory = std::env::temp_dir().join(format!("lanes-host-{}.json", std::process::id()));
    let mut child = Command::new(util::lanes_bin())
        .args(["host", "--device", "cpu", "--gpus", "0,1"])
        .args(["--endpoint", "tcp://127.0.0.1:*"])
        .arg("--directory")
        .arg(&directory)
        .args(["--", "--memory", memory, "--workers", "1"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("lanes runs");
    let lines = lines_of(child.stdout.take().unwrap());
    let errors = lines_of(child.stderr.take().unwrap());
    let host = Host {
        child,
        lines,
        errors,
        directory,
    };
    wait_for(&host.lines, "service(s) ready");
    host
}

#[test]
fn two_services_place_jobs_report_status_and_survive_one_another() {
    // 6 MiB each; a job with a 4 MiB weight fills service 0.
    let mut host = start_host("6MiB");
    let dir = Directory::read(&host.directory).unwrap();
    assert_eq!(dir.services.len(), 2);
    assert_eq!(
        dir.services.iter().map(|s| s.index).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert!(dir.services.iter().all(|s| s.running && s.device == "cpu"));
    let endpoints = dir.endpoints();
    assert_ne!(endpoints[0], endpoints[1]);

    // Both empty: a tie, the first service.
    let small = JobSize {
        persistent: 1 << 20,
        ephemeral: 1 << 16,
    };
    let (mut first, p) = connect_best(&endpoints, Some(small), options()).unwrap();
    assert_eq!(p.index, 0, "{p}");
    assert!(p.fits_now);
    load_and_run(&mut first, 1024, "big-0");

    // The same job's P and T, as service 0 planned them.
    let status = first.status().unwrap();
    let lanes: serde_json::Value =
        serde_json::from_str(status.lanes_json.as_deref().unwrap()).unwrap();
    let job = &lanes["lanes"][0]["jobs"][0];
    let need = JobSize {
        persistent: job["p"].as_u64().unwrap(),
        ephemeral: job["t"].as_u64().unwrap(),
    };
    assert!(need.persistent >= 4 << 20, "{lanes}");
    let (mut second, p) = connect_best(&endpoints, Some(need), options()).unwrap();
    assert_eq!(p.index, 1, "service 0 is full: {p}");
    assert!(p.fits_now);
    load_and_run(&mut second, 1024, "big-1");

    // `lanes status --directory`: both services, each under its heading.
    let out = Command::new(util::lanes_bin())
        .args(["status", "--directory"])
        .arg(&host.directory)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("== cpu 0: cpu ==") && text.contains("== cpu 1: cpu =="),
        "{text}"
    );
    assert!(text.contains("big-0") && text.contains("big-1"), "{text}");
    let out = Command::new(util::lanes_bin())
        .args(["status", "--json", "--directory"])
        .arg(&host.directory)
        .output()
        .unwrap();
    let array: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(array.as_array().map(Vec::len), Some(2), "{array}");
    assert_eq!(array[1]["endpoint"], endpoints[1].as_str());

    // Service 0 dies: the launcher says so, the directory marks it, and
    // service 1 keeps serving its job.
    signal(dir.services[0].pid.unwrap(), "KILL");
    let said = wait_for(&host.errors, "the others keep serving");
    assert!(
        said.contains("cpu 0") && said.contains("exited: signal: 9"),
        "{said}"
    );
    let until = Instant::now() + PATIENCE;
    while Directory::read(&host.directory).map_or(true, |d| d.services[0].running) {
        assert!(
            Instant::now() < until,
            "the directory never marked service 0"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut s = second
        .open_session(SessionSpec::inference("after"))
        .unwrap();
    let (g, v) = square(8);
    s.load(&g, v).unwrap();
    drop(s);
    // Placement skips the dead service.
    let quick = ClientOptions {
        timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        ..ClientOptions::default()
    };
    let (_c, p) = connect_best(&endpoints, None, quick).unwrap();
    assert_eq!(p.index, 1, "{p}");
    assert_eq!(
        Directory::read(&host.directory).unwrap().endpoints(),
        vec![endpoints[1].clone()]
    );

    // SIGTERM reaches the remaining service; the launcher exits after it.
    drop(first);
    drop(second);
    signal(host.child.id(), "TERM");
    let status = host.child.wait().unwrap();
    assert!(status.success(), "{status}");
    let pid1 = dir.services[1].pid.unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid1}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid1}/stat"))
                .is_ok_and(|s| s.contains(") Z ")),
        "service 1 still runs"
    );
}

#[test]
fn a_launcher_that_cannot_start_a_service_says_so_and_starts_none() {
    let out = Command::new(util::lanes_bin())
        .args(["host", "--device", "cpu", "--gpus", "0,1"])
        .args(["--endpoint", "tcp://127.0.0.1:*", "--", "--memory", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("the service of cpu 0 did not start"), "{err}");
    // Flags that are the launcher's own are refused after `--`.
    let out = Command::new(util::lanes_bin())
        .args([
            "host",
            "--device",
            "cpu",
            "--gpus",
            "0",
            "--",
            "--endpoint",
            "tcp://x:1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--endpoint is lanes host's own flag"), "{err}");
}

/// `lanes bench gpus` on the CPU backend at tiny size: both arrangements
/// run every job, one on service 0 and spread over both; the ratios are
/// reported (not judged: two CPU services share this machine's cores).
#[test]
fn the_two_gpu_bench_runs_on_the_cpu() {
    let out = Command::new(util::lanes_bin())
        .args(["bench", "gpus", "--device", "cpu"])
        .args(["--train-model", "mlp", "--train-batch", "8"])
        .args(["--infer-model", "mlp", "--infer-batch", "4"])
        .args(["--warmup", "1", "--seconds", "0.3"])
        .args(["--serve-arg=--workers=1", "--serve-arg=--memory=256MiB"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let services = |arr: &str| -> Vec<u64> {
        v[arr]["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| {
                assert!(j["iterations"].as_u64().unwrap() >= 1, "{j}");
                j["service"].as_u64().unwrap()
            })
            .collect()
    };
    assert_eq!(services("one_gpu"), vec![0; 6]);
    assert_eq!(services("spread"), vec![0, 1, 0, 1, 0, 1]);
    assert!(v["train_ratio"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["infer_ratio"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["ratio"].is_number(), "{v}");
}

// On the GPU machine (ignored here: no GPU): `LANES_BIN=… host_cli
// --ignored --test-threads=1`.

/// `lanes serve --device cuda:N` names GPU N; an ordinal past the host's
/// GPUs is refused at start-up with the count.
#[test]
#[ignore = "needs a GPU"]
fn gpu_serve_by_ordinal_names_its_gpu_and_refuses_a_missing_one() {
    let count = lanes::exec::cuda::device_count().expect("a GPU host");
    let last = count - 1;
    let mut child = Command::new(util::lanes_bin())
        .args(["serve", "--device", &format!("cuda:{last}")])
        .args(["--endpoint", "tcp://127.0.0.1:*", "--memory", "1GiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = util::serve::serving_line(&mut child);
    signal(child.id(), "TERM");
    let _ = child.wait();
    assert!(line.contains(&format!("(device cuda:{last} (")), "{line}");
    let (code, err) = util::serve::refusal(&["--device", &format!("cuda:{count}")]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains(&format!("no GPU {count}: this host has {count}")),
        "{err}"
    );
}

/// `lanes host --gpus all`: one service per GPU, each on its own GPU, each
/// running a job.
#[test]
#[ignore = "needs a GPU"]
fn gpu_host_serves_every_gpu() {
    let count = lanes::exec::cuda::device_count().expect("a GPU host");
    let directory = std::env::temp_dir().join(format!("lanes-gpus-{}.json", std::process::id()));
    let mut child = Command::new(util::lanes_bin())
        .args(["host", "--gpus", "all", "--endpoint", "tcp://127.0.0.1:*"])
        .arg("--directory")
        .arg(&directory)
        .args(["--", "--memory", "2GiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(child.stdout.take().unwrap());
    let errors = lines_of(child.stderr.take().unwrap());
    let mut host = Host {
        child,
        lines,
        errors,
        directory,
    };
    wait_for(&host.lines, "service(s) ready");
    let dir = Directory::read(&host.directory).unwrap();
    assert_eq!(dir.services.len(), count);
    for (i, s) in dir.services.iter().enumerate() {
        assert!(s.device.starts_with(&format!("cuda:{i} (")), "{s:?}");
        let mut c = Client::connect_with(&s.endpoint, options()).unwrap();
        assert!(c
            .status()
            .unwrap()
            .device
            .starts_with(&format!("cuda:{i} (")));
        load_and_run(&mut c, 256, &format!("on-{i}"));
    }
    let (_c, p) = connect_best(&dir.endpoints(), None, options()).unwrap();
    assert!(p.index < count);
    signal(host.child.id(), "TERM");
    assert!(host.child.wait().unwrap().success());
}
