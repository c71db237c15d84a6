//! `lanes bench lanes`: do lanes run in parallel, and what does sharing a
//! lane save? The same model runs as one job alone, then as two jobs (each
//! its own weights) placed in one lane (`max_lanes` 1: the jobs take turns
//! and, on the GPU, share the lane's ephemeral memory) and in two lanes
//! (`max_lanes` 2: each its own ephemeral memory, run at the same time).
//!
//! The jobs are the service's sessions (`lanes::session::Session`: memory
//! plan, admission into the lanes, the lane's turn around each iteration,
//! the executor), driven in-process so that the wire's host-side work does
//! not hide whether the lanes overlap (`lanes bench infer --path service`
//! measures that path). Each job's thread runs `--iters` iterations back to
//! back; throughput is iterations per second of wall time over all jobs. On
//! the GPU each case reports the device memory its programs hold: their own
//! blocks plus the lanes' shared blocks; with a reservation (on the CPU
//! always) its size and what the jobs use of it.

use std::time::Instant;

use anyhow::bail;
use lanes::exec::Backend;
use lanes::lanes::JobId;
use lanes::server;
use lanes::session::Session;
use lanes_adaptor::wire::{NamedTensor, SessionId};
use lanes_adaptor::{GraphLimits, SessionSpec, Tensor};

use super::paths::{progress, Device};
use super::workload::{self, Workload};

#[derive(Debug, clap::Args)]
pub struct LanesArgs {
    /// Model of every job (see `bench infer --help` for the names).
    #[arg(long, default_value = "resnet50")]
    model: String,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// `auto` (the GPU when one is usable, else the CPU), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value_t = lanes::server::DeviceChoice::Auto)]
    device: lanes::server::DeviceChoice,
    /// Timed iterations per job (after three untimed ones).
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// On the GPU, carve the jobs' memory from one device reservation taken
    /// per case (as `lanes serve --reserve`).
    #[arg(long)]
    reserve: bool,
}

/// One case: how many jobs, how many lanes they may use.
struct Case {
    name: &'static str,
    jobs: usize,
    max_lanes: usize,
}

const CASES: [Case; 3] = [
    Case {
        name: "one job",
        jobs: 1,
        max_lanes: 2,
    },
    Case {
        name: "two jobs, one lane",
        jobs: 2,
        max_lanes: 1,
    },
    Case {
        name: "two jobs, two lanes",
        jobs: 2,
        max_lanes: 2,
    },
];

/// The job's own weights: the shared initial values, scaled a little.
fn vars_of(w: &Workload, job: usize) -> anyhow::Result<Vec<NamedTensor>> {
    w.vars
        .iter()
        .map(|(n, t)| {
            let t = match t.f32s() {
                Ok(v) => Tensor::from_f32(
                    t.shape().clone(),
                    v.iter().map(|x| x * (1.0 + job as f32 * 1e-3)).collect(),
                )?,
                Err(_) => t.clone(),
            };
            Ok(NamedTensor::new(n.clone(), t))
        })
        .collect()
}

fn run_case(
    a: &LanesArgs,
    case: &Case,
    device: Device,
    w: &Workload,
    memory: u64,
    since: Instant,
) -> anyhow::Result<serde_json::Value> {
    let backend = match device {
        Device::Cuda => Backend::Cuda,
        Device::Cpu => Backend::Cpu,
    };
    // As `lanes serve --memory --max-lanes N` (on the GPU: the device
    // reservation, held for the case).
    let (lanes, reservation) = server::lanes_for(memory, case.max_lanes, backend, a.reserve)?;
    let limits = GraphLimits {
        max_nodes: 1 << 20,
        ..GraphLimits::default()
    };
    let feeds: Vec<NamedTensor> = w
        .random_feeds(7)?
        .into_iter()
        .map(|(n, t)| NamedTensor::new(n, t))
        .collect();
    let fetch = [w.fetch.clone()];
    let mut sessions = Vec::with_capacity(case.jobs);
    for job in 0..case.jobs {
        let mut s = Session::new(
            SessionId(job as u64 + 1),
            SessionSpec::inference(format!("lanes-{job}")),
        )
        .with_backend(backend)
        .with_lanes(Some(lanes.clone()));
        progress(&format!("{}: loading job {job}", case.name), since);
        s.load(w.graph.clone(), vars_of(w, job)?, &limits)?;
        if !s.is_admitted() {
            bail!(
                "job {job} was not admitted: {}",
                s.waiting().unwrap_or_default()
            );
        }
        for _ in 0..3 {
            s.run(feeds.clone(), &fetch)?;
        }
        sessions.push(s);
    }
    let placed: Vec<Option<u32>> = sessions
        .iter()
        .map(|s| lanes.placement(JobId(s.id().0)).map(|p| p.lane.0))
        .collect();
    // Device memory: each program's own blocks and the lanes' shared ones.
    let own: Option<u64> = sessions.iter().map(Session::own_device_bytes).sum();
    let shared = match device {
        Device::Cuda => Some(lanes::exec::cuda::lane_block_bytes()),
        Device::Cpu => None,
    };
    progress(
        &format!("{}: {} iterations per job", case.name, a.iters),
        since,
    );
    let bar = crate::cli::bar(
        a.iters * sessions.len(),
        &format!("{} iterations", case.name),
    );
    let t0 = Instant::now();
    let per_job: Vec<f64> = std::thread::scope(|scope| {
        let threads: Vec<_> = sessions
            .iter_mut()
            .map(|s| {
                let (feeds, fetch, bar) = (&feeds, &fetch, &bar);
                scope.spawn(move || -> anyhow::Result<f64> {
                    let t = Instant::now();
                    for _ in 0..a.iters {
                        s.run(feeds.clone(), fetch)?;
                        bar.inc(1);
                    }
                    Ok(t.elapsed().as_secs_f64())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| match t.join() {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("a job's thread panicked")),
            })
            .collect::<anyhow::Result<Vec<f64>>>()
    })?;
    let wall = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    // The reservation and what the lanes use of it: on the GPU the chunks
    // mapped (with `--reserve`), on the CPU (always a reservation, every
    // job's variables and its lane's arena in it) `sum P + max T` per lane.
    let snapshot = lanes.snapshot();
    let reserved = match (&reservation, device) {
        (Some(r), _) => Some((r.size(), r.size() - r.free_bytes())),
        (None, Device::Cpu) => Some((
            snapshot.capacity,
            snapshot.lanes.iter().map(|l| l.used).sum(),
        )),
        (None, Device::Cuda) => None,
    };
    let lanes_text = snapshot.to_string();
    drop(sessions);
    drop(reservation);
    let iterations = (a.iters * case.jobs) as f64;
    Ok(serde_json::json!({
        "case": case.name,
        "jobs": case.jobs,
        "max_lanes": case.max_lanes,
        "lanes_of_jobs": placed,
        "wall_s": wall,
        "per_job_s": per_job,
        "iterations_per_s": iterations / wall,
        "wall_ms_per_iteration": wall * 1e3 / iterations,
        "reservation": reserved.map(|(size, in_use)| serde_json::json!({
            "bytes": size,
            "in_use": in_use,
        })),
        "device_bytes": {
            "programs_own": own,
            "lanes_shared": shared,
            "total": own.zip(shared).map(|(o, s)| o + s),
        },
        "lanes": lanes_text,
    }))
}

pub fn lanes(a: LanesArgs) -> anyhow::Result<()> {
    if a.iters == 0 {
        bail!("need --iters ≥ 1");
    }
    super::workload::check_model(&a.model, a.seq)?;
    let dev = super::paths::resolve(a.device)?;
    let since = Instant::now();
    progress(&format!("building {}", a.model), since);
    let (w, valid) = workload::validated_inference(&a.model, a.batch, a.seq)?;
    let device = dev.name();
    let (p, t) = server::admission_sizes(device, &valid, a.reserve)?;
    // Room for two jobs in two lanes (2 (P + T)), with slack.
    let memory = 2 * (p + t) + (p + t) / 2;
    let mut cases = Vec::with_capacity(CASES.len());
    for case in &CASES {
        cases.push(run_case(&a, case, dev, &w, memory, since)?);
    }
    let rate = |k: usize| cases[k]["iterations_per_s"].as_f64().unwrap_or(0.0);
    let json = serde_json::json!({
        "bench": "lanes",
        "model": a.model,
        "batch": a.batch,
        "device": dev.name(),
        "iters": a.iters,
        "persistent_bytes": p,
        "ephemeral_bytes": t,
        "memory_bytes": memory,
        "cases": cases,
        "two_lanes_over_one_job": rate(2) / rate(0).max(f64::MIN_POSITIVE),
        "one_lane_over_one_job": rate(1) / rate(0).max(f64::MIN_POSITIVE),
    });
    outln!("{json}")?;
    Ok(())
}
