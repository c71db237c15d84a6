//! [`CudaProgram`]: a validated graph laid out in one device arena, run one
//! iteration at a time on its own stream. Same contract as
//! [`crate::exec::cpu::CpuProgram`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cudnn::Cudnn;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr};
use lanes_adaptor::{
    DType, NodeId, Op, Outlet, Tensor, TensorData, TensorType, ValidGraph, VarValues,
};

use super::conv::ConvPlan;
use super::device::{gpu, Gpu};
use crate::exec::ExecError;

/// Precision switches. The defaults equal PyTorch's: matrix products in plain
/// FP32 (`torch.backends.cuda.matmul.allow_tf32 = False`), convolutions may
/// use TF32 tensor cores (`torch.backends.cudnn.allow_tf32 = True`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Let cuDNN use TF32 tensor cores for FP32 convolutions.
    pub conv_tf32: bool,
    /// Let cuBLAS use TF32 tensor cores for FP32 matrix products.
    pub matmul_tf32: bool,
    /// Record the iteration's launches once as a CUDA graph and replay it
    /// (addresses never change, so the graph stays valid); falls back to
    /// launching op by op if capture fails.
    pub cuda_graph: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            conv_tf32: true,
            matmul_tf32: false,
            cuda_graph: true,
        }
    }
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
    pub(super) workspace: u64,
    pub(super) workspace_bytes: usize,
    pub(super) options: CudaOptions,
    /// The recorded iteration, once captured.
    captured: Option<CudaGraph>,
    /// Capture failed once: launch op by op from then on.
    capture_failed: bool,
    // Kept for their lifetimes: every address above points into these.
    _arena: CudaSlice<u8>,
    _blas_workspace: CudaSlice<u8>,
    _workspace: Option<CudaSlice<u8>>,
    _cudnn: Arc<Cudnn>,
    arena_bytes: usize,
}

impl std::fmt::Debug for CudaProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaProgram")
            .field("device", &self.gpu.info.name)
            .field("nodes", &self.graph.graph().nodes.len())
            .field("arena_bytes", &self.arena_bytes)
            .field("workspace_bytes", &self.workspace_bytes)
            .field("options", &self.options)
            .finish()
    }
}

// SAFETY: the cuDNN handle and descriptors (the only members that are not
// `Send`) are owned by this program and used only through `&mut self` or
// `&self` methods of it, so they are never used from two threads at once;
// cuDNN allows a handle to move between threads when calls do not overlap.
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
        let gpu = gpu()?;
        gpu.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let stream = gpu.ctx.new_stream().map_err(|e| dev_err("stream", e))?;
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
        let blas_ws = stream
            .alloc_zeros::<u8>(CUBLAS_WORKSPACE)
            .map_err(|e| dev_err("allocating the cuBLAS workspace", e))?;
        {
            let (p, _sync) = blas_ws.device_ptr(&stream);
            // SAFETY: `p` is a live allocation of CUBLAS_WORKSPACE bytes kept
            // alive as long as the handle (both are fields of the program).
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    p as *mut std::ffi::c_void,
                    CUBLAS_WORKSPACE,
                )
            }
            .result()
            .map_err(|e| dev_err("cuBLAS workspace", e))?;
        }
        let cudnn = Cudnn::new(stream.clone()).map_err(|e| dev_err("cuDNN", e))?;

        // Layout: every output of every node gets its own aligned range;
        // a reshape of anything but a variable aliases its input.
        let mut slots: Vec<Vec<Slot>> = vec![Vec::new(); g.nodes.len()];
        let mut total = 0usize;
        for &id in graph.order() {
            let node = &g.nodes[id.index()];
            let mut outs = Vec::with_capacity(node.outputs.len());
            for ty in &node.outputs {
                let n = ty.shape.checked_numel().unwrap_or(usize::MAX);
                if n > MAX_ELEMS {
                    return Err(op_err(
                        id,
                        node,
                        format!("{ty} is too large for this backend"),
                    ));
                }
                if let (Op::Reshape { .. }, Some(src)) = (&node.op, node.inputs.first()) {
                    let src_node = &g.nodes[src.node.index()];
                    if !matches!(src_node.op, Op::Variable(_)) {
                        let off = slots[src.node.index()][src.slot as usize].off;
                        outs.push(Slot {
                            off,
                            ty: ty.clone(),
                        });
                        continue;
                    }
                }
                let bytes = ty.bytes().max(1);
                outs.push(Slot {
                    off: total,
                    ty: ty.clone(),
                });
                total = total
                    .checked_add(bytes.div_ceil(ALIGN) * ALIGN)
                    .ok_or_else(|| op_err(id, node, "arena size overflows".into()))?;
            }
            slots[id.index()] = outs;
        }
        let arena_bytes = total.max(ALIGN);
        let arena = stream
            .alloc_zeros::<u8>(arena_bytes)
            .map_err(|e| dev_err(&format!("allocating {arena_bytes} bytes"), e))?;
        let base = {
            let (p, _sync) = arena.device_ptr(&stream);
            p
        };

        let mut convs = HashMap::new();
        let mut ws_bytes = 0usize;
        for &id in graph.order() {
            let node = &g.nodes[id.index()];
            let in_ty = |k: usize| -> Result<TensorType, ExecError> {
                let o = node
                    .inputs
                    .get(k)
                    .ok_or_else(|| op_err(id, node, "missing input".into()))?;
                Ok(slots[o.node.index()][o.slot as usize].ty.clone())
            };
            let plan = match &node.op {
                Op::Conv2d(a) => Some(ConvPlan::forward(
                    &cudnn,
                    a,
                    in_ty(0)?.shape.dims(),
                    in_ty(1)?.shape.dims(),
                    node.outputs[0].shape.dims(),
                    options.conv_tf32,
                )),
                Op::Conv2dGradInput { attrs, .. } => Some(ConvPlan::backward_data(
                    &cudnn,
                    attrs,
                    node.outputs[0].shape.dims(),
                    in_ty(1)?.shape.dims(),
                    in_ty(0)?.shape.dims(),
                    options.conv_tf32,
                )),
                Op::Conv2dGradFilter { attrs, .. } => Some(ConvPlan::backward_filter(
                    &cudnn,
                    attrs,
                    in_ty(0)?.shape.dims(),
                    node.outputs[0].shape.dims(),
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
        let ws = if ws_bytes > 0 {
            Some(
                stream
                    .alloc_zeros::<u8>(ws_bytes)
                    .map_err(|e| dev_err("allocating the cuDNN workspace", e))?,
            )
        } else {
            None
        };
        let workspace = ws
            .as_ref()
            .map(|w| {
                let (p, _sync) = w.device_ptr(&stream);
                p
            })
            .unwrap_or(0);

        let prog = CudaProgram {
            graph,
            gpu,
            stream,
            blas,
            slots,
            base,
            convs,
            workspace,
            workspace_bytes: ws_bytes,
            options,
            captured: None,
            capture_failed: false,
            _arena: arena,
            _blas_workspace: blas_ws,
            _workspace: ws,
            _cudnn: cudnn,
            arena_bytes,
        };
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

    /// Bytes of device memory this program holds (arena plus cuDNN workspace).
    pub fn device_bytes(&self) -> usize {
        self.arena_bytes + self.workspace_bytes
    }

    /// Name of the GPU.
    pub fn device_name(&self) -> &str {
        &self.gpu.info.name
    }

    pub(super) fn slot(&self, o: Outlet) -> &Slot {
        &self.slots[o.node.index()][o.slot as usize]
    }

    pub(super) fn addr(&self, o: Outlet) -> u64 {
        self.base + self.slot(o).off as u64
    }

    fn upload(&self, o: Outlet, t: &Tensor) -> Result<(), ExecError> {
        let dst = self.addr(o);
        // SAFETY: `dst` is the start of this outlet's range in the arena,
        // which holds exactly `t.ty().bytes()` bytes (types were checked), and
        // the host slice lives until the stream is synchronised by the caller.
        let r = unsafe {
            match t.data() {
                TensorData::F32(v) => {
                    cudarc::driver::result::memcpy_htod_async(dst, v, self.stream.cu_stream())
                }
                TensorData::I64(v) => {
                    cudarc::driver::result::memcpy_htod_async(dst, v, self.stream.cu_stream())
                }
            }
        };
        r.map_err(|e| dev_err("host to device copy", e))
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
        };
        Tensor::new(s.ty.shape.clone(), data).map_err(|e| dev_err("result", e))
    }

    pub(super) fn sync(&self) -> Result<(), ExecError> {
        self.stream
            .synchronize()
            .map_err(|e| dev_err("stream synchronize", e))
    }

    /// Runs one iteration: feeds by placeholder name, fetches by `"node"` or
    /// `"node:slot"`, returns fetched tensors in order.
    pub fn run(
        &mut self,
        feeds: &BTreeMap<String, Tensor>,
        fetches: &[String],
    ) -> Result<Vec<Tensor>, ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
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
        for (o, t) in feed_list {
            self.upload(o, t)?;
        }
        self.iterate()?;
        let r = outs.iter().map(|&o| self.download(o)).collect();
        self.sync()?;
        r
    }

    /// Launches every node in order, or replays the recorded graph.
    fn iterate(&mut self) -> Result<(), ExecError> {
        if !self.options.cuda_graph || self.capture_failed {
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
                _ => {
                    // Nothing ran while capturing: run op by op instead.
                    self.capture_failed = true;
                    return self.launch_nodes();
                }
            }
        }
        match &self.captured {
            Some(g) => g.launch().map_err(|e| dev_err("graph launch", e)),
            None => self.launch_nodes(),
        }
    }

    fn launch_nodes(&self) -> Result<(), ExecError> {
        for &id in self.graph.order() {
            self.exec(id)?;
        }
        Ok(())
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
            out.insert(n.clone(), self.download(Outlet::new(id, 0))?);
        }
        Ok(out)
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
        for (o, t) in todo {
            self.upload(o, t)?;
        }
        self.sync()
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
