//! One phase of `bench deploy` against one embedded service: `--clients`
//! threads, each with its own connection, load the models they own (each
//! kind's first model before the rest, so that the first load of an
//! architecture is cold and later ones find it in the load cache), then
//! send their share of the open-loop request sequence.
//!
//! **Hits and misses, exactly.** A session belongs to the connection that
//! opened it, so only its owner's Runs ever bring a model back, and the
//! service counts those returns per session (Status: `returns`, raised by
//! a Run that found the model evicted). A client knows a model's count
//! before each of its requests; the first Status after the reply (taken
//! when the client next needs that model, or at the end) says whether
//! that request brought it back. The Status is taken before the request's
//! scheduled time when the client has time to spare: it is not on the
//! request's clock unless the client is late anyway.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes_adaptor::wire::{Reply, Request, SessionId, SessionState};
use lanes_adaptor::{Client, ClientOptions, Graph, Limits, SessionSpec, Tensor, VarValues};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::plan::{Arrival, Plan};

/// What every client needs of a kind: its graph, the initial weights each
/// model perturbs with its own seed, the feeds and the fetch.
#[derive(Debug)]
pub struct KindModel {
    pub name: String,
    pub graph: Graph,
    pub vars: VarValues,
    pub feeds: BTreeMap<String, Tensor>,
    pub fetch: String,
}

/// Model `m`'s own weights: every f32 weight scaled by `1 + 0.01·u`, `u`
/// uniform in [-1, 1) from the model's seed (signs kept, so variances
/// stay positive); nothing is shared between models but the structure.
fn own_weights(base: &VarValues, seed: u64, m: usize) -> anyhow::Result<VarValues> {
    let mut rng = StdRng::seed_from_u64(seed ^ (m as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    base.iter()
        .map(|(n, t)| {
            let t = match t.f32s() {
                Ok(v) => Tensor::from_f32(
                    t.shape().clone(),
                    v.iter()
                        .map(|x| x * (1.0 + 0.01 * rng.gen_range(-1.0f32..1.0)))
                        .collect(),
                )?,
                Err(_) => t.clone(),
            };
            Ok((n.clone(), t))
        })
        .collect()
}

/// One model's load, from OpenSession to the end of its untimed first Run.
#[derive(Debug, Clone)]
pub struct LoadRecord {
    pub model: usize,
    /// The first model of its kind in the phase (loaded before the rest).
    pub first: bool,
    /// LoadGraph alone, milliseconds.
    pub load_ms: f64,
}

/// One timed or warm-up request.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub index: usize,
    pub model: usize,
    /// Scheduled send and reply, seconds from the phase's start.
    pub scheduled_s: f64,
    pub done_s: f64,
    /// From the scheduled send to the reply (open loop: a late send's wait
    /// counts).
    pub latency_ms: f64,
    /// How late the client sent it (behind its earlier requests or its
    /// Status calls), counted in `latency_ms`.
    pub late_ms: f64,
    /// Whether the Run found its model evicted (brought it back).
    pub miss: bool,
}

/// What one client hands back.
#[derive(Debug, Default)]
pub struct ClientOut {
    pub loads: Vec<LoadRecord>,
    pub requests: Vec<RequestRecord>,
    pub sessions: Vec<(SessionId, usize)>,
    /// Status round trips taken to classify requests, milliseconds.
    pub status_ms: Vec<f64>,
    /// Returns (Runs that found their model evicted) of this client's
    /// models before and after its requests, summed over each `serve`:
    /// their difference is the number of its requests that missed.
    pub returns_start: u64,
    pub returns_end: u64,
}

/// When the sequence starts and at what rate it is played.
#[derive(Debug, Clone, Copy)]
pub struct Start {
    pub at: Instant,
    pub rate: f64,
}

/// What a client is told once every client has loaded.
#[derive(Debug, Clone, Copy)]
enum Go {
    /// Another client failed: stop.
    Stop,
    /// Send the warm-up requests back to back (the baseline's capacity),
    /// then wait for [`Go::Play`] with the timed ones.
    Calibrate,
    /// Play the sequence (the warm-up too, unless calibrated).
    Play(Start),
}

/// Shared by a phase's clients and the thread that runs the phase.
pub struct Phase<'a> {
    pub endpoint: String,
    pub limits: Limits,
    pub plan: &'a Plan,
    pub kinds: &'a [KindModel],
    /// Models served in this phase (all, or the baseline's subset).
    pub models: &'a [usize],
    pub clients: usize,
    pub seed: u64,
    /// All clients past their first-of-kind loads.
    pub firsts: Barrier,
    /// All clients and the phase's thread past every load.
    pub loaded: Barrier,
    /// All clients and the phase's thread past a calibration.
    pub calibrated: Barrier,
    /// The warm-up is sent back to back to measure the capacity.
    pub calibrate: bool,
    /// Requests at the start of the sequence that are not timed.
    pub warmup: usize,
    pub failed: AtomicBool,
}

pub fn connect(endpoint: &str, limits: Limits, name: String) -> anyhow::Result<Client> {
    Client::connect_with(
        endpoint,
        ClientOptions {
            timeout: Duration::from_secs(900),
            limits,
            name,
            ..ClientOptions::default()
        },
    )
    .with_context(|| format!("connecting to {endpoint}"))
}

/// What a client that stopped because another failed says.
const STOPPED: &str = "stopped: another client failed";

/// Client `c` of `phase`: loads, then serves the arrivals it owns when
/// told to start (`None`: another client failed, stop).
fn run_client(phase: &Phase<'_>, c: usize, go: mpsc::Receiver<Go>) -> anyhow::Result<ClientOut> {
    let mut out = ClientOut::default();
    let mine: Vec<usize> = phase
        .models
        .iter()
        .copied()
        .filter(|&m| phase.plan.owner[m] == c)
        .collect();
    let firsts: Vec<usize> = (0..phase.kinds.len())
        .filter_map(|k| {
            phase
                .models
                .iter()
                .copied()
                .find(|&m| phase.plan.kind[m] == k)
        })
        .collect();
    let mut client = None;
    let mut ids = HashMap::new();
    // Every barrier is passed even after an error, so that no other
    // thread waits for this one for ever.
    let first_loads = (|| -> anyhow::Result<()> {
        let cl = client.insert(connect(
            &phase.endpoint,
            phase.limits,
            format!("lanes-bench-deploy-{c}"),
        )?);
        for &m in mine.iter().filter(|m| firsts.contains(m)) {
            ids.insert(m, load_one(cl, phase, m, true, &mut out)?);
        }
        Ok(())
    })();
    fail_on(phase, &first_loads);
    phase.firsts.wait();
    let rest = first_loads.and_then(|()| {
        let cl = client.as_mut().context("no connection")?;
        for &m in mine.iter().filter(|m| !firsts.contains(m)) {
            if phase.failed.load(Ordering::Relaxed) {
                bail!("{STOPPED}");
            }
            ids.insert(m, load_one(cl, phase, m, false, &mut out)?);
        }
        Ok(())
    });
    fail_on(phase, &rest);
    phase.loaded.wait();
    rest?;
    let client = client.as_mut().context("no connection")?;
    out.sessions = ids.iter().map(|(&m, &id)| (id, m)).collect();
    let serving: HashSet<usize> = phase.models.iter().copied().collect();
    let arrivals: Vec<Arrival> = phase
        .plan
        .arrivals
        .iter()
        .copied()
        .filter(|a| phase.plan.owner[a.model] == c && serving.contains(&a.model))
        .collect();
    let mut next = go.recv();
    if let Ok(Go::Calibrate) = next {
        let warm: Vec<Arrival> = arrivals
            .iter()
            .copied()
            .filter(|a| a.index < phase.warmup)
            .collect();
        let r = serve(client, phase, &ids, &warm, None, &mut out);
        fail_on(phase, &r);
        phase.calibrated.wait();
        r?;
        next = go.recv();
        if let Ok(Go::Play(start)) = next {
            let timed: Vec<Arrival> = arrivals
                .iter()
                .copied()
                .filter(|a| a.index >= phase.warmup)
                .collect();
            serve(client, phase, &ids, &timed, Some(start), &mut out)?;
            return Ok(out);
        }
    }
    match next {
        Ok(Go::Play(start)) => serve(client, phase, &ids, &arrivals, Some(start), &mut out)?,
        _ => bail!("{STOPPED}"),
    }
    Ok(out)
}

fn fail_on<T>(phase: &Phase<'_>, r: &anyhow::Result<T>) {
    if r.is_err() {
        phase.failed.store(true, Ordering::Relaxed);
    }
}

/// Opens model `m`'s session, loads it (timed) and runs it once untimed
/// (first iterations profile and record).
fn load_one(
    client: &mut Client,
    phase: &Phase<'_>,
    m: usize,
    first: bool,
    out: &mut ClientOut,
) -> anyhow::Result<SessionId> {
    let kind = &phase.kinds[phase.plan.kind[m]];
    let id = match client.request(&Request::OpenSession(SessionSpec::inference(format!(
        "deploy-{m}-{}",
        kind.name
    ))))? {
        Reply::SessionOpened { session } => session,
        other => bail!("unexpected reply to OpenSession: {other:?}"),
    };
    let vars = own_weights(&kind.vars, phase.seed, m)?;
    let t0 = Instant::now();
    client
        .load_in(id, &kind.graph, vars)
        .with_context(|| format!("loading model {m} ({})", kind.name))?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    client
        .run_in(id, feeds_of(kind), &[kind.fetch.as_str()])
        .with_context(|| format!("first Run of model {m} ({})", kind.name))?;
    out.loads.push(LoadRecord {
        model: m,
        first,
        load_ms,
    });
    Ok(id)
}

fn feeds_of(kind: &KindModel) -> Vec<(String, Tensor)> {
    kind.feeds
        .iter()
        .map(|(n, t)| (n.clone(), t.clone()))
        .collect()
}

/// A request whose reply came but whose hit or miss is not known yet.
struct Pending {
    record: usize,
    returns_before: u64,
}

/// Attempts at a Status that lists a model's session before a request of
/// it is left unclassified as an error (one Status normally does).
const SETTLE_TRIES: usize = 2000;

/// Per-session (state, returns) of this client's sessions.
fn counts(
    client: &mut Client,
    ids: &HashMap<usize, SessionId>,
    out: &mut ClientOut,
) -> anyhow::Result<HashMap<usize, (SessionState, u64)>> {
    let t0 = Instant::now();
    let st = client.status()?;
    out.status_ms.push(t0.elapsed().as_secs_f64() * 1e3);
    let model_of: HashMap<SessionId, usize> = ids.iter().map(|(&m, &id)| (id, m)).collect();
    Ok(st
        .sessions
        .iter()
        .filter_map(|s| Some((*model_of.get(&s.session)?, (s.state, s.returns))))
        .collect())
}

/// Classifies every pending request whose model is settled; `need`: keep
/// asking until this model's is (it is about to be requested again).
fn settle(
    client: &mut Client,
    ids: &HashMap<usize, SessionId>,
    pending: &mut HashMap<usize, Pending>,
    returns: &mut HashMap<usize, u64>,
    need: Option<usize>,
    out: &mut ClientOut,
) -> anyhow::Result<()> {
    for _ in 0..SETTLE_TRIES {
        let now = counts(client, ids, out)?;
        // A return is counted before its Run's reply, and only this
        // client runs its models: the count read after the reply is the
        // request's, whatever the session is doing now.
        pending.retain(|m, p| match now.get(m) {
            Some(&(_, r)) => {
                out.requests[p.record].miss = r > p.returns_before;
                returns.insert(*m, r);
                false
            }
            _ => true,
        });
        let waiting = match need {
            Some(m) => pending.contains_key(&m),
            None => !pending.is_empty(),
        };
        if !waiting {
            return Ok(());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    bail!("a model's session was missing from every Status after its reply")
}

/// Sends `arrivals` (this client's) one at a time: at their scheduled
/// times from `start`, or back to back (`None`: a request's latency is
/// then from its send).
fn serve(
    client: &mut Client,
    phase: &Phase<'_>,
    ids: &HashMap<usize, SessionId>,
    arrivals: &[Arrival],
    start: Option<Start>,
    out: &mut ClientOut,
) -> anyhow::Result<()> {
    let mut returns: HashMap<usize, u64> = counts(client, ids, out)?
        .into_iter()
        .map(|(m, (_, r))| (m, r))
        .collect();
    out.returns_start += returns.values().sum::<u64>();
    let mut pending: HashMap<usize, Pending> = HashMap::new();
    let t0 = Instant::now();
    let origin = start.map_or(t0, |s| s.at);
    for &a in arrivals {
        let kind = &phase.kinds[phase.plan.kind[a.model]];
        let id = *ids
            .get(&a.model)
            .context("a model this client does not own")?;
        if pending.contains_key(&a.model) {
            settle(client, ids, &mut pending, &mut returns, Some(a.model), out)?;
        }
        let returns_before = *returns.get(&a.model).context("no count for a model")?;
        let feeds = feeds_of(kind);
        let scheduled = match start {
            Some(s) => s.at + Duration::from_secs_f64(a.unit_time / s.rate),
            None => Instant::now(),
        };
        if let Some(wait) = scheduled.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let sent = Instant::now();
        client
            .run_in(id, feeds, &[kind.fetch.as_str()])
            .with_context(|| format!("request {} to model {} ({})", a.index, a.model, kind.name))?;
        let done = Instant::now();
        pending.insert(
            a.model,
            Pending {
                record: out.requests.len(),
                returns_before,
            },
        );
        out.requests.push(RequestRecord {
            index: a.index,
            model: a.model,
            scheduled_s: scheduled.saturating_duration_since(origin).as_secs_f64(),
            done_s: done.saturating_duration_since(origin).as_secs_f64(),
            latency_ms: done.saturating_duration_since(scheduled).as_secs_f64() * 1e3,
            late_ms: sent.saturating_duration_since(scheduled).as_secs_f64() * 1e3,
            miss: false,
        });
    }
    settle(client, ids, &mut pending, &mut returns, None, out)?;
    out.returns_end += returns.values().sum::<u64>();
    Ok(())
}

/// A phase's outcome: each client's records, how long the loads took,
/// the capacity the calibration measured and what `after` said.
pub struct PhaseOut {
    pub clients: Vec<ClientOut>,
    pub load_wall: Duration,
    /// Warm-up requests per second sent back to back (calibrated phases).
    pub capacity: Option<f64>,
    pub rate: f64,
    pub after: serde_json::Value,
}

/// Runs a whole phase: spawns the clients and waits for their loads
/// (then calls `loaded` with how long they took); in a calibrated phase
/// lets them send the warm-up back to back; starts the sequence at the
/// rate `rate` gives for the capacity measured (if any) and collects what
/// the clients measured. `after` runs with a connection of the phase's
/// own once every client is done, before any disconnects.
pub fn run_phase<L, R, A>(
    phase: &Phase<'_>,
    loaded: L,
    rate: R,
    after: A,
) -> anyhow::Result<PhaseOut>
where
    L: FnOnce(Duration),
    R: FnOnce(Option<f64>) -> anyhow::Result<f64>,
    A: FnOnce(&mut Client, &[ClientOut]) -> anyhow::Result<serde_json::Value>,
{
    let mut own = connect(&phase.endpoint, phase.limits, "lanes-bench-deploy".into())?;
    std::thread::scope(|scope| {
        let t_load = Instant::now();
        let mut txs = Vec::with_capacity(phase.clients);
        let mut handles = Vec::with_capacity(phase.clients);
        for c in 0..phase.clients {
            let (tx, rx) = mpsc::channel();
            txs.push(tx);
            handles.push(scope.spawn(move || run_client(phase, c, rx)));
        }
        // A client that already stopped has dropped its receiver.
        let tell = |go: Go| {
            for tx in &txs {
                let _ = tx.send(go);
            }
        };
        phase.loaded.wait();
        let load_wall = t_load.elapsed();
        let mut capacity = None;
        let mut played = Err(anyhow::anyhow!("a client failed while loading"));
        if !phase.failed.load(Ordering::Relaxed) {
            loaded(load_wall);
            if phase.calibrate {
                let t0 = Instant::now();
                tell(Go::Calibrate);
                phase.calibrated.wait();
                let n = phase
                    .plan
                    .arrivals
                    .iter()
                    .filter(|a| a.index < phase.warmup && phase.models.contains(&a.model))
                    .count();
                capacity = Some(n as f64 / t0.elapsed().as_secs_f64().max(1e-9));
            }
            played = if phase.failed.load(Ordering::Relaxed) {
                Err(anyhow::anyhow!("a client failed while calibrating"))
            } else {
                rate(capacity)
            };
        }
        match &played {
            Ok(rate) => {
                let rate = *rate;
                // After a calibration the timed part starts at once (its
                // first arrival's time from the sequence's start dropped).
                let skip = match phase.plan.arrivals.get(phase.warmup) {
                    Some(a) if phase.calibrate => Duration::from_secs_f64(a.unit_time / rate),
                    _ => Duration::ZERO,
                };
                let soon = Instant::now() + Duration::from_millis(100);
                tell(Go::Play(Start {
                    at: soon.checked_sub(skip).unwrap_or(soon),
                    rate,
                }))
            }
            Err(_) => tell(Go::Stop),
        }
        let mut outs = Vec::with_capacity(phase.clients);
        // The cause first: a client's own error before another's "stopped".
        let mut errors = Vec::new();
        for (c, h) in handles.into_iter().enumerate() {
            match h.join() {
                Ok(Ok(o)) => outs.push(o),
                Ok(Err(e)) => errors.push(e.context(format!("client {c}"))),
                Err(_) => errors.push(anyhow::anyhow!("client {c} panicked")),
            }
        }
        errors.sort_by_key(|e| format!("{e:#}").contains(STOPPED));
        if let Some(e) = errors.into_iter().next() {
            return Err(e);
        }
        let rate = played?;
        let after = after(&mut own, &outs)?;
        Ok(PhaseOut {
            clients: outs,
            load_wall,
            capacity,
            rate,
            after,
        })
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn each_model_has_its_own_weights_of_the_same_signs() {
        let mut base = VarValues::new();
        base.insert(
            "w".into(),
            Tensor::from_f32(
                lanes_adaptor::Shape::new(vec![4]),
                vec![1.0, -2.0, 3.0, 0.5],
            )
            .unwrap(),
        );
        let a = own_weights(&base, 1, 0).unwrap();
        let b = own_weights(&base, 1, 1).unwrap();
        let a2 = own_weights(&base, 1, 0).unwrap();
        assert_eq!(a, a2);
        assert_ne!(a, b);
        let (va, vb) = (a["w"].f32s().unwrap(), b["w"].f32s().unwrap());
        for (i, x) in [1.0f32, -2.0, 3.0, 0.5].iter().enumerate() {
            assert_eq!(va[i].signum(), x.signum());
            assert!((va[i] / x - 1.0).abs() <= 0.01 && (vb[i] / x - 1.0).abs() <= 0.01);
        }
    }
}
