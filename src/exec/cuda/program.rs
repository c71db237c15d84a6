//! [`CudaProgram`]: a validated graph laid out in one device arena, run one
//! iteration at a time on its own stream. Same contract as
//! [`crate::exec::cpu::CpuProgram`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cudnn::Cudnn;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream, PinnedHostSlice};
use lanes_adaptor::wire::shm::AttachedSegment;
use lanes_adaptor::{
    DType, NodeId, Op, Outlet, Tensor, TensorData, TensorType, ValidGraph, VarValues,
};

use super::bn::{plan_batch_norms, BnHandle, BnPlan};
use super::conv::ConvPlan;
use super::device::{gpu, Gpu};
use super::fuse::{find_chains, Fusion};
use super::pin::SegmentPins;
use super::vm::{granularity, VmArena};
use crate::compile::{self, MemoryPlan};
use crate::exec::{ExecError, HostFeed};
use crate::residency::{Costs, GroupPlan, Layout, PlanCache, Profile, Strategy, SwitchReport};

/// A program's arena in bytes (see [`CudaProgram::arena_parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaParts {
    pub persistent: usize,
    /// T of the memory plan the ephemeral tensors follow.
    pub ephemeral: usize,
    pub workspaces: usize,
    /// The planner's lower bound for T and T with every tensor in its own bytes.
    pub lower_bound: usize,
    pub no_reuse: usize,
}

/// Hands cuBLAS its workspace (in the arena), so that it never allocates
/// (also required for capturing its calls in a CUDA graph).
fn bind_cublas_workspace(blas: &CudaBlas, at: u64) -> Result<(), ExecError> {
    // SAFETY: the handle is live (owned by `blas`); `at` starts
    // CUBLAS_WORKSPACE bytes of the program's arena, whose address stays
    // reserved as long as the program (and so the handle) lives.
    unsafe {
        cudarc::cublas::sys::cublasSetWorkspace_v2(
            *blas.handle(),
            at as *mut std::ffi::c_void,
            CUBLAS_WORKSPACE,
        )
    }
    .result()
    .map_err(|e| dev_err("cuBLAS workspace", e))
}

/// Precision switches. The defaults equal PyTorch's: matrix products in plain
/// FP32 (`torch.backends.cuda.matmul.allow_tf32 = False`), convolutions may
/// use TF32 tensor cores (`torch.backends.cudnn.allow_tf32 = True`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Let cuDNN use TF32 tensor cores for FP32 convolutions. Default: on,
    /// unless [`set_conv_tf32`] turned it off.
    pub conv_tf32: bool,
    /// Let cuBLAS use TF32 tensor cores for FP32 matrix products.
    pub matmul_tf32: bool,
    /// Record the iteration's launches once as a CUDA graph and replay it
    /// (addresses never change, so the graph stays valid); falls back to
    /// launching op by op if capture fails.
    pub cuda_graph: bool,
    /// How urgent the program's work is to the GPU: its streams get the
    /// device's least priority raised by this many levels (clamped to the
    /// greatest), so that when lanes run at once the block scheduler
    /// starts an urgent lane's blocks before a less urgent lane's waiting
    /// ones. 0 (the default) is CUDA's default priority.
    pub urgency: u8,
    /// Run chains of per-channel elementwise ops after a convolution (its
    /// bias, inference batch norm, a residual Add, Relu) as one kernel
    /// (see `fuse.rs`). Default: on unless the environment variable
    /// `LANES_NO_FUSION` is `1`.
    pub fuse: bool,
    /// Batch norm with batch statistics (training), forward, through
    /// cuDNN's kernels, as PyTorch (see `bn.rs`; the gradient always runs on
    /// ours); our own kernels where cuDNN's definition differs. Default: on
    /// unless the environment variable `LANES_NO_CUDNN_BN` is `1`.
    pub cudnn_batch_norm: bool,
}

/// Process-wide default of [`CudaOptions::conv_tf32`] (`--no-tf32`).
static CONV_TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Process-wide: whether programs made from [`CudaOptions::default`] let
/// cuDNN use TF32 for FP32 convolutions (on by default, as PyTorch's
/// `cudnn.allow_tf32`; `lanes serve --no-tf32` turns it off, for results
/// that match an FP32 reference at FP32 tolerances).
pub fn set_conv_tf32(on: bool) {
    CONV_TF32.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Process-wide default of [`CudaOptions::matmul_tf32`] (`--tf32-matmul`).
static MATMUL_TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Process-wide: whether programs made from [`CudaOptions::default`] let
/// cuBLAS use TF32 tensor cores for FP32 matrix products (off by default,
/// as PyTorch's `torch.backends.cuda.matmul.allow_tf32`; `lanes serve
/// --tf32-matmul` turns it on, as `torch.set_float32_matmul_precision
/// ("high")` does).
pub fn set_matmul_tf32(on: bool) {
    MATMUL_TF32.store(on, std::sync::atomic::Ordering::Relaxed);
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            conv_tf32: CONV_TF32.load(std::sync::atomic::Ordering::Relaxed),
            matmul_tf32: MATMUL_TF32.load(std::sync::atomic::Ordering::Relaxed),
            cuda_graph: true,
            urgency: 0,
            fuse: std::env::var("LANES_NO_FUSION").as_deref() != Ok("1"),
            cudnn_batch_norm: std::env::var("LANES_NO_CUDNN_BN").as_deref() != Ok("1"),
        }
    }
}

/// A stream of `urgency` levels above the device's least priority.
fn stream_of(
    ctx: &Arc<cudarc::driver::CudaContext>,
    urgency: u8,
) -> Result<Arc<CudaStream>, ExecError> {
    if urgency == 0 {
        return ctx.new_stream().map_err(|e| dev_err("stream", e));
    }
    // (least, greatest); a greater priority is a smaller number.
    let (least, greatest) = cudarc::driver::result::stream::get_priority_range()
        .map_err(|e| dev_err("stream priority range", e))?;
    let priority = least.saturating_sub(i32::from(urgency)).max(greatest);
    ctx.new_stream_with_priority(priority)
        .map_err(|e| dev_err("stream", e))
}

/// Where one tensor lives in the arena.
#[derive(Debug, Clone)]
pub(super) struct Slot {
    /// Byte offset from the arena's base.
    pub off: usize,
    pub ty: TensorType,
}

/// Alignment of every tensor in the arena, in bytes.
const ALIGN: usize = 256;
/// cuBLAS workspace handed over at creation, so that it never allocates
/// (also required for capturing its calls in a CUDA graph).
const CUBLAS_WORKSPACE: usize = 32 << 20;
/// Largest element count a kernel indexes with 32-bit integers.
const MAX_ELEMS: usize = i32::MAX as usize;

/// A validated graph and its variables, resident on the GPU.
pub struct CudaProgram {
    pub(super) graph: ValidGraph,
    pub(super) gpu: Arc<Gpu>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: CudaBlas,
    pub(super) slots: Vec<Vec<Slot>>,
    pub(super) base: u64,
    pub(super) convs: HashMap<usize, ConvPlan>,
    /// Batch norms with batch statistics that cuDNN runs, and its handle
    /// for them (made only when there are any).
    pub(super) bns: HashMap<usize, BnPlan>,
    pub(super) bn_handle: Option<BnHandle>,
    pub(super) options: CudaOptions,
    /// Fused chains for the current arena layout (re-matched when a new
    /// fetch re-plans it).
    pub(super) fusion: Fusion,
    /// The recorded iteration (valid for the program's lifetime: the arena
    /// keeps its address across evictions, see `vm.rs`).
    captured: Option<CudaGraph>,
    /// Captures that failed; after [`CAPTURE_TRIES`] launch op by op.
    capture_failures: u32,
    /// Residency: persistent tensors sit at the arena's start in first-use
    /// order, so a group of units is one contiguous copy.
    res: Residency,
    // Kept for their lifetimes: every address above points into these
    // (the arena's memory is given up while the program is evicted; its
    // address stays).
    arena: VmArena,
    _cudnn: Arc<Cudnn>,
    /// Where the arena's parts are and which fetches the plan keeps.
    mem: ArenaLayout,
    /// The job's shared segments its feeds were copied from, registered
    /// page-locked.
    pins: SegmentPins,
    /// How long the last wait for the stream took (nanoseconds): the next
    /// wait polls without sleeping through about that long.
    last_wait_ns: std::sync::atomic::AtomicU64,
}

/// The arena, from its base: the persistent region (residency order), the
/// ephemeral region at the memory plan's offsets (T bytes: feeds,
/// activations, gradients, results), the cuDNN workspace, the cuBLAS
/// workspace. The ephemeral region and the workspaces are only used during
/// an iteration.
#[derive(Debug, Clone)]
struct ArenaLayout {
    /// Offset of the ephemeral region (the persistent bytes, aligned).
    ephemeral_at: usize,
    /// T of the plan the slots follow.
    ephemeral: usize,
    /// The planner's lower bound and no-reuse size for the same fetches.
    lower_bound: usize,
    no_reuse: usize,
    /// Offset and size of the cuDNN workspace (largest any convolution asked).
    cudnn_at: usize,
    cudnn_bytes: usize,
    /// Offset of the cuBLAS workspace ([`CUBLAS_WORKSPACE`] bytes).
    cublas_at: usize,
    /// Bytes the layout needs.
    bytes: usize,
    /// Outputs planned to live to the end of an iteration (a Run may fetch
    /// them); fetching another re-plans (see `CudaProgram::cover_fetches`).
    fetchable: HashSet<Outlet>,
}

impl ArenaLayout {
    /// Plans the ephemeral region for `fetchable` after `persistent` bytes
    /// and places the workspaces after it.
    fn new(
        graph: &ValidGraph,
        persistent: usize,
        cudnn_bytes: usize,
        fetchable: HashSet<Outlet>,
        granularity: usize,
    ) -> Result<(Self, MemoryPlan), ExecError> {
        let plan = compile::cache::plan_outlets(graph, fetchable, compile::PlanOptions::default())
            .map_err(|e| ExecError::Op {
                node: String::new(),
                op: "memory plan",
                reason: e.to_string(),
            })?;
        let size = |b: u64| -> Result<usize, ExecError> {
            usize::try_from(b)
                .ok()
                .and_then(|b| b.checked_next_multiple_of(ALIGN))
                .ok_or_else(|| dev_err("arena size", "overflows"))
        };
        let (ephemeral, cudnn_bytes, extent) = ephemeral_extent(plan.ephemeral, cudnn_bytes)?;
        // The ephemeral part is mapped on its own (perhaps to the lane's
        // shared memory): it starts at a multiple of the granularity.
        let ephemeral_at = persistent
            .checked_next_multiple_of(granularity.max(ALIGN))
            .ok_or_else(|| dev_err("arena size", "overflows"))?;
        let bytes = ephemeral_at
            .checked_add(extent)
            .ok_or_else(|| dev_err("arena size", "overflows"))?;
        // Inside the extent (no overflow: both below `bytes`): T, then
        // cuDNN's workspace, then cuBLAS's.
        let cudnn_at = ephemeral_at + ephemeral;
        let cublas_at = cudnn_at + cudnn_bytes;
        let layout = ArenaLayout {
            ephemeral_at,
            ephemeral,
            lower_bound: size(plan.lower_bound)?,
            no_reuse: size(plan.no_reuse)?,
            cudnn_at,
            cudnn_bytes,
            cublas_at,
            bytes,
            fetchable: plan.fetched.iter().copied().collect(),
        };
        Ok((layout, plan))
    }

    /// Gives every output of a non-persistent node its slot of `plan`.
    fn place(
        &self,
        graph: &ValidGraph,
        plan: &MemoryPlan,
        slots: &mut [Vec<Slot>],
    ) -> Result<(), ExecError> {
        let g = graph.graph();
        for (i, node) in g.nodes.iter().enumerate() {
            if matches!(node.op, Op::Variable(_) | Op::Constant(_)) {
                continue;
            }
            let id = NodeId(i as u32);
            let mut outs = Vec::with_capacity(node.outputs.len());
            for (k, ty) in node.outputs.iter().enumerate() {
                if ty.shape.checked_numel().unwrap_or(usize::MAX) > MAX_ELEMS {
                    return Err(op_err(
                        id,
                        node,
                        format!("{ty} is too large for this backend"),
                    ));
                }
                let s = plan
                    .slot(Outlet::new(id, k as u32))
                    .ok_or_else(|| op_err(id, node, "no slot in the memory plan".into()))?;
                let off = usize::try_from(s.offset)
                    .ok()
                    .and_then(|o| o.checked_add(self.ephemeral_at))
                    .ok_or_else(|| op_err(id, node, "arena offset overflows".into()))?;
                outs.push(Slot {
                    off,
                    ty: ty.clone(),
                });
            }
            slots[i] = outs;
        }
        Ok(())
    }
}

/// Where the persistent region lives and what switching it costs.
struct Residency {
    layout: Layout,
    /// Byte range of each unit in the persistent region.
    ranges: Vec<(usize, usize)>,
    /// Bytes of the persistent region (the arena's first bytes).
    bytes: usize,
    /// The copy stream (standby: created with the program).
    copy: Arc<CudaStream>,
    /// Pinned host image of the persistent region; current unless `dirty`.
    host: Option<PinnedHostSlice<u8>>,
    resident: bool,
    dirty: bool,
    /// Iterations change variables (in-place ops).
    updates: bool,
    profile: Option<Profile>,
    /// Measured host → device bandwidth (bytes/s) and per-copy overhead (s).
    link: Option<(f64, f64)>,
    /// Iterations launched so far (the first warms up, the second is profiled).
    iterations: u64,
    /// GPU time of one replay of the recorded iteration, seconds: the
    /// op-by-op profile is scaled to it.
    graph_secs: Option<f64>,
    /// Per-strategy recorded segments (one CUDA graph per group's nodes,
    /// after the prefix), valid for the cut they were recorded for.
    segments: std::collections::HashMap<Strategy, Segments>,
    plans: PlanCache,
}

/// Failed recordings of the iteration before a program stops trying.
const CAPTURE_TRIES: u32 = 3;

/// A switch's recorded compute: the prefix, then one graph per group.
struct Segments {
    starts: Vec<usize>,
    graphs: Vec<Option<CudaGraph>>,
}

/// `LANES_ARENA_FILL`: `zero` or `poison` (0xFF bytes: NaN) fills the
/// ephemeral part of an arena allocated by a switch; unset leaves it as is.
fn arena_fill() -> Option<u8> {
    static FILL: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    *FILL.get_or_init(|| match std::env::var("LANES_ARENA_FILL").as_deref() {
        Ok("zero") => Some(0),
        Ok("poison") => Some(0xFF),
        _ => None,
    })
}

/// Per-group cost on the compute side (one stream wait), seconds.
const WAIT_OVERHEAD: f64 = 2e-6;

impl CudaProgram {
    /// Whether the persistent region is on the device.
    pub fn is_resident(&self) -> bool {
        self.res.resident
    }

    /// Persistent bytes (variables and constants).
    pub fn persistent_bytes(&self) -> u64 {
        self.res.layout.bytes()
    }

    /// The unit layout (persistent tensors by first use).
    pub fn layout(&self) -> &Layout {
        &self.res.layout
    }

    /// Per-unit compute profile of the first resident iteration.
    pub fn profile(&self) -> Option<&Profile> {
        self.res.profile.as_ref()
    }

    /// Measured pinned host → device bandwidth in bytes/s (after an eviction).
    pub fn bandwidth(&self) -> Option<f64> {
        self.res.link.map(|(bw, _)| bw)
    }

    /// The group plan `strategy` would use now.
    pub fn plan(&self, strategy: Strategy) -> GroupPlan {
        self.res.plans.get(strategy, || self.costs())
    }

    /// The measured costs (zeros where nothing was measured yet).
    fn costs(&self) -> Costs {
        let res = &self.res;
        let n = res.layout.units.len();
        let mut profile = res.profile.clone().unwrap_or_else(|| Profile::zeros(n));
        // Switches replay recorded segments: scale the op-by-op profile to
        // the recorded iteration's time.
        let total = profile.prefix + profile.compute.iter().sum::<f64>();
        if let (Some(g), true) = (res.graph_secs, total > 0.0) {
            let f = g / total;
            profile.prefix *= f;
            profile.compute.iter_mut().for_each(|c| *c *= f);
        }
        let (bw, over) = res.link.unwrap_or((0.0, 0.0));
        Costs::from_bandwidth(
            &res.layout,
            bw,
            profile.compute,
            profile.prefix,
            over,
            WAIT_OVERHEAD,
        )
    }

    fn event(&self, stream: &CudaStream, timing: bool) -> Result<CudaEvent, ExecError> {
        let flags =
            (!timing).then_some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let flags = flags.unwrap_or(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        stream
            .record_event(Some(flags))
            .map_err(|e| dev_err("record event", e))
    }

    /// Copies the persistent region to pinned host memory when the host
    /// image is stale (always for training state; once for an inference
    /// graph) and releases the device arena. Returns the bytes copied.
    pub fn evict(&mut self) -> Result<u64, ExecError> {
        if !self.res.resident {
            return Ok(0);
        }
        let t0 = std::time::Instant::now();
        let copied = self.refresh_host_image()?;
        let t1 = std::time::Instant::now();
        self.arena.unmap()?;
        self.res.resident = false;
        tracing::debug!(
            copied,
            host_ms = (t1 - t0).as_secs_f64() * 1e3,
            unmap_ms = t1.elapsed().as_secs_f64() * 1e3,
            "evicted"
        );
        Ok(copied)
    }

    /// Brings the pinned host image up to date (copying only when stale),
    /// measures the link once and caches the plans. Returns bytes copied.
    fn refresh_host_image(&mut self) -> Result<u64, ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.sync()?;
        let bytes = self.res.bytes;
        let mut copied = 0u64;
        if self.res.dirty || self.res.host.is_none() {
            if self.res.host.is_none() && bytes > 0 {
                // SAFETY: the buffer is written by the copy below before any read.
                let pinned = unsafe { self.gpu.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }
                    .map_err(|e| dev_err(&format!("allocating {bytes} pinned bytes"), e))?;
                self.res.host = Some(pinned);
            }
            if let Some(host) = self.res.host.as_mut() {
                let dst = host
                    .as_mut_slice()
                    .map_err(|e| dev_err("pinned memory", e))?;
                // SAFETY: the arena's first `bytes` bytes are the persistent
                // region; `dst` holds exactly `bytes` bytes and stays borrowed
                // until the synchronize below.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        dst,
                        self.base,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| dev_err("device to host copy", e))?;
                self.sync()?;
                copied = bytes as u64;
            }
            self.res.dirty = false;
        }
        if self.res.link.is_none() {
            self.res.link = Some(self.measure_link()?);
            self.res.plans.invalidate();
        }
        let costs = self.costs();
        self.res.plans.fill(&costs);
        Ok(copied)
    }

    /// Standby for an inference program (no in-place updates): runs it with
    /// zero feeds until it is warm, profiled and recorded, takes the pinned
    /// host image, measures the link, plans the switch and records the
    /// pipelined plan's segments — so that the first eviction copies nothing
    /// and every switch replays recorded segments. A graph that updates
    /// variables is left alone (running it would change its state).
    pub fn prepare_standby(&mut self) -> Result<(), ExecError> {
        if self.res.updates || !self.res.resident {
            return Ok(());
        }
        let g = self.graph.graph();
        let feeds: BTreeMap<String, Tensor> = g
            .placeholders()
            .map(|(_, name, ty)| {
                let n = ty.shape.numel();
                let data = match ty.dtype {
                    DType::F32 => TensorData::F32(vec![0.0; n]),
                    DType::I64 => TensorData::I64(vec![0; n]),
                    DType::F16 | DType::BF16 => return Err(half_unsupported(ty.dtype)),
                };
                Tensor::new(ty.shape.clone(), data)
                    .map(|t| (name.to_string(), t))
                    .map_err(|e| dev_err("standby feeds", e))
            })
            .collect::<Result<_, _>>()?;
        // Warm-up, profile, record and time the recorded iteration.
        for _ in 0..3 {
            if self.res.graph_secs.is_some() && self.res.profile.is_some() {
                break;
            }
            self.run(&feeds, &[])?;
        }
        self.refresh_host_image()?;
        if self.options.cuda_graph && self.capture_failures < CAPTURE_TRIES {
            let plan = self.plan(Strategy::Pipelined);
            let sg = self.record_segments(&plan)?;
            self.res.segments.insert(Strategy::Pipelined, sg);
        }
        Ok(())
    }

    /// Times one copy of the whole persistent region from the pinned image
    /// and one copy per unit (writing the same bytes back: harmless):
    /// bandwidth and the fixed cost of one more copy.
    fn measure_link(&self) -> Result<(f64, f64), ExecError> {
        let Some(host) = self.res.host.as_ref() else {
            return Ok((0.0, 0.0));
        };
        let src = host.as_slice().map_err(|e| dev_err("pinned memory", e))?;
        let copy = &self.res.copy;
        let e0 = self.event(copy, true)?;
        // SAFETY: the persistent region holds `src.len()` bytes at `base`; the
        // pinned source lives in `self` and the stream is synchronised below.
        unsafe { cudarc::driver::result::memcpy_htod_async(self.base, src, copy.cu_stream()) }
            .map_err(|e| dev_err("host to device copy", e))?;
        let e1 = self.event(copy, true)?;
        for &(lo, hi) in &self.res.ranges {
            // SAFETY: as above, for the unit's sub-range.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.base + lo as u64,
                    &src[lo..hi],
                    copy.cu_stream(),
                )
            }
            .map_err(|e| dev_err("host to device copy", e))?;
        }
        let e2 = self.event(copy, true)?;
        wait_idle(copy)?;
        let whole = f64::from(e0.elapsed_ms(&e1).map_err(|e| dev_err("event", e))?) / 1e3;
        let units = f64::from(e1.elapsed_ms(&e2).map_err(|e| dev_err("event", e))?) / 1e3;
        let bw = if whole > 0.0 {
            src.len() as f64 / whole
        } else {
            0.0
        };
        let n = self.res.ranges.len();
        let over = if n > 1 {
            ((units - whole) / (n - 1) as f64).max(0.0)
        } else {
            0.0
        };
        Ok((bw, over))
    }

    /// Runs one iteration; when the program is not resident, its persistent
    /// region comes back in the groups of `strategy` on the copy stream while
    /// the compute stream runs the nodes whose weights are there (each
    /// group's first node waits for that group's copy event).
    pub fn run_switching<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        strategy: Strategy,
    ) -> Result<(Vec<Tensor>, Option<SwitchReport>), ExecError> {
        if self.res.resident {
            let out = self.run(feeds, fetches)?;
            return Ok((out, None));
        }
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.pin_feeds(feeds);
        let (feed_list, outs) = self.check_io(feeds, fetches)?;
        self.cover_fetches(&outs)?;
        let plan = self.plan(strategy);
        let fill = arena_fill();
        // Memory back under the arena's fixed address: the recorded graphs
        // stay valid. The persistent part's chunks beyond the first group
        // are mapped while the earlier groups copy (below); a fill touches
        // it all at once.
        let units = &self.res.layout.units;
        let first = match plan.groups() {
            0 => 0,
            _ => self.res.ranges[plan.range(0, units.len()).end - 1].1,
        };
        if fill.is_some() {
            self.arena.map()?;
        } else {
            self.arena.map_deferred(first)?;
        }
        let base = self.base;
        let p = self.res.bytes;
        // The ephemeral part is left as mapped: every kernel
        // writes its outputs before anything reads them (checked by filling
        // it with NaN bytes under LANES_ARENA_FILL=poison and comparing with
        // resident runs, see docs/switching.md). The fill, when asked for,
        // runs on the compute stream around the feeds, which the copy stream
        // brings in first: a copy from pageable memory returns only once
        // done, so behind the weights it would hold up every launch.
        let mut fed: Vec<(usize, usize)> = feed_list
            .iter()
            .map(|(o, t)| {
                let off = self.slot(*o).off;
                (off, off + t.ty().bytes())
            })
            .collect();
        fed.sort_unstable();
        let mut at = p;
        for (lo, hi) in fed
            .iter()
            .copied()
            .chain([(self.mem.bytes, self.mem.bytes)])
        {
            if let (Some(byte), true) = (fill, lo > at) {
                // SAFETY: [base + at, base + lo) is inside the new arena.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        base + at as u64,
                        byte,
                        lo - at,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| dev_err("memset", e))?;
            }
            at = at.max(hi);
        }
        let copy = &self.res.copy;
        for (o, t) in &feed_list {
            self.upload_on(*o, *t, copy)?;
        }
        let feeds_in = self.event(copy, false)?;
        self.stream
            .wait(&feeds_in)
            .map_err(|e| dev_err("stream wait", e))?;
        let host = self
            .res
            .host
            .as_ref()
            .ok_or_else(|| dev_err("restore", "the evicted program has no host image"))?;
        let src = host.as_slice().map_err(|e| dev_err("pinned memory", e))?;
        let units = &self.res.layout.units;
        let mut groups: Vec<(usize, CudaEvent)> = Vec::with_capacity(plan.groups());
        for k in 0..plan.groups() {
            let r = plan.range(k, units.len());
            let (lo, hi) = (self.res.ranges[r.start].0, self.res.ranges[r.end - 1].1);
            self.arena.map_through(hi)?;
            // SAFETY: [lo, hi) lies in the persistent region of the new arena
            // (mapped through `hi` just above) and of the pinned image, which
            // outlives the copy (synchronised before returning).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + lo as u64,
                    &src[lo..hi],
                    copy.cu_stream(),
                )
            }
            .map_err(|e| dev_err("host to device copy", e))?;
            groups.push((units[r.start].first_use, self.event(copy, false)?));
        }
        // Whatever the groups did not cover (alignment tail), before any
        // kernel runs.
        self.arena.map()?;
        let recorded = self
            .res
            .segments
            .get(&strategy)
            .filter(|sg| sg.starts == plan.starts);
        let replayed = recorded.is_some();
        let launched = if let Some(sg) = recorded {
            // Prefix, then each group's segment after its copy event.
            let mut r = Ok(());
            for (k, g) in sg.graphs.iter().enumerate() {
                if k > 0 {
                    self.stream
                        .wait(&groups[k - 1].1)
                        .map_err(|e| dev_err("stream wait", e))?;
                }
                if let Some(g) = g {
                    r = g.launch().map_err(|e| dev_err("graph launch", e));
                    if r.is_err() {
                        break;
                    }
                }
            }
            for (_, ev) in &groups {
                self.stream
                    .wait(ev)
                    .map_err(|e| dev_err("stream wait", e))?;
            }
            r
        } else {
            let mut next = 0;
            let mut wait_until = |pos: usize| -> Result<(), ExecError> {
                while next < groups.len() && groups[next].0 <= pos {
                    self.stream
                        .wait(&groups[next].1)
                        .map_err(|e| dev_err("stream wait", e))?;
                    next += 1;
                }
                Ok(())
            };
            let launched = self.launch_nodes_with(&mut wait_until);
            wait_until(usize::MAX)?;
            launched
        };
        // Wait before copying to pageable memory (see `wait_idle`).
        let r: Result<Vec<Tensor>, ExecError> = launched
            .and_then(|()| self.sync())
            .and_then(|()| outs.iter().map(|&o| self.download(o)).collect());
        self.sync()?;
        wait_idle(copy)?;
        self.res.resident = true;
        self.res.dirty = self.res.updates;
        if !replayed
            && r.is_ok()
            && self.options.cuda_graph
            && self.capture_failures < CAPTURE_TRIES
        {
            // Record this cut's segments for the next switch.
            // Recording launches nothing: the switch's result is unchanged.
            match self.record_segments(&plan) {
                Ok(sg) => {
                    self.res.segments.insert(strategy, sg);
                }
                Err(e) => tracing::debug!(error = %e, "segments not recorded"),
            }
        }
        let report = SwitchReport {
            strategy,
            replayed,
            groups: plan.groups(),
            bytes: self.res.layout.bytes(),
            predicted: plan.predicted,
        };
        r.map(|o| (o, Some(report)))
    }
}

impl std::fmt::Debug for CudaProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaProgram")
            .field("device", &self.gpu.info.name)
            .field("nodes", &self.graph.graph().nodes.len())
            .field("arena_bytes", &self.arena.size())
            .field("cudnn_workspace_bytes", &self.mem.cudnn_bytes)
            .field("options", &self.options)
            .field("fused_chains", &self.fusion.chains.len())
            .field("cudnn_batch_norms", &self.bns.len())
            .finish()
    }
}

// SAFETY: the cuDNN handle and descriptors (the only members that are not
// `Send`) are owned by this program and used only through `&mut self` or
// `&self` methods of it, so they are never used from two threads at once;
// cuDNN allows a handle to move between threads when calls do not overlap.
unsafe impl Send for CudaProgram {}

/// How long [`wait_idle`] polls without sleeping, at least.
const WAIT_SPIN: std::time::Duration = std::time::Duration::from_millis(2);
/// How long it polls without sleeping at most (see [`set_wait_spin`]), in
/// nanoseconds; 0: [`WAIT_SPIN`].
static WAIT_SPIN_MAX_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Process-wide: CUDA workers wait for their streams without sleeping for
/// up to `window` (a service's `--busy-poll`), instead of [`WAIT_SPIN`].
pub fn set_wait_spin(window: std::time::Duration) {
    let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
    WAIT_SPIN_MAX_NS.store(ns, std::sync::atomic::Ordering::Relaxed);
}

/// How long the wait for an iteration spins: [`WAIT_SPIN`], or 1.25 times
/// the program's last wait (its iterations' length) up to the busy-poll
/// window, so that the wait polls through the iteration's expected end
/// instead of sleeping past it.
fn spin_for(last: std::time::Duration) -> std::time::Duration {
    let max = std::time::Duration::from_nanos(
        WAIT_SPIN_MAX_NS.load(std::sync::atomic::Ordering::Relaxed),
    );
    WAIT_SPIN.max((last * 5 / 4).min(max))
}
/// Its pause between polls after that.
const WAIT_POLL: std::time::Duration = std::time::Duration::from_micros(50);

/// Waits until the work queued on `stream` so far has finished, by polling
/// an event rather than blocking inside the driver. A thread that waits in
/// `cuStreamSynchronize` or in a copy to pageable memory holds a driver
/// lock (shared) that calls such as `cuCtxGetLimit` take exclusively; the
/// cuDNN and cuBLAS set-up of a job being loaded makes such calls, and a
/// training lane waiting in the driver back to back starved that load for
/// as long as the training ran (seen on the H100: 17 s and more). Polling
/// holds the lock only for each short query.
pub(super) fn wait_idle(stream: &CudaStream) -> Result<(), ExecError> {
    wait_idle_spinning(stream, WAIT_SPIN).map(|_| ())
}

/// [`wait_idle`] that polls without sleeping for `spin`; returns how long
/// it waited.
fn wait_idle_spinning(
    stream: &CudaStream,
    spin: std::time::Duration,
) -> Result<std::time::Duration, ExecError> {
    let done = stream
        .record_event(None)
        .map_err(|e| dev_err("record event", e))?;
    let t0 = std::time::Instant::now();
    while !done
        .try_is_complete()
        .map_err(|e| dev_err("stream synchronize", e))?
    {
        if t0.elapsed() < spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep(WAIT_POLL);
        }
    }
    Ok(t0.elapsed())
}

/// The CUDA backend's refusal of a half-precision tensor (until its
/// kernels take them).
pub(super) fn half_unsupported(dtype: DType) -> ExecError {
    ExecError::UnsupportedDType {
        dtype,
        backend: "CUDA",
    }
}

pub(super) fn dev_err(what: &str, e: impl std::fmt::Debug) -> ExecError {
    ExecError::NoDevice {
        reason: format!("{what}: {e:?}"),
    }
}

impl CudaProgram {
    /// Checks every variable of `graph` has a value of its declared type,
    /// lays out all tensors in one device allocation, uploads variables and
    /// constants, and plans the cuDNN convolutions (workspace included).
    pub fn new(graph: ValidGraph, vars: VarValues) -> Result<Self, ExecError> {
        Self::with_options(graph, vars, CudaOptions::default())
    }

    /// [`CudaProgram::new`] with explicit precision switches.
    pub fn with_options(
        graph: ValidGraph,
        vars: VarValues,
        options: CudaOptions,
    ) -> Result<Self, ExecError> {
        let g = graph.graph();
        // Until the kernels take half tensors, a graph with one is refused
        // here rather than run by f32 kernels on 2-byte values.
        if let Some(t) = g
            .nodes
            .iter()
            .flat_map(|n| &n.outputs)
            .find(|t| t.dtype.is_half())
        {
            return Err(half_unsupported(t.dtype));
        }
        for (_, name, ty) in g.variables() {
            let v = vars
                .get(name)
                .ok_or_else(|| ExecError::MissingVariable { name: name.into() })?;
            if v.ty() != *ty {
                return Err(ExecError::VariableType {
                    name: name.into(),
                    expected: ty.clone(),
                    got: v.ty(),
                });
            }
        }
        let gpu = gpu()?;
        gpu.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let stream = stream_of(&gpu.ctx, options.urgency)?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err("cuBLAS", e))?;
        let math = if options.matmul_tf32 {
            cudarc::cublas::sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cudarc::cublas::sys::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: the handle is live (owned by `blas`); setting the math mode
        // has no memory effects.
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), math) }
            .result()
            .map_err(|e| dev_err("cuBLAS math mode", e))?;
        let cudnn = Cudnn::new(stream.clone()).map_err(|e| dev_err("cuDNN", e))?;
        let copy_stream = stream_of(&gpu.ctx, options.urgency)?;

        // Layout: the persistent tensors first, in first-use order (so a
        // group of units is one contiguous copy); then the ephemeral region
        // at the memory plan's offsets (the graph's sinks fetchable; a Run
        // that fetches more re-plans); then the workspaces.
        let layout = Layout::of(&graph);
        let mut slots: Vec<Vec<Slot>> = vec![Vec::new(); g.nodes.len()];
        let mut total = 0usize;
        let mut ranges = Vec::with_capacity(layout.units.len());
        for unit in &layout.units {
            let lo = total;
            for id in &unit.tensors {
                let node = &g.nodes[id.index()];
                let ty = node
                    .outputs
                    .first()
                    .ok_or_else(|| op_err(*id, node, "no output".into()))?;
                if ty.shape.checked_numel().unwrap_or(usize::MAX) > MAX_ELEMS {
                    return Err(op_err(
                        *id,
                        node,
                        format!("{ty} is too large for this backend"),
                    ));
                }
                slots[id.index()] = vec![Slot {
                    off: total,
                    ty: ty.clone(),
                }];
                total = total
                    .checked_add(ty.bytes().max(1).div_ceil(ALIGN) * ALIGN)
                    .ok_or_else(|| op_err(*id, node, "arena size overflows".into()))?;
            }
            ranges.push((lo, total));
        }
        let persistent_bytes = total;
        // The other nodes' types now (their offsets come from the plan,
        // below): convolution plans read them.
        for (i, node) in g.nodes.iter().enumerate() {
            if !matches!(node.op, Op::Variable(_) | Op::Constant(_)) {
                slots[i] = node
                    .outputs
                    .iter()
                    .map(|ty| Slot {
                        off: 0,
                        ty: ty.clone(),
                    })
                    .collect();
            }
        }

        let (convs, ws_bytes) = plan_convs(&cudnn, &graph, options)?;
        let bns = plan_batch_norms(&graph, options.cudnn_batch_norm)
            .map_err(|(k, e)| op_err(NodeId(k as u32), &g.nodes[k], format!("cuDNN: {e:?}")))?;
        let bn_handle = if bns.is_empty() {
            None
        } else {
            Some(BnHandle::new(&stream).map_err(|e| dev_err("cuDNN", e))?)
        };
        let gran = granularity(&gpu.ctx)?;
        let (mem, plan) = ArenaLayout::new(
            &graph,
            persistent_bytes,
            ws_bytes,
            compile::sinks(&graph),
            gran,
        )?;
        mem.place(&graph, &plan, &mut slots)?;
        let arena = VmArena::new(&gpu.ctx, mem.ephemeral_at, mem.bytes - mem.ephemeral_at)?;
        let base = arena.base();
        if mem.ephemeral_at > 0 {
            // SAFETY: the persistent part is mapped (the ephemeral part is
            // mapped by the first run); zeroed like a fresh allocation.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    base,
                    0,
                    mem.ephemeral_at,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| dev_err("memset", e))?;
        }
        bind_cublas_workspace(&blas, base + mem.cublas_at as u64)?;

        let updates = g.nodes.iter().any(|n| !n.op.mutated_inputs().is_empty());
        let mut prog = CudaProgram {
            graph,
            gpu,
            stream,
            blas,
            slots,
            base,
            convs,
            bns,
            bn_handle,
            options,
            fusion: Fusion::default(),
            captured: None,
            capture_failures: 0,
            res: Residency {
                updates,
                layout,
                ranges,
                bytes: persistent_bytes,
                copy: copy_stream,
                host: None,
                resident: true,
                dirty: true,
                profile: None,
                link: None,
                iterations: 0,
                graph_secs: None,
                segments: std::collections::HashMap::new(),
                plans: PlanCache::default(),
            },
            arena,
            _cudnn: cudnn,
            pins: SegmentPins::default(),
            last_wait_ns: std::sync::atomic::AtomicU64::new(0),
            mem,
        };
        prog.fusion = prog.match_chains();
        // Upload variables and constants.
        let g = prog.graph.graph();
        for (i, node) in g.nodes.iter().enumerate() {
            let t = match &node.op {
                Op::Variable(_) => vars.get(&node.name),
                Op::Constant(t) => Some(t),
                _ => None,
            };
            if let Some(t) = t {
                prog.upload(Outlet::new(NodeId(i as u32), 0), t)?;
            }
        }
        prog.sync()?;
        Ok(prog)
    }

    pub fn graph(&self) -> &ValidGraph {
        &self.graph
    }

    /// Bytes of device memory this program holds: its arena (persistent
    /// region, planned ephemeral region, workspaces).
    pub fn device_bytes(&self) -> usize {
        self.arena.size()
    }

    /// From the next iteration on, the ephemeral region (tensors and
    /// workspaces) lives in the shared memory of `lane` (a process-unique
    /// key, see `lanes::LaneTurn::key`), or in the program's own memory for
    /// `None`. The caller runs one iteration at a time per lane.
    pub fn bind_lane(&mut self, lane: Option<u64>) -> Result<(), ExecError> {
        if self.arena.lane() == lane {
            return Ok(());
        }
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.sync()?;
        self.arena.bind_lane(lane)
    }

    /// Bytes of device memory mapped to this program alone now (its lane's
    /// shared memory is not counted; nothing while evicted).
    pub fn own_device_bytes(&self) -> usize {
        self.arena.own_bytes()
    }

    /// The arena's parts in bytes: (persistent, ephemeral T, cuDNN and
    /// cuBLAS workspaces, the planner's lower bound for T, T without reuse).
    pub fn arena_parts(&self) -> ArenaParts {
        ArenaParts {
            persistent: self.res.bytes,
            ephemeral: self.mem.ephemeral,
            workspaces: self.mem.cudnn_bytes + CUBLAS_WORKSPACE,
            lower_bound: self.mem.lower_bound,
            no_reuse: self.mem.no_reuse,
        }
    }

    /// Name of the GPU.
    pub fn device_name(&self) -> &str {
        &self.gpu.info.name
    }

    /// The cuDNN workspace in the arena: (address, bytes).
    pub(super) fn cudnn_workspace(&self) -> (u64, usize) {
        (self.base + self.mem.cudnn_at as u64, self.mem.cudnn_bytes)
    }

    pub(super) fn slot(&self, o: Outlet) -> &Slot {
        &self.slots[o.node.index()][o.slot as usize]
    }

    pub(super) fn addr(&self, o: Outlet) -> u64 {
        self.base + self.slot(o).off as u64
    }

    fn upload<F: HostFeed>(&self, o: Outlet, t: &F) -> Result<(), ExecError> {
        self.upload_on(o, t, &self.stream)
    }

    fn upload_on<F: HostFeed>(
        &self,
        o: Outlet,
        t: &F,
        stream: &CudaStream,
    ) -> Result<(), ExecError> {
        let dst = self.addr(o);
        let bytes = t.bytes();
        if bytes.len() != self.slot(o).ty.bytes() {
            return Err(dev_err(
                "host to device copy",
                "a feed's bytes do not match its type",
            ));
        }
        // SAFETY: `dst` is the start of this outlet's range in the arena,
        // which holds exactly `bytes.len()` bytes (checked just above), and
        // the host bytes live until the stream is synchronised by the caller
        // (from page-locked memory the copy is asynchronous).
        let r =
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, bytes, stream.cu_stream()) };
        r.map_err(|e| dev_err("host to device copy", e))
    }

    /// Registers the shared segments `feeds` lie in (once each), so that
    /// their copies to the device are DMA from where the job wrote them.
    fn pin_feeds<F: HostFeed>(&mut self, feeds: &BTreeMap<String, F>) {
        // The span of the feeds in each segment (a Run's feeds lie in one).
        let mut spans: Vec<(&Arc<AttachedSegment>, std::ops::Range<usize>)> = Vec::new();
        for f in feeds.values() {
            let (Some(seg), Some(at)) = (f.segment(), f.offset()) else {
                continue;
            };
            let end = at + f.bytes().len();
            match spans.iter_mut().find(|(s, _)| Arc::ptr_eq(s, seg)) {
                Some((_, r)) => *r = r.start.min(at)..r.end.max(end),
                None => spans.push((seg, at..end)),
            }
        }
        for (seg, range) in spans {
            self.pins.pin(seg, range);
        }
    }

    fn download(&self, o: Outlet) -> Result<Tensor, ExecError> {
        let s = self.slot(o);
        let n = s.ty.shape.numel();
        let src = self.addr(o);
        let data = match s.ty.dtype {
            DType::F32 => {
                let mut v = vec![0f32; n];
                // SAFETY: the arena range holds n f32 values; the copy is
                // awaited by the synchronize below before `v` is used.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(&mut v, src, self.stream.cu_stream())
                }
                .map_err(|e| dev_err("device to host copy", e))?;
                self.sync()?;
                TensorData::F32(v)
            }
            DType::I64 => {
                let mut v = vec![0i64; n];
                // SAFETY: as above, for n i64 values.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(&mut v, src, self.stream.cu_stream())
                }
                .map_err(|e| dev_err("device to host copy", e))?;
                self.sync()?;
                TensorData::I64(v)
            }
            DType::F16 | DType::BF16 => return Err(half_unsupported(s.ty.dtype)),
        };
        Tensor::new(s.ty.shape.clone(), data).map_err(|e| dev_err("result", e))
    }

    pub(super) fn sync(&self) -> Result<(), ExecError> {
        use std::sync::atomic::Ordering::Relaxed;
        let last = std::time::Duration::from_nanos(self.last_wait_ns.load(Relaxed));
        let waited = wait_idle_spinning(&self.stream, spin_for(last))?;
        self.last_wait_ns.store(
            u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX),
            Relaxed,
        );
        Ok(())
    }

    /// Runs one iteration: feeds by placeholder name, fetches by `"node"` or
    /// `"node:slot"`, returns fetched tensors in order.
    pub fn run<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
    ) -> Result<Vec<Tensor>, ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.pin_feeds(feeds);
        let (feed_list, outs) = self.check_io(feeds, fetches)?;
        self.cover_fetches(&outs)?;
        if !self.res.resident {
            return self
                .run_switching(feeds, fetches, Strategy::Pipelined)
                .map(|(o, _)| o);
        }
        // The ephemeral part (own, or the lane's block) from the first run.
        self.arena.map()?;
        for (o, t) in feed_list {
            self.upload(o, t)?;
        }
        self.iterate()?;
        if self.res.updates {
            self.res.dirty = true;
        }
        // Wait here, not inside the copies to pageable memory below (see
        // `wait_idle`).
        self.sync()?;
        outs.iter().map(|&o| self.download(o)).collect()
    }

    /// Runs one iteration op by op with a timing event after every node and
    /// returns the GPU time per op kind as (op, nodes, milliseconds), the
    /// largest first. A real iteration: in-place updates happen.
    pub fn profile_ops<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
    ) -> Result<Vec<(&'static str, usize, f64)>, ExecError> {
        if !self.res.resident {
            self.run_switching(feeds, fetches, Strategy::Pipelined)?;
        }
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.arena.map()?;
        let (feed_list, outs) = self.check_io(feeds, fetches)?;
        self.cover_fetches(&outs)?;
        for (o, t) in feed_list {
            self.upload(o, t)?;
        }
        let order = self.graph.order().to_vec();
        let mut marks = Vec::with_capacity(order.len() + 1);
        marks.push(self.event(&self.stream, true)?);
        for &id in &order {
            self.step(id)?;
            marks.push(self.event(&self.stream, true)?);
        }
        self.sync()?;
        if self.res.updates {
            self.res.dirty = true;
        }
        let mut by_op: BTreeMap<&'static str, (usize, f64)> = BTreeMap::new();
        for (k, id) in order.iter().enumerate() {
            // Nodes inside a fused chain launch nothing; the chain's kernel
            // counts under its own name (at its last node).
            let Some(name) = self.step_name(*id) else {
                continue;
            };
            let ms = marks[k]
                .elapsed_ms(&marks[k + 1])
                .map_err(|e| dev_err("event", e))?;
            let e = by_op.entry(name).or_default();
            e.0 += 1;
            e.1 += f64::from(ms);
        }
        let mut out: Vec<_> = by_op.into_iter().map(|(op, (n, ms))| (op, n, ms)).collect();
        out.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(out)
    }

    /// The ephemeral bytes (T with the workspaces, as admission counts
    /// them) the program will use once a Run fetched `fetches`: `None` when
    /// they need no re-plan (see [`CudaProgram::cover_fetches`]).
    pub fn ephemeral_need_for(&self, fetches: &[String]) -> Result<Option<u64>, ExecError> {
        let g = self.graph.graph();
        let mut fetchable = self.mem.fetchable.clone();
        let mut more = false;
        for k in fetches {
            let o = g
                .resolve(k)
                .ok_or_else(|| ExecError::UnknownFetch { key: k.clone() })?;
            let persistent = matches!(
                g.nodes.get(o.node.index()).map(|n| &n.op),
                Some(Op::Variable(_) | Op::Constant(_))
            );
            if !persistent && fetchable.insert(o) {
                more = true;
            }
        }
        if !more {
            return Ok(None);
        }
        let plan = compile::plan_outlets(&self.graph, fetchable, compile::PlanOptions::default())
            .map_err(|e| ExecError::Op {
            node: String::new(),
            op: "memory plan",
            reason: e.to_string(),
        })?;
        let (_, _, extent) = ephemeral_extent(plan.ephemeral, self.mem.cudnn_bytes)?;
        Ok(Some(extent as u64))
    }

    /// Re-plans the ephemeral region when a Run fetches an output that the
    /// current plan lets die before the end of the iteration: the new plan
    /// keeps every output fetched so far. The recorded graphs hold the old
    /// addresses and are dropped (recorded again by later iterations). When
    /// the new layout needs more bytes than the arena has, the arena is
    /// replaced: the persistent region goes to its host image and comes back
    /// with the next iteration (a switch).
    fn cover_fetches(&mut self, outs: &[Outlet]) -> Result<(), ExecError> {
        let g = self.graph.graph();
        let missing: Vec<Outlet> = outs
            .iter()
            .copied()
            .filter(|o| {
                !matches!(
                    g.nodes[o.node.index()].op,
                    Op::Variable(_) | Op::Constant(_)
                ) && !self.mem.fetchable.contains(o)
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let mut fetchable = self.mem.fetchable.clone();
        fetchable.extend(missing);
        let gran = granularity(&self.gpu.ctx)?;
        let (mem, plan) = ArenaLayout::new(
            &self.graph,
            self.res.bytes,
            self.mem.cudnn_bytes,
            fetchable,
            gran,
        )?;
        self.sync()?;
        if mem.bytes > self.arena.size() {
            self.evict()?;
            let mut arena = VmArena::new(
                &self.gpu.ctx,
                mem.ephemeral_at,
                mem.bytes - mem.ephemeral_at,
            )?;
            arena.unmap()?;
            arena.bind_lane(self.arena.lane())?;
            self.arena = arena;
            self.base = self.arena.base();
        }
        tracing::debug!(
            before = self.mem.ephemeral,
            after = mem.ephemeral,
            fetchable = mem.fetchable.len(),
            "re-planned the ephemeral region for new fetches"
        );
        mem.place(&self.graph, &plan, &mut self.slots)?;
        bind_cublas_workspace(&self.blas, self.base + mem.cublas_at as u64)?;
        self.mem = mem;
        self.fusion = self.match_chains();
        self.captured = None;
        self.capture_failures = 0;
        self.res.segments.clear();
        self.res.graph_secs = None;
        self.res.plans.invalidate();
        Ok(())
    }

    /// Feeds in placeholder order and fetch outlets, checked.
    #[allow(clippy::type_complexity)]
    fn check_io<'t, F: HostFeed>(
        &self,
        feeds: &'t BTreeMap<String, F>,
        fetches: &[String],
    ) -> Result<(Vec<(Outlet, &'t F)>, Vec<Outlet>), ExecError> {
        let g = self.graph.graph();
        for name in feeds.keys() {
            match g.find(name).map(|id| &g.nodes[id.index()].op) {
                Some(Op::Placeholder(_)) => {}
                _ => return Err(ExecError::UnknownFeed { name: name.clone() }),
            }
        }
        let mut feed_list = Vec::new();
        for (id, name, ty) in g.placeholders() {
            let t = feeds
                .get(name)
                .ok_or_else(|| ExecError::MissingFeed { name: name.into() })?;
            if t.ty() != *ty {
                return Err(ExecError::FeedType {
                    name: name.into(),
                    expected: ty.clone(),
                    got: t.ty(),
                });
            }
            feed_list.push((Outlet::new(id, 0), t));
        }
        let outs = fetches
            .iter()
            .map(|k| {
                g.resolve(k)
                    .ok_or_else(|| ExecError::UnknownFetch { key: k.clone() })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((feed_list, outs))
    }

    /// Launches every node in order, or replays the recorded graph.
    fn iterate(&mut self) -> Result<(), ExecError> {
        self.res.iterations += 1;
        if self.res.iterations == 1 {
            // Warm-up (module loads, first cuDNN calls): op by op.
            return self.launch_nodes();
        }
        if self.res.profile.is_none() {
            // The second iteration runs op by op with events at the unit
            // boundaries: the compute profile pipelined switching plans with.
            return self.launch_profiled();
        }
        if !self.options.cuda_graph || self.capture_failures >= CAPTURE_TRIES {
            return self.launch_nodes();
        }
        if self.captured.is_none() {
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| dev_err("begin capture", e))?;
            let launched = self.launch_nodes();
            let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
            match (launched, ended) {
                (Ok(()), Ok(Some(g))) => self.captured = Some(g),
                (launched, ended) => {
                    // Nothing ran while capturing: run op by op this time.
                    self.capture_failures += 1;
                    tracing::warn!(
                        failures = self.capture_failures,
                        launched = ?launched.err(),
                        ended = ?ended.err(),
                        "recording the iteration as a CUDA graph failed"
                    );
                    return self.launch_nodes();
                }
            }
        }
        match &self.captured {
            Some(g) if self.res.graph_secs.is_none() => {
                let e0 = self.event(&self.stream, true)?;
                g.launch().map_err(|e| dev_err("graph launch", e))?;
                let e1 = self.event(&self.stream, true)?;
                self.sync()?;
                let ms = e0.elapsed_ms(&e1).map_err(|e| dev_err("event", e))?;
                self.res.graph_secs = Some(f64::from(ms) / 1e3);
                self.res.plans.invalidate();
                Ok(())
            }
            Some(g) => g.launch().map_err(|e| dev_err("graph launch", e)),
            None => self.launch_nodes(),
        }
    }

    /// Node positions where each segment of `plan` starts: the prefix at 0,
    /// then each group's first consumer.
    fn segment_bounds(&self, plan: &GroupPlan) -> Vec<usize> {
        let units = &self.res.layout.units;
        let mut b = vec![0];
        b.extend(plan.starts.iter().map(|&u| units[u].first_use));
        b.push(self.graph.order().len());
        b
    }

    /// Records one CUDA graph per segment of `plan` at the current base.
    fn record_segments(&self, plan: &GroupPlan) -> Result<Segments, ExecError> {
        let bounds = self.segment_bounds(plan);
        let order = self.graph.order();
        let mut graphs = Vec::with_capacity(bounds.len() - 1);
        for w in bounds.windows(2) {
            let (a, b) = (w[0].min(order.len()), w[1].min(order.len()));
            if a >= b {
                graphs.push(None);
                continue;
            }
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| dev_err("begin capture", e))?;
            let launched = order[a..b].iter().try_for_each(|&id| self.step(id));
            let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
            match (launched, ended) {
                (Ok(()), Ok(g)) => graphs.push(g),
                (Err(e), _) => return Err(e),
                (_, Err(e)) => return Err(dev_err("end capture", e)),
            }
        }
        Ok(Segments {
            starts: plan.starts.clone(),
            graphs,
        })
    }

    fn launch_nodes(&self) -> Result<(), ExecError> {
        self.launch_nodes_with(&mut |_| Ok(()))
    }

    /// Launches every node in order, calling `before` with each position.
    fn launch_nodes_with(
        &self,
        before: &mut dyn FnMut(usize) -> Result<(), ExecError>,
    ) -> Result<(), ExecError> {
        for (pos, &id) in self.graph.order().iter().enumerate() {
            before(pos)?;
            self.step(id)?;
        }
        Ok(())
    }

    /// Launches op by op with a timing event at each unit boundary and keeps
    /// the per-unit times.
    fn launch_profiled(&mut self) -> Result<(), ExecError> {
        let unit_of = self.res.layout.unit_of_position();
        let mut marks: Vec<(Option<usize>, CudaEvent)> =
            vec![(None, self.event(&self.stream, true)?)];
        let mut current = None;
        let launched = self.launch_nodes_with(&mut |pos| {
            let u = unit_of.get(pos).copied().flatten();
            if u != current {
                marks.push((current, self.event(&self.stream, true)?));
                current = u;
            }
            Ok(())
        });
        launched?;
        marks.push((current, self.event(&self.stream, true)?));
        self.sync()?;
        let mut profile = Profile::zeros(self.res.layout.units.len());
        for w in marks.windows(2) {
            let dt = f64::from(
                w[0].1
                    .elapsed_ms(&w[1].1)
                    .map_err(|e| dev_err("event", e))?,
            ) / 1e3;
            match w[1].0 {
                None => profile.prefix += dt,
                Some(u) => profile.compute[u] += dt,
            }
        }
        self.res.profile = Some(profile);
        self.res.plans.invalidate();
        Ok(())
    }

    /// The chains of ops that run as one kernel for the current layout
    /// (none when [`CudaOptions::fuse`] is off), and the nodes that launch
    /// nothing of their own.
    pub fn fused_chains(&self) -> (usize, usize) {
        (self.fusion.chains.len(), self.fusion.skipped())
    }

    /// How many batch-norm forwards with batch statistics run through
    /// cuDNN's kernels rather than ours.
    pub fn cudnn_batch_norms(&self) -> usize {
        self.bns.len()
    }

    /// Matches fusable chains against the current slots and fetchable
    /// outputs (see `fuse.rs`).
    fn match_chains(&self) -> Fusion {
        if !self.options.fuse {
            return Fusion::default();
        }
        let g = self.graph.graph();
        let range = |o: Outlet| -> Option<(usize, usize)> {
            let node = g.nodes.get(o.node.index())?;
            if matches!(node.op, Op::Variable(_) | Op::Constant(_)) {
                return None;
            }
            let s = self.slots.get(o.node.index())?.get(o.slot as usize)?;
            Some((s.off, s.off + s.ty.bytes()))
        };
        let fusion = find_chains(g, self.graph.order(), &self.mem.fetchable, &range);
        tracing::debug!(
            chains = fusion.chains.len(),
            skipped = fusion.skipped(),
            "fused elementwise chains"
        );
        fusion
    }

    /// Whether iterations replay a recorded CUDA graph.
    pub fn uses_cuda_graph(&self) -> bool {
        self.captured.is_some()
    }

    /// Current values of the named variables (all variables when `names` is empty).
    pub fn read_variables(&self, names: &[String]) -> Result<VarValues, ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        let g = self.graph.graph();
        let mut out = VarValues::new();
        let all: Vec<String>;
        let names = if names.is_empty() {
            all = g.variables().map(|(_, n, _)| n.to_string()).collect();
            &all
        } else {
            names
        };
        for n in names {
            let id = g
                .variables()
                .find(|(_, vn, _)| vn == n)
                .map(|(id, _, _)| id)
                .ok_or_else(|| ExecError::MissingVariable { name: n.clone() })?;
            let o = Outlet::new(id, 0);
            let t = if self.res.resident {
                self.download(o)?
            } else {
                self.read_host(o)?
            };
            out.insert(n.clone(), t);
        }
        Ok(out)
    }

    /// A persistent tensor's value from the pinned image (while evicted).
    fn read_host(&self, o: Outlet) -> Result<Tensor, ExecError> {
        let s = self.slot(o);
        let host = self
            .res
            .host
            .as_ref()
            .ok_or_else(|| dev_err("read", "the evicted program has no host image"))?;
        let bytes = host.as_slice().map_err(|e| dev_err("pinned memory", e))?;
        let raw = &bytes[s.off..s.off + s.ty.bytes()];
        let data = match s.ty.dtype {
            DType::F32 => TensorData::F32(bytemuck::pod_collect_to_vec(raw)),
            DType::I64 => TensorData::I64(bytemuck::pod_collect_to_vec(raw)),
            DType::F16 | DType::BF16 => return Err(half_unsupported(s.ty.dtype)),
        };
        Tensor::new(s.ty.shape.clone(), data).map_err(|e| dev_err("result", e))
    }

    /// Overwrites variables; each must exist and keep its type.
    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        let g = self.graph.graph();
        let mut todo = Vec::new();
        for (name, t) in &values {
            let (id, ty) = g
                .variables()
                .find(|(_, vn, _)| vn == name)
                .map(|(id, _, ty)| (id, ty.clone()))
                .ok_or_else(|| ExecError::MissingVariable { name: name.clone() })?;
            if ty != t.ty() {
                return Err(ExecError::VariableType {
                    name: name.clone(),
                    expected: ty,
                    got: t.ty(),
                });
            }
            todo.push((Outlet::new(id, 0), t));
        }
        if !self.res.resident {
            // Into the pinned image, which the next run brings back.
            let offs: Vec<usize> = todo.iter().map(|(o, _)| self.slot(*o).off).collect();
            let host = self
                .res
                .host
                .as_mut()
                .ok_or_else(|| dev_err("write", "the evicted program has no host image"))?;
            let bytes = host
                .as_mut_slice()
                .map_err(|e| dev_err("pinned memory", e))?;
            for ((_, t), off) in todo.iter().zip(offs) {
                let src: &[u8] = match t.data() {
                    TensorData::F32(v) => bytemuck::cast_slice(v),
                    TensorData::I64(v) => bytemuck::cast_slice(v),
                    TensorData::F16(_) | TensorData::BF16(_) => {
                        return Err(half_unsupported(t.dtype()))
                    }
                };
                bytes[off..off + src.len()].copy_from_slice(src);
            }
            return Ok(());
        }
        for (o, t) in todo {
            self.upload(o, t)?;
        }
        self.res.dirty = true;
        self.sync()
    }
}

/// The cuDNN plan of every convolution node (forward, data and filter
/// gradients) and the largest workspace they ask for.
fn plan_convs(
    cudnn: &Arc<Cudnn>,
    graph: &ValidGraph,
    options: CudaOptions,
) -> Result<(HashMap<usize, ConvPlan>, usize), ExecError> {
    let g = graph.graph();
    let mut convs = HashMap::new();
    let mut ws_bytes = 0usize;
    for &id in graph.order() {
        let node = &g.nodes[id.index()];
        let in_ty = |k: usize| -> Result<&TensorType, ExecError> {
            let o = node
                .inputs
                .get(k)
                .ok_or_else(|| op_err(id, node, "missing input".into()))?;
            g.nodes[o.node.index()]
                .outputs
                .get(o.slot as usize)
                .ok_or_else(|| op_err(id, node, "missing input".into()))
        };
        let out = || -> Result<&TensorType, ExecError> {
            node.outputs
                .first()
                .ok_or_else(|| op_err(id, node, "no output".into()))
        };
        let plan = match &node.op {
            Op::Conv2d(a) => Some(ConvPlan::forward(
                cudnn,
                a,
                in_ty(0)?.shape.dims(),
                in_ty(1)?.shape.dims(),
                out()?.shape.dims(),
                options.conv_tf32,
            )),
            Op::Conv2dGradInput { attrs, .. } => Some(ConvPlan::backward_data(
                cudnn,
                attrs,
                out()?.shape.dims(),
                in_ty(1)?.shape.dims(),
                in_ty(0)?.shape.dims(),
                options.conv_tf32,
            )),
            Op::Conv2dGradFilter { attrs, .. } => Some(ConvPlan::backward_filter(
                cudnn,
                attrs,
                in_ty(0)?.shape.dims(),
                out()?.shape.dims(),
                in_ty(1)?.shape.dims(),
                options.conv_tf32,
            )),
            _ => None,
        };
        if let Some(p) = plan {
            let p = p.map_err(|e| op_err(id, node, format!("cuDNN: {e:?}")))?;
            ws_bytes = ws_bytes.max(p.workspace_bytes);
            convs.insert(id.index(), p);
        }
    }
    Ok((convs, ws_bytes))
}

/// Ephemeral bytes a CUDA program of `graph` needs in its lane's arena:
/// the plan's `planned` T plus the cuDNN and cuBLAS workspaces (what
/// admission must count for a GPU job). Plans the convolutions (no device
/// memory taken).
pub fn ephemeral_need(graph: &ValidGraph, planned: u64) -> Result<u64, ExecError> {
    let gpu = gpu()?;
    gpu.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
    let stream = gpu.ctx.new_stream().map_err(|e| dev_err("stream", e))?;
    let cudnn = Cudnn::new(stream).map_err(|e| dev_err("cuDNN", e))?;
    let (_, ws) = plan_convs(&cudnn, graph, CudaOptions::default())?;
    ephemeral_extent(planned, ws).map(|(_, _, extent)| extent as u64)
}

/// The ephemeral part of an arena for a plan's T and a cuDNN workspace:
/// (T, cuDNN workspace, the whole part with the cuBLAS workspace), each
/// rounded to the arena alignment. One formula for the program's layout
/// and for what admission counts.
fn ephemeral_extent(planned: u64, cudnn: usize) -> Result<(usize, usize, usize), ExecError> {
    let round = |b: u64| {
        usize::try_from(b)
            .ok()
            .and_then(|b| b.checked_next_multiple_of(ALIGN))
    };
    round(planned)
        .zip(round(cudnn as u64))
        .and_then(|(t, w)| Some((t, w, t.checked_add(w)?.checked_add(CUBLAS_WORKSPACE)?)))
        .ok_or_else(|| dev_err("arena size", "overflows"))
}

pub(super) fn op_err(id: NodeId, node: &lanes_adaptor::Node, reason: String) -> ExecError {
    let _ = id;
    ExecError::Op {
        node: node.name.clone(),
        op: node.op.name(),
        reason,
    }
}
