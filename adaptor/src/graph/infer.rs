//! Shape and dtype inference: the output types of an op from its input types.
//! Every attribute is checked here, so a graph whose nodes all infer is one the
//! backends can run without further checks.

mod update;

use super::op::{Conv2dAttrs, Op, Pool2dAttrs};
use crate::tensor::{DType, Shape, TensorType};

type R<T> = Result<T, String>;

/// Output types of `op` applied to inputs of types `inputs`, or why not.
pub fn infer(op: &Op, inputs: &[TensorType]) -> R<Vec<TensorType>> {
    use Op::*;
    let one = |t: TensorType| Ok(vec![t]);
    match op {
        Placeholder(t) | Variable(t) => {
            arity(inputs, 0)?;
            checked(t)?;
            one(t.clone())
        }
        Constant(t) => {
            arity(inputs, 0)?;
            one(t.ty())
        }
        Add | Sub | Mul | Div => {
            arity(inputs, 2)?;
            let d = floats(inputs)?;
            one(TensorType::new(
                d,
                broadcast(&inputs[0].shape, &inputs[1].shape)?,
            ))
        }
        Relu | Gelu | Sigmoid | Tanh | Exp | Log | Sqrt | Scale(_) | Erf | IsNan | HardSigmoid
        | HardSwish => {
            arity(inputs, 1)?;
            floats(inputs)?;
            one(inputs[0].clone())
        }
        Softmax { axis } | LogSoftmax { axis } => {
            arity(inputs, 1)?;
            f32s(op, inputs)?;
            axis_in(*axis, inputs[0].shape.rank())?;
            one(inputs[0].clone())
        }
        Reshape { shape } => {
            arity(inputs, 1)?;
            let out = Shape::new(shape.clone());
            let n = out.checked_numel().ok_or("target shape overflows")?;
            if n != inputs[0].shape.numel() {
                return Err(format!(
                    "cannot reshape {} ({} elements) to {} ({} elements)",
                    inputs[0].shape,
                    inputs[0].shape.numel(),
                    out,
                    n
                ));
            }
            one(TensorType::new(inputs[0].dtype, out))
        }
        Transpose { perm } => {
            arity(inputs, 1)?;
            let d = inputs[0].shape.dims();
            if perm.len() != d.len() {
                return Err(format!(
                    "permutation {perm:?} does not match rank {}",
                    d.len()
                ));
            }
            let mut seen = vec![false; d.len()];
            for &p in perm {
                if p >= d.len() || seen[p] {
                    return Err(format!("{perm:?} is not a permutation of 0..{}", d.len()));
                }
                seen[p] = true;
            }
            one(TensorType::new(
                inputs[0].dtype,
                perm.iter().map(|&p| d[p]).collect::<Vec<_>>(),
            ))
        }
        Concat { axis } => {
            if inputs.is_empty() {
                return Err("concat needs at least one input".into());
            }
            let first = &inputs[0];
            axis_in(*axis, first.shape.rank())?;
            let mut dims = first.shape.dims().to_vec();
            for t in &inputs[1..] {
                if t.dtype != first.dtype || t.shape.rank() != first.shape.rank() {
                    return Err(format!("cannot concat {} with {}", first, t));
                }
                for (i, (&a, &b)) in first.shape.dims().iter().zip(t.shape.dims()).enumerate() {
                    if i != *axis && a != b {
                        return Err(format!("cannot concat {} with {} on axis {axis}", first, t));
                    }
                }
                dims[*axis] = dims[*axis]
                    .checked_add(t.shape.dims()[*axis])
                    .ok_or("concat overflows")?;
            }
            one(TensorType::new(first.dtype, dims))
        }
        Slice { axis, start, end } => {
            arity(inputs, 1)?;
            axis_in(*axis, inputs[0].shape.rank())?;
            let d = inputs[0].shape.dims()[*axis];
            if start >= end || *end > d {
                return Err(format!(
                    "slice {start}..{end} out of range for axis {axis} of length {d}"
                ));
            }
            let mut dims = inputs[0].shape.dims().to_vec();
            dims[*axis] = end - start;
            one(TensorType::new(inputs[0].dtype, dims))
        }
        BroadcastTo { shape } => {
            arity(inputs, 1)?;
            let d = floats(inputs)?;
            let target = Shape::new(shape.clone());
            if broadcast(&inputs[0].shape, &target)? != target {
                return Err(format!(
                    "cannot broadcast {} to {}",
                    inputs[0].shape, target
                ));
            }
            one(TensorType::new(d, target))
        }
        SumTo { shape } => {
            arity(inputs, 1)?;
            let d = floats(inputs)?;
            let target = Shape::new(shape.clone());
            if broadcast(&target, &inputs[0].shape)? != inputs[0].shape {
                return Err(format!("cannot sum {} down to {}", inputs[0].shape, target));
            }
            one(TensorType::new(d, target))
        }
        ReduceSum { axes, keep_dims }
        | ReduceMean { axes, keep_dims }
        | ReduceMax { axes, keep_dims } => {
            arity(inputs, 1)?;
            let d = floats(inputs)?;
            one(TensorType::new(
                d,
                reduced(&inputs[0].shape, axes, *keep_dims)?,
            ))
        }
        MatMul {
            transpose_a,
            transpose_b,
        } => {
            arity(inputs, 2)?;
            let d = floats(inputs)?;
            one(TensorType::new(
                d,
                matmul_shape(
                    &inputs[0].shape,
                    &inputs[1].shape,
                    *transpose_a,
                    *transpose_b,
                )?,
            ))
        }
        Conv2d(a) => {
            if inputs.len() != 2 && inputs.len() != 3 {
                return Err(format!("expects 2 or 3 inputs, got {}", inputs.len()));
            }
            let d = floats(inputs)?;
            let out = conv_shape(&inputs[0].shape, &inputs[1].shape, a)?;
            if let Some(b) = inputs.get(2) {
                if b.shape.dims() != [out[1]] {
                    return Err(format!(
                        "bias {} does not match {} output channels",
                        b.shape, out[1]
                    ));
                }
            }
            one(TensorType::new(d, out))
        }
        MaxPool2d(p) | AvgPool2d { pool: p, .. } => {
            arity(inputs, 1)?;
            let d = floats(inputs)?;
            one(TensorType::new(d, pool_shape(&inputs[0].shape, p)?))
        }
        GlobalAvgPool => {
            arity(inputs, 1)?;
            let dt = floats(inputs)?;
            let d = nchw(&inputs[0].shape)?;
            one(TensorType::new(dt, [d[0], d[1]]))
        }
        BatchNorm { eps } => {
            arity(inputs, 5)?;
            f32s(op, inputs)?;
            positive(*eps, "eps")?;
            let c = channels(&inputs[0].shape)?;
            for (i, t) in inputs[1..].iter().enumerate() {
                vector_of(t, c, ["gamma", "beta", "mean", "var"][i])?;
            }
            one(inputs[0].clone())
        }
        BatchNormTrain { eps, momentum } => {
            arity(inputs, 5)?;
            f32s(op, inputs)?;
            positive(*eps, "eps")?;
            if !(0.0..=1.0).contains(momentum) {
                return Err(format!("momentum {momentum} is not in [0, 1]"));
            }
            let c = channels(&inputs[0].shape)?;
            for (i, t) in inputs[1..].iter().enumerate() {
                vector_of(t, c, ["gamma", "beta", "running_mean", "running_var"][i])?;
            }
            Ok(vec![
                inputs[0].clone(),
                TensorType::f32([c]),
                TensorType::f32([c]),
            ])
        }
        LayerNorm { eps } => {
            arity(inputs, 3)?;
            f32s(op, inputs)?;
            positive(*eps, "eps")?;
            let d = last_dim(&inputs[0].shape)?;
            vector_of(&inputs[1], d, "gamma")?;
            vector_of(&inputs[2], d, "beta")?;
            one(inputs[0].clone())
        }
        Embedding => {
            arity(inputs, 2)?;
            let d = floats(&inputs[..1])?;
            dtype(&inputs[1], DType::I64, "indices")?;
            if inputs[0].shape.rank() != 2 {
                return Err(format!("table must be [V, D], got {}", inputs[0].shape));
            }
            let mut dims = inputs[1].shape.dims().to_vec();
            dims.push(inputs[0].shape.dims()[1]);
            one(TensorType::new(d, dims))
        }
        CrossEntropy => {
            arity(inputs, 2)?;
            f32s(op, &inputs[..1])?;
            classification(&inputs[0], &inputs[1])?;
            one(TensorType::f32(Shape::scalar()))
        }
        MseLoss => {
            arity(inputs, 2)?;
            f32s(op, inputs)?;
            same_shape(&inputs[0], &inputs[1])?;
            one(TensorType::f32(Shape::scalar()))
        }
        ReluGrad | GeluGrad | SigmoidGrad | TanhGrad | HardSigmoidGrad | HardSwishGrad => {
            arity(inputs, 2)?;
            floats(inputs)?;
            same_shape(&inputs[0], &inputs[1])?;
            one(inputs[0].clone())
        }
        SoftmaxGrad { axis } | LogSoftmaxGrad { axis } => {
            arity(inputs, 2)?;
            f32s(op, inputs)?;
            same_shape(&inputs[0], &inputs[1])?;
            axis_in(*axis, inputs[0].shape.rank())?;
            one(inputs[0].clone())
        }
        ReduceMaxGrad { axes, keep_dims } => {
            arity(inputs, 3)?;
            floats(inputs)?;
            let r = reduced(&inputs[0].shape, axes, *keep_dims)?;
            if inputs[1].shape != r || inputs[2].shape != r {
                return Err(format!(
                    "y and dy must be {r}, got {} and {}",
                    inputs[1].shape, inputs[2].shape
                ));
            }
            one(inputs[0].clone())
        }
        SliceGrad {
            axis,
            start,
            input_dim,
        } => {
            arity(inputs, 1)?;
            let d = floats(inputs)?;
            axis_in(*axis, inputs[0].shape.rank())?;
            let len = inputs[0].shape.dims()[*axis];
            if start.checked_add(len).is_none_or(|e| e > *input_dim) {
                return Err(format!(
                    "slice {start}..{} out of range for length {input_dim}",
                    start + len
                ));
            }
            let mut dims = inputs[0].shape.dims().to_vec();
            dims[*axis] = *input_dim;
            one(TensorType::new(d, dims))
        }
        Conv2dGradInput { attrs, input_shape } => {
            arity(inputs, 2)?;
            let d = floats(inputs)?;
            let x = Shape::new(input_shape.to_vec());
            let y = conv_shape(&x, &inputs[1].shape, attrs)?;
            if inputs[0].shape.dims() != y.as_slice() {
                return Err(format!(
                    "dy {} does not match conv output {:?}",
                    inputs[0].shape, y
                ));
            }
            one(TensorType::new(d, x))
        }
        Conv2dGradFilter {
            attrs,
            filter_shape,
        } => {
            arity(inputs, 2)?;
            let d = floats(inputs)?;
            let w = Shape::new(filter_shape.to_vec());
            let y = conv_shape(&inputs[0].shape, &w, attrs)?;
            if inputs[1].shape.dims() != y.as_slice() {
                return Err(format!(
                    "dy {} does not match conv output {:?}",
                    inputs[1].shape, y
                ));
            }
            one(TensorType::new(d, w))
        }
        MaxPool2dGrad(p) | AvgPool2dGrad { pool: p, .. } => {
            arity(inputs, 2)?;
            floats(inputs)?;
            let y = pool_shape(&inputs[0].shape, p)?;
            if inputs[1].shape.dims() != y.as_slice() {
                return Err(format!(
                    "dy {} does not match pool output {:?}",
                    inputs[1].shape, y
                ));
            }
            one(inputs[0].clone())
        }
        BatchNormTrainGrad => {
            arity(inputs, 5)?;
            f32s(op, inputs)?;
            let c = channels(&inputs[0].shape)?;
            for (i, t) in inputs[1..4].iter().enumerate() {
                vector_of(t, c, ["gamma", "saved_mean", "saved_invstd"][i])?;
            }
            same_shape(&inputs[0], &inputs[4])?;
            Ok(vec![
                inputs[0].clone(),
                TensorType::f32([c]),
                TensorType::f32([c]),
            ])
        }
        LayerNormGrad { eps } => {
            arity(inputs, 3)?;
            f32s(op, inputs)?;
            positive(*eps, "eps")?;
            let d = last_dim(&inputs[0].shape)?;
            vector_of(&inputs[1], d, "gamma")?;
            same_shape(&inputs[0], &inputs[2])?;
            Ok(vec![
                inputs[0].clone(),
                TensorType::f32([d]),
                TensorType::f32([d]),
            ])
        }
        EmbeddingGrad { num_embeddings } => {
            arity(inputs, 2)?;
            dtype(&inputs[0], DType::I64, "indices")?;
            let dt = floats(&inputs[1..])?;
            let i = inputs[0].shape.dims();
            let d = inputs[1].shape.dims();
            if d.len() != i.len() + 1 || &d[..i.len()] != i {
                return Err(format!(
                    "dy {} does not match indices {}",
                    inputs[1].shape, inputs[0].shape
                ));
            }
            if *num_embeddings == 0 {
                return Err("num_embeddings must be positive".into());
            }
            one(TensorType::new(dt, [*num_embeddings, d[i.len()]]))
        }
        CrossEntropyGrad => {
            arity(inputs, 3)?;
            f32s(op, &inputs[..1])?;
            classification(&inputs[0], &inputs[1])?;
            dtype(&inputs[2], DType::F32, "dloss")?;
            if inputs[2].shape.numel() != 1 {
                return Err(format!("dloss must be a scalar, got {}", inputs[2].shape));
            }
            one(inputs[0].clone())
        }
        SgdUpdate { .. } | AdamUpdate { .. } | AmpUnscale | AmpScaleUpdate { .. } => {
            update::infer(op, inputs)
        }
        Clip { min, max } => {
            arity(inputs, 1)?;
            floats(inputs)?;
            if min.is_nan() || max.is_nan() || min > max {
                return Err(format!("clip bounds [{min}, {max}] are not an interval"));
            }
            one(inputs[0].clone())
        }
        Where => {
            arity(inputs, 3)?;
            let d = floats(inputs)?;
            let ab = broadcast(&inputs[1].shape, &inputs[2].shape)?;
            one(TensorType::new(d, broadcast(&inputs[0].shape, &ab)?))
        }
        Cast { to } => {
            arity(inputs, 1)?;
            let from = inputs[0].dtype;
            let ok = from == *to
                || (from.is_float() && to.is_float())
                || (from == DType::I64 && to.is_float())
                || (from == DType::F32 && *to == DType::I64);
            if !ok {
                return Err(format!(
                    "cannot cast {from} to {to} (casts go between floats, from i64 to a float, and from f32 to i64)"
                ));
            }
            one(TensorType::new(*to, inputs[0].shape.clone()))
        }
        DropoutMask { p, shape, .. } => {
            arity(inputs, 1)?;
            dtype(&inputs[0], DType::I64, "seed")?;
            if inputs[0].shape.numel() != 1 {
                return Err(format!(
                    "the seed must hold one element, got {}",
                    inputs[0].shape
                ));
            }
            if !(0.0..1.0).contains(p) {
                return Err(format!("dropout probability {p} is not in [0, 1)"));
            }
            one(TensorType::f32(shape.clone()))
        }
        Assign => {
            arity(inputs, 2)?;
            if inputs[0] != inputs[1] {
                return Err(format!("cannot assign {} to {}", inputs[1], inputs[0]));
            }
            Ok(vec![])
        }
    }
}

fn checked(t: &TensorType) -> R<()> {
    t.checked_bytes()
        .map(|_| ())
        .ok_or_else(|| format!("type {t} overflows"))
}

fn arity(inputs: &[TensorType], n: usize) -> R<()> {
    if inputs.len() != n {
        return Err(format!("expects {n} inputs, got {}", inputs.len()));
    }
    Ok(())
}

fn arity_between(inputs: &[TensorType], lo: usize, hi: usize) -> R<()> {
    if inputs.len() < lo || inputs.len() > hi {
        return Err(format!("expects {lo} to {hi} inputs, got {}", inputs.len()));
    }
    Ok(())
}

/// The inputs of an op that computes in f32 only (the normalising ops, the
/// losses, the optimizers): every one f32. A half input is refused with a
/// hint: cast it to f32 first (what autocast does).
fn f32s(op: &Op, inputs: &[TensorType]) -> R<()> {
    for (i, t) in inputs.iter().enumerate() {
        if t.dtype.is_half() {
            return Err(format!(
                "{} takes f32 only, input {i} is {t}: Cast it to f32 first",
                op.name()
            ));
        }
        if t.dtype != DType::F32 {
            return Err(format!("input {i} must be f32, got {t}"));
        }
    }
    Ok(())
}

/// The inputs of an op that computes in any float dtype (f32, f16, bf16):
/// all of one float dtype, which is returned (the output's dtype).
fn floats(inputs: &[TensorType]) -> R<DType> {
    let Some(first) = inputs.first() else {
        return Ok(DType::F32);
    };
    let d = first.dtype;
    for (i, t) in inputs.iter().enumerate() {
        if !t.dtype.is_float() {
            return Err(format!(
                "input {i} must be a float (f32, f16 or bf16), got {t}"
            ));
        }
        if t.dtype != d {
            return Err(format!(
                "input {i} is {t} but input 0 is {d}: an op's float inputs share one dtype (Cast one of them)"
            ));
        }
    }
    Ok(d)
}

fn dtype(t: &TensorType, want: DType, what: &str) -> R<()> {
    if t.dtype != want {
        return Err(format!("{what} must be {want}, got {t}"));
    }
    Ok(())
}

fn same_shape(a: &TensorType, b: &TensorType) -> R<()> {
    if a.shape != b.shape {
        return Err(format!("shapes {} and {} differ", a.shape, b.shape));
    }
    Ok(())
}

fn positive(v: f32, what: &str) -> R<()> {
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("{what} must be positive and finite, got {v}"));
    }
    Ok(())
}

fn non_negative(v: f32, what: &str) -> R<()> {
    if !(v >= 0.0 && v.is_finite()) {
        return Err(format!("{what} must be non-negative and finite, got {v}"));
    }
    Ok(())
}

fn axis_in(axis: usize, rank: usize) -> R<()> {
    if axis >= rank {
        return Err(format!("axis {axis} out of range for rank {rank}"));
    }
    Ok(())
}

fn vector_of(t: &TensorType, n: usize, what: &str) -> R<()> {
    if t.shape.dims() != [n] {
        return Err(format!("{what} must be [{n}], got {}", t.shape));
    }
    Ok(())
}

fn last_dim(s: &Shape) -> R<usize> {
    s.dims()
        .last()
        .copied()
        .ok_or_else(|| "input must have at least one axis".to_string())
}

fn channels(s: &Shape) -> R<usize> {
    if s.rank() < 2 {
        return Err(format!("input must be [N, C, ...], got {s}"));
    }
    Ok(s.dims()[1])
}

fn nchw(s: &Shape) -> R<[usize; 4]> {
    match s.dims() {
        &[n, c, h, w] => Ok([n, c, h, w]),
        _ => Err(format!("input must be [N, C, H, W], got {s}")),
    }
}

fn classification(logits: &TensorType, labels: &TensorType) -> R<()> {
    dtype(logits, DType::F32, "logits")?;
    dtype(labels, DType::I64, "labels")?;
    match (logits.shape.dims(), labels.shape.dims()) {
        (&[n, c], &[m]) if n == m && c > 0 => Ok(()),
        _ => Err(format!(
            "logits must be [N, C] and labels [N], got {} and {}",
            logits.shape, labels.shape
        )),
    }
}

/// Numpy broadcasting of two shapes.
pub fn broadcast(a: &Shape, b: &Shape) -> R<Shape> {
    let (a, b) = (a.dims(), b.dims());
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i < n - a.len() {
            1
        } else {
            a[i - (n - a.len())]
        };
        let db = if i < n - b.len() {
            1
        } else {
            b[i - (n - b.len())]
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(format!("shapes {a:?} and {b:?} do not broadcast"));
        };
    }
    Ok(Shape(out))
}

/// Shape after reducing `axes`.
pub fn reduced(s: &Shape, axes: &[usize], keep_dims: bool) -> R<Shape> {
    if axes.is_empty() {
        return Err("no axes to reduce".into());
    }
    let mut marked = vec![false; s.rank()];
    for &a in axes {
        axis_in(a, s.rank())?;
        if marked[a] {
            return Err(format!("axis {a} listed twice"));
        }
        marked[a] = true;
    }
    Ok(Shape(
        s.dims()
            .iter()
            .zip(&marked)
            .filter_map(|(&d, &m)| match (m, keep_dims) {
                (false, _) => Some(d),
                (true, true) => Some(1),
                (true, false) => None,
            })
            .collect(),
    ))
}

/// Output shape of a (batched) matrix product.
pub fn matmul_shape(a: &Shape, b: &Shape, ta: bool, tb: bool) -> R<Shape> {
    let (ad, bd) = (a.dims(), b.dims());
    if ad.len() < 2 || bd.len() < 2 {
        return Err(format!("matmul needs rank >= 2, got {a} and {b}"));
    }
    let (m, k) = if ta {
        (ad[ad.len() - 1], ad[ad.len() - 2])
    } else {
        (ad[ad.len() - 2], ad[ad.len() - 1])
    };
    let (k2, n) = if tb {
        (bd[bd.len() - 1], bd[bd.len() - 2])
    } else {
        (bd[bd.len() - 2], bd[bd.len() - 1])
    };
    if k != k2 {
        return Err(format!(
            "inner dimensions differ: {a}{} x {b}{}",
            if ta { "ᵀ" } else { "" },
            if tb { "ᵀ" } else { "" }
        ));
    }
    let batch = broadcast(
        &Shape(ad[..ad.len() - 2].to_vec()),
        &Shape(bd[..bd.len() - 2].to_vec()),
    )?;
    let mut out = batch.0;
    out.push(m);
    out.push(n);
    Ok(Shape(out))
}

/// Output spatial size of a window op; `None` if the window does not fit.
pub fn window_out(
    input: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    dilation: usize,
) -> Option<usize> {
    let span = dilation
        .checked_mul(kernel.checked_sub(1)?)?
        .checked_add(1)?;
    let padded = input.checked_add(pad.checked_mul(2)?)?;
    if padded < span || stride == 0 {
        return None;
    }
    Some((padded - span) / stride + 1)
}

/// Output shape [N, O, OH, OW] of a convolution.
pub fn conv_shape(x: &Shape, w: &Shape, a: &Conv2dAttrs) -> R<Vec<usize>> {
    let [n, c, h, wd] = nchw(x)?;
    let [o, ci, kh, kw] = match w.dims() {
        &[o, ci, kh, kw] => [o, ci, kh, kw],
        _ => return Err(format!("weights must be [O, C/groups, kh, kw], got {w}")),
    };
    let g = a.groups;
    if g == 0 || c % g != 0 || o % g != 0 {
        return Err(format!(
            "groups {g} must divide input channels {c} and output channels {o}"
        ));
    }
    if ci != c / g {
        return Err(format!(
            "weights {w} expect {} input channels per group, input has {}",
            ci,
            c / g
        ));
    }
    if a.stride.contains(&0) || a.dilation.contains(&0) || kh == 0 || kw == 0 {
        return Err("stride, dilation and kernel must be positive".into());
    }
    let oh = window_out(h, kh, a.stride[0], a.padding[0], a.dilation[0]);
    let ow = window_out(wd, kw, a.stride[1], a.padding[1], a.dilation[1]);
    match (oh, ow) {
        (Some(oh), Some(ow)) => Ok(vec![n, o, oh, ow]),
        _ => Err(format!(
            "kernel {kh}x{kw} does not fit input {h}x{wd} with the given padding and dilation"
        )),
    }
}

/// Output shape [N, C, OH, OW] of a pooling op.
pub fn pool_shape(x: &Shape, p: &Pool2dAttrs) -> R<Vec<usize>> {
    let [n, c, h, w] = nchw(x)?;
    if p.kernel.contains(&0) || p.stride.contains(&0) {
        return Err("kernel and stride must be positive".into());
    }
    if p.padding[0] * 2 > p.kernel[0] || p.padding[1] * 2 > p.kernel[1] {
        return Err(format!(
            "padding {:?} must be at most half of kernel {:?}",
            p.padding, p.kernel
        ));
    }
    let oh = window_out(h, p.kernel[0], p.stride[0], p.padding[0], 1);
    let ow = window_out(w, p.kernel[1], p.stride[1], p.padding[1], 1);
    match (oh, ow) {
        (Some(oh), Some(ow)) => Ok(vec![n, c, oh, ow]),
        _ => Err(format!("window {:?} does not fit input {h}x{w}", p.kernel)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn f(d: &[usize]) -> TensorType {
        TensorType::f32(d.to_vec())
    }

    #[test]
    fn broadcasting() {
        assert_eq!(
            broadcast(&Shape::new([3, 1]), &Shape::new([4])).unwrap(),
            Shape::new([3, 4])
        );
        assert!(broadcast(&Shape::new([3]), &Shape::new([4])).is_err());
    }

    #[test]
    fn matmul_with_transposes_and_batch() {
        let out = infer(
            &Op::MatMul {
                transpose_a: true,
                transpose_b: false,
            },
            &[f(&[2, 5, 3]), f(&[5, 4])],
        )
        .unwrap();
        assert_eq!(out[0], f(&[2, 3, 4]));
        assert!(infer(
            &Op::MatMul {
                transpose_a: false,
                transpose_b: false
            },
            &[f(&[2, 3]), f(&[4, 5])]
        )
        .is_err());
    }

    #[test]
    fn conv_shapes_follow_pytorch() {
        let a = Conv2dAttrs {
            stride: [2, 2],
            padding: [3, 3],
            dilation: [1, 1],
            groups: 1,
        };
        let out = infer(&Op::Conv2d(a), &[f(&[1, 3, 224, 224]), f(&[64, 3, 7, 7])]).unwrap();
        assert_eq!(out[0], f(&[1, 64, 112, 112]));
        let bad = Conv2dAttrs { groups: 2, ..a };
        assert!(infer(&Op::Conv2d(bad), &[f(&[1, 3, 224, 224]), f(&[64, 3, 7, 7])]).is_err());
    }

    #[test]
    fn reductions_and_attributes() {
        let out = infer(
            &Op::ReduceSum {
                axes: vec![0, 2],
                keep_dims: false,
            },
            &[f(&[2, 3, 4])],
        )
        .unwrap();
        assert_eq!(out[0], f(&[3]));
        assert!(infer(
            &Op::ReduceSum {
                axes: vec![3],
                keep_dims: false
            },
            &[f(&[2, 3, 4])]
        )
        .is_err());
        assert!(infer(&Op::Transpose { perm: vec![0, 0] }, &[f(&[2, 3])]).is_err());
        assert!(infer(&Op::Softmax { axis: 2 }, &[f(&[2, 3])]).is_err());
    }
}
