//! A training job of `bench colocate` on its own thread and connection: it
//! iterates with one Run in flight ahead (`submit_run` / `wait_run`),
//! recording when each step completed, and can be paused (its Run in
//! flight finished, nothing new sent) while inference is timed alone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use lanes_adaptor::SessionSpec;

use super::super::child::{connect, open};
use super::super::workload::Workload;
use super::{feeds_of, ms};

/// One training job's thread and what it shares with the bench.
pub(in crate::cli::bench) struct Trainer {
    stop: Arc<AtomicBool>,
    pause: Arc<AtomicBool>,
    /// Set by the thread while paused with nothing in flight.
    idle: Arc<AtomicBool>,
    done: Arc<Mutex<Vec<Instant>>>,
    thread: std::thread::JoinHandle<anyhow::Result<()>>,
    /// Its LoadGraph, milliseconds.
    pub(in crate::cli::bench) load_ms: f64,
}

impl Trainer {
    /// Connects, loads and warms up (three steps); returns once the job is
    /// iterating.
    pub(in crate::cli::bench) fn start(
        endpoint: String,
        w: Workload,
        index: usize,
    ) -> anyhow::Result<Trainer> {
        let stop = Arc::new(AtomicBool::new(false));
        let pause = Arc::new(AtomicBool::new(false));
        let idle = Arc::new(AtomicBool::new(false));
        let done = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<f64>>();
        let (s, p, i, d) = (
            Arc::clone(&stop),
            Arc::clone(&pause),
            Arc::clone(&idle),
            Arc::clone(&done),
        );
        let thread = std::thread::Builder::new()
            .name(format!("colocate-train-{index}"))
            .spawn(move || -> anyhow::Result<()> {
                let r = (|| {
                    let mut client = connect(
                        &endpoint,
                        &format!("colocate-train-{index}"),
                        Duration::from_secs(900),
                    )?;
                    let id = open(
                        &mut client,
                        SessionSpec::training(format!("train-{}-{index}", w.model)),
                    )?;
                    let t0 = Instant::now();
                    client.load_in(id, &w.graph, w.vars.clone())?;
                    let load_ms = ms(t0.elapsed());
                    let feeds = w.random_feeds(11 + index as u64)?;
                    let fetch = [w.fetch.as_str()];
                    for _ in 0..3 {
                        client.run_in(id, feeds_of(&feeds), &fetch)?;
                    }
                    Ok::<_, anyhow::Error>((client, id, load_ms, feeds, fetch))
                })();
                let (mut client, id, feeds, fetch) = match r {
                    Ok((client, id, load_ms, feeds, fetch)) => {
                        let _ = ready_tx.send(Ok(load_ms));
                        (client, id, feeds, fetch)
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow::anyhow!("{e:#}")));
                        return Err(e);
                    }
                };
                let record = || {
                    d.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(Instant::now())
                };
                let mut pending = None;
                while !s.load(Ordering::SeqCst) {
                    if p.load(Ordering::SeqCst) {
                        if let Some(h) = pending.take() {
                            client.wait_run(h)?;
                            record();
                        }
                        i.store(true, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    i.store(false, Ordering::SeqCst);
                    let next = client.submit_run_in(id, feeds_of(&feeds), &fetch)?;
                    if let Some(h) = pending.replace(next) {
                        client.wait_run(h)?;
                        record();
                    }
                }
                if let Some(h) = pending {
                    client.wait_run(h)?;
                }
                client.close_in(id)?;
                Ok(())
            })?;
        let load_ms = ready_rx
            .recv()
            .context("the training thread stopped before it was ready")??;
        Ok(Trainer {
            stop,
            pause,
            idle,
            done,
            thread,
            load_ms,
        })
    }

    /// Stops sending Runs and waits until the one in flight has finished.
    pub(in crate::cli::bench) fn pause(&self) {
        self.pause.store(true, Ordering::SeqCst);
        while !self.idle.load(Ordering::SeqCst) && !self.thread.is_finished() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Iterates again.
    pub(in crate::cli::bench) fn resume(&self) {
        self.idle.store(false, Ordering::SeqCst);
        self.pause.store(false, Ordering::SeqCst);
    }

    /// Completions at or after `from` and at or before `to`.
    pub(in crate::cli::bench) fn steps_between(&self, from: Instant, to: Instant) -> usize {
        self.done
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|t| **t >= from && **t <= to)
            .count()
    }

    /// Every completion so far, in order.
    pub(in crate::cli::bench) fn completions(&self) -> Vec<Instant> {
        self.done
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Median time between completions in `[from, to]`, milliseconds.
    pub(in crate::cli::bench) fn median_step_ms(&self, from: Instant, to: Instant) -> f64 {
        let done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        let mut gaps: Vec<f64> = done
            .windows(2)
            .filter(|w| w[0] >= from && w[1] <= to)
            .map(|w| ms(w[1] - w[0]))
            .collect();
        gaps.sort_by(f64::total_cmp);
        gaps.get(gaps.len() / 2).copied().unwrap_or(f64::NAN)
    }

    /// Whether the thread has ended (an error, or stopped).
    pub(in crate::cli::bench) fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Stops the job, closes its session and returns the thread's error,
    /// if it had one.
    pub(in crate::cli::bench) fn finish(self) -> anyhow::Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the training thread panicked"))?
    }
}
