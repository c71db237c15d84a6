//! The arena's layout: the persistent region, the ephemeral tensors at the
//! memory plan's offsets, the workspaces; the cuDNN plans whose workspace
//! it holds, and what a program needs of its lane (`ephemeral_need`).

use super::*;
use crate::exec::cuda::algos::Pass;
use crate::exec::cuda::elem::Elem;

impl ArenaLayout {
    /// Plans the ephemeral region for `fetchable` after `persistent` bytes
    /// and places the workspaces after it.
    pub(super) fn new(
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
    pub(super) fn place(
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

/// A tensor of a node: its `i`th input or its output.
#[derive(Clone, Copy)]
enum At {
    In(usize),
    Out,
}

/// The cuDNN plan of every convolution node (forward, data and filter
/// gradients) and the largest workspace they ask for, from the process's
/// cuDNN handle (nothing launched).
pub(super) fn plan_convs(
    graph: &ValidGraph,
    options: CudaOptions,
) -> Result<(HashMap<usize, ConvPlan>, usize), ExecError> {
    crate::exec::cuda::handles::dnn()?.planning(|h| plan_convs_with(h, graph, options))?
}

fn plan_convs_with(
    h: cudarc::cudnn::sys::cudnnHandle_t,
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
        // The convolution's element type: its output's (inputs and output
        // share it, shape inference checked).
        let elem = || -> Result<Elem, ExecError> {
            Elem::of(out()?.dtype).ok_or_else(|| op_err(id, node, "an integer convolution".into()))
        };
        // Where the forward convolution's x, w and y are among the node's
        // inputs and output, for each pass.
        let pass = match &node.op {
            Op::Conv2d(a) => Some((Pass::Forward, a, [At::In(0), At::In(1), At::Out])),
            Op::Conv2dGradInput { attrs, .. } => {
                Some((Pass::BackwardData, attrs, [At::Out, At::In(1), At::In(0)]))
            }
            Op::Conv2dGradFilter { attrs, .. } => {
                Some((Pass::BackwardFilter, attrs, [At::In(0), At::Out, At::In(1)]))
            }
            _ => None,
        };
        if let Some((pass, a, [x, w, y])) = pass {
            let dims = |at: At| -> Result<&[usize], ExecError> {
                Ok(match at {
                    At::In(i) => in_ty(i)?.shape.dims(),
                    At::Out => out()?.shape.dims(),
                })
            };
            let (x, w, y) = (dims(x)?, dims(w)?, dims(y)?);
            let p = ConvPlan::new(h, pass, elem()?, a, x, w, y, options.conv_tf32)
                .map_err(|e| op_err(id, node, format!("cuDNN: {e:?}")))?;
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
    let (_, ws) = plan_convs(graph, CudaOptions::default())?;
    ephemeral_extent(planned, ws).map(|(_, _, extent)| extent as u64)
}

/// The ephemeral part of an arena for a plan's T and a cuDNN workspace:
/// (T, cuDNN workspace, the whole part with the cuBLAS workspace), each
/// rounded to the arena alignment. One formula for the program's layout
/// and for what admission counts.
pub(super) fn ephemeral_extent(
    planned: u64,
    cudnn: usize,
) -> Result<(usize, usize, usize), ExecError> {
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
