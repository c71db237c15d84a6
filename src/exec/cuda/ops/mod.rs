//! One node at a time: each op becomes kernel launches, a cuBLAS call or a
//! cuDNN call on the program's stream, on arena addresses.

mod copy;
mod dtypes;
mod gemm;
mod geometry;
mod optim;

use cudarc::driver::LaunchConfig;
use lanes_adaptor::{NodeId, Op, TensorType};

use super::device::{blocks, grid, launch, warps, ArgRef};
use super::elem::Elem;
use super::program::{op_err, CudaProgram};
use crate::exec::ExecError;
use dtypes::cast_kernel;
pub(super) use dtypes::check_half;
pub(super) use geometry::plane_rows;
use geometry::{
    around, bcast_strides, collapse, contiguous_strides, i, plane_cols, plane_grid, plane_parallel,
    plane_vec4, pool, prod, red, repeats, strided, MAXR,
};

impl CudaProgram {
    pub(super) fn k(
        &self,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[&dyn ArgRef],
    ) -> Result<(), ExecError> {
        let f = self.gpu.kernel(name)?;
        // SAFETY: every call site below passes the kernel's parameters in
        // order with matching types (u64 for pointers, i32, f32, the
        // `#[repr(C)]` structs above), and addresses of arena ranges whose
        // types were inferred and checked at validation, so the indices a
        // kernel derives from the shape arguments stay inside them.
        unsafe { launch(&self.stream, f, cfg, args) }
    }

    /// Launches the `elem` instance of typed kernel `name` (see
    /// `device.rs`'s `TYPED`).
    pub(super) fn kt(
        &self,
        name: &'static str,
        elem: Elem,
        cfg: LaunchConfig,
        args: &[&dyn ArgRef],
    ) -> Result<(), ExecError> {
        let f = self.gpu.typed(name, elem)?;
        // SAFETY: as for `k`: the instances of one typed kernel share its
        // parameter list, with pointers to elements of `elem`, which the
        // call sites pass for tensors of that dtype.
        unsafe { launch(&self.stream, f, cfg, args) }
    }

    /// Runs `f` with the process's cuDNN handle bound to this program's
    /// stream (`handles.rs`); a cuDNN failure is reported as `err` makes it.
    fn with_cudnn(
        &self,
        err: impl Fn(String) -> ExecError,
        f: impl FnOnce(cudarc::cudnn::sys::cudnnHandle_t) -> Result<(), cudarc::cudnn::CudnnError>,
    ) -> Result<(), ExecError> {
        super::handles::dnn()?
            .with(&self.stream, f)?
            .map_err(|e| err(format!("cuDNN: {e:?}")))
    }

    /// Runs node `id`.
    pub(super) fn exec(&self, id: NodeId) -> Result<(), ExecError> {
        let g = self.graph.graph();
        let node = &g.nodes[id.index()];
        let err = |reason: String| op_err(id, node, reason);
        let inp: Vec<u64> = node.inputs.iter().map(|&o| self.addr(o)).collect();
        let ity: Vec<&TensorType> = node.inputs.iter().map(|&o| &self.slot(o).ty).collect();
        let out: Vec<u64> = (0..node.outputs.len())
            .map(|k| self.addr(lanes_adaptor::Outlet::new(id, k as u32)))
            .collect();
        let oty = &node.outputs;
        let rank_err = || err(format!("rank above {MAXR} is not supported on CUDA"));
        let n_out = oty.first().map(|t| t.shape.numel()).unwrap_or(0);
        let n32 = i(n_out);
        // The float element type of the first output, for the typed
        // kernels (an op on integers never reaches one of them).
        let elem = || {
            oty.first()
                .and_then(|t| Elem::of(t.dtype))
                .ok_or_else(|| err("expected a float output".into()))
        };
        match &node.op {
            Op::Placeholder(_) | Op::Variable(_) | Op::Constant(_) => Ok(()),
            Op::Add | Op::Sub | Op::Mul | Op::Div => {
                let mut code: i32 = match node.op {
                    Op::Add => 0,
                    Op::Sub => 1,
                    Op::Mul => 2,
                    _ => 3,
                };
                let (mut a, mut b) = (ity[0].shape.dims(), ity[1].shape.dims());
                let (mut pa, mut pb) = (inp[0], inp[1]);
                let o = oty[0].shape.dims();
                // The repeating operand first (bias + x): swap so the row
                // kernel below applies; Sub and Div become their reversed
                // codes (4: b - a, 5: b / a).
                if b == o && a != o && repeats(a, o) {
                    std::mem::swap(&mut a, &mut b);
                    std::mem::swap(&mut pa, &mut pb);
                    code = match code {
                        1 => 4,
                        3 => 5,
                        c => c,
                    };
                }
                // b's dims (leading 1s dropped) are a suffix of out's: b repeats.
                let b_core: &[usize] = {
                    let lead = b.iter().take_while(|&&d| d == 1).count();
                    &b[lead..]
                };
                let e = elem()?;
                let f32x4 = e == Elem::F32;
                if f32x4 && a == o && b == o && n_out % 4 == 0 && (out[0] | pa | pb) % 16 == 0 {
                    let n4 = i(n_out / 4);
                    self.k(
                        "binary_same4",
                        grid(n_out / 4),
                        &[&out[0], &pa, &pb, &n4, &code],
                    )
                } else if a == o && b == o {
                    self.kt(
                        "binary_same",
                        e,
                        grid(n_out),
                        &[&out[0], &pa, &pb, &n32, &code],
                    )
                } else if a == o && !b_core.is_empty() && o.ends_with(b_core) {
                    let len = i(prod(b_core));
                    self.kt(
                        "binary_row",
                        e,
                        grid(n_out),
                        &[&out[0], &pa, &pb, &n32, &len, &code],
                    )
                } else {
                    // Both operands' strides over the fewest axes; rows of
                    // the innermost one when it is long enough to fill a
                    // warp, else the per-element index walk.
                    let (d, sa, sb) = collapse(o, &bcast_strides(a, o), &bcast_strides(b, o));
                    let last = d.len() - 1;
                    let inner = d[last];
                    if n_out > 0 && inner >= 32 && sa[last] <= 1 && sb[last] <= 1 {
                        let rows = prod(&d[..last]);
                        let s =
                            strided(&d[..last], &sa[..last], &sb[..last]).ok_or_else(rank_err)?;
                        // About 2,048 blocks in all, each thread looping
                        // over its row: one block per 256 elements ran the
                        // [8, 12, 512, 512] mask add at 0.98 ms on an H200,
                        // 2,048 blocks at 0.09 (one elementwise pass).
                        let threads = inner.next_multiple_of(32).min(256);
                        let per_row = 2048usize.div_ceil(rows).clamp(1, inner.div_ceil(threads));
                        let cfg = LaunchConfig {
                            grid_dim: (per_row as u32, rows.min(65535) as u32, 1),
                            block_dim: (threads as u32, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let (rows, inner) = (i(rows), i(inner));
                        let (ia, ib) = (i(sa[last]), i(sb[last]));
                        return self.kt(
                            "binary_rows",
                            e,
                            cfg,
                            &[&out[0], &pa, &pb, &rows, &inner, &ia, &ib, &code, &s],
                        );
                    }
                    let s = strided(&d, &sa, &sb).ok_or_else(rank_err)?;
                    self.kt(
                        "binary_bcast",
                        e,
                        grid(n_out),
                        &[&out[0], &pa, &pb, &n32, &code, &s],
                    )
                }
            }
            Op::Relu
            | Op::Gelu
            | Op::Sigmoid
            | Op::Tanh
            | Op::Exp
            | Op::Log
            | Op::Sqrt
            | Op::Scale(_)
            | Op::Erf
            | Op::IsNan
            | Op::HardSigmoid
            | Op::HardSwish => {
                let (code, p): (i32, f32) = match node.op {
                    Op::Relu => (0, 0.0),
                    Op::Gelu => (1, 0.0),
                    Op::Sigmoid => (2, 0.0),
                    Op::Tanh => (3, 0.0),
                    Op::Exp => (4, 0.0),
                    Op::Log => (5, 0.0),
                    Op::Sqrt => (6, 0.0),
                    Op::Scale(f) => (7, f),
                    Op::Erf => (8, 0.0),
                    Op::IsNan => (9, 0.0),
                    Op::HardSigmoid => (10, 0.0),
                    Op::HardSwish => (11, 0.0),
                    _ => (7, 1.0),
                };
                let e = elem()?;
                if e == Elem::F32 && n_out % 4 == 0 && (out[0] | inp[0]) % 16 == 0 {
                    let n4 = i(n_out / 4);
                    self.k(
                        "unary4",
                        grid(n_out / 4),
                        &[&out[0], &inp[0], &n4, &code, &p],
                    )
                } else {
                    self.kt(
                        "unary",
                        e,
                        grid(n_out),
                        &[&out[0], &inp[0], &n32, &code, &p],
                    )
                }
            }
            Op::Clip { min, max } => self.kt(
                "clip",
                elem()?,
                grid(n_out),
                &[&out[0], &inp[0], &n32, min, max],
            ),
            Op::Where => {
                let o = oty[0].shape.dims();
                // Each operand whole (1) or a single value (0), else None.
                let flat = |t: &TensorType| {
                    if t.shape.dims() == o {
                        Some(1i32)
                    } else if t.shape.numel() == 1 {
                        Some(0i32)
                    } else {
                        None
                    }
                };
                if let (Some(kc), Some(ka), Some(kb)) = (flat(ity[0]), flat(ity[1]), flat(ity[2])) {
                    let aligned = |p: u64, k: i32| k == 0 || p % 16 == 0;
                    let vec4 = n_out % 4 == 0
                        && out[0] % 16 == 0
                        && aligned(inp[0], kc)
                        && aligned(inp[1], ka)
                        && aligned(inp[2], kb);
                    return if vec4 {
                        let n4 = i(n_out / 4);
                        self.k(
                            "where_flat4",
                            grid(n_out / 4),
                            &[&out[0], &inp[0], &inp[1], &inp[2], &n4, &kc, &ka, &kb],
                        )
                    } else {
                        self.k(
                            "where_flat",
                            grid(n_out),
                            &[&out[0], &inp[0], &inp[1], &inp[2], &n32, &kc, &ka, &kb],
                        )
                    };
                }
                let s = strided(
                    o,
                    &bcast_strides(ity[0].shape.dims(), o),
                    &bcast_strides(ity[1].shape.dims(), o),
                )
                .ok_or_else(rank_err)?;
                let t = strided(
                    o,
                    &contiguous_strides(o),
                    &bcast_strides(ity[2].shape.dims(), o),
                )
                .ok_or_else(rank_err)?;
                self.k(
                    "where_bcast",
                    grid(n_out),
                    &[&out[0], &inp[0], &inp[1], &inp[2], &n32, &s, &t],
                )
            }
            Op::Cast { to } => {
                let (from, to) = (ity[0].dtype, *to);
                if from == to {
                    return self.copy(out[0], inp[0], oty[0].bytes());
                }
                let name = cast_kernel(from, to)
                    .ok_or_else(|| err(format!("no cast from {from:?} to {to:?} on CUDA")))?;
                self.k(name, grid(n_out), &[&out[0], &inp[0], &n32])
            }
            Op::DropoutMask { p, salt, .. } => {
                let threshold = lanes_adaptor::graph::op::dropout_threshold(*p);
                let scale = 1.0f32 / (1.0 - p);
                self.k(
                    "dropout_mask",
                    grid(n_out),
                    &[&out[0], &inp[0], &n32, salt, &threshold, &scale],
                )
            }
            Op::ReluGrad
            | Op::GeluGrad
            | Op::SigmoidGrad
            | Op::TanhGrad
            | Op::HardSigmoidGrad
            | Op::HardSwishGrad => {
                let code: i32 = match node.op {
                    Op::ReluGrad => 0,
                    Op::GeluGrad => 1,
                    Op::SigmoidGrad => 2,
                    Op::HardSigmoidGrad => 4,
                    Op::HardSwishGrad => 5,
                    _ => 3,
                };
                self.kt(
                    "unary_grad",
                    elem()?,
                    grid(n_out),
                    &[&out[0], &inp[0], &inp[1], &n32, &code],
                )
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let (outer, d, inner) = around(ity[0].shape.dims(), *axis);
                let rows = outer * inner;
                let log: i32 = matches!(node.op, Op::LogSoftmax { .. }).into();
                let (rows32, d32, inner32) = (i(rows), i(d), i(inner));
                self.k(
                    "softmax",
                    warps(rows),
                    &[&out[0], &inp[0], &rows32, &d32, &inner32, &log],
                )
            }
            Op::SoftmaxGrad { axis } | Op::LogSoftmaxGrad { axis } => {
                let (outer, d, inner) = around(ity[0].shape.dims(), *axis);
                let rows = outer * inner;
                let log: i32 = matches!(node.op, Op::LogSoftmaxGrad { .. }).into();
                let (rows32, d32, inner32) = (i(rows), i(d), i(inner));
                self.k(
                    "softmax_grad",
                    warps(rows),
                    &[&out[0], &inp[0], &inp[1], &rows32, &d32, &inner32, &log],
                )
            }
            // A view (`compile::views`): the output is the input's bytes.
            Op::Reshape { .. } if out[0] == inp[0] => Ok(()),
            Op::Reshape { .. } => self.copy(out[0], inp[0], oty[0].bytes()),
            Op::Assign => self.copy(inp[0], inp[1], ity[0].bytes()),
            Op::Transpose { perm } => {
                let d = ity[0].shape.dims();
                let st = contiguous_strides(d);
                let o = oty[0].shape.dims();
                let sb: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
                let s = strided(o, &contiguous_strides(o), &sb).ok_or_else(rank_err)?;
                self.strided_copy(oty[0].dtype, out[0], inp[0], s, 0, 0)
            }
            Op::Slice { axis, start, .. } => {
                let st = contiguous_strides(ity[0].shape.dims());
                let o = oty[0].shape.dims();
                let s = strided(o, &contiguous_strides(o), &st).ok_or_else(rank_err)?;
                self.strided_copy(oty[0].dtype, out[0], inp[0], s, 0, start * st[*axis])
            }
            Op::SliceGrad { axis, start, .. } => {
                self.fill_as(elem()?, out[0], n_out, 0.0)?;
                let ost = contiguous_strides(oty[0].shape.dims());
                let d = ity[0].shape.dims();
                let s = strided(d, &ost, &contiguous_strides(d)).ok_or_else(rank_err)?;
                self.strided_copy(oty[0].dtype, out[0], inp[0], s, start * ost[*axis], 0)
            }
            Op::Concat { axis } => {
                let ost = contiguous_strides(oty[0].shape.dims());
                let mut at = 0usize;
                for (k, t) in ity.iter().enumerate() {
                    let d = t.shape.dims();
                    let s = strided(d, &ost, &contiguous_strides(d)).ok_or_else(rank_err)?;
                    self.strided_copy(oty[0].dtype, out[0], inp[k], s, at * ost[*axis], 0)?;
                    at += d[*axis];
                }
                Ok(())
            }
            Op::BroadcastTo { .. } => {
                let o = oty[0].shape.dims();
                let s = strided(
                    o,
                    &contiguous_strides(o),
                    &bcast_strides(ity[0].shape.dims(), o),
                )
                .ok_or_else(rank_err)?;
                self.strided_copy(oty[0].dtype, out[0], inp[0], s, 0, 0)
            }
            Op::SumTo { shape } => {
                let d = ity[0].shape.dims();
                let off = d.len() - shape.len();
                let flags: Vec<bool> = (0..d.len())
                    .map(|k| k < off || (shape[k - off] == 1 && d[k] != 1))
                    .collect();
                self.reduce(elem()?, out[0], inp[0], d, &flags, false, false)
                    .and_then(|r| r.ok_or_else(rank_err))
            }
            Op::ReduceSum { axes, .. }
            | Op::ReduceMean { axes, .. }
            | Op::ReduceMax { axes, .. } => {
                let d = ity[0].shape.dims();
                let flags: Vec<bool> = (0..d.len()).map(|k| axes.contains(&k)).collect();
                let mean = matches!(node.op, Op::ReduceMean { .. });
                let max = matches!(node.op, Op::ReduceMax { .. });
                self.reduce(elem()?, out[0], inp[0], d, &flags, mean, max)
                    .and_then(|r| r.ok_or_else(rank_err))
            }
            Op::ReduceMaxGrad { axes, .. } => {
                self.fill(out[0], n_out, 0.0)?;
                let d = ity[0].shape.dims();
                let flags: Vec<bool> = (0..d.len()).map(|k| axes.contains(&k)).collect();
                let (r, no, nr) = red(d, &flags).ok_or_else(rank_err)?;
                let (no32, nr32) = (i(no), i(nr));
                self.k(
                    "reduce_max_grad",
                    warps(no),
                    &[&out[0], &inp[0], &inp[1], &inp[2], &no32, &nr32, &r],
                )
            }
            Op::MatMul {
                transpose_a,
                transpose_b,
            } => self
                .matmul(
                    elem()?,
                    (inp[0], ity[0].shape.dims()),
                    (inp[1], ity[1].shape.dims()),
                    *transpose_a,
                    *transpose_b,
                    (out[0], oty[0].shape.dims()),
                )
                .map_err(err),
            Op::Conv2d(_) | Op::Conv2dGradInput { .. } | Op::Conv2dGradFilter { .. } => {
                let plan = self
                    .convs
                    .get(&id.index())
                    .ok_or_else(|| err("no convolution plan".into()))?;
                let (ws, ws_bytes) = self.cudnn_workspace();
                // SAFETY: the plan's descriptors were made from these very
                // types; the workspace holds the largest size any plan asked.
                self.with_cudnn(err, |h| unsafe {
                    plan.run(h, inp[0], inp[1], out[0], ws, ws_bytes)
                })?;
                // A bias whose add moved into a fused chain is added there.
                let bias = inp
                    .get(2)
                    .filter(|_| self.fusion.role(id) != super::fuse::Role::ConvWithoutBias);
                if let (Op::Conv2d(_), Some(bias)) = (&node.op, bias) {
                    let d = oty[0].shape.dims();
                    let (c, inner) = (i(d[1]), i(d[2] * d[3]));
                    self.kt(
                        "channel_bias",
                        elem()?,
                        grid(n_out),
                        &[&out[0], bias, &n32, &c, &inner],
                    )?;
                }
                Ok(())
            }
            Op::MaxPool2d(p) => {
                let pp = pool(ity[0].shape.dims(), oty[0].shape.dims(), p);
                self.k("maxpool", grid(n_out), &[&out[0], &inp[0], &pp])
            }
            Op::AvgPool2d {
                pool: p,
                count_include_pad,
            } => {
                let pp = pool(ity[0].shape.dims(), oty[0].shape.dims(), p);
                let inc: i32 = (*count_include_pad).into();
                self.k("avgpool", grid(n_out), &[&out[0], &inp[0], &pp, &inc])
            }
            Op::MaxPool2dGrad(p) => {
                self.fill(out[0], n_out, 0.0)?;
                let pp = pool(ity[0].shape.dims(), ity[1].shape.dims(), p);
                let ny = ity[1].shape.numel();
                self.k("maxpool_grad", grid(ny), &[&out[0], &inp[0], &inp[1], &pp])
            }
            Op::AvgPool2dGrad {
                pool: p,
                count_include_pad,
            } => {
                self.fill(out[0], n_out, 0.0)?;
                let pp = pool(ity[0].shape.dims(), ity[1].shape.dims(), p);
                let ny = ity[1].shape.numel();
                let inc: i32 = (*count_include_pad).into();
                self.k("avgpool_grad", grid(ny), &[&out[0], &inp[1], &pp, &inc])
            }
            Op::GlobalAvgPool => {
                let d = ity[0].shape.dims();
                let (rows, l) = (d[0] * d[1], d[2] * d[3]);
                let (rows32, l32) = (i(rows), i(l));
                self.k("row_mean", warps(rows), &[&out[0], &inp[0], &rows32, &l32])
            }
            Op::BatchNorm { eps } => {
                let d = ity[0].shape.dims();
                let (c, inner) = (i(d[1]), i(prod(&d[2..])));
                let planes = d[0] * d[1];
                if prod(&d[2..]) >= 32 && (1..=65_535).contains(&planes) {
                    let vec4 = prod(&d[2..]) % 4 == 0 && out[0] % 16 == 0 && inp[0] % 16 == 0;
                    let units = if vec4 {
                        prod(&d[2..]) / 4
                    } else {
                        prod(&d[2..])
                    };
                    let cfg = plane_rows(units, planes);
                    let v4 = i32::from(vec4);
                    return self.k(
                        "batchnorm_planes",
                        cfg,
                        &[
                            &out[0], &inp[0], &inp[1], &inp[2], &inp[3], &inp[4], &c, &inner, eps,
                            &v4,
                        ],
                    );
                }
                self.k(
                    "batchnorm_infer",
                    grid(n_out),
                    &[
                        &out[0], &inp[0], &inp[1], &inp[2], &inp[3], &inp[4], &n32, &c, &inner, eps,
                    ],
                )
            }
            Op::BatchNormTrain { eps, momentum } => {
                if let Some(plan) = self.bns.get(&id.index()) {
                    // SAFETY: the plan was made from these types; the
                    // handle is bound to the program's stream.
                    return self.with_cudnn(err, |h| unsafe {
                        plan.forward(
                            h,
                            inp[0],
                            out[0],
                            (inp[1], inp[2]),
                            (inp[3], inp[4]),
                            (out[1], out[2]),
                        )
                    });
                }
                let d = ity[0].shape.dims();
                let (nb, c, inner) = (i(d[0]), i(d[1]), i(prod(&d[2..])));
                let vec4 = i32::from(plane_vec4(d, &[out[0], inp[0]]));
                if plane_parallel(d) && prod(&d[2..]) >= 2 {
                    // Plane sums and M2s (2·N·C values) go into y's range,
                    // which bn_apply then writes.
                    self.k(
                        "bn_plane_stats",
                        plane_grid(d, vec4 != 0),
                        &[&out[0], &inp[0], &nb, &c, &inner, &vec4],
                    )?;
                    self.k(
                        "bn_stats_finish",
                        grid(d[1]),
                        &[
                            &out[1], &out[2], &inp[3], &inp[4], &out[0], &nb, &c, &inner, eps,
                            momentum,
                        ],
                    )?;
                } else {
                    self.k(
                        "bn_stats",
                        blocks(d[1], 256),
                        &[
                            &out[1], &out[2], &inp[3], &inp[4], &inp[0], &nb, &c, &inner, eps,
                            momentum,
                        ],
                    )?;
                }
                if let Some(cfg) = plane_cols(d, vec4 != 0) {
                    return self.k(
                        "bn_apply_planes",
                        cfg,
                        &[
                            &out[0], &inp[0], &out[1], &out[2], &inp[1], &inp[2], &c, &inner, &vec4,
                        ],
                    );
                }
                self.k(
                    "bn_apply",
                    grid(n_out),
                    &[
                        &out[0], &inp[0], &out[1], &out[2], &inp[1], &inp[2], &n32, &c, &inner,
                    ],
                )
            }
            Op::BatchNormTrainGrad => {
                let d = ity[0].shape.dims();
                let (nb, c, inner) = (i(d[0]), i(d[1]), i(prod(&d[2..])));
                let m = i(d[0] * prod(&d[2..]));
                let vec4 = i32::from(plane_vec4(d, &[out[0], inp[0], inp[4]]));
                if plane_parallel(d) && prod(&d[2..]) >= 2 {
                    // Plane sums (2·N·C values) go into dx's range, which
                    // bn_grad_dx then writes.
                    self.k(
                        "bn_grad_plane",
                        plane_grid(d, vec4 != 0),
                        &[
                            &out[0], &inp[0], &inp[2], &inp[3], &inp[4], &nb, &c, &inner, &vec4,
                        ],
                    )?;
                    self.k(
                        "bn_grad_finish",
                        grid(d[1]),
                        &[&out[1], &out[2], &out[0], &nb, &c],
                    )?;
                } else {
                    self.k(
                        "bn_grad_reduce",
                        blocks(d[1], 256),
                        &[
                            &out[1], &out[2], &inp[0], &inp[2], &inp[3], &inp[4], &nb, &c, &inner,
                        ],
                    )?;
                }
                if let Some(cfg) = plane_cols(d, vec4 != 0) {
                    return self.k(
                        "bn_grad_dx_planes",
                        cfg,
                        &[
                            &out[0], &inp[0], &inp[1], &inp[2], &inp[3], &inp[4], &out[1], &out[2],
                            &c, &inner, &m, &vec4,
                        ],
                    );
                }
                self.k(
                    "bn_grad_dx",
                    grid(n_out),
                    &[
                        &out[0], &inp[0], &inp[1], &inp[2], &inp[3], &inp[4], &out[1], &out[2],
                        &n32, &c, &inner, &m,
                    ],
                )
            }
            Op::LayerNorm { eps } => {
                let d = *ity[0].shape.dims().last().unwrap_or(&1);
                let rows = n_out / d.max(1);
                let (rows32, d32) = (i(rows), i(d));
                self.k(
                    "layernorm",
                    warps(rows),
                    &[&out[0], &inp[0], &inp[1], &inp[2], &rows32, &d32, eps],
                )
            }
            Op::LayerNormGrad { eps } => {
                let d = *ity[0].shape.dims().last().unwrap_or(&1);
                let rows = n_out / d.max(1);
                self.fill(out[1], d, 0.0)?;
                self.fill(out[2], d, 0.0)?;
                let (rows32, d32) = (i(rows), i(d));
                let args: [&dyn ArgRef; 9] = [
                    &out[0], &out[1], &out[2], &inp[0], &inp[1], &inp[2], &rows32, &d32, eps,
                ];
                // dgamma and dbeta summed per block in shared memory
                // (2·D floats, within the 48 KiB every launch may take);
                // 8 warps a block. Rows of at most 1,024 keep each lane's
                // terms in registers until the warp is done (at most 512
                // blocks, whose sums go to dg and db by atomics), longer
                // ones add each row's terms into shared memory (at most
                // 256 blocks).
                let shared = 2 * d * 4;
                if d <= 1024 {
                    let cfg = LaunchConfig {
                        grid_dim: (rows.div_ceil(8).clamp(1, 512) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: shared as u32,
                    };
                    self.k("layernorm_grad_reg", cfg, &args)
                } else if shared <= 48 * 1024 {
                    let cfg = LaunchConfig {
                        grid_dim: (rows.div_ceil(8).clamp(1, 256) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: shared as u32,
                    };
                    self.k("layernorm_grad", cfg, &args)
                } else {
                    self.k("layernorm_grad_wide", warps(rows), &args)
                }
            }
            Op::Embedding => {
                let t = ity[0].shape.dims();
                let n_idx = ity[1].shape.numel();
                let (ni, d, v) = (i(n_idx), i(t[1]), i(t[0]));
                self.k(
                    "embedding",
                    grid(n_out),
                    &[&out[0], &inp[0], &inp[1], &ni, &d, &v],
                )
            }
            Op::EmbeddingGrad { num_embeddings } => {
                self.fill(out[0], n_out, 0.0)?;
                let n_idx = ity[0].shape.numel();
                let d = *ity[1].shape.dims().last().unwrap_or(&1);
                let (ni, d32, v) = (i(n_idx), i(d), i(*num_embeddings));
                self.k(
                    "embedding_grad",
                    grid(n_idx * d),
                    &[&out[0], &inp[0], &inp[1], &ni, &d32, &v],
                )
            }
            Op::CrossEntropy => {
                let d = ity[0].shape.dims();
                let (n, c) = (d[0], d[1]);
                self.fill(out[0], 1, 0.0)?;
                let (n32, c32, scale) = (i(n), i(c), 1.0f32 / n as f32);
                self.k(
                    "cross_entropy",
                    warps(n),
                    &[&out[0], &inp[0], &inp[1], &n32, &c32, &scale],
                )
            }
            Op::CrossEntropyGrad => {
                let d = ity[0].shape.dims();
                let (n32, c32) = (i(d[0]), i(d[1]));
                self.k(
                    "cross_entropy_grad",
                    warps(d[0]),
                    &[&out[0], &inp[0], &inp[1], &inp[2], &n32, &c32],
                )
            }
            Op::MseLoss => {
                let n = i(ity[0].shape.numel());
                self.k(
                    "mse_loss",
                    blocks(1, 1024),
                    &[&out[0], &inp[0], &inp[1], &n],
                )
            }
            Op::SgdUpdate { .. }
            | Op::AdamUpdate { .. }
            | Op::AmpUnscale
            | Op::AmpScaleUpdate { .. } => self.update(node, &inp, &ity, &out),
        }
    }

    /// Sum (times 1/count when `mean`) or max of `dims` over the flagged
    /// axes into `out`, laid out as the kept axes in order. `None` if the
    /// rank is too high. Both tensors hold `elem`s (accumulated in f32).
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        elem: Elem,
        out: u64,
        inp: u64,
        dims: &[usize],
        flags: &[bool],
        mean: bool,
        max: bool,
    ) -> Result<Option<()>, ExecError> {
        let Some((r, no, nr)) = red(dims, flags) else {
            return Ok(None);
        };
        if no == 0 {
            return Ok(Some(()));
        }
        let scale = if mean { 1.0 / nr.max(1) as f32 } else { 1.0 };
        let op = i32::from(max);
        let (no32, nr32) = (i(no), i(nr));
        // The reduced axes lead, the kept ones trail: columns of a
        // [nr, no] matrix, which one warp per output would read strided.
        let k = flags.iter().take_while(|&&f| f).count();
        if k > 0 && flags[k..].iter().all(|&f| !f) && no >= 32 && nr >= 2 {
            return self
                .kt(
                    "reduce_cols",
                    elem,
                    LaunchConfig {
                        grid_dim: (no.div_ceil(8) as u32, 1, 1),
                        block_dim: (32, nr.div_ceil(4).min(32) as u32, 1),
                        shared_mem_bytes: 0,
                    },
                    &[&out, &inp, &no32, &nr32, &op, &scale],
                )
                .map(Some);
        }
        if nr >= 4096 && no < 1024 {
            self.kt(
                "reduce_block",
                elem,
                blocks(no, 512),
                &[&out, &inp, &no32, &nr32, &r, &op, &scale],
            )?;
        } else {
            self.kt(
                "reduce_warp",
                elem,
                warps(no),
                &[&out, &inp, &no32, &nr32, &r, &op, &scale],
            )?;
        }
        Ok(Some(()))
    }
}
