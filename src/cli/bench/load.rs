//! `lanes bench load`: where a LoadGraph's time goes, cold and warm. The
//! model's LoadGraph request is encoded once as a client sends it; each
//! load decodes it (`wire::decode_request`, as the service's socket thread
//! or decoder does) and loads it into a fresh session (`Session::load`,
//! the very code a service worker runs, without lanes: admission takes no
//! time here). Uncached loads run with the load cache off (what every
//! load did before it: validation and two plans, the service's and the
//! executor's); cold loads empty it first; warm loads follow a load of
//! the same architecture. Prints per-phase medians as JSON, and
//! for scale the time of one host copy of the weights.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes::compile::cache;
use lanes::server::{self, DeviceChoice};
use lanes::session::{LoadTimes, Session};
use lanes_adaptor::wire::{self, NamedTensor, Request, SessionId};
use lanes_adaptor::{Limits, SessionSpec};

use super::paths::{self, progress};
use super::workload;

#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Model loaded (see `bench infer --help` for the names).
    #[arg(long, default_value = "resnet152")]
    model: String,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Sequence length for BERT and the small transformer.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// `auto` (the GPU when one is usable, else the CPU), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Loads of each kind (cold, warm).
    #[arg(long, default_value_t = 5)]
    loads: usize,
}

/// One load's phases, the decode first.
struct Timed {
    decode: Duration,
    times: LoadTimes,
    total: Duration,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Per-phase medians of `loads`, in milliseconds, and how many hit.
fn summary(loads: &[Timed]) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    m.insert(
        "decode_ms".into(),
        median(loads.iter().map(|l| ms(l.decode)).collect()).into(),
    );
    for (i, phase) in LoadTimes::PHASES.iter().enumerate() {
        let v = loads.iter().map(|l| ms(l.times.phases()[i].1)).collect();
        m.insert(format!("{phase}_ms"), median(v).into());
    }
    let part = |f: fn(&Timed) -> Duration| median(loads.iter().map(|l| ms(f(l))).collect());
    m.insert(
        "warm_parts_ms".into(),
        serde_json::json!({
            "runs": part(|l| l.times.standby.runs),
            "host_image": part(|l| l.times.standby.host_image),
            "segments": part(|l| l.times.standby.segments),
            "link_measured": loads.iter().filter(|l| l.times.standby.link_measured).count(),
        }),
    );
    m.insert(
        "total_ms".into(),
        median(loads.iter().map(|l| ms(l.total)).collect()).into(),
    );
    m.insert(
        "cache_hits".into(),
        loads.iter().filter(|l| l.times.cached).count().into(),
    );
    serde_json::Value::Object(m)
}

pub fn load(a: LoadArgs) -> anyhow::Result<()> {
    if a.loads == 0 {
        bail!("--loads must be at least 1");
    }
    workload::check_model(&a.model, a.seq)?;
    let device = server::resolve_device(paths::resolve(a.device)?.choice())?;
    let backend = server::backend_of(&device);
    let since = Instant::now();
    progress(&format!("building {}", a.model), since);
    let w = workload::inference(&a.model, a.batch, a.seq)?;
    let limits = Limits {
        max_nodes: 1 << 20,
        ..Limits::default()
    };
    let weights: u64 = w.vars.values().map(|t| t.ty().bytes() as u64).sum();
    let request = Request::LoadGraph {
        session: SessionId(1),
        graph: w.graph.clone(),
        variables: w
            .vars
            .iter()
            .map(|(n, t)| NamedTensor::new(n.clone(), t.clone()))
            .collect(),
    };
    let frames = wire::encode_request(1, &request).context("encoding the LoadGraph")?;
    drop(request);
    // For scale: one host copy of the weights.
    let t0 = Instant::now();
    let copied: Vec<_> = w.vars.values().cloned().collect();
    let copy = t0.elapsed();
    drop(copied);
    let run = |cold: bool, n: usize| -> anyhow::Result<Timed> {
        if cold {
            cache::clear();
        }
        let t0 = Instant::now();
        let env = wire::decode_request(&frames, &limits).context("decoding the LoadGraph")?;
        let decode = t0.elapsed();
        let Request::LoadGraph {
            graph, variables, ..
        } = env.message
        else {
            bail!("the request decoded as another kind");
        };
        let mut s = Session::new(
            SessionId(n as u64),
            SessionSpec::inference(format!("bench-load-{n}")),
        )
        .with_backend(backend);
        s.load(graph, variables, &limits.graph_limits())
            .context("loading")?;
        let total = t0.elapsed();
        let times = s.load_times().context("no load times")?;
        drop(s);
        Ok(Timed {
            decode,
            times,
            total,
        })
    };
    let mut uncached = Vec::with_capacity(a.loads);
    cache::configure(0);
    for i in 0..a.loads {
        progress(&format!("uncached load {}", i + 1), since);
        uncached.push(run(true, i));
    }
    cache::configure(cache::DEFAULT_CACHE_BYTES);
    let uncached = uncached.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let mut cold = Vec::with_capacity(a.loads);
    let mut warm = Vec::with_capacity(a.loads);
    for i in 0..a.loads {
        progress(&format!("cold load {}", i + 1), since);
        cold.push(run(true, 2 * i)?);
        progress(&format!("warm load {}", i + 1), since);
        warm.push(run(false, 2 * i + 1)?);
    }
    let json = serde_json::json!({
        "bench": "load",
        "model": a.model,
        "batch": a.batch,
        "device": device,
        "loads": a.loads,
        "nodes": w.graph.nodes.len(),
        "weights_bytes": weights,
        "weights_copy_ms": ms(copy),
        "uncached": summary(&uncached),
        "cold": summary(&cold),
        "warm": summary(&warm),
        "host_images_kept_bytes": if matches!(backend, lanes::exec::Backend::Cuda) {
            Some(lanes::exec::cuda::kept_host_image_bytes())
        } else {
            None
        },
    });
    outln!("{json}")?;
    Ok(())
}
