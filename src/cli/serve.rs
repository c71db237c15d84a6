//! `lanes serve`: run the execution service until SIGINT (Ctrl-C) or
//! SIGTERM.

use std::time::Duration;

use anyhow::Context;
use lanes::exec::gate::{GateConfig, GateMode};
use lanes::server::{self, ByteSize, DeviceArg, MemoryChoice, PolicyChoice, ServerConfig};
use lanes_adaptor::Limits;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// ZeroMQ endpoint to bind (`tcp://HOST:PORT`, `tcp://127.0.0.1:*` for a free port, `ipc://PATH`).
    #[arg(long, default_value = "tcp://127.0.0.1:5555")]
    pub endpoint: String,
    /// Where iterations run: `auto` (the first GPU, or the CPU when no GPU
    /// is usable), `cpu`, `cuda` (the first GPU) or `cuda:N` (GPU N; one
    /// service per GPU, see `lanes host` and docs/multi-gpu.md).
    #[arg(long, default_value = "auto", value_name = "DEVICE")]
    pub device: DeviceArg,
    /// Memory that lane admission shares among jobs: `auto` (a safe share
    /// of the device read at start-up: on the GPU 90% of its free memory
    /// less 1 GiB headroom, on the CPU half of the host's available memory),
    /// a size (512MiB, 8GiB; a bare K/M/G/T is binary too, 8G = 8GiB, while
    /// kB/MB/GB are powers of 1000), or `none`: no admission, every job is
    /// loaded and jobs together can run the device out of memory.
    #[arg(long, default_value = "auto")]
    pub memory: MemoryChoice,
    /// Most lanes open at once: each lane runs one
    /// iteration at a time and its jobs share one ephemeral arena; lanes run
    /// in parallel.
    #[arg(long, default_value_t = ServerConfig::default().max_lanes)]
    pub max_lanes: usize,
    /// On the GPU, take `--memory` (the size given or chosen by `auto`) at
    /// start-up as one device reservation (equal chunks) that every job's
    /// memory is carved from: the memory is the service's even if other
    /// processes allocate. The default; this flag only makes it explicit
    /// (and is refused with `--memory none`).
    #[arg(long, conflicts_with = "no_reserve")]
    pub reserve: bool,
    /// No device reservation: programs take their memory from the driver as
    /// admission allows. Switching a job back is then about 1 ms faster (no
    /// map call per 16 MiB chunk; see docs/memory.md), but other processes
    /// can take the memory the lanes count on.
    #[arg(long)]
    pub no_reserve: bool,
    /// Seconds of silence after which a session is reclaimed.
    #[arg(long, default_value_t = 300.0)]
    pub idle_timeout: f64,
    /// Busy polling: for this many milliseconds after a message, the socket
    /// thread, a worker that finished an item and a CUDA worker waiting for
    /// its iteration poll without sleeping (each takes a core meanwhile;
    /// saves tens of microseconds of wake-ups per request). 0, the default,
    /// is off; at most 1000.
    #[arg(long, default_value_t = 0.0, value_name = "MS")]
    pub busy_poll: f64,
    /// Convolutions in plain FP32: cuDNN may not use TF32 tensor cores
    /// (on by default, as PyTorch's `cudnn.allow_tf32`).
    #[arg(long)]
    pub no_tf32: bool,
    /// FP32 matrix products on TF32 tensor cores (cuBLAS), as PyTorch's
    /// `torch.set_float32_matmul_precision("high")`; off by default, as
    /// PyTorch's `matmul.allow_tf32`: products are then plain FP32.
    #[arg(long)]
    pub tf32_matmul: bool,
    /// Worker threads running iterations (default: one per core).
    #[arg(long)]
    pub workers: Option<usize>,
    /// The scheduling policy that picks whose Run request goes next (see docs/scheduling.md).
    #[arg(long, value_enum, default_value_t = PolicyChoice::Fifo)]
    pub policy: PolicyChoice,
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Most open sessions in all (the session table's capacity; more are
    /// refused with Overloaded).
    #[arg(long, default_value_t = server::DEFAULT_MAX_SESSIONS)]
    pub max_sessions: usize,
    /// Most open sessions of one peer across all its connections: one
    /// host's IP address for TCP (every client on loopback is one peer),
    /// one process for ipc:// (so one process opening many connections
    /// cannot take more than its share of --max-sessions).
    #[arg(long, default_value_t = server::DEFAULT_SESSIONS_PER_PEER)]
    pub max_sessions_per_peer: usize,
    /// Most open sessions of one client connection, if the deployment
    /// wants one (default: none; sessions with graphs are bounded by their
    /// memory and requests, empty ones by --max-unloaded-per-client).
    #[arg(long)]
    pub max_sessions_per_client: Option<usize>,
    /// Most sessions of one client connection with no graph loaded yet
    /// (empty sessions cost a table entry that nothing else bounds).
    #[arg(long, default_value_t = server::DEFAULT_UNLOADED_PER_CLIENT)]
    pub max_unloaded_per_client: usize,
    /// Most requests of one client connection queued or running at once
    /// (more are refused with Overloaded; bounds what a client can make
    /// the service hold, see docs/protocol.md).
    #[arg(long, default_value_t = server::DEFAULT_REQUESTS_PER_CLIENT)]
    pub max_requests_per_client: usize,
    /// Never evict idle jobs to host memory under memory pressure (by
    /// default idle inference jobs are evicted, least recently used first,
    /// and brought back pipelined by their next Run; nothing is evicted
    /// with `--memory none`).
    #[arg(long)]
    pub no_evict: bool,
    /// Training jobs may be evicted too (their state is copied out): idle
    /// ones under memory pressure, and a busy one at its next iteration
    /// boundary when an inference job waits for memory (it comes back once
    /// that job is idle; docs/switching.md, *Eviction*).
    #[arg(long)]
    pub evict_training: bool,
    /// Refuse the shared-memory segments that jobs on this host offer for
    /// their feeds (their Runs then carry the feeds over the socket).
    #[arg(long)]
    pub no_shared_memory: bool,
    /// Most address space the shared-memory segments of one client
    /// connection may take in the service, each mapping counted (the
    /// service maps a segment twice, read-only and for reply slots, so a
    /// segment of N bytes usually counts 2N); an offer beyond is refused
    /// with SharedMemory and the client sends its feeds over the socket.
    #[arg(long, default_value = "1TiB", value_name = "SIZE")]
    pub max_shared_per_client: ByteSize,
    /// Most address space the shared-memory segments of all clients
    /// together may take in the service (counted as for
    /// --max-shared-per-client): many clients cannot exhaust the
    /// service's address space (128 TiB on x86-64) either.
    #[arg(long, default_value = "16TiB", value_name = "SIZE")]
    pub max_shared: ByteSize,
    /// Bound of the load cache: validated graphs and memory plans kept by
    /// the graph's structure (not its weights), so that a model whose
    /// architecture the service has seen loads without them being made
    /// again (docs/memory.md); 0 turns it off.
    #[arg(long, default_value = "256MiB", value_name = "SIZE")]
    pub load_cache: ByteSize,
    /// Bind an endpoint other than loopback or `ipc://` without
    /// `--auth-key-file`, or an `--http` address other than loopback:
    /// anyone who reaches the address may open sessions and use the device
    /// (see the security section of docs/protocol.md, and docs/serving.md).
    #[arg(long)]
    pub allow_unauthenticated_remote: bool,
    /// Authenticate peers with the pre-shared key in this file (at least
    /// 16 bytes, surrounding whitespace trimmed; e.g. `head -c 32
    /// /dev/urandom | base64 > key`): a connection must prove it holds the
    /// key in ZeroMQ's handshake (a one-time token; hosts' clocks within
    /// 5 minutes) and again before any request. Clients read it from
    /// `LANES_AUTH_KEY_FILE`. Authenticates, does not encrypt.
    #[arg(long, value_name = "FILE")]
    pub auth_key_file: Option<std::path::PathBuf>,
    /// On the GPU, give every lane's streams CUDA's default priority
    /// instead of the one the policy ranks its job at (under `priority`:
    /// inference lanes before training lanes); for comparison.
    #[arg(long)]
    pub no_stream_priority: bool,
    /// Under `priority` on the GPU, no gate: training's iterations run as
    /// one graph beside inference's Runs, ordered by stream priorities
    /// alone (by default training runs in short segments that wait while
    /// an inference Run runs; docs/scheduling.md).
    #[arg(long)]
    pub no_gate: bool,
    /// What training may launch while an inference Run runs: `hold`
    /// (nothing) or `trickle` (one short segment at a time).
    #[arg(long, value_enum, default_value_t = GateMode::Hold)]
    pub gate_mode: GateMode,
    /// How long the gate stays closed after the last inference Run, in
    /// microseconds.
    #[arg(long, default_value_t = 100, value_name = "US")]
    pub gate_release_us: u64,
    /// The GPU time training's segments aim at, in microseconds: how long
    /// an inference Run may wait for one.
    #[arg(long, default_value_t = 300, value_name = "US",
          value_parser = clap::value_parser!(u64).range(10..=100_000))]
    pub gate_segment_us: u64,
    /// Once inference Runs have kept the gate closed this long without a
    /// break, training segments go through anyway at `--gate-min-share`
    /// of the time (training slowed, never starved), in milliseconds.
    #[arg(long, default_value_t = 50.0, value_name = "MS", value_parser = parse_gate_ms)]
    pub gate_starve_ms: f64,
    /// The share of the time training keeps while the gate stays closed
    /// past `--gate-starve-ms` (0: none; training may starve).
    #[arg(long, default_value_t = 0.1, value_name = "SHARE", value_parser = parse_share)]
    pub gate_min_share: f64,
    /// Under `--gate-mode trickle`, the most training segments let through
    /// beside each burst of inference Runs (from the first Run to the
    /// gate's opening again); 0: no limit.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub gate_trickle_segments: u32,
    /// The most training segments on the GPU at once, all training jobs
    /// together, while an inference job is loaded; 0: one per training
    /// job (an inference Run then finds up to one per training job
    /// running).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub gate_in_flight: u32,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g.
    /// 127.0.0.1:9400): request latency and queueing per session,
    /// iterations, errors by code, lanes, reservation, evictions,
    /// switch-in latency, open sessions (see docs/metrics.md).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// On SIGINT or SIGTERM the service accepts no new work (requests are
    /// answered ShuttingDown) and gives the requests already queued or
    /// running this many seconds to finish; those left are answered
    /// ShuttingDown, then it closes the sessions, removes an ipc:// socket
    /// file and exits 0. A second signal stops it at once (exit 1).
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub shutdown_grace: f64,
    #[command(flatten)]
    pub http: HttpArgs,
}

/// The Open Inference Protocol front end (docs/serving.md).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// Serve the KServe v2 Open Inference Protocol over HTTP at ADDR (e.g.
    /// 127.0.0.1:8000; port 0 picks a free one), with Triton's binary
    /// data, model repository, configuration and statistics extensions.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<String>,
    /// Serve the same protocol over gRPC at ADDR (e.g. 127.0.0.1:8001;
    /// port 0 picks a free one): the service inference.GRPCInferenceService
    /// (health, metadata, infer, statistics), sharing the models and
    /// limits with --http.
    #[arg(long, value_name = "ADDR")]
    pub grpc: Option<String>,
    /// Models to serve over --http and --grpc, in Triton's layout
    /// (DIR/NAME/VERSION/model.onnx, optional DIR/NAME/config.pbtxt),
    /// loaded at start (each an inference session of this service).
    #[arg(long, value_name = "DIR")]
    pub model_repository: Option<std::path::PathBuf>,
    /// Largest HTTP request body (JSON and binary tensor data) and largest
    /// gRPC request message; larger ones are answered 413
    /// (RESOURCE_EXHAUSTED over gRPC).
    #[arg(long, default_value = "64MiB", value_name = "SIZE")]
    pub http_max_body: ByteSize,
    /// Most inference and load requests served over HTTP and gRPC
    /// together at once; more are answered 503 (RESOURCE_EXHAUSTED) at
    /// once.
    #[arg(long, default_value_t = lanes::oip::DEFAULT_MAX_IN_FLIGHT, value_name = "N")]
    pub http_max_in_flight: usize,
    /// Serve Triton's system shared memory extension over --http and
    /// --grpc: clients on this host register POSIX shared memory objects
    /// (by name, in /dev/shm) and infer requests name them for inputs and
    /// outputs, so no tensor crosses a socket. Off by default: any caller
    /// of the ports can then have the server read and write any object in
    /// /dev/shm that this server's user can open (docs/serving.md).
    #[arg(long)]
    pub system_shared_memory: bool,
}

/// Bounds on what the service accepts from the network.
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// Largest part of a message (the header, or one tensor's values),
    /// however many frames carry it (every frame is at most 64 KiB).
    #[arg(long, default_value = "1GiB")]
    pub max_frame: ByteSize,
    /// Largest header (bincode decoding limit; holds the graph).
    #[arg(long, default_value = "64MiB")]
    pub max_header: ByteSize,
    /// Largest tensor sent in a message.
    #[arg(long, default_value = "1GiB")]
    pub max_tensor: ByteSize,
    /// Most parts in one message (the header and one per tensor).
    #[arg(long, default_value_t = 4096)]
    pub max_frames: usize,
    /// Most nodes in one graph.
    #[arg(long, default_value_t = 100_000)]
    pub max_nodes: usize,
    /// Largest doorbell a busy-polling client's Run may name (its header
    /// included; announced at Hello, a larger one is refused with
    /// SharedMemory): the most the service reads from a doorbell per
    /// ring. Clients use 4 KiB.
    #[arg(long, default_value = "64KiB")]
    pub max_doorbell: ByteSize,
}

impl LimitArgs {
    pub fn limits(&self) -> anyhow::Result<Limits> {
        let size = |b: ByteSize, what: &str| {
            usize::try_from(b.0).with_context(|| format!("{what} does not fit this machine"))
        };
        Ok(Limits {
            max_frame_bytes: size(self.max_frame, "--max-frame")?,
            max_header_bytes: size(self.max_header, "--max-header")?,
            max_tensor_bytes: size(self.max_tensor, "--max-tensor")?,
            max_frames: self.max_frames,
            max_nodes: self.max_nodes,
            max_doorbell_bytes: size(self.max_doorbell, "--max-doorbell")?,
        })
    }
}

/// Logs to stderr; `RUST_LOG` overrides `default` (e.g. `info`).
pub fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colours only on a terminal: a log file or pipe gets plain text.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

pub fn run(args: Args) -> anyhow::Result<()> {
    init_tracing("info");
    lanes_adaptor::check_endpoint(&args.endpoint)?;
    let auth_key = match &args.auth_key_file {
        Some(path) => Some(lanes_adaptor::AuthKey::from_file(path)?),
        None => None,
    };
    let auth_key_for_http = auth_key.clone();
    if !lanes_adaptor::client::is_local(&args.endpoint) && auth_key.is_none() {
        if !args.allow_unauthenticated_remote {
            anyhow::bail!(
                "{} is reachable from other hosts, and without --auth-key-file this service does not authenticate its peers: \
                 bind a loopback address (tcp://127.0.0.1:PORT) or ipc://PATH, give --auth-key-file, or pass \
                 --allow-unauthenticated-remote on a network you trust (docs/protocol.md, security)",
                args.endpoint
            );
        }
        tracing::warn!(endpoint = %args.endpoint, "serving peers on other hosts without authentication");
    }
    if args.max_sessions == 0 || args.max_sessions_per_peer == 0 {
        anyhow::bail!("--max-sessions and --max-sessions-per-peer must be at least 1");
    }
    if args.max_sessions_per_client == Some(0) || args.max_unloaded_per_client == 0 {
        anyhow::bail!("--max-sessions-per-client and --max-unloaded-per-client must be at least 1");
    }
    if args.max_requests_per_client == 0 {
        anyhow::bail!("--max-requests-per-client must be at least 1");
    }
    if !(args.idle_timeout.is_finite() && args.idle_timeout > 0.0) {
        anyhow::bail!("--idle-timeout must be a positive number of seconds");
    }
    if args.memory == MemoryChoice::Size(ByteSize(0)) {
        anyhow::bail!(
            "--memory 0 leaves the lanes no memory, and every LoadGraph would be refused: give a size (e.g. 8GiB), auto, or none (no admission)"
        );
    }
    if args.reserve && args.memory == MemoryChoice::Off {
        anyhow::bail!(
            "--reserve takes the lanes' memory at start-up: give --memory auto or a size, not none"
        );
    }
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        anyhow::bail!("--shutdown-grace must be a number of seconds, 0 or more");
    }
    let busy_poll = super::busy_poll_window(args.busy_poll)?;
    lanes::exec::cuda::set_conv_tf32(!args.no_tf32);
    lanes::exec::cuda::set_matmul_tf32(args.tf32_matmul);
    let device = server::resolve_device_arg(args.device)?;
    let memory_bytes = server::resolve_memory(args.memory, &device)?;
    let limits = args.limits.limits()?;
    let bell_header = lanes_adaptor::wire::shm::DOORBELL_HEADER;
    if limits.max_doorbell_bytes < bell_header
        || limits.max_doorbell_bytes > limits.max_header_bytes.saturating_add(bell_header)
    {
        anyhow::bail!(
            "--max-doorbell must be at least {bell_header} bytes and at most --max-header + {bell_header} (a doorbell holds one header frame)"
        );
    }
    if args.max_shared_per_client.0 > args.max_shared.0 {
        anyhow::bail!("--max-shared-per-client may not be more than --max-shared");
    }
    let device_name = device.clone();
    let config = ServerConfig {
        endpoint: args.endpoint.clone(),
        limits,
        workers: args.workers.unwrap_or(ServerConfig::default().workers),
        idle_timeout: Duration::from_secs_f64(args.idle_timeout),
        max_sessions: args.max_sessions,
        max_sessions_per_client: args.max_sessions_per_client,
        max_unloaded_per_client: args.max_unloaded_per_client,
        max_sessions_per_peer: args.max_sessions_per_peer,
        max_requests_per_client: args.max_requests_per_client,
        device,
        memory_bytes,
        max_lanes: args.max_lanes,
        // The reservation goes with admission: none without `--memory`.
        reserve: !args.no_reserve && args.memory != MemoryChoice::Off,
        policy: args.policy,
        evict_idle: !args.no_evict,
        evict_training: args.evict_training,
        feed_pool_bytes: server::DEFAULT_FEED_POOL_BYTES,
        shared_memory: !args.no_shared_memory,
        max_shared_per_client: args.max_shared_per_client.0,
        max_shared: args.max_shared.0,
        load_cache_bytes: args.load_cache.0,
        stream_priority: !args.no_stream_priority,
        gate: (!args.no_gate).then(|| GateConfig {
            mode: args.gate_mode,
            release: Duration::from_micros(args.gate_release_us),
            segment: Duration::from_micros(args.gate_segment_us),
            starve_after: Duration::from_secs_f64(args.gate_starve_ms / 1e3),
            min_share: args.gate_min_share,
            trickle_segments: args.gate_trickle_segments,
            max_in_flight: args.gate_in_flight,
        }),
        auth_key,
        metrics: args
            .metrics
            .as_ref()
            .map(|_| std::sync::Arc::new(server::metrics::Metrics::new())),
        busy_poll,
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
    };
    // The metrics endpoint first: a busy port is refused before the
    // service takes the device.
    let metrics_http = match (&args.metrics, &config.metrics) {
        (Some(addr), Some(m)) => Some(server::metrics::serve_http(addr, std::sync::Arc::clone(m))?),
        _ => None,
    };
    let handle = server::start(config).with_context(|| format!("starting on {}", args.endpoint))?;
    let oip = if args.http.http.is_some() || args.http.grpc.is_some() {
        if args.http.http_max_in_flight == 0 {
            anyhow::bail!("--http-max-in-flight must be at least 1");
        }
        for (flag, addr) in [("--http", &args.http.http), ("--grpc", &args.http.grpc)] {
            let Some(addr) = addr else { continue };
            let remote = std::net::ToSocketAddrs::to_socket_addrs(addr.as_str())
                .with_context(|| format!("{flag} {addr} is not an address (e.g. 127.0.0.1:8000)"))?
                .any(|a| !a.ip().is_loopback());
            if remote {
                if !args.allow_unauthenticated_remote {
                    anyhow::bail!(
                        "{flag} {addr} is reachable from other hosts, and the inference protocol's ports do not authenticate: \
                         bind a loopback address (127.0.0.1:PORT) behind a proxy that does, or pass \
                         --allow-unauthenticated-remote on a network you trust (docs/serving.md)"
                    );
                }
                tracing::warn!(addr = %addr, "serving the inference protocol ({flag}) to other hosts without authentication");
            }
        }
        let oip = lanes::oip::start(lanes::oip::OipConfig {
            http: args.http.http.clone(),
            grpc: args.http.grpc.clone(),
            endpoint: handle.endpoint().to_string(),
            auth_key: auth_key_for_http,
            repository: args.http.model_repository.clone(),
            max_body_bytes: usize::try_from(args.http.http_max_body.0)
                .context("--http-max-body does not fit this machine")?,
            max_in_flight: args.http.http_max_in_flight,
            run_timeout: Duration::from_secs(300),
            system_shared_memory: args.http.system_shared_memory,
            shm_limits: lanes::oip::ShmLimits::default(),
            stopping: Some(handle.stop_flag()),
        })
        .context("starting the inference protocol's front end")?;
        for (name, state, reason) in oip.models() {
            match reason {
                Some(r) => tracing::warn!(model = %name, state = %state, reason = %r, "model"),
                None => tracing::info!(model = %name, state = %state, "model"),
            }
        }
        Some(oip)
    } else {
        if args.http.system_shared_memory {
            anyhow::bail!(
                "--system-shared-memory is an extension of --http and --grpc: give one of them"
            );
        }
        if args.http.model_repository.is_some() {
            anyhow::bail!(
                "--model-repository serves models over --http or --grpc: give one of them"
            );
        }
        None
    };
    let stop = handle.stop_flag();
    ctrlc::set_handler(move || {
        if stop.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tracing::warn!("a second signal: stopping at once");
            std::process::exit(1);
        }
        tracing::info!("SIGINT or SIGTERM: stopping");
    })
    .context("installing the SIGINT and SIGTERM handler")?;
    let mut line = format!(
        "lanes serving on {} (device {}, policy {})",
        handle.endpoint(),
        device_name,
        args.policy
    );
    if let Some(h) = &metrics_http {
        line.push_str(&format!(", metrics at http://{}/metrics", h.addr()));
    }
    if let Some(a) = oip.as_ref().and_then(|o| o.http_addr()) {
        line.push_str(&format!(", inference protocol at http://{a}/v2"));
    }
    if let Some(a) = oip.as_ref().and_then(|o| o.grpc_addr()) {
        line.push_str(&format!(", gRPC inference protocol at {a}"));
    }
    outln!("{line}")?;
    handle.wait()?;
    drop(oip);
    Ok(())
}

/// `--gate-starve-ms`: finite, in [0, 60000].
fn parse_gate_ms(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if v.is_finite() && (0.0..=60_000.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s}: must be between 0 and 60000 milliseconds"))
    }
}

/// `--gate-min-share`: a fraction in [0, 1].
fn parse_share(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s}: must be between 0 and 1"))
    }
}
