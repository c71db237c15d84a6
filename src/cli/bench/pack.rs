//! `lanes bench pack`: inference packing with more models than fit. An
//! embedded service gets `--memory` for `--fit` copies of the model (sum P +
//! max T of that many, as its lanes count them) and `--models` sessions of it
//! (each with its own weights); requests go to models chosen at random, one
//! at a time, through real sockets. Reports latency p50/p99 over all
//! requests, over requests whose model was resident and over those whose
//! model had been evicted, and how often a request hit an evicted model.
//!
//! `--precision bf16` (or `fp16`) serves every model with half weights
//! (`lanes_adaptor::amp`) in the same memory, still sized for `--fit` fp32
//! copies: the report gives each model's P at that precision, how many fit
//! (`fits`, from `sum P + max T <= C`) and the most the service held
//! resident at once (`max_resident`), about twice the fp32 numbers.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes::server::{self, DeviceChoice, ServerConfig};
use lanes_adaptor::wire::{Reply, Request};
use lanes_adaptor::{Client, ClientOptions, Limits, SessionSpec, Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::paths::{self, progress};
use super::workload;

#[derive(Debug, clap::Args)]
pub struct PackArgs {
    /// Model of every session (see `bench infer --help` for the names).
    #[arg(long, default_value = "resnet50")]
    model: String,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// `auto` (the GPU when one is usable, else the CPU), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Sessions (models) registered.
    #[arg(long, default_value_t = 6)]
    models: usize,
    /// How many of them the memory holds at once in fp32 (the memory is
    /// sized for this many fp32 copies, whatever `--precision`).
    #[arg(long, default_value_t = 2)]
    fit: usize,
    /// fp32 | bf16 | fp16 (weights stored in half) | bf16-mixed |
    /// fp16-mixed (f32 weights); docs/precision.md.
    #[arg(long, default_value = "fp32")]
    precision: lanes_adaptor::Precision,
    /// Timed requests (after one warm-up request per model).
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Carve the models' memory from one device reservation (as `lanes
    /// serve --reserve`).
    #[arg(long)]
    reserve: bool,
    /// Seed of the model choice.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn quantile(v: &[f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Some(s[((s.len() - 1) as f64 * q).round() as usize])
}

pub fn pack(a: PackArgs) -> anyhow::Result<()> {
    if a.models == 0 || a.fit == 0 || a.fit > a.models || a.requests == 0 {
        bail!("need --models ≥ --fit ≥ 1 and --requests ≥ 1");
    }
    workload::check_model(&a.model, a.seq)?;
    let device = server::resolve_device(paths::resolve(a.device)?.choice())?;
    let since = Instant::now();
    progress(&format!("building {} ×{}", a.model, a.models), since);
    let (w32, valid) = workload::validated_inference(&a.model, a.batch, a.seq)?;
    // What the lanes count for one fp32 model on this device (on the GPU:
    // the workspaces in T, whole granules); room for `fit` of them in one
    // lane, not for one more.
    let (p32, t32) = server::admission_sizes(&device, &valid, a.reserve)?;
    let memory = a.fit as u64 * p32 + t32 + p32 / 2;
    // The models served, at the precision asked for, in that memory.
    let (w, valid) = workload::validated(w32.at_precision(a.precision)?)?;
    let (p, t) = server::admission_sizes(&device, &valid, a.reserve)?;
    let fits = memory.saturating_sub(t) / p.max(1);
    let limits = Limits {
        max_nodes: 1 << 20,
        ..Limits::default()
    };
    let handle = server::start(ServerConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        workers: 1,
        device: device.clone(),
        limits,
        memory_bytes: Some(memory),
        reserve: a.reserve,
        ..ServerConfig::default()
    })
    .context("starting the embedded service")?;
    let mut client = Client::connect_with(
        handle.endpoint(),
        ClientOptions {
            timeout: Duration::from_secs(900),
            limits,
            name: "lanes-bench-pack".into(),
            ..ClientOptions::default()
        },
    )?;
    let feeds = w.random_feeds(7)?;
    let feeds_of =
        || -> Vec<(String, Tensor)> { feeds.iter().map(|(n, t)| (n.clone(), t.clone())).collect() };
    let fetch = [w.fetch.as_str()];
    let mut ids = Vec::with_capacity(a.models);
    for m in 0..a.models {
        let id = match client.request(&Request::OpenSession(SessionSpec::inference(format!(
            "pack-{m}"
        ))))? {
            Reply::SessionOpened { session } => session,
            other => bail!("unexpected reply {other:?}"),
        };
        // Each model its own weights: perturb the shared initial values.
        let vars = w
            .vars
            .iter()
            .map(|(n, t)| {
                let t = if t.dtype().is_float() {
                    let v: Vec<f32> = t
                        .to_f32_vec()?
                        .iter()
                        .map(|x| x * (1.0 + m as f32 * 1e-3))
                        .collect();
                    let data = TensorData::from_f32_rounded(t.dtype(), &v)
                        .context("a float dtype rounds")?;
                    Tensor::new(t.shape().clone(), data)?
                } else {
                    t.clone()
                };
                Ok((n.clone(), t))
            })
            .collect::<anyhow::Result<_>>()?;
        progress(&format!("loading model {m}"), since);
        client.load_in(id, &w.graph, vars)?;
        // One untimed request: first iterations profile and record.
        client.run_in(id, feeds_of(), &fetch)?;
        ids.push(id);
    }
    progress(
        &format!("{} requests across {} models", a.requests, a.models),
        since,
    );
    let mut rng = StdRng::seed_from_u64(a.seed);
    let (mut all, mut hits, mut misses) = (Vec::new(), Vec::new(), Vec::new());
    let mut max_resident = 0;
    let bar = crate::cli::bar(a.requests, "requests");
    for _ in 0..a.requests {
        let m = rng.gen_range(0..a.models);
        let st = client.status()?;
        max_resident = max_resident.max(st.sessions.iter().filter(|s| s.resident).count());
        let resident = st
            .sessions
            .iter()
            .find(|s| s.session == ids[m])
            .is_some_and(|s| s.resident);
        let t0 = Instant::now();
        client.run_in(ids[m], feeds_of(), &fetch)?;
        let dt = t0.elapsed().as_secs_f64() * 1e3;
        all.push(dt);
        if resident {
            hits.push(dt);
        } else {
            misses.push(dt);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let st = client.status()?;
    let evictions: u64 = st.sessions.iter().map(|s| s.evictions).sum();
    let json = serde_json::json!({
        "bench": "pack",
        "model": a.model,
        "batch": a.batch,
        "device": device,
        "models": a.models,
        "fit": a.fit,
        "oversubscription": a.models as f64 / a.fit as f64,
        "precision": a.precision.to_string(),
        "memory_bytes": memory,
        "persistent_bytes": p,
        "ephemeral_bytes": t,
        "fp32_persistent_bytes": p32,
        "fp32_ephemeral_bytes": t32,
        "fits": fits,
        "max_resident": max_resident,
        "requests": a.requests,
        "p50_ms": quantile(&all, 0.5),
        "p99_ms": quantile(&all, 0.99),
        "resident": {"count": hits.len(), "p50_ms": quantile(&hits, 0.5), "p99_ms": quantile(&hits, 0.99)},
        "evicted": {"count": misses.len(), "p50_ms": quantile(&misses, 0.5), "p99_ms": quantile(&misses, 0.99)},
        "miss_rate": misses.len() as f64 / a.requests as f64,
        "evictions": evictions,
        "reserve": a.reserve,
    });
    outln!("{json}")?;
    drop(client);
    handle.shutdown().context("stopping the embedded service")?;
    Ok(())
}
