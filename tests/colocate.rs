//! Inference beside training through a real service: a training job keeps
//! Runs back to back (several in flight) while an inference job arrives.
//!
//! - Whatever the policy, the arriving job is loaded and answers its first
//!   Run while training goes on, within a bound of its own load time and
//!   the training's iterations (on the GPU a load once waited for the
//!   training to end: a driver lock starved by the training lane's waits).
//! - Under `priority`, even with `--max-lanes 1`, the inference job has a
//!   lane of its own (lanes of its class), so no inference Run waits
//!   behind more than one training iteration; under `fifo` the two share
//!   the one lane and the same inference job waits for the training job's
//!   queue.
//!
//! CPU backend in CI; `LANES_TEST_DEVICE=cuda` runs it on the GPU machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use util::jobs::{self, open, Job};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanes::server::PolicyChoice;
use lanes_adaptor::wire::SessionId;
use lanes_adaptor::{Arch, Client, SessionSpec};

/// Runs the training job keeps in flight.
const AHEAD: usize = 4;
/// The training job stops by itself after this long (a stalled arrival
/// shows as a wait this long).
const TRAIN_FOR: Duration = Duration::from_secs(60);

fn client(endpoint: &str) -> Client {
    jobs::client(endpoint, "colocate-test", Duration::from_secs(120))
}

/// An MLP training step heavy enough to take milliseconds on the CPU.
fn training_job() -> Job {
    let arch = Arch::Mlp {
        inputs: 256,
        hidden: vec![1024, 1024],
        classes: 10,
    };
    Job::training(&arch, 128)
}

fn inference_job() -> Job {
    let arch = Arch::Mlp {
        inputs: 64,
        hidden: vec![128],
        classes: 10,
    };
    Job::inference(&arch, 8)
}

/// The training job on its own connection: `AHEAD` Runs in flight until
/// stopped (or `TRAIN_FOR` passed); completion times recorded.
struct Trainer {
    stop: Arc<AtomicBool>,
    done: Arc<Mutex<Vec<Instant>>>,
    thread: std::thread::JoinHandle<()>,
}

impl Trainer {
    fn start(endpoint: &str) -> Trainer {
        let endpoint = endpoint.to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(Mutex::new(Vec::new()));
        let (s, d) = (Arc::clone(&stop), Arc::clone(&done));
        let thread = std::thread::spawn(move || {
            let job = training_job();
            let mut c = client(&endpoint);
            let id = open(&mut c, SessionSpec::training("train"));
            c.load_in(id, &job.graph, job.vars.clone()).unwrap();
            let fetch = [job.fetch.as_str()];
            let mut pending = std::collections::VecDeque::new();
            for _ in 0..AHEAD {
                pending.push_back(c.submit_run_in(id, job.feeds(), &fetch).unwrap());
            }
            let t0 = Instant::now();
            while !s.load(Ordering::SeqCst) && t0.elapsed() < TRAIN_FOR {
                let first = pending.pop_front().unwrap();
                c.wait_run(first).unwrap();
                d.lock().unwrap().push(Instant::now());
                pending.push_back(c.submit_run_in(id, job.feeds(), &fetch).unwrap());
            }
            for p in pending {
                c.wait_run(p).unwrap();
            }
            c.close_in(id).unwrap();
        });
        Trainer { stop, done, thread }
    }

    fn steps(&self) -> usize {
        self.done.lock().unwrap().len()
    }

    fn wait_for_steps(&self, n: usize) {
        let t0 = Instant::now();
        while self.steps() < n {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "training made no progress"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Longest time between two completions so far (an iteration's time,
    /// with Runs in flight).
    fn longest_step(&self) -> Duration {
        let d = self.done.lock().unwrap();
        d.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default()
    }

    fn completed_after(&self, t: Instant) -> usize {
        self.done.lock().unwrap().iter().filter(|x| **x > t).count()
    }

    fn finish(self) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap();
    }
}

fn serve(policy: PolicyChoice, max_lanes: usize) -> lanes::server::ServerHandle {
    util::start_with(|c| {
        c.policy = policy;
        c.memory_bytes = Some(512 << 20);
        c.max_lanes = max_lanes;
        c.workers = 2;
    })
}

/// Load and first Run of the inference job; returns (load + first run,
/// first run alone).
fn arrive(c: &mut Client, job: &Job, name: &str) -> (SessionId, Duration) {
    let t0 = Instant::now();
    let id = open(c, SessionSpec::inference(name));
    c.load_in(id, &job.graph, job.vars.clone()).unwrap();
    c.run_in(id, job.feeds(), &[job.fetch.as_str()]).unwrap();
    (id, t0.elapsed())
}

#[test]
fn an_arriving_job_loads_and_answers_while_training_runs() {
    for policy in [PolicyChoice::Fifo, PolicyChoice::Priority] {
        let server = serve(policy, 8);
        let job = inference_job();
        let mut c = client(server.endpoint());
        // Its own load and first Run on an idle service.
        let (alone_id, alone) = arrive(&mut c, &job, "alone");
        c.close_in(alone_id).unwrap();

        let trainer = Trainer::start(server.endpoint());
        trainer.wait_for_steps(3);
        let (id, took) = arrive(&mut c, &job, "arriving");
        let arrived = Instant::now();
        let step = trainer.longest_step();
        // Training went on meanwhile and after.
        trainer.wait_for_steps(trainer.steps() + 2);
        assert!(trainer.completed_after(arrived) >= 1);
        trainer.finish();
        c.close_in(id).unwrap();
        let bound = 3 * (alone + step) + Duration::from_secs(2);
        assert!(
            took <= bound,
            "{policy}: the arriving job answered after {took:?} (alone {alone:?}, a training step {step:?})"
        );
        server.shutdown().unwrap();
    }
}

/// Latencies of `n` inference Runs, one every `gap`, beside the trainer.
fn paced_runs(c: &mut Client, id: SessionId, job: &Job, n: usize, gap: Duration) -> Vec<Duration> {
    (0..n)
        .map(|_| {
            std::thread::sleep(gap);
            let t0 = Instant::now();
            c.run_in(id, job.feeds(), &[job.fetch.as_str()]).unwrap();
            t0.elapsed()
        })
        .collect()
}

/// The lanes in the service's Status: each lane's class and its jobs.
fn lanes_of(c: &mut Client) -> Vec<(u64, Vec<u64>)> {
    let status = c.status().unwrap();
    let v: serde_json::Value =
        serde_json::from_str(status.lanes_json.as_deref().expect("lanes view")).unwrap();
    v["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let jobs = l["jobs"].as_array().unwrap();
            let ids = jobs.iter().map(|j| j["job"].as_u64().unwrap()).collect();
            (l["class"].as_u64().unwrap(), ids)
        })
        .collect()
}

#[test]
fn under_priority_inference_has_a_lane_of_its_own_and_waits_behind_at_most_one_iteration() {
    // `--max-lanes 1`: under fifo the two jobs would share the one lane and
    // take turns; under priority the inference job opens a lane of its
    // class, so its Runs never wait for a training iteration of their lane
    // (on the GPU the device's gate decides what runs beside them).
    let server = serve(PolicyChoice::Priority, 1);
    let job = inference_job();
    let mut c = client(server.endpoint());
    let id = open(&mut c, SessionSpec::inference("urgent"));
    c.load_in(id, &job.graph, job.vars.clone()).unwrap();
    let alone = paced_runs(&mut c, id, &job, 5, Duration::ZERO);
    let alone_max = alone.into_iter().max().unwrap();

    let trainer = Trainer::start(server.endpoint());
    trainer.wait_for_steps(3);
    let mut lanes = lanes_of(&mut c);
    lanes.sort();
    assert_eq!(lanes.len(), 2, "{lanes:?}");
    assert_eq!(
        (lanes[0].0, lanes[0].1.len()),
        (0, 1),
        "training: {lanes:?}"
    );
    assert_eq!(lanes[1], (1, vec![id.0]), "inference: {lanes:?}");
    let beside = paced_runs(&mut c, id, &job, 20, Duration::from_millis(3));
    let step = trainer.longest_step();
    trainer.finish();
    let worst = beside.into_iter().max().unwrap();
    // One training iteration in progress, then this Run (twice each, and a
    // margin, for a loaded CI machine); `AHEAD` queued training Runs would
    // be several iterations.
    let bound = 2 * (step + alone_max) + Duration::from_millis(100);
    assert!(
        worst <= bound,
        "an inference Run took {worst:?}; a training step takes up to {step:?}, the Run alone {alone_max:?}"
    );
    server.shutdown().unwrap();
}

/// The contrast: under `fifo` the job that arrived first keeps its lane
/// while it has Runs queued, so an inference Run waits for the training
/// job's whole queue; priority is what lets it through. Checked by the
/// order of the replies, not by time (a GPU runs this small training step
/// in well under a millisecond).
#[test]
fn under_fifo_inference_waits_for_the_training_queue() {
    const QUEUED: usize = 40;
    let server = serve(PolicyChoice::Fifo, 1);
    let train = training_job();
    let job = inference_job();
    // The training job arrives (and joins the policy) first.
    let mut t = client(server.endpoint());
    let tid = open(&mut t, SessionSpec::training("first"));
    t.load_in(tid, &train.graph, train.vars.clone()).unwrap();
    let mut c = client(server.endpoint());
    let id = open(&mut c, SessionSpec::inference("late"));
    c.load_in(id, &job.graph, job.vars.clone()).unwrap();
    let fetch = [train.fetch.as_str()];
    let runs: Vec<_> = (0..QUEUED)
        .map(|_| t.submit_run_in(tid, train.feeds(), &fetch).unwrap())
        .collect();
    let mut runs = runs.into_iter();
    t.wait_run(runs.next().unwrap()).unwrap();
    // Training is running with its queue full: the inference Run arrives.
    let waiter = std::thread::spawn(move || {
        runs.map(|r| {
            t.wait_run(r).unwrap();
            Instant::now()
        })
        .collect::<Vec<_>>()
    });
    c.run_in(id, job.feeds(), &[job.fetch.as_str()]).unwrap();
    let answered = Instant::now();
    let training = waiter.join().unwrap();
    let before = training.iter().filter(|t| **t <= answered).count();
    assert!(
        before + 2 >= training.len(),
        "under fifo the inference Run was answered after {before} of {} queued training Runs",
        training.len()
    );
    server.shutdown().unwrap();
}

/// The gate's count of urgent Runs on /metrics once it reads `expected`
/// (the socket thread publishes twice a second), or what it read last.
fn gate_count(metrics: &lanes::server::metrics::Metrics, expected: f64) -> (Option<f64>, String) {
    let series = "lanes_gate_urgent_runs_total ";
    let t0 = Instant::now();
    loop {
        let text = metrics.encode().unwrap();
        let v = text
            .lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse::<f64>().ok());
        if v == Some(expected) || t0.elapsed() > Duration::from_secs(10) {
            return (v, text);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A service under `policy` with metrics, a training job loaded and run
/// once, and an inference job of `spec` loaded and run `runs` times.
fn runs_beside_training(
    policy: PolicyChoice,
    spec: SessionSpec,
    runs: usize,
) -> (
    lanes::server::ServerHandle,
    Arc<lanes::server::metrics::Metrics>,
) {
    let metrics = Arc::new(lanes::server::metrics::Metrics::new());
    let m = Arc::clone(&metrics);
    let server = util::start_with(move |c| {
        c.policy = policy;
        c.metrics = Some(m);
    });
    let job = inference_job();
    let train = training_job();
    let mut c = client(server.endpoint());
    let tid = open(&mut c, SessionSpec::training("t"));
    c.load_in(tid, &train.graph, train.vars.clone()).unwrap();
    c.run_in(tid, train.feeds(), &[train.fetch.as_str()])
        .unwrap();
    let id = open(&mut c, spec);
    c.load_in(id, &job.graph, job.vars.clone()).unwrap();
    for _ in 0..runs {
        c.run_in(id, job.feeds(), &[job.fetch.as_str()]).unwrap();
    }
    (server, metrics)
}

/// Under `priority` every inference Run closes the device's gate while it
/// runs (`exec::gate`; the CPU backend's training ignores it, the GPU's
/// waits): the gate counts them, and /metrics shows the count. Under
/// `fifo` nothing is gated.
#[test]
fn under_priority_inference_runs_close_the_gate() {
    for (policy, expected) in [(PolicyChoice::Priority, 5.0), (PolicyChoice::Fifo, 0.0)] {
        let (server, metrics) = runs_beside_training(policy, SessionSpec::inference("i"), 5);
        let (seen, text) = gate_count(&metrics, expected);
        assert_eq!(seen, Some(expected), "{policy}: {text}");
        server.shutdown().unwrap();
    }
}

/// An inference session with a latency objective its Runs stay well under
/// closes the gate only until it has seen a window of 32 Runs
/// (`session/slo.rs`); with one they all exceed, every Run closes it.
#[test]
fn an_objective_with_room_leaves_the_gate_open() {
    for (slo_ms, expected) in [(60_000.0, 32.0), (0.001, 40.0)] {
        let spec = SessionSpec::inference("i").with_slo_ms(slo_ms).unwrap();
        let (server, metrics) = runs_beside_training(PolicyChoice::Priority, spec, 40);
        let (seen, text) = gate_count(&metrics, expected);
        assert_eq!(seen, Some(expected), "slo {slo_ms} ms: {text}");
        server.shutdown().unwrap();
    }
}
