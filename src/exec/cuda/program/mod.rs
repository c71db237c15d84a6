//! [`CudaProgram`]: a validated graph laid out in one device arena, run one
//! iteration at a time on its own stream. Same contract as
//! [`crate::exec::cpu::CpuProgram`].

mod entry;
mod gated;
mod host_image;
mod io;
mod layout;
mod options;
mod profile;
mod switching;
mod wait;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream, PinnedHostSlice};
use lanes_adaptor::wire::shm::AttachedSegment;
use lanes_adaptor::{
    NodeId, Op, Outlet, Part, Tensor, TensorData, TensorType, ValidGraph, VarValues,
};

use crate::compile::{self, MemoryPlan};
use crate::exec::cuda::bn::{plan_batch_norms, BnPlan};
use crate::exec::cuda::conv::ConvPlan;
use crate::exec::cuda::device::{gpu, Gpu};
use crate::exec::cuda::fuse::{find_chains, Fusion};
use crate::exec::cuda::pin::SegmentPins;
use crate::exec::cuda::vm::{granularity, VmArena};
use crate::exec::{ExecError, FetchInto, Fetched, HostFeed};
use crate::residency::{
    Costs, GroupPlan, Layout, PlanCache, Profile, Strategy, SwitchReport, SwitchTrace,
};

pub use layout::ephemeral_need;
use layout::{ephemeral_extent, plan_convs};
pub use options::{set_conv_tf32, set_matmul_tf32, CudaOptions};
pub use wait::set_wait_spin;
pub(super) use wait::wait_idle;
use wait::{spin_for, wait_idle_spinning};

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
    pub(super) slots: Vec<Vec<Slot>>,
    pub(super) base: u64,
    pub(super) convs: HashMap<usize, ConvPlan>,
    /// Batch norms with batch statistics that cuDNN runs.
    pub(super) bns: HashMap<usize, BnPlan>,
    pub(super) options: CudaOptions,
    /// Fused chains for the current arena layout (re-matched when a new
    /// fetch re-plans it).
    pub(super) fusion: Fusion,
    /// The recorded iteration (valid for the program's lifetime: the arena
    /// keeps its address across evictions, see `vm/`).
    captured: Option<CudaGraph>,
    /// Captures that failed; after [`CAPTURE_TRIES`] launch op by op.
    capture_failures: u32,
    /// A yielding job's gate and segments (`gated.rs`).
    gated: Option<gated::Gated>,
    /// Each entry's Runs so far and its recorded launches (`entry.rs`).
    entries: HashMap<usize, entry::EntryRuns>,
    /// Residency: persistent tensors sit at the arena's start in first-use
    /// order, so a group of units is one contiguous copy.
    res: Residency,
    // Kept for their lifetimes: every address above points into these
    // (the arena's memory is given up while the program is evicted; its
    // address stays).
    arena: VmArena,
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
    /// While evicted partially: the units whose bytes stayed mapped (the
    /// arena's kept block, `VmArena::kept_bytes`); 0 otherwise.
    kept_units: usize,
    dirty: bool,
    profile: Option<Profile>,
    /// Measured host → device bandwidth (bytes/s) and per-copy overhead (s).
    link: Option<(f64, f64)>,
    /// Iterations launched so far (the first warms up, the second is profiled).
    iterations: u64,
    /// GPU time of one replay of the recorded iteration, seconds: the
    /// op-by-op profile is scaled to it.
    graph_secs: Option<f64>,
    /// Recorded segments by strategy and kept units (one CUDA graph per
    /// group's nodes, after the prefix), valid for the cut they were
    /// recorded for.
    segments: std::collections::HashMap<(Strategy, usize), Segments>,
    plans: PlanCache,
}

impl Drop for Residency {
    /// The host image goes back to the pool (`host_pool.rs`) once no copy
    /// reads or writes it: those run on the copy stream, or on the compute
    /// stream with a synchronize after them.
    fn drop(&mut self) {
        if let Some(img) = self.host.take() {
            if self.copy.synchronize().is_ok() {
                crate::exec::cuda::host_pool::give(img);
            }
        }
    }
}

impl Drop for CudaProgram {
    /// The shared library handles may still be bound to this program's
    /// stream and workspace, both about to go (`handles::release`).
    fn drop(&mut self) {
        crate::exec::cuda::handles::release(&self.stream);
    }
}

/// Failed recordings of the iteration before a program stops trying.
const CAPTURE_TRIES: u32 = 3;

/// A switch's recorded compute: the prefix, then one graph per group.
struct Segments {
    starts: Vec<usize>,
    graphs: Vec<Option<CudaGraph>>,
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

// SAFETY: the cuDNN descriptors (the only members that are not `Send`)
// are owned by this program and used only through `&mut self` or `&self`
// methods of it, so they are never used from two threads at once; cuDNN
// allows a descriptor to move between threads. The shared handles are
// used under their locks (`handles.rs`).
unsafe impl Send for CudaProgram {}

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
        crate::exec::cuda::ops::check_half(g)?;
        let gpu = gpu()?;
        gpu.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let stream = stream_of(&gpu.ctx, options.urgency)?;
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

        let (convs, ws_bytes) = plan_convs(&graph, options)?;
        let bns = plan_batch_norms(&graph, options.cudnn_batch_norm)
            .map_err(|(k, e)| op_err(NodeId(k as u32), &g.nodes[k], format!("cuDNN: {e:?}")))?;
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
        let mut prog = CudaProgram {
            graph,
            gpu,
            stream,
            slots,
            base,
            convs,
            bns,
            options,
            fusion: Fusion::default(),
            captured: None,
            gated: None,
            entries: HashMap::new(),
            capture_failures: 0,
            res: Residency {
                layout,
                ranges,
                bytes: persistent_bytes,
                copy: copy_stream,
                host: None,
                resident: true,
                kept_units: 0,
                dirty: true,
                profile: None,
                link: None,
                iterations: 0,
                graph_secs: None,
                segments: std::collections::HashMap::new(),
                plans: PlanCache::default(),
            },
            arena,
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

    /// Where cuBLAS works for this program: [`CUBLAS_WORKSPACE`] bytes of
    /// its arena, bound to the shared handle for each of its calls (so it
    /// never allocates, as capturing its calls in a CUDA graph requires).
    pub(super) fn cublas_workspace(&self) -> (u64, usize) {
        (self.base + self.mem.cublas_at as u64, CUBLAS_WORKSPACE)
    }

    pub(super) fn slot(&self, o: Outlet) -> &Slot {
        &self.slots[o.node.index()][o.slot as usize]
    }

    pub(super) fn addr(&self, o: Outlet) -> u64 {
        self.base + self.slot(o).off as u64
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
        self.run_to(feeds, fetches, None).map(Fetched::into_tensors)
    }

    /// [`CudaProgram::run`] whose fetched values go straight from the
    /// device into `into` when it takes them.
    pub fn run_to<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        into: Option<&mut dyn FetchInto>,
    ) -> Result<Fetched, ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.pin_feeds(feeds);
        let (feed_list, outs, part) = self.check_io(feeds, fetches)?;
        self.cover_fetches(&outs)?;
        if !self.res.resident {
            return self
                .run_switching_to(feeds, fetches, Strategy::Pipelined, into)
                .map(|(o, _)| o);
        }
        // The ephemeral part (own, or the lane's block) from the first run.
        self.arena.map()?;
        for (o, t) in feed_list {
            self.upload(o, t)?;
        }
        match part {
            Part::Main => self.iterate()?,
            Part::Entry(k) => self.launch_entry(k)?,
        }
        if self.graph.part_updates(part) {
            self.res.dirty = true;
        }
        // Wait here, not inside the copies to pageable memory below (see
        // `wait_idle`).
        self.sync()?;
        self.fetch(&outs, into)
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
        self.mem = mem;
        self.fusion = self.match_chains();
        self.captured = None;
        self.entries.clear();
        self.capture_failures = 0;
        if let Some(g) = &mut self.gated {
            g.invalidate();
        }
        self.res.segments.clear();
        self.res.graph_secs = None;
        self.res.plans.invalidate();
        Ok(())
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
        if self.gating() {
            // An urgent job is loaded: through the gate, in segments.
            return self.launch_gated();
        }
        if self.captured.is_none() {
            let (launched, ended) = crate::exec::cuda::handles::recording(|| {
                self.stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .map_err(|e| dev_err("begin capture", e))?;
                let launched = self.launch_nodes();
                Ok::<_, ExecError>((
                    launched,
                    self.stream.end_capture(CUgraphInstantiate_flags(0)),
                ))
            })?;
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
                // Uploaded first: a graph's first launch uploads it, which
                // timed with it would count in the iteration's time (the
                // time the switching planner scales its profile to).
                g.upload().map_err(|e| dev_err("graph upload", e))?;
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
        b.push(self.graph.main_order().len());
        b
    }

    /// Records one CUDA graph per segment of `plan` at the current base.
    fn record_segments(&self, plan: &GroupPlan) -> Result<Segments, ExecError> {
        let bounds = self.segment_bounds(plan);
        let mut graphs = Vec::with_capacity(bounds.len() - 1);
        for w in bounds.windows(2) {
            graphs.push(self.record_range(w[0], w[1])?);
        }
        Ok(Segments {
            starts: plan.starts.clone(),
            graphs,
        })
    }

    fn launch_nodes(&self) -> Result<(), ExecError> {
        self.launch_nodes_with(&mut |_| Ok(()))
    }

    /// Launches the main iteration's nodes in order, calling `before` with
    /// each position.
    fn launch_nodes_with(
        &self,
        before: &mut dyn FnMut(usize) -> Result<(), ExecError>,
    ) -> Result<(), ExecError> {
        for (pos, &id) in self.graph.main_order().iter().enumerate() {
            before(pos)?;
            self.step(id)?;
        }
        Ok(())
    }

    /// The chains of ops that run as one kernel for the current layout
    /// (none when [`CudaOptions::fuse`] is off), and the nodes that launch
    /// nothing of their own.
    pub fn fused_chains(&self) -> (usize, usize) {
        (
            self.fusion.chains.len() + self.fusion.softmax.len(),
            self.fusion.skipped(),
        )
    }

    /// How many reshapes are views of their inputs under the current
    /// layout (`compile::views`): they copy nothing and launch nothing.
    pub fn views(&self) -> usize {
        self.graph
            .order()
            .iter()
            .filter(|&&id| self.is_view(id))
            .count()
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
}

pub(super) fn op_err(id: NodeId, node: &lanes_adaptor::Node, reason: String) -> ExecError {
    let _ = id;
    ExecError::Op {
        node: node.name.clone(),
        op: node.op.name(),
        reason,
    }
}
