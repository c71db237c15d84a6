//! PipeSwitch's own case through a real service: a training job runs
//! iterations back to back (Runs in flight ahead) in memory that holds it or
//! an inference model, not both; a Run for the evicted model arrives.
//!
//! - With `evict_training` (`lanes serve --evict-training`) the training job
//!   yields at its next iteration boundary: it is evicted (its state copied
//!   to host memory), the model comes back and answers (its output equal to
//!   its answer before), and training resumes while it still has Runs to
//!   go, its losses bit for bit those of a run never interrupted.
//! - By default (training never evicted) the Run waits until the training
//!   job leaves: today's behaviour, kept.
//!
//! No timing is asserted. CPU backend in CI; `LANES_TEST_DEVICE=cuda` runs
//! it on the GPU machine (the losses then compared within a tolerance).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use util::jobs::{self, open, Job};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanes_adaptor::{validate, Arch, Client, GraphLimits, SessionSpec, Tensor};

/// Training steps in all, and how many Runs the training job keeps in
/// flight (so it is never idle between them).
const STEPS: usize = 40;
const AHEAD: usize = 4;
/// Steps completed before the inference Run is sent.
const BEFORE: usize = 3;

fn client(endpoint: &str) -> Client {
    jobs::client(endpoint, "preempt-test", Duration::from_secs(300))
}

/// (P, T) of `job` as the lanes count them on the test's device.
fn sizes(job: &Job) -> (u64, u64) {
    let valid = validate(job.graph.clone(), &GraphLimits::default()).unwrap();
    lanes::server::admission_sizes(&util::device(), &valid, false).unwrap()
}

fn mlp() -> Arch {
    Arch::Mlp {
        inputs: 256,
        hidden: vec![1024, 1024],
        classes: 10,
    }
}

/// An MLP training step (SGD with momentum: state beside the weights).
fn training_job() -> Job {
    Job::training(&mlp(), 64)
}

fn inference_job() -> Job {
    Job::inference(&mlp(), 8)
}

/// The training job on its own connection: `STEPS` Runs, `AHEAD` in
/// flight; each step's loss and when its reply came.
type Trained = (Vec<f32>, Vec<Instant>);

fn train(endpoint: &str, done: Arc<Mutex<Vec<Instant>>>) -> std::thread::JoinHandle<Vec<f32>> {
    let endpoint = endpoint.to_string();
    std::thread::spawn(move || {
        let job = training_job();
        let mut c = client(&endpoint);
        let id = open(&mut c, SessionSpec::training("train"));
        c.load_in(id, &job.graph, job.vars.clone()).unwrap();
        let fetch = [job.fetch.as_str()];
        let mut pending = VecDeque::new();
        let mut losses = Vec::with_capacity(STEPS);
        for _ in 0..AHEAD {
            pending.push_back(c.submit_run_in(id, job.feeds(), &fetch).unwrap());
        }
        let mut sent = AHEAD;
        while let Some(h) = pending.pop_front() {
            let out = c.wait_run(h).unwrap();
            done.lock().unwrap().push(Instant::now());
            losses.push(out[0].f32s().unwrap()[0]);
            if sent < STEPS {
                pending.push_back(c.submit_run_in(id, job.feeds(), &fetch).unwrap());
                sent += 1;
            }
        }
        c.close_in(id).unwrap();
        losses
    })
}

/// Training alone in a service with room for everything.
fn reference_losses() -> Vec<f32> {
    let server = util::start_with(|c| c.memory_bytes = Some(1 << 30));
    let losses = train(server.endpoint(), Arc::default()).join().unwrap();
    server.shutdown().unwrap();
    losses
}

/// A service whose memory holds the training job or the model, not both;
/// the model loaded and answered once, then evicted by the training job's
/// arrival; the model's Run sent once training has run `BEFORE` steps.
/// Returns the model's two answers, training's losses and completion
/// times, when the second answer came, and the sessions' status.
fn preempted(evict_training: bool) -> (Vec<u32>, Vec<u32>, Trained, Instant, String) {
    let (train_job, infer_job) = (training_job(), inference_job());
    let ((pt, tt), (pi, ti)) = (sizes(&train_job), sizes(&infer_job));
    let memory = (pt + tt).max(pi + ti) + pi.min(pt) / 2;
    assert!(
        pt + pi + tt.max(ti) > memory && pt + tt + pi + ti > memory,
        "training and the model must not fit together"
    );
    let server = util::start_with(|c| {
        c.memory_bytes = Some(memory);
        c.evict_training = evict_training;
    });
    let mut c = client(server.endpoint());
    let id = open(&mut c, SessionSpec::inference("model"));
    c.load_in(id, &infer_job.graph, infer_job.vars.clone())
        .unwrap();
    let fetch = [infer_job.fetch.as_str()];
    let bits = |out: Vec<Tensor>| -> Vec<u32> {
        out[0].f32s().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    let first = bits(c.run_in(id, infer_job.feeds(), &fetch).unwrap());

    let done = Arc::new(Mutex::new(Vec::new()));
    let trainer = train(server.endpoint(), Arc::clone(&done));
    let t0 = Instant::now();
    while done.lock().unwrap().len() < BEFORE {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "training made no progress"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let second = bits(c.run_in(id, infer_job.feeds(), &fetch).unwrap());
    let answered = Instant::now();
    let losses = trainer.join().unwrap();
    let status = format!("{:?}", client(server.endpoint()).status().unwrap());
    let times = done.lock().unwrap().clone();
    c.close_in(id).unwrap();
    server.shutdown().unwrap();
    (first, second, (losses, times), answered, status)
}

fn assert_same_losses(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    if std::env::var("LANES_TEST_DEVICE").as_deref() == Ok("cuda") {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "step {i}: {g} vs {w}"
            );
        }
    } else {
        // The CPU backend is deterministic: bit for bit.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got), bits(want), "losses {got:?} vs {want:?}");
    }
}

#[test]
fn training_yields_at_an_iteration_boundary_to_an_evicted_model() {
    let want = reference_losses();
    let (first, second, (losses, times), answered, status) = preempted(true);
    assert_eq!(first, second, "the model's answer after switching back in");
    // Answered while training still had Runs to go: it yielded at a
    // boundary, and came back for the rest.
    let after = times.iter().filter(|t| **t > answered).count();
    assert!(
        after >= 1,
        "the model answered only after training's {} steps: {status}",
        times.len()
    );
    assert_eq!(times.len(), STEPS);
    assert_same_losses(&losses, &want);
}

/// Without `evict_training` a busy training job keeps its memory: the
/// model's Run waits until training has left (as before).
#[test]
fn by_default_the_model_waits_for_the_training_job() {
    let want = reference_losses();
    let (first, second, (losses, times), answered, status) = preempted(false);
    assert_eq!(first, second);
    let after = times.iter().filter(|t| **t > answered).count();
    assert_eq!(after, 0, "training was preempted: {status}");
    assert_same_losses(&losses, &want);
}
