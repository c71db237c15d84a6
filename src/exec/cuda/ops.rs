//! One node at a time: each op becomes kernel launches, a cuBLAS call or a
//! cuDNN call on the program's stream, on arena addresses.

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use lanes_adaptor::{DType, NodeId, Op, Pool2dAttrs, TensorType};

use super::device::{blocks, grid, launch, warps, ArgRef};
use super::program::{dev_err, half_unsupported, op_err, CudaProgram};
use crate::exec::ExecError;

const MAXR: usize = 8;

/// Index space plus two stride sets (see `elementwise.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Strided {
    rank: i32,
    dims: [i32; MAXR],
    sa: [i32; MAXR],
    sb: [i32; MAXR],
}
// SAFETY: plain `#[repr(C)]` integers, laid out as the CUDA struct `Strided`.
unsafe impl DeviceRepr for Strided {}

/// Reduction geometry (see `reduce.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Red {
    orank: i32,
    odims: [i32; MAXR],
    ostr: [i32; MAXR],
    rrank: i32,
    rdims: [i32; MAXR],
    rstr: [i32; MAXR],
}
// SAFETY: plain `#[repr(C)]` integers, laid out as the CUDA struct `Red`.
unsafe impl DeviceRepr for Red {}

/// Pooling geometry (see `nn.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Pool {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    oh: i32,
    ow: i32,
    kh: i32,
    kw: i32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
}
// SAFETY: plain `#[repr(C)]` integers, laid out as the CUDA struct `Pool`.
unsafe impl DeviceRepr for Pool {}

fn contiguous_strides(d: &[usize]) -> Vec<usize> {
    let mut s = vec![1; d.len()];
    for i in (0..d.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * d[i + 1];
    }
    s
}

fn prod(d: &[usize]) -> usize {
    d.iter().product()
}

fn i(v: usize) -> i32 {
    // Every tensor was checked to hold at most i32::MAX elements.
    v as i32
}

/// Strides of `src` (right-aligned) read at the indices of `out`, 0 on
/// broadcast axes.
fn bcast_strides(src: &[usize], out: &[usize]) -> Vec<usize> {
    let s = contiguous_strides(src);
    let off = out.len() - src.len();
    (0..out.len())
        .map(|k| {
            if k < off || src[k - off] == 1 {
                0
            } else {
                s[k - off]
            }
        })
        .collect()
}

fn strided(dims: &[usize], sa: &[usize], sb: &[usize]) -> Option<Strided> {
    if dims.len() > MAXR {
        return None;
    }
    let mut s = Strided {
        rank: dims.len() as i32,
        ..Default::default()
    };
    for k in 0..dims.len() {
        s.dims[k] = i(dims[k]);
        s.sa[k] = i(sa[k]);
        s.sb[k] = i(sb[k]);
    }
    Some(s)
}

/// Reduction of `dims` over `axes` (each a flag per axis).
fn red(dims: &[usize], reduced: &[bool]) -> Option<(Red, usize, usize)> {
    if dims.len() > MAXR {
        return None;
    }
    let st = contiguous_strides(dims);
    let mut r = Red::default();
    let (mut n_out, mut n_red) = (1usize, 1usize);
    for k in 0..dims.len() {
        if reduced[k] {
            let j = r.rrank as usize;
            r.rdims[j] = i(dims[k]);
            r.rstr[j] = i(st[k]);
            r.rrank += 1;
            n_red *= dims[k];
        } else {
            let j = r.orank as usize;
            r.odims[j] = i(dims[k]);
            r.ostr[j] = i(st[k]);
            r.orank += 1;
            n_out *= dims[k];
        }
    }
    Some((r, n_out, n_red))
}

fn pool(x: &[usize], y: &[usize], p: &Pool2dAttrs) -> Pool {
    Pool {
        n: i(x[0]),
        c: i(x[1]),
        h: i(x[2]),
        w: i(x[3]),
        oh: i(y[2]),
        ow: i(y[3]),
        kh: i(p.kernel[0]),
        kw: i(p.kernel[1]),
        sh: i(p.stride[0]),
        sw: i(p.stride[1]),
        ph: i(p.padding[0]),
        pw: i(p.padding[1]),
    }
}

/// [outer, axis, inner] view of `dims` around `axis`.
fn around(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (prod(&dims[..axis]), dims[axis], prod(&dims[axis + 1..]))
}

/// Whether `a` (leading 1s dropped) is a non-empty suffix of `o`: it
/// repeats along o's leading axes.
fn repeats(a: &[usize], o: &[usize]) -> bool {
    let lead = a.iter().take_while(|&&d| d == 1).count();
    let core = &a[lead..];
    !core.is_empty() && o.ends_with(core)
}

/// A strided copy after merging axes and widening its unit.
#[derive(Debug, Clone, Copy)]
struct CopyPlan {
    s: Strided,
    ob: usize,
    ib: usize,
    /// Bytes moved per index: 4, 8 or 16.
    unit: usize,
}

impl CopyPlan {
    /// `None` when there is nothing to copy. `out` and `inp` are the base
    /// addresses (their alignment decides the widest unit).
    fn new(s: &Strided, ob: usize, ib: usize, esize: usize, out: u64, inp: u64) -> Option<Self> {
        let rank = s.rank as usize;
        let mut dims = Vec::with_capacity(rank);
        let mut sa = Vec::with_capacity(rank);
        let mut sb = Vec::with_capacity(rank);
        for k in 0..rank {
            let d = s.dims[k] as usize;
            if d == 0 {
                return None;
            }
            if d > 1 {
                dims.push(d);
                sa.push(s.sa[k] as usize);
                sb.push(s.sb[k] as usize);
            }
        }
        // Merge an axis into the next when both sides step over it as one.
        let mut k = dims.len();
        while k >= 2 {
            let (j, n) = (k - 2, k - 1);
            if sa[j] == sa[n] * dims[n] && sb[j] == sb[n] * dims[n] {
                dims[j] *= dims[n];
                sa[j] = sa[n];
                sb[j] = sb[n];
                dims.remove(n);
                sa.remove(n);
                sb.remove(n);
            }
            k -= 1;
        }
        let (mut ob, mut ib, mut unit) = (ob, ib, esize);
        if let (Some(&1), Some(&1)) = (sa.last(), sb.last()) {
            let r = dims.len();
            for w in [16usize, 8] {
                if w <= esize {
                    continue;
                }
                let f = w / esize;
                let fits = dims[r - 1] % f == 0
                    && sa[..r - 1].iter().chain(&sb[..r - 1]).all(|&x| x % f == 0)
                    && ob % f == 0
                    && ib % f == 0
                    && out % w as u64 == 0
                    && inp % w as u64 == 0;
                if fits {
                    dims[r - 1] /= f;
                    for x in sa[..r - 1].iter_mut().chain(sb[..r - 1].iter_mut()) {
                        *x /= f;
                    }
                    ob /= f;
                    ib /= f;
                    unit = w;
                    break;
                }
            }
        }
        let s = strided(&dims, &sa, &sb)?;
        Some(CopyPlan { s, ob, ib, unit })
    }
}

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

    fn fill(&self, ptr: u64, n: usize, v: f32) -> Result<(), ExecError> {
        let n32 = i(n);
        self.k("fill", grid(n), &[&ptr, &n32, &v])
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), ExecError> {
        if dst == src || bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are arena ranges of `bytes` bytes (same type).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        }
        .map_err(|e| dev_err("device copy", e))
    }

    /// Copies the index space of `s`: out[ob + idx·sa] = in[ib + idx·sb]
    /// (element offsets and strides of `dtype`). Axes that are contiguous on
    /// both sides are merged first, and where the inner axis is contiguous
    /// on both sides and every offset and stride allows it, the copy moves 8
    /// or 16 bytes at a time (a concat or a slice becomes row copies).
    fn strided_copy(
        &self,
        dtype: DType,
        out: u64,
        inp: u64,
        s: Strided,
        ob: usize,
        ib: usize,
    ) -> Result<(), ExecError> {
        let esize = match dtype {
            DType::F32 => 4,
            DType::I64 => 8,
            DType::F16 | DType::BF16 => return Err(half_unsupported(dtype)),
        };
        let Some(c) = CopyPlan::new(&s, ob, ib, esize, out, inp) else {
            return Ok(());
        };
        let n = (0..c.s.rank as usize)
            .map(|k| c.s.dims[k] as usize)
            .product::<usize>();
        let (n32, ob, ib) = (i(n), i(c.ob), i(c.ib));
        let name = match c.unit {
            16 => "strided_copy128",
            8 => "strided_copy64",
            _ => "strided_copy32",
        };
        self.k(name, grid(n), &[&out, &inp, &n32, &c.s, &ob, &ib])
    }

    /// cuDNN's plan for batch-norm forward `id`, when cuDNN runs it.
    fn cudnn_bn(&self, id: NodeId) -> Option<(&super::bn::BnPlan, &super::bn::BnHandle)> {
        Some((self.bns.get(&id.index())?, self.bn_handle.as_ref()?))
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
                if a == o && b == o && n_out % 4 == 0 && (out[0] | pa | pb) % 16 == 0 {
                    let n4 = i(n_out / 4);
                    self.k(
                        "binary_same4",
                        grid(n_out / 4),
                        &[&out[0], &pa, &pb, &n4, &code],
                    )
                } else if a == o && b == o {
                    self.k(
                        "binary_same",
                        grid(n_out),
                        &[&out[0], &pa, &pb, &n32, &code],
                    )
                } else if a == o && !b_core.is_empty() && o.ends_with(b_core) {
                    let len = i(prod(b_core));
                    self.k(
                        "binary_row",
                        grid(n_out),
                        &[&out[0], &pa, &pb, &n32, &len, &code],
                    )
                } else {
                    let s = strided(o, &bcast_strides(a, o), &bcast_strides(b, o))
                        .ok_or_else(rank_err)?;
                    self.k(
                        "binary_bcast",
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
                if n_out % 4 == 0 && (out[0] | inp[0]) % 16 == 0 {
                    let n4 = i(n_out / 4);
                    self.k(
                        "unary4",
                        grid(n_out / 4),
                        &[&out[0], &inp[0], &n4, &code, &p],
                    )
                } else {
                    self.k("unary", grid(n_out), &[&out[0], &inp[0], &n32, &code, &p])
                }
            }
            Op::Clip { min, max } => {
                self.k("clip", grid(n_out), &[&out[0], &inp[0], &n32, min, max])
            }
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
            Op::Cast { to } => match (ity[0].dtype, *to) {
                (DType::F32, DType::I64) => {
                    self.k("cast_f32_i64", grid(n_out), &[&out[0], &inp[0], &n32])
                }
                (DType::I64, DType::F32) => {
                    self.k("cast_i64_f32", grid(n_out), &[&out[0], &inp[0], &n32])
                }
                (from, to) if from.is_half() || to.is_half() => {
                    Err(half_unsupported(if from.is_half() { from } else { to }))
                }
                _ => self.copy(out[0], inp[0], oty[0].bytes()),
            },
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
                self.k(
                    "unary_grad",
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
                self.fill(out[0], n_out, 0.0)?;
                let ost = contiguous_strides(oty[0].shape.dims());
                let d = ity[0].shape.dims();
                let s = strided(d, &ost, &contiguous_strides(d)).ok_or_else(rank_err)?;
                self.strided_copy(DType::F32, out[0], inp[0], s, start * ost[*axis], 0)
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
                self.strided_copy(DType::F32, out[0], inp[0], s, 0, 0)
            }
            Op::SumTo { shape } => {
                let d = ity[0].shape.dims();
                let off = d.len() - shape.len();
                let flags: Vec<bool> = (0..d.len())
                    .map(|k| k < off || (shape[k - off] == 1 && d[k] != 1))
                    .collect();
                self.reduce(out[0], inp[0], d, &flags, false, false)
                    .and_then(|r| r.ok_or_else(rank_err))
            }
            Op::ReduceSum { axes, .. }
            | Op::ReduceMean { axes, .. }
            | Op::ReduceMax { axes, .. } => {
                let d = ity[0].shape.dims();
                let flags: Vec<bool> = (0..d.len()).map(|k| axes.contains(&k)).collect();
                let mean = matches!(node.op, Op::ReduceMean { .. });
                let max = matches!(node.op, Op::ReduceMax { .. });
                self.reduce(out[0], inp[0], d, &flags, mean, max)
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
                let n = |t: &TensorType| t.shape.numel();
                let (ws, ws_bytes) = self.cudnn_workspace();
                // SAFETY: the plan's descriptors were made from these very
                // types; the workspace holds the largest size any plan asked.
                unsafe {
                    plan.run(
                        &self.stream,
                        (inp[0], n(ity[0])),
                        (inp[1], n(ity[1])),
                        (out[0], n_out),
                        ws,
                        ws_bytes,
                    )
                }
                .map_err(|e| err(format!("cuDNN: {e:?}")))?;
                // A bias whose add moved into a fused chain is added there.
                let bias = inp
                    .get(2)
                    .filter(|_| self.fusion.role(id) != super::fuse::Role::ConvWithoutBias);
                if let (Op::Conv2d(_), Some(bias)) = (&node.op, bias) {
                    let d = oty[0].shape.dims();
                    let (c, inner) = (i(d[1]), i(d[2] * d[3]));
                    self.k(
                        "channel_bias",
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
                if let Some((plan, h)) = self.cudnn_bn(id) {
                    // SAFETY: the plan was made from these types; the
                    // handle is on the program's stream.
                    return unsafe {
                        plan.forward(
                            h,
                            inp[0],
                            out[0],
                            (inp[1], inp[2]),
                            (inp[3], inp[4]),
                            (out[1], out[2]),
                        )
                    }
                    .map_err(|e| err(format!("cuDNN: {e:?}")));
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
                self.k(
                    "layernorm_grad",
                    warps(rows),
                    &[
                        &out[0], &out[1], &out[2], &inp[0], &inp[1], &inp[2], &rows32, &d32, eps,
                    ],
                )
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
            Op::SgdUpdate {
                lr,
                momentum,
                weight_decay,
                nesterov,
            } => {
                let n = ity[0].shape.numel();
                let (n32, nest) = (i(n), i32::from(*nesterov));
                // The optional learning-rate scale; any valid pointer when absent.
                let (scale, has) = (inp.get(3).unwrap_or(&inp[1]), i32::from(inp.len() > 3));
                self.k(
                    "sgd_update",
                    grid(n),
                    &[
                        &inp[0],
                        &inp[1],
                        &inp[2],
                        &n32,
                        lr,
                        momentum,
                        weight_decay,
                        &nest,
                        scale,
                        &has,
                    ],
                )
            }
            Op::AdamUpdate {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            } => {
                let n = ity[0].shape.numel();
                let (n32, dec) = (i(n), i32::from(*decoupled));
                let (scale, has) = (inp.get(5).unwrap_or(&inp[1]), i32::from(inp.len() > 5));
                self.k(
                    "adam_update",
                    grid(n),
                    &[
                        &inp[0],
                        &inp[1],
                        &inp[2],
                        &inp[3],
                        &inp[4],
                        &n32,
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        &dec,
                        scale,
                        &has,
                    ],
                )?;
                self.k("step_incr", blocks(1, 32), &[&inp[4]])
            }
        }
    }

    /// Sum (times 1/count when `mean`) or max of `dims` over the flagged
    /// axes into `out`, laid out as the kept axes in order. `None` if the
    /// rank is too high.
    fn reduce(
        &self,
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
                .k(
                    "reduce_cols",
                    LaunchConfig {
                        grid_dim: (no.div_ceil(32) as u32, 1, 1),
                        block_dim: (32, nr.min(32) as u32, 1),
                        shared_mem_bytes: 0,
                    },
                    &[&out, &inp, &no32, &nr32, &op, &scale],
                )
                .map(Some);
        }
        if nr >= 4096 && no < 1024 {
            self.k(
                "reduce_block",
                blocks(no, 512),
                &[&out, &inp, &no32, &nr32, &r, &op, &scale],
            )?;
        } else {
            self.k(
                "reduce_warp",
                warps(no),
                &[&out, &inp, &no32, &nr32, &r, &op, &scale],
            )?;
        }
        Ok(Some(()))
    }

    /// Row-major batched product through cuBLAS (column-major): C = A B is
    /// computed as Cᵀ = Bᵀ Aᵀ.
    fn matmul(
        &self,
        (pa, a): (u64, &[usize]),
        (pb, b): (u64, &[usize]),
        ta: bool,
        tb: bool,
        (pc, c): (u64, &[usize]),
    ) -> Result<(), String> {
        let (ra, rb, rc) = (a.len(), b.len(), c.len());
        let (m, n) = (c[rc - 2], c[rc - 1]);
        let k = if ta { a[ra - 2] } else { a[ra - 1] };
        let (ba, bb, bc) = (&a[..ra - 2], &b[..rb - 2], &c[..rc - 2]);
        let (na, nb, nc) = (prod(ba), prod(bb), prod(bc));
        if nc == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        let f = 4u64;
        if k == 0 {
            self.fill(pc, nc * m * n, 0.0)
                .map_err(|e| format!("{e:?}"))?;
            return Ok(());
        }
        // Fold a's batch into its rows when b is shared and a is not transposed.
        if nb == 1 && !ta && na == nc {
            return self.gemm(ta, tb, na * m, n, k, pa, 0, pb, 0, pc, 0, 1);
        }
        let (sa, sb, sc) = (m * k, k * n, m * n);
        if (na == nc || na == 1) && (nb == nc || nb == 1) {
            let sa = if na == 1 { 0 } else { sa };
            let sb = if nb == 1 { 0 } else { sb };
            return self.gemm(ta, tb, m, n, k, pa, sa, pb, sb, pc, sc, nc);
        }
        // General broadcasting of batch dimensions: one product per batch.
        let sta = bcast_strides(ba, bc);
        let stb = bcast_strides(bb, bc);
        for q in 0..nc {
            let (mut rem, mut oa, mut ob) = (q, 0usize, 0usize);
            for d in (0..bc.len()).rev() {
                let idx = rem % bc[d];
                rem /= bc[d];
                oa += idx * sta[d];
                ob += idx * stb[d];
            }
            self.gemm(
                ta,
                tb,
                m,
                n,
                k,
                pa + (oa * m * k) as u64 * f,
                0,
                pb + (ob * k * n) as u64 * f,
                0,
                pc + (q * m * n) as u64 * f,
                0,
                1,
            )?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        pa: u64,
        sa: usize,
        pb: u64,
        sb: usize,
        pc: u64,
        sc: usize,
        batch: usize,
    ) -> Result<(), String> {
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let lda = if ta { m } else { k };
        let ldb = if tb { k } else { n };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the three addresses are arena ranges holding the row-major
        // operands of the inferred shapes (batch × m×k, k×n, m×n, or strides
        // 0 for a shared operand), which is exactly what these sizes,
        // leading dimensions and strides make cuBLAS read and write.
        unsafe {
            cudarc::cublas::result::sgemm_strided_batched(
                *self.blas.handle(),
                op(tb),
                op(ta),
                n as i32,
                m as i32,
                k as i32,
                &alpha,
                pb as *const f32,
                ldb as i32,
                sb as i64,
                pa as *const f32,
                lda as i32,
                sa as i64,
                &beta,
                pc as *mut f32,
                n as i32,
                sc as i64,
                batch as i32,
            )
        }
        .map_err(|e| format!("cuBLAS: {e:?}"))
    }
}

/// Whether training batch norm over `dims` ([N, C, …]) spreads its sums over
/// one block per (n, c) plane: when the C per-channel blocks alone would
/// leave most of the GPU idle and the grid fits (y ≤ 65535 channels).
fn plane_parallel(dims: &[usize]) -> bool {
    dims.len() >= 2 && dims[0] > 1 && dims[1] <= 65_535 && dims[0] <= i32::MAX as usize
}

/// Blocks over `planes` rows (grid y, at most 65535) of `units` items each:
/// up to 256 threads a block (a multiple of 32, no more than the row needs)
/// and up to 8 blocks a row.
pub(super) fn plane_rows(units: usize, planes: usize) -> cudarc::driver::LaunchConfig {
    let threads = units.div_ceil(32).clamp(1, 8) * 32;
    let per_row = units.div_ceil(threads).clamp(1, 8);
    cudarc::driver::LaunchConfig {
        grid_dim: (per_row as u32, planes as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per (n, c) plane (grid x: n, y: c), as many threads as
/// [`plane_rows`] gives a plane of its floats (float4s with `vec4`).
fn plane_grid(dims: &[usize], vec4: bool) -> cudarc::driver::LaunchConfig {
    let inner = prod(&dims[2..]);
    let units = if vec4 { inner / 4 } else { inner };
    cudarc::driver::LaunchConfig {
        grid_dim: (dims[0] as u32, dims[1] as u32, 1),
        block_dim: plane_rows(units, 1).block_dim,
        shared_mem_bytes: 0,
    }
}

/// Whether a per-plane kernel over `dims` ([N, C, …]) may move four floats
/// at a time: planes of a multiple of 4 floats, every address 16-byte
/// aligned.
fn plane_vec4(dims: &[usize], addrs: &[u64]) -> bool {
    prod(dims.get(2..).unwrap_or(&[])) % 4 == 0 && addrs.iter().all(|a| a % 16 == 0)
}

/// Launch geometry of the elementwise per-plane kernels (`bn_apply_planes`,
/// `bn_grad_dx_planes`): the N·C planes along grid x (no 65,535 limit there)
/// and up to 8 blocks per plane along y, as [`plane_rows`]; `None` where
/// planes are too small for a block each (under 32 floats: the flat kernels
/// run) or too many for grid x.
fn plane_cols(dims: &[usize], vec4: bool) -> Option<cudarc::driver::LaunchConfig> {
    let inner = prod(dims.get(2..)?);
    let planes = dims.first()?.checked_mul(*dims.get(1)?)?;
    if inner < 32 || planes == 0 || planes > i32::MAX as usize {
        return None;
    }
    let units = if vec4 { inner / 4 } else { inner };
    let r = plane_rows(units, 1);
    Some(cudarc::driver::LaunchConfig {
        grid_dim: (planes as u32, r.grid_dim.0, 1),
        block_dim: r.block_dim,
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// What the strided copy kernels do, on bytes: `unit` bytes per index.
    fn run_copy(out: &mut [u8], inp: &[u8], s: &Strided, ob: usize, ib: usize, unit: usize) {
        let rank = s.rank as usize;
        let n: usize = (0..rank).map(|k| s.dims[k] as usize).product();
        for q in 0..n {
            let (mut rem, mut oo, mut oi) = (q, ob, ib);
            for d in (0..rank).rev() {
                let k = rem % s.dims[d] as usize;
                rem /= s.dims[d] as usize;
                oo += k * s.sa[d] as usize;
                oi += k * s.sb[d] as usize;
            }
            out[oo * unit..(oo + 1) * unit].copy_from_slice(&inp[oi * unit..(oi + 1) * unit]);
        }
    }

    /// The planned copy (merged, widened) writes the same bytes as the
    /// element-wise one, for base addresses `out_base` and `in_base`;
    /// returns the unit the plan chose.
    fn same_as_elementwise(
        s: Strided,
        ob: usize,
        ib: usize,
        esize: usize,
        out_len: usize,
        in_len: usize,
        (out_base, in_base): (u64, u64),
    ) -> usize {
        let inp: Vec<u8> = (0..in_len * esize).map(|k| (k * 7 + 3) as u8).collect();
        let mut want = vec![0u8; out_len * esize];
        run_copy(&mut want, &inp, &s, ob, ib, esize);
        let mut got = vec![0u8; out_len * esize];
        match CopyPlan::new(&s, ob, ib, esize, out_base, in_base) {
            Some(c) => {
                assert!(c.s.rank <= s.rank);
                run_copy(&mut got, &inp, &c.s, c.ob, c.ib, c.unit);
                assert_eq!(got, want, "plan {c:?} of {s:?}");
                c.unit
            }
            None => {
                assert_eq!(got, want);
                0
            }
        }
    }

    fn concat_units(
        dims: &[Vec<usize>],
        axis: usize,
        esize: usize,
        bases: (u64, u64),
    ) -> Vec<usize> {
        let mut o = dims[0].clone();
        o[axis] = dims.iter().map(|d| d[axis]).sum();
        let ost = contiguous_strides(&o);
        let mut at = 0;
        let mut units = Vec::new();
        for d in dims {
            let s = strided(d, &ost, &contiguous_strides(d)).unwrap();
            units.push(same_as_elementwise(
                s,
                at * ost[axis],
                0,
                esize,
                prod(&o),
                prod(d),
                bases,
            ));
            at += d[axis];
        }
        units
    }

    #[test]
    fn concat_rows_widen_only_where_aligned() {
        // Inception-like: channels concat of [8, c, 5, 5], c multiple of 4
        // but 25 per plane: rows of c·25 floats at offsets of at·25.
        let u = concat_units(
            &[vec![2, 64, 5, 5], vec![2, 64, 5, 5], vec![2, 96, 5, 5]],
            1,
            4,
            (0, 256),
        );
        assert_eq!(u, vec![16, 16, 16]);
        // Odd channel counts and odd planes: 4-byte units.
        let u = concat_units(&[vec![3, 3, 3, 3], vec![3, 5, 3, 3]], 1, 4, (0, 0));
        assert_eq!(u, vec![4, 4]);
        // Last axis, odd widths; i64 elements.
        for axis in 0..3 {
            let with = |d: [usize; 3], k: usize| {
                let mut d = d.to_vec();
                d[axis] = k;
                d
            };
            let odd = [with([3, 2, 5], 3), with([3, 2, 5], 1), with([3, 2, 5], 7)];
            concat_units(&odd, axis, 8, (0, 0));
            concat_units(&odd, axis, 4, (0, 0));
            let even = [with([4, 2, 6], 6), with([4, 2, 6], 2)];
            concat_units(&even, axis, 4, (0, 64));
        }
        // Even widths but a base address only 8-byte aligned: 8-byte units.
        let u = concat_units(&[vec![2, 4], vec![2, 8]], 1, 4, (8, 0));
        assert_eq!(u, vec![8, 8]);
        // Axis 0: the whole input is one contiguous run.
        let u = concat_units(&[vec![1, 3], vec![2, 3]], 0, 4, (0, 0));
        assert_eq!(u, vec![4, 4]);
    }

    #[test]
    fn slices_and_transposes_keep_their_bytes() {
        // Slice of [2, 6, 8] along axis 1 from 2, length 3.
        let d = [2usize, 6, 8];
        let o = [2usize, 3, 8];
        let st = contiguous_strides(&d);
        let s = strided(&o, &contiguous_strides(&o), &st).unwrap();
        assert_eq!(
            same_as_elementwise(s, 0, 2 * st[1], 4, prod(&o), prod(&d), (0, 0)),
            16
        );
        // An odd offset: not a multiple of 4 floats.
        let s = strided(&o, &contiguous_strides(&o), &st).unwrap();
        assert_eq!(
            same_as_elementwise(s, 0, 2 * 8 + 1, 4, prod(&o), prod(&d), (0, 0)),
            4
        );
        // BERT's head split: [B, S, H, dh] -> [B, H, S, dh], dh contiguous.
        let d = [2usize, 3, 4, 8];
        let perm = [0usize, 2, 1, 3];
        let st = contiguous_strides(&d);
        let o: Vec<usize> = perm.iter().map(|&p| d[p]).collect();
        let sb: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
        let s = strided(&o, &contiguous_strides(&o), &sb).unwrap();
        assert_eq!(
            same_as_elementwise(s, 0, 0, 4, prod(&o), prod(&d), (0, 0)),
            16
        );
        // A full transpose has no contiguous inner axis.
        let d = [3usize, 5];
        let o = [5usize, 3];
        let st = contiguous_strides(&d);
        let s = strided(&o, &contiguous_strides(&o), &[st[1], st[0]]).unwrap();
        assert_eq!(same_as_elementwise(s, 0, 0, 4, 15, 15, (0, 0)), 4);
        // Scalars and size-1 axes.
        let s = strided(&[1, 1], &[1, 1], &[1, 1]).unwrap();
        assert_eq!(same_as_elementwise(s, 0, 0, 8, 1, 1, (0, 0)), 8);
        // Nothing to copy.
        let s = strided(&[2, 0], &[0, 1], &[0, 1]).unwrap();
        assert_eq!(same_as_elementwise(s, 0, 0, 4, 0, 0, (0, 0)), 0);
    }

    #[test]
    fn repeating_operand_detection() {
        assert!(repeats(&[768], &[8, 128, 768]));
        assert!(repeats(&[1, 128, 768], &[8, 128, 768]));
        assert!(!repeats(&[8, 1, 768], &[8, 128, 768]));
        assert!(!repeats(&[1, 1], &[8, 128]));
        assert!(!repeats(&[128, 1], &[8, 128, 768]));
    }
}
