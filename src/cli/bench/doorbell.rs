//! `lanes bench doorbell`: what a client abusing its doorbell costs a
//! bystander. A real `lanes serve` (a child process) serves a bystander
//! client's small Runs alone, then beside a raw peer ringing garbage in
//! its doorbell as fast as it can, then beside one naming a huge doorbell
//! (a sparse segment; its length word spanning it) rung every 0.2 s. One
//! JSON object on stdout: the bystander's Run latency in each phase, the
//! ringer's rings, the service's own counts of the rings it examined and
//! the bytes it copied (from its metrics endpoint), and its peak memory.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes_adaptor::wire::shm::{OwnedSegment, SEGMENT_HEADER};
use lanes_adaptor::wire::{self, NamedTensor, Reply, Request, SessionId, SharedAreas, SlotRange};
use lanes_adaptor::{Graph, GraphBuilder, SessionSpec, Tensor, TensorType, VarValues};
use serde_json::{json, Value};

use super::child::{self, ServeOpts, Service};
use super::paths::progress;

#[derive(Debug, clap::Args)]
pub struct DoorbellArgs {
    #[command(flatten)]
    pub serve: ServeOpts,
    /// Bystander Runs per phase.
    #[arg(long, default_value_t = 2000)]
    pub runs: usize,
    /// Rows of the bystander's input (x is rows × 256, w 256 × 256).
    #[arg(long, default_value_t = 32)]
    pub rows: usize,
    /// Bytes of the huge doorbell's segment (sparse: only the ringer's
    /// writes take memory).
    #[arg(long, default_value = "1GiB")]
    pub huge: lanes::server::ByteSize,
    /// Seconds between two rings of the huge doorbell.
    #[arg(long, default_value_t = 0.2)]
    pub huge_every: f64,
}

const WIDTH: usize = 256;
/// The garbage ringer's doorbell: 4 KiB at 1 MiB of a 4 MiB segment.
const BELL_AT: usize = 1 << 20;
const BELL_LEN: usize = 4096;

fn graph(rows: usize) -> anyhow::Result<(Graph, VarValues)> {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([rows, WIDTH]));
    let w = g.variable(
        "w",
        Tensor::from_f32([WIDTH, WIDTH], vec![0.01; WIDTH * WIDTH])?,
    );
    let h = g.matmul(x, w);
    let y = g.relu(h);
    g.set_name(y, "y");
    Ok(g.finish()?)
}

/// A DEALER that sends hand-made frames: the abusive peer.
struct Raw {
    socket: zmq::Socket,
    _ctx: zmq::Context,
    limits: lanes_adaptor::Limits,
}

impl Raw {
    fn connect(endpoint: &str) -> anyhow::Result<Raw> {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::DEALER)?;
        socket.set_rcvtimeo(30_000)?;
        socket.set_linger(0)?;
        // Sessions belong only to connections with an id of their own.
        socket.set_identity(&lanes_adaptor::wire::auth::connection_id())?;
        socket.connect(endpoint)?;
        Ok(Raw {
            socket,
            _ctx: ctx,
            limits: child::limits(),
        })
    }

    fn call(&self, frames: Vec<Vec<u8>>) -> anyhow::Result<Reply> {
        self.socket.send_multipart(frames, 0)?;
        let got = self
            .socket
            .recv_multipart(0)
            .context("no reply from the service")?;
        Ok(wire::decode_reply(&got, &self.limits)?.message)
    }

    fn request(&self, id: u64, req: &Request) -> anyhow::Result<Reply> {
        self.call(wire::encode_request(id, req)?)
    }
}

/// A raw peer with a loaded session and a segment (id 1) of `bytes`
/// attached; its Run (id 10) named the doorbell of `bell` bytes at
/// `at`, through the socket: the service's reply to it.
struct Ringer {
    seg: OwnedSegment,
    frame: Vec<u8>,
    reply: String,
    _raw: Raw,
}

impl Ringer {
    fn new(
        endpoint: &str,
        rows: usize,
        bytes: usize,
        at: usize,
        bell: usize,
    ) -> anyhow::Result<Self> {
        let raw = Raw::connect(endpoint)?;
        let desk = match raw.request(
            1,
            &Request::Hello {
                client: "ringer".into(),
            },
        )? {
            Reply::Hello { desk: Some(d), .. } => d,
            other => bail!("the service gives no desk: {other:?}"),
        };
        let session =
            match raw.request(2, &Request::OpenSession(SessionSpec::inference("ringer")))? {
                Reply::SessionOpened { session } => session,
                other => bail!("{other:?}"),
            };
        let (g, vars) = graph(rows)?;
        let load = Request::LoadGraph {
            session,
            graph: g,
            variables: vars
                .into_iter()
                .map(|(n, t)| NamedTensor::new(n, t))
                .collect(),
        };
        match raw.request(3, &load)? {
            Reply::GraphLoaded { .. } => {}
            other => bail!("{other:?}"),
        }
        let seg = OwnedSegment::create(1, bytes)?;
        seg.hand_over(&desk)?;
        let offer = Request::ShareMemory {
            session,
            offer: seg.offer(),
        };
        match raw.request(4, &offer)? {
            Reply::MemoryShared { .. } => {}
            other => bail!("{other:?}"),
        }
        let frame = Self::run(session, rows, 10, at, bell)?;
        let reply = match raw.call(vec![frame.clone()])? {
            Reply::RunDone { .. } => "RunDone".to_string(),
            Reply::Error(e) => format!("{:?}: {}", e.code, e.message),
            other => format!("{other:?}"),
        };
        Ok(Ringer {
            seg,
            frame,
            reply,
            _raw: raw,
        })
    }

    fn run(
        session: SessionId,
        rows: usize,
        id: u64,
        at: usize,
        bell: usize,
    ) -> anyhow::Result<Vec<u8>> {
        let ty = TensorType::f32([rows, WIDTH]);
        let areas = SharedAreas {
            reply: None,
            doorbell: Some(SlotRange {
                offset: at as u64,
                bytes: bell as u64,
            }),
        };
        let feeds = [("x", &ty, SEGMENT_HEADER as u64)];
        let mut frames = wire::encode_shared_run(id, session, feeds, 1, areas, &["y".to_string()])?;
        if frames.len() != 1 {
            bail!("a shared Run is one frame");
        }
        Ok(frames.remove(0))
    }
}

/// Latencies of `runs` bystander Runs, in ms: p50, p99, max.
fn bystander(
    client: &mut lanes_adaptor::Client,
    rows: usize,
    runs: usize,
) -> anyhow::Result<Value> {
    let mut session = client.open_session(SessionSpec::inference("bystander"))?;
    let (g, vars) = graph(rows)?;
    session.load(&g, vars)?;
    let x = Tensor::from_f32([rows, WIDTH], vec![0.5; rows * WIDTH])?;
    for _ in 0..runs / 10 {
        session.run(vec![("x", x.clone())], &["y"])?;
    }
    let mut ms = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        session.run(vec![("x", x.clone())], &["y"])?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    session.close()?;
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    Ok(json!({ "runs": runs, "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0) }))
}

/// The value of the metric line starting with `series` (0 if absent).
fn scrape(addr: &str, series: &str) -> anyhow::Result<u64> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64))
}

fn service_counts(addr: &str) -> anyhow::Result<Value> {
    Ok(json!({
        "garbage_rings": scrape(addr, "lanes_doorbell_rings_total{outcome=\"Garbage\"}")?,
        "taken_rings": scrape(addr, "lanes_doorbell_rings_total{outcome=\"Taken\"}")?,
        "copied_bytes": scrape(addr, "lanes_doorbell_copied_bytes_total")?,
        "doorbells_closed": scrape(addr, "lanes_doorbells_closed_total")?,
    }))
}

/// The child's resident memory now and at its peak, in MiB.
fn memory(pid: u32) -> Value {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |field: &str| {
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0.0, |k| k as f64 / 1024.0)
    };
    json!({ "rss_mib": kib("VmRSS:"), "peak_rss_mib": kib("VmHWM:") })
}

/// Runs `ring` on a thread until the bystander's phase is over; the rings
/// it made.
fn beside(
    client: &mut lanes_adaptor::Client,
    a: &DoorbellArgs,
    mut ringer: Ringer,
    mut ring: impl FnMut(&mut Ringer, u64) -> bool + Send + 'static,
) -> anyhow::Result<(Value, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let rings = Arc::new(AtomicU64::new(0));
    let (s, r) = (Arc::clone(&stop), Arc::clone(&rings));
    let t = std::thread::spawn(move || {
        let mut id = 100u64;
        while !s.load(Ordering::Relaxed) {
            id += 1;
            if ring(&mut ringer, id) {
                r.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    // Let the ringer get going first.
    std::thread::sleep(Duration::from_millis(200));
    let lat = bystander(client, a.rows, a.runs);
    stop.store(true, Ordering::Relaxed);
    if t.join().is_err() {
        bail!("the ringer panicked");
    }
    Ok((lat?, rings.load(Ordering::Relaxed)))
}

pub fn doorbell(a: DoorbellArgs) -> anyhow::Result<()> {
    let since = Instant::now();
    let metrics = child::free_endpoint()?.replace("tcp://", "");
    let mut serve = a.serve.clone();
    serve.args.push(format!("--metrics={metrics}"));
    let (service, endpoint) = Service::start(&serve, since)?;
    let mut client = child::connect(&endpoint, "bystander", Duration::from_secs(60))?;

    progress("bystander alone", since);
    let alone = bystander(&mut client, a.rows, a.runs)?;
    let alone_mem = memory(service.pid());

    progress("bystander beside a garbage ringer", since);
    let ringer = Ringer::new(&endpoint, a.rows, 4 << 20, BELL_AT, BELL_LEN)?;
    let garbage_reply = ringer.reply.clone();
    let (garbage, garbage_rings) = beside(&mut client, &a, ringer, |r, id| {
        // Junk, a Run's prefix under the word's id over junk, and a Run
        // under another id, in turn.
        let mut f = r.frame.clone();
        match id % 3 {
            0 => f.truncate(8),
            1 => {
                f.truncate(24);
                f.resize(BELL_LEN - 64, 0xAB);
                f[8..16].copy_from_slice(&id.to_le_bytes());
            }
            _ => {}
        }
        r.seg.ring(BELL_AT, BELL_LEN, id, &f)
    })?;
    let garbage_counts = service_counts(&metrics)?;

    progress("bystander beside a huge-doorbell ringer", since);
    let huge = usize::try_from(a.huge.0).context("--huge does not fit")?;
    let bell = huge - BELL_AT;
    let ringer = Ringer::new(&endpoint, a.rows, huge, BELL_AT, bell)?;
    let huge_reply = ringer.reply.clone();
    let every = Duration::from_secs_f64(a.huge_every);
    let mut body = ringer.frame.clone();
    body.resize(bell - 64, 0);
    let (huge_lat, huge_rings) = beside(&mut client, &a, ringer, move |r, id| {
        body[8..16].copy_from_slice(&id.to_le_bytes());
        let ok = r.seg.ring(BELL_AT, bell, id, &body);
        std::thread::sleep(every);
        ok
    })?;
    let huge_counts = service_counts(&metrics)?;

    progress("bystander alone again", since);
    let after = bystander(&mut client, a.rows, a.runs)?;
    let p50 = |v: &Value| v["p50_ms"].as_f64().unwrap_or(f64::NAN);
    let out = json!({
        "bench": "doorbell",
        "service_args": serve.args,
        "device": child::device_arg(a.serve.device),
        "bystander": { "rows": a.rows, "width": WIDTH },
        "alone": alone,
        "garbage": {
            "bystander": garbage,
            "ringer_rings": garbage_rings,
            "ringer_run_reply": garbage_reply,
            "service": garbage_counts,
            "p50_vs_alone": p50(&garbage) / p50(&alone),
        },
        "huge": {
            "segment_bytes": huge,
            "doorbell_bytes": bell,
            "every_s": a.huge_every,
            "bystander": huge_lat,
            "ringer_rings": huge_rings,
            "ringer_run_reply": huge_reply,
            "service": huge_counts,
            "p50_vs_alone": p50(&huge_lat) / p50(&alone),
        },
        "alone_after": after,
        "service_memory": { "after_alone": alone_mem, "end": memory(service.pid()) },
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
